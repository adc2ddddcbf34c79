#pragma once
// The MPI backend: one rank per device; each group gets a sub-communicator from MPI_Comm_create_group, made
// by the group's members the first time they use it (collective over the group alone, so pipeline stages
// that run different programs never wait for each other's groups). Point-to-point sends are nonblocking on
// a copy of the data, so a send never waits for the stage that receives it. Collectives of groups within one
// host run through the host's shared memory (shared_memory.hpp); all_reduce, reduce_scatter and all_gather over
// groups spanning hosts run in two levels: shared memory inside each host, MPI between them.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the deprecated C++ bindings: not used, and they do not compile warning-free
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <list>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include "partir/runtime/comm/communicator.hpp"
#include "partir/runtime/comm/shared_memory.hpp"
#include "partir/runtime/kernels/kernel_threads.hpp"
#include "partir/runtime/kernels/malloc_policy.hpp"

namespace partir::mpi {

inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw UserError(std::string("mpi backend: ") + call + " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

inline MPI_Datatype datatype(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::bf16: case DType::f16: return MPI_UINT16_T;  // moved as words, summed by half_sum
  }
  return MPI_DATATYPE_NULL;
}

// MPI has no 16-bit float types: their sums are user ops on 16-bit words, adding in f32 and rounding each
// partial sum once, as the threads backend and NCCL do.
template <class H>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = plus(a[i], b[i]);
}

inline MPI_Op sum_op(DType t) {
  auto create = [](MPI_User_function* f) {
    MPI_Op op;
    check(MPI_Op_create(f, /*commute=*/1, &op), "MPI_Op_create");
    return op;  // never freed: ops live until MPI_Finalize
  };
  if (t == DType::bf16) {
    static const MPI_Op bf16_sum = create(&half_sum<bf16>);
    return bf16_sum;
  }
  if (t == DType::f16) {
    static const MPI_Op f16_sum = create(&half_sum<f16>);
    return f16_sum;
  }
  return MPI_SUM;
}

inline int count(std::int64_t n) {
  if (n > INT_MAX) user_error("mpi backend: a message of " + std::to_string(n) + " elements exceeds MPI's int count");
  return static_cast<int>(n);
}

// MPI_Init / MPI_Finalize for the process; errors come back as codes (turned into exceptions), not aborts.
class Session {
 public:
  Session(int& argc, char**& argv) {
    keep_freed_memory();
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      check(MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
      owns_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    // The ranks on this host share its cores (one BLAS thread each when there is a rank per core).
    MPI_Comm host;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host) == MPI_SUCCESS) {
      MPI_Comm_size(host, &local_);
      MPI_Comm_free(&host);
    }
    threads_.emplace(thread_budget() / std::max(1, local_));
  }
  ~Session() {
    if (owns_) MPI_Finalize();
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }
  int ranks_on_this_host() const { return local_; }

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1, local_ = 1;
  std::optional<KernelThreads> threads_;
};

// Runs fn() on this rank. If it throws, prints "error: rank R: <message>" and ends the whole job with
// MPI_Abort: the other ranks may be blocked in a collective this rank will never join, and MPI offers no
// way to cancel one, so returning (or MPI_Finalize) would hang them.
[[noreturn]] inline void abort_job(const std::string& why) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "error: rank %d: %s\n", rank, why.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return
}

template <class Fn>
void abort_on_error(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
}

