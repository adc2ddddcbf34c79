#pragma once
// The work of one local op, from its types alone: FLOPs = FLOPs per point x the op's iteration space, the
// product of the factor sizes of its rule in the tile-mapping registry (dot_general: 2 x batch x M x N x K;
// reduce: the operand's elements; elementwise: the result's elements); layout ops move data and do no
// arithmetic. Bytes = the operands read plus the result written. The simulator turns it into time on a
// hardware profile (sim/cost_model.hpp); the pipeline tactic balances its stages by it (tactics/pipeline.hpp) and
// the stage cutter weighs the schedule's tasks by it (spmd/pipeline.hpp), both on a nominal machine.
#include <algorithm>
#include <span>

#include "partir/sharding/rules.hpp"

namespace partir {

struct Work {
  double flops = 0;
  double bytes = 0;
  double gemm_dim = 0;  // dot_general: the smallest of M, N and K (HardwareProfile::gemm_curve)
  double reuse = 0;     // bytes the device touched since it last touched the operands (the cache curve's key)
};

// The GEMM a dot_general runs per batch element: M (lhs free), N (rhs free), K (contracted); the smallest.
inline double gemm_dim(const DotDims& d, const Shape& lhs, const Shape& rhs) {
  auto product = [](const Shape& s, const std::vector<std::int64_t>& skip1, const std::vector<std::int64_t>& skip2,
                    bool keep) {
    double p = 1;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(s.size()); ++i) {
      const bool listed = std::find(skip1.begin(), skip1.end(), i) != skip1.end() ||
                          std::find(skip2.begin(), skip2.end(), i) != skip2.end();
      if (listed == keep) p *= static_cast<double>(s[static_cast<std::size_t>(i)]);
    }
    return p;
  };
  const double m = product(lhs, d.lhs_batch, d.lhs_contract, false), n = product(rhs, d.rhs_batch, d.rhs_contract, false),
               k = product(lhs, d.lhs_contract, {}, true);
  return std::min({m, n, k});
}

// Arithmetic per point of an op's iteration space: a multiply-add for dot_general, one operation for
// elementwise ops and reductions, none for ops that only move data.
inline double flops_per_point(OpKind k) {
  if (k == OpKind::dot_general) return 2;
  if (is_elementwise(k) || k == OpKind::reduce_sum || k == OpKind::reduce_max) return 1;
  return 0;
}

// The work of one local op with operands of types `in` (per device).
inline Work local_work(const Op& op, std::span<const TensorType> in) {
  if (op.kind == OpKind::input) return {};
  Work w;
  w.bytes = static_cast<double>(op.type.bytes());
  // A slice reads only the elements it keeps (unit strides: whole runs of the last dim), not its operand.
  if (op.kind == OpKind::slice) w.bytes *= 2;
  else
    for (const auto& t : in) w.bytes += static_cast<double>(t.bytes());
  // scatter_add adds each update row into the table: one add per update element.
  if (op.kind == OpKind::scatter_add) w.flops = static_cast<double>(in[1].elements());
  if (op.kind == OpKind::add_n) w.flops = static_cast<double>(op.type.elements()) * static_cast<double>(in.size() - 1);
  if (op.kind == OpKind::dot_general) w.gemm_dim = gemm_dim(op.attrs.dot, in[0].shape, in[1].shape);
  // A convolution is a multiply-add per output element, input feature of its group and window tap, computed as
  // the GEMMs [images x positions, taps x C/G] x [taps x C/G, O/G] (im2col's, per group; oneDNN's primitives
  // block the same products).
  if (op.kind == OpKind::convolution) {
    const double taps_features = static_cast<double>(in[1].elements() / in[1].shape.back());
    const std::int64_t O = op.type.shape.back();
    const double rows = O > 0 ? static_cast<double>(op.type.elements() / O) : 0.0;
    w.flops = 2.0 * static_cast<double>(op.type.elements()) * taps_features;
    w.gemm_dim = std::min({rows, taps_features, static_cast<double>(O / op.attrs.conv.feature_groups)});
  }
  // Pooling: one operation per output element and tap (its gradient: per window and tap).
  if (op.kind == OpKind::reduce_window_sum || op.kind == OpKind::reduce_window_max || op.kind == OpKind::select_and_scatter) {
    const TensorType& windows = op.kind == OpKind::select_and_scatter ? in[1] : op.type;
    w.flops = static_cast<double>(windows.elements() * num_elements(op.attrs.window.window));
  }
  if (const double per_point = flops_per_point(op.kind); per_point > 0) {
    double points = 1;
    for (const auto& f : rule_for(op, in).factors) points *= static_cast<double>(f.size);
    w.flops = per_point * points;
  }
  return w;
}

// Seconds on a nominal machine (100 GFLOP/s, 10 GB/s, 1 us per op): what only the ratios between ops matter to
// (a stage cut, a task order) uses it, before there is a hardware profile.
inline double nominal_seconds(const Work& w) { return 1e-6 + std::max(w.flops / 1e11, w.bytes / 1e10); }

}  // namespace partir
