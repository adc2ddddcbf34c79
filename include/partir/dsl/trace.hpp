#pragma once
// trace(name, fn, inputs): runs fn on symbolic Tensors once and returns the Program it recorded.
#include <utility>

#include "partir/dsl/tensor.hpp"
#include "partir/ir/verifier.hpp"

namespace partir {

struct InputSpec {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

namespace detail {
template <class F, std::size_t... I>
auto call_with(F& fn, const std::vector<Tensor>& xs, std::index_sequence<I...>) {
  return fn(xs[I]...);
}
template <class F, std::size_t N = 0>
auto call_traced(F& fn, const std::vector<Tensor>& xs) {
  if constexpr (std::is_invocable_v<F&, const std::vector<Tensor>&>) {
    return fn(xs);
  } else if constexpr (N > 8) {
    static_assert(N <= 8, "trace: fn must take up to 8 Tensors or a std::vector<Tensor>");
  } else if constexpr ([]<std::size_t... I>(std::index_sequence<I...>) {
                         return std::is_invocable_v<F&, decltype((void)I, std::declval<Tensor>())...>;
                       }(std::make_index_sequence<N>{})) {
    if (xs.size() != N)
      user_error("trace: the function takes " + std::to_string(N) + " tensors but " + std::to_string(xs.size()) +
                 " inputs were given");
    return call_with(fn, xs, std::make_index_sequence<N>{});
  } else {
    return call_traced<F, N + 1>(fn, xs);
  }
}
}  // namespace detail

// fn returns a Tensor (output "out") or NamedTensors. Parameters it declares with param() become inputs.
template <class F>
Program trace(const std::string& name, F&& fn, const std::vector<InputSpec>& inputs) {
  Program p(name);
  {
    TraceScope scope(p);
    std::vector<Tensor> xs;
    for (const auto& in : inputs) xs.emplace_back(p, p.add_input(in.name, {in.shape, in.dtype}));
    auto result = detail::call_traced(fn, xs);
    if constexpr (std::is_same_v<decltype(result), Tensor>) {
      p.add_output("out", result.id());
    } else {
      for (const auto& [n, t] : result) p.add_output(n, t.id());
    }
  }
  verify(p);
  return p;
}

}  // namespace partir
