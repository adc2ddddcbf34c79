#pragma once
// train_step: a whole training step (forward, backward, optimizer update) as ONE program, so that
// partitioning sees parameters, gradients and optimizer state together and ties each new value to the
// input it replaces in the next step.
#include <functional>
#include <optional>

#include "partir/autodiff/grad.hpp"
#include "partir/autodiff/lr_schedule.hpp"
#include "partir/autodiff/optimizer.hpp"
#include "partir/autodiff/remat.hpp"
#include "partir/dsl/trace.hpp"

namespace partir {

// What a train step does besides loss, gradients and the optimizer; each part off by default.
struct StepOptions {
  // Traces the model under a precision policy (precision.hpp).
  std::optional<MixedPrecision> precision;
  // Scales every gradient by min(1, clip_norm / (norm + 1e-6)), norm the L2 norm of all gradients together,
  // as torch.nn.utils.clip_grad_norm_; output "grad_norm" is the norm before clipping. Partitioned, each
  // device sums the squares of the gradient pieces it holds, and the terms that are partial sums over the
  // same axes are reduced together: one scalar all_reduce per group of axes.
  std::optional<double> clip_norm;
  // The optimizer's learning rate times data input "opt/lr_scale" (an f64 scalar the loop feeds each step,
  // LRSchedule::at(step)): the program is built and partitioned once for the whole schedule.
  bool scheduled_learning_rate = false;
  // Forward values the backward pass recomputes instead of keeping (remat.hpp).
  Remat remat = Remat::none();
  // Gradient accumulation: the batch runs as this many microbatches, each forward then backward, and the
  // optimizer applies the mean of their gradients once: the step on the whole batch, in one microbatch's
  // activation memory. Every data input's dim 0 is the batch.
  int microbatches = 1;

  static constexpr const char* lr_scale_name = "opt/lr_scale";
  static constexpr const char* clip_tag = "clip/global_norm";
};

namespace detail {
// train_step's loss function and optimizer, type-erased: the step is built by one function compiled once
// (config.hpp), whatever the model and the optimizer.
using LossOfInputs = std::function<Tensor(const std::vector<Tensor>&)>;
struct OptimizerRef {
  std::function<ParamUpdate(Program&, ValueId, ValueId, const std::optional<Tensor>&)> update;
  std::function<void(const Program&, const std::vector<ValueId>&, const std::string&)> check;

  template <Optimizer Opt>
  static OptimizerRef of(const Opt& opt) {
    return {[&opt](Program& p, ValueId param, ValueId grad, const std::optional<Tensor>& lr_scale) {
              return opt.update(p, param, grad, lr_scale);
            },
            [&opt](const Program& p, const std::vector<ValueId>& params, const std::string& who) {
              if constexpr (requires { opt.check(p, params, who); }) opt.check(p, params, who);
            }};
  }
};

PARTIR_ENTRY Program build_train_step(const LossOfInputs& loss_fn, const OptimizerRef& opt,
                                      const std::vector<InputSpec>& data, const StepOptions& options,
                                      const std::string& name);

template <class LossFn, Optimizer Opt>
Program train_step(LossFn& loss_fn, const Opt& opt, const std::vector<InputSpec>& data, const StepOptions& options,
                   const std::string& name) {
  const LossOfInputs loss = [&loss_fn](const std::vector<Tensor>& xs) {
    auto result = call_traced(loss_fn, xs);
    static_assert(std::is_same_v<decltype(result), Tensor>, "train_step: the loss function must return a Tensor");
    return result;
  };
  return build_train_step(loss, OptimizerRef::of(opt), data, options, name);
}
}  // namespace detail

// Traces loss_fn on the data inputs (N Tensors or a std::vector<Tensor>, as trace() calls it; parameters are
// declared inside with param() or nn blocks), differentiates the loss w.r.t. every parameter and applies
// opt. Outputs: "loss" (and "grad_norm" when clipping); then each parameter under its own name, updating it;
// then the optimizer state, each under (and updating) its input's name. With a precision policy (precision.hpp)
// the model is traced under it: parameters and optimizer state in `params` dtype, the model in `compute`, the
// loss in `output`.
template <class LossFn, Optimizer Opt>
Program train_step(LossFn loss_fn, const Opt& opt, const std::vector<InputSpec>& data,
                   const std::string& name = "train_step") {
  return detail::train_step(loss_fn, opt, data, StepOptions{}, name);
}
template <class LossFn, Optimizer Opt>
Program train_step(LossFn loss_fn, const Opt& opt, const std::vector<InputSpec>& data, const MixedPrecision& precision,
                   const std::string& name = "train_step") {
  return detail::train_step(loss_fn, opt, data, StepOptions{precision}, name);
}
// With StepOptions: gradient clipping, a scheduled learning rate, a precision policy.
template <class LossFn, Optimizer Opt>
Program train_step(LossFn loss_fn, const Opt& opt, const std::vector<InputSpec>& data, const StepOptions& options,
                   const std::string& name = "train_step") {
  return detail::train_step(loss_fn, opt, data, options, name);
}

#if PARTIR_DEFINE_ENTRIES
namespace detail {
// Rows j, j + m, j + 2m... of x (dim 0).
inline Tensor microbatch(const Tensor& x, int j, int m) {
  Shape split = x.shape();
  split[0] /= m;
  split.insert(split.begin() + 1, m);
  std::vector<std::int64_t> lo(split.size(), 0), hi(split.begin(), split.end());
  lo[1] = j;
  hi[1] = j + 1;
  Shape rows = x.shape();
  rows[0] /= m;
  return reshape(slice(reshape(x, split), std::move(lo), std::move(hi)), rows);
}

// Dynamic loss scaling (precision.hpp's LossScaling) around a step's gradients and updates.
class LossScaler {
 public:
  LossScaler(Program& p, const LossScaling& s)
      : s_(s),
        scale_(p, p.add_input(LossScaling::scale_name, {{}, DType::f32}, InputKind::optimizer_state,
                              constant_init(s.initial))),
        clean_(p, p.add_input(LossScaling::clean_steps_name, {{}, DType::f32}, InputKind::optimizer_state,
                              zeros_init())) {}

