#pragma once
// A decoder-only transformer language model (GPT) from the nn blocks: token + position embedding, pre-LayerNorm
// blocks of causal self-attention and a GELU MLP, a final LayerNorm, a tied or untied output projection and
// the cross-entropy loss. Parameter names follow the layer structure, which is what the presets select on:
//   params/tok_embed/table [V, D]    params/pos_embed [S, D]
//   params/layers/<i>/ln1/{gamma,beta}  params/layers/<i>/attn/{wq,wk,wv,wo}, {bq,bv,bo} (with bias)
//   params/layers/<i>/ln2/{gamma,beta}  params/layers/<i>/mlp/{w1,b1,w2,b2}
//   params/ln_f/{gamma,beta}            params/head/w [D, V] (untied only)
//   params/layers/<i>/moe/{router, experts/{w1,b1,w2,b2}} in place of mlp/ when config.experts > 0
// Multi-query attention (Shazeer 2019) keeps the query heads but shares one K/V head ([D, D/H] weights):
// it shrinks the K/V a decoder has to keep, and it is what the multi_query preset shards.
#include <cmath>
#include <optional>

#include "partir/dsl/moe.hpp"
#include "partir/dsl/nn.hpp"

namespace partir::nn {

struct LayerNorm {
  std::string name;  // parameters: name/gamma (ones), name/beta (zeros)
  std::int64_t dim;
  Tensor operator()(const Tensor& x) const {
    return layer_norm(x, param(name + "/gamma", {dim}, ones_init(), x.dtype()),
                      param(name + "/beta", {dim}, zeros_init(), x.dtype()));
  }
};

// Causal self-attention over x [B, S, D] with `heads` query heads of D / heads features.
struct Attention {
  // Parameters name/wq, wk, wv, wo (+ bq, bv, bo). No key bias: it adds q.bk to every score of a query
  // alike, which softmax cancels, so its gradient is rounding noise that Adam would scale up to +-lr steps.
  std::string name;
  std::int64_t d_model, heads;
  bool bias = true;
  bool multi_query = false;

  Tensor operator()(const Tensor& x) const {
    if (x.rank() != 3 || x.dim(2) != d_model)
      user_error("Attention '" + name + "': expects [batch, seq, " + std::to_string(d_model) + "], got " +
                 to_string(x.type()));
    if (heads <= 0 || d_model % heads != 0)
      user_error("Attention '" + name + "': d_model " + std::to_string(d_model) + " is not divisible by " +
                 std::to_string(heads) + " heads");
    const std::int64_t B = x.dim(0), S = x.dim(1), Dh = d_model / heads;
    auto project = [&](const char* w, const char* b, std::int64_t out) {  // b = "": no bias
      return dense(x, name + "/" + w, name + "/" + b, d_model, out, bias && *b);
    };
    // Scaling q rather than the scores: [B, S, D] elements instead of [B, H, S, S].
    // q, k, v and the context bound the attention core that selective remat recomputes (remat.hpp).
    const Tensor q = checkpoint_name(
        reshape(project("wq", "bq", d_model) * (1.0 / std::sqrt(static_cast<double>(Dh))), {B, S, heads, Dh}), name + "/q");
    const std::int64_t kv_features = multi_query ? Dh : d_model;
    const Tensor k = checkpoint_name(project("wk", "", kv_features), name + "/k");
    const Tensor v = checkpoint_name(project("wv", "bv", kv_features), name + "/v");
    const Tensor context =
        checkpoint_name(multi_query ? shared_kv_context(q, k, v) : per_head_context(q, k, v), name + "/context");
    return dense(reshape(context, {B, S, d_model}), name + "/wo", name + "/bo", d_model, d_model, bias);
  }

  // q [B, S, H, Dh]; k, v [B, T, H * Dh]. Batch dims (b, h) lead the results: scores [B, H, S, T], context
  // [B, H, S, Dh], transposed back to [B, S, H, Dh].
  static Tensor per_head_context(const Tensor& q, Tensor k, Tensor v) {
    k = reshape(k, q.shape());
    v = reshape(v, q.shape());
    const Tensor scores = dot_general(q, k, {{0, 2}, {0, 2}, {3}, {3}});
    const Tensor probs = softmax(scores + causal_mask(scores.shape(), {2, 3}, q));
    return transpose(dot_general(probs, v, {{0, 1}, {0, 2}, {3}, {1}}), {0, 2, 1, 3});
  }
  // q [B, S, H, Dh]; k, v [B, T, Dh] serve every head: scores [B, S, H, T] and the context [B, S, H, Dh]
  // need no transposes.
  static Tensor shared_kv_context(const Tensor& q, const Tensor& k, const Tensor& v) {
    const Tensor scores = dot_general(q, k, {{0}, {0}, {3}, {2}});
    const Tensor probs = softmax(scores + causal_mask(scores.shape(), {1, 3}, q));
    return dot_general(probs, v, {{0}, {0}, {3}, {1}});
  }

