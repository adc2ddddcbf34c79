#pragma once
// The tile-mapping registry (TMR): for every op kind, one einsum-like rule saying how the op may be
// partitioned (Shardy's OpShardingRule). Every operand and result dim is made of factors; tiling a factor
// on a mesh axis tiles every dim made of it. Propagation, lowering and the cost model all read these rules;
// no op kind is special-cased anywhere else.
//
//   matmul [i,k] x [k,j] -> [i,j]:   ([i,k],[k,j])->([i,j]) {i=8,j=16,k=4} reduction={k}
//
// Factor kinds:
// - pass_through: each device computes its tile of every tensor holding the factor from the operands' tiles.
// - reduction: only operands hold it; tiling it leaves each device with a partial sum of the result
//   (PartIR #sum).
// - need_replication: the op cannot run on tiles of this factor; its operands must be gathered first.
// A factor held by the result only (a broadcast's new dim, a slice's cut dim) can be tiled without touching
// the operands: the op computes only the tile the device keeps.
//
// Reshape: dims are split into the coarsest common factorization, so (2,4,32)->(8,32) is ([i,j,k])->([(ij),k])
// and a merged dim (ij) is made of factors i then j, major to minor. Tiling such a dim on an axis must fill
// its factors in order: an axis that would straddle two factors (8 tiled on an axis of 4, reshaped to 2x4)
// needs a sub-axis, which partir does not model: propagation stops there and records why. Shapes whose
// sizes do not factor ((4,6)->(6,4)) make the operand dims need replication.
//
// Partial sums (linearity): a result may stay a partial sum over an axis when the op is linear in the
// operands that are partial over it; see PartialRule.
#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "partir/config.hpp"
#include "partir/ir/program.hpp"
#include "partir/sharding/halo.hpp"

namespace partir {

enum class FactorKind : std::uint8_t { pass_through, reduction, need_replication };

inline std::string_view name_of(FactorKind k) {
  switch (k) {
    case FactorKind::pass_through: return "pass_through";
    case FactorKind::reduction: return "reduction";
    case FactorKind::need_replication: return "need_replication";
  }
  return "?";
}

struct Factor {
  std::int64_t size = 1;
  FactorKind kind = FactorKind::pass_through;
  std::string why;  // need_replication: the reason, quoted where propagation stops
  friend bool operator==(const Factor&, const Factor&) = default;
};

// The factors a dim is made of, major to minor (indices into OpRule::factors): one for most dims, several
// for a dim a reshape merges, none for a size-1 dim a reshape drops or a broadcast expands.
using DimFactors = std::vector<int>;

// When a result keeps the partial sums of its operands (sum_i p_i stays split across the axis):
enum class PartialRule : std::uint8_t {
  none,     // not linear (exp, max, compare, reduce_max...): partial operands are all-reduced first
  sum,      // additive in the `linear` operands taken together (add, sub, concatenate, select's branches,
            // and every linear unary op): all of them partial on the axis, the other operands not using it
  product,  // linear in each `linear` operand alone (mul, div's numerator, dot_general, gather's table):
            // exactly one operand partial on the axis, the others not using it
};

struct OpRule {
  std::vector<Factor> factors;
  std::vector<std::vector<DimFactors>> operands;  // [operand][dim]
  std::vector<DimFactors> result;                 // [dim]
  PartialRule partial = PartialRule::none;
  std::vector<bool> linear;                       // per operand, read by `partial`

  // The dim among `dims` (one tensor's) made of factor f, -1 if none.
  static std::int64_t dim_of(const std::vector<DimFactors>& dims, int f) {
    for (std::size_t d = 0; d < dims.size(); ++d)
      for (auto g : dims[d])
        if (g == f) return static_cast<std::int64_t>(d);
    return -1;
  }
  std::int64_t operand_dim(std::size_t operand, int f) const { return dim_of(operands.at(operand), f); }
  std::int64_t result_dim(int f) const { return dim_of(result, f); }

  friend bool operator==(const OpRule&, const OpRule&) = default;
};

// The rule of `op` given its operands' types.
PARTIR_ENTRY OpRule rule_for(const Op& op, std::span<const TensorType> in);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

class RuleBuilder {
 public:
  explicit RuleBuilder(std::size_t operands) { rule.operands.resize(operands); }

