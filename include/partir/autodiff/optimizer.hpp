#pragma once
// Optimizers inside the program: for one parameter and its gradient, an optimizer emits its update rule
// and declares its state as optimizer_state inputs. A training step is then one program whose new
// parameters and state are loop-carried outputs, so sharding sees (and can shard) the optimizer state: ZeRO.
#include <concepts>

#include "partir/dsl/functional.hpp"

namespace partir {

// What an optimizer emits for one parameter: the parameter's new value and the new value of each state
// input it declared (every state output names, and updates, the input of the same name). The caller
// registers them as outputs, so that a train step can list all parameters before all state.
struct ParamUpdate {
  ValueId param;
  std::vector<Output> state;
};

// What train_step needs of an optimizer.
template <class O>
concept Optimizer = requires(const O& opt, Program& p, ValueId v) {
  { opt.update(p, v, v) } -> std::same_as<ParamUpdate>;
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

// Updates run in f32 for 16-bit parameters (bf16 cannot even hold Adam's beta2 = 0.999: it rounds to 1), in
// the parameter's dtype otherwise; results are stored back in the parameter's dtype.
inline DType update_dtype(DType param) { return is_half(param) ? DType::f32 : param; }
}  // namespace detail

// Plain gradient descent: p <- p - lr * g. No state.
struct SGD {
  double learning_rate = 1e-2;

  ParamUpdate update(Program& p, ValueId param, ValueId grad) const {
    const Tensor w = detail::param_input(p, param, grad, "SGD");
    const DType math = detail::update_dtype(w.dtype());
    return {convert(convert(w, math) - learning_rate * convert(Tensor{p, grad}, math), w.dtype()).id(), {}};
  }
};

// Adam (Kingma & Ba, as in torch.optim.Adam):
//   t <- t + 1;  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// State: opt/adam/m/<param>, opt/adam/v/<param> (param's type) and one shared f32 scalar opt/adam/step (t).
struct Adam {
  double learning_rate = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;

  static constexpr const char* step_name = "opt/adam/step";
  static constexpr const char* next_step_tag = "opt/adam/t";  // names t + 1, shared by all parameters

  ParamUpdate update(Program& p, ValueId param, ValueId grad) const {
    const Tensor stored = detail::param_input(p, param, grad, "Adam");
    const DType math = detail::update_dtype(stored.dtype());
    const Tensor w = convert(stored, math), g = convert(Tensor{p, grad}, math);
    const std::string name = p.op(param).name;  // a copy: adding the state inputs below may move the ops
    ParamUpdate out;
    const Tensor t = next_step(p, out.state);
    auto state_input = [&](const std::string& state_name) {  // stored like the parameter
      return convert(Tensor{p, p.add_input(state_name, stored.type(), InputKind::optimizer_state, zeros_init())}, math);
    };
    const std::string m_name = "opt/adam/m/" + name, v_name = "opt/adam/v/" + name;
    const Tensor m = beta1 * state_input(m_name) + (1.0 - beta1) * g;
    const Tensor v = beta2 * state_input(v_name) + (1.0 - beta2) * (g * g);
    // Bias corrections in the update's dtype (t itself is f32), so f64 parameters get an f64 update.
    const Tensor t_w = convert(t, math);
    auto bias_correction = [&](double beta) { return 1.0 - pow(constant(p, beta, {}, math), t_w); };
    const Tensor m_hat = m / bias_correction(beta1), v_hat = v / bias_correction(beta2);
    out.param = convert(w - learning_rate * m_hat / (sqrt(v_hat) + eps), stored.dtype()).id();
    out.state.push_back({m_name, convert(m, stored.dtype()).id(), m_name});
    out.state.push_back({v_name, convert(v, stored.dtype()).id(), v_name});
    return out;
  }

 private:
  // t + 1: declared and counted by the first update in a program (which then owns the step output), found
  // by its tag by the later ones.
  static Tensor next_step(Program& p, std::vector<Output>& state) {
    for (ValueId v = 0; v < p.size(); ++v)
      if (p.op(v).kind != OpKind::input && p.op(v).name == next_step_tag) return {p, v};
    const Tensor step{p, p.add_input(step_name, {{}, DType::f32}, InputKind::optimizer_state, zeros_init())};
    const Tensor next = tag(step + 1.0, next_step_tag);
    state.push_back({step_name, next.id(), step_name});
    return next;
  }
};

}  // namespace partir
