// The GPT of dsl/transformer.hpp under the PartIR strategies: the collective plan of each preset matches the
// published per-layer counts (Megatron-LM: 2 all_reduces forward, 2 backward; BP: one gradient all_reduce per
// parameter; ZeRO-3: parameters all-gathered, gradients reduce-scattered), and every composition computes
// what the single-device interpreter computes.
#include <doctest/doctest.h>

#include <partir/partir.hpp>
#include <partir/calibrate/trace.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <numbers>
#include <numeric>
#include <random>

using namespace partir;

namespace {

using CK = CollectiveKind;

constexpr std::int64_t batch = 8;

nn::GptConfig small(std::int64_t layers = 2) {
  return {.vocab = 32, .seq = 8, .d_model = 16, .heads = 2, .layers = layers};
}

std::vector<InputSpec> data_specs(const nn::GptConfig& c) {
  return {{"tokens", {batch, c.seq}, DType::i32}, {"targets", {batch, c.seq}, DType::i32}};
}

// Adam divides each gradient by its own running scale, so where a gradient is as small as its rounding error
// (which a partitioned run, summing in another order, changes) two runs may step apart by up to the learning
// rate. A larger eps bounds that amplification to lr / eps for the differential tests.
Program train(const nn::GptConfig& c, double adam_eps = 1e-8) {
  const nn::Gpt model{c};
  return train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2, 0.9, 0.999, adam_eps},
                    data_specs(c));
}

// The same step under a mixed-precision policy (the model code unchanged).
Program train_mixed(const nn::GptConfig& c, DType compute, double adam_eps = 1e-8) {
  const nn::Gpt model{c};
  return train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2, 0.9, 0.999, adam_eps},
                    data_specs(c), MixedPrecision::with_compute(compute));
}

// The practitioners' step: AdamW, gradients clipped to a global norm of 0.5 (the small GPT's norm is ~1.3, so
// clipping acts), a learning rate scaled by the "opt/lr_scale" input.
Program train_recipe(const nn::GptConfig& c, DType compute = DType::f32) {
  const nn::Gpt model{c};
  StepOptions options;
  if (compute != DType::f32) options.precision = MixedPrecision::with_compute(compute);
  options.clip_norm = 0.5;
  options.scheduled_learning_rate = true;
  return train_step([&](Tensor t, Tensor y) { return model.loss(t, y); },
                    AdamW{.learning_rate = 1e-2, .eps = 1e-3, .weight_decay = 0.1}, data_specs(c), options);
}

// train(c, 1e-3) with StepOptions (remat, microbatches).
Program train_with(const nn::GptConfig& c, const StepOptions& options) {
  const nn::Gpt model{c};
  return train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2, 0.9, 0.999, 1e-3}, data_specs(c),
                    options);
}

// The loss alone: what the train step computes before its backward pass.
Program forward(const nn::GptConfig& c) {
  const nn::Gpt model{c};
  return trace("gpt_loss", [&](Tensor t, Tensor y) { return model.loss(t, y); }, data_specs(c));
}

std::vector<ValueId> parameters(const Program& p) {
  std::vector<ValueId> out;
  for (auto v : p.inputs())
    if (p.op(v).attrs.input_kind == InputKind::parameter) out.push_back(v);
  return out;
}

std::int64_t parameter_bytes(const Program& p) {
  std::int64_t total = 0;
  for (auto v : parameters(p)) total += p.type(v).bytes();
  return total;
}

// The parameters the loss's backward pass reads (a weight, for its input's gradient; not the optimizer's
// update, which reads the parameter's own shard): ZeRO-3 gathers these a second time.
std::vector<ValueId> read_by_backward(const nn::GptConfig& c) {
  Program g = forward(c);
  grad(g, g.outputs().at(0).value, parameters(g));
  const Program p = rematerialize(g, Remat::none());  // as train_step: a gain's broadcast made again from it
  std::vector<ValueId> out;
  for (auto v : parameters(p))
    for (ValueId u = p.backward_start().value(); u < p.size(); ++u)
      if (std::ranges::count(p.op(u).operands, v) > 0) {
        out.push_back(v);
        break;
      }
  return out;
}

// Communicating collectives by kind and axes ("all_reduce{model}"); scalars (the loss) apart, all_slice
// (a local copy) left out.
std::map<std::string, int> plan(const SpmdProgram& p, bool scalars = false) {
  std::map<std::string, int> n;
  for (const auto& c : p.collectives())
    if (c.collective.kind != CK::all_slice && (c.operand.rank() > 0) != scalars)
      ++n[std::string(name_of(c.collective.kind)) + to_string(c.collective.axes)];
  return n;
}

// Bytes of the collectives of one kind and axes: per device, the larger of operand and result (the whole
// tensor for an all_gather's result or a reduce_scatter's operand).
std::int64_t bytes(const SpmdProgram& p, CK kind, const AxisList& axes) {
  std::int64_t total = 0;
  for (const auto& c : p.collectives())
    if (c.collective.kind == kind && c.collective.axes == axes) total += c.bytes;
  return total;
}

NamedArrays random_inputs(const Program& p, std::int64_t vocab, std::uint64_t seed) {
  NamedArrays state = init_inputs(p, seed, true);
  std::mt19937_64 rng(seed);
  for (const char* name : {"tokens", "targets"})
    if (auto it = state.find(name); it != state.end())
      for (std::int64_t i = 0; i < it->second.size(); ++i) it->second.set(i, static_cast<double>(rng() % vocab));
  if (auto it = state.find(StepOptions::lr_scale_name); it != state.end()) it->second.set(0, 0.7);
  return state;
}

// The largest |a - b| / (1 + |a|) over every output of two consecutive steps (state carried, so loop-carried
// layouts are exercised) on every device, and where it is.
struct Error {
  double value = 0;
  std::string where;
};
Error max_error(const Program& step, const SpmdProgram& spmd, std::int64_t vocab, std::uint64_t seed) {
  NamedArrays state = random_inputs(step, vocab, seed), sharded_state = state;
  Error worst;
  for (int iteration = 0; iteration < 2; ++iteration) {
    NamedArrays expect = interpret(step, state);
    auto results = execute_on_threads(spmd, sharded_state);
    NamedArrays returned;  // a pipeline stage returns its own state and the plain outputs
    for (const auto& r : results)
      for (const auto& [name, a] : expect) {
        auto it = r.outputs.find(name);
        if (it == r.outputs.end()) continue;
        const Array& b = it->second;
        returned.try_emplace(name, b);
        REQUIRE(a.type() == b.type());
        for (std::int64_t i = 0; i < a.size(); ++i)
          if (const double e = std::abs(a.at(i) - b.at(i)) / (1 + std::abs(a.at(i))); e > worst.value)
            worst = {e, "step " + std::to_string(iteration + 1) + " " + name + "[" + std::to_string(i) + "]: " +
                            std::to_string(a.at(i)) + " vs " + std::to_string(b.at(i))};
      }
    REQUIRE(returned.size() == expect.size());
    carry_state(step, state, std::move(expect));
    carry_state(step, sharded_state, std::move(returned));
  }
  return worst;
}

// A plan of a differential test: step partitioned by `schedule` on `mesh` must compute what one device does.
struct PlanCase {
  std::string label;
  Mesh mesh;
  Schedule schedule;
};
const Mesh square{{"batch", 2}, {"model", 2}};
const Mesh cube{{"pod", 2}, {"batch", 2}, {"model", 2}};
void check_plans(const Program& step, const std::vector<PlanCase>& cases, std::int64_t vocab, std::uint64_t seed) {
  for (const auto& k : cases) {
    CAPTURE(k.label);
    const Error error = max_error(step, lower(partition(step, k.mesh, k.schedule)), vocab, ++seed);
    CHECK_MESSAGE(error.value < 1e-4, error.where);
  }
}

const Sharding& input_layout(const SpmdProgram& p, const std::string& name) {
  for (const auto& b : p.inputs())
    if (b.name == name) return b.sharding;
  FAIL("no input " << name);
  return p.inputs().front().sharding;
}

}  // namespace

TEST_CASE("gpt: parameters are named by layer") {
  const Program step = forward(small(1));
  std::vector<std::string> names;
  for (auto v : parameters(step)) names.push_back(step.op(v).name);
  std::sort(names.begin(), names.end());
  const std::vector<std::string> expect = {
      "params/layers/0/attn/bo",  "params/layers/0/attn/bq",   "params/layers/0/attn/bv",
      "params/layers/0/attn/wk",  "params/layers/0/attn/wo",   "params/layers/0/attn/wq",
      "params/layers/0/attn/wv",  "params/layers/0/ln1/beta",  "params/layers/0/ln1/gamma",
      "params/layers/0/ln2/beta", "params/layers/0/ln2/gamma", "params/layers/0/mlp/b1",
      "params/layers/0/mlp/b2",   "params/layers/0/mlp/w1",    "params/layers/0/mlp/w2",
      "params/ln_f/beta",         "params/ln_f/gamma",         "params/pos_embed",
      "params/tok_embed/table"};
  CHECK(names == expect);
  nn::GptConfig untied = small(1);
  untied.tied = false;
  CHECK(forward(untied).find_input("params/head/w"));
  nn::GptConfig mq = small(1);
  mq.multi_query = true;
  const Program mq_step = forward(mq);
  CHECK(mq_step.type(*mq_step.find_input("params/layers/0/attn/wk")).shape == Shape{16, 8});
  CHECK(mq_step.type(*mq_step.find_input("params/layers/0/attn/wq")).shape == Shape{16, 16});
}

TEST_CASE("gpt: attention is causal") {
  // Changing the last token changes no logit before the last position; changing the first changes them all.
  // (Within rounding: the kernels' sums may round differently from run to run.)
  nn::GptConfig c = small(2);
  for (bool multi_query : {false, true}) {
    CAPTURE(multi_query);
    c.multi_query = multi_query;
    const nn::Gpt model{c};
    const Program p = trace("logits", [&](Tensor t) { return model.logits(t); }, {{"tokens", {1, c.seq}, DType::i32}});
    NamedArrays in = random_inputs(p, c.vocab, 5);
    in["tokens"] = Array({1, c.seq}, std::vector<std::int32_t>{1, 2, 3, 4, 5, 6, 7, 8});
    const Array base = interpret(p, in).at("out");
    in["tokens"].set(c.seq - 1, 9);
    const Array last_changed = interpret(p, in).at("out");
    in["tokens"].set(0, 9);
    const Array first_changed = interpret(p, in).at("out");
    int moved_before_last = 0, moved = 0;
    for (std::int64_t i = 0; i < base.size(); ++i) {
      moved_before_last += i < (c.seq - 1) * c.vocab && std::abs(last_changed.at(i) - base.at(i)) > 1e-5;
      moved += std::abs(first_changed.at(i) - base.at(i)) > 1e-5;
    }
    CHECK(moved_before_last == 0);
    CHECK(moved == base.size());
  }
}

TEST_CASE("gpt: Adam fits a fixed batch") {
  const nn::GptConfig c = small(2);
  const Program step = train(c);
  NamedArrays state = random_inputs(step, c.vocab, 11);
  const double first = interpret(step, state).at("loss").at(0);
  // Logits of unit scale at initialization: about log(vocab) + 1/2.
  CHECK(std::abs(first - std::log(static_cast<double>(c.vocab)) - 0.5) < 0.5);
  double loss = first;
  for (int i = 0; i < 40; ++i) {
    NamedArrays out = interpret(step, state);
    loss = out.at("loss").at(0);
    carry_state(step, state, std::move(out));
  }
  CHECK(loss < 0.5 * first);
}

