// SPMD execution: collectives on hand-built SpmdPrograms over the threads backend; every plan's global
// outputs must equal what the single-device program computes.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

#include <random>

// GCC 12 at -O3 calls the moved-from temporaries of `p.add_input({...})` maybe-uninitialized where it inlines
// the executor into a test (a false positive: Binding is fully built before it is moved).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using namespace partir;

namespace {

Array random_array(Shape shape, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(static_cast<std::size_t>(num_elements(shape)));
  for (auto& x : v) x = u(rng);
  return Array(std::move(shape), std::move(v));
}

Op local_op(OpKind kind, std::vector<ValueId> operands, TensorType type, Attrs attrs = {}, std::string name = "") {
  return Op{kind, std::move(operands), std::move(attrs), std::move(type), std::move(name)};
}

// An SpmdProgram with one input laid out by `in`, one collective, and one output laid out by `out`.
SpmdProgram one_collective(const Mesh& mesh, const TensorType& global, const Sharding& in, Collective c,
                           const Sharding& out) {
  SpmdProgram p("one", mesh);
  auto x = p.add({local_op(OpKind::input, {}, {local_shape(global, in, mesh), global.dtype}, {}, "x")});
  p.add_input({"x", x, global, in, ""});
  auto y = p.add({local_op(OpKind::input, {x}, {local_shape(global, out, mesh), global.dtype}), std::move(c)});
  p.add_output({"y", y, global, out, ""});
  return p;
}

void check_identity(const SpmdProgram& p, const Array& x) {
  auto results = execute_on_threads(p, {{"x", x}});
  for (const auto& r : results) CHECK(r.outputs.at("y") == x);
}

}  // namespace

TEST_CASE("collectives move tiles as their layouts say") {
  const Mesh mesh{{"batch", 2}, {"model", 2}};
  const TensorType t{{4, 6, 8}, DType::f32};
  const Array x = random_array(t.shape, 1);
  using CK = CollectiveKind;
  const Sharding batch_model{{{"batch"}, {}, {"model"}}, {}};
  SUBCASE("all_gather of a minor dim") {
    check_identity(one_collective(mesh, t, batch_model, {CK::all_gather, {"model"}, 2},
                                  Sharding{{{"batch"}, {}, {}}, {}}), x);
  }
  SUBCASE("all_gather of two axes at once, model major") {
    check_identity(one_collective(mesh, t, Sharding{{{}, {}, {"model", "batch"}}, {}},
                                  {CK::all_gather, {"model", "batch"}, 2}, Sharding::replicated(3)), x);
  }
  SUBCASE("all_slice") {
    check_identity(one_collective(mesh, t, Sharding::replicated(3), {CK::all_slice, {"model"}, 1},
                                  Sharding{{{}, {"model"}, {}}, {}}), x);
  }
  SUBCASE("all_reduce of a partial sum") {
    check_identity(one_collective(mesh, t, Sharding{{{}, {}, {}}, {"model"}}, {CK::all_reduce, {"model"}},
                                  Sharding::replicated(3)), x);
  }
  SUBCASE("reduce_scatter into a minor dim") {
    check_identity(one_collective(mesh, t, Sharding{{{"batch"}, {}, {}}, {"model"}},
                                  {CK::reduce_scatter, {"model"}, 2}, batch_model), x);
  }
  SUBCASE("all_to_all moves an axis between dims") {
    check_identity(one_collective(mesh, t, batch_model, {CK::all_to_all, {"model"}, 2, 1},
                                  Sharding{{{"batch"}, {"model"}, {}}, {}}), x);
  }
}

TEST_CASE("a hand-lowered Megatron MLP equals the single-device program") {
  const std::int64_t B = 8, D = 6, H = 12;
  Program global = trace("mlp", [](Tensor x, Tensor w1, Tensor w2) { return matmul(relu(matmul(x, w1)), w2); },
                         {{"x", {B, D}}, {"w1", {D, H}}, {"w2", {H, D}}});
  const Mesh mesh{{"model", 2}};
  SpmdProgram p("mlp", mesh);
  const Sharding rep = Sharding::replicated(2), cols{{{}, {"model"}}, {}}, rows{{{"model"}, {}}, {}};
  auto in = [&](const char* name, Shape local, Shape g, Sharding s) {
    auto v = p.add({local_op(OpKind::input, {}, {local}, {}, name)});
    p.add_input({name, v, {g}, s, ""});
    return v;
  };
  auto x = in("x", {B, D}, {B, D}, rep);
  auto w1 = in("w1", {D, H / 2}, {D, H}, cols);
  auto w2 = in("w2", {H / 2, D}, {H, D}, rows);
  Attrs mm;
  mm.dot = {{}, {}, {1}, {0}};
  auto h = p.add({local_op(OpKind::dot_general, {x, w1}, {{B, H / 2}}, mm)});
  Attrs zero;
  zero.literal = {0};
  auto z = p.add({local_op(OpKind::constant, {}, {{}}, zero)});
  Attrs bcast;
  bcast.shape = {B, H / 2};
  auto zb = p.add({local_op(OpKind::broadcast_in_dim, {z}, {{B, H / 2}}, bcast)});
  auto r = p.add({local_op(OpKind::max, {h, zb}, {{B, H / 2}})});
  auto y = p.add({local_op(OpKind::dot_general, {r, w2}, {{B, D}}, mm)});
  auto ys = p.add({local_op(OpKind::input, {y}, {{B, D}}), Collective{CollectiveKind::all_reduce, {"model"}}});
  p.add_output({"out", ys, {{B, D}}, rep, ""});

  NamedArrays inputs{{"x", random_array({B, D}, 2)}, {"w1", random_array({D, H}, 3)}, {"w2", random_array({H, D}, 4)}};
  const Array expect = interpret(global, inputs).at("out");
  auto results = execute_on_threads(p, inputs);
  for (const auto& res : results) {
    const Array& got = res.outputs.at("out");
    REQUIRE(got.type() == expect.type());
    for (std::int64_t i = 0; i < got.size(); ++i) CHECK(got.at(i) == doctest::Approx(expect.at(i)).epsilon(1e-5));
    CHECK(res.collective_seconds.size() == 1);
    CHECK(res.peak_bytes > 0);
  }
  CHECK(p.collectives().size() == 1);
  CHECK(p.collectives()[0].bytes == B * D * 4);
}

