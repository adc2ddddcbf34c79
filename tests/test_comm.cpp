// Communicator backends: the threads backend on 4 threads, against locally computed expectations.
#include <doctest/doctest.h>

#include <partir/runtime/threads.hpp>

#include <atomic>

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

TEST_CASE("threads backend: rejects an empty world") {
  CHECK_THROWS_WITH_AS(threads::World(0), "threads::World: needs at least 1 device, got 0", UserError);
}