  int factor(std::int64_t size, FactorKind kind = FactorKind::pass_through, std::string why = {}) {
    rule.factors.push_back({size, kind, std::move(why)});
    return static_cast<int>(rule.factors.size() - 1);
  }
  // One pass-through factor per result dim.
  void result_dims(const Shape& shape) {
    for (auto s : shape) rule.result.push_back({factor(s)});
  }
  void linear(PartialRule partial, std::vector<bool> operands) {
    rule.partial = partial;
    rule.linear = std::move(operands);
  }

  OpRule rule;
};

// An operand dim whose size the op changes (slice, pad, concatenate) needs replication; the result dim keeps
// the factor of its own that result_dims gave it.
inline void changed_dim(RuleBuilder& b, std::size_t operand, std::int64_t size, const std::string& why) {
  b.rule.operands[operand].push_back({b.factor(size, FactorKind::need_replication, why)});
}

inline void reshape_rule(RuleBuilder& b, const Shape& in, const Shape& out) {
  auto& op_dims = b.rule.operands[0];
  op_dims.assign(in.size(), {});
  b.rule.result.assign(out.size(), {});
  auto unfactored = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
    const std::string why = "reshape " + to_string(in) + "->" + to_string(out) + " regroups dims whose sizes do not factor";
    for (auto i = i0; i < i1; ++i)
      if (in[i] != 1) op_dims[i] = {b.factor(in[i], FactorKind::need_replication, why)};
    for (auto j = j0; j < j1; ++j)
      if (out[j] != 1) b.rule.result[j] = {b.factor(out[j])};
  };
  if (num_elements(in) == 0) return unfactored(0, in.size(), 0, out.size());

  std::size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    if (i < in.size() && in[i] == 1) { ++i; continue; }
    if (j < out.size() && out[j] == 1) { ++j; continue; }
    // A group: the fewest dims on each side with equal products.
    const auto i0 = i, j0 = j;
    std::int64_t pi = in[i++], pj = out[j++];
    while (pi != pj) {
      if (pi < pj) pi *= in[i++];
      else pj *= out[j++];
    }
    // Factors are the steps between the union of both sides' running products, which must divide each other.
    std::vector<std::int64_t> bounds;
    for (auto [shape, lo, hi] : {std::tuple{&in, i0, i}, std::tuple{&out, j0, j}}) {
      std::int64_t c = 1;
      for (auto k = lo; k < hi; ++k) bounds.push_back(c *= (*shape)[k]);
    }
    std::sort(bounds.begin(), bounds.end());
    bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
    bool chain = true;
    for (std::size_t k = 1; k < bounds.size(); ++k) chain = chain && bounds[k] % bounds[k - 1] == 0;
    if (!chain) {
      unfactored(i0, i, j0, j);
      continue;
    }
    std::vector<int> factors;
    for (std::size_t k = 0; k < bounds.size(); ++k) factors.push_back(b.factor(k ? bounds[k] / bounds[k - 1] : bounds[0]));
    auto assign = [&](const Shape& shape, std::size_t lo, std::size_t hi, std::vector<DimFactors>& dims) {
      std::int64_t c = 1;
      std::size_t next = 0;  // first factor not yet given to a dim
      for (auto k = lo; k < hi; ++k) {
        c *= shape[k];
        while (next < bounds.size() && bounds[next] <= c) dims[k].push_back(factors[next++]);
      }
    };
    assign(in, i0, i, op_dims);
    assign(out, j0, j, b.rule.result);
  }
}

}  // namespace detail

