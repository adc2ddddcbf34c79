#pragma once
// The result type of every op kind from its operand types and attributes. Both the builder (at trace time)
// and the verifier use it, so a malformed op is reported the same way wherever it is found.
#include <algorithm>
#include <set>
#include <span>
#include <string>

#include "partir/config.hpp"
#include "partir/ir/op.hpp"

namespace partir {

// The result type of `kind` on operands of types `in`, or a UserError naming the op and the rule broken.
PARTIR_ENTRY TensorType infer_type(OpKind kind, std::span<const TensorType> in, const Attrs& a);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

inline std::string dims_str(const std::vector<std::int64_t>& v) { return to_string(Shape(v)); }

inline void check_dims(std::string_view op, std::string_view what, const std::vector<std::int64_t>& dims,
                       std::int64_t rank, bool unique = true) {
  std::set<std::int64_t> seen;
  for (auto d : dims) {
    if (d < 0 || d >= rank)
      user_error(std::string(op) + ": " + std::string(what) + " dim " + std::to_string(d) +
                 " is out of range for rank " + std::to_string(rank));
    if (unique && !seen.insert(d).second)
      user_error(std::string(op) + ": " + std::string(what) + " dim " + std::to_string(d) + " appears twice");
  }
}

}  // namespace detail

PARTIR_ENTRY TensorType infer_type(OpKind kind, std::span<const TensorType> in, const Attrs& a) {
  const std::string op(name_of(kind));
  auto fail = [&](const std::string& why) -> TensorType { user_error(op + ": " + why); };
  auto show = [&](std::size_t i) { return to_string(in[i]); };
  if (info(kind).arity >= 0 && static_cast<int>(in.size()) != info(kind).arity)
    return fail("expects " + std::to_string(info(kind).arity) + " operands, got " + std::to_string(in.size()));

  switch (info(kind).op_class) {
    case OpClass::leaf: {
      if (kind == OpKind::constant) {
        if (a.literal.size() != 1 && static_cast<std::int64_t>(a.literal.size()) != num_elements(a.shape))
          return fail("literal has " + std::to_string(a.literal.size()) + " values for shape " +
                      to_string(a.shape));
      }
      for (auto d : a.shape)
        if (d < 0) return fail("negative dimension in shape " + to_string(a.shape));
      return {a.shape, a.dtype};
    }
    case OpClass::unary:
      if (kind == OpKind::convert) return {in[0].shape, a.dtype};
      if (!is_float(in[0].dtype)) return fail("needs a floating-point operand, got " + show(0));
      return in[0];
    case OpClass::binary:
      if (in[0] != in[1]) return fail("operand types differ: " + show(0) + " vs " + show(1));
      if (!is_float(in[0].dtype) && kind != OpKind::compare)
        return fail("needs floating-point operands, got " + show(0));
      return in[0];
    case OpClass::other: break;
  }

  switch (kind) {
    case OpKind::select:
      if (in[0].shape != in[1].shape || in[1] != in[2])
        return fail("mask, on_true and on_false must agree: " + show(0) + ", " + show(1) + ", " + show(2));
      return in[1];
    case OpKind::dot_general: {
      const auto& d = a.dot;
      const auto &l = in[0], &r = in[1];
      if (l.dtype != r.dtype) return fail("operand dtypes differ: " + show(0) + " vs " + show(1));
      if (d.lhs_batch.size() != d.rhs_batch.size() || d.lhs_contract.size() != d.rhs_contract.size())
        return fail("lhs and rhs must name as many batch and contracting dims");
      std::vector<std::int64_t> lused = d.lhs_batch, rused = d.rhs_batch;
      lused.insert(lused.end(), d.lhs_contract.begin(), d.lhs_contract.end());
      rused.insert(rused.end(), d.rhs_contract.begin(), d.rhs_contract.end());
      detail::check_dims(op, "lhs", lused, l.rank());
      detail::check_dims(op, "rhs", rused, r.rank());
      auto pair_check = [&](const auto& ld, const auto& rd, const char* what) {
        for (std::size_t i = 0; i < ld.size(); ++i)
          if (l.shape[ld[i]] != r.shape[rd[i]])
            fail(std::string(what) + " dims differ: lhs dim " + std::to_string(ld[i]) + " of " + show(0) +
                 " vs rhs dim " + std::to_string(rd[i]) + " of " + show(1));
      };
      pair_check(d.lhs_batch, d.rhs_batch, "batch");
      pair_check(d.lhs_contract, d.rhs_contract, "contracting");
      // result: batch dims, then lhs free dims, then rhs free dims (XLA's convention)
      Shape out;
      for (auto b : d.lhs_batch) out.push_back(l.shape[b]);
      for (std::int64_t i = 0; i < l.rank(); ++i)
        if (std::find(lused.begin(), lused.end(), i) == lused.end()) out.push_back(l.shape[i]);
      for (std::int64_t i = 0; i < r.rank(); ++i)
        if (std::find(rused.begin(), rused.end(), i) == rused.end()) out.push_back(r.shape[i]);
      return {out, l.dtype};
    }
    case OpKind::reduce_sum:
    case OpKind::reduce_max: {
      detail::check_dims(op, "reduced", a.dims, in[0].rank());
      Shape out;
      for (std::int64_t i = 0; i < in[0].rank(); ++i)
        if (std::find(a.dims.begin(), a.dims.end(), i) == a.dims.end()) out.push_back(in[0].shape[i]);
      return {out, in[0].dtype};
    }
    case OpKind::broadcast_in_dim: {
      const auto rank = static_cast<std::int64_t>(a.shape.size());
      for (auto d : a.shape)
        if (d < 0) return fail("negative dimension in shape " + to_string(a.shape));
      if (static_cast<std::int64_t>(a.dims.size()) != in[0].rank())
        return fail("dims " + detail::dims_str(a.dims) + " must map each of the " + std::to_string(in[0].rank()) +
                    " operand dims of " + show(0));
      detail::check_dims(op, "result", a.dims, rank);
      for (std::size_t i = 0; i + 1 < a.dims.size(); ++i)
        if (a.dims[i] >= a.dims[i + 1]) return fail("dims " + detail::dims_str(a.dims) + " must increase");
      for (std::size_t i = 0; i < a.dims.size(); ++i) {
        auto s = in[0].shape[i];
        if (s != 1 && s != a.shape[a.dims[i]])
          return fail("operand " + show(0) + " dim " + std::to_string(i) + " (size " + std::to_string(s) +
                      ") cannot broadcast to result dim " + std::to_string(a.dims[i]) + " of " + to_string(a.shape));
      }
      return {a.shape, in[0].dtype};
    }
    case OpKind::reshape:
      for (auto d : a.shape)
        if (d < 0) return fail("negative dimension in shape " + to_string(a.shape));
      if (num_elements(a.shape) != in[0].elements())
        return fail("cannot reshape " + show(0) + " to " + to_string(a.shape) + ": element counts differ");
      return {a.shape, in[0].dtype};
    case OpKind::transpose: {
      if (static_cast<std::int64_t>(a.dims.size()) != in[0].rank())
        return fail("permutation " + detail::dims_str(a.dims) + " does not match " + show(0));
      detail::check_dims(op, "permutation", a.dims, in[0].rank());
      Shape out;
      for (auto d : a.dims) out.push_back(in[0].shape[d]);
      return {out, in[0].dtype};
    }
    case OpKind::slice:
    case OpKind::pad: {
      const auto r = static_cast<std::size_t>(in[0].rank());
      if (a.lo.size() != r || a.hi.size() != r)
        return fail("needs " + std::to_string(r) + " lo and hi bounds for " + show(0));
      Shape out = in[0].shape;
      for (std::size_t i = 0; i < r; ++i) {
        if (kind == OpKind::slice) {
          if (a.lo[i] < 0 || a.lo[i] > a.hi[i] || a.hi[i] > in[0].shape[i])
            return fail("bounds [" + std::to_string(a.lo[i]) + ", " + std::to_string(a.hi[i]) + ") of dim " +
                        std::to_string(i) + " are outside " + show(0));
          out[i] = a.hi[i] - a.lo[i];
        } else {
          if (a.lo[i] < 0 || a.hi[i] < 0) return fail("negative padding on dim " + std::to_string(i));
          out[i] += a.lo[i] + a.hi[i];
        }
      }
      return {out, in[0].dtype};
    }
    case OpKind::add_n: {
      if (in.empty()) return fail("needs at least one operand");
      if (!is_float(in[0].dtype)) return fail("needs floating-point operands, got " + show(0));
      for (std::size_t i = 1; i < in.size(); ++i)
        if (in[i] != in[0]) return fail("operand types differ: " + show(0) + " vs " + show(i));
      return in[0];
    }
    case OpKind::concatenate: {
      if (in.empty()) return fail("needs at least one operand");
      Shape out = in[0].shape;
      if (a.axis < 0 || a.axis >= in[0].rank()) return fail("axis " + std::to_string(a.axis) + " out of range for " + show(0));
      for (std::size_t i = 1; i < in.size(); ++i) {
        bool ok = in[i].dtype == in[0].dtype && in[i].rank() == in[0].rank();
        for (std::int64_t d = 0; ok && d < in[0].rank(); ++d)
          ok = d == a.axis || in[i].shape[d] == in[0].shape[d];
        if (!ok) return fail("operand " + std::to_string(i) + " " + show(i) + " does not fit " + show(0) +
                             " along axis " + std::to_string(a.axis));
        out[a.axis] += in[i].shape[a.axis];
      }
      return {out, in[0].dtype};
    }
    case OpKind::gather: {  // table [V, F...], indices [I...] -> [I..., F...]
      if (in[0].rank() < 1) return fail("table must have rank >= 1, got " + show(0));
      if (in[1].dtype != DType::i32) return fail("indices must be i32, got " + show(1));
      Shape out = in[1].shape;
      out.insert(out.end(), in[0].shape.begin() + 1, in[0].shape.end());
      return {out, in[0].dtype};
    }
    case OpKind::scatter_add: {  // indices [I...], updates [I..., F...] -> [V, F...] (a.shape)
      if (in[0].dtype != DType::i32) return fail("indices must be i32, got " + show(0));
      Shape expect = in[0].shape;
      if (a.shape.empty()) return fail("result shape must have rank >= 1");
      for (auto d : a.shape)
        if (d < 0) return fail("negative dimension in shape " + to_string(a.shape));
      expect.insert(expect.end(), a.shape.begin() + 1, a.shape.end());
      if (in[1].shape != expect)
        return fail("updates " + show(1) + " must have shape " + to_string(expect) + " for indices " + show(0) +
                    " and result " + to_string(a.shape));
      return {a.shape, in[1].dtype};
    }
    case OpKind::reduce_window_sum:
    case OpKind::reduce_window_max:
    case OpKind::select_and_scatter: {
      const std::int64_t r = in[0].rank();
      const auto& w = a.window;
      for (const auto* v : {&w.window, &w.strides, &w.base_dilation, &w.window_dilation, &a.lo, &a.hi})
        if (static_cast<std::int64_t>(v->size()) != r)
          return fail("needs a window size, stride, dilations and padding for each of the " + std::to_string(r) +
                      " dims of " + show(0));
      if (!is_float(in[0].dtype)) return fail("needs a floating-point operand, got " + show(0));
      Shape out;
      for (std::size_t d = 0; d < static_cast<std::size_t>(r); ++d) {
        if (w.window[d] < 1 || w.strides[d] < 1 || w.base_dilation[d] < 1 || w.window_dilation[d] < 1)
          return fail("window, stride and dilations must be >= 1 (dim " + std::to_string(d) + ")");
        const std::int64_t size = in[0].shape[d];
        const std::int64_t padded = (size > 0 ? (size - 1) * w.base_dilation[d] + 1 : 0) + a.lo[d] + a.hi[d];
        const std::int64_t span = (w.window[d] - 1) * w.window_dilation[d] + 1;
        if (span > padded)
          return fail("window of " + std::to_string(span) + " on dim " + std::to_string(d) +
                      " does not fit the padded operand of " + std::to_string(padded) + " (" + show(0) + ")");
        out.push_back((padded - span) / w.strides[d] + 1);
      }
      if (kind != OpKind::select_and_scatter) return {out, in[0].dtype};
      if (in[1] != TensorType{out, in[0].dtype})
        return fail("the gradient " + show(1) + " must have the windows' type " + to_string(TensorType{out, in[0].dtype}) +
                    " (operand " + show(0) + ")");
      return in[0];
    }
    case OpKind::convolution: {
      const std::int64_t r = in[0].rank(), spatial = r - 2;
      if (r < 3) return fail("input must be [batch, spatial..., features] (rank >= 3), got " + show(0));
      if (in[1].rank() != r)
        return fail("kernel " + show(1) + " must be [window..., in features, out features], of the input's rank " +
                    std::to_string(r) + " (input " + show(0) + ")");
      if (in[0].dtype != in[1].dtype || !is_float(in[0].dtype))
        return fail("needs floating-point operands of one dtype, got " + show(0) + " and " + show(1));
      const auto& c = a.conv;
      const std::int64_t groups = c.feature_groups, features = in[0].shape[r - 1], outs = in[1].shape.back();
      if (groups < 1 || features % groups != 0 || outs % groups != 0)
        return fail(std::to_string(groups) + " feature groups must divide the input's " + std::to_string(features) +
                    " features and the kernel's " + std::to_string(outs) + " output features (" + show(0) +
                    ", kernel " + show(1) + ")");
      if (in[1].shape[spatial] * groups != features)
        return fail("kernel " + show(1) + " reads " + std::to_string(in[1].shape[spatial]) + " features" +
                    (groups > 1 ? " in each of " + std::to_string(groups) + " groups" : std::string()) + ", input " +
                    show(0) + " has " + std::to_string(features));
      for (const auto* v : {&c.strides, &c.lhs_dilation, &c.rhs_dilation, &a.lo, &a.hi})
        if (static_cast<std::int64_t>(v->size()) != spatial)
          return fail("needs a stride, dilations and padding for each of the " + std::to_string(spatial) +
                      " spatial dims of " + show(0));
      Shape out{in[0].shape[0]};
      for (std::int64_t i = 0; i < spatial; ++i) {
        const auto k = static_cast<std::size_t>(i);
        if (c.strides[k] < 1 || c.lhs_dilation[k] < 1 || c.rhs_dilation[k] < 1)
          return fail("stride and dilations must be >= 1 (spatial dim " + std::to_string(i) + ")");
        const std::int64_t size = in[0].shape[k + 1], taps = in[1].shape[k];
        const std::int64_t padded = (size > 0 ? (size - 1) * c.lhs_dilation[k] + 1 : 0) + a.lo[k] + a.hi[k];
        const std::int64_t window = taps > 0 ? (taps - 1) * c.rhs_dilation[k] + 1 : 0;
        if (window < 1 || window > padded)
          return fail("window of " + std::to_string(window) + " on spatial dim " + std::to_string(i) +
                      " does not fit the padded input of " + std::to_string(padded) + " (" + show(0) + ", kernel " +
                      show(1) + ")");
        out.push_back((padded - window) / c.strides[k] + 1);
      }
      out.push_back(in[1].shape[static_cast<std::size_t>(r - 1)]);
      return {out, in[0].dtype};
    }
    default: break;
  }
  internal_error("no shape rule for " + op);
}
#endif

}  // namespace partir
