#pragma once
// A caching pool of device memory. cudaMalloc and cudaFree synchronize the device and cost tens to hundreds
// of microseconds each, and a training step frees and allocates the same shapes every step, so freed blocks
// are kept by size class and handed out again. Blocks come from cudaMalloc only (never managed memory: its
// page migration would make step times depend on access history).
//
// The executor uses one pool per (thread, GPU), with every kernel, copy and collective on the
// communicator's one stream: a block given back while work that uses it is still queued is only reused by
// work queued after it on the same stream, so reuse needs no synchronization.
//
// plan_pool() replays a plan's allocations against a pool with a counting allocator (no memory): the
// blocks a run will hold at its peak, known before the run, so the executor can reserve them up front and
// say plainly when a program does not fit in the device's free memory.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <vector>

#include "partir/runtime/gpu/cuda_error.hpp"
#include "partir/spmd/execution_plan.hpp"

namespace partir::gpu {

// Bytes of the block that serves a request: 512-byte steps below 1 MiB; above, steps of 1/8 of the power of
// two below the size, so a block can serve nearby sizes while wasting at most 12.5%.
inline std::int64_t size_class(std::int64_t bytes) {
  if (bytes <= 512) return 512;
  if (bytes < (std::int64_t{1} << 20)) return (bytes + 511) / 512 * 512;
  std::int64_t power = 1;
  while (power * 2 <= bytes) power *= 2;
  const std::int64_t step = power / 8;
  return (bytes + step - 1) / step * step;
}

struct CudaAllocator {
  void* allocate(std::int64_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, static_cast<std::size_t>(bytes)) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  }
  void deallocate(void* p) { cudaFree(p); }
  std::string describe() const {
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      cudaGetLastError();
      return "";
    }
    return "; the device has " + std::to_string(free >> 20) + " MiB free of " + std::to_string(total >> 20) + " MiB";
  }
};

// Allocator: allocate(bytes) -> pointer or nullptr, deallocate(pointer), describe() -> text for errors.
template <class Allocator>
class BasicPool {
 public:
  explicit BasicPool(Allocator allocator = {}) : allocator_(std::move(allocator)) {}
  ~BasicPool() { release(); }
  BasicPool(const BasicPool&) = delete;
  BasicPool& operator=(const BasicPool&) = delete;

  // A block of at least `bytes`: a cached one of the same size class, else a new one (after giving the
  // cache back to the allocator if the first attempt fails).
  void* take(std::int64_t bytes) {
    const std::int64_t size = size_class(bytes);
    auto it = free_.find(size);
    void* p = nullptr;
    if (it != free_.end()) {
      p = it->second;
      free_.erase(it);
      cached_ -= size;
    } else {
      p = allocator_.allocate(size);
      if (!p) {
        release();
        p = allocator_.allocate(size);
      }
      if (!p)
        user_error("gpu: out of device memory: a buffer of " + std::to_string(bytes) + " bytes does not fit next to the " +
                   std::to_string(in_use_) + " bytes in use" + allocator_.describe());
      ++allocations_;
      held_ += size;
    }
    in_use_ += size;
    peak_in_use_ = std::max(peak_in_use_, in_use_);
    return p;
  }

  void give(void* p, std::int64_t bytes) {
    if (!p) return;
    const std::int64_t size = size_class(bytes);
    free_.emplace(size, p);
    cached_ += size;
    in_use_ -= size;
  }

  // Makes sure the cache holds at least these blocks (sizes in bytes), allocating what is missing.
  void reserve(const std::vector<std::int64_t>& blocks) {
    std::map<std::int64_t, std::int64_t> wanted;
    for (auto b : blocks) ++wanted[size_class(b)];
    for (auto [size, n] : wanted) {
      for (auto have = static_cast<std::int64_t>(free_.count(size)); have < n; ++have) {
        void* p = allocator_.allocate(size);
        if (!p)
          user_error("gpu: the liveness plan needs " + std::to_string(bytes_of(blocks)) +
                     " bytes of device memory at its peak, which do not fit" + allocator_.describe());
        ++allocations_;
        held_ += size;
        cached_ += size;
        free_.emplace(size, p);
      }
    }
  }

