#pragma once
// The cost formulas the simulator applies, one device at a time.
//   Local ops: a roofline over their work (sharding/op_work.hpp: FLOPs and bytes). Time = op_overhead + max(FLOPs / rate, bytes / bandwidth) (rate:
//   the GEMM peak for dot_general, scaled by the profile's GEMM curve at its smallest dim; the elementwise
//   rate for the rest), the bandwidth of the op's kind where the profile has one (strided copies), else
//   memory_bandwidth, scaled by the profile's cache curve at this working set or, if longer, at the bytes
//   touched since the operands were last (Work::reuse: a step's parameters come from memory, the activation
//   just made from a cache).
//   A convolution: 2 x output elements x input features x window taps FLOPs, at the GEMM rate of the GEMM
//   it amounts to ([positions, taps x features] x [taps x features, out features] per image).
//   Collectives: ring algorithms on a group of n devices, S = the larger of the local operand and result
//   buffers, one alpha-beta link: all_gather, reduce_scatter and all_to_all (n-1)(alpha + beta S/n),
//   all_reduce twice that, or the link's measured times where it has them; all_slice communicates nothing
//   and is costed as the local copy it is.
#include <algorithm>
#include <map>
#include <span>

#include "partir/sim/hardware_profile.hpp"
#include "partir/sharding/op_work.hpp"

namespace partir {

// The slower of the two roofline limits of an op of kind k decides; `compute_bound` tells which.
inline double roofline_seconds(const Work& w, OpKind k, DType t, const HardwareProfile& hw, bool* compute_bound = nullptr) {
  const double compute = w.flops > 0 ? w.flops / hw.flops_per_second(k, t, w.gemm_dim) : 0;
  const double bandwidth = hw.bandwidth(k, std::max(w.bytes, w.reuse));
  const double memory = bandwidth > 0 ? w.bytes / bandwidth : 0;
  if (compute_bound) *compute_bound = compute >= memory;
  return hw.op_overhead + std::max(compute, memory);
}

// Transfers that move one buffer one hop (pipeline sends, halo exchanges), not around a ring.
inline bool is_point_to_point(CollectiveKind k) {
  return k == CollectiveKind::send || k == CollectiveKind::recv || k == CollectiveKind::collective_permute;
}

// Ring time of a collective moving a buffer of `bytes` (the larger of operand and result) over n devices.
// A link with measured points: between two of them, interpolated linearly; above the largest, at its rate
// (seconds per byte); below the smallest, the ring formula.
inline double ring_seconds(CollectiveKind k, std::int64_t n, double bytes, const Link& link) {
  if (n <= 1 || k == CollectiveKind::all_slice) return 0;
  if (is_point_to_point(k)) return link.alpha + link.beta * bytes;  // one hop
  const auto& m = link.measured;
  if (!m.empty() && bytes >= m.front().first) {
    for (std::size_t i = 1; i < m.size(); ++i)
      if (bytes <= m[i].first) {
        const double f = (bytes - m[i - 1].first) / (m[i].first - m[i - 1].first);
        return m[i - 1].second + f * (m[i].second - m[i - 1].second);
      }
    return m.back().second * bytes / m.back().first;
  }
  const double steps = static_cast<double>((k == CollectiveKind::all_reduce ? 2 : 1) * (n - 1));
  return steps * (link.alpha + link.beta * bytes / static_cast<double>(n));
}

// The time of collective c on `device`'s group, moving a buffer of `bytes` (the larger of operand and result).
// Within one host (or with no hosts in the profile): the ring on the axes' link. A group spanning hosts with the
// same m >= 2 members on each: all_reduce, reduce_scatter and all_gather in two levels, as the mpi backend runs
// them (HostSharedMemory::levels): within each host over the whole buffer, across hosts on 1/m of it; any other
// collective as one ring, paced by its hops between hosts; a send or permute between hosts, one hop there.
inline double collective_seconds(const Collective& c, const Mesh& mesh, std::int64_t device, double bytes,
                                 const HardwareProfile& hw) {
  const std::int64_t n = is_point_to_point(c.kind) ? 2 : tile_count(c.axes, mesh);
  auto within = [&](CollectiveKind k, std::int64_t size, double b) {
    return ring_seconds(k, size, b, hw.link(k, c.axes, size));
  };
  if (hw.devices_per_host <= 0 || n <= 1) return within(c.kind, n, bytes);
  std::vector<std::int64_t> members;
  if (c.kind == CollectiveKind::send || c.kind == CollectiveKind::recv) {  // this device and its peer stage's
    auto at = mesh.coordinates(device);
    at[static_cast<std::size_t>(mesh.axis_index(c.axes.at(0)))] = c.peer;
    members = {device, mesh.device_at(at)};
  } else {
    members = mesh.group(device, c.axes);
  }
  std::map<std::int64_t, std::int64_t> per_host;  // members on each host
  for (auto d : members) ++per_host[d / hw.devices_per_host];
  if (per_host.size() == 1) return within(c.kind, n, bytes);
  const auto hosts = static_cast<std::int64_t>(per_host.size());
  const std::int64_t m = per_host.begin()->second;
  const bool even = std::all_of(per_host.begin(), per_host.end(), [&](const auto& h) { return h.second == m; });
  const bool two_levels = c.kind == CollectiveKind::all_reduce || c.kind == CollectiveKind::reduce_scatter ||
                          c.kind == CollectiveKind::all_gather;
  if (two_levels && m >= 2 && even)
    return within(c.kind, m, bytes) + ring_seconds(c.kind, hosts, bytes / static_cast<double>(m), hw.between_hosts);
  return ring_seconds(c.kind, n, bytes, hw.between_hosts);
}

// Bytes each device sends in the ring algorithm: what ZeRO's "2 Psi per device" counts.
inline double wire_bytes(CollectiveKind k, std::int64_t n, double bytes) {
  if (n <= 1 || k == CollectiveKind::all_slice || k == CollectiveKind::recv) return 0;
  if (k == CollectiveKind::send || k == CollectiveKind::collective_permute) return bytes;
  const double steps = static_cast<double>((k == CollectiveKind::all_reduce ? 2 : 1) * (n - 1));
  return steps * bytes / static_cast<double>(n);
}

// nccl-tests' bus bandwidth factor: busbw = algbw x this, so that busbw compares with the link's bandwidth
// whatever the collective.
inline double bus_factor(CollectiveKind k, std::int64_t n) {
  if (n <= 1) return 0;
  const double f = static_cast<double>(n - 1) / static_cast<double>(n);
  return k == CollectiveKind::all_reduce ? 2 * f : f;
}

inline std::int64_t group_size(const Collective& c, const Mesh& mesh) { return tile_count(c.axes, mesh); }

}  // namespace partir
