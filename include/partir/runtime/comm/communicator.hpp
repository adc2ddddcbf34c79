#pragma once
// The Communicator concept: what an executor needs from a backend to run one device of an SPMD program.
// Collectives act on a Group (the devices that vary along some mesh axes, in mesh order) over contiguous
// buffers; the executor packs non-leading dims. Buffers are raw pointers plus an element count and dtype,
// so a device-memory backend (NCCL) fits the same signatures.
#include <concepts>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "partir/ir/dtype.hpp"

namespace partir {

struct Group {
  std::vector<int> devices;  // global device ids, in group order
  int size() const { return static_cast<int>(devices.size()); }
  int index_of(int device) const {
    for (int i = 0; i < size(); ++i)
      if (devices[static_cast<std::size_t>(i)] == device) return i;
    internal_error("device " + std::to_string(device) + " is not in the group");
  }
  friend bool operator==(const Group&, const Group&) = default;
  friend auto operator<=>(const Group&, const Group&) = default;
};

// count: elements per device contribution. all_gather/all_to_all/reduce_scatter exchange blocks of count
// elements; `out` of all_gather and `in` of reduce_scatter/all_to_all hold group.size() blocks.
// send/recv move n elements between two devices (pipeline stages), matched by tag: a send never waits for its
// recv (the data is copied or queued before it returns), a recv waits for the send with its peer and tag.
template <class C>
concept Communicator = requires(C c, const Group& g, const void* in, void* out, void* inout, std::int64_t n, DType t,
                                int peer, std::int64_t tag) {
  c.send(peer, in, n, t, tag);
  c.recv(peer, out, n, t, tag);
  { c.device() } -> std::convertible_to<int>;
  { c.num_devices() } -> std::convertible_to<int>;
  c.all_reduce(g, inout, n, t);
  c.all_gather(g, in, out, n, t);
  c.reduce_scatter(g, in, out, n, t);
  c.all_to_all(g, in, out, n, t);
  c.collective_permute(g, peer, in, peer, out, n, t);
  c.barrier();
};

// A backend that can send from the caller's buffer without copying it (MPI): the caller keeps `data` unchanged
// until finish_sends(), which waits until every such send has been received. A copied send costs a pass over
// memory as long as the transfer itself (sendrecv at 0.3-0.5x of MPI_Sendrecv's busbw here). A run that fails
// midway cannot wait for its peers: its pending sends are left to the job's end, which the failure brings.
template <class C>
concept SendsInPlace = requires(C& c, const void* in, std::int64_t n, DType t, int peer, std::int64_t tag) {
  c.send_in_place(peer, in, n, t, tag);
  c.finish_sends();
};

// A backend with two all_reduce algorithms, the library's and partir's ring (MPI), chosen by buffer size:
// from ring_all_reduce_from(group size) bytes up the ring runs. Calibration times both and records where the
// ring takes over (HardwareProfile::ring_all_reduce_from); tune_collectives sets it from a profile.
// ring_all_reduce_never: no size, the library's algorithm at every size.
inline constexpr std::int64_t ring_all_reduce_never = std::numeric_limits<std::int64_t>::max();
template <class C>
concept ChoosesAllReduce = requires(C& c, const C& cc, int group_size, std::int64_t bytes) {
  c.set_ring_all_reduce_from(group_size, bytes);
  { cc.ring_all_reduce_from(group_size) } -> std::convertible_to<std::int64_t>;
};

}  // namespace partir
