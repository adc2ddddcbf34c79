// AutomaticPartition: the search composes with the tactics before and after it, finds plans at least as fast
// (predicted) as Megatron given BP first, fits a memory budget that forbids replicated parameters, is
// deterministic, and the plan it commits computes what the single-device interpreter computes. The checks are
// on predicted time and memory, not on a fixed answer.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

#include <atomic>
#include <random>

using namespace partir;

namespace {

constexpr std::int64_t batch = 8;

Program mlp_step() {
  const nn::Mlp model{"params/mlp", {32, 128, 32}};
  return train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{1e-2, 0.9, 0.999, 1e-3},
                    {{"x", {batch, 32}}, {"y", {batch, 32}}});
}

nn::GptConfig gpt_config(std::int64_t heads = 4) {
  return {.vocab = 32, .seq = 8, .d_model = 32, .heads = heads, .layers = 2};
}

Program gpt_step(const nn::GptConfig& c) {
  const nn::Gpt model{c};
  return train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2, 0.9, 0.999, 1e-3},
                    {{"tokens", {batch, c.seq}, DType::i32}, {"targets", {batch, c.seq}, DType::i32}});
}

Report predict(const Program& p, const Mesh& mesh, const Schedule& s) {
  return simulate(lower(partition(p, mesh, s)), HardwareProfile::cpu());
}

// A budget that forbids replicated parameters: 90% of the peak of data parallelism over every device (BP on
// batch, the data inputs' batch dim on model too), the plan with the smallest activations among those that
// keep every parameter and its optimizer state whole.
std::int64_t tight_budget(const Program& p, const Mesh& mesh) {
  ManualPartition data{{}, "model"};
  for (auto v : p.inputs())
    if (p.op(v).attrs.input_kind == InputKind::data) data.tiles.push_back({p.op(v).name, 0});
  return predict(p, mesh, {data_parallel("batch"), data}).peak_bytes * 9 / 10;
}

AutomaticPartition auto_on(std::string axis, std::int64_t budget_bytes = 0, SearchBudget search = {}) {
  return {{std::move(axis)}, Objective::step_time, budget_bytes, search, HardwareProfile::cpu(), {},
          std::make_shared<SearchReport>()};
}

NamedArrays random_inputs(const Program& p, std::int64_t vocab, std::uint64_t seed) {
  NamedArrays state = init_inputs(p, seed, true);
  std::mt19937_64 rng(seed);
  for (const char* name : {"tokens", "targets"})
    if (auto it = state.find(name); it != state.end())
      for (std::int64_t i = 0; i < it->second.size(); ++i) it->second.set(i, static_cast<double>(rng() % vocab));
  return state;
}

// The largest |a - b| / (1 + |a|) over every output of two consecutive steps on every device.
double max_error(const Program& step, const SpmdProgram& spmd, std::int64_t vocab, std::uint64_t seed) {
  NamedArrays state = random_inputs(step, vocab, seed), sharded = state;
  double worst = 0;
  for (int iteration = 0; iteration < 2; ++iteration) {
    NamedArrays expect = interpret(step, state);
    auto results = execute_on_threads(spmd, sharded);
    for (const auto& r : results)
      for (const auto& [name, a] : expect) {
        const Array& b = r.outputs.at(name);
        REQUIRE(a.type() == b.type());
        for (std::int64_t i = 0; i < a.size(); ++i)
          worst = std::max(worst, std::abs(a.at(i) - b.at(i)) / (1 + std::abs(a.at(i))));
      }
    carry_state(step, state, std::move(expect));
    carry_state(step, sharded, std::move(results[0].outputs));
  }
  return worst;
}

bool any_input_on(const Partitioned& plan, const std::string& axis) {
  for (auto v : plan.program().inputs())
    if (plan.sharding(v).uses(axis)) return true;
  return false;
}

bool any_parameter_on(const Partitioned& plan, const std::string& axis) {
  for (auto v : plan.program().inputs())
    if (plan.program().op(v).attrs.input_kind == InputKind::parameter && plan.sharding(v).uses(axis)) return true;
  return false;
}

