#pragma once
// Collectives among the ranks of one host through memory they all map, as DeepSpeed's CPU all_reduce runs
// them (deepspeedai/DeepSpeed#5391): Open MPI's point-to-point path copies every message twice (into its own
// shared FIFO, out of it) and hands it over in fragments; here each rank copies its contribution once into its
// own slot of a shared segment, every rank reduces its 1/k slice reading the others' slots, and each reads the
// others' results: a 16 MiB all_reduce on 2 ranks here takes 1.3-1.5 ms against Open MPI's 4.0-4.4 ms
// (docs/cluster.md).
//
// The segment is a memfd (an anonymous file) that one rank per host creates and the others open through
// /proc/<pid>/fd: it has no name, so no exit path (an exception, MPI_Abort, SIGKILL) can leave anything in
// /dev/shm, and it is not bounded by /dev/shm's size (64 MiB in a default Docker container). Where the files of
// another process cannot be opened (a container without /proc, another user), the transport is unavailable
// and the MPI paths run: `unavailable_reason()` says why.
//
// Synchronisation needs no locks: flag[a][b] counts the barriers rank a has passed in collectives shared with
// rank b (one cache line each, written by a alone). Members of a group run its collectives in the same order
// (SPMD), so a and b count their shared barriers alike whatever other groups each belongs to: b waits for
// flag[a][b] to reach its own count. A rank that never arrives ends the job through MPI_Abort (abort_on_error),
// which mpirun turns into the end of every rank, spinning ones included.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <fcntl.h>
#include <mpi.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "partir/ir/dtype.hpp"
#include "partir/ir/half.hpp"
#include "partir/runtime/comm/communicator.hpp"

namespace partir::mpi {

class HostSharedMemory {
 public:
  // Bytes of one step's staging per rank (the slot holds two, so that a step's copies in overlap the previous
  // step's reads): small enough that what one rank writes is still in cache when the others read it. On 2 ranks
  // here (`bench/collectives --backend mpi`, 256 KiB-64 MiB) 256 KiB beat 128 KiB and 512 KiB by 5-15%, and
  // 1 MiB halved all_gather's bandwidth at 4 MiB.
  static constexpr std::int64_t default_chunk_bytes = std::int64_t{256} << 10;

