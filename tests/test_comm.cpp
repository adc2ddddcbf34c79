// Communicator backends: the threads backend on 4 threads, against locally computed expectations.
#include <doctest/doctest.h>

#include <partir/runtime/comm/comm_stream.hpp>
#include <partir/runtime/comm/threads.hpp>

#include <atomic>
#include <numeric>
#include <chrono>
#include <thread>

#include "collective_checks.hpp"

using namespace partir;

static_assert(StreamableCommunicator<threads::Communicator>);

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

TEST_CASE("communication stream: tasks run one at a time in issue order; a failure stops the rest and is rethrown") {
  std::vector<int> ran;
  std::atomic<int> running = 0, overlapped = 0;
  int aborts = 0;
  {
    CommStream stream([&](const std::string&) { ++aborts; });
    std::vector<std::int64_t> tickets;
    for (int i = 0; i < 20; ++i)
      tickets.push_back(stream.issue([&, i] {
        overlapped += running++ > 0;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        ran.push_back(i);
        --running;
      }));
    CHECK(tickets.front() == 0);
    stream.wait(tickets.back());
    CHECK(stream.done(tickets.back()));
    std::vector<int> expect(20);
    std::iota(expect.begin(), expect.end(), 0);
    CHECK(ran == expect);
    CHECK(overlapped == 0);
    const auto failing = stream.issue([] { user_error("collective failed"); });
    const auto after = stream.issue([&] { ran.push_back(-1); });
    CHECK_THROWS_WITH_AS(stream.wait(after), "collective failed", UserError);
    CHECK(stream.done(failing));
    CHECK(ran.size() == 20);  // not started after the failure
    stream.abandon("nothing left to end");  // every task has finished: abort is not needed
  }
  CHECK(aborts == 0);
}

TEST_CASE("communication stream: a device failing with work on its stream aborts the world instead of hanging") {
  // Device 1's stream waits in an all_reduce that device 0 never joins; device 1 itself then fails. Abandoning
  // its stream must end the wait (threads::World::abort), so both devices end with device 1's error.
  auto run = [](threads::Communicator& c) {
    if (c.device() == 0) {  // never joins the collective
      float x = 0;
      c.all_reduce(Group{{0}}, &x, 1, DType::f32);
      return;
    }
    CommStream stream([&c](const std::string& why) { c.abort(why); });
    float x = 1;
    stream.issue([&] { c.all_reduce(Group{{0, 1}}, &x, 1, DType::f32); });
    try {
      user_error("device 1 failed while its stream waits");
    } catch (const std::exception& e) {
      stream.abandon(e.what());
      throw;
    }
  };
  CHECK_THROWS_WITH_AS(threads::run(2, run), "device 1 failed while its stream waits", UserError);
}