TEST_CASE("execute: mesh and communicator must agree, inputs must match") {
  SpmdProgram p("tiny", Mesh{{"batch", 2}});
  auto x = p.add({local_op(OpKind::input, {}, {{2}}, {}, "x")});
  p.add_input({"x", x, {{4}}, Sharding{{{"batch"}}, {}}, ""});
  p.add_output({"x", x, {{4}}, Sharding{{{"batch"}}, {}}, ""});
  CHECK_THROWS_WITH_AS(threads::run(3, [&](threads::Communicator& c) { execute(p, c, {}); }),
                       "execute tiny (device 0): mesh {batch=2} has 2 devices but the communicator has 3", UserError);
  CHECK_THROWS_WITH_AS(execute_on_threads(p, {{"x", Array({3}, std::vector<float>{1, 2, 3})}}),
                       "execute tiny (device 0): input 'x' expects f32[4], got f32[3]", UserError);
  CHECK_THROWS_WITH_AS(execute_on_threads(p, {{"y", Array({3}, std::vector<float>{1, 2, 3})}}),
                       "execute tiny (device 0): no input named 'y'", UserError);
  auto out = execute_on_threads(p, {{"x", Array({4}, std::vector<float>{1, 2, 3, 4})}});
  CHECK(out[1].outputs.at("x") == Array({4}, std::vector<float>{1, 2, 3, 4}));
}

// ---- lowering: partition + lower + execute on threads must equal the single-device program ----

namespace {

struct Case {
  std::string label;
  Mesh mesh;
  Schedule schedule;
};

Program mlp_step(std::int64_t batch, std::vector<std::int64_t> sizes, bool adam) {
  nn::Mlp model{"params/mlp", sizes};
  auto loss = [&](Tensor x, Tensor y) { return mse(model(x), y); };
  const std::vector<InputSpec> data{{"x", {batch, sizes.front()}}, {"y", {batch, sizes.back()}}};
  return adam ? train_step(loss, Adam{1e-2}, data) : train_step(loss, SGD{0.1}, data);
}

// Max |a - b| / (1 + |a|) over every output; two runs of the step, carrying state, to cover loop-carried layouts.
double max_error(const Program& step, const SpmdProgram& spmd, std::uint64_t seed) {
  NamedArrays state = init_inputs(step, seed, true), sharded_state = state;
  double worst = 0;
  for (int iteration = 0; iteration < 2; ++iteration) {
    NamedArrays expect = interpret(step, state);
    auto results = execute_on_threads(spmd, sharded_state);
    for (const auto& r : results)
      for (const auto& [name, a] : expect) {
        const Array& b = r.outputs.at(name);
        REQUIRE(a.type() == b.type());
        for (std::int64_t i = 0; i < a.size(); ++i)
          worst = std::max(worst, std::abs(a.at(i) - b.at(i)) / (1 + std::abs(a.at(i))));
      }
    carry_state(step, state, std::move(expect));
    carry_state(step, sharded_state, std::move(results[0].outputs));
  }
  return worst;
}

ManualPartition bp(const std::string& axis) { return {{{"x", 0}, {"y", 0}}, axis, "bp"}; }
std::map<CollectiveKind, int> count(const SpmdProgram& p, const std::string& axis, bool scalars = false) {
  std::map<CollectiveKind, int> n;
  for (const auto& c : p.collectives())
    if (c.collective.axes == AxisList{axis} && (scalars || c.operand.rank() > 0)) ++n[c.collective.kind];
  return n;
}

// A 4-layer MLP's Adam step over 2 microbatches, pipelined over 2 stages (two layers each) with BP inside them.
Program microbatched_mlp_step() {
  const nn::Mlp model{"params/mlp", {8, 32, 8, 32, 8}};
  return train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}},
                    StepOptions{.microbatches = 2});
}
Partitioned two_stages_bp(const Program& step) {
  return partition(step, Mesh{{"stage", 2}, {"batch", 2}},
                   {pipeline("stage", PipelineSchedule::one_f_one_b,
                             {{"params/mlp/w1", "params/mlp/b1", "params/mlp/w2", "params/mlp/b2"},
                              {"params/mlp/w3", "params/mlp/b3", "params/mlp/w4", "params/mlp/b4"}}),
                    data_parallel("batch")});
}

}  // namespace

TEST_CASE("lowering: partitioned MLP train steps equal the single-device step") {
  std::mt19937_64 rng(7);
  const std::vector<Case> cases = {
      {"none", Mesh{{"batch", 2}}, {}},
      {"bp 4x1", Mesh{{"batch", 4}, {"model", 1}}, {bp("batch")}},
      {"mp 1x4", Mesh{{"batch", 1}, {"model", 4}}, {megatron("model")}},
      {"bp,mp 2x2", Mesh{{"batch", 2}, {"model", 2}}, {data_parallel("batch"), megatron("model")}},
      {"mp,bp 2x2", Mesh{{"batch", 2}, {"model", 2}}, {megatron("model"), bp("batch")}},
      {"bp,z2 4", Mesh{{"batch", 4}}, {bp("batch"), zero2("batch")}},
      {"bp,z3 2x2", Mesh{{"batch", 2}, {"model", 2}}, {bp("batch"), zero3("batch")}},
      {"bp,mp,z3 2x2", Mesh{{"batch", 2}, {"model", 2}}, {bp("batch"), megatron("model"), zero3("batch")}},
      {"bp,mp,z2 2x2x2", Mesh{{"batch", 2}, {"model", 2}, {"zero", 2}},
       {bp("batch"), megatron("model"), zero2("zero")}},
      {"bp on two axes 2x2", Mesh{{"a", 2}, {"b", 2}}, {bp("a"), bp("b")}},
  };
  for (const auto& c : cases)
    for (bool adam : {false, true}) {  // under SGD, Z2 shards only each parameter's update
      // Sizes are random multiples of 8 so every tiling divides.
      auto size = [&] { return 8 * static_cast<std::int64_t>(1 + rng() % 3); };
      const auto batch = size(), in = size(), hidden = size(), out = size();
      CAPTURE(c.label);
      CAPTURE(adam);
      CAPTURE(batch);
      CAPTURE(hidden);
      const Program step = mlp_step(batch, {in, hidden, out}, adam);
      const SpmdProgram spmd = lower(partition(step, c.mesh, c.schedule));
      CHECK(max_error(step, spmd, rng()) < 1e-5);
    }
}

