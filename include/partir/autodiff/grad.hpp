#pragma once
// Reverse-mode automatic differentiation as a Program -> Program transform. grad() appends, after the
// forward ops, one vector-Jacobian product per op on a path from a differentiated value to the loss, so the
// backward pass is ordinary IR: sharding, lowering, the simulator and the kernels need nothing new for it.
//
// Conventions at non-differentiable points (as in JAX): max/min split the gradient evenly between equal
// operands, reduce_max splits it evenly among the tied maxima, abs has slope 0 at 0, compare has no
// gradient, and integer (i32) values never get one.
#include <algorithm>
#include <map>
#include <numeric>
#include <optional>

#include "partir/config.hpp"
#include "partir/dsl/functional.hpp"

namespace partir {

namespace detail {

inline void check_loss_type(const std::string& who, const std::string& what, const TensorType& t) {
  if (t.rank() != 0 || !is_float(t.dtype))
    user_error(who + ": " + what + " must be a scalar floating-point value, got " + to_string(t));
}

}  // namespace detail

// Appends to p the backward pass of `loss` (a scalar float value) and returns d loss / d w for each w in
// wrt: a value of w's type, zeros if w does not influence the loss. Adjoints of values used several times
// are summed with add. Only the ops between a wrt value and the loss are differentiated.
PARTIR_ENTRY std::vector<ValueId> grad(Program& p, ValueId loss, const std::vector<ValueId>& wrt);

// A copy of f that also computes the gradient of output `loss_output` w.r.t. the named inputs (all
// parameters if wrt is empty): f's outputs, then "grad/<input name>" for each.
PARTIR_ENTRY Program value_and_grad(const Program& f, const std::string& loss_output, std::vector<std::string> wrt = {});

#if PARTIR_DEFINE_ENTRIES
namespace detail {

inline Tensor zeros_like(const Tensor& x) { return full_like(x, 0.0); }

// reduce_sum over exactly `dims` (the DSL's sum() reads an empty list as "all dims").
inline Tensor reduce_sum_exact(const Tensor& x, std::vector<std::int64_t> dims) {
  if (dims.empty()) return x;
  Attrs a;
  a.dims = std::move(dims);
  return emit(x.program(), OpKind::reduce_sum, {x.id()}, std::move(a));
}

// The dims of a rank-`rank` operand that a reduce over `reduced` keeps, ascending.
inline std::vector<std::int64_t> kept_dims(std::int64_t rank, const std::vector<std::int64_t>& reduced) {
  std::vector<std::int64_t> kept;
  for (std::int64_t d = 0; d < rank; ++d)
    if (std::find(reduced.begin(), reduced.end(), d) == reduced.end()) kept.push_back(d);
  return kept;
}

// Gradient of dot_general w.r.t. one operand ("self") from the result's adjoint g and the other operand.
// g's dims are [batch, lhs free, rhs free]; contracting g's dims of other's free dims with other's free dims
// (batched alike) gives dot(g, other) = [batch, self free, self contracting dims ordered as their partners in
// other], or dot(other, g) = [batch, those contracting dims, self free]. The order that already is self's
// dim order is emitted (for a matmul's rhs, dot(other, g) is x^T g with no transpose after it); otherwise
// a transpose puts dot(g, other) back into self's dim order.
inline Tensor dot_general_vjp(const Tensor& g, const Tensor& other, std::int64_t self_rank,
                              const std::vector<std::int64_t>& self_batch,
                              const std::vector<std::int64_t>& self_contract,
                              const std::vector<std::int64_t>& other_batch,
                              const std::vector<std::int64_t>& other_contract, std::int64_t g_other_free_start) {
  auto free_dims = [](std::int64_t rank, std::vector<std::int64_t> used, const std::vector<std::int64_t>& more) {
    used.insert(used.end(), more.begin(), more.end());
    return kept_dims(rank, used);
  };
  const auto self_free = free_dims(self_rank, self_batch, self_contract);
  const auto other_free = free_dims(other.rank(), other_batch, other_contract);
  std::vector<std::int64_t> g_batch, g_contract;
  for (std::size_t i = 0; i < self_batch.size(); ++i) g_batch.push_back(static_cast<std::int64_t>(i));
  for (std::size_t k = 0; k < other_free.size(); ++k) g_contract.push_back(g_other_free_start + static_cast<std::int64_t>(k));

  std::vector<std::size_t> by_partner(self_contract.size());
  std::iota(by_partner.begin(), by_partner.end(), std::size_t{0});
  std::sort(by_partner.begin(), by_partner.end(),
            [&](std::size_t a, std::size_t b) { return other_contract[a] < other_contract[b]; });
  std::vector<std::int64_t> contracted;  // self's contracting dims in the order a dot result holds them
  for (auto k : by_partner) contracted.push_back(self_contract[k]);
  auto is_identity = [](const std::vector<std::int64_t>& source) {
    for (std::size_t i = 0; i < source.size(); ++i)
      if (source[i] != static_cast<std::int64_t>(i)) return false;
    return true;
  };
  std::vector<std::int64_t> g_first = self_batch, other_first = self_batch;  // the self dim each result dim holds
  g_first.insert(g_first.end(), self_free.begin(), self_free.end());
  g_first.insert(g_first.end(), contracted.begin(), contracted.end());
  other_first.insert(other_first.end(), contracted.begin(), contracted.end());
  other_first.insert(other_first.end(), self_free.begin(), self_free.end());
  if (!is_identity(g_first) && is_identity(other_first))
    return dot_general(other, g, DotDims{other_batch, g_batch, other_free, g_contract});

  Tensor r = dot_general(g, other, DotDims{g_batch, other_batch, g_contract, other_free});
  if (is_identity(g_first)) return r;
  std::vector<std::int64_t> perm(g_first.size());
  for (std::size_t i = 0; i < g_first.size(); ++i) perm[static_cast<std::size_t>(g_first[i])] = static_cast<std::int64_t>(i);
  return transpose(r, std::move(perm));
}

// The gradient of pooling. A window sum's is a window sum of g dilated by the stride, the window's taps
// reversed by the padding ((K-1)d - lo before, X - 1 - (P-1)s + lo after, as a convolution's input gradient); a
// window max's is select_and_scatter (g to each window's first maximum). Base dilation and second derivatives
// are not supported.
inline Tensor window_vjp(const Op& op, const Tensor& x, const Tensor& g) {
  const WindowDims w = op.attrs.window;  // copies: the ops added below may move the program's attributes
  const std::vector<std::int64_t> lo = op.attrs.lo, hi = op.attrs.hi;
  const Shape xs = x.shape(), gs = g.shape();
  if (op.kind == OpKind::select_and_scatter)
    user_error("grad: the gradient of select_and_scatter is not supported (partir differentiates pooling once)");
  if (std::any_of(w.base_dilation.begin(), w.base_dilation.end(), [](auto d) { return d != 1; }))
    user_error("grad: the gradient of " + std::string(name_of(op.kind)) +
               " with base dilation is not supported (partir differentiates pooling once, not its gradients)");
  if (op.kind == OpKind::reduce_window_max) return select_and_scatter(x, g, w, lo, hi);
  WindowDims back{w.window, std::vector<std::int64_t>(xs.size(), 1), w.strides, w.window_dilation};
  std::vector<std::int64_t> low, high;
  for (std::size_t d = 0; d < xs.size(); ++d) {
    low.push_back((w.window[d] - 1) * w.window_dilation[d] - lo[d]);
    high.push_back(xs[d] - 1 - (gs[d] - 1) * w.strides[d] + lo[d]);
  }
  return reduce_window(g, OpKind::reduce_window_sum, std::move(back), std::move(low), std::move(high));
}

// The gradients of a convolution (ConvDims in op.hpp), both convolutions again (XLA's rules). Per spatial dim
// with stride s, window K taps d apart, padding lo, input size X and output size P:
//   dx: g dilated by s, convolved with the kernel flipped and its features swapped, padding (K-1)d - lo
//       before and X - 1 - (P-1)s + lo after, stride 1;
//   dw: x with batch and features swapped ([C, X..., N]) convolved with g as the kernel ([P..., N, O]), taps
//       s apart, stride d, padding lo before and (K-1)d + (P-1)s + 1 - X' - lo after (X' the dilated input).
// With G feature groups, dx's kernel is each group's kernel with its features swapped (G groups again), and dw
// is each group's dw, concatenated.
// The gradients of those (second derivatives) are not supported: partir differentiates a convolution once.
template <class Needed, class Accumulate>
void conv_vjp(const Op& op, const Tensor& x, const Tensor& w, const Tensor& g, Needed&& needed, Accumulate&& accumulate) {
  const ConvDims c = op.attrs.conv;  // copies: the ops added below may move the program's attributes
  const std::vector<std::int64_t> lo = op.attrs.lo;
  const Shape xs = x.shape(), ws = w.shape(), gs = g.shape();
  const auto spatial = static_cast<std::int64_t>(xs.size()) - 2;
  auto unsupported = [&](const char* what) {
    user_error(std::string("grad: the ") + what + " gradient of a convolution with " +
               (c.flip ? "a flipped window" : "input dilation") +
               " is not supported (partir differentiates a convolution once, not its gradients)");
  };
  auto dims = [](std::int64_t first, std::int64_t count) {
    std::vector<std::int64_t> v(static_cast<std::size_t>(count));
    std::iota(v.begin(), v.end(), first);
    return v;
  };
  const std::int64_t groups = c.feature_groups;
  if (needed(0)) {
    if (std::any_of(c.lhs_dilation.begin(), c.lhs_dilation.end(), [](auto l) { return l != 1; })) unsupported("input");
    std::vector<std::int64_t> low, high;
    for (std::int64_t i = 0; i < spatial; ++i) {
      const auto k = static_cast<std::size_t>(i);
      low.push_back((ws[k] - 1) * c.rhs_dilation[k] - lo[k]);
      high.push_back(xs[k + 1] - 1 - (gs[k + 1] - 1) * c.strides[k] + lo[k]);
    }
    const Tensor swapped = [&] {  // [window..., O / G, C]
      std::vector<std::int64_t> swap = dims(0, spatial);
      if (groups == 1) {
        swap.insert(swap.end(), {spatial + 1, spatial});
        return transpose(w, std::move(swap));
      }
      // [window..., C/G, G, O/G] -> [window..., O/G, G, C/G]
      const std::int64_t in_group = ws[static_cast<std::size_t>(spatial)], out_group = gs.back() / groups;
      Shape split(ws.begin(), ws.begin() + spatial), joined = split;
      split.insert(split.end(), {in_group, groups, out_group});
      joined.insert(joined.end(), {out_group, in_group * groups});
      swap.insert(swap.end(), {spatial + 2, spatial + 1, spatial});
      return reshape(transpose(reshape(w, split), std::move(swap)), joined);
    }();
    const std::vector<std::int64_t> ones(static_cast<std::size_t>(spatial), 1);
    accumulate(0, conv_general(g, swapped, {ones, c.strides, c.rhs_dilation, !c.flip, groups}, std::move(low),
                               std::move(high)));
  }
  if (needed(1)) {
    if (c.flip) unsupported("kernel");
    std::vector<std::int64_t> features_first{spatial + 1}, positions = dims(1, spatial), high, back = dims(1, spatial);
    for (auto d : dims(1, spatial)) features_first.push_back(d);
    features_first.push_back(0);  // x -> [C, X..., N]
    positions.push_back(0);
    positions.push_back(spatial + 1);  // g -> [P..., N, O]
    back.push_back(0);
    back.push_back(spatial + 1);  // [C, K..., O] -> [K..., C, O]
    for (std::int64_t i = 0; i < spatial; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::int64_t dilated = (xs[k + 1] - 1) * c.lhs_dilation[k] + 1;
      high.push_back((ws[k] - 1) * c.rhs_dilation[k] + (gs[k + 1] - 1) * c.strides[k] + 1 - dilated - lo[k]);
    }
    auto kernel_grad = [&](const Tensor& xg, const Tensor& gg) {
      const Tensor dw = conv_general(transpose(xg, features_first), transpose(gg, positions),
                                     {c.rhs_dilation, c.lhs_dilation, c.strides, false}, lo, high);  // [C, K..., O]
      return transpose(dw, back);
    };
    if (groups == 1) {
      accumulate(1, kernel_grad(x, g));
    } else {  // each group's features of x and g
      auto features = [&](const Tensor& t, std::int64_t group) {
        const std::int64_t size = t.shape().back() / groups;
        std::vector<std::int64_t> from(t.shape().size(), 0), to(t.shape().begin(), t.shape().end());
        from.back() = group * size;
        to.back() = (group + 1) * size;
        return slice(t, std::move(from), std::move(to));
      };
      std::vector<Tensor> parts;
      for (std::int64_t group = 0; group < groups; ++group)
        parts.push_back(kernel_grad(features(x, group), features(g, group)));
      accumulate(1, concatenate(parts, spatial + 1));
    }
  }
}

// Calls accumulate(i, contribution) for each operand i of op v that needs an adjoint, given v's adjoint g.
// `op` is a copy: emitting ops grows the program and would invalidate a reference into it.
template <class Accumulate>
void vjp(Program& p, ValueId v, const Op& op, const Tensor& g, const std::vector<char>& needs, Accumulate accumulate) {
  auto operand = [&](std::size_t i) { return Tensor{p, op.operands[i]}; };
  auto depends = [&](ValueId o) { return needs[static_cast<std::size_t>(o)] != 0; };
  auto needed = [&](std::size_t i) { return depends(op.operands[i]); };
  if (std::none_of(op.operands.begin(), op.operands.end(), depends)) return;  // v is a wrt value, its operands not
  const Tensor y{p, v};
  const Attrs& a = op.attrs;
  switch (op.kind) {
    case OpKind::input:
    case OpKind::constant:
    case OpKind::compare:
    case OpKind::count_: return;
    case OpKind::neg: accumulate(0, -g); return;
    case OpKind::exp: accumulate(0, g * y); return;
    case OpKind::log: accumulate(0, g / operand(0)); return;
    case OpKind::tanh: accumulate(0, g * (1.0 - y * y)); return;
    case OpKind::rsqrt: accumulate(0, (-0.5 * g) * (y * y * y)); return;  // d x^-1/2 = -1/2 x^-3/2
    case OpKind::sqrt: accumulate(0, g / (2.0 * y)); return;
    case OpKind::abs: {
      const Tensor x = operand(0), zero = zeros_like(x);
      accumulate(0, g * (compare(x, zero, CompareDir::gt) - compare(x, zero, CompareDir::lt)));
      return;
    }
    case OpKind::add:
      if (needed(0)) accumulate(0, g);
      if (needed(1)) accumulate(1, g);
      return;
    case OpKind::sub:
      if (needed(0)) accumulate(0, g);
      if (needed(1)) accumulate(1, -g);
      return;
    case OpKind::mul:
      if (op.operands[0] == op.operands[1]) {  // x * x (squares): one product instead of two
        const Tensor gx = g * operand(0);
        accumulate(0, gx + gx);
        return;
      }
      if (needed(0)) accumulate(0, g * operand(1));
      if (needed(1)) accumulate(1, g * operand(0));
      return;
    case OpKind::div: {
      const Tensor q = g / operand(1);
      if (needed(0)) accumulate(0, q);
      if (needed(1)) accumulate(1, -(q * y));  // d(a/b)/db = -(a/b)/b
      return;
    }
    case OpKind::max:
    case OpKind::min: {
      const auto wins = op.kind == OpKind::max ? CompareDir::gt : CompareDir::lt;
      const Tensor x0 = operand(0), x1 = operand(1);
      const Tensor g0 = g * (compare(x0, x1, wins) + 0.5 * compare(x0, x1, CompareDir::eq));
      if (needed(0)) accumulate(0, g0);
      if (needed(1)) accumulate(1, g - g0);
      return;
    }
    case OpKind::pow: {
      const Tensor base = operand(0), exponent = operand(1);
      if (needed(0)) {  // b * a^(b-1), taken as 0 where b == 0 (where it would be 0 * inf at a == 0)
        const Tensor zero = zeros_like(exponent);
        accumulate(0, g * select(compare(exponent, zero, CompareDir::eq), zero, exponent * pow(base, exponent - 1.0)));
      }
      if (needed(1)) {  // a^b log a, taken as 0 where a == 0 (there a^b is 0 for b > 0)
        const Tensor zero = zeros_like(base);
        accumulate(1, g * y * log(select(compare(base, zero, CompareDir::eq), full_like(base, 1.0), base)));
      }
      return;
    }
    case OpKind::select: {
      const Tensor mask = operand(0), zero = zeros_like(g);
      if (needed(1)) accumulate(1, select(mask, g, zero));
      if (needed(2)) accumulate(2, select(mask, zero, g));
      return;
    }
    case OpKind::convert: accumulate(0, convert(g, operand(0).dtype())); return;
    case OpKind::dot_general: {
      const auto& d = a.dot;
      const Tensor lhs = operand(0), rhs = operand(1);
      const auto batch = static_cast<std::int64_t>(d.lhs_batch.size());
      const auto lhs_free = lhs.rank() - batch - static_cast<std::int64_t>(d.lhs_contract.size());
      if (needed(0))
        accumulate(0, dot_general_vjp(g, rhs, lhs.rank(), d.lhs_batch, d.lhs_contract, d.rhs_batch, d.rhs_contract,
                                      batch + lhs_free));
      if (needed(1))
        accumulate(1, dot_general_vjp(g, lhs, rhs.rank(), d.rhs_batch, d.rhs_contract, d.lhs_batch, d.lhs_contract,
                                      batch));
      return;
    }
    case OpKind::reduce_sum: {
      const Tensor x = operand(0);
      accumulate(0, broadcast_in_dim(g, x.shape(), kept_dims(x.rank(), a.dims)));
      return;
    }
    case OpKind::reduce_max: {
      const Tensor x = operand(0);
      const auto kept = kept_dims(x.rank(), a.dims);
      const Tensor argmax = compare(x, broadcast_in_dim(y, x.shape(), kept), CompareDir::eq);
      const Tensor ties = broadcast_in_dim(reduce_sum_exact(argmax, a.dims), x.shape(), kept);
      accumulate(0, broadcast_in_dim(g, x.shape(), kept) * argmax / ties);
      return;
    }
    case OpKind::broadcast_in_dim: {
      // Sum over the result dims that the operand does not have or stretches from size 1, then restore
      // the operand's size-1 dims.
      const Tensor x = operand(0);
      std::vector<std::int64_t> summed;
      for (std::int64_t r = 0; r < g.rank(); ++r) {
        auto it = std::find(a.dims.begin(), a.dims.end(), r);
        if (it == a.dims.end() || (x.dim(it - a.dims.begin()) == 1 && g.dim(r) != 1)) summed.push_back(r);
      }
      accumulate(0, reshape(reduce_sum_exact(g, std::move(summed)), x.shape()));
      return;
    }
    case OpKind::reshape: accumulate(0, reshape(g, operand(0).shape())); return;
    case OpKind::transpose: {
      std::vector<std::int64_t> inverse(a.dims.size());
      for (std::size_t i = 0; i < a.dims.size(); ++i)
        inverse[static_cast<std::size_t>(a.dims[i])] = static_cast<std::int64_t>(i);
      accumulate(0, transpose(g, std::move(inverse)));
      return;
    }
    case OpKind::slice: {
      const Shape s = operand(0).shape();  // a copy: the op added below may move the program's types
      std::vector<std::int64_t> high(s.size());
      for (std::size_t i = 0; i < s.size(); ++i) high[i] = s[i] - a.hi[i];
      accumulate(0, pad(g, a.lo, std::move(high)));
      return;
    }
    case OpKind::pad: {
      const Shape s = operand(0).shape();  // a copy: the op added below may move the program's types
      std::vector<std::int64_t> limit(s.size());
      for (std::size_t i = 0; i < s.size(); ++i) limit[i] = a.lo[i] + s[i];
      accumulate(0, slice(g, a.lo, std::move(limit)));
      return;
    }
    case OpKind::add_n:
      for (std::size_t i = 0; i < op.operands.size(); ++i)
        if (needed(i)) accumulate(i, g);
      return;
    case OpKind::concatenate: {
      std::int64_t offset = 0;
      for (std::size_t i = 0; i < op.operands.size(); ++i) {
        const auto size = operand(i).dim(a.axis);
        if (needed(i)) {
          std::vector<std::int64_t> start(static_cast<std::size_t>(g.rank()), 0);
          std::vector<std::int64_t> limit = g.shape();
          start[static_cast<std::size_t>(a.axis)] = offset;
          limit[static_cast<std::size_t>(a.axis)] = offset + size;
          accumulate(i, slice(g, std::move(start), std::move(limit)));
        }
        offset += size;
      }
      return;
    }
    case OpKind::convolution: conv_vjp(op, operand(0), operand(1), g, needed, accumulate); return;
    case OpKind::reduce_window_sum:
    case OpKind::reduce_window_max:
    case OpKind::select_and_scatter: accumulate(0, window_vjp(op, operand(0), g)); return;
    case OpKind::gather: accumulate(0, scatter_add(operand(1), g, operand(0).shape())); return;
    case OpKind::scatter_add: accumulate(1, gather(g, operand(0))); return;
  }
}

// A composite's rule (ir/program.hpp), from its result y and y's adjoint g; math in f32 whatever y's dtype
// (the f32 list), the adjoint of the input in the input's dtype:
//   softmax      dx = y (g - sum(g y))
//   log_softmax  dx = g - exp(y) sum(g)
//   normalize    dx = (g - mean(g) - y mean(g y)) / sigma   (y = (x - mean(x)) / sigma, `saved` = 1 / sigma)
//   rms_normalize dx = (g - y mean(g y)) / rms                (y = x / rms, rms = sqrt(mean(x^2) + eps), `saved` = 1 / rms)
// Reading y rounded to 16 bits costs the gradient less than the 16-bit adjoint it returns to.
inline Tensor composite_vjp(Program& p, ValueId root, const Composite& c, const Tensor& g) {
  auto f32 = [](const Tensor& t) { return is_half(t.dtype()) ? convert(t, DType::f32) : t; };
  const Tensor y = f32(Tensor{p, root}), g32 = f32(g);
  const std::vector<std::int64_t> axis{c.axis};
  Tensor dx = g32;
  switch (c.kind) {
    case Composite::Kind::softmax: dx = y * (g32 - sum(g32 * y, axis, true)); break;
    case Composite::Kind::log_softmax: dx = g32 - exp(y) * sum(g32, axis, true); break;
    case Composite::Kind::normalize:
      dx = (g32 - mean(g32, axis, true) - y * mean(g32 * y, axis, true)) * Tensor{p, c.saved};
      break;
    case Composite::Kind::rms_normalize: dx = (g32 - y * mean(g32 * y, axis, true)) * Tensor{p, c.saved}; break;
  }
  return dx.dtype() == p.type(c.input).dtype ? dx : convert(dx, p.type(c.input).dtype);
}

// The composites whose rule replaces their ops' VJPs: those below the loss whose inner values nothing outside
// them reads (no later op, output or wrt value); any other differentiates op by op.
inline std::map<ValueId, Composite> closed_composites(const Program& p, ValueId loss, const std::vector<ValueId>& wrt) {
  std::vector<ValueId> inside(static_cast<std::size_t>(p.size()), -1);  // the root of the composite v is inside
  std::map<ValueId, Composite> closed;
  for (const auto& [root, c] : p.composites()) {
    if (root > loss) continue;
    closed.emplace(root, c);
    for (ValueId v = c.first; v < root; ++v) inside[static_cast<std::size_t>(v)] = root;
  }
  auto open = [&](ValueId v, ValueId reader) {
    const auto c = closed.find(inside[static_cast<std::size_t>(v)]);
    if (c != closed.end() && !(reader >= c->second.first && reader <= c->first)) closed.erase(c);
  };
  for (ValueId u = 0; u < p.size(); ++u)
    for (auto v : p.op(u).operands) open(v, u);
  for (const auto& o : p.outputs()) open(o.value, -1);
  for (auto w : wrt) open(w, -1);
  return closed;
}

}  // namespace detail

PARTIR_ENTRY std::vector<ValueId> grad(Program& p, ValueId loss, const std::vector<ValueId>& wrt) {
  auto check_defined = [&](ValueId v, const std::string& what) {
    if (v < 0 || v >= p.size())
      user_error("grad: " + what + " %" + std::to_string(v) + " is not defined in program '" + p.name() + "'");
  };
  check_defined(loss, "loss");
  detail::check_loss_type("grad", "loss " + p.label(loss), p.type(loss));
  for (auto w : wrt) {
    check_defined(w, "wrt value");
    if (!is_float(p.type(w).dtype))
      user_error("grad: cannot differentiate with respect to " + p.label(w) + " " + to_string(p.type(w)) +
                 ": only floating-point values have gradients");
  }

  // needs[v]: v is a float value that depends on some wrt value, so its adjoint is worth computing (compare
  // results are piecewise constant: their adjoint would be zero).
  const auto n = static_cast<std::size_t>(loss) + 1;
  std::vector<char> needs(n, 0);
  for (auto w : wrt)
    if (w <= loss) needs[static_cast<std::size_t>(w)] = 1;
  for (ValueId v = 0; v <= loss; ++v) {
    const Op& op = p.op(v);
    if (!is_float(op.type.dtype) || op.kind == OpKind::compare) continue;
    for (auto o : op.operands) needs[static_cast<std::size_t>(v)] |= needs[static_cast<std::size_t>(o)];
  }

  const auto composites = detail::closed_composites(p, loss, wrt);
  std::vector<std::optional<ValueId>> adjoint(n);
  p.mark_backward_start(p.size());
  if (needs[static_cast<std::size_t>(loss)]) {
    adjoint.back() = constant(p, 1.0, {}, p.type(loss).dtype).id();
    p.mark_vjp(p.size() - 1, p.size(), loss);
  }
  // Every use of v comes after v, so v's adjoint is complete when the reverse walk reaches it.
  for (ValueId v = loss; v >= 0; --v) {
    const auto& g = adjoint[static_cast<std::size_t>(v)];
    if (!g) continue;
    const Op op = p.op(v);
    // The cotangent of a tagged value is tagged grad/<tag>, so a tactic can lay out the backward pass at the
    // same boundary (as a sharding constraint's transpose is one in GSPMD). A value already named keeps it.
    if (op.kind != OpKind::input && !op.name.empty() && p.op(*g).kind != OpKind::input && p.op(*g).name.empty())
      p.tag(*g, "grad/" + op.name);
    const ValueId first = static_cast<ValueId>(p.size());
    auto accumulate = [&](ValueId to, const Tensor& contribution) {
      auto& slot = adjoint[static_cast<std::size_t>(to)];
      slot = slot ? (Tensor{p, *slot} + contribution).id() : contribution.id();
    };
    // A composite's inner values get no adjoint: the walk passes them by.
    if (auto c = composites.find(v); c != composites.end()) {
      if (needs[static_cast<std::size_t>(c->second.input)])
        accumulate(c->second.input, detail::composite_vjp(p, v, c->second, Tensor{p, *g}));
    } else {
      detail::vjp(p, v, op, Tensor{p, *g}, needs,
                  [&](std::size_t i, const Tensor& contribution) { accumulate(op.operands[i], contribution); });
    }
    p.mark_vjp(first, static_cast<ValueId>(p.size()), v);
  }

  std::vector<ValueId> grads;
  for (auto w : wrt) {
    if (w <= loss && adjoint[static_cast<std::size_t>(w)]) grads.push_back(*adjoint[static_cast<std::size_t>(w)]);
    else {
      const ValueId first = static_cast<ValueId>(p.size());
      grads.push_back(detail::zeros_like(Tensor{p, w}).id());
      p.mark_vjp(first, static_cast<ValueId>(p.size()), w);
    }
  }
  return grads;
}

PARTIR_ENTRY Program value_and_grad(const Program& f, const std::string& loss_output, std::vector<std::string> wrt) {
  auto loss = f.find_output(loss_output);
  if (!loss) user_error("value_and_grad: program '" + f.name() + "' has no output named '" + loss_output + "'");
  detail::check_loss_type("value_and_grad", "output '" + loss_output + "'", f.type(*loss));
  if (wrt.empty())
    for (auto v : f.inputs())
      if (f.op(v).attrs.input_kind == InputKind::parameter) wrt.push_back(f.op(v).name);
  std::vector<ValueId> ids;
  for (const auto& name : wrt) {
    auto v = f.find_input(name);
    if (!v) user_error("value_and_grad: program '" + f.name() + "' has no input named '" + name + "'");
    ids.push_back(*v);
  }
  Program out = f;
  const auto grads = grad(out, *loss, ids);
  for (std::size_t i = 0; i < wrt.size(); ++i) out.add_output("grad/" + wrt[i], grads[i]);
  return out;
}
#endif

}  // namespace partir
