// nn::Llama (dsl/llama.hpp) under the presets, and safetensors (runtime/state/safetensors.hpp): every composition
// computes what one device computes; grouped-query attention's K/V heads split where the model axis divides them
// and stay whole where it does not; weights saved under one plan load onto another mesh and plan without any
// device gathering them (damaged files: the catalog, test_errors.cpp). The blocks' gradients against finite
// differences are in test_autodiff.cpp, the model against PyTorch in llama_vs_torch.py.
#include <doctest/doctest.h>

#include <partir/partir.hpp>
#include <partir/runtime/state/safetensors.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

using namespace partir;
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t batch = 4;

nn::LlamaConfig small(std::int64_t heads = 4, std::int64_t kv_heads = 2) {
  return {.vocab = 32, .seq = 8, .d_model = 32, .layers = 2, .heads = heads, .kv_heads = kv_heads, .ffn = 48};
}

std::vector<InputSpec> data_specs(const nn::LlamaConfig& c) {
  return {{"tokens", {batch, c.seq}, DType::i32}, {"targets", {batch, c.seq}, DType::i32}};
}

// Adam with eps 1e-3: partitioned sums round differently, and a larger eps bounds how much Adam amplifies that
// (as test_transformer.cpp's GPT steps).
Program train(const nn::LlamaConfig& c, const StepOptions& options = {}) {
  const nn::Llama model{c};
  return train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2, 0.9, 0.999, 1e-3}, data_specs(c),
                    options);
}

NamedArrays random_inputs(const Program& p, std::int64_t vocab, std::uint64_t seed) {
  NamedArrays state = init_inputs(p, seed, true);
  std::mt19937_64 rng(seed);
  for (const char* name : {"tokens", "targets"})
    for (std::int64_t i = 0; i < state.at(name).size(); ++i) state.at(name).set(i, static_cast<double>(rng() % vocab));
  return state;
}

// The largest |a - b| / (1 + |a|) over every output of two steps, state carried, on every device.
double max_error(const Program& step, const SpmdProgram& spmd, std::int64_t vocab, std::uint64_t seed, double* loss = nullptr) {
  NamedArrays state = random_inputs(step, vocab, seed), sharded = state;
  double worst = 0;
  for (int iteration = 0; iteration < 2; ++iteration) {
    NamedArrays expect = interpret(step, state);
    if (loss) *loss = expect.at("loss").at(0);
    NamedArrays returned;
    for (const auto& r : execute_on_threads(spmd, sharded))
      for (const auto& [name, a] : expect)
        if (auto it = r.outputs.find(name); it != r.outputs.end()) {
          returned.try_emplace(name, it->second);
          for (std::int64_t i = 0; i < a.size(); ++i)
            worst = std::max(worst, std::abs(a.at(i) - it->second.at(i)) / (1 + std::abs(a.at(i))));
        }
    REQUIRE(returned.size() == expect.size());
    carry_state(step, state, std::move(expect));
    carry_state(step, sharded, std::move(returned));
  }
  return worst;
}

const Sharding& layout_of(const SpmdProgram& p, const std::string& name) {
  for (const auto& b : p.inputs())
    if (b.name == name) return b.sharding;
  FAIL("no input " << name);
  return p.inputs().front().sharding;
}

const std::string q_proj = "params/model/layers/0/self_attn/q_proj/weight";
const std::string k_proj = "params/model/layers/0/self_attn/k_proj/weight";

}  // namespace

TEST_CASE("llama: parameters carry Hugging Face's names in its [out, in] layout") {
  const nn::LlamaConfig c = small(4, 2);
  const Program p = trace("llama", [&](Tensor t) { return NamedTensors{{"logits", nn::Llama{c}.logits(t)}}; },
                          {{"tokens", {batch, c.seq}, DType::i32}});
  std::map<std::string, Shape> shapes;
  for (ValueId v : p.inputs()) shapes[p.op(v).name] = p.type(v).shape;
  const std::int64_t Dh = c.d_model / c.heads;
  CHECK(shapes.at("params/model/embed_tokens/weight") == Shape{c.vocab, c.d_model});
  CHECK(shapes.at(q_proj) == Shape{c.heads * Dh, c.d_model});
  CHECK(shapes.at(k_proj) == Shape{c.kv_heads * Dh, c.d_model});
  CHECK(shapes.at("params/model/layers/1/self_attn/o_proj/weight") == Shape{c.d_model, c.heads * Dh});
  CHECK(shapes.at("params/model/layers/1/mlp/down_proj/weight") == Shape{c.d_model, 48});
  CHECK(shapes.at("params/model/layers/1/post_attention_layernorm/weight") == Shape{c.d_model});
  CHECK(shapes.at("params/lm_head/weight") == Shape{c.vocab, c.d_model});
  CHECK(shapes.size() == 4 + 2 * 9);  // tokens, embedding, norm and head; 9 per layer
  CHECK(safetensors::tensor_name(q_proj) == "model.layers.0.self_attn.q_proj.weight");
  CHECK(safetensors::parameter_name("model.layers.0.self_attn.q_proj.weight") == q_proj);
  // Llama's default width: 8/3 d rounded up to 32.
  CHECK(nn::LlamaConfig{.d_model = 64}.ffn_width() == 192);
}

