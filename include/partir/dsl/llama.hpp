#pragma once
// A Llama-family decoder (Touvron et al. 2023): RMSNorm before each sublayer, rotary position embeddings on q
// and k, grouped-query attention (kv_heads <= heads: each K/V head serves heads / kv_heads query heads), a
// SwiGLU MLP, no biases, an untied output head unless tie_embeddings. Parameters carry Hugging Face's names
// for LlamaForCausalLM under params/, '/' for '.' (runtime/state/safetensors.hpp maps one to the other):
//   params/model/embed_tokens/weight [V, D]
//   params/model/layers/<i>/input_layernorm/weight [D]   params/model/layers/<i>/post_attention_layernorm/weight
//   params/model/layers/<i>/self_attn/{q,o}_proj/weight  [H*Dh, D], [D, H*Dh]
//   params/model/layers/<i>/self_attn/{k,v}_proj/weight  [KV*Dh, D]
//   params/model/layers/<i>/mlp/{gate,up}_proj/weight    [F, D]    params/model/layers/<i>/mlp/down_proj/weight [D, F]
//   params/model/norm/weight [D]                         params/lm_head/weight [V, D] (untied only)
// Linear weights keep Hugging Face's (and torch.nn.Linear's) [out, in] layout: a layer computes x W^T by
// contracting x's features with W's dim 1, so a safetensors tensor is the parameter byte for byte, with no
// transpose on save or load.
#include <cmath>

#include "partir/dsl/nn.hpp"
#include "partir/dsl/transformer.hpp"

namespace partir::nn {

struct LlamaConfig {
  std::int64_t vocab = 256;  // byte-level by default
  std::int64_t seq = 64;     // context length: the rotary table's rows
  std::int64_t d_model = 64, layers = 2, heads = 4, kv_heads = 2;
  std::int64_t ffn = 0;  // SwiGLU's hidden width; 0: 8/3 d_model rounded up to a multiple of 32 (Llama's rule)
  double rope_theta = 10000;
  double norm_eps = 1e-6;  // Hugging Face's rms_norm_eps default
  bool tie_embeddings = false;

  std::int64_t head_dim() const { return d_model / heads; }
  std::int64_t ffn_width() const { return ffn > 0 ? ffn : (8 * d_model / 3 + 31) / 32 * 32; }
  friend bool operator==(const LlamaConfig&, const LlamaConfig&) = default;
};

// x [..., in] W^T with W [out, in] ~ N(0, 1/in) (LeCun, as nn::dense): torch.nn.Linear without bias.
inline Tensor linear(const Tensor& x, const std::string& name, std::int64_t in, std::int64_t out) {
  if (x.dim(-1) != in)
    user_error("linear '" + name + "': input " + to_string(x.type()) + " has " + std::to_string(x.dim(-1)) +
               " features, the layer expects " + std::to_string(in));
  const Tensor w = param(name, {out, in}, normal_init(1.0 / std::sqrt(static_cast<double>(in))), x.dtype());
  return dot_general(x, w, {{}, {}, {x.rank() - 1}, {1}});
}

struct RmsNorm {
  std::string name;  // parameter: name/weight (ones)
  std::int64_t dim;
  double eps = 1e-6;
  Tensor operator()(const Tensor& x) const { return rms_norm(x, param(name + "/weight", {dim}, ones_init(), x.dtype()), eps); }
};

// Rotary position embedding (Su et al. 2021) of x [B, S, heads, Dh] at positions 0..S-1, in Hugging Face's
// half-split convention (rotate_half: feature i pairs with i + Dh/2), the one its Llama checkpoints assume:
//   x cos(pos theta^(-2i/Dh)) + rotate_half(x) sin(pos theta^(-2i/Dh)).
// The table is a constant of the program rather than an input: it depends on the shapes and theta alone, so
// nothing has to feed it each step, and a constant is replicated on every device whatever the plan.
inline Tensor rotary(const Tensor& x, double theta) {
  if (x.rank() != 4 || x.dim(3) % 2 != 0)
    user_error("rotary: expects [batch, seq, heads, head_dim] with an even head_dim, got " + to_string(x.type()));
  const std::int64_t S = x.dim(1), Dh = x.dim(3), half = Dh / 2;
  std::vector<double> cos_table(static_cast<std::size_t>(S * Dh)), sin_table(cos_table.size());
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t i = 0; i < Dh; ++i) {
      const double angle = static_cast<double>(s) *
                           std::pow(theta, -2.0 * static_cast<double>(i % half) / static_cast<double>(Dh));
      cos_table[static_cast<std::size_t>(s * Dh + i)] = std::cos(angle);
      sin_table[static_cast<std::size_t>(s * Dh + i)] = std::sin(angle);
    }
  auto table = [&](std::vector<double> values) {
    return broadcast_in_dim(constant(x.program(), std::move(values), {S, Dh}, x.dtype()), x.shape(), {1, 3});
  };
  const std::int64_t B = x.dim(0), H = x.dim(2);
  const Tensor first = slice(x, {0, 0, 0, 0}, {B, S, H, half}), second = slice(x, {0, 0, 0, half}, {B, S, H, Dh});
  return x * table(std::move(cos_table)) + concatenate({-second, first}, 3) * table(std::move(sin_table));
}