TEST_CASE("lowering: collective plans of BP, MP and ZeRO on the MLP step") {
  const Program step = mlp_step(16, {8, 32, 8}, true);
  const int params = 4;  // w1, b1, w2, b2
  SUBCASE("BP: no forward collectives on tensors, one all_reduce(batch) per parameter gradient, one scalar loss") {
    const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, {bp("batch")}));
    CHECK(count(spmd, "batch") == std::map<CollectiveKind, int>{{CollectiveKind::all_reduce, params}});
    CHECK(count(spmd, "batch", true)[CollectiveKind::all_reduce] == params + 1);
    CHECK(spmd.collectives().size() == params + 1);
  }
  SUBCASE("MP: one all_reduce(model) forward per MLP block, none in backward without an input gradient") {
    const SpmdProgram spmd = lower(partition(step, Mesh{{"model", 2}}, {megatron("model")}));
    CHECK(count(spmd, "model", true) == std::map<CollectiveKind, int>{{CollectiveKind::all_reduce, 1}});
  }
  SUBCASE("Z2: optimizer state tiled on batch turns gradient all_reduce into reduce_scatter + all_gather") {
    const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, {bp("batch"), zero2("batch")}));
    auto n = count(spmd, "batch");
    CHECK(n[CollectiveKind::all_reduce] == 0);
    CHECK(n[CollectiveKind::reduce_scatter] == params);
    CHECK(n[CollectiveKind::all_gather] == params);  // one per updated parameter, none in forward
    // No op computes what nothing reads (the whole broadcasts of Adam's constants that lowering made again at
    // the shards' shape).
    std::vector<bool> read(static_cast<std::size_t>(spmd.size()), false);
    for (ValueId v = 0; v < spmd.size(); ++v)
      for (auto o : spmd.op(v).op.operands) read[static_cast<std::size_t>(o)] = true;
    for (const auto& o : spmd.outputs()) read[static_cast<std::size_t>(o.value)] = true;
    for (ValueId v = 0; v < spmd.size(); ++v)
      if (!spmd.op(v).collective && spmd.op(v).op.kind != OpKind::input) CHECK_MESSAGE(read[static_cast<std::size_t>(v)], v);
    // Each new parameter is computed on its shard and gathered whole: what an all_gather makes is the output.
    for (const auto& c : spmd.collectives())
      if (c.collective.kind == CollectiveKind::all_gather)
        CHECK(std::ranges::any_of(spmd.outputs(), [&](const Binding& o) {
          return o.value == c.value && o.name.starts_with("params/") && o.updates == o.name;
        }));
    for (const auto& b : spmd.inputs()) {
      if (b.name.starts_with("params/")) CHECK(b.sharding.is_replicated());
      if (b.name.starts_with("opt/adam/m/")) CHECK(b.sharding.dims[0] == AxisList{"batch"});
    }
    // Adam's constants meet the gradient's shard as broadcasts made at the shard's shape, not sliced from whole
    // ones; the update on the shard is then one group that stores m and v too (each a scalar pattern there).
    for (const auto& c : spmd.collectives())
      if (c.collective.kind == CollectiveKind::all_slice)
        CHECK_MESSAGE(spmd.op(spmd.op(c.value).op.operands[0]).op.kind != OpKind::broadcast_in_dim, to_string(spmd));
    const bool fusing = fusion_enabled();
    set_fusion(true);
    const FusionPlan fusion = plan_fusion(spmd);
    int updates = 0;
    for (const auto& g : fusion.groups()) updates += g.side_outputs.size() == 2;
    CHECK_MESSAGE(updates == params, to_string(fusion));
    set_fusion(fusing);
    CHECK(max_error(step, spmd, 13) < 1e-5);
  }
  SUBCASE("Z3: parameters stored tiled and gathered where used") {
    const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, {bp("batch"), zero3("batch")}));
    auto n = count(spmd, "batch");
    CHECK(n[CollectiveKind::all_reduce] == 0);
    CHECK(n[CollectiveKind::reduce_scatter] == params);
    CHECK(n[CollectiveKind::all_gather] >= params);
    for (const auto& b : spmd.inputs())
      if (b.name.starts_with("params/")) CHECK(b.sharding.dims[0] == AxisList{"batch"});
  }
}

TEST_CASE("lowering: a gradient scaled by the learning rate is reduced first; the scaling joins the update") {
  const Program step = mlp_step(16, {8, 32, 8}, false);  // SGD: w - lr * g
  for (const auto& [label, schedule] : std::vector<std::pair<std::string, Schedule>>{
           {"bp", {bp("batch")}}, {"bp,z2", {bp("batch"), zero2("batch")}}, {"bp,z3", {bp("batch"), zero3("batch")}}}) {
    CAPTURE(label);
    const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, schedule));
    int reductions = 0;
    for (const auto& c : spmd.collectives()) {
      const CollectiveKind k = c.collective.kind;
      if ((k != CollectiveKind::all_reduce && k != CollectiveKind::reduce_scatter) || c.operand.rank() == 0) continue;
      ++reductions;
      const OpKind source = spmd.op(spmd.op(c.value).op.operands[0]).op.kind;
      CHECK_MESSAGE((source == OpKind::dot_general || source == OpKind::reduce_sum), to_string(spmd));
    }
    CHECK(reductions == 4);
    // Each update is one fused group that scales and subtracts, on the parameter's own tile under ZeRO-3, on
    // its shard under ZeRO-2 (weight-update sharding: the new parameter is then all-gathered).
    const bool fusing = fusion_enabled();
    set_fusion(true);  // also in the PARTIR_FUSION=0 variant: the plan is what is checked
    const FusionPlan fusion = plan_fusion(spmd);
    set_fusion(fusing);
    for (const auto& o : spmd.outputs()) {
      if (o.updates.empty()) continue;
      ValueId update = o.value;
      if (label == "bp,z2") {
        REQUIRE(spmd.op(update).collective);
        CHECK(spmd.op(update).collective->kind == CollectiveKind::all_gather);
        update = spmd.op(update).op.operands[0];
      }
      const FusionGroup* g = fusion.group_at(update);
      REQUIRE(g);
      CHECK(g->steps.size() == 2);
      CHECK(g->steps.front().kind == OpKind::mul);
    }
    CHECK(max_error(step, spmd, 11) < 1e-5);
  }
}