TEST_CASE("llama: rotary scores depend on relative positions only; attention is causal") {
  // q.k after rotary at positions (s, t) equals the same vectors' at (s + 1, t + 1).
  const Program p = trace("rope", [&](Tensor x) { return NamedTensors{{"y", nn::rotary(x, 10000.0)}}; },
                          {{"x", {1, 3, 1, 4}, DType::f64}});
  Array x({{1, 3, 1, 4}, DType::f64});
  const double q[4] = {0.3, -1.2, 0.7, 0.5}, k[4] = {-0.4, 0.9, 1.1, -0.2};
  auto score = [&](int s, int t) {
    Array in = x;
    for (int i = 0; i < 4; ++i) in.set(s * 4 + i, q[i]);
    Array in2 = x;
    for (int i = 0; i < 4; ++i) in2.set(t * 4 + i, k[i]);
    const Array a = interpret(p, {{"x", in}}).at("y"), b = interpret(p, {{"x", in2}}).at("y");
    double sum = 0;
    for (int i = 0; i < 4; ++i) sum += a.at(s * 4 + i) * b.at(t * 4 + i);
    return sum;
  };
  CHECK(score(1, 0) == doctest::Approx(score(2, 1)).epsilon(1e-12));
  CHECK(score(0, 0) == doctest::Approx(q[0] * k[0] + q[1] * k[1] + q[2] * k[2] + q[3] * k[3]).epsilon(1e-12));
  CHECK(score(2, 0) != doctest::Approx(score(1, 0)));
  // Changing a later token leaves the logits of earlier positions unchanged.
  const nn::LlamaConfig c = small();
  const Program logits = trace("llama", [&](Tensor t) { return NamedTensors{{"logits", nn::Llama{c}.logits(t)}}; },
                               {{"tokens", {1, c.seq}, DType::i32}});
  NamedArrays in = init_inputs(logits, 5, true);
  for (std::int64_t i = 0; i < c.seq; ++i) in.at("tokens").set(i, static_cast<double>(i * 3 % c.vocab));
  const Array before = interpret(logits, in).at("logits");
  in.at("tokens").set(c.seq - 1, 7);
  const Array after = interpret(logits, in).at("logits");
  for (std::int64_t i = 0; i < (c.seq - 1) * c.vocab; ++i) REQUIRE(before.at(i) == after.at(i));
  bool last_changed = false;
  for (std::int64_t i = (c.seq - 1) * c.vocab; i < c.seq * c.vocab; ++i) last_changed |= before.at(i) != after.at(i);
  CHECK(last_changed);
}

TEST_CASE("differential: Llama train steps under the presets equal the single-device step") {
  const Mesh square{{"batch", 2}, {"model", 2}};
  struct Case {
    std::string label;
    Mesh mesh;
    std::string schedule;
    nn::LlamaConfig config = small();
    StepOptions options = {};
  };
  nn::LlamaConfig tied = small();
  tied.tie_embeddings = true;
  const std::vector<Case> cases = {
      {"bp 4", Mesh{{"batch", 4}}, "bp"},
      {"mp 2", Mesh{{"model", 2}}, "mp"},
      {"bp,mp,z3 2x2", square, "bp,mp,z3"},
      {"bp,mp,z2,emb 2x2", square, "bp,mp,z2,emb"},
      {"bp,mp,z3,emb 2x2 tied", square, "bp,mp,z3,emb", tied},
      {"bp,mp 2x2 remat blocks", square, "bp,mp", small(), {.remat = Remat::blocks()}},
      {"bp,mp,z3 2x2 remat selective", square, "bp,mp,z3", small(), {.remat = Remat::selective()}},
      {"pp 2 (M=2)", Mesh{{"stage", 2}}, "pp", small(), {.microbatches = 2}},
      {"pp,bp 2x2 (M=2)", Mesh{{"stage", 2}, {"batch", 2}}, "pp,bp", small(), {.microbatches = 2}},
      {"gqa 8/2 mp 2", Mesh{{"model", 2}}, "mp", small(8, 2)},
      {"gqa 8/2 mp 4", Mesh{{"model", 4}}, "mp", small(8, 2)},
      {"gqa 8/2 bp,mp 2x4", Mesh{{"batch", 2}, {"model", 4}}, "bp,mp", small(8, 2)},
  };
  std::uint64_t seed = 10;
  for (const auto& k : cases) {
    CAPTURE(k.label);
    const Program step = train(k.config, k.options);
    const SpmdProgram spmd = lower(partition(step, k.mesh, parse_schedule(k.schedule)));
    CHECK(max_error(step, spmd, k.config.vocab, ++seed) < 1e-4);
  }
}

