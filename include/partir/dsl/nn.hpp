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
