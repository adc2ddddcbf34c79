// Communicator backends: the threads backend on 4 threads, against locally computed expectations.
#include <doctest/doctest.h>

#include <partir/runtime/threads.hpp>

#include <atomic>
#include <chrono>
#include <thread>

#include "collective_checks.hpp"

using namespace partir;

static_assert(Communicator<threads::Communicator>);

TEST_CASE("threads backend: every collective on rows, columns and all of a 2x2 grid") {
  std::atomic<long> wrong = 0;
  threads::run(4, [&](threads::Communicator& c) { wrong += collective_checks::check_all(c); });
  CHECK(wrong == 0);
}

TEST_CASE("threads backend: a failing device ends the run with its error instead of hanging") {
  auto failing = [](threads::Communicator& c) {
    if (c.device() == 2) user_error("bad input on device 2");
    float x = 1;
    c.all_reduce(Group{{0, 1, 2, 3}}, &x, 1, DType::f32);
  };
  CHECK_THROWS_WITH_AS(threads::run(4, failing), "bad input on device 2", UserError);
}

TEST_CASE("threads backend: after an abort, a group that met waits for its readers before anyone leaves") {
  // Device 1 is still copying from device 0's buffer when another device fails; device 0 must not leave the
  // collective (and free or reuse that buffer) until device 1 has finished. CI's ASan caught the race.
  threads::World world(3);
  std::atomic<bool> reading = false, zero_left = false;
  int zero_buffer = 7, copied = 0;
  std::thread zero([&] {
    try {
      world.exchange(Group{{0, 1}}, 0, &zero_buffer, nullptr, [](const auto&, const auto&) {});
    } catch (const UserError&) {
    }
    zero_left = true;
    zero_buffer = -1;  // what freeing the buffer would do
  });
  std::thread one([&] {
    try {
      world.exchange(Group{{0, 1}}, 1, nullptr, nullptr, [&](const auto& ins, const auto&) {
        reading = true;
        for (int waited = 0; waited < 100 && !zero_left; ++waited)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        copied = *static_cast<const int*>(ins[0]);
      });
    } catch (const UserError&) {
    }
  });
  while (!reading) std::this_thread::yield();
  world.abort();
  zero.join();
  one.join();
  CHECK(copied == 7);

  // A member that gave up waiting withdraws: a peer arriving later must not meet it (and read its buffer).
  threads::World late(2);
  late.abort();
  bool met = false;
  auto meet = [&](const auto&, const auto&) { met = true; };
  CHECK_THROWS_AS(late.exchange(Group{{0, 1}}, 0, nullptr, nullptr, meet), UserError);
  CHECK_THROWS_AS(late.exchange(Group{{0, 1}}, 1, nullptr, nullptr, meet), UserError);
  CHECK_FALSE(met);
}

TEST_CASE("threads backend: rejects an empty world") {
  CHECK_THROWS_WITH_AS(threads::World(0), "threads::World: needs at least 1 device, got 0", UserError);
}
