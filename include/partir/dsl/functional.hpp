#pragma once
// Composite functions built from the primitives (so sharding rules and kernels need nothing new).
// The f32 list: softmax, log_softmax, layer_norm's statistics, cross_entropy and mse compute in f32 when
// given 16-bit values (exp, sums and variances lose too much in 8 or 11 mantissa bits; PyTorch autocast's
// list), and return to the input's dtype, except losses, which stay f32. softmax, log_softmax and layer_norm's
// normalization are composites: their gradient is one rule that reads their result (autodiff/grad.hpp), so
// the backward pass keeps no f32 inner value of theirs.
#include <cmath>
#include <numbers>

#include "partir/dsl/ops.hpp"

namespace partir {

inline Tensor relu(const Tensor& x) { return maximum(x, full_like(x, 0.0)); }
inline Tensor sigmoid(const Tensor& x) { return 1.0 / (1.0 + exp(-x)); }
// GELU, tanh approximation (as in GPT-2 and Megatron).
inline Tensor gelu(const Tensor& x) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

namespace detail {
// x in f32 if it is a 16-bit float (the f32 list's inputs), else x.
inline Tensor f32_if_half(const Tensor& x) { return is_half(x.dtype()) ? convert(x, DType::f32) : x; }

// The ops traced since `c.first`, ending in `result`, as one composite with its own gradient rule
// (ir/program.hpp): the backward pass keeps the result, not the inner values.
inline Tensor composite(const Tensor& result, Composite c) {
  result.program().mark_composite(result.id(), c);
  return result;
}
}  // namespace detail

// Along `axis`; subtracting the max keeps exp from overflowing and does not change the result.
inline Tensor log_softmax(const Tensor& x, std::int64_t axis = -1) {
  const ValueId first = x.program().size();
  const Tensor x32 = detail::f32_if_half(x);
  Tensor shifted = x32 - max(x32, {axis}, true);
  return detail::composite(convert(shifted - log(sum(exp(shifted), {axis}, true)), x.dtype()),
                           {Composite::Kind::log_softmax, first, x.id(), -1, axis});
}
inline Tensor softmax(const Tensor& x, std::int64_t axis = -1) {
  const ValueId first = x.program().size();
  const Tensor x32 = detail::f32_if_half(x);
  Tensor e = exp(x32 - max(x32, {axis}, true));
  return detail::composite(convert(e / sum(e, {axis}, true), x.dtype()),
                           {Composite::Kind::softmax, first, x.id(), -1, axis});
}

// Normalizes over the last dim, then scales and shifts by gamma and beta ([features] each).
inline Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps = 1e-5) {
  const ValueId first = x.program().size();
  const Tensor x32 = detail::f32_if_half(x);
  Tensor centered = x32 - mean(x32, {-1}, true);
  const Tensor inverse_sigma = rsqrt(mean(centered * centered, {-1}, true) + eps);
  const Tensor normalized = detail::composite(convert(centered * inverse_sigma, x.dtype()),
                                              {Composite::Kind::normalize, first, x.id(), inverse_sigma.id(), -1});
  return normalized * gamma + beta;
}

// RMSNorm (Zhang & Sennrich 2019; Llama): x / sqrt(mean(x^2) + eps) over the last dim, times weight
// ([features]); no centring, no shift. The statistics in f32, as layer_norm's (and Hugging Face's LlamaRMSNorm).
inline Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6) {
  const ValueId first = x.program().size();
  const Tensor x32 = detail::f32_if_half(x);
  const Tensor inverse_rms = rsqrt(mean(x32 * x32, {-1}, true) + eps);
  const Tensor normalized = detail::composite(convert(x32 * inverse_rms, x.dtype()),
                                              {Composite::Kind::rms_normalize, first, x.id(), inverse_rms.id(), -1});
  return normalized * weight;
}

// SiLU (swish): x sigmoid(x), the gate of SwiGLU.
inline Tensor silu(const Tensor& x) { return x * sigmoid(x); }

// one_hot(labels [I...] i32, n) -> [I..., n] with 1 at each label.
inline Tensor one_hot(const Tensor& labels, std::int64_t n, DType dtype = DType::f32) {
  Shape shape = labels.shape();
  shape.push_back(n);
  Tensor classes = iota(labels.program(), shape, labels.rank(), dtype);
  return compare(convert(reshape(labels, [&] { Shape s = labels.shape(); s.push_back(1); return s; }()), dtype),
                 classes, CompareDir::eq);
}

// Mean cross-entropy of logits [..., C] against integer labels [...].
inline Tensor cross_entropy(const Tensor& logits, const Tensor& labels) {
  if (labels.dtype() != DType::i32)
    user_error("cross_entropy: labels must be i32 class indices, got " + to_string(labels.type()));
  Shape expect = logits.shape();
  expect.pop_back();
  if (labels.shape() != expect)
    user_error("cross_entropy: labels " + to_string(labels.type()) + " do not match logits " +
               to_string(logits.type()) + " (expected labels shape " + to_string(expect) + ")");
  const Tensor logits32 = detail::f32_if_half(logits);
  return -mean(sum(one_hot(labels, logits.dim(-1), logits32.dtype()) * log_softmax(logits32), {-1}));
}

// Mean squared error.
inline Tensor mse(const Tensor& prediction, const Tensor& target) {
  if (prediction.shape() != target.shape())
    user_error("mse: prediction " + to_string(prediction.type()) + " and target " + to_string(target.type()) +
               " differ in shape");
  Tensor d = detail::f32_if_half(prediction) - detail::f32_if_half(target);
  return mean(d * d);
}

}  // namespace partir