struct Model {
  std::string label;
  Program step;
  Mesh mesh;
  std::int64_t vocab = 0;
};

std::vector<Model> models() {
  return {{"mlp model=2", mlp_step(), Mesh{{"batch", 2}, {"model", 2}}},
          {"mlp model=4", mlp_step(), Mesh{{"batch", 2}, {"model", 4}}},
          {"gpt model=2", gpt_step(gpt_config()), Mesh{{"batch", 2}, {"model", 2}}, 32},
          {"gpt model=4", gpt_step(gpt_config()), Mesh{{"batch", 2}, {"model", 4}}, 32}};
}

}  // namespace

TEST_CASE("auto: given BP, the search is at least as fast as Megatron (MCTS and greedy)") {
  const bool default_overlap = async_collectives_enabled();
  for (const bool overlap : {false, true}) {  // the simulator's two time models (SimulateOptions::overlap)
    set_async_collectives(overlap);
    for (const auto& m : models())
      for (const SearchBudget& search : {SearchBudget{}, greedy()}) {
        CAPTURE(overlap);
        CAPTURE(m.label);
        CAPTURE(name_of(search.strategy));
        const AutomaticPartition automatic = auto_on("model", 0, search);
        const Partitioned plan = partition(m.step, m.mesh, {data_parallel("batch"), automatic});
        const Report found = simulate(lower(plan), HardwareProfile::cpu());
        const Report mp = predict(m.step, m.mesh, {data_parallel("batch"), megatron("model")});
        const Report bp = predict(m.step, m.mesh, {data_parallel("batch")});
        CHECK(found.step_seconds <= mp.step_seconds);
        CHECK(found.step_seconds < bp.step_seconds);
        // The report's figures are the committed plan's.
        const SearchReport& r = *automatic.report;
        CHECK(r.chosen.step_seconds == doctest::Approx(found.step_seconds));
        CHECK(r.chosen.peak_bytes == found.peak_bytes);
        CHECK(r.baseline.step_seconds == doctest::Approx(bp.step_seconds));
        CHECK(!r.chosen.actions.empty());
        CHECK(r.evaluations <= search.evaluations + search.max_actions);
        for (const auto& other : r.runners_up) CHECK(r.chosen.step_seconds <= other.step_seconds);
      }
  }
  set_async_collectives(default_overlap);
}

TEST_CASE("auto: under a budget that forbids replicated parameters the plan fits") {
  for (const auto& m : models()) {
    CAPTURE(m.label);
    const std::int64_t budget = tight_budget(m.step, m.mesh);
    CHECK(predict(m.step, m.mesh, {data_parallel("batch")}).peak_bytes > budget);
    for (const SearchBudget& search : {SearchBudget{}, greedy()}) {
      CAPTURE(name_of(search.strategy));
      const AutomaticPartition automatic = auto_on("model", budget, search);
      const Partitioned plan = partition(m.step, m.mesh, {data_parallel("batch"), automatic});
      const Report found = simulate(lower(plan), HardwareProfile::cpu());
      CHECK(found.peak_bytes <= budget);
      CHECK(automatic.report->chosen.fits);
      CHECK(any_parameter_on(plan, "model"));
      for (const auto& other : automatic.report->runners_up)
        if (other.fits) CHECK(automatic.report->chosen.step_seconds <= other.step_seconds);
    }
  }
}

TEST_CASE("auto: under a budget Megatron does not fit, the plan fits and is no slower than ZeRO-3 on model") {
  for (const auto& m : models()) {
    CAPTURE(m.label);
    const Report mp = predict(m.step, m.mesh, {data_parallel("batch"), megatron("model")});
    const Report z3 = predict(m.step, m.mesh, {data_parallel("batch"), zero3("model")});
    const std::int64_t budget = (mp.peak_bytes + z3.peak_bytes) / 2;
    REQUIRE(mp.peak_bytes > budget);
    for (const SearchBudget& search : {SearchBudget{}, greedy()}) {
      CAPTURE(name_of(search.strategy));
      const Report found =
          predict(m.step, m.mesh, {data_parallel("batch"), auto_on("model", budget, search)});
      CHECK(found.peak_bytes <= budget);
      CHECK(found.step_seconds <= z3.step_seconds);
    }
  }
}