TEST_CASE("gpt: user errors name the block") {
  nn::GptConfig c = small(1);
  c.heads = 3;
  CHECK_THROWS_WITH_AS(forward(c), "Attention 'params/layers/0/attn': d_model 16 is not divisible by 3 heads", UserError);
  const nn::Gpt model{small(1)};
  CHECK_THROWS_WITH_AS(trace("bad", [&](Tensor t) { return model.logits(t); }, {{"tokens", {2, 5}, DType::i32}}),
                       "Gpt: tokens must be i32 [batch, 8], got i32[2,5]", UserError);
}

// ---- predictability: collective plans per layer ----

TEST_CASE("plan: Megatron has 2 all_reduces per layer forward and 2 backward") {
  const Mesh mesh{{"model", 2}};
  for (std::int64_t layers : {1, 2, 3}) {
    CAPTURE(layers);
    const nn::GptConfig c = small(layers);
    const int L = static_cast<int>(layers);
    // Forward: after attention's wo (row-tiled) and after the MLP's w2, the partial sums meet the residual.
    const SpmdProgram fwd = lower(partition(forward(c), mesh, {megatron("model")}));
    CHECK(plan(fwd) == std::map<std::string, int>{{"all_reduce{model}", 2 * L}});
    // Backward: the input gradients of the column-tiled wq/wk/wv and w1 are partial sums, reduced once each
    // where LayerNorm's backward needs them whole. Embedding, loss and Adam add nothing.
    const SpmdProgram step = lower(partition(train(c), mesh, {megatron("model")}));
    CHECK(plan(step) == std::map<std::string, int>{{"all_reduce{model}", 4 * L}});
    CHECK(plan(step, true).empty());
    for (const auto& col : step.collectives()) {
      CHECK(col.operand.shape == Shape{batch, c.seq, c.d_model});  // activations, never weights
      CHECK(col.collective.reason.find("megatron(model)") != std::string::npos);
    }
    CHECK(input_layout(step, "params/layers/0/attn/wq").dims[1] == AxisList{"model"});
    CHECK(input_layout(step, "params/layers/0/attn/wo").dims[0] == AxisList{"model"});
    CHECK(input_layout(step, "params/layers/0/mlp/w1").dims[1] == AxisList{"model"});
    CHECK(input_layout(step, "params/layers/0/mlp/w2").dims[0] == AxisList{"model"});
  }
}

TEST_CASE("plan: BP all-reduces each parameter's gradient once, and the loss") {
  const Program step = train(small(2));
  const auto P = static_cast<int>(parameters(step).size());
  CHECK(P == 2 * 15 + 4);  // 15 per layer; embeddings and the final LayerNorm
  const SpmdProgram fwd = lower(partition(forward(small(2)), Mesh{{"batch", 4}}, {data_parallel("batch")}));
  CHECK(plan(fwd).empty());
  CHECK(plan(fwd, true) == std::map<std::string, int>{{"all_reduce{batch}", 1}});
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, {data_parallel("batch")}));
  CHECK(plan(spmd) == std::map<std::string, int>{{"all_reduce{batch}", P}});
  CHECK(plan(spmd, true) == std::map<std::string, int>{{"all_reduce{batch}", 1}});
  CHECK(bytes(spmd, CK::all_reduce, {"batch"}) == parameter_bytes(step) + 4);  // + the f32 loss
}

TEST_CASE("plan: ZeRO-3 all-gathers each parameter per pass that reads it and reduce-scatters its gradient") {
  const Program step = train(small(2));
  const auto P = static_cast<int>(parameters(step).size());
  const Program loss = forward(small(2));
  const std::vector<ValueId> reread = read_by_backward(small(2));
  const auto R = static_cast<int>(reread.size());
  std::int64_t reread_bytes = 0;
  for (auto v : reread) reread_bytes += loss.type(v).bytes();
  const Schedule schedule{data_parallel("batch"), zero3("batch")};
  const SpmdProgram fwd = lower(partition(forward(small(2)), Mesh{{"batch", 4}}, schedule));
  CHECK(plan(fwd) == std::map<std::string, int>{{"all_gather{batch}", P}});
  // As in the ZeRO paper, the backward pass gathers what it reads again instead of holding the forward's
  // copy: the matmul weights, LayerNorm gains and the tied table, not the biases or the position table.
  CHECK(R > 0);
  CHECK(R < P);
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, schedule));
  CHECK(plan(spmd) == std::map<std::string, int>{{"all_gather{batch}", P + R}, {"reduce_scatter{batch}", P}});
  CHECK(plan(spmd, true) == std::map<std::string, int>{{"all_reduce{batch}", 1}});
  CHECK(bytes(spmd, CK::all_gather, {"batch"}) == parameter_bytes(step) + reread_bytes);
  CHECK(bytes(spmd, CK::reduce_scatter, {"batch"}) == parameter_bytes(step));
  for (auto v : parameters(step)) CHECK(input_layout(spmd, step.op(v).name).dims[0] == AxisList{"batch"});
}

TEST_CASE("plan: compositions on a 2x2 mesh add their parts") {
  const Mesh mesh{{"batch", 2}, {"model", 2}};
  const nn::GptConfig c = small(2);
  const Program step = train(c);
  const auto P = static_cast<int>(parameters(step).size());
  const auto R = static_cast<int>(read_by_backward(c).size());  // gathered again for the backward pass
  const int L = 2;
  SUBCASE("bp,mp: BP's gradient all_reduces on batch, Megatron's on model") {
    const SpmdProgram spmd = lower(partition(step, mesh, parse_schedule("bp,mp")));
    CHECK(plan(spmd) == std::map<std::string, int>{{"all_reduce{batch}", P}, {"all_reduce{model}", 4 * L}});
    CHECK(plan(spmd, true) == std::map<std::string, int>{{"all_reduce{batch}", 1}});
  }
  SUBCASE("bp,mp,z3: ZeRO-3 on batch replaces the gradient all_reduces") {
    const SpmdProgram spmd = lower(partition(step, mesh, parse_schedule("bp,mp,z3")));
    CHECK(plan(spmd) == std::map<std::string, int>{
                            {"all_gather{batch}", P + R}, {"reduce_scatter{batch}", P}, {"all_reduce{model}", 4 * L}});
  }
  SUBCASE("bp,mp,z3,emb: the vocab-tiled table adds one all_reduce for the lookup") {
    // z3 put 'batch' on the table's vocab dim before emb appended 'model', so the table is [V{batch,model}, D]:
    // - forward: the lookup wants rows on 'model' alone: all_gather{batch,model} then a local slice (batch
    //   being major, it cannot be gathered alone); the lookup is a partial sum over model: all_reduce{model};
    //   the tied head wants the table whole (its vocab dim cannot take 'batch', which the logits' batch dim
    //   holds), a second all_gather{batch,model}, and a third for the head's backward pass;
    // - backward: the table's gradient (lookup + head) is all_reduced on batch, then sliced on
    //   {batch,model}, since 'model' cannot propagate into it below 'batch'; the other P - 1 parameters are
    //   gathered per pass and reduce-scattered as under bp,mp,z3.
    const SpmdProgram spmd = lower(partition(step, mesh, parse_schedule("bp,mp,z3,emb")));
    CHECK(plan(spmd) == std::map<std::string, int>{{"all_gather{batch,model}", 3},
                                                   {"all_gather{batch}", P - 1 + R - 1},
                                                   {"all_reduce{batch}", 1},
                                                   {"reduce_scatter{batch}", P - 1},
                                                   {"all_reduce{model}", 4 * L + 1}});
    CHECK(input_layout(spmd, "params/tok_embed/table").dims[0] == AxisList{"batch", "model"});
  }
  SUBCASE("bp,mp,emb,z3: a vocab-parallel table and head (Megatron's layout)") {
    // The table is [V{model,batch}, D]; the tied head gives logits tiled on vocab. Forward adds the lookup's
    // all_reduce, an all_gather of the logits for log_softmax's max (reduce_max needs its dim whole) and the
    // all_reduce of sum(exp) [B,S,1]; backward adds 2 all_reduces: the head's input gradient [B,S,D] and the
    // per-position sum of log_softmax's rule (dx = g - exp(y) sum(g), grad.hpp; its ops' own VJPs took three);
    // the scalar loss is a partial sum over batch and model.
    const SpmdProgram spmd = lower(partition(step, mesh, parse_schedule("bp,mp,emb,z3")));
    CHECK(plan(spmd) == std::map<std::string, int>{{"all_gather{batch}", P + R},
                                                   {"all_gather{model}", 1},
                                                   {"reduce_scatter{batch}", P},
                                                   {"all_reduce{model}", 4 * L + 4}});
    CHECK(plan(spmd, true) == std::map<std::string, int>{{"all_reduce{batch,model}", 1}});
    CHECK(input_layout(spmd, "params/tok_embed/table").dims[0] == AxisList{"model", "batch"});
  }
}

TEST_CASE("plan: compositions on a 2x2x2 mesh, data parallel over two axes") {
  const Program step = train(small(2));
  const auto P = static_cast<int>(parameters(step).size());
  const auto R = static_cast<int>(read_by_backward(small(2)).size());
  const int L = 2;
  const Schedule bp_mp{data_parallel("pod"), data_parallel("batch"), megatron("model")};
  SUBCASE("bp,mp: one gradient all_reduce over both data axes per parameter") {
    const SpmdProgram spmd = lower(partition(step, cube, bp_mp));
    CHECK(plan(spmd) == std::map<std::string, int>{{"all_reduce{pod,batch}", P}, {"all_reduce{model}", 4 * L}});
    CHECK(plan(spmd, true) == std::map<std::string, int>{{"all_reduce{pod,batch}", 1}});
  }
  SUBCASE("bp,mp,z3 with ZeRO on batch: reduce_scatter within a pod, all_reduce of the shard across pods") {
    Schedule schedule = bp_mp;
    schedule.push_back(zero3("batch"));
    const SpmdProgram spmd = lower(partition(step, cube, schedule));
    CHECK(plan(spmd) == std::map<std::string, int>{{"all_gather{batch}", P + R},
                                                   {"reduce_scatter{batch}", P},
                                                   {"all_reduce{pod}", P},
                                                   {"all_reduce{model}", 4 * L}});
  }
}

TEST_CASE("plan: MQ decoding keeps the one K/V head whole and splits query heads and the MLP") {
  nn::GptConfig c = small(2);
  c.multi_query = true;
  const nn::Gpt model{c};
  const Program logits = trace("logits", [&](Tensor t) { return model.logits(t); }, {{"tokens", {batch, c.seq}, DType::i32}});
  const SpmdProgram spmd = lower(partition(logits, Mesh{{"model", 2}}, {multi_query("model")}));
  // Per layer: the row-tiled wo and w2 each leave a partial sum for the residual, as in Megatron.
  CHECK(plan(spmd) == std::map<std::string, int>{{"all_reduce{model}", 2 * 2}});
  for (const char* kv : {"params/layers/0/attn/wk", "params/layers/0/attn/wv", "params/layers/1/attn/bv"})
    CHECK(input_layout(spmd, kv).is_replicated());
  CHECK(input_layout(spmd, "params/layers/0/attn/wq").dims[1] == AxisList{"model"});
  CHECK(input_layout(spmd, "params/layers/1/mlp/w2").dims[0] == AxisList{"model"});
  const Error error = max_error(logits, spmd, c.vocab, 3);
  CHECK_MESSAGE(error.value < 1e-4, error.where);
}

