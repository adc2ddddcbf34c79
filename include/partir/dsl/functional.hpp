#pragma once
// Composite functions built from the primitives (so autodiff, sharding rules and kernels need nothing new).
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

// Along `axis`; subtracting the max keeps exp from overflowing and does not change the result.
inline Tensor log_softmax(const Tensor& x, std::int64_t axis = -1) {
  Tensor shifted = x - max(x, {axis}, true);
  return shifted - log(sum(exp(shifted), {axis}, true));
}
inline Tensor softmax(const Tensor& x, std::int64_t axis = -1) {
  Tensor e = exp(x - max(x, {axis}, true));
  return e / sum(e, {axis}, true);
}

// Normalizes over the last dim, then scales and shifts by gamma and beta ([features] each).
inline Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps = 1e-5) {
  Tensor centered = x - mean(x, {-1}, true);
  Tensor var = mean(centered * centered, {-1}, true);
  return centered * rsqrt(var + eps) * gamma + beta;
}

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
  return -mean(sum(one_hot(labels, logits.dim(-1), logits.dtype()) * log_softmax(logits), {-1}));
}

// Mean squared error.
inline Tensor mse(const Tensor& prediction, const Tensor& target) {
  if (prediction.shape() != target.shape())
    user_error("mse: prediction " + to_string(prediction.type()) + " and target " + to_string(target.type()) +
               " differ in shape");
  Tensor d = prediction - target;
  return mean(d * d);
}

}  // namespace partir
