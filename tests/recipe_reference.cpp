// What tests/recipe_vs_torch.py compares with PyTorch: the MLP and a 2-layer GPT in f64, trained 10 steps by
// AdamW (matrices decay) with gradients clipped to a global norm and a warmup + cosine learning rate. Writes
// the initial parameters, each step's batch and gradient norm, and the final parameters, one array per line:
//   <kind> <step> <model>:<name> <dims, comma-separated or -> = <values>
// usage: recipe_reference OUT
#include <partir/partir.hpp>

#include <cstdio>
#include <fstream>
#include <random>

namespace p = partir;

namespace {

constexpr int steps = 10;
const p::LRSchedule schedule = p::LRSchedule::warmup(3).then_cosine(steps - 3, 0.1);

void write(std::ofstream& out, const std::string& kind, int step, const std::string& name, const p::Array& a) {
  out << kind << " " << step << " " << name << " ";
  for (std::size_t d = 0; d < a.shape().size(); ++d) out << (d ? "," : "") << a.shape()[d];
  out << (a.shape().empty() ? "-" : "") << " =";
  char buf[32];
  for (std::int64_t i = 0; i < a.size(); ++i) {
    std::snprintf(buf, sizeof buf, " %.17g", a.at(i));
    out << buf;
  }
  out << "\n";
}

template <class LossFn>
void run(std::ofstream& out, const std::string& model, LossFn loss, const std::vector<p::InputSpec>& data, double clip,
         const std::function<p::NamedArrays(std::mt19937_64&)>& batch) {
  const p::MixedPrecision f64{p::DType::f64, p::DType::f64, p::DType::f64, p::DType::f64};
  const p::Program step = p::train_step(loss, p::AdamW{.learning_rate = 1e-2, .weight_decay = 0.1}, data,
                                        p::StepOptions{f64, clip, true}, model);
  p::NamedArrays state = p::init_inputs(step, 7);
  for (auto v : step.inputs())
    if (step.op(v).attrs.input_kind == p::InputKind::parameter) write(out, "init", 0, model + ":" + step.op(v).name, state.at(step.op(v).name));
  std::mt19937_64 rng(11);
  for (int t = 0; t < steps; ++t) {
    for (auto& [name, a] : batch(rng)) {
      write(out, "batch", t, model + ":" + name, a);
      state.insert_or_assign(name, std::move(a));
    }
    state.insert_or_assign(p::StepOptions::lr_scale_name, p::Array({}, std::vector<double>{schedule.at(t)}));
    p::NamedArrays outs = p::interpret(step, state);
    write(out, "grad_norm", t, model + ":grad_norm", outs.at("grad_norm"));
    write(out, "loss", t, model + ":loss", outs.at("loss"));
    p::carry_state(step, state, std::move(outs));
  }
  for (auto v : step.inputs())
    if (step.op(v).attrs.input_kind == p::InputKind::parameter) write(out, "final", steps, model + ":" + step.op(v).name, state.at(step.op(v).name));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: recipe_reference OUT\n");
    return 2;
  }
  std::ofstream out(argv[1]);
  const p::nn::Mlp mlp{"params/mlp", {8, 16, 4}};
  run(out, "mlp", [&](p::Tensor x, p::Tensor y) { return p::mse(mlp(x), y); },
      {{"x", {16, 8}, p::DType::f64}, {"y", {16, 4}, p::DType::f64}}, 0.5, [](std::mt19937_64& rng) {
        std::normal_distribution<double> normal;
        p::Array x({{16, 8}, p::DType::f64}), y({{16, 4}, p::DType::f64});
        for (auto* a : {&x, &y})
          for (std::int64_t i = 0; i < a->size(); ++i) a->set(i, normal(rng));
        return p::NamedArrays{{"x", x}, {"y", y}};
      });
  const p::nn::Gpt gpt{{.vocab = 32, .seq = 8, .d_model = 16, .heads = 2, .layers = 2}};
  run(out, "gpt", [&](p::Tensor t, p::Tensor y) { return gpt.loss(t, y); },
      {{"tokens", {4, 8}, p::DType::i32}, {"targets", {4, 8}, p::DType::i32}}, 1.0, [](std::mt19937_64& rng) {
        std::vector<std::int32_t> tokens(32), targets(32);
        for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 32);
        for (auto& t : targets) t = static_cast<std::int32_t>(rng() % 32);
        return p::NamedArrays{{"tokens", p::Array({4, 8}, tokens)}, {"targets", p::Array({4, 8}, targets)}};
      });
  return out ? 0 : 1;
}
