#pragma once
// A device's communication stream (what NCCL's communication stream is on a GPU, here a CPU thread): the
// executor hands it each collective as its operand is ready and goes on computing; the stream runs them one at
// a time in issue order — the program's order, the same on every device, so groups meet as they would inline —
// and the executor waits for one only where its result, or its operand's buffer, is needed next.
//
// Handing a collective to another thread costs a wake-up or two, which a small collective does not repay on
// a loaded CPU: one below the stream's minimum size runs inline, on the device's own thread, when the stream is
// idle, and queues behind it otherwise — so every device still runs its collectives in program order.
// Which collectives go on the stream is the ExecutionPlan's stream policy (spmd/execution_plan.hpp).
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "partir/error.hpp"
#include "partir/runtime/comm/communicator.hpp"
#include "partir/spmd/execution_plan.hpp"

namespace partir {

// A backend whose collectives may run on a thread other than the device's own (one at a time), and that can
// end the job at once when a device fails while its stream is still inside a collective that the failed device
// will never finish (`abort`: the threads backend wakes every waiting device; MPI aborts the job).
template <class C>
concept StreamableCommunicator = Communicator<C> && requires(C& c, const std::string& why) {
  { c.streams_collectives() } -> std::convertible_to<bool>;
  c.abort(why);
};

class CommStream {
 public:
  // `abort(why)` ends what the stream waits for when the device fails (see StreamableCommunicator).
  explicit CommStream(std::function<void(const std::string&)> abort)
      : abort_(std::move(abort)), worker_([this] { loop(); }) {}
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;
  ~CommStream() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    worker_.join();
  }

  // Queues a task; returns its ticket (0, 1, ... in issue order).
  std::int64_t issue(std::function<void()> task) {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    changed_.notify_all();
    return issued_++;
  }
  bool done(std::int64_t ticket) {
    std::lock_guard lock(mutex_);
    return finished_ > ticket;
  }
  // Blocks until task `ticket` has run; rethrows what it (or an earlier task) threw.
  void wait(std::int64_t ticket) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return finished_ > ticket; });
    if (failure_) std::rethrow_exception(failure_);
  }
  // The device failed with `why`: if a task is still queued or running, ends what it waits for, so that
  // destroying the stream cannot hang.
  void abandon(const std::string& why) {
    {
      std::lock_guard lock(mutex_);
      if (finished_ == issued_) return;
    }
    abort_(why);
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        if (failure_) {  // an earlier collective failed: the rest are not started
          ++finished_;
          changed_.notify_all();
          continue;
        }
      }
      std::exception_ptr error;
      try {
        task();
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(mutex_);
      if (error && !failure_) failure_ = error;
      ++finished_;
      changed_.notify_all();
    }
  }

  std::function<void(const std::string&)> abort_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  std::int64_t issued_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts after the members it uses exist
};

}  // namespace partir
