#pragma once
// The threads backend: N devices as N threads of one process exchanging data through shared memory.
// Every member of a group reduces in group order, so all members get bitwise-identical results.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

#include "partir/runtime/comm/communicator.hpp"
#include "partir/runtime/kernels/kernel_threads.hpp"
#include "partir/runtime/kernels/malloc_policy.hpp"

namespace partir::threads {

// Shared state of the N device threads: one rendezvous per group, reused collective after collective.
class World {
 public:
  explicit World(int devices) : devices_(devices) {
    if (devices < 1) user_error("threads::World: needs at least 1 device, got " + std::to_string(devices));
    keep_freed_memory();
  }
  int size() const { return devices_; }

  // Publishes this member's pointers, waits for the whole group, runs fn on all members' pointers, then
  // waits again so no member reuses its buffers while a peer still reads them. After an abort, a member
  // still waiting for its group gives up; a group that met runs fn and meets again before anyone leaves,
  // since its members read each other's buffers.
  void exchange(const Group& g, int member, const void* in, void* out,
                const std::function<void(const std::vector<const void*>&, const std::vector<void*>&)>& fn) {
    Rendezvous& r = rendezvous(g);
    std::unique_lock lock(r.mutex);
    r.ins[static_cast<std::size_t>(member)] = in;
    r.outs[static_cast<std::size_t>(member)] = out;
    if (!arrive(r, lock, /*abortable=*/true))
      throw UserError("threads backend: another device failed; abandoning collective");
    auto ins = r.ins;
    auto outs = r.outs;
    lock.unlock();
    std::exception_ptr failure;
    try {
      fn(ins, outs);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    arrive(r, lock, /*abortable=*/false);
    lock.unlock();
    if (failure) std::rethrow_exception(failure);
    if (aborted_) throw UserError("threads backend: another device failed; abandoning collective");
  }

  // Point to point: a send copies into the (from, to, tag) mailbox and returns; a recv waits for it.
  void post(int from, int to, std::int64_t tag, const void* data, std::size_t bytes) {
    std::vector<std::byte> message(bytes);
    std::memcpy(message.data(), data, bytes);
    std::lock_guard lock(mail_mutex_);
    mail_[{from, to, tag}].push_back(std::move(message));
    mail_cv_.notify_all();
  }
  void take(int from, int to, std::int64_t tag, void* data, std::size_t bytes) {
    std::unique_lock lock(mail_mutex_);
    const std::tuple<int, int, std::int64_t> key{from, to, tag};
    mail_cv_.wait(lock, [&] { return aborted_ || !mail_[key].empty(); });
    if (aborted_) throw UserError("threads backend: another device failed; abandoning recv");
    auto& queue = mail_[key];
    if (queue.front().size() != bytes)
      internal_error("threads backend: recv of " + std::to_string(bytes) + " bytes from device " + std::to_string(from) +
                     " (tag " + std::to_string(tag) + ") matched a send of " + std::to_string(queue.front().size()));
    std::memcpy(data, queue.front().data(), bytes);
    queue.pop_front();
  }

  // Wakes every waiting device with an error so one failing thread cannot hang the others.
  void abort() {
    std::lock_guard guard(table_mutex_);
    aborted_ = true;
    for (auto& [key, r] : groups_) {
      std::lock_guard lock(r.mutex);
      r.cv.notify_all();
    }
    std::lock_guard mail(mail_mutex_);
    mail_cv_.notify_all();
  }

 private:
  struct Rendezvous {
    std::mutex mutex;
    std::condition_variable cv;
    int arrived = 0;
    std::uint64_t generation = 0;
    std::vector<const void*> ins;
    std::vector<void*> outs;
  };

  Rendezvous& rendezvous(const Group& g) {
    std::lock_guard guard(table_mutex_);
    auto [it, fresh] = groups_.try_emplace(g.devices);
    if (fresh) {
      it->second.ins.resize(g.devices.size());
      it->second.outs.resize(g.devices.size());
    }
    return it->second;
  }

  // Returns whether the whole group arrived; false only when abortable and abort() released the wait first.
  bool arrive(Rendezvous& r, std::unique_lock<std::mutex>& lock, bool abortable) {
    const auto generation = r.generation;
    if (++r.arrived == static_cast<int>(r.ins.size())) {
      r.arrived = 0;
      ++r.generation;
      r.cv.notify_all();
      return true;
    }
    r.cv.wait(lock, [&] { return r.generation != generation || (abortable && aborted_); });
    if (r.generation != generation) return true;
    --r.arrived;  // withdrawn: a late peer must not meet a member that has left
    return false;
  }

  int devices_;
  std::mutex table_mutex_;
  std::map<std::vector<int>, Rendezvous> groups_;  // std::map: node addresses stay valid
  std::atomic<bool> aborted_ = false;
  std::mutex mail_mutex_;
  std::condition_variable mail_cv_;
  std::map<std::tuple<int, int, std::int64_t>, std::deque<std::vector<std::byte>>> mail_;
};

class Communicator {
 public:
  Communicator(World& world, int device) : world_(&world), device_(device) {}
  int device() const { return device_; }
  int num_devices() const { return world_->size(); }