PARTIR_ENTRY OpRule rule_for(const Op& op, std::span<const TensorType> in) {
  const auto n = op.operands.size();
  detail::RuleBuilder b(n);
  const Attrs& a = op.attrs;
  const Shape& out = op.type.shape;
  auto same_dims = [&](std::size_t operand) {  // operand dims equal to the result's, factor for factor
    for (const auto& f : b.rule.result) b.rule.operands[operand].push_back(f);
  };
  if (is_elementwise(op.kind)) {
    b.result_dims(out);
    for (std::size_t i = 0; i < n; ++i) same_dims(i);
    switch (op.kind) {
      case OpKind::add:
      case OpKind::sub: b.linear(PartialRule::sum, {true, true}); break;
      case OpKind::neg: b.linear(PartialRule::sum, {true}); break;
      // Rounding to integers is not linear. Partial sums cross a float convert that does not widen, so that
      // they are reduced in the narrower dtype: a bf16 gradient widened for an f32 update is all-reduced in
      // bf16 (half the bytes), an f32 value narrowed to bf16 is reduced after narrowing (and see
      // widens_into_accumulation: the microbatches' gradients are summed before they are reduced).
      case OpKind::convert:
        if (is_float(in[0].dtype) && is_float(op.type.dtype) && size_of(op.type.dtype) <= size_of(in[0].dtype))
          b.linear(PartialRule::sum, {true});
        break;
      case OpKind::mul: b.linear(PartialRule::product, {true, true}); break;
      case OpKind::div: b.linear(PartialRule::product, {true, false}); break;
      case OpKind::select: b.linear(PartialRule::sum, {false, true, true}); break;
      default: break;
    }
    return b.rule;
  }
  switch (op.kind) {
    case OpKind::input:
    case OpKind::constant: b.result_dims(out); break;
    case OpKind::dot_general: {  // factors in einsum order: batch, lhs free, rhs free, contracting
      const auto& d = a.dot;
      auto& lhs = b.rule.operands[0];
      auto& rhs = b.rule.operands[1];
      lhs.resize(in[0].shape.size());
      rhs.resize(in[1].shape.size());
      for (std::size_t k = 0; k < d.lhs_batch.size(); ++k) {
        const int f = b.factor(in[0].shape[d.lhs_batch[k]]);
        lhs[d.lhs_batch[k]] = rhs[d.rhs_batch[k]] = {f};
        b.rule.result.push_back({f});
      }
      auto contracting = [](const std::vector<std::int64_t>& dims, std::size_t k) {
        return std::find(dims.begin(), dims.end(), static_cast<std::int64_t>(k)) != dims.end();
      };
      for (auto [side, shape, contract] : {std::tuple{&lhs, &in[0].shape, &d.lhs_contract},
                                           std::tuple{&rhs, &in[1].shape, &d.rhs_contract}})
        for (std::size_t k = 0; k < side->size(); ++k)
          if ((*side)[k].empty() && !contracting(*contract, k)) {
            (*side)[k] = {b.factor((*shape)[k])};
            b.rule.result.push_back((*side)[k]);
          }
      for (std::size_t k = 0; k < d.lhs_contract.size(); ++k)
        lhs[d.lhs_contract[k]] = rhs[d.rhs_contract[k]] = {b.factor(in[0].shape[d.lhs_contract[k]], FactorKind::reduction)};
      b.linear(PartialRule::product, {true, true});
      break;
    }
    case OpKind::reduce_sum:
    case OpKind::reduce_max: {
      const bool sum = op.kind == OpKind::reduce_sum;
      for (std::int64_t d = 0; d < in[0].rank(); ++d) {
        const bool reduced = std::find(a.dims.begin(), a.dims.end(), d) != a.dims.end();
        const auto size = in[0].shape[static_cast<std::size_t>(d)];
        if (!reduced) {
          b.rule.operands[0].push_back({b.factor(size)});
          b.rule.result.push_back(b.rule.operands[0].back());
        } else if (sum) {
          b.rule.operands[0].push_back({b.factor(size, FactorKind::reduction)});
        } else {
          b.rule.operands[0].push_back({b.factor(size, FactorKind::need_replication,
                                                 "reduce_max over a tiled dim (a max of maxima is no sum)")});
        }
      }
      if (sum) b.linear(PartialRule::sum, {true});
      break;
    }
    case OpKind::broadcast_in_dim:
      b.result_dims(out);
      for (std::size_t d = 0; d < a.dims.size(); ++d) {
        const auto to = static_cast<std::size_t>(a.dims[d]);
        b.rule.operands[0].push_back(in[0].shape[d] == out[to] ? b.rule.result[to] : DimFactors{});
      }
      b.linear(PartialRule::sum, {true});
      break;
    case OpKind::reshape:
      detail::reshape_rule(b, in[0].shape, out);
      b.linear(PartialRule::sum, {true});
      break;
    case OpKind::transpose:
      for (auto s : in[0].shape) b.rule.operands[0].push_back({b.factor(s)});
      for (auto d : a.dims) b.rule.result.push_back(b.rule.operands[0][static_cast<std::size_t>(d)]);
      b.linear(PartialRule::sum, {true});
      break;
    case OpKind::slice:
    case OpKind::pad:
      b.result_dims(out);
      for (std::size_t d = 0; d < out.size(); ++d) {
        if (in[0].shape[d] == out[d] && a.lo[d] == 0) b.rule.operands[0].push_back(b.rule.result[d]);
        else detail::changed_dim(b, 0, in[0].shape[d], std::string(name_of(op.kind)) + " changes dim " + std::to_string(d));
      }
      b.linear(PartialRule::sum, {true});
      break;
    case OpKind::concatenate:
      b.result_dims(out);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t d = 0; d < out.size(); ++d) {
          if (static_cast<std::int64_t>(d) != a.axis) b.rule.operands[i].push_back(b.rule.result[d]);
          else detail::changed_dim(b, i, in[i].shape[d], "concatenate joins along dim " + std::to_string(d));
        }
      b.linear(PartialRule::sum, std::vector<bool>(n, true));
      break;
    case OpKind::add_n:  // elementwise in every operand; lowering sums equal partial sums before reducing them
      b.result_dims(out);
      for (std::size_t i = 0; i < n; ++i) same_dims(i);
      b.linear(PartialRule::sum, std::vector<bool>(n, true));
      break;
    case OpKind::gather: {  // table [V, F...], indices [I...] -> [I..., F...]
      b.result_dims(out);
      const auto index_rank = static_cast<std::size_t>(in[1].rank());
      // Each device looks up the rows it owns and contributes zeros for the others: a partial sum.
      b.rule.operands[0].push_back({b.factor(in[0].shape[0], FactorKind::reduction)});
      for (std::size_t d = 1; d < in[0].shape.size(); ++d) b.rule.operands[0].push_back(b.rule.result[index_rank + d - 1]);
      for (std::size_t d = 0; d < index_rank; ++d) b.rule.operands[1].push_back(b.rule.result[d]);
      b.linear(PartialRule::product, {true, false});
      break;
    }
    case OpKind::scatter_add: {  // indices [I...], updates [I..., F...] -> [V, F...]
      b.result_dims(out);
      const auto index_rank = static_cast<std::size_t>(in[0].rank());
      // Each device adds the updates it holds: summing over the index dims is the reduction.
      for (std::size_t d = 0; d < index_rank; ++d) {
        b.rule.operands[0].push_back({b.factor(in[0].shape[d], FactorKind::reduction)});
        b.rule.operands[1].push_back(b.rule.operands[0].back());
      }
      for (std::size_t d = 1; d < out.size(); ++d) b.rule.operands[1].push_back(b.rule.result[d]);
      b.linear(PartialRule::product, {false, true});
      break;
    }
    case OpKind::reduce_window_sum:
    case OpKind::reduce_window_max:
    case OpKind::select_and_scatter: {  // x [X...] (and g [P...]) -> [P...] ([X...]): a dim tiles where windows
      // stay inside tiles (no halo: pooling's padding is no zeros), else it needs replication
      const bool scatter = op.kind == OpKind::select_and_scatter;
      const Shape& windows = scatter ? in[1].shape : out;
      for (std::size_t d = 0; d < in[0].shape.size(); ++d) {
        const ConvSpatialDim s = window_spatial_dim(op, in[0].shape, windows, d);
        const HaloExchange h = halo_exchange(s, a.window.base_dilation[d]);
        if (s.tiling == SpatialTiling::output && h.from_previous == 0 && h.from_next == 0) {
          const int f = b.factor(s.shared());
          b.rule.operands[0].push_back({f});
          if (scatter) b.rule.operands[1].push_back({f});
          b.rule.result.push_back({f});
          continue;
        }
        std::string why = std::string(name_of(op.kind)) + ": dim " + std::to_string(d) + ": ";
        if (s.tiling == SpatialTiling::none)
          why += "tiles of the operand (" + std::to_string(s.input) + ") and of the windows (" + std::to_string(s.output) +
                 " x stride " + std::to_string(a.window.strides[d]) + ") would not start at the same positions";
        else
          why += "windows cross into the neighbouring tile (a pooling halo would need its padding value, not zeros)";
        b.rule.operands[0].push_back({b.factor(s.input, FactorKind::need_replication, why)});
        if (scatter) b.rule.operands[1].push_back({b.factor(s.output, FactorKind::need_replication, why)});
        b.rule.result.push_back({b.factor(scatter ? s.input : s.output, FactorKind::need_replication, why)});
      }
      if (op.kind == OpKind::reduce_window_sum) b.linear(PartialRule::sum, {true});
      if (scatter) b.linear(PartialRule::product, {false, true});
      break;
    }
    case OpKind::convolution: {  // x [N, X..., C], w [K..., C, O] -> [N, P..., O]: the batch and output
      // features pass through, the input features are a reduction (a partial sum, as a matmul's k), and each
      // spatial dim tiles its input with its output or with its window (halo.hpp), else not at all. With
      // feature groups, the features stay whole.
      const std::size_t spatial = in[0].shape.size() - 2;
      auto& x = b.rule.operands[0];
      auto& w = b.rule.operands[1];
      const bool grouped = op.attrs.conv.feature_groups > 1;
      const std::string whole = "convolution: " + std::to_string(op.attrs.conv.feature_groups) +
                                " feature groups: each output feature reads its group's input features";
      const int batch = b.factor(in[0].shape[0]);
      const int features = grouped ? -1 : b.factor(in[0].shape.back(), FactorKind::reduction);
      x.push_back({batch});
      b.rule.result.push_back({batch});
      for (std::size_t d = 0; d < spatial; ++d) {
        const ConvSpatialDim s = conv_spatial_dim(op, in[0].shape, in[1].shape, d);
        const std::string dim = "convolution: spatial dim " + std::to_string(d);
        const std::string taps = dim + ": a window's taps are read together (tile the output instead)";
        switch (s.tiling) {
          case SpatialTiling::output: {
            const int f = b.factor(s.shared());
            x.push_back({f});
            b.rule.result.push_back({f});
            w.push_back({b.factor(s.window, FactorKind::need_replication, taps)});
            break;
          }
          case SpatialTiling::window: {
            const int f = b.factor(s.shared(), FactorKind::reduction);
            x.push_back({f});
            w.push_back({f});
            b.rule.result.push_back({b.factor(s.output, FactorKind::need_replication, dim + ": every output position sums the whole window")});
            break;
          }
          case SpatialTiling::none: {
            const std::string why = dim + ": tiles of the input (" + std::to_string(s.input) + " x dilation " +
                                    std::to_string(op.attrs.conv.lhs_dilation[d]) + ") and of the output (" +
                                    std::to_string(s.output) + " x stride " + std::to_string(op.attrs.conv.strides[d]) +
                                    ") would not start at the same positions";
            x.push_back({b.factor(s.input, FactorKind::need_replication, why)});
            b.rule.result.push_back({b.factor(s.output, FactorKind::need_replication, why)});
            w.push_back({b.factor(s.window, FactorKind::need_replication, taps)});
            break;
          }
        }
      }
      if (grouped) {
        x.push_back({b.factor(in[0].shape.back(), FactorKind::need_replication, whole)});
        w.push_back({b.factor(in[1].shape[spatial], FactorKind::need_replication, whole)});
        w.push_back({b.factor(in[1].shape.back(), FactorKind::need_replication, whole)});
      } else {
        x.push_back({features});
        w.push_back({features});
        w.push_back({b.factor(in[1].shape.back())});
      }
      b.rule.result.push_back(w.back());
      b.linear(PartialRule::product, {true, true});
      break;
    }
    default: internal_error("no sharding rule for " + std::string(name_of(op.kind)));
  }
  return b.rule;
}
#endif