TEST_CASE("llama: mp splits query heads; K/V heads split where the axis divides them, else every device keeps them") {
  for (std::int64_t model : {2, 4}) {
    CAPTURE(model);
    const nn::LlamaConfig c = small(8, 2);
    const SpmdProgram spmd = lower(partition(train(c), Mesh{{"model", model}}, parse_schedule("mp")));
    CHECK(layout_of(spmd, q_proj).dims.at(0) == AxisList{"model"});
    CHECK(layout_of(spmd, "params/model/layers/0/mlp/up_proj/weight").dims.at(0) == AxisList{"model"});
    CHECK(layout_of(spmd, "params/model/layers/0/mlp/down_proj/weight").dims.at(1) == AxisList{"model"});
    CHECK(layout_of(spmd, "params/model/layers/0/self_attn/o_proj/weight").dims.at(1) == AxisList{"model"});
    const bool split = 2 % model == 0;
    CHECK(layout_of(spmd, k_proj).dims.at(0) == (split ? AxisList{"model"} : AxisList{}));
    CHECK(layout_of(spmd, "params/model/layers/1/self_attn/v_proj/weight").dims.at(0) ==
          (split ? AxisList{"model"} : AxisList{}));
    // Megatron's 2 all_reduces per layer forward and 2 backward either way; with the K/V heads whole, each
    // device's gradients of the repeated K and V (its query heads' share) are gathered to sum over the group.
    std::map<CollectiveKind, int> n;
    for (const auto& col : spmd.collectives())
      if (col.collective.kind != CollectiveKind::all_slice) ++n[col.collective.kind];
    CHECK(n.size() == (split ? 1u : 2u));
    CHECK(n[CollectiveKind::all_reduce] == 4 * c.layers);
    CHECK((n[CollectiveKind::all_gather] > 0) == !split);
  }
}

TEST_CASE("differential: Llama in bf16 under bp,mp,z3 equals the same program on one device") {
  const nn::LlamaConfig c = small();
  const Program step = train(c, {.precision = MixedPrecision::with_compute(DType::bf16)});
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 2}, {"model", 2}}, parse_schedule("bp,mp,z3")));
  // bf16 keeps 8 bits: a partitioned sum rounds differently by a few units in the last place.
  CHECK(max_error(step, spmd, c.vocab, 3) < 3e-2);
}

// ---- safetensors ----

namespace {

// Runs `body` on every device of spmd's mesh with its piece of `global` (parameters and optimizer state).
void on_devices(const SpmdProgram& spmd, const NamedArrays& global,
                const std::function<void(threads::Communicator&, NamedArrays&)>& body) {
  threads::run(static_cast<int>(spmd.mesh().num_devices()), [&](threads::Communicator& c) {
    NamedArrays state;
    for (const auto& b : spmd.inputs())
      if (holds_state(spmd, b, c.device())) state[b.name] = layout::shard(global.at(b.name), b.sharding, spmd.mesh(), c.device());
    body(c, state);
  });
}

NamedArrays parameters_of(const Program& p, const NamedArrays& all) {
  NamedArrays out;
  for (ValueId v : p.inputs())
    if (p.op(v).attrs.input_kind == InputKind::parameter) out.emplace(p.op(v).name, all.at(p.op(v).name));
  return out;
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("partir-safetensors-" + std::to_string(::getpid()));
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& s) const { return (path / s).string(); }
};

}  // namespace