TEST_CASE("auto: a budget no plan fits is a user error naming the budget and the best found") {
  const Program step = mlp_step();
  const Mesh mesh{{"batch", 2}, {"model", 2}};
  CHECK_THROWS_WITH_AS(partition(step, mesh, {data_parallel("batch"), auto_on("model", 1024)}),
                       doctest::Contains("tactic 2 (auto(model)): no plan found fits the memory budget of 1.00 KiB "
                                         "per device; the best of"),
                       UserError);
  CHECK_THROWS_WITH_AS(partition(step, mesh, {auto_on("pipeline")}),
                       "tactic 1 (auto(pipeline)): axis 'pipeline' is not in mesh {batch=2,model=2}", UserError);
}

TEST_CASE("auto: the chosen plan computes what the single-device interpreter computes") {
  std::uint64_t seed = 7;
  for (const auto& m : models())
    for (const std::int64_t budget : {std::int64_t{0}, tight_budget(m.step, m.mesh)}) {
      CAPTURE(m.label);
      CAPTURE(budget);
      const SpmdProgram spmd = lower(partition(m.step, m.mesh, {data_parallel("batch"), auto_on("model", budget)}));
      CHECK(max_error(m.step, spmd, m.vocab ? m.vocab : 1, ++seed) < 1e-4);
    }
}

TEST_CASE("auto: same seed, same plan; the report names its actions") {
  const Program step = gpt_step(gpt_config());
  const Mesh mesh{{"batch", 2}, {"model", 2}};
  for (const SearchBudget& search : {SearchBudget{SearchStrategy::mcts, 32, 6, 1, 42}, greedy(32)}) {
    const AutomaticPartition a = auto_on("model", 0, search), b = auto_on("model", 0, search);
    CHECK(a == b);
    CHECK(partition(step, mesh, {data_parallel("batch"), a}) == partition(step, mesh, {data_parallel("batch"), b}));
    CHECK(*a.report == *b.report);
    // Frozen as manual tactics, the chosen actions give the same plan.
    Schedule frozen{data_parallel("batch")};
    for (const auto& t : a.report->schedule()) frozen.push_back(t);
    CHECK(predict(step, mesh, frozen).step_seconds == doctest::Approx(a.report->chosen.step_seconds));
    std::ostringstream os;
    os << *a.report;
    CHECK(os.str().find("chosen:") != std::string::npos);
    CHECK(os.str().find("baseline:") != std::string::npos);
    CHECK(os.str().find(a.report->chosen.actions.front().name()) != std::string::npos);
  }
}

TEST_CASE("auto: candidates are scored by the tactic's Evaluator") {
  // An evaluator that counts its calls and prefers plans by peak memory alone: the search calls it once per plan
  // it reports, and under step_time it then chooses what the memory objective chooses with the simulator.
  const Program step = mlp_step();
  const Mesh mesh{{"batch", 2}, {"model", 2}};
  std::atomic<int> calls{0};
  AutomaticPartition by_memory = auto_on("model", 0, greedy(16));
  by_memory.evaluator = [&](const Partitioned& plan) {
    ++calls;
    const Evaluation e = simulated_on(HardwareProfile::cpu())(plan);
    return Evaluation{static_cast<double>(e.peak_bytes), e.peak_bytes};
  };
  AutomaticPartition reference = auto_on("model", 0, greedy(16));
  reference.objective = Objective::peak_memory;
  (void)partition(step, mesh, {data_parallel("batch"), by_memory});
  (void)partition(step, mesh, {data_parallel("batch"), reference});
  CHECK(calls == by_memory.report->evaluations);
  CHECK(by_memory.report->chosen.actions == reference.report->chosen.actions);
  CHECK(by_memory.report->chosen.peak_bytes == reference.report->chosen.peak_bytes);
  CHECK(by_memory == auto_on("model", 0, greedy(16)));  // the evaluator is not part of the tactic's identity
}