TEST_CASE("presets: emb and mq need what they shard") {
  const Program mlp = trace("mlp", [](Tensor x) { return nn::Mlp{"params/mlp", {4, 8, 4}}(x); }, {{"x", {2, 4}}});
  CHECK_THROWS_WITH_AS(partition(mlp, Mesh{{"model", 2}}, {embedding("model")}),
                       "tactic 1 (emb(model)): selector 'params/**/table|params/**/embed_tokens/weight' matches no input or tagged "
                       "value of program 'mlp'",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(mlp, Mesh{{"model", 2}}, {multi_query("model")}),
                       "tactic 1 (mq(model)): no parameter of 'mlp' is a K/V projection (params/**/attn/wk, wv) to keep whole",
                       UserError);
  CHECK(parse_schedule("bp,emb,mq") == Schedule{data_parallel("batch"), embedding("model"), multi_query("model")});
}

// ---- differential: partitioned == single device ----

TEST_CASE("differential: GPT train steps under compositions equal the single-device step") {
  struct Case {
    std::string label;
    Mesh mesh;
    Schedule schedule;
    bool tied = true, multi_query = false;
  };
  const Schedule cube_bp{data_parallel("pod"), data_parallel("batch")};
  auto with = [](Schedule s, std::vector<Tactic> more) {
    s.insert(s.end(), more.begin(), more.end());
    return s;
  };
  const std::vector<Case> cases = {
      {"mp 1x2", Mesh{{"model", 2}}, parse_schedule("mp")},
      {"bp 4", Mesh{{"batch", 4}}, parse_schedule("bp")},
      {"bp,z3 4", Mesh{{"batch", 4}}, parse_schedule("bp,z3")},
      {"bp,mp 2x2", square, parse_schedule("bp,mp")},
      {"bp,mp,z3 2x2", square, parse_schedule("bp,mp,z3")},
      {"bp,mp,z3,emb 2x2", square, parse_schedule("bp,mp,z3,emb")},
      {"bp,mp,emb,z3 2x2", square, parse_schedule("bp,mp,emb,z3")},
      {"bp,mp,z3,emb 2x2 untied", square, parse_schedule("bp,mp,z3,emb"), false},
      {"bp,mp,emb(dim 1) 2x2", square, {data_parallel("batch"), megatron("model"), embedding("model", 1)}},
      {"bp,mq 2x2 multi-query", square, parse_schedule("bp,mq"), true, true},
      {"bp,mp 2x2x2", cube, with(cube_bp, {megatron("model")})},
      {"bp,mp,z3 2x2x2", cube, with(cube_bp, {megatron("model"), zero3("batch")})},
      {"bp,mp,z3,emb 2x2x2", cube, with(cube_bp, {megatron("model"), zero3("batch"), embedding("model")})},
      {"bp,mp,z2 2x2x2", cube, with(cube_bp, {megatron("model"), zero2("pod")})},
  };
  std::uint64_t seed = 1;
  for (const auto& k : cases) {
    CAPTURE(k.label);
    nn::GptConfig c = small(2);
    c.tied = k.tied;
    c.multi_query = k.multi_query;
    const Program step = train(c, 1e-3);
    const SpmdProgram spmd = lower(partition(step, k.mesh, k.schedule));
    const Error error = max_error(step, spmd, c.vocab, ++seed);
    CHECK_MESSAGE(error.value < 1e-4, error.where);
  }
}

// ---- mixed precision ----

TEST_CASE("precision: under bf16 the master weights and Adam's state stay f32, the model computes in bf16") {
  const nn::GptConfig c = small(2);
  const Program f32 = train(c), step = train_mixed(c, DType::bf16);
  CHECK(parameters(step).size() == parameters(f32).size());
  for (auto v : step.inputs()) CHECK(step.type(v) == f32.type(*f32.find_input(step.op(v).name)));  // same inputs
  for (const auto& o : step.outputs()) CHECK(step.type(o.value).dtype == DType::f32);
  int dots = 0;
  for (ValueId v = 0; v < step.size(); ++v) {
    const Op& op = step.op(v);
    if (op.kind == OpKind::dot_general) {
      ++dots;
      CHECK(op.type.dtype == DType::bf16);
    }
    // The f32 list: softmax's exp and log_softmax's log run in f32.
    if (op.kind == OpKind::exp || op.kind == OpKind::log) CHECK(op.type.dtype == DType::f32);
  }
  CHECK(dots > 0);
  CHECK(step.type(step.output("loss")) == TensorType{{}, DType::f32});
}

TEST_CASE("plan: bf16 halves BP's gradient all_reduce and ZeRO-3's all_gather and reduce_scatter") {
  const nn::GptConfig c = small(2);
  const Mesh mesh{{"batch", 4}};
  for (DType half : {DType::bf16, DType::f16}) {
    CAPTURE(name_of(half));
    const Program f32 = train(c), mixed = train_mixed(c, half);
    const SpmdProgram bp32 = lower(partition(f32, mesh, {data_parallel("batch")}));
    const SpmdProgram bp16 = lower(partition(mixed, mesh, {data_parallel("batch")}));
    CHECK(plan(bp16) == plan(bp32));
    // Gradients are reduced in the compute dtype (scalars apart: the f32 loss, and f16's overflow check).
    auto gradient_bytes = [](const SpmdProgram& spmd) {
      std::int64_t total = 0;
      for (const auto& col : spmd.collectives())
        if (col.collective.kind == CK::all_reduce && col.operand.rank() > 0) total += col.bytes;
      return total;
    };
    CHECK(gradient_bytes(bp16) * 2 == gradient_bytes(bp32));
    const Schedule z3{data_parallel("batch"), zero3("batch")};
    const SpmdProgram z3_32 = lower(partition(f32, mesh, z3)), z3_16 = lower(partition(mixed, mesh, z3));
    CHECK(plan(z3_16) == plan(z3_32));
    // Each parameter is cast on its shard, then gathered as a 16-bit copy.
    CHECK(bytes(z3_16, CK::all_gather, {"batch"}) * 2 == bytes(z3_32, CK::all_gather, {"batch"}));
    CHECK(bytes(z3_16, CK::reduce_scatter, {"batch"}) * 2 == bytes(z3_32, CK::reduce_scatter, {"batch"}));
    for (const auto& col : z3_16.collectives())
      if (col.operand.rank() > 0 && col.collective.kind != CK::all_slice) CHECK(col.operand.dtype == half);
  }
}

TEST_CASE("differential: bf16 and f16 plans under compositions equal the same program on one device") {
  // Both sides round every op's result to 16 bits, but a partitioned run sums partial products and partial
  // gradients in another order and rounds them at other points (a partial sum is rounded before the
  // all_reduce): results differ by a few 16-bit ulps (2^-8 relative for bf16), which two Adam steps carry
  // into the parameters by at most a few lr * ulp. Hence 3e-2 relative, against 1e-4 for f32.
  struct Case {
    std::string label;
    Mesh mesh;
    Schedule schedule;
  };
  const std::vector<Case> cases = {
      {"bp 4", Mesh{{"batch", 4}}, parse_schedule("bp")},
      {"bp,mp 2x2", square, parse_schedule("bp,mp")},
      {"bp,z2 4", Mesh{{"batch", 4}}, parse_schedule("bp,z2")},
      {"bp,mp,z3 2x2", square, parse_schedule("bp,mp,z3")},
      {"bp,mp 2x2x2", cube, {data_parallel("pod"), data_parallel("batch"), megatron("model")}},
      {"bp,mp,z3 2x2x2", cube, {data_parallel("pod"), data_parallel("batch"), megatron("model"), zero3("batch")}},
  };
  std::uint64_t seed = 100;
  for (DType half : {DType::bf16, DType::f16})
    for (const auto& k : cases) {
      CAPTURE(k.label);
      CAPTURE(name_of(half));
      const nn::GptConfig c = small(2);
      const Program step = train_mixed(c, half, 1e-3);
      const Error error = max_error(step, lower(partition(step, k.mesh, k.schedule)), c.vocab, ++seed);
      CHECK_MESSAGE(error.value < 3e-2, error.where);
    }
}

TEST_CASE("precision: bf16 training follows f32 training") {
  const nn::GptConfig c = small(2);
  const Program f32 = train(c), bf16_step = train_mixed(c, DType::bf16);
  NamedArrays a = random_inputs(f32, c.vocab, 12), b = a;
  double loss32 = 0, loss16 = 0;
  for (int i = 0; i < 40; ++i) {
    NamedArrays out32 = interpret(f32, a), out16 = interpret(bf16_step, b);
    loss32 = out32.at("loss").at(0), loss16 = out16.at("loss").at(0);
    carry_state(f32, a, std::move(out32));
    carry_state(bf16_step, b, std::move(out16));
  }
  CHECK(loss16 < 0.6 * std::log(static_cast<double>(c.vocab)));
  CHECK(std::abs(loss16 - loss32) < 0.05 * loss32 + 0.02);
}

TEST_CASE("precision: f16 loss scaling skips a step whose gradients overflow, backs off, and grows after clean steps") {
  const nn::GptConfig c = small(1);
  const nn::Gpt model{c};
  MixedPrecision policy = MixedPrecision::with_compute(DType::f16);
  REQUIRE(policy.loss_scaling);
  policy.loss_scaling->interval = 2;
  const Program step = train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2}, data_specs(c),
                                  policy);
  NamedArrays state = random_inputs(step, c.vocab, 5);
  CHECK(state.at(LossScaling::scale_name).at(0) == 65536);
  auto scale_and_clean = [](const NamedArrays& s) {
    return std::pair{s.at(LossScaling::scale_name).at(0), s.at(LossScaling::clean_steps_name).at(0)};
  };
  auto unchanged = [&](const NamedArrays& out, const NamedArrays& in) {
    for (const auto& o : step.outputs())
      if (!o.updates.empty() && o.updates.rfind("opt/loss_scale", 0) != 0 && !(out.at(o.name) == in.at(o.updates)))
        return false;
    return true;
  };
  // A scale that overflows (the scaled loss is inf in f32, the f16 gradients with it): nothing moves.
  state[LossScaling::scale_name] = Array({}, std::vector<float>{3e38f});
  NamedArrays out = interpret(step, state);
  CHECK(std::isfinite(out.at("loss").at(0)));
  CHECK(unchanged(out, state));
  NamedArrays next = state;
  carry_state(step, next, std::move(out));
  CHECK(scale_and_clean(next) == std::pair{static_cast<double>(3e38f) / 2, 0.0});
  // The same under bp,mp,z3 on 4 devices: every device skips (they agree through the reduced check).
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 2}, {"model", 2}}, parse_schedule("bp,mp,z3")));
  for (const auto& r : execute_on_threads(spmd, state)) CHECK(unchanged(r.outputs, state));
  // Clean steps update the parameters; the second in a row doubles the scale.
  next[LossScaling::scale_name] = Array({}, std::vector<float>{1024});
  out = interpret(step, next);
  CHECK(!unchanged(out, next));
  carry_state(step, next, std::move(out));
  CHECK(scale_and_clean(next) == std::pair{1024.0, 1.0});
  carry_state(step, next, interpret(step, next));
  CHECK(scale_and_clean(next) == std::pair{2048.0, 0.0});
}