class Communicator {
 public:
  // Collective over MPI_COMM_WORLD (the host's shared segment is mapped here): every rank constructs it.
  // shared_memory_chunk: bytes per rank and step of the shared-memory collectives (tests make it small).
  explicit Communicator(std::int64_t shared_memory_chunk = HostSharedMemory::default_chunk_bytes)
      : shm_(shared_memory_chunk) {
    MPI_Comm_rank(MPI_COMM_WORLD, &device_);
    MPI_Comm_size(MPI_COMM_WORLD, &devices_);
  }
  ~Communicator() {
    try {
      complete_sends(true);
    } catch (const UserError&) {  // a destructor reports nothing; the job is ending with an error already
    }
    for (auto& [key, comm] : comms_) MPI_Comm_free(&comm);
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int device() const { return device_; }
  int num_devices() const { return devices_; }

  void all_reduce(const Group& g, void* data, std::int64_t n, DType t) {
    const bool shared = shared_memory_ && (all_reduce_algorithm_ == AllReduceAlgorithm::automatic ||
                                           all_reduce_algorithm_ == AllReduceAlgorithm::shared_memory);
    if (shared && shm_.covers(g)) return shm_.all_reduce(g, data, n, t);
    if (shared)
      if (const auto levels = shm_.levels(g))  // sum inside each host, then across hosts on 1/m of the buffer
        return shm_.all_reduce(levels->local, data, n, t,
                               [&](void* part, std::int64_t len) { mpi_all_reduce(levels->across, part, len, t); });
    mpi_all_reduce(g, data, n, t);
  }
  // all_reduce through MPI alone: partir's ring or MPI_Allreduce, by size.
  void mpi_all_reduce(const Group& g, void* data, std::int64_t n, DType t) {
    if (use_ring_all_reduce(g.size(), n * size_of(t))) {
      switch (t) {
        case DType::f32: return ring_all_reduce(g, static_cast<float*>(data), n, t);
        case DType::f64: return ring_all_reduce(g, static_cast<double*>(data), n, t);
        case DType::i32: return ring_all_reduce(g, static_cast<std::int32_t*>(data), n, t);
        case DType::bf16: return ring_all_reduce(g, static_cast<bf16*>(data), n, t);
        case DType::f16: return ring_all_reduce(g, static_cast<f16*>(data), n, t);
      }
    }
    check(MPI_Allreduce(MPI_IN_PLACE, data, count(n), datatype(t), sum_op(t), comm(g)), "MPI_Allreduce");
  }
  void all_gather(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    if (use_shared_memory(g)) return shm_.all_gather(g, in, out, n, t);
    if (shared_memory_)
      if (const auto levels = shm_.levels(g)) return two_level_all_gather(*levels, in, out, n, t);
    check(MPI_Allgather(in, count(n), datatype(t), out, count(n), datatype(t), comm(g)), "MPI_Allgather");
  }
  void reduce_scatter(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    if (use_shared_memory(g)) return shm_.reduce_scatter(g, in, out, n, t);
    if (shared_memory_)
      if (const auto levels = shm_.levels(g)) return two_level_reduce_scatter(*levels, in, out, n, t);
    if (use_ring_reduce_scatter(g.size(), n * size_of(t))) {
      switch (t) {
        case DType::f32: return ring_reduce_scatter(g, static_cast<const float*>(in), static_cast<float*>(out), n, t);
        case DType::f64: return ring_reduce_scatter(g, static_cast<const double*>(in), static_cast<double*>(out), n, t);
        case DType::i32:
          return ring_reduce_scatter(g, static_cast<const std::int32_t*>(in), static_cast<std::int32_t*>(out), n, t);
        case DType::bf16: return ring_reduce_scatter(g, static_cast<const bf16*>(in), static_cast<bf16*>(out), n, t);
        case DType::f16: return ring_reduce_scatter(g, static_cast<const f16*>(in), static_cast<f16*>(out), n, t);
      }
    }
    check(MPI_Reduce_scatter_block(in, out, count(n), datatype(t), sum_op(t), comm(g)), "MPI_Reduce_scatter_block");
  }
  void all_to_all(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    if (use_shared_memory(g)) return shm_.all_to_all(g, in, out, n, t);
    check(MPI_Alltoall(in, count(n), datatype(t), out, count(n), datatype(t), comm(g)), "MPI_Alltoall");
  }
  void collective_permute(const Group& g, int to, const void* in, int from, void* out, std::int64_t n, DType t) {
    check(MPI_Sendrecv(in, to >= 0 ? count(n) : 0, datatype(t), to >= 0 ? to : MPI_PROC_NULL, 0, out,
                       from >= 0 ? count(n) : 0, datatype(t), from >= 0 ? from : MPI_PROC_NULL, 0, comm(g), MPI_STATUS_IGNORE),
          "MPI_Sendrecv (collective_permute)");
  }
  void barrier() {
    complete_sends(true);
    check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  }
  // A stream thread may run the collectives while the rank's own thread makes no MPI call (the Session asks for
  // MPI_THREAD_SERIALIZED); a rank that fails with work on its stream ends the job, as abort_on_error does.
  bool streams_collectives() const {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level >= MPI_THREAD_SERIALIZED;
  }
  [[noreturn]] void abort(const std::string& why) { abort_job(why); }

  void send(int peer, const void* data, std::int64_t n, DType t, std::int64_t tag) {
    complete_sends(false);
    const auto bytes = static_cast<std::size_t>(n * size_of(t));
    auto& s = sends_.emplace_back();
    s.data.assign(static_cast<const std::byte*>(data), static_cast<const std::byte*>(data) + bytes);
    check(MPI_Isend(s.data.data(), count(n), datatype(t), peer, wire_tag(tag), MPI_COMM_WORLD, &s.request), "MPI_Isend");
  }
  void send_in_place(int peer, const void* data, std::int64_t n, DType t, std::int64_t tag) {
    complete_sends(false);
    auto& s = sends_.emplace_back();
    check(MPI_Isend(data, count(n), datatype(t), peer, wire_tag(tag), MPI_COMM_WORLD, &s.request), "MPI_Isend");
  }
  void finish_sends() { complete_sends(true); }
  void recv(int peer, void* data, std::int64_t n, DType t, std::int64_t tag) {
    check(MPI_Recv(data, count(n), datatype(t), peer, wire_tag(tag), MPI_COMM_WORLD, MPI_STATUS_IGNORE), "MPI_Recv");
  }

  // How all_reduce runs: `automatic` takes the host's shared memory where the group allows (inside a host; in
  // two levels across hosts) and otherwise picks by size (use_ring_all_reduce); `ring`, `library` and
  // `shared_memory` force one, for tests and benchmarks. $PARTIR_MPI_ALL_REDUCE=auto|ring|mpi|shm sets it for a
  // process.
  enum class AllReduceAlgorithm { automatic, ring, library, shared_memory };
  static AllReduceAlgorithm parse_all_reduce_algorithm(std::string_view name) {
    if (name == "auto") return AllReduceAlgorithm::automatic;
    if (name == "ring") return AllReduceAlgorithm::ring;
    if (name == "mpi") return AllReduceAlgorithm::library;
    if (name == "shm") return AllReduceAlgorithm::shared_memory;
    user_error("PARTIR_MPI_ALL_REDUCE: unknown all_reduce algorithm '" + std::string(name) +
               "' (auto: shared memory within a host, else by size; ring: partir's reduce_scatter + all_gather ring; "
               "mpi: MPI_Allreduce; shm: the host's shared memory)");
  }
  void set_all_reduce_algorithm(AllReduceAlgorithm a) { all_reduce_algorithm_ = a; }

  // The shared-memory transport for collectives within a host: on unless $PARTIR_MPI_SHM=0 or the segment could
  // not be mapped (shared_memory().unavailable_reason() says why).
  void set_shared_memory(bool on) { shared_memory_ = on; }
  bool shared_memory_enabled() const { return shared_memory_; }
  HostSharedMemory& shared_memory() { return shm_; }
  bool use_shared_memory(const Group& g) const { return shared_memory_ && shm_.covers(g); }

  // Open MPI's MPI_Allreduce falls behind on buffers past the caches (64 MiB on 2 ranks: 190-210 ms, some days
  // 33 ms, against the ring's 17-28 ms), while from 1 to 4 MiB it is up to ~25% faster; they cross between 16
  // and 32 MiB on 2 and 4 ranks (`bench/collectives --backend mpi --algorithms` prints both per size). 16 MiB is
  // the default; a calibrated profile sets where they cross on this machine, per group size (tune_collectives).
  bool use_ring_all_reduce(int group_size, std::int64_t bytes) const {
    if (group_size == 1) return false;
    switch (all_reduce_algorithm_) {
      case AllReduceAlgorithm::ring: return true;
      case AllReduceAlgorithm::library: return false;
      case AllReduceAlgorithm::automatic: case AllReduceAlgorithm::shared_memory: break;
    }
    return bytes >= ring_all_reduce_from(group_size);
  }
  static constexpr std::int64_t default_ring_all_reduce_from = std::int64_t{16} << 20;
  std::int64_t ring_all_reduce_from(int group_size) const {
    auto it = ring_from_.find(group_size);
    return it != ring_from_.end() ? it->second : default_ring_all_reduce_from;
  }
  void set_ring_all_reduce_from(int group_size, std::int64_t bytes) { ring_from_[group_size] = bytes; }

  // Ring all_reduce in place, as NCCL's ring and Horovod run it: the buffer splits into k blocks (sizes
  // differing by at most one element, so any n works); k-1 steps of reduce-scatter leave member i with the sum
  // of block i+1, and k-1 steps of all-gather pass the sums around. Each member sends and receives 2(k-1)/k of
  // the buffer; every block is summed in one order, so all members end with identical bits.
  template <class T>
  void ring_all_reduce(const Group& g, T* data, std::int64_t n, DType t) {
    const int k = g.size(), me = g.index_of(device_);
    if (k == 1 || n == 0) return;
    MPI_Comm c = comm(g);
    const MPI_Datatype type = datatype(t);
    const int next = (me + 1) % k, prev = (me + k - 1) % k;
    auto block = [&](int b) { return ((b % k) + k) % k; };
    auto begin = [&](int b) { return n / k * b + std::min<std::int64_t>(b, n % k); };
    auto length = [&](int b) { return begin(b + 1) - begin(b); };
    constexpr std::int64_t segment = (std::int64_t{256} << 10) / sizeof(T);
    ring_scratch_.resize(static_cast<std::size_t>(std::min(length(0), segment)) * sizeof(T));
    T* received = reinterpret_cast<T*>(ring_scratch_.data());
    // Step s of both phases sends block b_send to `next` and receives block b_recv from `prev`, segment by
    // segment; every member makes as many calls as the longest block needs (some empty), so calls pair up.
    auto step = [&](int b_send, int b_recv, bool add) {
      const std::int64_t send_len = length(b_send), recv_len = length(b_recv);
      for (std::int64_t at = 0; at < length(0); at += segment) {
        const std::int64_t out = std::clamp<std::int64_t>(send_len - at, 0, segment);
        const std::int64_t in = std::clamp<std::int64_t>(recv_len - at, 0, segment);
        T* target = data + begin(b_recv) + at;
        check(MPI_Sendrecv(data + begin(b_send) + at, count(out), type, next, 0, add ? received : target, count(in), type,
                           prev, 0, c, MPI_STATUS_IGNORE),
              "MPI_Sendrecv (ring all_reduce)");
        if (add)
          for (std::int64_t i = 0; i < in; ++i) target[i] = plus(target[i], received[i]);
      }
    };
    for (int s = 0; s + 1 < k; ++s) step(block(me - s), block(me - s - 1), true);
    for (int s = 0; s + 1 < k; ++s) step(block(me + 1 - s), block(me - s), false);
  }

  // reduce_scatter and all_gather over a group spanning hosts, in two levels: within each host through shared
  // memory on the whole buffer, across hosts through MPI on 1/m of it (each of a host's m members carries the
  // blocks of the members at its position on every host). Blocks are arranged by (position on host, host) for
  // the host's level: block (i, a) is the group's block of host a's i-th member.
  void two_level_reduce_scatter(const HostSharedMemory::Levels& l, const void* in, void* out, std::int64_t n, DType t) {
    const std::size_t hosts = l.position.size(), block = static_cast<std::size_t>(n * size_of(t));
    const std::size_t m = l.position[0].size();
    level_scratch_.resize(block * hosts * (m + 1));
    std::byte* arranged = level_scratch_.data();
    std::byte* host_sums = arranged + block * hosts * m;  // this member's h blocks summed over its host
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t a = 0; a < hosts; ++a)
        std::memcpy(arranged + (i * hosts + a) * block,
                    static_cast<const std::byte*>(in) + static_cast<std::size_t>(l.position[a][i]) * block, block);
    shm_.reduce_scatter(l.local, arranged, host_sums, n * static_cast<std::int64_t>(hosts), t);
    reduce_scatter(l.across, host_sums, out, n, t);
  }
  void two_level_all_gather(const HostSharedMemory::Levels& l, const void* in, void* out, std::int64_t n, DType t) {
    const std::size_t hosts = l.position.size(), block = static_cast<std::size_t>(n * size_of(t));
    const std::size_t m = l.position[0].size();
    level_scratch_.resize(block * hosts * (m + 1));
    std::byte* arranged = level_scratch_.data();
    std::byte* across = arranged + block * hosts * m;  // the blocks of the members at this position
    all_gather(l.across, in, across, n, t);
    shm_.all_gather(l.local, across, arranged, n * static_cast<std::int64_t>(hosts), t);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t a = 0; a < hosts; ++a)
        std::memcpy(static_cast<std::byte*>(out) + static_cast<std::size_t>(l.position[a][i]) * block,
                    arranged + (i * hosts + a) * block, block);
  }

  // Open MPI's MPI_Reduce_scatter_block measured 2-3x below the ring from 1 MiB up on this machine, and below
  // it at every size for pairs; for small blocks in larger groups its fewer steps win
  // (`bench/collectives --backend mpi --algorithms` prints the figures).
  static bool use_ring_reduce_scatter(int group_size, std::int64_t block_bytes) {
    return group_size == 2 || block_bytes * group_size >= (std::int64_t{1} << 20);
  }

  // Ring reduce-scatter, as NCCL and Gloo run it: in step s each member passes its running sum of block
  // (i-s-1) to the next member and adds its own block (i-s-2) to what the previous one passed; after k-1
  // steps member i holds the sum of block i, having sent and received (k-1)/k of the buffer once. `out`
  // carries the running sum; blocks travel in segments so that each received segment is added while it
  // is still in cache.
  template <class T>
  void ring_reduce_scatter(const Group& g, const T* in, T* out, std::int64_t n, DType t) {
    const int k = g.size(), me = g.index_of(device_);
    if (k == 1) {
      std::copy_n(in, n, out);
      return;
    }
    constexpr std::int64_t segment = (std::int64_t{256} << 10) / sizeof(T);
    MPI_Comm c = comm(g);
    const MPI_Datatype type = datatype(t);
    const int next = (me + 1) % k, prev = (me + k - 1) % k;
    ring_scratch_.resize(static_cast<std::size_t>(std::min(n, segment)) * sizeof(T));
    const T* received = reinterpret_cast<const T*>(ring_scratch_.data());
    for (int s = 0; s + 1 < k; ++s) {
      const T* sending = s == 0 ? in + static_cast<std::int64_t>((me + k - 1) % k) * n : out;
      const T* own = in + static_cast<std::int64_t>(((me - s - 2) % k + k) % k) * n;
      for (std::int64_t at = 0; at < n; at += segment) {
        const std::int64_t len = std::min(segment, n - at);
        check(MPI_Sendrecv(sending + at, count(len), type, next, 0, ring_scratch_.data(), count(len), type, prev, 0, c,
                           MPI_STATUS_IGNORE),
              "MPI_Sendrecv (ring reduce_scatter)");
        for (std::int64_t i = 0; i < len; ++i) out[at + i] = plus(own[at + i], received[i]);
      }
    }
  }

 private:
  MPI_Comm comm(const Group& g) {
    if (is_world(g)) return MPI_COMM_WORLD;
    auto it = comms_.find(g.devices);
    if (it != comms_.end()) return it->second;
    MPI_Group world, members;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_incl(world, g.size(), g.devices.data(), &members);
    MPI_Comm c;
    check(MPI_Comm_create_group(MPI_COMM_WORLD, members, wire_tag(-1), &c), "MPI_Comm_create_group");
    MPI_Group_free(&members);
    MPI_Group_free(&world);
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    return comms_[g.devices] = c;
  }

  // Tags above MPI_TAG_UB (at least 32767) wrap: a recv matches the oldest send with its tag from its peer.
  // Tag -1 is the largest, kept for making groups.
  static int wire_tag(std::int64_t tag) {
    static const std::int64_t bound = [] {
      int* ub = nullptr;
      int flag = 0;
      MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
      return flag && ub ? std::int64_t{*ub} + 1 : std::int64_t{32768};
    }();
    return static_cast<int>(tag < 0 ? bound - 1 : tag % (bound - 1));
  }

  // Frees the copies of sends that have completed (all of them, waiting, when `wait`).
  void complete_sends(bool wait) {
    std::erase_if(sends_, [&](Send& s) {
      int done = 0;
      if (wait) check(MPI_Wait(&s.request, MPI_STATUS_IGNORE), "MPI_Wait (send)"), done = 1;
      else check(MPI_Test(&s.request, &done, MPI_STATUS_IGNORE), "MPI_Test (send)");
      return done != 0;
    });
  }

  bool is_world(const Group& g) const {
    if (g.size() != devices_) return false;
    for (int i = 0; i < devices_; ++i)
      if (g.devices[static_cast<std::size_t>(i)] != i) return false;
    return true;
  }

  int device_ = 0, devices_ = 1;
  AllReduceAlgorithm all_reduce_algorithm_ = [] {
    const char* env = std::getenv("PARTIR_MPI_ALL_REDUCE");
    return env && *env ? parse_all_reduce_algorithm(env) : AllReduceAlgorithm::automatic;
  }();
  bool shared_memory_ = [] {
    const char* env = std::getenv("PARTIR_MPI_SHM");
    return !(env && std::string_view(env) == "0");
  }();
  HostSharedMemory shm_;
  std::map<int, std::int64_t> ring_from_;  // by group size; others: default_ring_all_reduce_from
  std::map<std::vector<int>, MPI_Comm> comms_;
  std::vector<std::byte> ring_scratch_;  // one received segment
  std::vector<std::byte> level_scratch_;  // a two-level collective's arranged blocks
  struct Send {
    std::vector<std::byte> data;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  std::list<Send> sends_;  // in flight (std::list: a request's address stays valid)
};

}  // namespace partir::mpi