TEST_CASE("auto: honours Replicate and earlier tactics; later tactics compose on top") {
  const Program step = gpt_step(gpt_config());
  const Mesh mesh{{"batch", 2}, {"model", 2}};
  const Partitioned plan = partition(step, mesh,
                                     {data_parallel("batch"), Replicate{"params/**/mlp/w1", "model"},
                                      Replicate{"tokens", "model"}, auto_on("model"), zero3("batch")});
  REQUIRE(plan.history().size() == 5);
  for (auto v : select(step, "params/**/mlp/w1")) CHECK(!plan.sharding(v).uses("model"));
  CHECK(!plan.sharding("tokens").uses("model"));
  // Every axis placed before the search is where it was, on every value.
  const auto& before = plan.history()[2].shardings;
  const auto& after = plan.history()[3].shardings;
  for (std::size_t v = 0; v < before.size(); ++v)
    for (std::size_t d = 0; d < before[v].dims.size(); ++d)
      for (const auto& axis : before[v].dims[d]) CHECK(after[v].dim_of(axis) == static_cast<std::int64_t>(d));
  CHECK(any_input_on(plan, "model"));  // the search acted (on parameters, or on the data under overlap)
  // ZeRO-3 after the search: the optimizer state is also tiled on batch.
  CHECK(plan.sharding("opt/adam/m/params/layers/0/mlp/w1").uses("batch"));
}

TEST_CASE("auto: parse_schedule takes auto:<axis> and leaves a report") {
  const Schedule s = parse_schedule("bp,auto:model");
  REQUIRE(s.size() == 2);
  const auto* a = s[1].as<AutomaticPartition>();
  REQUIRE(a != nullptr);
  CHECK(a->axes == std::vector<std::string>{"model"});
  REQUIRE(a->report != nullptr);
  CHECK(s[1].name() == "auto(model)");
  CHECK(parse_schedule("auto")[0].as<AutomaticPartition>()->axes == std::vector<std::string>{"model"});
  partition(mlp_step(), Mesh{{"batch", 2}, {"model", 2}}, s);
  CHECK(a->report->tactic == "tactic 2 (auto(model))");
  CHECK(!a->report->chosen.actions.empty());
  CHECK_THROWS_WITH_AS(parse_schedule("bp,auto:"), "schedule 'bp,auto:': 'auto:' needs an axis, as in auto:model",
                       UserError);
}

TEST_CASE("auto: acts on convolutions; spatial tilings whose halo is wider than a tile are skipped, not fatal") {
  // 8 rows on 4 tiles: 2 rows each, less than a 7x7 window's halo of 3. Tiling the rows (of x or y) is refused
  // by lowering; the kernels' output channels (4) can be split.
  const ConvWindow same{.padding_low = {3, 3}, .padding_high = {3, 3}};
  const Program step = train_step(
      [&](Tensor x, Tensor y) {
        const Tensor h = relu(conv(x, param("params/conv/w1", {7, 7, 2, 4}, normal_init(0.1)), same));
        return mse(conv(h, param("params/conv/w2", {1, 1, 4, 2}, normal_init(0.3))), y);
      },
      Adam{1e-2, 0.9, 0.999, 1e-3}, {{"x", {2, 8, 8, 2}}, {"y", {2, 8, 8, 2}}});
  const Mesh mesh{{"space", 4}};
  CHECK_THROWS_AS(lower(partition(step, mesh, {ManualPartition{{{"x", 1}}, "space"}})), UserError);
  const AutomaticPartition search = auto_on("space", 0, greedy(16));
  const Partitioned plan = partition(step, mesh, {search});
  for (const auto& name : {"x", "y"}) CHECK(plan.sharding(plan.program().input(name)).dims.at(1).empty());
  CHECK(max_error(step, lower(plan), 1, 3) < 1e-4);
}