  // What the backward pass starts from: loss * scale, in the loss's dtype.
  ValueId scaled(Program& p, ValueId loss) const { return (Tensor{p, loss} * convert(scale_, p.type(loss).dtype)).id(); }

  // The gradients divided by the scale (in their own dtypes), and whether they are all finite: sum(g - g) is
  // 0 for finite g and NaN for inf or NaN, summed over every gradient.
  std::vector<ValueId> unscale(Program& p, const std::vector<ValueId>& grads) {
    std::vector<ValueId> out;
    std::optional<Tensor> nonfinite;
    for (ValueId g : grads) {
      const Tensor gt{p, g};
      const Tensor check = sum(convert(gt - gt, DType::f32));
      nonfinite = nonfinite ? *nonfinite + check : check;
      out.push_back((gt / convert(scale_, gt.dtype())).id());
    }
    finite_ = compare(*nonfinite, *nonfinite, CompareDir::eq);  // NaN != NaN
    return out;
  }

  // `updated` where the gradients were finite, else `old` (the step is skipped).
  ValueId keep_if_finite(Program& p, ValueId updated, ValueId old) const {
    const Tensor u{p, updated};
    return select(broadcast_to(convert(*finite_, u.dtype()), u.shape()), u, Tensor{p, old}).id();
  }

  // The scale's and the clean-step counter's next values, as outputs updating their inputs.
  std::vector<Output> next_state() const {
    const Tensor clean = select(*finite_, clean_ + 1.0, full_like(clean_, 0.0));
    const Tensor grow = *finite_ * compare(clean, full_like(clean, static_cast<double>(s_.interval)), CompareDir::ge);
    const Tensor scale = select(*finite_, select(grow, scale_ * s_.growth, scale_), scale_ * s_.backoff);
    return {{LossScaling::scale_name, scale.id(), LossScaling::scale_name},
            {LossScaling::clean_steps_name, select(grow, full_like(clean, 0.0), clean).id(), LossScaling::clean_steps_name}};
  }