TEST_CASE("precision: policies name what they break") {
  const nn::GptConfig c = small(1);
  const nn::Gpt model{c};
  auto loss = [&](Tensor t, Tensor y) { return model.loss(t, y); };
  // E80 a policy naming an integer dtype
  CHECK_THROWS_WITH_AS(train_step(loss, Adam{}, data_specs(c), MixedPrecision{.compute = DType::i32}),
                       "train_step 'train_step': MixedPrecision.compute = i32 is not a floating-point dtype "
                       "(f32, f64, bf16 or f16)",
                       UserError);
  // E81 a reduce dtype other than the compute dtype
  CHECK_THROWS_WITH_AS(
      train_step(loss, Adam{}, data_specs(c), MixedPrecision{.compute = DType::bf16, .reduce = DType::f32}),
      "train_step 'train_step': MixedPrecision.reduce = f32 with compute = bf16: gradients are reduced in the "
      "narrowest dtype they take, the compute dtype; set reduce = compute",
      UserError);
  // E84 a loss scaling that cannot work
  MixedPrecision shrinking = MixedPrecision::with_compute(DType::f16);
  shrinking.loss_scaling->growth = 0.5;
  CHECK_THROWS_WITH_AS(train_step(loss, Adam{}, data_specs(c), shrinking),
                       "train_step 'train_step': LossScaling{initial 65536.000000, growth 0.500000, backoff 0.500000, "
                       "interval 2000}: needs initial > 0, growth >= 1, 0 < backoff < 1, interval >= 1",
                       UserError);
  // E82 an unknown --precision name
  CHECK_THROWS_WITH_AS(MixedPrecision::parse("fp8", "--precision"), "--precision='fp8': expected f32, bf16 or f16",
                       UserError);
}

// ---- the training recipe: clipping by the global norm ----

TEST_CASE("plan: global-norm clipping adds one scalar all_reduce per group of axes that split the gradients") {
  const nn::GptConfig c = small(2);
  const Mesh line{{"batch", 4}}, square{{"batch", 2}, {"model", 2}};
  struct Case {
    std::string schedule;
    Mesh mesh;
    std::map<std::string, int> norm;  // the clipping's scalar all_reduces
  };
  const std::vector<Case> cases = {
      {"bp", line, {}},  // gradients all-reduced whole: every device sums the squares itself
      {"bp,z2", line, {{"all_reduce{batch}", 1}}},
      {"bp,z3", line, {{"all_reduce{batch}", 1}}},
      {"bp,mp", square, {{"all_reduce{model}", 1}}},
      {"bp,mp,z3", square, {{"all_reduce{batch}", 1}, {"all_reduce{batch,model}", 1}}},
      {"bp,mp,z3,emb", square, {{"all_reduce{batch}", 1}, {"all_reduce{batch,model}", 1}}},
  };
  const Program plain = train(c), recipe = train_recipe(c);
  for (const auto& k : cases) {
    CAPTURE(k.schedule);
    const SpmdProgram base = lower(partition(plain, k.mesh, parse_schedule(k.schedule)));
    const SpmdProgram clipped = lower(partition(recipe, k.mesh, parse_schedule(k.schedule)));
    // Tensors move exactly as without clipping: ZeRO's reduce_scatters stay reduce_scatters.
    CHECK(plan(clipped) == plan(base));
    std::map<std::string, int> norm;
    for (const auto& col : clipped.collectives())
      if (col.operand.rank() == 0 && col.collective.reason.find(StepOptions::clip_tag) != std::string::npos) {
        CHECK(col.collective.kind == CK::all_reduce);
        ++norm[std::string(name_of(col.collective.kind)) + to_string(col.collective.axes)];
      }
    CHECK(norm == k.norm);
    auto others = plan(clipped, true);
    for (const auto& [key, n] : norm) others[key] -= n;
    std::erase_if(others, [](const auto& kv) { return kv.second == 0; });
    CHECK(others == plan(base, true));  // the loss's all_reduce, as before
  }
  // bf16 gradients: reduce-scattered in bf16, squared on their shards in f32.
  const SpmdProgram z2 = lower(partition(train_recipe(c, DType::bf16), line, parse_schedule("bp,z2")));
  CHECK(plan(z2) == plan(lower(partition(plain, line, parse_schedule("bp,z2")))));
  for (const auto& col : z2.collectives())
    if (col.collective.kind == CK::reduce_scatter) CHECK(col.operand.dtype == DType::bf16);
}

TEST_CASE("differential: the clipped AdamW step with a scheduled rate equals the single-device step") {
  const nn::GptConfig c = small(2);
  check_plans(train_recipe(c), {
      {"bp 4", Mesh{{"batch", 4}}, parse_schedule("bp")},
      {"bp,z3 4", Mesh{{"batch", 4}}, parse_schedule("bp,z3")},
      {"bp,mp 2x2", square, parse_schedule("bp,mp")},
      {"bp,mp,z3,emb 2x2", square, parse_schedule("bp,mp,z3,emb")},
      {"bp,mp,z3 2x2x2", cube, {data_parallel("pod"), data_parallel("batch"), megatron("model"), zero3("batch")}},
      {"bp,mp,z2,emb 2x2x2", cube,
       {data_parallel("pod"), data_parallel("batch"), megatron("model"), zero2("pod"), embedding("model")}},
  }, c.vocab, 300);
}

// ---- activation rematerialization ----

TEST_CASE("remat: blocks and selective recompute in the backward pass, bitwise equal, in less memory") {
  nn::GptConfig c = small(4);
  c.seq = 16;
  const Program none = train(c, 1e-3), blocks = train_with(c, {.remat = Remat::blocks()}),
                selective = train_with(c, {.remat = Remat::selective()});
  CHECK(train_with(c, {.remat = Remat::none()}) == none);
  // Every recomputation runs in the backward pass and names its policy.
  for (const Program* p : {&blocks, &selective}) {
    REQUIRE(!p->recomputes().empty());
    for (const auto& r : p->recomputes()) {
      CHECK(r.value >= *p->backward_start());
      CHECK(r.original < *p->backward_start());
      CHECK(p->op(r.value).kind == p->op(r.original).kind);
      CHECK(p->op(r.value).name.starts_with("remat(" + r.policy + ")"));
    }
  }
  // Attention recomputes its core only: score-shaped values [B, H, S, S] and their neighbours, no matmul of a
  // weight; selective adds the MLP's activation function (GELU's elementwise ops, from its input).
  const Program attention = train_with(c, {.remat = Remat::attention()});
  int scores = 0;
  for (const auto& r : attention.recomputes()) {
    scores += attention.type(r.value).shape == Shape{batch, c.heads, c.seq, c.seq};
    const Op& op = attention.op(r.original);
    CHECK(!(op.kind == OpKind::dot_general && attention.op(op.operands[1]).kind == OpKind::input));
  }
  CHECK(scores >= 4);
  auto elementwise = [](const Program& p) {
    std::size_t n = 0;
    for (const auto& r : p.recomputes()) n += is_elementwise(p.op(r.original).kind);
    return n;
  };
  CHECK(selective.recomputes().size() > attention.recomputes().size());
  CHECK(elementwise(selective) > elementwise(attention));
  CHECK(blocks.recomputes().size() > 2 * selective.recomputes().size());

  NamedArrays state = random_inputs(none, c.vocab, 21);
  RunStats plain, by_blocks, by_selective;
  const NamedArrays expect = interpret(none, state, &plain);
  CHECK(interpret(blocks, state, &by_blocks) == expect);
  CHECK(interpret(selective, state, &by_selective) == expect);
  CHECK(interpret(attention, state) == expect);
  CHECK(by_blocks.peak_bytes < 0.7 * static_cast<double>(plain.peak_bytes));
  CHECK(by_selective.peak_bytes < plain.peak_bytes);
}

TEST_CASE("remat: in bf16 a parameter's cast is made again, its arithmetic is kept, and a max's gradient finds the max") {
  // max(exp(tanh(w)) * w) of a parameter w: made again for the backward pass inside another fused group,
  // exp(tanh(w)) in bf16 kept f32 between its steps where the forward's group had stored tanh rounded, reduce_max's gradient
  // (operand == max) matched nothing and the step's gradient norm was NaN (found by test_fuzz in bf16).
  auto step_in = [](DType compute) {
    StepOptions options{.clip_norm = 1.0};
    if (compute != DType::f32) options.precision = MixedPrecision::with_compute(compute);
    return train_step(
        [](const std::vector<Tensor>&) {
          const Tensor w = param("params/w", {4, 6}, normal_init(0.5));
          const Tensor m = max(exp(tanh(w)) * w, {1});
          return sum(m * m);
        },
        Adam{1e-2}, {}, options, "max_of_params");
  };
  const Program f32 = step_in(DType::f32);
  const double norm = interpret(f32, init_inputs(f32, 3)).at("grad_norm").at(0);
  {  // (f16's first step overflows under its initial loss scale, as it should, and is skipped)
    const Program step = step_in(DType::bf16);
    bool cast_again = false;
    for (const auto& r : step.recomputes()) {
      const OpKind k = step.op(r.value).kind;
      CHECK((k != OpKind::tanh && k != OpKind::exp));
      cast_again |= k == OpKind::convert;
    }
    CHECK(cast_again);
    CHECK(interpret(step, init_inputs(step, 3)).at("grad_norm").at(0) == doctest::Approx(norm).epsilon(3e-2));
  }
}

TEST_CASE("differential: remat on and off give bitwise equal partitioned steps; recomputed values keep the layouts") {
  const nn::GptConfig c = small(2);
  const Program none = train(c, 1e-3);
  struct Case {
    std::string label;
    Mesh mesh;
    std::string schedule;
  };
  const std::vector<Case> cases = {{"none", Mesh{{"batch", 1}}, "none"},
                                   {"bp 4", Mesh{{"batch", 4}}, "bp"},
                                   {"bp,mp 2x2", square, "bp,mp"},
                                   {"bp,mp,z3 2x2", square, "bp,mp,z3"}};
  for (const Remat& remat : {Remat::blocks(), Remat::selective()}) {
    const Program step = train_with(c, {.remat = remat});
    for (const auto& k : cases) {
      CAPTURE(remat.name);
      CAPTURE(k.label);
      const Partitioned plan = partition(step, k.mesh, parse_schedule(k.schedule));
      for (const auto& r : step.recomputes()) CHECK(plan.sharding(r.value) == plan.sharding(r.original));
      NamedArrays state = random_inputs(none, c.vocab, 31);
      const auto base = execute_on_threads(lower(partition(none, k.mesh, parse_schedule(k.schedule))), state);
      const auto got = execute_on_threads(lower(plan), state);
      for (std::size_t d = 0; d < got.size(); ++d) CHECK(got[d].outputs == base[d].outputs);
      // The simulator follows the recomputation: predicted peak = the executor's measured peak.
      CHECK(simulate(lower(plan), HardwareProfile::cpu()).peak_bytes == got[0].peak_bytes);
    }
  }
}

TEST_CASE("remat: ZeRO-3 gathers a parameter the recomputation reads in the backward pass, not through it") {
  const nn::GptConfig c = small(2);
  const Mesh line{{"batch", 4}};
  const SpmdProgram plain = lower(partition(train(c, 1e-3), line, parse_schedule("bp,z3")));
  const SpmdProgram blocks = lower(partition(train_with(c, {.remat = Remat::blocks()}), line, parse_schedule("bp,z3")));
  // The backward pass already gathers the weights its gradients read; what only the recomputation reads
  // (the layer norms' and the query's biases) is gathered there too.
  CHECK(plan(blocks).at("all_gather{batch}") > plan(plain).at("all_gather{batch}"));
  CHECK(plan(blocks).at("reduce_scatter{batch}") == plan(plain).at("reduce_scatter{batch}"));
}