TEST_CASE("safetensors: saved under bp,mp,z3 on 2x2, every device writing its own pieces, restored onto 4 and 2x2x2") {
  const TempDir tmp;
  const nn::LlamaConfig c = small(8, 2);
  const Program step = train(c);
  const NamedArrays init = init_inputs(step, 7);
  const NamedArrays params = parameters_of(step, init);
  const SpmdProgram saved_by = lower(partition(step, Mesh{{"batch", 2}, {"model", 2}}, parse_schedule("bp,mp,z3")));
  // A shard limit that splits the model over several files with an index.
  const SafetensorsOptions options{.max_file_bytes = 16 << 10};
  on_devices(saved_by, init, [&](threads::Communicator& comm, NamedArrays& state) {
    save_safetensors(tmp / "weights", saved_by, comm, state, options);
  });
  CHECK(fs::exists(tmp / "weights/model.safetensors.index.json"));
  int files = 0;
  for (const auto& entry : fs::directory_iterator(tmp.path / "weights")) {
    CHECK(entry.path().extension() != ".tmp");
    files += entry.path().extension() == ".safetensors";
  }
  CHECK(files >= 3);
  CHECK(fs::exists(tmp / ("weights/model-00001-of-" + std::string(5 - std::to_string(files).size(), '0') +
                          std::to_string(files) + ".safetensors")));
  // The files hold the whole parameters, bit for bit.
  const NamedArrays loaded = load_safetensors(tmp / "weights");
  CHECK(loaded == params);
  // A pipeline's stages write their own layers.
  const SpmdProgram staged = lower(partition(train(c, {.microbatches = 2}), Mesh{{"stage", 2}, {"batch", 2}}, parse_schedule("pp,bp")));
  on_devices(staged, init, [&](threads::Communicator& comm, NamedArrays& state) {
    save_safetensors(tmp / "staged", staged, comm, state);
  });
  CHECK(load_safetensors(tmp / "staged") == params);

  // Restored on other meshes and plans: each device's piece is the one its plan wants.
  for (const auto& [label, mesh, schedule] :
       {std::tuple{"bp,z3 4", Mesh{{"batch", 4}}, "bp,z3"},
        std::tuple{"bp,mp,z3,emb 2x2x2", Mesh{{"pod", 2}, {"batch", 2}, {"model", 2}}, "bp,mp,z3,emb"},
        std::tuple{"pp 2", Mesh{{"stage", 2}}, "pp"}}) {
    CAPTURE(label);
    const SpmdProgram spmd = lower(partition(step, mesh, parse_schedule(schedule)));
    std::atomic<int> wrong = 0;
    on_devices(spmd, init_inputs(step, 99), [&](threads::Communicator& comm, NamedArrays& state) {
      restore_safetensors(tmp / "weights", spmd, comm, state);
      for (const auto& b : spmd.inputs())
        if (holds_state(spmd, b, comm.device()) && spmd.op(b.value).op.attrs.input_kind == InputKind::parameter &&
            !(state.at(b.name) == layout::shard(params.at(b.name), b.sharding, spmd.mesh(), comm.device())))
          ++wrong;
    });
    CHECK(wrong == 0);
  }
}

TEST_CASE("safetensors: one file, bf16 on save, f32 again on restore; whole arrays round trip") {
  const TempDir tmp;
  const nn::LlamaConfig c = small();
  const Program step = train(c);
  const NamedArrays init = init_inputs(step, 3);
  const NamedArrays params = parameters_of(step, init);
  save_safetensors(tmp / "whole", params);
  CHECK(fs::exists(tmp / "whole/model.safetensors"));
  CHECK(load_safetensors(tmp / "whole") == params);
  CHECK(load_safetensors(tmp / "whole/model.safetensors") == params);

  save_safetensors(tmp / "half", params, {.dtype = DType::bf16});
  const NamedArrays half = load_safetensors(tmp / "half");
  CHECK(half.at(q_proj).dtype() == DType::bf16);
  const SpmdProgram spmd = lower(partition(step, Mesh{{"model", 2}}, parse_schedule("mp")));
  on_devices(spmd, init_inputs(step, 99), [&](threads::Communicator& comm, NamedArrays& state) {
    restore_safetensors(tmp / "half", spmd, comm, state);
    const Array& piece = state.at(q_proj);
    CHECK(piece.dtype() == DType::f32);
    const Array whole = layout::shard(params.at(q_proj), layout_of(spmd, q_proj), spmd.mesh(), comm.device());
    for (std::int64_t i = 0; i < piece.size(); ++i)
      REQUIRE(piece.at(i) == doctest::Approx(whole.at(i)).epsilon(1.0 / 128));
  });
  // Raw names too (what the examples' --predict reads and writes).
  safetensors::write(tmp / "batch.safetensors", {{"tokens", Array({2, 2}, std::vector<std::int32_t>{1, 2, 3, 4})}});
  CHECK(safetensors::read(tmp / "batch.safetensors").at("tokens") == Array({2, 2}, std::vector<std::int32_t>{1, 2, 3, 4}));
}