 private:
  LossScaling s_;
  Tensor scale_, clean_;
  std::optional<Tensor> finite_;
};

// The gradients scaled to a global L2 norm of at most max_norm (StepOptions::clip_norm); `norm` is set to
// the norm before clipping. Squares are summed in f32 (f64 for f64 gradients) and the per-gradient sums
// joined by one add_n, which lowering reduces once per group of partial-sum axes.
inline std::vector<ValueId> clip_by_global_norm(Program& p, const std::vector<ValueId>& grads, double max_norm,
                                                ValueId& norm) {
  DType math = DType::f32;
  for (ValueId g : grads)
    if (p.type(g).dtype == DType::f64) math = DType::f64;
  std::vector<Tensor> squares;
  for (ValueId g : grads) {
    const Tensor x = convert(Tensor{p, g}, math);
    squares.push_back(sum(x * x));
  }
  const Tensor total = tag(add_n(squares), StepOptions::clip_tag);
  const Tensor n = sqrt(total);
  const Tensor coef = minimum(max_norm / (n + 1e-6), full_like(n, 1.0));
  norm = n.id();
  std::vector<ValueId> out;
  for (ValueId g : grads) out.push_back((Tensor{p, g} * convert(coef, p.type(g).dtype)).id());
  return out;
}

PARTIR_ENTRY Program build_train_step(const LossOfInputs& loss_fn, const OptimizerRef& opt,
                                      const std::vector<InputSpec>& data, const StepOptions& options,
                                      const std::string& name) {
  Program p(name);
  const std::string who = "train_step '" + name + "'";
  const MixedPrecision* precision = options.precision ? &*options.precision : nullptr;
  if (precision) precision->check(who);
  if (options.clip_norm && !(*options.clip_norm > 0))
    user_error(who + ": clip_norm " + number_str(*options.clip_norm) + " (a gradient norm limit is > 0)");
  const int m = options.microbatches;
  if (m < 1) user_error(who + ": microbatches " + std::to_string(m) + " (a step runs at least 1 microbatch)");
  std::vector<ValueId> inputs;
  for (const auto& in : data) {
    if (m > 1 && (in.shape.empty() || in.shape[0] % m != 0))
      user_error(who + ": data input '" + in.name + "' " + to_string(TensorType{in.shape, in.dtype}) +
                 " has no leading batch dim that " + std::to_string(m) + " microbatches divide");
    inputs.push_back(p.add_input(in.name, {in.shape, in.dtype}));
  }
  // The loss of microbatch j: rows j, j + m, j + 2m... of every data input (a strided split, so that a batch
  // tiled on dim 0 splits on every device alike: each microbatch's rows stay where the batch's are).
  auto trace_loss = [&](int j) {
    p.begin_segment({static_cast<ValueId>(p.size()), j, Segment::Pass::forward});
    TraceScope scope(p);
    std::optional<PrecisionScope> policy;
    if (precision) policy.emplace(*precision);
    std::vector<Tensor> xs;
    for (ValueId in : inputs) xs.push_back(detail::to_compute(p, m > 1 ? detail::microbatch(Tensor{p, in}, j, m).id() : in));
    const Tensor result = loss_fn(xs);
    detail::check_loss_type(who, "the loss", p.type(result.id()));
    return precision ? convert(result, precision->output) : result;
  };
  Tensor loss = trace_loss(0);
  std::vector<ValueId> params;
  for (auto v : p.inputs())
    if (p.op(v).attrs.input_kind == InputKind::parameter) params.push_back(v);
  if (params.empty()) user_error(who + ": the loss function declares no parameters (see param() and nn)");
  opt.check(p, params, who);

  std::optional<LossScaler> scaler;
  if (precision && precision->loss_scaling) scaler.emplace(p, *precision->loss_scaling);
  auto backward = [&](const Tensor& l, int j) {
    p.begin_segment({static_cast<ValueId>(p.size()), j, Segment::Pass::backward});
    return grad(p, scaler ? scaler->scaled(p, l.id()) : l.id(), params);
  };
  auto grads = backward(loss, 0);
  if (m > 1) {
    // Each microbatch's backward pass follows its forward pass, so one microbatch's activations live at a
    // time; the mean of the microbatch means is the batch's mean. Each gradient has one running sum (Megatron's
    // main_grad), added to at the end of each microbatch's backward pass, so one microbatch's gradient lives
    // beside it, not all m. add_n keeps partial gradients partial, and widened ones too
    // (widens_into_accumulation): data parallelism reduces each gradient once per step, not once per microbatch.
    std::vector<Tensor> losses{loss};
    std::vector<Tensor> sums;
    for (auto g : grads) sums.push_back(Tensor{p, g});
    for (int j = 1; j < m; ++j) {
      losses.push_back(trace_loss(j));
      const auto more = backward(losses.back(), j);
      for (std::size_t i = 0; i < params.size(); ++i) sums[i] = add_n({sums[i], Tensor{p, more[i]}});
    }
    p.begin_segment({static_cast<ValueId>(p.size()), 0, Segment::Pass::update});
    loss = add_n(losses) * (1.0 / m);
    for (std::size_t i = 0; i < params.size(); ++i) grads[i] = (sums[i] * (1.0 / m)).id();
  }
  if (m == 1) p.begin_segment({static_cast<ValueId>(p.size()), 0, Segment::Pass::update});
  if (scaler) grads = scaler->unscale(p, grads);
  ValueId norm = -1;
  if (options.clip_norm) grads = clip_by_global_norm(p, grads, *options.clip_norm, norm);
  std::optional<Tensor> lr_scale;
  if (options.scheduled_learning_rate) lr_scale = Tensor{p, p.add_input(StepOptions::lr_scale_name, {{}, DType::f64})};
  std::vector<ParamUpdate> updates;
  for (std::size_t i = 0; i < params.size(); ++i) updates.push_back(opt.update(p, params[i], grads[i], lr_scale));
  p.add_output("loss", loss.id());
  if (norm >= 0) p.add_output("grad_norm", norm);
  // Under loss scaling a step with inf/NaN gradients leaves every parameter and optimizer state as it was.
  auto output = [&](const std::string& name, ValueId value, const std::string& updates_input) {
    p.add_output(name, scaler ? scaler->keep_if_finite(p, value, *p.find_input(updates_input)) : value, updates_input);
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string param_name = p.op(params[i]).name;
    output(param_name, updates[i].param, param_name);
  }
  for (const auto& u : updates)
    for (const auto& s : u.state) output(s.name, s.value, s.updates);
  if (scaler)
    for (const auto& s : scaler->next_state()) p.add_output(s.name, s.value, s.updates);
  Program out = rematerialize(p, options.remat);
  verify(out);
  return out;
}
}  // namespace detail
#endif

}  // namespace partir