TEST_CASE("bucketing: small all_reduces fuse into buckets that never delay a value in use") {
  const Program step = mlp_step(16, {8, 32, 8, 32, 8}, true);
  const Partitioned bp_plan = partition(step, Mesh{{"batch", 4}}, {bp("batch")});
  const SpmdProgram plain = lower(bp_plan);
  const int gradients = 8;  // w1..w4, b1..b4
  REQUIRE(count(plain, "batch", true)[CollectiveKind::all_reduce] == gradients + 1);  // and the loss
  SUBCASE("one bucket holds the gradients and the loss; the sums are bitwise the unbucketed ones") {
    const SpmdProgram bucketed = lower(bp_plan, {.bucket_bytes = 25 << 20});
    CHECK(count(bucketed, "batch", true) == std::map<CollectiveKind, int>{{CollectiveKind::all_reduce, 1}});
    const auto reason = bucketed.collectives().at(0).collective.reason;
    CHECK(reason.starts_with("bucket of 9 all_reduces, "));
    for (const auto& c : plain.collectives())  // each member's own reason is kept
      CHECK(reason.find("[" + c.collective.reason + "]") != std::string::npos);
    const NamedArrays state = init_inputs(step, 3, true);
    const auto a = execute_on_threads(plain, state), b = execute_on_threads(bucketed, state);
    for (const auto& [name, x] : a[0].outputs) CHECK_MESSAGE(x == b[0].outputs.at(name), name);
  }
  SUBCASE("the bucket size bounds each bucket; a bucket of one is left alone") {
    std::int64_t largest = 0;
    for (const auto& c : plain.collectives()) largest = std::max(largest, c.result.bytes());
    const SpmdProgram bucketed = lower(bp_plan, {.bucket_bytes = largest + 1});
    const auto n = count(bucketed, "batch", true)[CollectiveKind::all_reduce];
    CHECK(n > 1);
    CHECK(n < gradients + 1);
    for (const auto& c : bucketed.collectives()) CHECK(c.result.bytes() <= largest + 1);
    CHECK(max_error(step, bucketed, 5) < 1e-5);
  }
  SUBCASE("ZeRO's gradient reduce_scatters bucket too; the sums are bitwise the unbucketed ones") {
    const Partitioned z2 = partition(step, Mesh{{"batch", 4}}, {bp("batch"), zero2("batch")});
    const SpmdProgram unbucketed = lower(z2), bucketed = lower(z2, {.bucket_bytes = 25 << 20});
    REQUIRE(count(unbucketed, "batch")[CollectiveKind::reduce_scatter] == gradients);
    CHECK(count(bucketed, "batch")[CollectiveKind::reduce_scatter] == 1);
    for (const auto& c : bucketed.collectives())
      if (c.collective.kind == CollectiveKind::reduce_scatter)
        CHECK(c.collective.reason.starts_with("bucket of 8 reduce_scatters, "));
    const NamedArrays state = init_inputs(step, 3, true);
    const auto a = execute_on_threads(unbucketed, state), b = execute_on_threads(bucketed, state);
    for (const auto& [name, x] : a[0].outputs) CHECK_MESSAGE(x == b[0].outputs.at(name), name);
  }
  SUBCASE("ZeRO-3's parameter all_gathers bucket in the order the layers use them, each bucket right before its first use") {
    const Partitioned z3 = partition(step, Mesh{{"batch", 4}}, {bp("batch"), zero3("batch")});
    const SpmdProgram unbucketed = lower(z3, {.early_collectives = false}),
                      bucketed = lower(z3, {.bucket_bytes = 25 << 20, .early_collectives = false});
    const int gathers = count(unbucketed, "batch")[CollectiveKind::all_gather];
    REQUIRE(gathers >= gradients);
    // One bucket per pass: the backward pass gathers its weights again, in a bucket of its own.
    CHECK(count(bucketed, "batch")[CollectiveKind::all_gather] == 2);
    for (ValueId v = 0; v < bucketed.size(); ++v) {
      const SpmdOp& s = bucketed.op(v);
      if (!s.collective || s.collective->kind != CollectiveKind::all_gather) continue;
      CHECK(s.collective->reason.starts_with("bucket of "));
      // As late as it can run: the ops between it and the next local computation only cut its result up.
      ValueId next = v + 1;
      while (next < bucketed.size() && (bucketed.op(next).op.kind == OpKind::slice || bucketed.op(next).op.kind == OpKind::reshape ||
                                        bucketed.op(next).op.kind == OpKind::transpose))
        ++next;
      REQUIRE(next < bucketed.size());
      bool reads_the_bucket = false;
      for (auto o : bucketed.op(next).op.operands) reads_the_bucket |= o > v && o < next;
      CHECK(reads_the_bucket);
    }
    const NamedArrays state = init_inputs(step, 3, true);
    const auto a = execute_on_threads(unbucketed, state), b = execute_on_threads(bucketed, state);
    for (std::size_t d = 0; d < a.size(); ++d)
      for (const auto& [name, x] : a[d].outputs) CHECK_MESSAGE(x == b[d].outputs.at(name), name);
    CHECK(max_error(step, lower(z3, {.bucket_bytes = 25 << 20}), 7) < 1e-5);  // and moved ahead by the schedule
  }
  SUBCASE("Megatron's all_reduces are used at once: none waits in a bucket") {
    const Partitioned mp_plan = partition(step, Mesh{{"batch", 2}, {"model", 2}}, {bp("batch"), megatron("model")});
    const SpmdProgram bucketed = lower(mp_plan, {.bucket_bytes = 25 << 20});
    CHECK(count(bucketed, "model", true) == count(lower(mp_plan), "model", true));
    CHECK(count(bucketed, "batch", true)[CollectiveKind::all_reduce] < count(lower(mp_plan), "batch", true)[CollectiveKind::all_reduce]);
    CHECK(max_error(step, bucketed, 6) < 1e-5);
  }
  SUBCASE("pipeline stages bucket their own gradients") {
    const Program accumulated = microbatched_mlp_step();
    const Partitioned pp = two_stages_bp(accumulated);
    const SpmdProgram bucketed = lower(pp, {.bucket_bytes = 25 << 20});
    std::map<int, int> per_stage;
    for (const auto& c : bucketed.collectives())
      if (c.collective.kind == CollectiveKind::all_reduce && c.operand.rank() > 0) ++per_stage[bucketed.op(c.value).stage];
    CHECK(per_stage == std::map<int, int>{{0, 1}, {1, 1}});
    const NamedArrays state = init_inputs(accumulated, 4, true);
    const auto a = execute_on_threads(lower(pp), state), b = execute_on_threads(bucketed, state);
    for (std::size_t d = 0; d < a.size(); ++d)
      for (const auto& [name, x] : a[d].outputs) CHECK_MESSAGE(x == b[d].outputs.at(name), name);
  }
}