  // 0 where query s may see key t (t <= s), a large negative number elsewhere, broadcast over the other dims
  // of scores of `shape` whose query and key dims are `dims`. Finite, so softmax never sees inf - inf.
  // Computed from the positions (f32: exact), not held as an S x S constant: a 2048-token model's 24 masks
  // would be 768 MB that every copy of the program copies. `shape` by value: adding ops may move the program's
  // storage, which a reference to a value's shape points into.
  static Tensor causal_mask(Shape shape, std::vector<std::int64_t> dims, const Tensor& like) {
    const std::int64_t S = shape[static_cast<std::size_t>(dims[0])];
    const Tensor query = iota(like.program(), {S, S}, 0), key = iota(like.program(), {S, S}, 1);
    const Tensor mask = convert(compare(key, query, CompareDir::gt) * -1e9, like.dtype());  // 0 * -1e9 in f32, not f16's inf
    return broadcast_in_dim(mask, std::move(shape), std::move(dims));
  }
};

struct GptConfig {
  std::int64_t vocab = 256;  // byte-level by default
  std::int64_t seq = 64;     // context length: the position table's rows
  std::int64_t d_model = 64, heads = 4, layers = 2;
  std::int64_t d_ff = 0;  // MLP hidden width; 0 means 4 * d_model
  bool tied = true;       // output projection = the token table, transposed
  bool bias = true;       // attention biases (the MLP always has them)
  bool multi_query = false;
  // Mixture of experts (dsl/moe.hpp) in place of every block's MLP when experts > 0; the loss adds
  // aux_loss_weight times the layers' load-balancing losses (Switch Transformer's 0.01).
  std::int64_t experts = 0;
  int top_k = 1;
  double capacity_factor = 1.25;
  double aux_loss_weight = 0.01;
};

// One pre-LayerNorm block: x + attn(ln1(x)), then + mlp(ln2(x)) (or + moe(ln2(x)), whose load-balancing loss is
// added to *aux). Its output is marked `name/out` (the block boundary that remat's blocks policy keeps).
struct TransformerBlock {
  std::string name;  // e.g. params/layers/3
  GptConfig config;
  Tensor operator()(Tensor x, std::optional<Tensor>* aux = nullptr) const {
    const auto D = config.d_model, H = config.d_ff > 0 ? config.d_ff : 4 * D;
    x = x + Attention{name + "/attn", D, config.heads, config.bias, config.multi_query}(LayerNorm{name + "/ln1", D}(x));
    const Tensor normed = LayerNorm{name + "/ln2", D}(x);
    if (config.experts > 0) {
      const MoeOutput moe = MixtureOfExperts{name + "/moe", D, H, config.experts, config.top_k, config.capacity_factor}(normed);
      if (aux) *aux = *aux ? **aux + moe.aux_loss : moe.aux_loss;
      return checkpoint_name(x + moe.y, name + "/out");
    }
    Mlp mlp{name + "/mlp", {D, H, D}, [](const Tensor& h) { return gelu(h); }};
    return checkpoint_name(x + mlp(normed), name + "/out");
  }
};

struct Gpt {
  GptConfig config;
  std::string name = "params";

  // tokens [B, S] i32 (S = config.seq) -> logits [B, S, vocab]; the experts' load-balancing losses summed into
  // *aux (left empty without experts).
  Tensor logits(const Tensor& tokens, std::optional<Tensor>* aux = nullptr) const {
    const auto& c = config;
    if (tokens.rank() != 2 || tokens.dtype() != DType::i32 || tokens.dim(1) != c.seq)
      user_error("Gpt: tokens must be i32 [batch, " + std::to_string(c.seq) + "], got " + to_string(tokens.type()));
    const Embedding tok_embed{name + "/tok_embed", c.vocab, c.d_model};
    // The position table is added whole (every window starts at position 0), so it needs no lookup.
    Tensor x = checkpoint_name(tok_embed(tokens) + param(name + "/pos_embed", {c.seq, c.d_model}, normal_init(0.02)),
                               name + "/embed");
    for (std::int64_t i = 0; i < c.layers; ++i) x = TransformerBlock{name + "/layers/" + std::to_string(i), c}(x, aux);
    x = LayerNorm{name + "/ln_f", c.d_model}(x);
    if (!c.tied) return dense(x, name + "/head/w", "", c.d_model, c.vocab, false);
    // The table is N(0, 1), so the tied projection is scaled by 1/sqrt(D) to give logits of unit scale,
    // as the untied head's N(0, 1/D) weights do.
    const Tensor table = param(tok_embed.name + "/table", {c.vocab, c.d_model}, normal_init(1.0));
    return dot_general(x * (1.0 / std::sqrt(static_cast<double>(c.d_model))), table, {{}, {}, {2}, {1}});
  }

  // Mean next-token cross-entropy (targets [B, S] i32 are the tokens shifted by one), plus the weighted
  // load-balancing loss of the experts if any.
  Tensor loss(const Tensor& tokens, const Tensor& targets) const {
    std::optional<Tensor> aux;
    const Tensor loss = cross_entropy(logits(tokens, &aux), targets);
    return aux ? loss + config.aux_loss_weight * *aux : loss;
  }
};

}  // namespace partir::nn