inline OpRule rule_for(const Program& p, ValueId v) {
  const Op& op = p.op(v);
  std::vector<TensorType> in;
  for (auto o : op.operands) in.push_back(p.type(o));
  return rule_for(op, in);
}

// A widening float convert keeps partial sums out (they are reduced before it, in the narrow dtype) except where
// gradients accumulate (train_step's running sums over microbatches: add_n of widened gradients and earlier
// sums): there the sum is widened first and reduced once after the last add_n, in the wide dtype, instead of once
// per microbatch in the narrow one (M microbatches: 2/M of the bytes).
inline bool widens_into_accumulation(const Program& p, ValueId v, std::span<const ValueId> users) {
  auto widens = [&](ValueId x) {
    const Op& op = p.op(x);
    if (op.kind != OpKind::convert) return false;
    const DType from = p.type(op.operands[0]).dtype, to = op.type.dtype;
    return is_float(from) && is_float(to) && size_of(to) > size_of(from);
  };
  if (!widens(v) || users.size() != 1 || p.op(users[0]).kind != OpKind::add_n) return false;
  const auto& summed = p.op(users[0]).operands;
  return summed.size() > 1 &&
         std::ranges::all_of(summed, [&](ValueId o) { return widens(o) || p.op(o).kind == OpKind::add_n; });
}
// rule_for(p, v), given v's users (the ops that read it, once each).
inline OpRule rule_for(const Program& p, ValueId v, std::span<const ValueId> users) {
  OpRule rule = rule_for(p, v);
  if (widens_into_accumulation(p, v, users)) {
    rule.partial = PartialRule::sum;
    rule.linear = {true};
  }
  return rule;
}