TEST_CASE("remat search: a budget the plain plan exceeds is met with remat, and the measured peak fits it") {
  nn::GptConfig c = small(4);
  c.seq = 16;
  const Program step = train(c, 1e-3);
  const Mesh mesh{{"batch", 2}};
  const Schedule bp = parse_schedule("bp");
  const auto peak = [&](const Remat& r) {
    return simulate(lower(partition(rematerialize(step, r), mesh, bp)), HardwareProfile::cpu()).peak_bytes;
  };
  const std::int64_t plain = peak(Remat::none()), blocks = peak(Remat::blocks());
  REQUIRE(blocks < plain);
  const std::int64_t budget = (plain + blocks) / 2;
  const RematChoice choice = choose_remat(step, mesh, bp, HardwareProfile::cpu(), budget);
  CAPTURE(choice.report());
  CHECK(choice.remat != Remat::none());
  CHECK(!choice.candidates.front().fits);
  CHECK(choice.report().find("over the budget") != std::string::npos);
  const auto results = execute_on_threads(lower(partition(choice.step, mesh, bp)), random_inputs(step, c.vocab, 41));
  for (const auto& r : results) CHECK(r.peak_bytes <= budget);
  CHECK_THROWS_WITH_AS(choose_remat(step, mesh, bp, HardwareProfile::cpu(), 1024),
                       ("choose_remat: no policy fits the budget of 1.00 KiB per device; the smallest predicted peak is " +
                        human_bytes(static_cast<double>(std::min(blocks, peak(Remat::selective()))))).c_str(),
                       UserError);
}

// ---- gradient accumulation ----

TEST_CASE("accumulation: M microbatches step as the whole batch does, in less activation memory") {
  nn::GptConfig c = small(2);
  c.seq = 16;
  const Program whole = train(c, 1e-3);
  NamedArrays state = random_inputs(whole, c.vocab, 51);
  RunStats one;
  const NamedArrays expect = interpret(whole, state, &one);
  for (int m : {2, 4, 8}) {
    CAPTURE(m);
    const Program step = train_with(c, {.microbatches = m});
    RunStats stats;
    const NamedArrays got = interpret(step, state, &stats);
    for (const auto& [name, a] : expect)
      for (std::int64_t i = 0; i < a.size(); ++i)
        CHECK(got.at(name).at(i) == doctest::Approx(a.at(i)).epsilon(1e-4).scale(1e-3));
    CHECK(stats.peak_bytes < one.peak_bytes);
  }
}

TEST_CASE("accumulation: partitioned microbatched steps equal the single-device one; BP reduces once per step") {
  const nn::GptConfig c = small(2);
  const Program step = train_with(c, {.microbatches = 2});
  check_plans(step, {
      {"bp 4", Mesh{{"batch", 4}}, parse_schedule("bp")},
      {"bp,z2 4", Mesh{{"batch", 4}}, parse_schedule("bp,z2")},
      {"bp,mp,z3 2x2", square, parse_schedule("bp,mp,z3")},
      {"bp,mp,z3 2x2x2", cube, {data_parallel("pod"), data_parallel("batch"), megatron("model"), zero3("batch")}},
  }, c.vocab, 60);
  // Each microbatch's rows stay on the devices that hold them, and the gradients add up before the one
  // reduction: the same collectives as the single-batch step.
  const Mesh line{{"batch", 4}};
  for (const char* schedule : {"bp", "bp,z2"}) {
    CAPTURE(schedule);
    CHECK(plan(lower(partition(step, line, parse_schedule(schedule)))) ==
          plan(lower(partition(train(c, 1e-3), line, parse_schedule(schedule)))));
  }
}

// ---- pipeline parallelism ----

namespace {

// Sends by the bytes they move.
std::map<std::int64_t, int> sends(const SpmdProgram& p) {
  std::map<std::int64_t, int> n;
  for (const auto& c : p.collectives())
    if (c.collective.kind == CK::send) ++n[c.operand.bytes()];
  return n;
}

}  // namespace

TEST_CASE("pipeline: GPipe and 1F1B steps equal the single-device accumulated step, alone and within bp, mp, z3") {
  nn::GptConfig c = small(4);
  const Mesh line2{{"stage", 2}}, line4{{"stage", 4}};
  const Mesh cube_pp{{"stage", 2}, {"batch", 2}, {"model", 2}};
  for (int m : {1, 2, 4}) {
    CAPTURE(m);
    const Program step = train_with(c, {.microbatches = m});
    check_plans(step, {
        {"1f1b 2", line2, parse_schedule("pp")},
        {"gpipe 2", line2, parse_schedule("pp:gpipe")},
        {"1f1b 4", line4, parse_schedule("pp")},
        {"gpipe 4", line4, parse_schedule("pp:gpipe")},
        {"pp,bp,mp,z3 2x2x2", cube_pp, parse_schedule("pp,bp,mp,z3")},
        {"bp,mp,z3,pp:gpipe 2x2x2", cube_pp, parse_schedule("bp,mp,z3,pp:gpipe")},
    }, c.vocab, 70 + static_cast<std::uint64_t>(m));
  }
  // Remat and clipping compose with the stages too (the global norm is summed across them).
  const Program recipe = train_with(c, {.clip_norm = 0.5, .remat = Remat::blocks(), .microbatches = 2});
  check_plans(recipe, {{"pp,bp 2x2", Mesh{{"stage", 2}, {"batch", 2}}, parse_schedule("pp,bp")}}, c.vocab, 80);
}

TEST_CASE("pipeline: per step and boundary, M activations forward and M gradients back; every transfer names the tactic") {
  nn::GptConfig c = small(4);
  c.tied = false;  // a tied embedding would also travel between the first and last stage
  const std::int64_t activation = batch * c.seq * c.d_model * 4;
  for (int m : {1, 2, 4})
    for (int stages : {2, 4}) {
      CAPTURE(m);
      CAPTURE(stages);
      const SpmdProgram p = lower(partition(train_with(c, {.microbatches = m}), Mesh{{"stage", stages}}, parse_schedule("pp")));
      const auto n = sends(p);
      CHECK(n.at(activation / m) == 2 * m * (stages - 1));
      // The loss goes to every stage; Adam's step counter lives on stage 0 and goes to the others.
      CHECK(n.at(4) == 2 * (stages - 1));
      CHECK(n.size() == 2);
      for (const auto& info : p.collectives())
        if (info.collective.kind == CK::send || info.collective.kind == CK::recv)
          CHECK(info.collective.reason.find("tactic 1 (pp(stage))") != std::string::npos);
      CHECK(p.pipeline() == SpmdPipeline{"stage", stages, PipelineSchedule::one_f_one_b, m});
    }
  // Other tactics act within the stages: bp's gradient all_reduces are the unpipelined step's, split over stages.
  const Program step = train_with(c, {.microbatches = 2});
  CHECK(plan(lower(partition(step, Mesh{{"stage", 2}, {"batch", 2}}, parse_schedule("pp,bp")))).at("all_reduce{batch}") ==
        plan(lower(partition(step, Mesh{{"batch", 2}}, parse_schedule("bp")))).at("all_reduce{batch}"));
}

TEST_CASE("pipeline: 1F1B holds fewer microbatches' activations than GPipe; the simulator predicts the bubble") {
  nn::GptConfig c = small(4);
  c.seq = 16;
  const Program step = train_with(c, {.microbatches = 4});
  const Mesh mesh{{"stage", 2}};
  const SpmdProgram gpipe = lower(partition(step, mesh, parse_schedule("pp:gpipe")));
  const SpmdProgram one_f_one_b = lower(partition(step, mesh, parse_schedule("pp")));
  const NamedArrays in = random_inputs(step, c.vocab, 90);
  const auto g = execute_on_threads(gpipe, in), o = execute_on_threads(one_f_one_b, in);
  CHECK(o[0].peak_bytes < g[0].peak_bytes);  // stage 0 keeps 2 microbatches' activations, not 4
  const Report rg = simulate(gpipe, HardwareProfile::cpu()), ro = simulate(one_f_one_b, HardwareProfile::cpu());
  CHECK(rg.stages.size() == 2);
  CHECK(rg.stages[0].peak_bytes == g[0].peak_bytes);  // memory as the executor counts it, per stage
  CHECK(ro.stages[0].peak_bytes == o[0].peak_bytes);
  CHECK(ro.stages[1].peak_bytes == o[1].peak_bytes);
  // The bubble shrinks as microbatches are added, towards (p - 1) / (M + p - 1).
  const Report r1 = simulate(lower(partition(train_with(c, {}), mesh, parse_schedule("pp"))), HardwareProfile::cpu());
  CHECK(r1.bubble_fraction > ro.bubble_fraction);
  CHECK(ro.bubble_fraction > 0.05);
  CHECK(ro.bubble_fraction < 0.5);
  // The trace has one track per stage.
  const auto events = trace_events(ro);
  CHECK(std::any_of(events.begin(), events.end(), [](const TraceEvent& e) { return e.device == 1; }));
}

