#pragma once
// Result buffers freed by a run, kept on this thread for the next runs. Touching fresh memory costs a page
// fault per 4 KiB (about 15 us on the project's VM: 60 ms for a 16 MiB gradient, more than its arithmetic),
// and glibc hands large freed blocks back to the system; a training step frees and allocates the same
// shapes every step. Only the buffers freed by the latest run are kept, so the cache never holds more
// than one run's frees.
#include <cstdint>
#include <map>
#include <utility>
#include <variant>

#include "partir/runtime/kernels/array.hpp"

namespace partir::kernels {

class BufferCache {
 public:
  // An Array of `type`: a cached buffer (stale contents) when one fits exactly, else a new zeroed one.
  Array take(const TensorType& type) {
    auto it = free_.find({type.dtype, type.elements()});
    if (it == free_.end()) return Array(type);
    Array out = std::visit([&](auto& v) { return Array(type.shape, std::move(v)); }, it->second.storage);
    bytes_ -= out.bytes();
    free_.erase(it);
    return out;
  }
  void give(Array&& array) {
    if (array.bytes() < min_bytes) return;  // small blocks: malloc recycles them well
    if (array.is_husk()) return;  // its buffer moved on (a reshape, a group or an all_reduce took it)
    bytes_ += array.bytes();
    free_.emplace(std::pair{array.dtype(), array.size()}, Entry{std::move(array.storage()), run_});
  }
  // Drops the buffers that were freed before the current run and not taken again in it.
  void end_run() {
    std::erase_if(free_, [&](const auto& entry) {
      if (entry.second.run == run_) return false;
      bytes_ -= entry.first.second * size_of(entry.first.first);
      return true;
    });
    ++run_;
  }
  void clear() {
    free_.clear();
    bytes_ = 0;
  }
  std::int64_t bytes() const { return bytes_; }

 private:
  static constexpr std::int64_t min_bytes = 4096;
  struct Entry {
    Array::Storage storage;
    std::uint64_t run;
  };
  std::multimap<std::pair<DType, std::int64_t>, Entry> free_;
  std::int64_t bytes_ = 0;
  std::uint64_t run_ = 0;
};

inline BufferCache& buffer_cache() {
  thread_local BufferCache cache;
  return cache;
}

}  // namespace partir::kernels