  // Reduce-scatter then all-gather through shared memory: member i sums block i of every member's data
  // into its scratch, then every member copies all the sums. Each member reads about 2n elements, not k*n.
  void all_reduce(const Group& g, void* data, std::int64_t n, DType t) {
    const int me = g.index_of(device_);
    const std::int64_t k = g.size(), block = (n + k - 1) / k, first = std::min<std::int64_t>(me * block, n),
                       count = std::min<std::int64_t>(block, n - first);
    const auto width = static_cast<std::size_t>(size_of(t));
    const auto partial = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(block) * width);
    world_->exchange(g, me, data, partial.get(), [&](const auto& ins, const auto&) {
      reduce_blocks(ins, static_cast<std::size_t>(first) * width, partial.get(), count, t);
    });
    world_->exchange(g, me, partial.get(), nullptr, [&](const auto& ins, const auto&) {
      for (std::int64_t i = 0; i < k; ++i) {
        const std::int64_t from = std::min<std::int64_t>(i * block, n), len = std::min<std::int64_t>(block, n - from);
        if (len > 0)
          std::memcpy(static_cast<std::byte*>(data) + static_cast<std::size_t>(from) * width,
                      ins[static_cast<std::size_t>(i)], static_cast<std::size_t>(len) * width);
      }
    });
  }
  void all_gather(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    const auto bytes = static_cast<std::size_t>(n * size_of(t));
    world_->exchange(g, g.index_of(device_), in, out, [&](const auto& ins, const auto&) {
      for (std::size_t i = 0; i < ins.size(); ++i) std::memcpy(static_cast<std::byte*>(out) + i * bytes, ins[i], bytes);
    });
  }
  void reduce_scatter(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    const int me = g.index_of(device_);
    world_->exchange(g, me, in, out, [&](const auto& ins, const auto&) {
      reduce_blocks(ins, static_cast<std::size_t>(me * n * size_of(t)), out, n, t);
    });
  }
  void all_to_all(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    const int me = g.index_of(device_);
    const auto bytes = static_cast<std::size_t>(n * size_of(t));
    world_->exchange(g, me, in, out, [&](const auto& ins, const auto&) {
      for (std::size_t i = 0; i < ins.size(); ++i)
        std::memcpy(static_cast<std::byte*>(out) + i * bytes,
                    static_cast<const std::byte*>(ins[i]) + static_cast<std::size_t>(me) * bytes, bytes);
    });
  }
  // Each member copies from its source.
  void collective_permute(const Group& g, int /*to*/, const void* in, int from, void* out, std::int64_t n, DType t) {
    world_->exchange(g, g.index_of(device_), in, out, [&](const auto& ins, const auto&) {
      if (from >= 0) std::memcpy(out, ins[static_cast<std::size_t>(from)], static_cast<std::size_t>(n * size_of(t)));
    });
  }
  void send(int peer, const void* data, std::int64_t n, DType t, std::int64_t tag) {
    world_->post(device_, peer, tag, data, static_cast<std::size_t>(n * size_of(t)));
  }
  void recv(int peer, void* data, std::int64_t n, DType t, std::int64_t tag) {
    world_->take(peer, device_, tag, data, static_cast<std::size_t>(n * size_of(t)));
  }
  // Any thread may run this device's collectives (comm_stream.hpp); abort() wakes every device waiting in one.
  bool streams_collectives() const { return true; }
  void abort(const std::string& /*why: the failing device's exception carries it*/) { world_->abort(); }
  void barrier() {
    Group all;
    for (int d = 0; d < world_->size(); ++d) all.devices.push_back(d);
    world_->exchange(all, device_, nullptr, nullptr, [](const auto&, const auto&) {});
  }

 private:
  // out = sum over members of their block at byte offset `offset`, in member order (the same order on every
  // member, so all of them get bitwise-identical sums).
  static void reduce_blocks(const std::vector<const void*>& ins, std::size_t offset, void* out, std::int64_t n,
                            DType t) {
    auto run = [&](auto zero) {
      using T = decltype(zero);
      T* o = static_cast<T*>(out);
      auto block = [&](std::size_t member) {
        return reinterpret_cast<const T*>(static_cast<const std::byte*>(ins[member]) + offset);
      };
      if constexpr (is_half_type<T>) {  // summed in f32, rounded once
        for (std::int64_t i = 0; i < n; ++i) {
          float sum = static_cast<float>(block(0)[i]);
          for (std::size_t m = 1; m < ins.size(); ++m) sum += static_cast<float>(block(m)[i]);
          o[i] = T(sum);
        }
      } else {
        std::memcpy(o, block(0), static_cast<std::size_t>(n) * sizeof(T));
        for (std::size_t m = 1; m < ins.size(); ++m) {
          const T* b = block(m);
          for (std::int64_t i = 0; i < n; ++i) o[i] += b[i];
        }
      }
    };
    switch (t) {
      case DType::f32: run(0.f); break;
      case DType::f64: run(0.0); break;
      case DType::i32: run(std::int32_t{0}); break;
      case DType::bf16: run(bf16{}); break;
      case DType::f16: run(f16{}); break;
    }
  }

  World* world_;
  int device_;
};

// Runs fn(communicator) on `devices` threads and rethrows the first failure after every thread has ended.
template <class Fn>
void run(int devices, Fn&& fn) {
  World world(devices);
  const auto threads = KernelThreads::shared_by(devices);  // the devices share the cores
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(devices));
  std::vector<std::thread> pool;
  for (int d = 0; d < devices; ++d)
    pool.emplace_back([&, d] {
      try {
        Communicator c(world, d);
        fn(c);
      } catch (...) {
        errors[static_cast<std::size_t>(d)] = std::current_exception();
        world.abort();
      }
    });
  for (auto& t : pool) t.join();
  // The first device's own error is the cause; later ones are usually "another device failed".
  for (auto& e : errors)
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const UserError& u) {
        if (std::string(u.what()).find("another device failed") == std::string::npos) throw;
      }
    }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace partir::threads