TEST_CASE("bucketing: reduce_scatters along any dim, each member keeping its own tile") {
  // Replicated inputs reduce-scattered along dims 1, 2 and 0 over 4 devices: every output is 4x its input.
  SpmdProgram p("scatters", Mesh{{"d", 4}});
  const std::vector<std::tuple<std::string, Shape, std::int64_t>> cases{{"x", {2, 8}, 1}, {"y", {3, 4, 4}, 2}, {"z", {8}, 0}};
  NamedArrays inputs;
  for (const auto& [name, shape, dim] : cases) {
    const auto v = p.add({local_op(OpKind::input, {}, {shape}, {}, name)});
    p.add_input({name, v, {shape}, Sharding::replicated(static_cast<std::int64_t>(shape.size())), ""});
    Shape tile = shape;
    tile[static_cast<std::size_t>(dim)] /= 4;
    const auto r = p.add({local_op(OpKind::input, {v}, {tile}), Collective{CollectiveKind::reduce_scatter, {"d"}, dim}});
    Sharding tiled = Sharding::replicated(static_cast<std::int64_t>(shape.size()));
    tiled.dims[static_cast<std::size_t>(dim)] = {"d"};
    p.add_output({name, r, {shape}, tiled, ""});
    inputs[name] = random_array(shape, static_cast<std::uint64_t>(inputs.size() + 1));
  }
  const SpmdProgram bucketed = bucket_collectives(p, 1 << 20);
  REQUIRE(bucketed.collectives().size() == 1);
  CHECK(bucketed.collectives()[0].result == TensorType{{1, 4 + 12 + 2}});
  const auto plain = execute_on_threads(p, inputs), fused = execute_on_threads(bucketed, inputs);
  for (const auto& [name, x] : inputs) {
    CHECK(fused[2].outputs.at(name) == plain[2].outputs.at(name));
    for (std::int64_t i = 0; i < x.size(); ++i) CHECK(fused[2].outputs.at(name).at(i) == doctest::Approx(4 * x.at(i)));
  }
}

TEST_CASE("bucketing: all_gathers along any dim, each member getting its whole result") {
  // Inputs tiled along dims 1, 2 and 0 over 4 devices, gathered: every device's output is the input.
  SpmdProgram p("gathers", Mesh{{"d", 4}});
  const std::vector<std::tuple<std::string, Shape, std::int64_t>> cases{{"x", {2, 8}, 1}, {"y", {3, 4, 4}, 2}, {"z", {8}, 0}};
  NamedArrays inputs;
  for (const auto& [name, shape, dim] : cases) {
    Shape tile = shape;
    tile[static_cast<std::size_t>(dim)] /= 4;
    Sharding tiled = Sharding::replicated(static_cast<std::int64_t>(shape.size()));
    tiled.dims[static_cast<std::size_t>(dim)] = {"d"};
    const auto v = p.add({local_op(OpKind::input, {}, {tile}, {}, name)});
    p.add_input({name, v, {shape}, tiled, ""});
    const auto r = p.add({local_op(OpKind::input, {v}, {shape}), Collective{CollectiveKind::all_gather, {"d"}, dim}});
    p.add_output({name, r, {shape}, Sharding::replicated(static_cast<std::int64_t>(shape.size())), ""});
    inputs[name] = random_array(shape, static_cast<std::uint64_t>(inputs.size() + 1));
  }
  const SpmdProgram bucketed = bucket_collectives(p, 1 << 20);
  REQUIRE(bucketed.collectives().size() == 1);
  CHECK(bucketed.collectives()[0].result == TensorType{{4, 4 + 12 + 2}});
  const auto fused = execute_on_threads(bucketed, inputs);
  for (const auto& device : fused)
    for (const auto& [name, x] : inputs) CHECK_MESSAGE(device.outputs.at(name) == x, name);
}

