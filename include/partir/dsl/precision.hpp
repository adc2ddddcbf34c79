#pragma once
// MixedPrecision: the dtypes a model trains in, a value kept apart from the model code and from the
// schedule (PartIR's separation, applied to precision; PyTorch autocast + FSDP MixedPrecision, JAX's jmp
// policies). While a policy is active (PrecisionScope, or train_step's precision argument):
//  - every float parameter is an input of `params` dtype (the master copy the optimizer updates in that
//    dtype), cast to `compute` where the model uses it; float data inputs are cast to `compute` too;
//  - the f32 list runs in f32 whatever the policy (see functional.hpp: softmax, log_softmax, layer_norm's
//    statistics, cross_entropy, mse); their results return to `compute`, losses stay f32;
//  - train_step returns the loss in `output` dtype;
//  - gradients are reduced in `reduce` dtype: a parameter's gradient arrives in `compute` and partial sums
//    are reduced in the narrowest dtype a value takes (sharding/rules.hpp), so `reduce` must be `compute`.
// Under ZeRO-3 the cast sits before the all_gather, so parameters travel as 16-bit copies.
// With loss_scaling (the default for f16, whose gradients underflow), train_step scales the loss before the
// backward pass and unscales the gradients, inside the one program (see LossScaling).
#include <optional>
#include <string>

#include "partir/ir/dtype.hpp"

namespace partir {

// Dynamic loss scaling, as PyTorch's GradScaler: the backward pass starts from loss * scale, the gradients are
// divided by scale before the update; a step whose gradients hold an inf or NaN on ANY device (the check is a
// sum over every gradient's shards, so partitioning reduces it across exactly the devices that split them)
// changes no parameter and no optimizer state and multiplies the scale by `backoff`; `interval` clean steps
// in a row multiply it by `growth`. State: opt/loss_scale and opt/loss_scale/clean_steps (f32 scalars).
struct LossScaling {
  double initial = 65536, growth = 2, backoff = 0.5;
  long interval = 2000;

  static constexpr const char* scale_name = "opt/loss_scale";
  static constexpr const char* clean_steps_name = "opt/loss_scale/clean_steps";
  friend bool operator==(const LossScaling&, const LossScaling&) = default;
};

struct MixedPrecision {
  DType params = DType::f32, compute = DType::f32, reduce = DType::f32, output = DType::f32;
  std::optional<LossScaling> loss_scaling = std::nullopt;

  // f32 master weights and f32 losses, everything else in `compute`: what `--precision bf16|f16` means.
  // f16 gets dynamic loss scaling (its smallest normal is 6e-5); bf16 has f32's range and needs none.
  static MixedPrecision with_compute(DType compute) {
    MixedPrecision p{DType::f32, compute, compute, DType::f32};
    if (compute == DType::f16) p.loss_scaling = LossScaling{};
    return p;
  }
  // "f32", "bf16" or "f16" (the examples' --precision).
  static MixedPrecision parse(std::string_view name, std::string_view source = "precision") {
    if (name != "f32" && name != "bf16" && name != "f16")
      user_error(std::string(source) + "='" + std::string(name) + "': expected f32, bf16 or f16");
    return with_compute(parse_dtype(name));
  }

  // Float dtypes only, and reduce == compute (see above); `who` names the caller in the error.
  void check(const std::string& who) const {
    for (auto [field, t] : {std::pair{"params", params}, {"compute", compute}, {"reduce", reduce}, {"output", output}})
      if (!is_float(t))
        user_error(who + ": MixedPrecision." + field + " = " + std::string(name_of(t)) +
                   " is not a floating-point dtype (f32, f64, bf16 or f16)");
    if (reduce != compute)
      user_error(who + ": MixedPrecision.reduce = " + std::string(name_of(reduce)) + " with compute = " +
                 std::string(name_of(compute)) + ": gradients are reduced in the narrowest dtype they take, the " +
                 "compute dtype; set reduce = compute");
    if (const auto& s = loss_scaling; s && !(s->initial > 0 && s->growth >= 1 && s->backoff > 0 && s->backoff < 1 &&
                                             s->interval >= 1))
      user_error(who + ": LossScaling{initial " + std::to_string(s->initial) + ", growth " + std::to_string(s->growth) +
                 ", backoff " + std::to_string(s->backoff) + ", interval " + std::to_string(s->interval) +
                 "}: needs initial > 0, growth >= 1, 0 < backoff < 1, interval >= 1");
  }
  std::string to_string() const {
    return "params=" + std::string(name_of(params)) + " compute=" + std::string(name_of(compute)) +
           " reduce=" + std::string(name_of(reduce)) + " output=" + std::string(name_of(output)) +
           (loss_scaling ? " loss_scaling" : "");
  }
  friend bool operator==(const MixedPrecision&, const MixedPrecision&) = default;
};

// The policy param() and input() follow while a function is traced (one per thread; none: types as written).
class PrecisionScope {
 public:
  explicit PrecisionScope(const MixedPrecision& policy) : previous_(slot()), policy_(policy) {
    policy_.check("PrecisionScope");
    slot() = &policy_;
  }
  ~PrecisionScope() { slot() = previous_; }
  PrecisionScope(const PrecisionScope&) = delete;
  PrecisionScope& operator=(const PrecisionScope&) = delete;

  static const MixedPrecision* active() { return slot(); }

 private:
  static const MixedPrecision*& slot() {
    thread_local const MixedPrecision* active = nullptr;
    return active;
  }
  const MixedPrecision* previous_;
  MixedPrecision policy_;
};

}  // namespace partir