  // Gives every cached block back to the allocator; blocks in use stay valid.
  void release() {
    for (auto& [size, p] : free_) {
      allocator_.deallocate(p);
      held_ -= size;
    }
    free_.clear();
    cached_ = 0;
  }

  std::int64_t bytes_in_use() const { return in_use_; }
  std::int64_t bytes_cached() const { return cached_; }
  std::int64_t bytes_held() const { return held_; }  // in use + cached: what the allocator has handed out
  std::int64_t peak_bytes_in_use() const { return peak_in_use_; }
  std::int64_t allocations() const { return allocations_; }  // calls to the allocator so far
  const Allocator& allocator() const { return allocator_; }

  static std::int64_t bytes_of(const std::vector<std::int64_t>& blocks) {
    std::int64_t total = 0;
    for (auto b : blocks) total += size_class(b);
    return total;
  }

 private:
  Allocator allocator_;
  std::multimap<std::int64_t, void*> free_;
  std::int64_t in_use_ = 0, cached_ = 0, held_ = 0, peak_in_use_ = 0, allocations_ = 0;
};

using DevicePool = BasicPool<CudaAllocator>;

// Hands out distinct fake addresses and remembers the sizes it was asked for: plan_pool's allocator, and
// the host-side tests'.
struct CountingAllocator {
  std::vector<std::int64_t> blocks;
  std::int64_t limit = -1;  // total bytes it agrees to hand out; -1: no limit
  std::int64_t handed = 0;
  std::uintptr_t next = 4096;
  void* allocate(std::int64_t bytes) {
    if (limit >= 0 && handed + bytes > limit) return nullptr;
    blocks.push_back(bytes);
    handed += bytes;
    const auto p = next;
    next += static_cast<std::uintptr_t>(bytes);
    return reinterpret_cast<void*>(p);
  }
  void deallocate(void*) {}
  std::string describe() const { return limit >= 0 ? "; the limit is " + std::to_string(limit) + " bytes" : ""; }
};

struct PoolPlan {
  std::vector<std::int64_t> blocks;  // size classes of the blocks a run allocates, in order
  std::int64_t bytes = 0;            // their sum: the device memory the run holds at its peak
  std::int64_t peak_in_use = 0;      // the most bytes (in size classes) in use at once
};

// The blocks one execution of a stage's plan takes from an empty pool: every input uploaded first and held to
// the end, each op's result taken before the values that die at that op (the plan's frees) are given back (the
// executor's order). The transient scratch of collectives, dot_general and split reductions is not part of the
// plan; it comes from the pool as it is needed, usually from blocks already cached.
inline PoolPlan plan_pool(const StagePlan& stage) {
  const SpmdProgram& p = *stage.program;
  BasicPool<CountingAllocator> pool;
  std::vector<void*> held(static_cast<std::size_t>(p.size()), nullptr);
  for (const auto& b : p.inputs()) {
    auto& slot = held[static_cast<std::size_t>(b.value)];
    if (!slot) slot = pool.take(p.type(b.value).bytes());
  }
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!detail::is_program_input(p.op(v)) && stage.fusion.runs_at(v))
      held[static_cast<std::size_t>(v)] = pool.take(p.type(v).bytes());
    for (auto dead : stage.frees()[static_cast<std::size_t>(v)]) {
      if (detail::is_program_input(p.op(dead))) continue;  // inputs stay to the end
      pool.give(held[static_cast<std::size_t>(dead)], p.type(dead).bytes());
      held[static_cast<std::size_t>(dead)] = nullptr;
    }
  }
  PoolPlan plan;
  plan.blocks = pool.allocator().blocks;
  plan.bytes = pool.bytes_held();  // nothing was released: every block the run made is still held
  plan.peak_in_use = pool.peak_bytes_in_use();
  return plan;
}

// The plan of the ExecutionPlan the GPU executor makes for p (unfused).
inline PoolPlan plan_pool(const SpmdProgram& p) {
  return plan_pool(ExecutionPlan::borrowing(p, {.fuse = false}).stages().front());
}

}  // namespace partir::gpu