TEST_CASE("early collectives: each moves up to its operand, within the prefetch budget; results bitwise the same") {
  const Program step = mlp_step(16, {8, 32, 8, 32, 8}, true);
  const NamedArrays state = init_inputs(step, 8, true);
  auto same_outputs = [](const SpmdProgram& a, const SpmdProgram& b, const NamedArrays& inputs) {
    const auto x = execute_on_threads(a, inputs), y = execute_on_threads(b, inputs);
    for (std::size_t d = 0; d < x.size(); ++d)
      for (const auto& [name, array] : x[d].outputs) CHECK_MESSAGE(array == y[d].outputs.at(name), name);
  };
  // The same collectives, each right after its operand, or after instructions that only feed collectives there
  // (other collectives, and the ops that move with them); returns whether any moved up. With `reductions_only`,
  // all_gathers (whose larger results move within the prefetch budget) are not held to that.
  auto as_early_as_allowed = [](const SpmdProgram& early, const SpmdProgram& late, bool reductions_only = false) {
    auto communicating = [](const SpmdProgram& p) {  // all_slice is a local copy: it moves only with a group
      std::vector<std::string> list;
      for (const auto& c : p.collectives())
        if (c.collective.kind != CollectiveKind::all_slice) list.push_back(to_string(c.collective) + " " + c.collective.reason);
      return list;
    };
    auto a = communicating(early), b = communicating(late);
    std::ranges::sort(a);
    std::ranges::sort(b);
    CHECK(a == b);
    std::vector<ValueId> last_user(static_cast<std::size_t>(early.size()), early.size());
    for (ValueId v = 0; v < early.size(); ++v)
      for (auto o : early.op(v).op.operands) last_user[static_cast<std::size_t>(o)] = v;
    bool moved = false;
    std::size_t index = 0;
    const auto in_place = late.collectives();
    for (ValueId c = 0; c < early.size(); ++c) {
      const auto& s = early.op(c);
      if (!s.collective || s.collective->kind == CollectiveKind::all_slice) continue;
      if (reductions_only && s.collective->kind == CollectiveKind::all_gather) continue;
      for (ValueId v = s.op.operands[0] + 1; v < c; ++v)
        CHECK_MESSAGE((early.op(v).collective || last_user[static_cast<std::size_t>(v)] < c),
                      "%" << v << " between %" << s.op.operands[0] << " and %" << c << " in " << to_string(early));
      while (index < in_place.size() && in_place[index].collective.kind == CollectiveKind::all_slice) ++index;
      moved |= index < in_place.size() && c < in_place[index++].value;
    }
    return moved;
  };
  SUBCASE("BP and ZeRO-2: a gradient's reduction comes right after the gradient (or the collective before it)") {
    for (const Schedule& schedule : {Schedule{bp("batch")}, Schedule{bp("batch"), zero2("batch")}}) {
      const Partitioned plan = partition(step, Mesh{{"batch", 4}}, schedule);
      const SpmdProgram late = lower(plan, {.early_collectives = false}), early = lower(plan),
                        unbounded = lower(plan, {.prefetch_bytes = std::int64_t{1} << 40});
      CHECK(as_early_as_allowed(early, late, true));
      CHECK(as_early_as_allowed(unbounded, late));  // ZeRO-2's new parameters gathered right after their update
      same_outputs(late, early, state);
      same_outputs(late, unbounded, state);
    }
  }
  SUBCASE("ZeRO-2 under SGD: a later layer's update and all_gather run during the earlier layers' backward") {
    const Program sgd = mlp_step(16, {8, 32, 8, 32, 8}, false);
    const Partitioned plan = partition(sgd, Mesh{{"batch", 4}}, {bp("batch"), zero2("batch")});
    const SpmdProgram late = lower(plan, {.early_collectives = false}), early = lower(plan);
    CHECK(as_early_as_allowed(early, late, true));
    ValueId last_gemm = 0;
    for (ValueId v = 0; v < early.size(); ++v)
      if (early.op(v).op.kind == OpKind::dot_general) last_gemm = v;
    for (const auto& o : early.outputs())
      if (o.name == "params/mlp/w4") CHECK_MESSAGE(o.value < last_gemm, to_string(early));
    same_outputs(late, early, init_inputs(sgd, 8, true));
  }
  SUBCASE("ZeRO-3: parameter all_gathers run ahead within the budget: one ahead by default") {
    const Partitioned plan = partition(step, Mesh{{"batch", 4}}, {bp("batch"), zero3("batch")});
    const SpmdProgram late = lower(plan, {.early_collectives = false});
    std::int64_t largest = 0;
    for (const auto& c : late.collectives())
      if (c.collective.kind == CollectiveKind::all_gather) largest = std::max(largest, c.result.bytes());
    const HardwareProfile hw = HardwareProfile::named("cpu");
    const auto peak = [&](const SpmdProgram& p) { return simulate(p, hw).peak_bytes; };
    const SpmdProgram none = lower(plan, {.prefetch_bytes = 0}), one = lower(plan),
                      all = lower(plan, {.prefetch_bytes = std::int64_t{1} << 40});
    CHECK(peak(none) <= peak(late));
    CHECK(peak(one) <= peak(none) + largest);
    CHECK(peak(all) > peak(one));  // each pass's gathers all at its start
    CHECK(as_early_as_allowed(all, late));
    same_outputs(late, none, state);
    same_outputs(late, one, state);
    same_outputs(late, all, state);
  }
  SUBCASE("a pipelined program keeps its order") {
    const nn::Mlp model{"params/mlp", {8, 16, 8}};
    const Program accumulated = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{1e-2},
                                           {{"x", {16, 8}}, {"y", {16, 8}}}, StepOptions{.microbatches = 2});
    const Partitioned pp = partition(accumulated, Mesh{{"stage", 2}, {"batch", 2}},
                                     {pipeline("stage", PipelineSchedule::gpipe,
                                               {{"params/mlp/w1", "params/mlp/b1"}, {"params/mlp/w2", "params/mlp/b2"}}),
                                      data_parallel("batch")});
    CHECK(lower(pp) == lower(pp, {.early_collectives = false}));
  }
}

// A collective of values made from constants alone reads nothing the program computes before it (remat.hpp
// makes a gain's broadcast again from its shard, and ZeRO-3 gathers that): it moves up to right after the first
// instruction, never before it.
TEST_CASE("early collectives: a collective of a constant's broadcast moves to the top") {
  SpmdProgram p("constant", Mesh{{"d", 2}});
  const auto x = p.add({local_op(OpKind::input, {}, {{4}}, {}, "x")});
  p.add_input({"x", x, {{4}}, Sharding::replicated(1), ""});
  const auto e = p.add({local_op(OpKind::exp, {x}, {{4}})});
  Attrs one, row;
  one.literal = {1};
  row.shape = {4};
  const auto c = p.add({local_op(OpKind::constant, {}, {{}}, one)});
  const auto b = p.add({local_op(OpKind::broadcast_in_dim, {c}, {{4}}, row)});
  const auto sum = p.add({local_op(OpKind::input, {b}, {{4}}), Collective{CollectiveKind::all_reduce, {"d"}}});
  p.add_output({"e", e, {{4}}, Sharding::replicated(1), ""});
  p.add_output({"sum", sum, {{4}}, Sharding::replicated(1), ""});
  const SpmdProgram early = schedule_collectives(p, 1 << 20);
  std::vector<OpKind> order;
  for (const auto& s : early.ops()) order.push_back(s.collective ? OpKind::count_ : s.op.kind);
  CHECK(order == std::vector<OpKind>{OpKind::input, OpKind::constant, OpKind::broadcast_in_dim, OpKind::count_, OpKind::exp});
  const NamedArrays in{{"x", random_array({4}, 5)}};
  const auto plain = execute_on_threads(p, in), moved = execute_on_threads(early, in);
  for (std::size_t d = 0; d < plain.size(); ++d) {
    CHECK(moved[d].outputs.at("e") == plain[d].outputs.at("e"));
    for (std::int64_t i = 0; i < 4; ++i) CHECK(moved[d].outputs.at("sum").at(i) == 2);
  }
}