TEST_CASE("pipeline: stages chosen by selectors; an Executable carries each stage's state; checkpoints change depth") {
  const nn::Mlp model{"params/mlp", {8, 32, 32, 16, 8}};
  auto loss = [&](Tensor x, Tensor y) { return mse(model(x), y); };
  const Program step = train_step(loss, Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}}, StepOptions{.microbatches = 2});
  const Schedule pp{pipeline("stage", PipelineSchedule::one_f_one_b,
                             {{"params/mlp/w1", "params/mlp/b1", "params/mlp/w2", "params/mlp/b2"},
                              {"params/mlp/w3", "params/mlp/b3", "params/mlp/w4", "params/mlp/b4"}}),
                    data_parallel("batch")};
  const Mesh mesh{{"stage", 2}, {"batch", 2}};
  const SpmdProgram spmd = lower(partition(step, mesh, pp));
  CHECK(max_error(step, spmd, 1, 100).value < 1e-5);
  // Three steps through Executables: each device holds its stage's state only; gathered, it is the state the
  // interpreter carries; saved, it restores into the unpipelined plan.
  NamedArrays state = init_inputs(step, 3, true);
  const NamedArrays batch{{"x", state.at("x")}, {"y", state.at("y")}};
  for (int s = 0; s < 3; ++s) carry_state(step, state, interpret(step, state));
  const std::string dir = "pipeline-checkpoint-test";
  std::filesystem::remove_all(dir);
  std::vector<NamedArrays> gathered(4);
  threads::run(4, [&](threads::Communicator& comm) {
    const Executable exe(spmd, comm);
    NamedArrays pieces = exe.init(3);
    for (const auto& [name, a] : pieces) CHECK(name.find(comm.device() < 2 ? "mlp/w3" : "mlp/w1") == std::string::npos);
    for (int s = 0; s < 3; ++s) exe.step(pieces, batch);
    gathered[static_cast<std::size_t>(comm.device())] = exe.gather_state(pieces);
    checkpoint::save(dir, spmd, comm, pieces, 3);
  });
  for (const auto& g : gathered)
    for (const auto& [name, a] : g)
      for (std::int64_t i = 0; i < a.size(); ++i) CHECK(a.at(i) == doctest::Approx(state.at(name).at(i)).epsilon(1e-5));
  const SpmdProgram flat = lower(partition(step, Mesh{{"batch", 4}}, parse_schedule("bp")));
  threads::run(4, [&](threads::Communicator& comm) {
    const Executable exe(flat, comm);
    NamedArrays pieces;
    CHECK(checkpoint::restore(dir, flat, comm, pieces) == 3);
    for (const auto& [name, a] : exe.gather_state(pieces))
      for (std::int64_t i = 0; i < a.size(); ++i) CHECK(a.at(i) == doctest::Approx(state.at(name).at(i)).epsilon(1e-5));
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("pipeline: explain names each value's stage and the tactic") {
  const Program step = train_with(small(2), {.microbatches = 2});
  const Partitioned plan = partition(step, Mesh{{"stage", 2}}, parse_schedule("pp"));
  CHECK(explain(plan, plan.value("params/layers/1/mlp/w1")).find("params/layers/1/mlp/w1 on stage 1 of 'stage': tactic 1 (pp(stage))") !=
        std::string::npos);
  CHECK(explain(plan, plan.value("params/tok_embed/table")).find("on stage 0 of 'stage'") != std::string::npos);
}

TEST_CASE("pipeline: stages cut by predicted work, so a heavy head takes fewer layers; equal layers on request") {
  nn::GptConfig c = small(8);
  c.vocab = 4096;  // the head's GEMM and the loss outweigh layers of d_model 16
  const Program step = train_with(c, {.microbatches = 2});
  const Mesh line4{{"stage", 4}};
  const Partitioned by_work = partition(step, line4, {pipeline("stage")});
  const Partitioned by_count = partition(step, line4, {pipeline("stage", PipelineSchedule::one_f_one_b, {}, StageBalance::layers)});
  auto stage_of = [](const Partitioned& p, int layer) {
    return p.state().pipeline()->stage[static_cast<std::size_t>(p.value("params/layers/" + std::to_string(layer) + "/mlp/w1"))];
  };
  for (int layer = 0; layer < 8; ++layer) CHECK(stage_of(by_count, layer) == layer / 2);
  CHECK(stage_of(by_work, 6) < 3);  // the last stage, with the head and the loss, holds fewer than 2 layers
  for (int layer = 1; layer < 8; ++layer) CHECK(stage_of(by_work, layer) >= stage_of(by_work, layer - 1));
  const auto busiest = [](const Report& r) {
    double most = 0;
    for (const auto& st : r.stages) most = std::max(most, st.busy_seconds);
    return most;
  };
  const Report work = simulate(lower(by_work), HardwareProfile::cpu()), count = simulate(lower(by_count), HardwareProfile::cpu());
  CHECK(busiest(work) < busiest(count));
  CHECK(work.step_seconds < count.step_seconds);
  const std::string why = explain(by_work, by_work.value("params/layers/0/mlp/w1"));
  CHECK(why.find("on stage 0 of 'stage': tactic 1 (pp(stage)) (layer") != std::string::npos);
  CHECK(why.find("% of the predicted work)") != std::string::npos);
  CHECK(explain(by_count, by_count.value("params/layers/7/mlp/w1")).find("(pp(stage, equal layers)) (layers 6-7, equal layers)") !=
        std::string::npos);
  check_plans(step, {{"pp by work 4", line4, {pipeline("stage")}}}, c.vocab, 96);
  // Layers of equal work and a light head: the cut by work is the cut by count.
  const Partitioned even = partition(train_with(small(8), {.microbatches = 2}), line4, parse_schedule("pp"));
  for (int layer = 0; layer < 8; ++layer) CHECK(stage_of(even, layer) == layer / 2);
  // A chunked schedule cut by work needs no equal chunks; by count it does (catalog E117).
  const Program three = train_with(small(3), {.microbatches = 2});
  check_plans(three, {{"interleaved:2 of 3 layers", Mesh{{"stage", 1}}, parse_schedule("pp:interleaved:2")}}, 32, 97);
}

TEST_CASE("pipeline: interleaved, zb1 and zbv steps equal the single-device accumulated step, alone and within bp, mp, z3") {
  const nn::GptConfig c = small(4), deep = small(8);
  const Mesh line2{{"stage", 2}}, line4{{"stage", 4}};
  const Mesh cube_pp{{"stage", 2}, {"batch", 2}, {"model", 2}};
  for (int m : {1, 2, 4, 8}) {
    CAPTURE(m);
    std::vector<PlanCase> cases{{"zb1 2", line2, parse_schedule("pp:zb1")}, {"zbv 2", line2, parse_schedule("pp:zbv")},
                                {"zb1 4", line4, parse_schedule("pp:zb1")}};
    if (m % 2 == 0) cases.push_back({"interleaved:2 2", line2, parse_schedule("pp:interleaved:2")});
    if (m < 8) {
      cases.push_back({"pp:zb1,bp,mp,z3 2x2x2", cube_pp, parse_schedule("pp:zb1,bp,mp,z3")});
      cases.push_back({"bp,mp,z3,pp:zbv 2x2x2", cube_pp, parse_schedule("bp,mp,z3,pp:zbv")});
    }
    if (m == 2) cases.push_back({"pp:interleaved:2,bp,mp,z3 2x2x2", cube_pp, parse_schedule("pp:interleaved:2,bp,mp,z3")});
    check_plans(train_with(c, {.microbatches = m}), cases, c.vocab, 170 + static_cast<std::uint64_t>(m));
  }
  // 4 stages of 2 chunks: 8 layers.
  check_plans(train_with(deep, {.microbatches = 4}),
              {{"interleaved:2 4", line4, parse_schedule("pp:interleaved:2")}, {"zbv 4", line4, parse_schedule("pp:zbv")}},
              deep.vocab, 180);
  // Remat composes: W recomputes what it reads, B what it reads.
  const Program recipe = train_with(c, {.clip_norm = 0.5, .remat = Remat::blocks(), .microbatches = 2});
  check_plans(recipe, {{"pp:zb1,bp 2x2", Mesh{{"stage", 2}, {"batch", 2}}, parse_schedule("pp:zb1,bp")},
                       {"pp:interleaved:2 2", line2, parse_schedule("pp:interleaved:2")}}, c.vocab, 181);
  // bf16 compute: a parameter's cast that the backward pass makes again is made by each stage that reads it (made
  // on the parameter's chunk and read by a later chunk's backward pass, it made the stages wait on each other).
  const Program mixed = train_with(c, {.precision = MixedPrecision::with_compute(DType::bf16), .microbatches = 4});
  // (Pipelining alone computes each value as one device does, so bf16 matches to f32 rounding.)
  check_plans(mixed, {{"pp:interleaved:2 2 bf16", line2, parse_schedule("pp:interleaved:2")}}, c.vocab, 182);
}

namespace {

// The step's length in unit time (F, B and W 1 each; an unsplit backward 2) when every device runs its tasks
// in order as soon as their inputs are ready, and the bubble: the fraction of devices' time idle. -1 if the
// orders deadlock. Written from the schedules' definitions, apart from pipeline_tasks' list scheduler.
double unit_bubble(const PipelineSchedule& schedule, int p, int m) {
  using Ph = StageTask::Phase;
  const auto tasks = pipeline_tasks(schedule, p, m);
  const int stages = p * schedule.chunks;
  std::map<std::tuple<int, Ph, int>, long> end;
  auto at = [&](int c, Ph ph, int j) { const auto it = end.find({c, ph, j}); return it == end.end() ? -1L : it->second; };
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<long> clock(static_cast<std::size_t>(p), 0);
  long work = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int d = 0; d < p; ++d) {
      const auto& mine = tasks[static_cast<std::size_t>(d)];
      for (auto& i = next[static_cast<std::size_t>(d)]; i < mine.size(); ++i) {
        const auto t = mine[i];
        long ready = 0;
        if (t.phase == Ph::forward && t.chunk > 0) ready = at(t.chunk - 1, Ph::forward, t.microbatch);
        if (t.phase == Ph::backward) {
          ready = at(t.chunk, Ph::forward, t.microbatch);
          const long after = t.chunk + 1 < stages ? at(t.chunk + 1, Ph::backward, t.microbatch) : 0;
          ready = ready < 0 || after < 0 ? -1 : std::max(ready, after);
        }
        if (t.phase == Ph::weight) ready = at(t.chunk, Ph::backward, t.microbatch);
        if (ready < 0) break;
        const long length = t.phase == Ph::update ? 0 : t.phase == Ph::backward && !schedule.splits_backward() ? 2 : 1;
        long& now = clock[static_cast<std::size_t>(d)];
        now = std::max(now, ready) + length;
        work += length;
        if (t.phase != Ph::update) CHECK(end.emplace(std::tuple{t.chunk, t.phase, t.microbatch}, now).second);
        progress = true;
      }
    }
  }
  for (int d = 0; d < p; ++d)
    if (next[static_cast<std::size_t>(d)] < tasks[static_cast<std::size_t>(d)].size()) return -1;
  const long span = *std::max_element(clock.begin(), clock.end());
  return 1.0 - static_cast<double>(work) / static_cast<double>(span * p);
}

}  // namespace

TEST_CASE("pipeline: every schedule's task lists run each task once, on its chunk's device, without deadlock") {
  using Ph = StageTask::Phase;
  for (int p : {2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 16})
      for (const auto& schedule : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b, PipelineSchedule::zb1,
                                   PipelineSchedule::zbv, PipelineSchedule::interleaved(2), PipelineSchedule::interleaved(3)}) {
        if (schedule.chunks > 1 && !schedule.v_shape && m > p && m % p != 0) continue;
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(name_of(schedule));
        const auto tasks = pipeline_tasks(schedule, p, m);
        std::size_t count = 0;
        for (int d = 0; d < p; ++d) {
          const auto& mine = tasks[static_cast<std::size_t>(d)];
          CHECK(mine.back().phase == Ph::update);
          for (const auto& t : mine)
            if (t.phase != Ph::update) CHECK(schedule.device_of(t.chunk, p) == d);
          count += mine.size() - 1;
        }
        CHECK(count == static_cast<std::size_t>(p * schedule.chunks * m * (schedule.splits_backward() ? 3 : 2)));
        CHECK(unit_bubble(schedule, p, m) >= 0);
      }
  // The published bubbles, in unit time (F 1, B 1, W 1): 1F1B (p - 1) / (M + p - 1); interleaved
  // (p - 1) / (vM + p - 1); ZB-H1 (p - 1)(F + B - W) over M(F + B + W) + that.
  CHECK(unit_bubble(PipelineSchedule::one_f_one_b, 4, 8) == doctest::Approx(3.0 / 11));
  CHECK(unit_bubble(PipelineSchedule::gpipe, 4, 8) == doctest::Approx(3.0 / 11));
  CHECK(unit_bubble(PipelineSchedule::interleaved(2), 4, 8) == doctest::Approx(3.0 / 19));
  CHECK(unit_bubble(PipelineSchedule::zb1, 4, 8) == doctest::Approx(3.0 / 27));
  CHECK(unit_bubble(PipelineSchedule::zbv, 4, 8) < unit_bubble(PipelineSchedule::zb1, 4, 8) / 1.5);
}

