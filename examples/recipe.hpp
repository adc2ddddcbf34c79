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

// The recipe's flags, declared on `app` before it parses; recipe() then checks how they combine.
struct RecipeFlags {
  std::string optimizer = "adam", weight_decay = "default", clip = "off", lr_schedule = "constant", remat = "none";
  double lr = 3e-3, momentum = 0, final_lr_scale = 0.1;
  long warmup = 0, microbatches = 1;

  RecipeFlags(CLI::App& app, double default_lr) : lr(default_lr) {
    app.add_option("--optimizer", optimizer, "adamw (decoupled weight decay on matrices), adam or sgd")
        ->check(CLI::IsMember({"adamw", "adam", "sgd"}));
    app.add_option("--lr", lr, "peak learning rate")->check(cli::at_least(0));
    app.add_option("--weight-decay", weight_decay, "weight decay of adamw (default 0.01) or sgd (default 0)");
    app.add_option("--momentum", momentum, "sgd momentum")->check(cli::at_least(0));
    app.add_option("--clip", clip, "clip gradients to this global L2 norm (or off)");
    app.add_option("--lr-schedule", lr_schedule, "constant, warmup, cosine, linear, warmup_cosine or warmup_linear");
    app.add_option("--warmup", warmup, "warmup steps of a warmup_* schedule")->check(cli::at_least(0));
    app.add_option("--final-lr-scale", final_lr_scale, "the decay's last rate, as a fraction of --lr");
    app.add_option("--remat", remat, "recompute activations in the backward pass: none, blocks, selective (attention's "
                                     "core and the MLP's activation) or attention (its core only); nn::Gpt's marks");
    app.add_option("--microbatches", microbatches, "gradient accumulation: the batch as M microbatches, one optimizer step")
        ->check(cli::at_least(1));
  }

  // Bad combinations end the program as a bad flag does (exit 2), before anything runs.
  Recipe recipe(long steps) const try {
    Recipe r;
    r.optimizer = optimizer;
    r.lr = lr;
    r.momentum = momentum;
    r.remat = p::Remat::parse(remat, "--remat");
    r.microbatches = static_cast<int>(microbatches);
    auto number = [](const std::string& flag, const std::string& text) {
      char* end = nullptr;
      const double x = std::strtod(text.c_str(), &end);
      if (text.empty() || *end) p::user_error(flag + ": expected a number, got '" + text + "'");
      return x;
    };
    if (weight_decay != "default") {
      if (optimizer == "adam") p::user_error("--weight-decay: adam has none (use --optimizer adamw for decoupled decay)");
      r.weight_decay = number("--weight-decay", weight_decay);
    }
    if (momentum != 0 && optimizer != "sgd") p::user_error("--momentum: only sgd takes a momentum");
    if (clip != "off") r.clip = number("--clip", clip);
    r.schedule = p::LRSchedule::parse(lr_schedule, warmup, steps, final_lr_scale, "--lr-schedule");
    return r;
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    std::exit(2);
  }
};

}  // namespace examples
