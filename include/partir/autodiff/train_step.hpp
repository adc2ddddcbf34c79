#pragma once
// train_step: a whole training step (forward, backward, optimizer update) as ONE program, so that
// partitioning sees parameters, gradients and optimizer state together and ties each new value to the
// input it replaces in the next step.
#include <optional>

#include "partir/autodiff/grad.hpp"
#include "partir/autodiff/optimizer.hpp"
#include "partir/dsl/trace.hpp"

namespace partir {

namespace detail {
template <class LossFn, Optimizer Opt>
Program train_step(LossFn& loss_fn, const Opt& opt, const std::vector<InputSpec>& data,
                   const MixedPrecision* precision, const std::string& name) {
  Program p(name);
  const std::string who = "train_step '" + name + "'";
  if (precision) precision->check(who);
  ValueId loss;
  {
    TraceScope scope(p);
    std::optional<PrecisionScope> policy;
    if (precision) policy.emplace(*precision);
    std::vector<Tensor> xs;
    for (const auto& in : data) xs.push_back(detail::to_compute(p, p.add_input(in.name, {in.shape, in.dtype})));
    auto result = detail::call_traced(loss_fn, xs);
    static_assert(std::is_same_v<decltype(result), Tensor>, "train_step: the loss function must return a Tensor");
    detail::check_loss_type(who, "the loss", p.type(result.id()));
    loss = (precision ? convert(result, precision->output) : result).id();
  }
  std::vector<ValueId> params;
  for (auto v : p.inputs())
    if (p.op(v).attrs.input_kind == InputKind::parameter) params.push_back(v);
  if (params.empty()) user_error(who + ": the loss function declares no parameters (see param() and nn)");

  const auto grads = grad(p, loss, params);
  std::vector<ParamUpdate> updates;
  for (std::size_t i = 0; i < params.size(); ++i) updates.push_back(opt.update(p, params[i], grads[i]));
  p.add_output("loss", loss);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string param_name = p.op(params[i]).name;
    p.add_output(param_name, updates[i].param, param_name);
  }
  for (const auto& u : updates)
    for (const auto& s : u.state) p.add_output(s.name, s.value, s.updates);
  verify(p);
  return p;
}
}  // namespace detail

// Traces loss_fn on the data inputs (N Tensors or a std::vector<Tensor>, as trace() calls it; parameters are
// declared inside with param() or nn blocks), differentiates the loss w.r.t. every parameter and applies
// opt. Outputs: "loss"; then each parameter under its own name, updating it; then the optimizer state,
// each under (and updating) its input's name. With a precision policy (precision.hpp) the model is traced
// under it: parameters and optimizer state in `params` dtype, the model in `compute`, the loss in `output`.
template <class LossFn, Optimizer Opt>
Program train_step(LossFn loss_fn, const Opt& opt, const std::vector<InputSpec>& data,
                   const std::string& name = "train_step") {
  return detail::train_step(loss_fn, opt, data, nullptr, name);
}
template <class LossFn, Optimizer Opt>
Program train_step(LossFn loss_fn, const Opt& opt, const std::vector<InputSpec>& data, const MixedPrecision& precision,
                   const std::string& name = "train_step") {
  return detail::train_step(loss_fn, opt, data, &precision, name);
}

}  // namespace partir
