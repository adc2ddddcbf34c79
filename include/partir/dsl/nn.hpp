#pragma once
// nn building blocks: plain structs holding names and sizes. Calling one inside a trace declares its
// parameters (hierarchical names such as params/mlp/w1) and applies it.
#include <cmath>
#include <functional>

#include "partir/dsl/functional.hpp"

namespace partir::nn {

// x @ w + b, with w [in, out] ~ N(0, 1/in) (LeCun) and b zeros.
inline Tensor dense(const Tensor& x, const std::string& w_name, const std::string& b_name, std::int64_t in,
                    std::int64_t out, bool bias = true) {
  if (x.dim(-1) != in)
    user_error("dense '" + w_name + "': input " + to_string(x.type()) + " has " + std::to_string(x.dim(-1)) +
               " features, the layer expects " + std::to_string(in));
  Tensor y = matmul(x, param(w_name, {in, out}, normal_init(1.0 / std::sqrt(static_cast<double>(in))), x.dtype()));
  return bias ? y + param(b_name, {out}, zeros_init(), x.dtype()) : y;
}

// Convolution of x [N, spatial..., in] with kernel w_name [window..., in, out] ~ N(0, 1/fan_in) (fan_in: taps x in),
// plus bias b_name [out] (zeros), with TensorFlow's 'same' padding: each spatial size becomes ceil(size / stride).
// HWIO kernels put the output features last and the input features before them, as a dense layer's [in, out],
// so Megatron's layout (megatron preset) splits a block's convolutions as it splits its matmuls.
inline Tensor conv_layer(const Tensor& x, const std::string& w_name, const std::string& b_name,
                         const std::vector<std::int64_t>& window, std::int64_t in, std::int64_t out,
                         std::int64_t stride = 1, bool bias = true) {
  if (x.rank() != static_cast<std::int64_t>(window.size()) + 2 || x.dim(-1) != in)
    user_error("conv_layer '" + w_name + "': input " + to_string(x.type()) + " is not [batch, " +
               std::to_string(window.size()) + " spatial dims, " + std::to_string(in) + " features]");
  Shape kernel = window;
  kernel.push_back(in);
  kernel.push_back(out);
  ConvWindow w;
  double fan_in = static_cast<double>(in);
  for (std::size_t d = 0; d < window.size(); ++d) {
    const std::int64_t size = x.dim(static_cast<std::int64_t>(d) + 1), result = (size + stride - 1) / stride;
    const std::int64_t total = std::max<std::int64_t>((result - 1) * stride + window[d] - size, 0);
    w.strides.push_back(stride);
    w.padding_low.push_back(total / 2);
    w.padding_high.push_back(total - total / 2);
    fan_in *= static_cast<double>(window[d]);
  }
  Tensor y = conv(x, param(w_name, std::move(kernel), normal_init(1.0 / std::sqrt(fan_in)), x.dtype()), w);
  return bias ? y + param(b_name, {out}, zeros_init(), x.dtype()) : y;
}

// Max and average pooling of x [N, spatial..., C] over `window` (one size per spatial dim) at `stride` (0: the
// window, non-overlapping), unpadded ('valid', as PyTorch's MaxPool2d/AvgPool2d defaults): ReduceWindow with
// windows of 1 on the batch and features. avg_pool divides by the window's size.
inline WindowDims pool_window(const Tensor& x, const std::vector<std::int64_t>& window, std::int64_t stride, const char* who) {
  if (x.rank() != static_cast<std::int64_t>(window.size()) + 2)
    user_error(std::string(who) + ": input " + to_string(x.type()) + " is not [batch, " + std::to_string(window.size()) +
               " spatial dims, features]");
  const auto r = static_cast<std::size_t>(x.rank());
  WindowDims w{std::vector<std::int64_t>(r, 1), std::vector<std::int64_t>(r, 1), std::vector<std::int64_t>(r, 1),
               std::vector<std::int64_t>(r, 1)};
  for (std::size_t d = 0; d < window.size(); ++d) {
    w.window[d + 1] = window[d];
    w.strides[d + 1] = stride > 0 ? stride : window[d];
  }
  return w;
}
inline Tensor max_pool(const Tensor& x, const std::vector<std::int64_t>& window, std::int64_t stride = 0) {
  const auto none = std::vector<std::int64_t>(static_cast<std::size_t>(x.rank()), 0);
  return reduce_window(x, OpKind::reduce_window_max, pool_window(x, window, stride, "max_pool"), none, none);
}
inline Tensor avg_pool(const Tensor& x, const std::vector<std::int64_t>& window, std::int64_t stride = 0) {
  const auto none = std::vector<std::int64_t>(static_cast<std::size_t>(x.rank()), 0);
  const double taps = static_cast<double>(num_elements(window));
  return reduce_window(x, OpKind::reduce_window_sum, pool_window(x, window, stride, "avg_pool"), none, none) * (1.0 / taps);
}

struct Linear {
  std::string name;  // parameters: name/w, name/b
  std::int64_t in, out;
  bool bias = true;
  Tensor operator()(const Tensor& x) const { return dense(x, name + "/w", name + "/b", in, out, bias); }
};

// Multi-layer perceptron: sizes {in, h1, ..., out}; layer i has params name/w{i}, name/b{i} (from 1);
// the activation follows every layer but the last; its inputs are checkpoint-named name/a{i} and its outputs
// tagged and checkpoint-named name/h{i} (the bounds of the activation function, for remat).
struct Mlp {
  std::string name;
  std::vector<std::int64_t> sizes;
  std::function<Tensor(const Tensor&)> activation = [](const Tensor& x) { return relu(x); };

  Tensor operator()(Tensor x) const {
    if (sizes.size() < 2) user_error("Mlp '" + name + "': needs at least {in, out} sizes");
    for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
      const auto n = std::to_string(i + 1);
      x = dense(x, name + "/w" + n, name + "/b" + n, sizes[i], sizes[i + 1]);
      if (i + 2 < sizes.size())
        x = checkpoint_name(tag(activation(checkpoint_name(x, name + "/a" + n)), name + "/h" + n), name + "/h" + n);
    }
    return x;
  }
};

// Embedding table name/table [vocab, dim] ~ N(0, 1); looks up i32 token ids [I...] -> [I..., dim].
struct Embedding {
  std::string name;
  std::int64_t vocab, dim;
  Tensor operator()(const Tensor& ids, DType dtype = DType::f32) const {
    return gather(param(name + "/table", {vocab, dim}, normal_init(1.0), dtype), ids);
  }
};

}  // namespace partir::nn