  // Collective over MPI_COMM_WORLD: every rank constructs it.
  explicit HostSharedMemory(std::int64_t chunk_bytes = default_chunk_bytes) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
    MPI_Comm host;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host) != MPI_SUCCESS)
      user_error("mpi backend: MPI_Comm_split_type (the ranks of this host) failed");
    MPI_Comm_rank(host, &local_);
    MPI_Comm_size(host, &locals_);
    // Which host each rank is on (named by its first rank), and its index there.
    int first = rank_;
    MPI_Bcast(&first, 1, MPI_INT, 0, host);
    host_of_.resize(static_cast<std::size_t>(ranks_));
    local_index_.resize(host_of_.size());
    MPI_Allgather(&first, 1, MPI_INT, host_of_.data(), 1, MPI_INT, MPI_COMM_WORLD);
    MPI_Allgather(&local_, 1, MPI_INT, local_index_.data(), 1, MPI_INT, MPI_COMM_WORLD);
    half_bytes_ = std::max<std::int64_t>(chunk_bytes, std::int64_t{256} * locals_) / 64 * 64;
    slot_bytes_ = 2 * half_bytes_;
    flags_bytes_ = std::int64_t{64} * locals_ * locals_;
    if (locals_ > 1) map(host);
    MPI_Comm_free(&host);
    // Every rank must choose the same paths: a host without its segment leaves the transport off everywhere.
    int ok = locals_ == 1 || base_ ? 1 : 0, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok && base_) {
      munmap(base_, static_cast<std::size_t>(bytes_));
      base_ = nullptr;
      why_unavailable_ = "a rank (of this host or another) could not map its host's segment; that rank's "
                         "unavailable_reason() says why";
    }
    passed_.assign(static_cast<std::size_t>(locals_), 0);
  }
  ~HostSharedMemory() {
    if (base_) munmap(base_, static_cast<std::size_t>(bytes_));
  }
  HostSharedMemory(const HostSharedMemory&) = delete;
  HostSharedMemory& operator=(const HostSharedMemory&) = delete;

  bool available() const { return base_ != nullptr; }
  const std::string& unavailable_reason() const { return why_unavailable_; }
  int ranks_on_this_host() const { return locals_; }
  std::int64_t chunk_bytes() const { return half_bytes_; }
  bool same_host(int a, int b) const {
    return host_of_[static_cast<std::size_t>(a)] == host_of_[static_cast<std::size_t>(b)];
  }
  // Whether g's collectives can run here: two or more members, all on this host, and the segment mapped.
  bool covers(const Group& g) const {
    if (!available() || g.size() < 2) return false;
    return std::all_of(g.devices.begin(), g.devices.end(), [&](int d) { return same_host(d, rank_); });
  }

  // A group spanning hosts as the two levels of a hierarchical collective: `local`, its members on this host;
  // `across`, the members at this rank's position among their host's members, one per host, in the order the
  // hosts first appear in the group; `position[a][i]`, the group position of host a's i-th member. Only for
  // groups with the same number (>= 2) of members on each of two or more hosts; otherwise nullopt.
  struct Levels {
    Group local, across;
    std::vector<std::vector<int>> position;
  };
  std::optional<Levels> levels(const Group& g) const {
    if (!available() || covers(g)) return std::nullopt;
    std::vector<int> hosts;
    std::vector<std::vector<int>> members;
    for (int d : g.devices) {
      const int h = host_of_[static_cast<std::size_t>(d)];
      const auto at = static_cast<std::size_t>(std::find(hosts.begin(), hosts.end(), h) - hosts.begin());
      if (at == hosts.size()) hosts.push_back(h), members.emplace_back();
      members[at].push_back(d);
    }
    const std::size_t per_host = members[0].size();
    if (per_host < 2 || hosts.size() < 2 ||
        std::any_of(members.begin(), members.end(), [&](const auto& m) { return m.size() != per_host; }))
      return std::nullopt;
    Levels l;
    for (const auto& m : members) {
      if (std::find(m.begin(), m.end(), rank_) != m.end()) l.local.devices = m;
      auto& at = l.position.emplace_back();
      for (int d : m) at.push_back(g.index_of(d));
    }
    const auto mine = static_cast<std::size_t>(l.local.index_of(rank_));
    for (const auto& m : members) l.across.devices.push_back(m[mine]);
    return l;
  }

  // Called on this rank's reduced part of each step (the hierarchical all_reduce's exchange across hosts).
  using SliceHook = std::function<void(void* slice, std::int64_t n)>;

  // In place. Slices as the ring's (sizes differing by at most one element); each step reduces one segment of
  // every slice: copy in what the others reduce, reduce this rank's slice in group order, publish it, copy the
  // others' results out. Every element is summed once, by one rank, so all members end with the same bits.
  void all_reduce(const Group& g, void* data, std::int64_t n, DType t, const SliceHook& between = {}) {
    const int k = g.size(), me = g.index_of(rank_);
    if (k == 1 || n == 0) return;
    const Members m = members(g);
    const std::int64_t e = size_of(t), seg = segment(k, e);
    auto begin = [&](int b) { return n / k * b + std::min<std::int64_t>(b, n % k); };
    auto* d = static_cast<std::byte*>(data);
    std::vector<const void*> sources(static_cast<std::size_t>(k));
    for (std::int64_t at = 0, step = 0; at < begin(1); at += seg, ++step) {
      const int h = static_cast<int>(step % 2);
      auto length = [&](int b) { return std::clamp<std::int64_t>(begin(b + 1) - begin(b) - at, 0, seg); };
      auto mine = [&](int b) { return d + (begin(b) + at) * e; };
      auto region = [&](int member, int b) { return slot(m[static_cast<std::size_t>(member)], h) + b * seg * e; };
      for (int b = 0; b < k; ++b)
        if (b != me) std::memcpy(region(me, b), mine(b), static_cast<std::size_t>(length(b) * e));
      barrier(m);
      for (int j = 0; j < k; ++j) sources[static_cast<std::size_t>(j)] = j == me ? mine(me) : region(j, me);
      sum(t, mine(me), sources, length(me));
      if (between && length(me) > 0) between(mine(me), length(me));
      std::memcpy(region(me, me), mine(me), static_cast<std::size_t>(length(me) * e));
      barrier(m);
      for (int b = 0; b < k; ++b)
        if (b != me) std::memcpy(mine(b), region(b, b), static_cast<std::size_t>(length(b) * e));
    }
    barrier(m);  // every member has read this rank's slot: the next collective may write it
  }

  // `in` holds k blocks of n; `out` gets the sum of block (this rank's position) over the group.
  void reduce_scatter(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    const int k = g.size(), me = g.index_of(rank_);
    const std::int64_t e = size_of(t);
    if (k == 1) return (void)std::memcpy(out, in, static_cast<std::size_t>(n * e));
    const Members m = members(g);
    const std::int64_t seg = segment(k, e);
    const auto* src = static_cast<const std::byte*>(in);
    std::vector<const void*> sources(static_cast<std::size_t>(k));
    for (std::int64_t at = 0, step = 0; at < n; at += seg, ++step) {
      const int h = static_cast<int>(step % 2);
      const std::int64_t len = std::min(seg, n - at);
      auto region = [&](int member, int b) { return slot(m[static_cast<std::size_t>(member)], h) + b * seg * e; };
      for (int b = 0; b < k; ++b)
        if (b != me) std::memcpy(region(me, b), src + (b * n + at) * e, static_cast<std::size_t>(len * e));
      barrier(m);  // also: the step before last (same half) has been read by every member
      for (int j = 0; j < k; ++j)
        sources[static_cast<std::size_t>(j)] =
            j == me ? static_cast<const void*>(src + (me * n + at) * e) : region(j, me);
      sum(t, static_cast<std::byte*>(out) + at * e, sources, len);
    }
    barrier(m);
  }

  // `out` gets k blocks of n: block j is member j's `in`.
  void all_gather(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    exchange(g, in, out, n, t, false);
  }
  // `in` and `out` hold k blocks of n: out block j is member j's in block (this rank's position).
  void all_to_all(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    exchange(g, in, out, n, t, true);
  }

 private:
  using Members = std::vector<int>;  // the group's members' indices on this host, in group order

  Members members(const Group& g) const {
    if (!covers(g)) internal_error("shared-memory collective on a group not within this host");
    Members m;
    m.reserve(g.devices.size());
    for (int d : g.devices) m.push_back(local_index_[static_cast<std::size_t>(d)]);
    return m;
  }

  // Elements of one block per step when a half slot holds k blocks (a multiple of 64 bytes).
  std::int64_t segment(int k, std::int64_t element_bytes) const {
    return std::max<std::int64_t>(half_bytes_ / k / 64 * 64 / element_bytes, 1);
  }
  std::byte* slot(int local, int half) const { return base_ + flags_bytes_ + local * slot_bytes_ + half * half_bytes_; }
  std::atomic_ref<std::uint64_t> flag(int from, int to) const {
    return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(base_ + 64 * (from * locals_ + to)));
  }

  // Every member has passed as many barriers shared with this rank as this rank has.
  void barrier(const Members& m) {
    for (int b : m)
      if (b != local_) flag(local_, b).store(++passed_[static_cast<std::size_t>(b)], std::memory_order_release);
    for (int b : m) {
      if (b == local_) continue;
      auto arrived = flag(b, local_);
      const std::uint64_t target = passed_[static_cast<std::size_t>(b)];
      // Spin briefly (a peer on its own core arrives within microseconds), then yield: ranks may outnumber cores.
      for (int spins = 0; arrived.load(std::memory_order_acquire) < target; ++spins) {
        if (spins < 2000) relax();
        else sched_yield();
      }
    }
  }
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // all_gather (each member's one block) and all_to_all (member j's block for each position), one step at a time.
  void exchange(const Group& g, const void* in, void* out, std::int64_t n, DType t, bool to_all) {
    const int k = g.size(), me = g.index_of(rank_);
    const std::int64_t e = size_of(t);
    const auto* src = static_cast<const std::byte*>(in);
    auto* dst = static_cast<std::byte*>(out);
    std::memcpy(dst + me * n * e, src + (to_all ? me * n * e : 0), static_cast<std::size_t>(n * e));
    if (k == 1) return;
    const Members m = members(g);
    const int blocks = to_all ? k : 1;
    const std::int64_t seg = segment(blocks, e);
    for (std::int64_t at = 0, step = 0; at < n; at += seg, ++step) {
      const int h = static_cast<int>(step % 2);
      const std::int64_t len = std::min(seg, n - at);
      auto region = [&](int member, int b) { return slot(m[static_cast<std::size_t>(member)], h) + b * seg * e; };
      for (int b = 0; b < blocks; ++b)
        if (!to_all || b != me) std::memcpy(region(me, b), src + (b * n + at) * e, static_cast<std::size_t>(len * e));
      barrier(m);
      for (int j = 0; j < k; ++j)
        if (j != me)
          std::memcpy(dst + (j * n + at) * e, region(j, to_all ? me : 0), static_cast<std::size_t>(len * e));
    }
    barrier(m);
  }

  // out = sources[0] + sources[1] + ... in that order, a tile at a time (out may be one of the sources).
  template <class T>
  static void sum_in_order(T* out, const std::vector<const void*>& sources, std::int64_t n) {
    constexpr std::int64_t tile = 1024;
    T acc[tile];
    const auto k = sources.size();
    for (std::int64_t i0 = 0; i0 < n; i0 += tile) {
      const std::int64_t len = std::min(tile, n - i0);
      const T* a = static_cast<const T*>(sources[0]) + i0;
      const T* b = static_cast<const T*>(sources[1]) + i0;
      for (std::int64_t i = 0; i < len; ++i) acc[i] = plus(a[i], b[i]);
      for (std::size_t j = 2; j < k; ++j) {
        const T* c = static_cast<const T*>(sources[j]) + i0;
        for (std::int64_t i = 0; i < len; ++i) acc[i] = plus(acc[i], c[i]);
      }
      std::copy_n(acc, len, out + i0);
    }
  }
  static void sum(DType t, void* out, const std::vector<const void*>& sources, std::int64_t n) {
    switch (t) {
      case DType::f32: return sum_in_order(static_cast<float*>(out), sources, n);
      case DType::f64: return sum_in_order(static_cast<double*>(out), sources, n);
      case DType::i32: return sum_in_order(static_cast<std::int32_t*>(out), sources, n);
      case DType::bf16: return sum_in_order(static_cast<bf16*>(out), sources, n);
      case DType::f16: return sum_in_order(static_cast<f16*>(out), sources, n);
    }
  }

  // One rank makes the memfd; the others open it through /proc; all map it. A rank that fails says why.
  void map(MPI_Comm host) {
    bytes_ = flags_bytes_ + locals_ * slot_bytes_;
    struct Origin {
      int pid, fd, error;
    } origin{static_cast<int>(getpid()), -1, 0};
    std::string failed;
    if (local_ == 0) {
      origin.fd = memfd_create("partir-collectives", MFD_CLOEXEC);
      if (origin.fd < 0 || ftruncate(origin.fd, bytes_) != 0) origin.error = errno;
    }
    MPI_Bcast(&origin, 3, MPI_INT, 0, host);
    int fd = local_ == 0 ? origin.fd : -1;
    if (origin.error) failed = std::string("memfd_create: ") + std::strerror(origin.error);
    else if (local_ != 0) {
      const std::string path = "/proc/" + std::to_string(origin.pid) + "/fd/" + std::to_string(origin.fd);
      fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) failed = "open " + path + ": " + std::strerror(errno);
    }
    void* p = MAP_FAILED;
    if (failed.empty()) {
      p = mmap(nullptr, static_cast<std::size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) failed = std::string("mmap: ") + std::strerror(errno);
    }
    MPI_Barrier(host);  // every rank has opened the file before its creator closes it
    if (fd >= 0) close(fd);
    if (!failed.empty()) {
      why_unavailable_ = failed;
      return;
    }
    base_ = static_cast<std::byte*>(p);
    std::memset(slot(local_, 0), 0, static_cast<std::size_t>(slot_bytes_));  // first touch: this rank's pages
  }

  int rank_ = 0, ranks_ = 1, local_ = 0, locals_ = 1;
  std::vector<int> host_of_, local_index_;
  std::int64_t half_bytes_ = 0, slot_bytes_ = 0, flags_bytes_ = 0, bytes_ = 0;
  std::byte* base_ = nullptr;
  std::string why_unavailable_ = "one rank on this host";
  std::vector<std::uint64_t> passed_;  // barriers passed with each rank of this host
};

}  // namespace partir::mpi
