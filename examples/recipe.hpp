#pragma once
// The training recipe flags the examples share: --optimizer adamw|adam|sgd, --lr, --weight-decay, --momentum,
// --clip, --lr-schedule, --warmup, --final-lr-scale, --remat, --microbatches. With the defaults (Adam, constant
// rate, no clipping, no remat, one microbatch) the step is the plain Adam step.
#include <partir/partir.hpp>

#include "cli.hpp"

namespace examples {

namespace p = partir;

struct Recipe {
  std::string optimizer = "adam";
  double lr = 3e-3;
  double weight_decay = -1;  // < 0: the optimizer's default (AdamW 0.01, SGD 0)
  double momentum = 0;
  std::optional<double> clip;
  p::LRSchedule schedule;
  p::Remat remat = p::Remat::none();
  int microbatches = 1;

  p::StepOptions step_options(const p::MixedPrecision& precision) const {
    return {precision, clip, schedule != p::LRSchedule::constant(), remat, microbatches};
  }

  // train_step(loss_fn, <the chosen optimizer>, data, step_options(precision)).
  template <class LossFn>
  p::Program train_step(LossFn loss_fn, const std::vector<p::InputSpec>& data, const p::MixedPrecision& precision) const {
    const p::StepOptions options = step_options(precision);
    if (optimizer == "adamw")
      return p::train_step(loss_fn, p::AdamW{.learning_rate = lr, .weight_decay = weight_decay < 0 ? 1e-2 : weight_decay},
                           data, options);
    if (optimizer == "sgd")
      return p::train_step(loss_fn, p::SGD{lr, momentum, weight_decay < 0 ? 0 : weight_decay}, data, options);
    return p::train_step(loss_fn, p::Adam{lr}, data, options);
  }

  // The learning rate of step s (1-based, as the loop counts).
  double learning_rate(long s) const { return lr * schedule.at(s - 1); }
  // What step s reads besides the batch: its learning-rate scale, when the rate follows a schedule.
  p::NamedArrays step_inputs(long s) const {
    if (schedule == p::LRSchedule::constant()) return {};
    return {{p::StepOptions::lr_scale_name, p::Array({}, std::vector<double>{schedule.at(s - 1)})}};
  }
};

// Bad values end the program as a bad flag does (exit 2), before anything runs.
inline Recipe recipe_flags(cli::Args& args, long steps, double default_lr) try {
  Recipe r;
  r.optimizer = args.get("optimizer", "adam", "adamw (decoupled weight decay on matrices), adam or sgd");
  r.lr = args.get_double("lr", default_lr, "peak learning rate");
  const std::string decay = args.get("weight-decay", "default", "weight decay of adamw (default 0.01) or sgd (default 0)");
  r.momentum = args.get_double("momentum", 0, "sgd momentum");
  const std::string clip = args.get("clip", "off", "clip gradients to this global L2 norm");
  const std::string schedule = args.get("lr-schedule", "constant",
                                        "constant, warmup, cosine, linear, warmup_cosine or warmup_linear");
  const long warmup = args.get_int("warmup", 0, "warmup steps of a warmup_* schedule");
  const double final_scale = args.get_double("final-lr-scale", 0.1, "the decay's last rate, as a fraction of --lr");
  r.remat = p::Remat::parse(args.get("remat", "none", "recompute activations in the backward pass: none, blocks, "
                                                      "selective (attention's core and the MLP's activation) or "
                                                      "attention (its core only); nn::Gpt's marks"),
                            "--remat");
  r.microbatches = static_cast<int>(args.get_int("microbatches", 1, "gradient accumulation: the batch as M microbatches, "
                                                                    "one optimizer step"));
  if (r.optimizer != "adamw" && r.optimizer != "adam" && r.optimizer != "sgd")
    p::user_error("--optimizer: expected adamw, adam or sgd, got '" + r.optimizer + "'");
  auto number = [](const std::string& flag, const std::string& text) {
    char* end = nullptr;
    const double x = std::strtod(text.c_str(), &end);
    if (text.empty() || *end) p::user_error(flag + ": expected a number, got '" + text + "'");
    return x;
  };
  if (decay != "default") {
    if (r.optimizer == "adam") p::user_error("--weight-decay: adam has none (use --optimizer adamw for decoupled decay)");
    r.weight_decay = number("--weight-decay", decay);
  }
  if (r.momentum != 0 && r.optimizer != "sgd") p::user_error("--momentum: only sgd takes a momentum");
  if (clip != "off") r.clip = number("--clip", clip);
  r.schedule = p::LRSchedule::parse(schedule, warmup, steps, final_scale, "--lr-schedule");
  return r;
} catch (const p::UserError& e) {
  std::cerr << "error: " << e.what() << "\n";
  std::exit(2);
}

}  // namespace examples