TEST_CASE("pipeline: the backward pass splits into B and W by data dependence") {
  using Ph = StageTask::Phase;
  // Two virtual stages; the backward of stage 1 sends gh and gh2 on to stage 0.
  Program p("bw");
  Tensor x{p, p.add_input("x", {{2}})}, w{p, p.add_input("w", {{2}})}, w2{p, p.add_input("w2", {{2}})};
  std::vector<int> chunks(static_cast<std::size_t>(p.size()), -1);
  auto on = [&](int c) { chunks.resize(static_cast<std::size_t>(p.size()), c); };  // the ops made since: chunk c
  p.begin_segment({p.size(), 0, Segment::Pass::forward});
  const Tensor h = x * w, h2 = x * w2;
  on(0);
  const Tensor l = sum(h * h2);
  on(1);
  p.begin_segment({p.size(), 0, Segment::Pass::backward});
  const Tensor gy = exp(l);
  const Tensor gw = gy * h;          // feeds only itself: a weight gradient (W)
  const Tensor gh = gy * w;          // read by stage 0: the input gradient's path (B)
  const Tensor gw2 = gy * h2;        // a weight-side value that the input gradient reads...
  const Tensor gh2 = gy * gw2;       // ...so it is B too
  on(1);
  const Tensor gxw = gh * w;         // stage 0: the first stage sends nothing back, so all of it is W
  const Tensor gx = gxw + gh2;
  on(0);
  p.add_output("gw", gw.id());
  p.add_output("gx", gx.id());
  PipelineStages st{"stage", 2, PipelineSchedule::zb1, 0, "pp", {}, chunks};
  st.stage = st.chunk;
  auto phase = [&](const Tensor& t) { return value_tasks(p, st)[static_cast<std::size_t>(t.id())].phase; };
  CHECK(phase(h) == Ph::forward);
  CHECK(phase(gw) == Ph::weight);
  CHECK(phase(gh) == Ph::backward);
  CHECK(phase(gw2) == Ph::backward);
  CHECK(phase(gh2) == Ph::backward);
  CHECK(phase(gy) == Ph::backward);
  CHECK(phase(gxw) == Ph::weight);
  CHECK(phase(gx) == Ph::weight);
  // Schedules that do not split the backward pass keep it whole.
  st.schedule = PipelineSchedule::one_f_one_b;
  CHECK(phase(gw) == Ph::backward);
}

TEST_CASE("pipeline: chunks cross devices at every boundary of round-robin, and zbv's turn stays on one device") {
  nn::GptConfig c = small(4);
  c.tied = false;
  const std::int64_t activation = batch * c.seq * c.d_model * 4;
  for (int m : {2, 4}) {
    CAPTURE(m);
    const Program step = train_with(c, {.microbatches = m});
    const SpmdProgram interleaved = lower(partition(step, Mesh{{"stage", 2}}, parse_schedule("pp:interleaved:2")));
    const SpmdProgram zbv = lower(partition(step, Mesh{{"stage", 2}}, parse_schedule("pp:zbv")));
    // 4 chunks: 3 boundaries, each between devices; the V (devices 0, 1, 1, 0) crosses at 2 of them.
    CHECK(sends(interleaved).at(activation / m) == 2 * m * 3);
    CHECK(sends(zbv).at(activation / m) == 2 * m * 2);
    CHECK(interleaved.pipeline() == SpmdPipeline{"stage", 2, PipelineSchedule::interleaved(2), m});
    CHECK(zbv.pipeline()->schedule == PipelineSchedule::zbv);
  }
  // zb1 holds less than GPipe (though more than 1F1B on this tiny model: the per-layer output gradients that W
  // reads live from B to W), and the simulator predicts a smaller bubble, from the program's own task order.
  c.seq = 16;
  const Program step = train_with(c, {.microbatches = 4});
  const Mesh mesh{{"stage", 2}};
  auto predicted = [&](const char* schedule) {
    return simulate(lower(partition(step, mesh, parse_schedule(schedule))), HardwareProfile::cpu());
  };
  const Report zb1 = predicted("pp:zb1"), one = predicted("pp"), gpipe = predicted("pp:gpipe");
  CHECK(zb1.peak_bytes < gpipe.peak_bytes);
  CHECK(zb1.bubble_fraction < one.bubble_fraction);
}

// ---- mixture of experts ----

namespace {

nn::GptConfig with_experts(int top_k, std::int64_t layers = 2) {
  nn::GptConfig c = small(layers);
  c.experts = 4;
  c.top_k = top_k;
  return c;
}

double gelu_reference(double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v))); }

}  // namespace

TEST_CASE("moe: each token gets its experts' outputs weighted by the router, while the experts have room") {
  const std::int64_t B = 3, S = 10, D = 6, H = 5, E = 4;
  for (int top_k : {1, 2})
    for (double factor : {0.5, 4.0}) {  // 0.5: experts overflow and drop tokens; 4.0: C = S, none dropped
      CAPTURE(top_k);
      CAPTURE(factor);
      const nn::MixtureOfExperts moe{"params/moe", D, H, E, top_k, factor};
      const std::int64_t C = moe.capacity(S);
      const Program f = trace(
          "moe", [&](Tensor x) { const auto out = moe(x); return NamedTensors{{"y", out.y}, {"aux", out.aux_loss}}; },
          {{"x", {B, S, D}}});
      NamedArrays in = init_inputs(f, 11, true);
      std::mt19937_64 rng(5);
      std::normal_distribution<double> normal;
      for (const char* bias : {"params/moe/experts/b1", "params/moe/experts/b2"})  // zeros by default
        for (std::int64_t i = 0; i < in.at(bias).size(); ++i) in.at(bias).set(i, 0.1 * normal(rng));
      const NamedArrays out = interpret(f, in);
      auto at = [&](const char* name, std::vector<std::int64_t> index) {
        const Array& a = in.at(name);
        std::int64_t flat = 0;
        for (std::size_t d = 0; d < index.size(); ++d) flat = flat * a.shape()[d] + index[d];
        return a.at(flat);
      };
      int dropped = 0;
      double aux = 0;
      for (std::int64_t b = 0; b < B; ++b) {
        std::vector<std::vector<double>> probs(S, std::vector<double>(E));
        std::vector<std::vector<std::int64_t>> choice(S);
        std::vector<std::vector<double>> gate(S);
        for (std::int64_t s = 0; s < S; ++s) {
          std::vector<double> logits(E, 0.0);
          for (std::int64_t e = 0; e < E; ++e)
            for (std::int64_t d = 0; d < D; ++d) logits[e] += at("x", {b, s, d}) * at("params/moe/router", {d, e});
          const double top = *std::max_element(logits.begin(), logits.end());
          double z = 0;
          for (std::int64_t e = 0; e < E; ++e) z += std::exp(logits[e] - top);
          for (std::int64_t e = 0; e < E; ++e) probs[s][e] = std::exp(logits[e] - top) / z;
          std::vector<std::int64_t> order(E);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](auto i, auto j) { return logits[i] > logits[j]; });
          double total = 0;
          for (int j = 0; j < top_k; ++j) total += probs[s][order[j]];
          for (int j = 0; j < top_k; ++j) {
            choice[s].push_back(order[j]);
            gate[s].push_back(top_k == 2 ? probs[s][order[j]] / total : probs[s][order[j]]);
          }
        }
        // Slots in token order, first choices before second ones.
        std::vector<std::int64_t> taken(E, 0);
        std::vector<std::vector<bool>> kept(S, std::vector<bool>(top_k));
        for (int j = 0; j < top_k; ++j)
          for (std::int64_t s = 0; s < S; ++s) {
            kept[s][j] = taken[choice[s][j]]++ < C;
            dropped += !kept[s][j];
          }
        for (std::int64_t s = 0; s < S; ++s)
          for (std::int64_t o = 0; o < D; ++o) {
            double expect = 0;
            for (int j = 0; j < top_k; ++j) {
              if (!kept[s][j]) continue;
              const std::int64_t e = choice[s][j];
              double y = at("params/moe/experts/b2", {e, o});
              for (std::int64_t h = 0; h < H; ++h) {
                double pre = at("params/moe/experts/b1", {e, h});
                for (std::int64_t d = 0; d < D; ++d) pre += at("x", {b, s, d}) * at("params/moe/experts/w1", {e, d, h});
                y += gelu_reference(pre) * at("params/moe/experts/w2", {e, h, o});
              }
              expect += gate[s][j] * y;
            }
            CHECK(out.at("y").at((b * S + s) * D + o) == doctest::Approx(expect).epsilon(1e-4));
          }
        for (std::int64_t e = 0; e < E; ++e) {
          double f = 0, P = 0;
          for (std::int64_t s = 0; s < S; ++s) {
            f += choice[s][0] == e;
            P += probs[s][e];
          }
          aux += static_cast<double>(E) * (f / S) * (P / S) / B;
        }
      }
      CHECK(out.at("aux").at(0) == doctest::Approx(aux).epsilon(1e-5));
      CHECK((dropped > 0) == (factor < 1));
    }
}

TEST_CASE("plan: expert parallelism sends tokens to their experts and back by one all_to_all each way per layer and pass") {
  const Mesh mesh{{"batch", 2}, {"expert", 2}};
  for (std::int64_t layers : {1, 2}) {
    CAPTURE(layers);
    const nn::GptConfig c = with_experts(1, layers);
    const int L = static_cast<int>(layers);
    const nn::Gpt model{c};
    const Program fwd = trace("moe_loss", [&](Tensor t, Tensor y) { return model.loss(t, y); }, data_specs(c));
    CHECK(plan(lower(partition(fwd, mesh, parse_schedule("bp,ep")))) ==
          std::map<std::string, int>{{"all_to_all{expert}", 2 * L}});
    const Program step = train(c);
    const SpmdProgram spmd = lower(partition(step, mesh, parse_schedule("bp,ep")));
    // Expert weights are whole experts per device: their gradients reduce over 'batch' only; the rest over both.
    const int expert_weights = 4 * L, others = static_cast<int>(parameters(step).size()) - expert_weights;
    CHECK(plan(spmd) == std::map<std::string, int>{{"all_to_all{expert}", 4 * L},
                                                   {"all_reduce{batch}", expert_weights},
                                                   {"all_reduce{batch,expert}", others}});
    // Each moves one device's slots [B, E, C, D] / 4 devices.
    const std::int64_t C = nn::MixtureOfExperts{"", c.d_model, 4 * c.d_model, c.experts, c.top_k, c.capacity_factor}.capacity(c.seq);
    for (const auto& col : spmd.collectives())
      if (col.collective.kind == CK::all_to_all) {
        CHECK(col.bytes == batch * c.experts * C * c.d_model * 4 / 4);
        CHECK(col.collective.reason.find("ep(expert)") != std::string::npos);
      }
    CHECK(input_layout(spmd, "params/layers/0/moe/experts/w1").dims[0] == AxisList{"expert"});
    CHECK(input_layout(spmd, "params/layers/0/moe/router") == Sharding::replicated(2));
  }
}

TEST_CASE("differential: MoE train steps under expert parallelism and its compositions equal the single-device step") {
  const std::vector<PlanCase> cases = {
      {"ep 4", Mesh{{"expert", 4}}, parse_schedule("ep")},
      {"bp,ep 2x2", Mesh{{"batch", 2}, {"expert", 2}}, parse_schedule("bp,ep")},
      {"ep,mp 2x2", Mesh{{"expert", 2}, {"model", 2}}, parse_schedule("ep,mp")},
      {"bp,ep,z3 2x2", Mesh{{"batch", 2}, {"expert", 2}}, parse_schedule("bp,ep,z3")},
      {"bp,ep,mp 2x2x2", Mesh{{"batch", 2}, {"expert", 2}, {"model", 2}}, parse_schedule("bp,ep,mp")},
      {"bp,ep,mp,z3 2x2x2", Mesh{{"batch", 2}, {"expert", 2}, {"model", 2}}, parse_schedule("bp,ep,mp,z3")},
  };
  for (int top_k : {1, 2}) {
    CAPTURE(top_k);
    check_plans(train(with_experts(top_k), 1e-3), cases, 32, static_cast<std::uint64_t>(10 * top_k));
  }
}

// ---- convolution ----

