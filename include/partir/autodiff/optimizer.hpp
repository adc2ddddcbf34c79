#pragma once
// Optimizers inside the program: for one parameter and its gradient, an optimizer emits its update rule
// and declares its state as optimizer_state inputs. A training step is then one program whose new
// parameters and state are loop-carried outputs, so sharding sees (and can shard) the optimizer state: ZeRO.
#include <algorithm>
#include <concepts>
#include <optional>

#include "partir/dsl/functional.hpp"
#include "partir/ir/printer.hpp"
#include "partir/ir/selector.hpp"

namespace partir {

// What an optimizer emits for one parameter: the parameter's new value and the new value of each state
// input it declared (every state output names, and updates, the input of the same name). The caller
// registers them as outputs, so that a train step can list all parameters before all state.
struct ParamUpdate {
  ValueId param;
  std::vector<Output> state;
};

// What train_step needs of an optimizer. `lr_scale` is set when the step's learning rate follows a schedule
// (lr_schedule.hpp): a scalar input the loop feeds each step, by which the optimizer multiplies its own rate.
template <class O>
concept Optimizer = requires(const O& opt, Program& p, ValueId v, const std::optional<Tensor>& lr_scale) {
  { opt.update(p, v, v, lr_scale) } -> std::same_as<ParamUpdate>;
};

namespace detail {
inline Tensor param_input(Program& p, ValueId param, ValueId grad, const std::string& optimizer) {
  if (param < 0 || param >= p.size() || p.op(param).kind != OpKind::input)
    user_error(optimizer + ": %" + std::to_string(param) + " is not an input; optimizers update parameter inputs");
  if (grad < 0 || grad >= p.size() || p.type(grad) != p.type(param))
    user_error(optimizer + ": the gradient of '" + p.op(param).name + "' must be a value of its type " +
               to_string(p.type(param)));
  return {p, param};
}

inline void check_hyperparameter(const std::string& optimizer, const char* name, double value, double low, bool open,
                                 const char* rule) {
  if (!(open ? value > low : value >= low))
    user_error(optimizer + ": " + name + " " + number_str(value) + " is out of range (" + rule + ")");
}

// Updates run in f32 for 16-bit parameters (bf16 cannot even hold Adam's beta2 = 0.999: it rounds to 1), in
// the parameter's dtype otherwise; results are stored back in the parameter's dtype.
inline DType update_dtype(DType param) { return is_half(param) ? DType::f32 : param; }

// This step's learning rate as a scalar of dtype `math`: `rate`, times the scheduled scale if any.
inline Tensor learning_rate(Program& p, double rate, const std::optional<Tensor>& lr_scale, DType math) {
  const Tensor lr = constant(p, rate, {}, math);
  return lr_scale ? lr * convert(*lr_scale, math) : lr;
}

// A state input stored like the parameter (zeros at first), read in the update's dtype.
inline Tensor state_input(Program& p, const std::string& name, const TensorType& stored, DType math) {
  return convert(Tensor{p, p.add_input(name, stored, InputKind::optimizer_state, zeros_init())}, math);
}

// Adam and AdamW: Adam's step on w * (1 - lr * decay), decay = 0 for Adam.
struct AdamRule {
  double learning_rate, beta1, beta2, eps, decay;
};
inline constexpr const char* adam_step_name = "opt/adam/step";
inline constexpr const char* adam_next_step_tag = "opt/adam/t";  // names t + 1, shared by all parameters

// t + 1: declared and counted by the first update in a program (which then owns the step output), found by
// its tag by the later ones.
inline Tensor adam_next_step(Program& p, std::vector<Output>& state) {
  for (ValueId v = 0; v < p.size(); ++v)
    if (p.op(v).kind != OpKind::input && p.op(v).name == adam_next_step_tag) return {p, v};
  const Tensor step{p, p.add_input(adam_step_name, {{}, DType::f32}, InputKind::optimizer_state, zeros_init())};
  const Tensor next = tag(step + 1.0, adam_next_step_tag);
  state.push_back({adam_step_name, next.id(), adam_step_name});
  return next;
}

inline ParamUpdate adam_update(Program& p, ValueId param, ValueId grad, const std::optional<Tensor>& lr_scale,
                               const AdamRule& r, const std::string& who) {
  check_hyperparameter(who, "learning_rate", r.learning_rate, 0, false, "a learning rate is >= 0");
  check_hyperparameter(who, "beta1", r.beta1, 0, false, "0 <= beta1 < 1");
  check_hyperparameter(who, "beta2", r.beta2, 0, false, "0 <= beta2 < 1");
  if (r.beta1 >= 1 || r.beta2 >= 1)
    user_error(who + ": beta1 " + number_str(r.beta1) + ", beta2 " + number_str(r.beta2) + " must be < 1");
  check_hyperparameter(who, "eps", r.eps, 0, true, "eps > 0 keeps the division finite");
  const Tensor stored = param_input(p, param, grad, who);
  const DType math = update_dtype(stored.dtype());
  const Tensor g = convert(Tensor{p, grad}, math);
  const std::string name = p.op(param).name;  // a copy: adding the state inputs below may move the ops
  ParamUpdate out;
  const Tensor t = adam_next_step(p, out.state);
  const Tensor lr = learning_rate(p, r.learning_rate, lr_scale, math);
  Tensor w = convert(stored, math);
  if (r.decay > 0) w = w * (1.0 - lr * r.decay);  // decoupled (Loshchilov & Hutter), before the Adam step
  const std::string m_name = "opt/adam/m/" + name, v_name = "opt/adam/v/" + name;
  const Tensor m = r.beta1 * state_input(p, m_name, stored.type(), math) + (1.0 - r.beta1) * g;
  const Tensor v = r.beta2 * state_input(p, v_name, stored.type(), math) + (1.0 - r.beta2) * (g * g);
  // Bias corrections in the update's dtype (t itself is f32), so f64 parameters get an f64 update.
  const Tensor t_w = convert(t, math);
  auto bias_correction = [&](double beta) { return 1.0 - pow(constant(p, beta, {}, math), t_w); };
  const Tensor m_hat = m / bias_correction(r.beta1), v_hat = v / bias_correction(r.beta2);
  out.param = convert(w - lr * m_hat / (sqrt(v_hat) + r.eps), stored.dtype()).id();
  out.state.push_back({m_name, convert(m, stored.dtype()).id(), m_name});
  out.state.push_back({v_name, convert(v, stored.dtype()).id(), v_name});
  return out;
}
}  // namespace detail

// Gradient descent as torch.optim.SGD (dampening 0):
//   g <- g + weight_decay * p;  b <- momentum * b + g;  g <- nesterov ? g + momentum * b : b;  p <- p - lr * g
// State with momentum: opt/sgd/momentum/<param> (param's type).
struct SGD {
  double learning_rate = 1e-2, momentum = 0, weight_decay = 0;
  bool nesterov = false;

