#pragma once
// The DSL's primitive operations: one function per IR op, numpy-style broadcasting for elementwise
// arithmetic, and operator overloads. Composite functions (softmax, losses...) live in functional.hpp.
#include <algorithm>
#include <numeric>

#include "partir/dsl/tensor.hpp"

namespace partir {

namespace detail {

inline Tensor emit(Program& p, OpKind kind, std::vector<ValueId> operands, Attrs attrs = {}) {
  return {p, p.add(kind, std::move(operands), std::move(attrs))};
}

inline Program& same_program(const Tensor& a, const Tensor& b, std::string_view op) {
  if (&a.program() != &b.program())
    user_error(std::string(op) + ": operands belong to different programs (tensors from two traces were mixed)");
  return a.program();
}

inline std::int64_t normalize_dim(std::int64_t d, std::int64_t rank, std::string_view op) {
  if (d < -rank || d >= rank)
    user_error(std::string(op) + ": dim " + std::to_string(d) + " is out of range for rank " + std::to_string(rank));
  return d < 0 ? d + rank : d;
}

}  // namespace detail

inline Tensor constant(Program& p, double value, Shape shape = {}, DType dtype = DType::f32) {
  Attrs a;
  a.literal = {value};
  a.shape = std::move(shape);
  a.dtype = dtype;
  return detail::emit(p, OpKind::constant, {}, std::move(a));
}
inline Tensor constant(Program& p, std::vector<double> values, Shape shape, DType dtype = DType::f32) {
  Attrs a;
  a.literal = std::move(values);
  a.shape = std::move(shape);
  a.dtype = dtype;
  return detail::emit(p, OpKind::constant, {}, std::move(a));
}
// A constant shaped and typed like `like`.
inline Tensor full_like(const Tensor& like, double value) {
  Tensor scalar = constant(like.program(), value, {}, like.dtype());
  if (like.rank() == 0) return scalar;
  Attrs a;
  a.shape = like.shape();
  return detail::emit(like.program(), OpKind::broadcast_in_dim, {scalar.id()}, std::move(a));
}
inline Tensor broadcast_in_dim(const Tensor& x, Shape shape, std::vector<std::int64_t> dims) {
  Attrs a;
  a.shape = std::move(shape);
  a.dims = std::move(dims);
  return detail::emit(x.program(), OpKind::broadcast_in_dim, {x.id()}, std::move(a));
}

// 0, 1, ..., n-1 along `dim` of `shape`.
inline Tensor iota(Program& p, Shape shape, std::int64_t dim, DType dtype = DType::f32) {
  if (dim < 0 || dim >= static_cast<std::int64_t>(shape.size()))
    user_error("iota: dim " + std::to_string(dim) + " is out of range for shape " + to_string(shape));
  // One line of values broadcast: a program never holds the whole array (a cross-entropy's one-hot over a
  // 51,200-word vocabulary and a batch of 512 x 2048 would be a 200 GB constant).
  const std::int64_t n = shape.at(static_cast<std::size_t>(dim));
  std::vector<double> values(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(i);
  const Tensor line = constant(p, std::move(values), {n}, dtype);
  return shape.size() == 1 ? line : broadcast_in_dim(line, std::move(shape), {dim});
}

// numpy broadcasting: dims align from the right; a size-1 or missing dim stretches.
inline Tensor broadcast_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const auto r = static_cast<std::int64_t>(shape.size());
  if (x.rank() > r)
    user_error("broadcast: cannot broadcast " + to_string(x.type()) + " to " + to_string(shape));
  std::vector<std::int64_t> dims;
  for (std::int64_t i = 0; i < x.rank(); ++i) {
    std::int64_t target = r - x.rank() + i;
    if (x.dim(i) != 1 && x.dim(i) != shape[target])
      user_error("broadcast: cannot broadcast " + to_string(x.type()) + " to " + to_string(shape));
    dims.push_back(target);
  }
  return broadcast_in_dim(x, shape, std::move(dims));
}

inline Shape broadcast_shapes(const Shape& a, const Shape& b, std::string_view op) {
  Shape out(std::max(a.size(), b.size()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::int64_t da = i < out.size() - a.size() ? 1 : a[i - (out.size() - a.size())];
    std::int64_t db = i < out.size() - b.size() ? 1 : b[i - (out.size() - b.size())];
    if (da != db && da != 1 && db != 1)
      user_error(std::string(op) + ": shapes " + to_string(a) + " and " + to_string(b) + " do not broadcast (dim " +
                 std::to_string(i) + ": " + std::to_string(da) + " vs " + std::to_string(db) + ")");
    out[i] = std::max(da, db);
  }
  return out;
}

inline Tensor unary(OpKind kind, const Tensor& x) { return detail::emit(x.program(), kind, {x.id()}); }

inline Tensor binary(OpKind kind, const Tensor& a, const Tensor& b, Attrs attrs = {}) {
  const auto op = name_of(kind);
  Program& p = detail::same_program(a, b, op);
  if (a.dtype() != b.dtype())
    user_error(std::string(op) + ": dtypes differ: " + to_string(a.type()) + " vs " + to_string(b.type()) +
               " (partir never promotes implicitly: convert() one operand)");
  Shape s = broadcast_shapes(a.shape(), b.shape(), op);
  return detail::emit(p, kind, {broadcast_to(a, s).id(), broadcast_to(b, s).id()}, std::move(attrs));
}

inline Tensor neg(const Tensor& x) { return unary(OpKind::neg, x); }
inline Tensor exp(const Tensor& x) { return unary(OpKind::exp, x); }
inline Tensor log(const Tensor& x) { return unary(OpKind::log, x); }
inline Tensor tanh(const Tensor& x) { return unary(OpKind::tanh, x); }
inline Tensor sqrt(const Tensor& x) { return unary(OpKind::sqrt, x); }
inline Tensor rsqrt(const Tensor& x) { return unary(OpKind::rsqrt, x); }
inline Tensor abs(const Tensor& x) { return unary(OpKind::abs, x); }
inline Tensor maximum(const Tensor& a, const Tensor& b) { return binary(OpKind::max, a, b); }
inline Tensor minimum(const Tensor& a, const Tensor& b) { return binary(OpKind::min, a, b); }
inline Tensor pow(const Tensor& a, const Tensor& b) { return binary(OpKind::pow, a, b); }

inline Tensor compare(const Tensor& a, const Tensor& b, CompareDir dir) {
  Attrs attrs;
  attrs.cmp = dir;
  return binary(OpKind::compare, a, b, std::move(attrs));
}
// select(mask, a, b): a where mask != 0, else b; all three broadcast together.
inline Tensor select(const Tensor& mask, const Tensor& a, const Tensor& b) {
  detail::same_program(mask, a, "select");
  Shape s = broadcast_shapes(broadcast_shapes(mask.shape(), a.shape(), "select"), b.shape(), "select");
  return detail::emit(a.program(), OpKind::select,
                      {broadcast_to(mask, s).id(), broadcast_to(a, s).id(), broadcast_to(b, s).id()});
}
inline Tensor convert(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Attrs a;
  a.dtype = dtype;
  return detail::emit(x.program(), OpKind::convert, {x.id()}, std::move(a));
}

inline Tensor operator+(const Tensor& a, const Tensor& b) { return binary(OpKind::add, a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return binary(OpKind::sub, a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return binary(OpKind::mul, a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return binary(OpKind::div, a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
#define PARTIR_SCALAR_OPERATOR(op)                                                                              \
  inline Tensor operator op(const Tensor& a, double b) { return a op constant(a.program(), b, {}, a.dtype()); } \
  inline Tensor operator op(double a, const Tensor& b) { return constant(b.program(), a, {}, b.dtype()) op b; }
PARTIR_SCALAR_OPERATOR(+)
PARTIR_SCALAR_OPERATOR(-)
PARTIR_SCALAR_OPERATOR(*)
PARTIR_SCALAR_OPERATOR(/)
#undef PARTIR_SCALAR_OPERATOR

inline Tensor dot_general(const Tensor& a, const Tensor& b, DotDims dims) {
  Attrs attrs;
  attrs.dot = std::move(dims);
  return detail::emit(detail::same_program(a, b, "dot_general"), OpKind::dot_general, {a.id(), b.id()},
                      std::move(attrs));
}

// numpy matmul for rank >= 2: contracts a's last dim with b's second-to-last; a rank-2 b multiplies every
// leading index of a; otherwise leading dims are batch dims and must agree.
inline Tensor matmul(const Tensor& a, const Tensor& b) {
  auto fail = [&](const std::string& why) -> Tensor {
    user_error("matmul: cannot multiply " + to_string(a.type()) + " by " + to_string(b.type()) + ": " + why);
  };
  if (a.rank() < 2 || b.rank() < 2) return fail("both operands need rank >= 2");
  if (a.dim(-1) != b.dim(-2))
    return fail("inner dims " + std::to_string(a.dim(-1)) + " and " + std::to_string(b.dim(-2)) + " differ");
  DotDims d;
  d.lhs_contract = {a.rank() - 1};
  d.rhs_contract = {b.rank() - 2};
  if (b.rank() == 2) return dot_general(a, b, d);
  if (a.rank() != b.rank()) return fail("batched matmul needs equal ranks");
  for (std::int64_t i = 0; i < a.rank() - 2; ++i) {
    if (a.dim(i) != b.dim(i)) return fail("batch dim " + std::to_string(i) + " differs");
    d.lhs_batch.push_back(i);
    d.rhs_batch.push_back(i);
  }
  return dot_general(a, b, d);
}

inline std::vector<std::int64_t> normalize_dims(const std::vector<std::int64_t>& dims, std::int64_t rank,
                                                std::string_view op) {
  std::vector<std::int64_t> out;
  for (auto d : dims) out.push_back(detail::normalize_dim(d, rank, op));
  std::sort(out.begin(), out.end());
  return out;
}

namespace detail {
inline Tensor reduce(OpKind kind, const Tensor& x, std::vector<std::int64_t> dims, bool keepdims) {
  if (dims.empty()) {  // all dims
    dims.resize(static_cast<std::size_t>(x.rank()));
    std::iota(dims.begin(), dims.end(), 0);
  }
  Attrs a;
  a.dims = normalize_dims(dims, x.rank(), name_of(kind));
  Tensor r = emit(x.program(), kind, {x.id()}, a);
  if (!keepdims) return r;
  Shape kept = x.shape();
  for (auto d : a.dims) kept[static_cast<std::size_t>(d)] = 1;
  Attrs reshape;
  reshape.shape = kept;
  return emit(x.program(), OpKind::reshape, {r.id()}, std::move(reshape));
}
}  // namespace detail

// Reductions over `dims` (empty: all dims; negative dims count from the end).
inline Tensor sum(const Tensor& x, std::vector<std::int64_t> dims = {}, bool keepdims = false) {
  return detail::reduce(OpKind::reduce_sum, x, std::move(dims), keepdims);
}
inline Tensor max(const Tensor& x, std::vector<std::int64_t> dims = {}, bool keepdims = false) {
  return detail::reduce(OpKind::reduce_max, x, std::move(dims), keepdims);
}
inline Tensor mean(const Tensor& x, std::vector<std::int64_t> dims = {}, bool keepdims = false) {
  Tensor s = sum(x, dims, keepdims);
  return s * (static_cast<double>(s.type().elements()) / static_cast<double>(x.type().elements()));
}

inline Tensor reshape(const Tensor& x, Shape shape) {
  std::int64_t known = 1, infer = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < -1)
      user_error("reshape: dim " + std::to_string(i) + " of " + to_string(shape) +
                 " is negative (only -1, inferred from the rest, is allowed)");
    if (shape[i] == -1) {
      if (infer >= 0) user_error("reshape: only one dim of " + to_string(shape) + " may be -1");
      infer = static_cast<std::int64_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0 && known > 0) shape[static_cast<std::size_t>(infer)] = x.type().elements() / known;
  if (num_elements(shape) != x.type().elements())
    user_error("reshape: cannot reshape " + to_string(x.type()) + " to " + to_string(shape) + ": element counts differ");
  if (shape == x.shape()) return x;
  Attrs a;
  a.shape = std::move(shape);
  return detail::emit(x.program(), OpKind::reshape, {x.id()}, std::move(a));
}

// transpose(x, perm): result dim i is x's dim perm[i]; without perm, reverses the dims.
inline Tensor transpose(const Tensor& x, std::vector<std::int64_t> perm = {}) {
  if (perm.empty())
    for (auto d = x.rank() - 1; d >= 0; --d) perm.push_back(d);
  Attrs a;
  a.dims = std::move(perm);
  return detail::emit(x.program(), OpKind::transpose, {x.id()}, std::move(a));
}

inline Tensor slice(const Tensor& x, std::vector<std::int64_t> start, std::vector<std::int64_t> limit) {
  Attrs a;
  a.lo = std::move(start);
  a.hi = std::move(limit);
  return detail::emit(x.program(), OpKind::slice, {x.id()}, std::move(a));
}
inline Tensor pad(const Tensor& x, std::vector<std::int64_t> low, std::vector<std::int64_t> high) {
  Attrs a;
  a.lo = std::move(low);
  a.hi = std::move(high);
  return detail::emit(x.program(), OpKind::pad, {x.id()}, std::move(a));
}
// The convolution op with every attribute given (autodiff's form); conv() below is the user's.
inline Tensor conv_general(const Tensor& x, const Tensor& w, ConvDims dims, std::vector<std::int64_t> low,
                           std::vector<std::int64_t> high) {
  Attrs a;
  a.conv = std::move(dims);
  a.lo = std::move(low);
  a.hi = std::move(high);
  return detail::emit(detail::same_program(x, w, "convolution"), OpKind::convolution, {x.id(), w.id()}, std::move(a));
}
// A window sum or max (kind: reduce_window_sum or reduce_window_max) over every dim of x (WindowDims in op.hpp),
// padding with the reduction's identity.
inline Tensor reduce_window(const Tensor& x, OpKind kind, WindowDims window, std::vector<std::int64_t> low,
                            std::vector<std::int64_t> high) {
  if (kind != OpKind::reduce_window_sum && kind != OpKind::reduce_window_max)
    user_error("reduce_window: kind must be reduce_window_sum or reduce_window_max, got " + std::string(name_of(kind)));
  Attrs a;
  a.window = std::move(window);
  a.lo = std::move(low);
  a.hi = std::move(high);
  return detail::emit(x.program(), kind, {x.id()}, std::move(a));
}
// x's shape, with g (a window max's result type) added at each window's first maximum of x.
inline Tensor select_and_scatter(const Tensor& x, const Tensor& g, WindowDims window, std::vector<std::int64_t> low,
                                 std::vector<std::int64_t> high) {
  Attrs a;
  a.window = std::move(window);
  a.lo = std::move(low);
  a.hi = std::move(high);
  return detail::emit(detail::same_program(x, g, "select_and_scatter"), OpKind::select_and_scatter, {x.id(), g.id()},
                      std::move(a));
}
// Per spatial dim of a convolution: stride, zero padding before and after, and the window's dilation. Empty
// lists mean 1, 0, 0 and 1 for every spatial dim. feature_groups: see ConvDims (C for a depthwise convolution).
struct ConvWindow {
  std::vector<std::int64_t> strides, padding_low, padding_high, dilation;
  std::int64_t feature_groups = 1;
};
// x [N, spatial..., C] (NHWC) convolved with w [window..., C / groups, O] (HWIO) -> [N, spatial'..., O]: as
// TensorFlow and XLA compute it (cross-correlation: the window is not reversed).
inline Tensor conv(const Tensor& x, const Tensor& w, const ConvWindow& window = {}) {
  const auto spatial = static_cast<std::size_t>(std::max<std::int64_t>(x.rank() - 2, 0));
  auto each = [&](const std::vector<std::int64_t>& v, std::int64_t fill) {
    return v.empty() ? std::vector<std::int64_t>(spatial, fill) : v;
  };
  return conv_general(x, w,
                      {each(window.strides, 1), each({}, 1), each(window.dilation, 1), false, window.feature_groups},
                      each(window.padding_low, 0), each(window.padding_high, 0));
}
inline Tensor concatenate(const std::vector<Tensor>& xs, std::int64_t axis) {
  if (xs.empty()) user_error("concatenate: needs at least one tensor");
  std::vector<ValueId> ids;
  for (const auto& x : xs) {
    detail::same_program(xs[0], x, "concatenate");
    ids.push_back(x.id());
  }
  Attrs a;
  a.axis = detail::normalize_dim(axis, xs[0].rank(), "concatenate");
  return detail::emit(xs[0].program(), OpKind::concatenate, std::move(ids), std::move(a));
}

// xs[0] + xs[1] + ... as one op (same types). Unlike a chain of adds, partitioning may sum the terms that are
// partial sums over the same axes before reducing them: one collective per group of axes, whatever the order.
inline Tensor add_n(const std::vector<Tensor>& xs) {
  if (xs.empty()) user_error("add_n: needs at least one tensor");
  std::vector<ValueId> ids;
  for (const auto& x : xs) {
    detail::same_program(xs[0], x, "add_n");
    ids.push_back(x.id());
  }
  return detail::emit(xs[0].program(), OpKind::add_n, std::move(ids));
}

// Embedding lookup: rows of table [V, F...] at indices [I...] (i32) -> [I..., F...].
inline Tensor gather(const Tensor& table, const Tensor& indices) {
  return detail::emit(detail::same_program(table, indices, "gather"), OpKind::gather, {table.id(), indices.id()});
}
// The transpose of gather: adds each row of updates [I..., F...] into row indices[i] of zeros(shape).
inline Tensor scatter_add(const Tensor& indices, const Tensor& updates, Shape shape) {
  Attrs a;
  a.shape = std::move(shape);
  return detail::emit(detail::same_program(indices, updates, "scatter_add"), OpKind::scatter_add,
                      {indices.id(), updates.id()}, std::move(a));
}

}  // namespace partir