TEST_CASE("convolution: split by batch and by channels (Megatron's layout on HWIO kernels); unaligned spatial tiling stops with why") {
  const std::int64_t N = 8;
  const Program step = train_step(
      [](Tensor x, Tensor y) {
        const Tensor w1 = param("params/conv/w1", {3, 3, 3, 8}, normal_init(0.2));
        const Tensor w2 = param("params/conv/w2", {3, 3, 8, 4}, normal_init(0.1));
        const Tensor h = relu(conv(x, w1, {.padding_low = {1, 1}, .padding_high = {1, 1}}));  // [N, 6, 6, 8]
        return mse(conv(h, w2, {.strides = {2, 2}}), y);                                       // [N, 2, 2, 4]
      },
      Adam{1e-2, 0.9, 0.999, 1e-3}, {{"x", {N, 6, 6, 3}}, {"y", {N, 2, 2, 4}}});
  // Output channels of w1 and input channels of w2 on 'model': one all_reduce, of the second conv's partial
  // sums (x is data, so no input gradient needs one); under BP the two kernel gradients.
  CHECK(plan(lower(partition(step, Mesh{{"model", 2}}, {megatron("model")}))) ==
        std::map<std::string, int>{{"all_reduce{model}", 1}});
  CHECK(plan(lower(partition(step, Mesh{{"batch", 4}}, {data_parallel("batch")}))) ==
        std::map<std::string, int>{{"all_reduce{batch}", 2}});
  // Rows tiled: the first convolution exchanges halos; the second (6 rows to 2 at stride 2, unpadded) cannot
  // tile its rows, as output tiles would not start where input tiles do: propagation stops there and says so.
  const Schedule rows{ManualPartition{{{"x", 1}}, "batch"}};
  const Partitioned spatial = partition(step, Mesh{{"batch", 2}}, rows);
  REQUIRE(!spatial.history().back().stops.empty());
  CHECK(spatial.history().back().stops.front().reason ==
        "convolution: spatial dim 0: tiles of the input (6 x dilation 1) and of the output (2 x stride 2) would not "
        "start at the same positions");
  CHECK(plan(lower(spatial)).count("collective_permute{batch}") == 1);
  check_plans(step,
              {{"bp 4", Mesh{{"batch", 4}}, parse_schedule("bp")},
               {"bp,mp 2x2", square, parse_schedule("bp,mp")},
               {"bp,mp,z3 2x2", square, parse_schedule("bp,mp,z3")},
               {"bp,z2 4", Mesh{{"batch", 4}}, parse_schedule("bp,z2")},
               {"rows tiled 2", Mesh{{"batch", 2}}, rows}},
              1, 40);
}

// ---- spatial partitioning: halo exchange ----

namespace {

// The collective_permutes of a plan as (shift, bytes), in program order.
std::vector<std::pair<std::int64_t, std::int64_t>> halos(const SpmdProgram& p) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (const auto& c : p.collectives())
    if (c.collective.kind == CK::collective_permute) out.emplace_back(c.collective.shift, c.bytes);
  return out;
}

}  // namespace

TEST_CASE("spatial partitioning: each tile receives its halo from its neighbours only, the bytes the window implies") {
  // x [2, 8, 8, 3] -> 3x3 'same' -> [2, 8, 8, 4] -> 3x3 at stride 2, TF 'same' (no padding before, 1 after) -> [2, 4, 4, 5]
  const Program net = trace(
      "net",
      [](Tensor x, Tensor w1, Tensor w2) {
        const Tensor h = tanh(conv(x, w1, {.padding_low = {1, 1}, .padding_high = {1, 1}}));
        return NamedTensors{{"y", conv(h, w2, {.strides = {2, 2}, .padding_low = {0, 0}, .padding_high = {1, 1}})}};
      },
      {{"x", {2, 8, 8, 3}}, {"w1", {3, 3, 3, 4}}, {"w2", {3, 3, 4, 5}}});
  for (std::int64_t tiles : {2, 4}) {
    CAPTURE(tiles);
    const Partitioned plan_ = partition(net, Mesh{{"space", tiles}}, {ManualPartition{{{"x", 1}}, "space"}});
    CHECK(plan_.history().back().stops.empty());
    const SpmdProgram spmd = lower(plan_);
    // Halo rows x (batch 2, 8 columns, channels) x 4 bytes: the first convolution reads one row of each
    // neighbour's x, the strided one only the next tile's first row of h (its windows end one row past a tile).
    const std::int64_t row = 2 * 8 * 4;
    CHECK(plan(spmd) == std::map<std::string, int>{{"collective_permute{space}", 3}});
    CHECK(halos(spmd) == std::vector<std::pair<std::int64_t, std::int64_t>>{{1, row * 3}, {-1, row * 3}, {-1, row * 4}});
    CHECK(spmd.outputs().at(0).sharding == Sharding{{{}, {"space"}, {}, {}}, {}});
    CHECK(max_error(net, spmd, 1, 7).value < 1e-5);
  }
}

TEST_CASE("differential: spatially tiled convolution train steps (random windows, strides, dilations, padding, feature groups) equal one device") {
  std::mt19937_64 rng(2026);
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return lo + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(hi - lo + 1)); };
  int exchanged = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const std::int64_t spatial = trial % 4 == 3 ? 2 : 1, tiles = trial % 3 == 2 ? 4 : 2, stride = pick(1, 2);
    Shape x{3}, y{3}, k1, k2;
    ConvWindow first, second;
    std::string shape;
    for (std::int64_t i = 0; i < spatial; ++i) {
      const std::int64_t size = (i == 0 ? tiles : 2) * stride * pick(2, 4);
      const std::int64_t taps1 = pick(1, 4), dilation1 = pick(1, 2), window1 = (taps1 - 1) * dilation1 + 1;
      const std::int64_t taps2 = pick(1, 4), dilation2 = pick(1, 2), window2 = (taps2 - 1) * dilation2 + 1;
      const std::int64_t low1 = pick(0, window1 - 1), total2 = window2 - stride + pick(0, stride - 1);
      const std::int64_t low2 = pick(std::min<std::int64_t>(0, total2), std::max<std::int64_t>(0, total2));
      x.push_back(size);
      y.push_back(size / stride);
      k1.push_back(taps1);
      k2.push_back(taps2);
      first.strides.push_back(1), first.dilation.push_back(dilation1);
      first.padding_low.push_back(low1), first.padding_high.push_back(window1 - 1 - low1);
      second.strides.push_back(stride), second.dilation.push_back(dilation2);
      second.padding_low.push_back(low2), second.padding_high.push_back(total2 - low2);
      shape += " " + std::to_string(size) + ": " + std::to_string(taps1) + " taps d" + std::to_string(dilation1) +
               " pad " + std::to_string(low1) + ", then " + std::to_string(taps2) + " taps d" + std::to_string(dilation2) +
               " stride " + std::to_string(stride) + " pad " + std::to_string(low2) + "/" + std::to_string(total2 - low2);
    }
    first.feature_groups = trial % 2 ? 2 : 1;  // 2 -> 4 features, by 2 groups in odd trials
    x.push_back(2), y.push_back(3);
    k1.push_back(2 / first.feature_groups), k1.push_back(4), k2.push_back(4), k2.push_back(3);
    CAPTURE(trial);
    CAPTURE(tiles);
    CAPTURE(shape);
    const Program step = train_step(
        [&](Tensor images, Tensor targets) {
          const Tensor w1 = param("params/w1", k1, normal_init(0.4));
          const Tensor w2 = param("params/w2", k2, normal_init(0.4));
          return mse(conv(tanh(conv(images, w1, first)), w2, second), targets);
        },
        SGD{0.1}, {{"x", x}, {"y", y}});
    Mesh mesh{{"space", tiles}};
    Schedule schedule{ManualPartition{{{"x", 1}}, "space"}};
    if (spatial == 2) {
      mesh = Mesh{{"space", tiles}, {"cols", 2}};
      schedule.push_back(ManualPartition{{{"x", 2}}, "cols"});
    }
    const Partitioned plan_ = partition(step, mesh, schedule);
    for (const auto& stop : plan_.history().back().stops) FAIL_CHECK(stop.message);
    std::optional<SpmdProgram> spmd;
    try {
      spmd = lower(plan_);
    } catch (const UserError& e) {  // a window wider than a neighbour's tile: refused, never computed wrong
      CHECK(std::string(e.what()).find("a halo exchange reaches only the next tile") != std::string::npos);
      continue;
    }
    exchanged += !halos(*spmd).empty();
    const Error error = max_error(step, *spmd, 1, static_cast<std::uint64_t>(trial));
    CHECK_MESSAGE(error.value < 1e-4, error.where);
  }
  CHECK(exchanged >= 16);
}

TEST_CASE("pooling: batch, channels and rows pass through where windows stay inside tiles; overlapping windows stop with why") {
  const std::int64_t N = 8;
  const ConvWindow same{.padding_low = {1, 1}, .padding_high = {1, 1}};
  auto step_with = [&](std::function<Tensor(const Tensor&)> pool) {  // pool: [N, 8, 8, 8] -> [N, 4, 4, 8]
    return train_step(
        [=](Tensor x, Tensor y) {
          const Tensor w1 = param("params/conv/w1", {3, 3, 3, 8}, normal_init(0.2));
          const Tensor w2 = param("params/conv/w2", {3, 3, 8, 4}, normal_init(0.1));
          const Tensor h = pool(relu(conv(x, w1, same)));
          return mse(nn::avg_pool(conv(h, w2, same), {2, 2}), y);  // [N, 2, 2, 4]
        },
        Adam{1e-2, 0.9, 0.999, 1e-3}, {{"x", {N, 8, 8, 3}}, {"y", {N, 2, 2, 4}}});
  };
  const Program step = step_with([](const Tensor& h) { return nn::max_pool(h, {2, 2}); });
  const Schedule rows{ManualPartition{{{"x", 1}}, "space"}};
  // 2x2 windows at stride 2 never cross a tile of even rows: the rows stay tiled through both pools, and only
  // the convolutions exchange halos.
  const Partitioned spatial = partition(step, Mesh{{"space", 2}}, rows);
  for (const auto& stop : spatial.history().back().stops) FAIL_CHECK(stop.message);
  CHECK(plan(lower(spatial)).at("collective_permute{space}") > 0);
  // 3x3 windows at stride 2 ('same': one row of padding after) overlap the next tile: propagation stops at the
  // max pool and says why.
  const Program overlapping = step_with([](const Tensor& h) {
    return reduce_window(h, OpKind::reduce_window_max, {{1, 3, 3, 1}, {1, 2, 2, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}},
                         {0, 0, 0, 0}, {0, 1, 1, 0});
  });
  const Partitioned stopped = partition(overlapping, Mesh{{"space", 2}}, rows);
  REQUIRE(!stopped.history().back().stops.empty());
  CHECK(stopped.history().back().stops.front().reason ==
        "reduce_window_max: dim 1: windows cross into the neighbouring tile (a pooling halo would need its padding "
        "value, not zeros)");
  const std::vector<PlanCase> cases = {{"bp 4", Mesh{{"batch", 4}}, parse_schedule("bp")},
                                       {"bp,mp 2x2", square, parse_schedule("bp,mp")},
                                       {"bp,sp 2x2", Mesh{{"batch", 2}, {"space", 2}}, parse_schedule("bp,sp")},
                                       {"sp 2", Mesh{{"space", 2}}, parse_schedule("sp")}};
  check_plans(step, cases, 1, 50);
  check_plans(overlapping, cases, 1, 60);
}