  ParamUpdate update(Program& p, ValueId param, ValueId grad, const std::optional<Tensor>& lr_scale = {}) const;
};

// Adam (Kingma & Ba, as in torch.optim.Adam):
//   t <- t + 1;  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// State: opt/adam/m/<param>, opt/adam/v/<param> (param's type) and one shared f32 scalar opt/adam/step (t).
struct Adam {
  double learning_rate = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;

  static constexpr const char* step_name = detail::adam_step_name;

  ParamUpdate update(Program& p, ValueId param, ValueId grad, const std::optional<Tensor>& lr_scale = {}) const;
};

// AdamW (as torch.optim.AdamW): p <- p * (1 - lr * weight_decay), then Adam's step, with Adam's state (so a
// run may switch between the two). Only the parameters `decay` selects decay: globs over parameter names
// (selector.hpp), or when empty every parameter of rank >= 2 (weight matrices and embedding tables, as
// nanoGPT decays them; norms' scales and biases do not).
struct AdamW {
  double learning_rate = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  std::vector<std::string> decay = {};

  bool decays(const Program& p, ValueId param) const {
    if (decay.empty()) return p.type(param).rank() >= 2;
    return std::any_of(decay.begin(), decay.end(), [&](const auto& g) { return glob_match(g, p.op(param).name); });
  }

  ParamUpdate update(Program& p, ValueId param, ValueId grad, const std::optional<Tensor>& lr_scale = {}) const;

  // A `decay` glob that selects no parameter is a typo, not a choice.
  void check(const Program& p, const std::vector<ValueId>& params, const std::string& who) const;
};

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY ParamUpdate SGD::update(Program& p, ValueId param, ValueId grad,
                                     const std::optional<Tensor>& lr_scale) const {
  detail::check_hyperparameter("SGD", "learning_rate", learning_rate, 0, false, "a learning rate is >= 0");
  detail::check_hyperparameter("SGD", "momentum", momentum, 0, false, "momentum is >= 0");
  detail::check_hyperparameter("SGD", "weight_decay", weight_decay, 0, false, "a weight decay is >= 0");
  if (nesterov && momentum == 0) user_error("SGD: nesterov needs a momentum > 0");
  const Tensor stored = detail::param_input(p, param, grad, "SGD");
  const DType math = detail::update_dtype(stored.dtype());
  const std::string name = p.op(param).name;
  const Tensor w = convert(stored, math);
  Tensor g = convert(Tensor{p, grad}, math);
  if (weight_decay > 0) g = g + weight_decay * w;
  ParamUpdate out;
  if (momentum > 0) {
    const std::string b_name = "opt/sgd/momentum/" + name;
    const Tensor b = momentum * detail::state_input(p, b_name, stored.type(), math) + g;
    out.state.push_back({b_name, convert(b, stored.dtype()).id(), b_name});
    g = nesterov ? g + momentum * b : b;
  }
  out.param = convert(w - detail::learning_rate(p, learning_rate, lr_scale, math) * g, stored.dtype()).id();
  return out;
}

PARTIR_ENTRY ParamUpdate Adam::update(Program& p, ValueId param, ValueId grad,
                                      const std::optional<Tensor>& lr_scale) const {
  return detail::adam_update(p, param, grad, lr_scale, {learning_rate, beta1, beta2, eps, 0}, "Adam");
}

PARTIR_ENTRY ParamUpdate AdamW::update(Program& p, ValueId param, ValueId grad,
                                       const std::optional<Tensor>& lr_scale) const {
  detail::check_hyperparameter("AdamW", "weight_decay", weight_decay, 0, false, "a weight decay is >= 0");
  const double d = param >= 0 && param < p.size() && decays(p, param) ? weight_decay : 0;
  return detail::adam_update(p, param, grad, lr_scale, {learning_rate, beta1, beta2, eps, d}, "AdamW");
}

PARTIR_ENTRY void AdamW::check(const Program& p, const std::vector<ValueId>& params, const std::string& who) const {
  for (const auto& g : decay)
    if (std::none_of(params.begin(), params.end(), [&](ValueId v) { return glob_match(g, p.op(v).name); }))
      user_error(who + ": AdamW decay selector '" + g + "' matches no parameter (parameters are named like '" +
                 (params.empty() ? std::string("params/...") : p.op(params[0]).name) + "')");
}
#endif

}  // namespace partir