// How the axes tiling one dim (given by their sizes, major to minor) fall on the dim's factors: they fill
// the factors in order, each axis within the factor being filled, the next factor starting once one is cut
// down to size 1. For each axis its factor, and what is left of each factor; nothing if an axis straddles two
// factors (a dim of 8 = 2x4 tiled on an axis of 4: that needs a sub-axis).
struct FactorSplit {
  std::vector<int> factor_of_axis;
  std::vector<std::int64_t> left;  // per factor of the dim: its size divided by the axes on it
};
inline std::optional<FactorSplit> split_axes(std::span<const std::int64_t> axis_sizes, const DimFactors& dim,
                                             const OpRule& rule) {
  FactorSplit out;
  for (int f : dim) out.left.push_back(rule.factors[static_cast<std::size_t>(f)].size);
  std::size_t k = 0;
  for (auto size : axis_sizes) {
    while (k + 1 < out.left.size() && out.left[k] == 1) ++k;
    if (out.left.empty() || out.left[k] % size != 0) return std::nullopt;
    out.left[k] /= size;
    out.factor_of_axis.push_back(dim[k]);
  }
  return out;
}

// Shardy's notation: ([i,k],[k,j])->([i,j]) {i=8,j=16,k=4} reduction={k}; a size-1 dim without factors
// prints as 1, a merged dim as (ij).
inline std::string to_string(const OpRule& r) {
  auto letter = [](std::size_t f) {
    static constexpr std::string_view letters = "ijklmnopqrstuvwxyzabcdefgh";
    return f < letters.size() ? std::string(1, letters[f]) : "f" + std::to_string(f);
  };
  auto tensor = [&](const std::vector<DimFactors>& dims) {
    std::string s = "[";
    for (std::size_t d = 0; d < dims.size(); ++d) {
      s += d ? "," : "";
      if (dims[d].empty()) s += "1";
      if (dims[d].size() > 1) s += "(";
      for (auto f : dims[d]) s += letter(static_cast<std::size_t>(f));
      if (dims[d].size() > 1) s += ")";
    }
    return s + "]";
  };
  std::string s = "(";
  for (std::size_t i = 0; i < r.operands.size(); ++i) s += (i ? "," : "") + tensor(r.operands[i]);
  s += ")->(" + tensor(r.result) + ") {";
  for (std::size_t f = 0; f < r.factors.size(); ++f) s += (f ? "," : "") + letter(f) + "=" + std::to_string(r.factors[f].size);
  s += "}";
  for (auto kind : {FactorKind::reduction, FactorKind::need_replication}) {
    std::string list;
    for (std::size_t f = 0; f < r.factors.size(); ++f)
      if (r.factors[f].kind == kind) list += (list.empty() ? "" : ",") + letter(f);
    if (!list.empty()) s += " " + std::string(name_of(kind)) + "={" + list + "}";
  }
  return s;
}

}  // namespace partir
