#pragma once
// A mixture-of-experts MLP (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021), built from the
// primitives so that every op already has a sharding rule, a VJP and kernels. A router sends each token to its
// top-k of E experts; an expert takes at most C tokens of a group (one sequence), C = ceil(capacity_factor *
// k * S / E), in token order, first choices before second ones; a token over capacity skips the layer (the
// caller's residual carries it). Dispatch and combine are einsums with a one-hot [B, E, S, C] mask.
//
// The values where tokens change hands are tagged, and so are their cotangents (grad/<tag>): expert_parallel
// (tactics/presets.hpp) lays each side out by them, so tokens cross devices by one all_to_all each way.
//   name/dispatched [B, E, C, D]  each expert's slots, by group (the token side)
//   name/expert_in  [E, B, C, D]  the same, by expert (the expert side)
//   name/expert_out [E, B, C, D]  the experts' outputs
//   name/returned   [B, E, C, D]  back by group
// Parameters: name/router [D, E]; name/experts/w1 [E, D, H], b1 [E, H], w2 [E, H, D], b2 [E, D].
// Routing runs in f32 whatever the compute dtype (Switch's selective precision): softmax, the top-k choice,
// slot positions (counts stay exact) and the gates.
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include "partir/dsl/nn.hpp"

namespace partir::nn {

struct MoeOutput {
  Tensor y;         // [B, S, D]
  Tensor aux_loss;  // f32 scalar: Switch's load-balancing loss, E * sum_e f_e P_e (1 when perfectly balanced)
};

struct MixtureOfExperts {
  std::string name;
  std::int64_t d_model, d_ff, experts;
  int top_k = 1;
  double capacity_factor = 1.25;
  std::function<Tensor(const Tensor&)> activation = [](const Tensor& h) { return gelu(h); };

  // Slots per expert and group of `tokens` tokens.
  std::int64_t capacity(std::int64_t tokens) const {
    const auto c = static_cast<std::int64_t>(std::ceil(capacity_factor * top_k * static_cast<double>(tokens) /
                                                       static_cast<double>(experts)));
    return std::clamp<std::int64_t>(c, 1, tokens);
  }

  MoeOutput operator()(const Tensor& x) const {
    check(x);
    const std::int64_t B = x.dim(0), S = x.dim(1), D = d_model, E = experts, C = capacity(S);
    Program& p = x.program();
    const DType f32 = DType::f32;
    const Tensor logits = convert(
        matmul(x, param(name + "/router", {D, E}, normal_init(1.0 / std::sqrt(static_cast<double>(D))), x.dtype())), f32);
    const Tensor probs = softmax(logits);  // [B, S, E]

    // choices[j]: the j-th choice of each token, one-hot over experts [B, S, E]. An exact tie (measure zero)
    // routes to each tied expert.
    std::vector<Tensor> choices;
    Tensor remaining = logits;
    for (int j = 0; j < top_k; ++j) {
      const Tensor best = compare(remaining, broadcast_in_dim(max(remaining, {2}), {B, S, E}, {0, 1}), CompareDir::eq);
      choices.push_back(best);
      remaining = select(best, full_like(remaining, -1e30), remaining);
    }
    std::vector<Tensor> gates;  // [B, S]: the router's probability of each choice
    for (const auto& c : choices) gates.push_back(sum(probs * c, {2}));
    if (top_k == 2) {  // GShard renormalizes the two gates
      const Tensor total = gates[0] + gates[1];
      for (auto& g : gates) g = g / total;
    }

    // Slot of each routed token: its 1-based rank among the tokens its expert takes, counted by an einsum with
    // a lower-triangular matrix (a cumulative sum over the group) after the earlier choices' counts.
    std::vector<double> lower(static_cast<std::size_t>(S * S), 0.0);
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t t = 0; t <= s; ++t) lower[static_cast<std::size_t>(s * S + t)] = 1;
    const Tensor cumulative = constant(p, std::move(lower), {S, S}, f32);
    const Tensor slots = iota(p, {B, E, S, C}, 3, f32);
    std::vector<Tensor> dispatch, combine;  // per choice, [B, E, S, C]
    std::optional<Tensor> taken;            // [B, E]: the slots the earlier choices filled
    for (int j = 0; j < top_k; ++j) {
      const Tensor& choice = choices[static_cast<std::size_t>(j)];
      const Tensor routed = transpose(choice, {0, 2, 1});  // [B, E, S]
      Tensor rank = dot_general(choice, cumulative, {{}, {}, {1}, {1}});
      if (taken) rank = rank + broadcast_in_dim(*taken, {B, E, S}, {0, 1});
      const Tensor in_slot = compare(broadcast_in_dim(rank - 1.0, {B, E, S, C}, {0, 1, 2}), slots, CompareDir::eq) *
                             broadcast_in_dim(routed, {B, E, S, C}, {0, 1, 2});
      dispatch.push_back(in_slot);
      combine.push_back(in_slot * broadcast_in_dim(gates[static_cast<std::size_t>(j)], {B, E, S, C}, {0, 2}));
      taken = taken ? *taken + sum(routed, {2}) : sum(routed, {2});
    }