TEST_CASE("async collectives: the communication stream computes what inline collectives do, bitwise") {
  const Program step = mlp_step(16, {8, 32, 8, 32, 8}, true);
  const NamedArrays state = init_inputs(step, 9, true);
  const Mesh square{{"batch", 2}, {"model", 2}};
  for (const auto& [label, mesh, schedule] :
       std::vector<Case>{{"bp", Mesh{{"batch", 4}}, {bp("batch")}},
                         {"bp,mp", square, {bp("batch"), megatron("model")}},
                         {"bp,z2", Mesh{{"batch", 4}}, {bp("batch"), zero2("batch")}},
                         {"bp,mp,z3", square, {bp("batch"), megatron("model"), zero3("batch")}}}) {
    CAPTURE(label);
    for (const SpmdProgram& spmd : {lower(partition(step, mesh, schedule)), lower(partition(step, mesh, schedule), {.bucket_bytes = 1 << 20})}) {
      const auto inline_run = execute_on_threads(spmd, state, {.timeline = true}, {.overlap = false});
      const auto streamed = execute_on_threads(spmd, state, {.timeline = true}, {.overlap = true, .stream_min_bytes = 0});
      for (std::size_t d = 0; d < streamed.size(); ++d) {
        for (const auto& [name, array] : inline_run[d].outputs) CHECK_MESSAGE(array == streamed[d].outputs.at(name), name);
        CHECK(streamed[d].peak_bytes == inline_run[d].peak_bytes);  // counted at last uses, as the simulator does
        CHECK(streamed[d].collective_seconds.size() == inline_run[d].collective_seconds.size());
        REQUIRE(streamed[d].timeline.size() == inline_run[d].timeline.size());
        // Local ops run one after another in program order; collectives on the stream, in program order too.
        double compute_free = 0, stream_free = 0;
        for (std::size_t i = 0; i < streamed[d].timeline.size(); ++i) {
          const OpTiming& t = streamed[d].timeline[i];
          CHECK(t.value == inline_run[d].timeline[i].value);
          const auto& c = spmd.op(t.value).collective;
          double& free = c && c->kind != CollectiveKind::all_slice ? stream_free : compute_free;
          CHECK(t.start >= free);
          free = t.start + t.seconds;
        }
      }
    }
  }
}

TEST_CASE("async collectives: a device that fails while its stream waits in a collective ends the run with its error") {
  // Device 2's ids are out of range: it fails in the embedding's gather, while the other devices go on computing
  // with the loss's all_reduce and the gradient reductions on their streams, waiting there for device 2.
  const nn::Embedding embed{"params/embed", 10, 8};
  const nn::Mlp head{"params/head", {8, 16, 8}};
  const Program step = train_step([&](Tensor ids, Tensor y) { return mse(head(embed(ids)), y); }, SGD{0.1},
                                  {{"ids", {8}, DType::i32}, {"y", {8, 8}}});
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 4}}, {ManualPartition{{{"ids", 0}, {"y", 0}}, "batch", "bp"}}));
  const NamedArrays state = init_inputs(step, 1, true);
  auto run = [&](threads::Communicator& c) {
    NamedArrays inputs = state;
    if (c.device() == 2) inputs.at("ids") = Array(Shape{8}, std::vector<std::int32_t>(8, 99));
    execute(spmd, c, inputs, {}, {.overlap = true, .stream_min_bytes = 0});
  };
  CHECK_THROWS_WITH_AS(threads::run(4, run), doctest::Contains("execute train_step (device 2)"), UserError);
}

TEST_CASE("lowering: every collective says why it exists") {
  const Program step = mlp_step(16, {8, 32, 8}, false);
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 2}, {"model", 2}}, {bp("batch"), megatron("model")}));
  for (const auto& c : spmd.collectives()) {
    CAPTURE(c.collective.reason);
    CHECK(c.collective.reason.find("needs") != std::string::npos);
    CHECK(c.collective.reason.find("from tactic") != std::string::npos);
  }
}

TEST_CASE("lowering: golden text of BP + Megatron on a forward MLP") {
  Program f = trace("mlp", [](Tensor x) {
    nn::Mlp mlp{"params/mlp", {4, 8, 4}};
    return sum(mlp(x));
  }, {{"x", {8, 4}}});
  const char* golden = R"(spmd mlp on {batch=2,model=2} {
  %0 "x" = input {data} : f32[4,4]
  %1 "params/mlp/w1" = input {parameter, init=normal(0.5)} : f32[4,4]
  %2 = dot_general %0, %1 {contract=[1]x[0]} : f32[4,4]
  %3 "params/mlp/b1" = input {parameter, init=zeros} : f32[4]
  %4 = broadcast_in_dim %3 {dims=[1]} : f32[4,4]
  %5 = add %2, %4 : f32[4,4]
  %6 = constant {value=0} : f32[]
  %7 = broadcast_in_dim %6 {dims=[]} : f32[4,4]
  %8 "params/mlp/h1" = max %5, %7 : f32[4,4]
  %9 "params/mlp/w2" = input {parameter, init=normal(0.353553391)} : f32[4,4]
  %10 = dot_general %8, %9 {contract=[1]x[0]} : f32[4,4]
  %11 = all_reduce %10 {axes={model}} : f32[4,4]  # %13 add operand 0 needs %10 as f32[8{batch},4], has f32[8{batch},4] sum{model} ('model' from tactic 2 (megatron(model)))
  %12 "params/mlp/b2" = input {parameter, init=zeros} : f32[4]
  %13 = broadcast_in_dim %12 {dims=[1]} : f32[4,4]
  %14 = add %11, %13 : f32[4,4]
  %15 = reduce_sum %14 {dims=[0,1]} : f32[]
  %16 = all_reduce %15 {axes={batch}} : f32[]  # output 'out' needs %14 as f32[], has f32[] sum{batch} ('batch' from tactic 1 (bp(batch)))
  output "out" = %16 : f32[]
}
)";
  CHECK(to_string(lower(partition(f, Mesh{{"batch", 2}, {"model", 2}}, {data_parallel("batch"), megatron("model")}))) ==
        golden);
}