// Causal grouped-query self-attention over x [B, S, D]: `heads` query heads, `kv_heads` K/V heads, each K/V
// head read by heads / kv_heads consecutive query heads (Hugging Face's repeat_kv). K and V are repeated to
// the query heads explicitly: then a model axis that splits the query heads splits the attention core
// whether or not it divides the K/V heads (megatron keeps K/V whole where it does not).
struct GroupedQueryAttention {
  std::string name;  // e.g. params/model/layers/0/self_attn
  std::int64_t d_model, heads, kv_heads;
  double rope_theta = 10000;

  Tensor operator()(const Tensor& x) const {
    if (x.rank() != 3 || x.dim(2) != d_model)
      user_error("GroupedQueryAttention '" + name + "': expects [batch, seq, " + std::to_string(d_model) + "], got " +
                 to_string(x.type()));
    if (heads <= 0 || d_model % heads != 0 || kv_heads <= 0 || heads % kv_heads != 0)
      user_error("GroupedQueryAttention '" + name + "': " + std::to_string(heads) + " heads and " +
                 std::to_string(kv_heads) + " K/V heads need heads dividing d_model " + std::to_string(d_model) +
                 " and K/V heads dividing heads");
    const std::int64_t B = x.dim(0), S = x.dim(1), Dh = d_model / heads, group = heads / kv_heads;
    // Scaling q rather than the scores: [B, S, D] elements instead of [B, H, S, S].
    const Tensor q = checkpoint_name(
        rotary(reshape(linear(x, name + "/q_proj/weight", d_model, heads * Dh), {B, S, heads, Dh}), rope_theta) *
            (1.0 / std::sqrt(static_cast<double>(Dh))),
        name + "/q");
    const Tensor k_heads = tag(reshape(linear(x, name + "/k_proj/weight", d_model, kv_heads * Dh), {B, S, kv_heads, Dh}),
                               name + "/kv_heads");
    const Tensor k = checkpoint_name(rotary(k_heads, rope_theta), name + "/k");
    const Tensor v = checkpoint_name(
        reshape(linear(x, name + "/v_proj/weight", d_model, kv_heads * Dh), {B, S, kv_heads, Dh}), name + "/v");
    auto repeat = [&](const Tensor& t) {
      return group == 1 ? t : reshape(broadcast_in_dim(t, {B, S, kv_heads, group, Dh}, {0, 1, 2, 4}), {B, S, heads, Dh});
    };
    const Tensor context = checkpoint_name(Attention::per_head_context(q, repeat(k), repeat(v)), name + "/context");
    return linear(reshape(context, {B, S, heads * Dh}), name + "/o_proj/weight", heads * Dh, d_model);
  }
};

// SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)). gate's and up's outputs are marked name/a1, a2 and
// their product name/h1, the bounds of the elementwise part that selective remat recomputes (as nn::Mlp).
struct SwiGlu {
  std::string name;  // e.g. params/model/layers/0/mlp
  std::int64_t d_model, hidden;
  Tensor operator()(const Tensor& x) const {
    const Tensor gate = checkpoint_name(linear(x, name + "/gate_proj/weight", d_model, hidden), name + "/a1");
    const Tensor up = checkpoint_name(linear(x, name + "/up_proj/weight", d_model, hidden), name + "/a2");
    return linear(checkpoint_name(silu(gate) * up, name + "/h1"), name + "/down_proj/weight", hidden, d_model);
  }
};

struct Llama {
  LlamaConfig config;

  // tokens [B, S] i32 (S = config.seq) -> logits [B, S, vocab].
  Tensor logits(const Tensor& tokens) const {
    const auto& c = config;
    if (tokens.rank() != 2 || tokens.dtype() != DType::i32 || tokens.dim(1) != c.seq)
      user_error("Llama: tokens must be i32 [batch, " + std::to_string(c.seq) + "], got " + to_string(tokens.type()));
    if (c.heads <= 0 || c.d_model % c.heads != 0 || c.head_dim() % 2 != 0)
      user_error("Llama: d_model " + std::to_string(c.d_model) + " over " + std::to_string(c.heads) +
                 " heads must give an even head_dim (rotary pairs features)");
    // N(0, 1/D): a row has unit norm, so the tied head's logits start at unit scale without a factor that a
    // Hugging Face checkpoint would not know about.
    const Tensor table = param("params/model/embed_tokens/weight", {c.vocab, c.d_model},
                               normal_init(1.0 / std::sqrt(static_cast<double>(c.d_model))));
    Tensor x = checkpoint_name(gather(table, tokens), "params/model/embed");
    for (std::int64_t i = 0; i < c.layers; ++i) {
      const std::string layer = "params/model/layers/" + std::to_string(i);
      x = x + GroupedQueryAttention{layer + "/self_attn", c.d_model, c.heads, c.kv_heads, c.rope_theta}(
                  RmsNorm{layer + "/input_layernorm", c.d_model, c.norm_eps}(x));
      x = checkpoint_name(
          x + SwiGlu{layer + "/mlp", c.d_model, c.ffn_width()}(RmsNorm{layer + "/post_attention_layernorm", c.d_model, c.norm_eps}(x)),
          layer + "/out");
    }
    x = RmsNorm{"params/model/norm", c.d_model, c.norm_eps}(x);
    return c.tie_embeddings ? dot_general(x, table, {{}, {}, {2}, {1}}) : linear(x, "params/lm_head/weight", c.d_model, c.vocab);
  }

  // Mean next-token cross-entropy (targets [B, S] i32 are the tokens shifted by one).
  Tensor loss(const Tensor& tokens, const Tensor& targets) const { return cross_entropy(logits(tokens), targets); }
};

}  // namespace partir::nn