    const auto total = [](const std::vector<Tensor>& terms) { return terms.size() == 1 ? terms[0] : terms[0] + terms[1]; };
    const std::string e = name + "/experts/";
    const Tensor dispatched = tag(dot_general(convert(total(dispatch), x.dtype()), x, {{0}, {0}, {2}, {1}}), name + "/dispatched");
    const Tensor expert_in = tag(transpose(dispatched, {1, 0, 2, 3}), name + "/expert_in");
    const auto bias = [&](const std::string& n, std::int64_t features) {
      return broadcast_in_dim(param(e + n, {E, features}, zeros_init(), x.dtype()), {E, B, C, features}, {0, 3});
    };
    const Tensor h = activation(
        dot_general(expert_in, param(e + "w1", {E, D, d_ff}, normal_init(1.0 / std::sqrt(static_cast<double>(D))), x.dtype()),
                    {{0}, {0}, {3}, {1}}) +
        bias("b1", d_ff));
    const Tensor expert_out = tag(
        dot_general(h, param(e + "w2", {E, d_ff, D}, normal_init(1.0 / std::sqrt(static_cast<double>(d_ff))), x.dtype()),
                    {{0}, {0}, {3}, {1}}) +
            bias("b2", D),
        name + "/expert_out");
    const Tensor returned = tag(transpose(expert_out, {1, 0, 2, 3}), name + "/returned");
    const Tensor y = dot_general(convert(total(combine), x.dtype()), returned, {{0}, {0}, {1, 3}, {1, 2}});

    // f_e: the fraction of a group's tokens whose first choice is e; P_e: the mean router probability of e.
    const Tensor f = mean(choices[0], {1}), P = mean(probs, {1});  // [B, E]
    return {y, static_cast<double>(E) * mean(sum(f * P, {1}))};
  }

 private:
  void check(const Tensor& x) const {
    const std::string where = "MixtureOfExperts '" + name + "': ";
    if (x.rank() != 3 || x.dim(2) != d_model)
      user_error(where + "expects [batch, seq, " + std::to_string(d_model) + "], got " + to_string(x.type()));
    if (experts < 1 || d_ff < 1) user_error(where + "needs experts >= 1 and d_ff >= 1");
    if (top_k < 1 || top_k > 2 || top_k > experts)
      user_error(where + "top_k " + std::to_string(top_k) + " is not supported (1 or 2, at most the " +
                 std::to_string(experts) + " experts)");
    if (!(capacity_factor > 0)) user_error(where + "capacity_factor must be > 0, got " + std::to_string(capacity_factor));
  }
};

}  // namespace partir::nn