TEST_CASE("lowering: a slice passes a tiled dim whole") {
  Program p = trace("s", [](Tensor x) { return slice(x, {0, 1}, {4, 3}); }, {{"x", {4, 4}}});
  const SpmdProgram spmd = lower(partition(p, Mesh{{"batch", 2}}, {ManualPartition{{{"x", 0}}, "batch"}}));
  const Array x({4, 4}, std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
  CHECK(execute_on_threads(spmd, {{"x", x}})[1].outputs.at("out") == interpret(p, {{"x", x}}).at("out"));
}

TEST_CASE("compile: a pipelined Executable cuts its stage programs once, and runs each stage at its predicted peak") {
  // The ExecutionPlan is made at compile: steps reuse its stage programs and fusion plans. Executor and simulator
  // free by the same plan, so each device's measured peak is its stage's predicted one.
  const Program step = microbatched_mlp_step();
  const Partitioned plan = two_stages_bp(step);
  NamedArrays all = init_inputs(step, 3, true), batch;
  for (const char* name : {"x", "y"}) batch[name] = all.at(name);
  const std::int64_t before = detail::stage_programs_cut();
  std::int64_t cut_at_compile = 0;
  std::vector<std::int64_t> measured(4), predicted(4);
  threads::run(4, [&](threads::Communicator& c) {
    const Executable<threads::Communicator> exe = compile(plan, c);
    c.barrier();
    if (c.device() == 0) cut_at_compile = detail::stage_programs_cut() - before;
    c.barrier();
    NamedArrays state = exe.init(3);
    const auto d = static_cast<std::size_t>(c.device());
    for (int s = 0; s < 3; ++s) measured[d] = exe.step(state, batch).peak_bytes;
    const Report r = simulate(exe.plan(), HardwareProfile::cpu());
    predicted[d] = r.stages.at(static_cast<std::size_t>(exe.spmd().stage_of(c.device()))).peak_bytes;
  });
  CHECK(cut_at_compile == 4 * 2);  // each device's plan cuts both stages, once
  CHECK(detail::stage_programs_cut() - before == cut_at_compile);  // and no step or simulation cuts again
  CHECK(measured == predicted);
}

TEST_CASE("compile: an Executable's steps and carried state equal the single-device step, on every device") {
  // Each device holds its pieces of the state from init() to the end; batches go in whole. After three Adam
  // steps, every device's loss and the gathered state must equal interpret() carrying the whole state.
  std::mt19937_64 rng(11);
  const std::vector<Case> cases = {
      {"none 2", Mesh{{"batch", 2}}, {}},
      {"mp 1x4", Mesh{{"batch", 1}, {"model", 4}}, {megatron("model")}},
      {"bp,z2 4", Mesh{{"batch", 4}}, {bp("batch"), zero2("batch")}},
      {"bp,mp,z3 2x2", Mesh{{"batch", 2}, {"model", 2}}, {bp("batch"), megatron("model"), zero3("batch")}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.label);
    const Program step = mlp_step(16, {8, 8 * static_cast<std::int64_t>(1 + rng() % 3), 8}, true);
    const Partitioned plan = partition(step, c.mesh, c.schedule);
    const std::uint64_t seed = rng();
    auto batch_at = [&](int s) {
      NamedArrays all = init_inputs(step, seed + static_cast<std::uint64_t>(s), true), batch;
      for (const char* name : {"x", "y"}) batch[name] = all.at(name);
      return batch;
    };
    NamedArrays want = init_inputs(step, seed);
    std::vector<double> want_loss;
    for (int s = 0; s < 3; ++s) {
      NamedArrays in = want;
      in.merge(batch_at(s));
      NamedArrays out = interpret(step, in);
      want_loss.push_back(out.at("loss").at(0));
      carry_state(step, want, std::move(out));
    }
    const auto devices = static_cast<std::size_t>(c.mesh.num_devices());
    std::vector<std::vector<double>> losses(devices);
    std::vector<NamedArrays> trained(devices), reloaded(devices), pieces(devices);
    threads::run(static_cast<int>(devices), [&](threads::Communicator& comm) {
      const auto d = static_cast<std::size_t>(comm.device());
      const Executable<threads::Communicator> exe = compile(plan, comm);
      NamedArrays state = exe.init(seed);
      CHECK(state == exe.shard_state(init_inputs(step, seed)));  // init draws the global values, then shards
      for (int s = 0; s < 3; ++s) {
        DeviceResult r = exe.step(state, batch_at(s));
        CHECK(r.outputs.size() == 1);  // everything else updates the state
        losses[d].push_back(r.outputs.at("loss").at(0));
      }
      pieces[d] = state;
      trained[d] = exe.gather_state(state);
      reloaded[d] = exe.shard_state(trained[d]);
    });
    for (std::size_t d = 0; d < devices; ++d) {
      CAPTURE(d);
      for (int s = 0; s < 3; ++s) CHECK(losses[d][static_cast<std::size_t>(s)] == doctest::Approx(want_loss[static_cast<std::size_t>(s)]).epsilon(1e-5));
      REQUIRE(trained[d].size() == want.size());
      for (const auto& [name, a] : want) {
        CAPTURE(name);
        const Array& b = trained[d].at(name);
        REQUIRE(a.type() == b.type());
        double worst = 0;
        for (std::int64_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a.at(i) - b.at(i)) / (1 + std::abs(a.at(i))));
        CHECK(worst < 1e-5);
      }
      CHECK(reloaded[d] == pieces[d]);  // gather_state then shard_state gives each device its pieces back
    }
  }
}
