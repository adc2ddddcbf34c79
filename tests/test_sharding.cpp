// Sharding core: mesh, shardings, the tile-mapping registry, tactics, propagation, provenance, viz.
#include <doctest/doctest.h>

// The headers this area needs rather than partir.hpp: no Eigen kernels to compile here.
#include <partir/autodiff/train_step.hpp>
#include <partir/dsl/nn.hpp>
#include <partir/sharding/explain.hpp>
#include <partir/tactics/manual.hpp>
#include <partir/tactics/partition.hpp>
#include <partir/viz/layout.hpp>

using namespace partir;

namespace {

const Mesh mesh2x2{{"batch", 2}, {"model", 2}};

Sharding sh(std::vector<AxisList> dims, AxisList partial = {}) { return {std::move(dims), std::move(partial)}; }

// A value's sharding as text, "[{batch},{model}] sum{model}": readable in failures, cheap to compile.
std::string layout(const Partitioned& p, ValueId v) { return to_string(p.sharding(v)); }
std::string layout(const Partitioned& p, std::string_view name) { return to_string(p.sharding(name)); }

// y = relu(x @ w1) @ w2 (Megatron's MLP without biases), tagged h and y; loss = mse(y, t).
Tensor mlp(const Tensor& x) {
  Tensor w1 = param("params/mlp/w1", {8, 32}, normal_init(0.1));
  Tensor w2 = param("params/mlp/w2", {32, 8}, normal_init(0.1));
  return tag(matmul(tag(relu(matmul(x, w1)), "params/mlp/h"), w2), "y");
}
Program mlp_forward() {
  return trace("mlp", [](Tensor x) { return NamedTensors{{"y", mlp(x)}}; }, {{"x", {16, 8}}});
}
Program mlp_loss() {
  return trace("mlp", [](Tensor x, Tensor t) { return NamedTensors{{"loss", mse(mlp(x), t)}}; },
               {{"x", {16, 8}}, {"t", {16, 8}}});
}

const ManualPartition bp{{{"x", 0}, {"t", 0}}, "batch", "bp"};
const ManualPartition mp{{{"params/mlp/w1", 1}, {"params/mlp/w2", 0}}, "model", "mp"};
const ManualPartition bp_x{{{"x", 0}}, "batch", "bp"};

}  // namespace

TEST_CASE("mesh: device ids, coordinates, positions and groups") {
  const Mesh m{{"batch", 2}, {"model", 3}};
  CHECK(m.num_devices() == 6);
  CHECK(m.coordinates(4) == std::vector<std::int64_t>{1, 1});
  CHECK(m.device_at({1, 2}) == 5);
  CHECK(m.position(5, {"batch"}) == 1);
  CHECK(m.position(5, {"model", "batch"}) == 5);
  CHECK(m.position(5, {"batch", "model"}) == 5);
  CHECK(m.position(4, {"model", "batch"}) == 3);
  CHECK(m.group(4, {"model"}) == std::vector<std::int64_t>{3, 4, 5});
  CHECK(m.groups({"batch"}) == std::vector<std::vector<std::int64_t>>{{0, 3}, {1, 4}, {2, 5}});
  CHECK(m.groups({"model", "batch"}) == std::vector<std::vector<std::int64_t>>{{0, 3, 1, 4, 2, 5}});
  CHECK(m.groups({}).size() == 6);
  CHECK(m.to_string() == "{batch=2,model=3}");
  CHECK(Mesh::parse("batch=2,model=3") == m);
  CHECK(m.axis_size("model") == 3);
}

TEST_CASE("mesh: errors") {
  CHECK_THROWS_WITH_AS(Mesh({{"a", 2}, {"a", 2}}), "mesh {a=2,a=2}: axis 'a' appears twice", UserError);
  CHECK_THROWS_WITH_AS(Mesh({{"", 2}}), "mesh {=2}: axis 0 has an empty name", UserError);
  CHECK_THROWS_WITH_AS(Mesh({{"a", 0}}), "mesh {a=0}: axis 'a' has size 0 (must be at least 1)", UserError);
  CHECK_THROWS_WITH_AS(Mesh::parse("batch=2,model"),
                       "mesh 'batch=2,model': expected axes as name=size separated by commas, got 'model'", UserError);
  CHECK_THROWS_WITH_AS(Mesh::parse("batch=x"),
                       "mesh 'batch=x': expected axes as name=size separated by commas, got 'batch=x'", UserError);
  CHECK_THROWS_WITH_AS(mesh2x2.axis_index("foo"), "axis 'foo' is not in mesh {batch=2,model=2}", UserError);
  CHECK_THROWS_WITH_AS(mesh2x2.coordinates(4), "mesh {batch=2,model=2}: device 4 is out of range (4 devices)",
                       UserError);
}

TEST_CASE("sharding: printing, local shapes and invariants") {
  const TensorType t{{256, 1024}, DType::f32};
  CHECK(to_string(t, sh({{"batch"}, {"model"}})) == "f32[256{batch},1024{model}]");
  CHECK(to_string(t, sh({{"batch"}, {}}, {"model"})) == "f32[256{batch},1024] sum{model}");
  CHECK(to_string(t, Sharding::replicated(2)) == "f32[256,1024]");
  CHECK(to_string(sh({{"batch", "model"}, {}})) == "[{batch,model},{}]");
  CHECK(local_shape(t, sh({{"batch"}, {"model"}}), mesh2x2) == Shape{128, 512});
  CHECK(local_shape(t, sh({{"model", "batch"}, {}}), mesh2x2) == Shape{64, 1024});
  CHECK(sh({{"batch"}, {}}) != sh({{}, {"batch"}}));
  CHECK(sh({{"batch"}, {}}, {"model"}).uses("model"));
  CHECK(sh({{}, {"model"}}).dim_of("model") == 1);
  CHECK(Sharding::replicated(2).is_replicated());
  CHECK(!sh({{}, {}}, {"model"}).is_replicated());

  const TensorType odd{{6, 4}, DType::f32};
  CHECK_THROWS_WITH_AS(validate(sh({{"batch", "model"}, {}}), odd, mesh2x2, "x"),
                       "sharding of 'x' f32[6,4]: dim 0 (size 6) is not divisible by {batch,model} (4 tiles)",
                       UserError);
  CHECK_THROWS_WITH_AS(validate(sh({{"batch"}, {}}, {"batch"}), odd, mesh2x2, "x"),
                       "sharding of 'x' f32[6,4]: axis 'batch' is used twice", UserError);
  CHECK_THROWS_WITH_AS(validate(sh({{"data"}, {}}), odd, mesh2x2, "x"),
                       "sharding of 'x' f32[6,4]: axis 'data' is not in mesh {batch=2,model=2}", UserError);
  CHECK_THROWS_WITH_AS(validate(sh({{}}), odd, mesh2x2, "x"), "sharding of 'x' f32[6,4]: 1 dims given for rank 2",
                       UserError);
}

TEST_CASE("rules: one factor rule per op kind") {
  Program p = trace("ops", [](Tensor x, Tensor ids) {
    Tensor w = input("w", {8, 32});
    Tensor b = input("b", {32});
    NamedTensors out{{"dot", matmul(x, w)},
                     {"add", x + x},
                     {"bcast", broadcast_in_dim(b, {4, 32}, {1})},
                     {"bcast1", broadcast_in_dim(reshape(b, {1, 32}), {4, 32}, {0, 1})},
                     {"sum", sum(x, {1})},
                     {"max", max(x, {1})},
                     {"transpose", transpose(x)},
                     {"slice", slice(x, {0, 1}, {16, 4})},
                     {"pad", pad(x, {0, 0}, {0, 2})},
                     {"concat", concatenate({x, slice(x, {0, 0}, {4, 8})}, 0)},
                     {"gather", gather(w, ids)},
                     {"scatter", scatter_add(ids, gather(w, ids), {8, 32})},
                     {"select", select(compare(x, x, CompareDir::lt), x, x)},
                     {"convert", convert(ids, DType::f32)}};
    return out;
  }, {{"x", {16, 8}}, {"ids", {3, 5}, DType::i32}});
  auto rule = [&](const std::string& output) { return to_string(rule_for(p, p.output(output))); };
  CHECK(rule("dot") == "([i,k],[k,j])->([i,j]) {i=16,j=32,k=8} reduction={k}");
  CHECK(rule("add") == "([i,j],[i,j])->([i,j]) {i=16,j=8}");
  CHECK(rule("bcast") == "([j])->([i,j]) {i=4,j=32}");
  CHECK(rule("bcast1") == "([1,j])->([i,j]) {i=4,j=32}");
  CHECK(rule("sum") == "([i,j])->([i]) {i=16,j=8} reduction={j}");
  CHECK(rule("max") == "([i,j])->([i]) {i=16,j=8} need_replication={j}");
  CHECK(rule("transpose") == "([i,j])->([j,i]) {i=16,j=8}");
  CHECK(rule("slice") == "([i,k])->([i,j]) {i=16,j=3,k=8} need_replication={k}");
  CHECK(rule("pad") == "([i,k])->([i,j]) {i=16,j=10,k=8} need_replication={k}");
  CHECK(rule("concat") == "([k,j],[l,j])->([i,j]) {i=20,j=8,k=16,l=4} need_replication={k,l}");
  CHECK(rule("gather") == "([l,k],[i,j])->([i,j,k]) {i=3,j=5,k=32,l=8} reduction={l}");
  CHECK(rule("scatter") == "([k,l],[k,l,j])->([i,j]) {i=8,j=32,k=3,l=5} reduction={k,l}");
  CHECK(rule("select") == "([i,j],[i,j],[i,j])->([i,j]) {i=16,j=8}");
  CHECK(rule("convert") == "([i,j])->([i,j]) {i=3,j=5}");
  // Every op of the program has a rule whose tensors match the op's ranks.
  for (ValueId v = 0; v < p.size(); ++v) {
    const OpRule r = rule_for(p, v);
    REQUIRE(r.operands.size() == p.op(v).operands.size());
    for (std::size_t i = 0; i < r.operands.size(); ++i)
      CHECK(static_cast<std::int64_t>(r.operands[i].size()) == p.type(p.op(v).operands[i]).rank());
    CHECK(static_cast<std::int64_t>(r.result.size()) == p.type(v).rank());
  }
  // Linearity decides where partial sums survive.
  CHECK(rule_for(p, p.output("dot")).partial == PartialRule::product);
  CHECK(rule_for(p, p.output("add")).partial == PartialRule::sum);
  CHECK(rule_for(p, p.output("max")).partial == PartialRule::none);
  CHECK(rule_for(p, p.output("convert")).partial == PartialRule::none);  // i32 -> f32 is not linear
}

TEST_CASE("rules: reshape splits and merges factors") {
  auto rule = [](Shape from, Shape to) {
    Program p = trace("r", [&](Tensor x) { return reshape(x, to); }, {{"x", from}});
    return to_string(rule_for(p, p.output("out")));
  };
  CHECK(rule({2, 4, 32}, {8, 32}) == "([i,j,k])->([(ij),k]) {i=2,j=4,k=32}");
  CHECK(rule({8, 32}, {2, 4, 32}) == "([(ij),k])->([i,j,k]) {i=2,j=4,k=32}");
  CHECK(rule({6, 4}, {2, 12}) == "([(ij),k])->([i,(jk)]) {i=2,j=3,k=4}");
  CHECK(rule({16, 1}, {16}) == "([i,1])->([i]) {i=16}");
  CHECK(rule({4, 6}, {6, 4}) == "([i,j])->([k,l]) {i=4,j=6,k=6,l=4} need_replication={i,j}");

  // Axes on a merged dim fill its factors major to minor; one that would straddle two factors does not fit.
  const Program p = trace("r", [](Tensor x) { return reshape(x, {2, 4, 32}); }, {{"x", {8, 32}}});
  const OpRule r = rule_for(p, p.output("out"));
  const std::int64_t two_then_four[] = {2, 4}, two[] = {2}, four[] = {4};
  REQUIRE(split_axes(two_then_four, r.operands[0][0], r));
  CHECK(split_axes(two_then_four, r.operands[0][0], r)->factor_of_axis == std::vector<int>{0, 1});
  CHECK(split_axes(two, r.operands[0][0], r)->left == std::vector<std::int64_t>{1, 4});
  CHECK(!split_axes(four, r.operands[0][0], r));
}

TEST_CASE("selectors: exact names, tags and globs") {
  CHECK(glob_match("params/*/w1", "params/mlp/w1"));
  CHECK(!glob_match("params/*/w1", "params/layers/3/w1"));
  CHECK(glob_match("params/**/w1", "params/layers/3/w1"));
  CHECK(glob_match("params/**/w1", "params/w1"));
  CHECK(glob_match("params/**", "params/mlp/w1"));
  CHECK(!glob_match("params/*", "params/mlp/w1"));
  CHECK(glob_match("params/mlp/w*", "params/mlp/w12"));
  CHECK(!glob_match("x", "xy"));
  CHECK(glob_match("params/**/table|params/**/embed_tokens/weight", "params/model/embed_tokens/weight"));
  CHECK(glob_match("params/**/table|params/**/embed_tokens/weight", "params/tok_embed/table"));
  CHECK(!glob_match("params/**/table|params/**/embed_tokens/weight", "params/model/embed_tokens"));
  const Program p = mlp_forward();
  CHECK(select(p, "params/mlp/*").size() == 3);  // w1, w2 and the tag h
  CHECK(select(p, "params/mlp/w2|params/mlp/w1|params/mlp/w*") == select(p, "params/mlp/w*"));  // each once, in order
  CHECK(select(p, "params/mlp/w1|y").size() == 2);
  CHECK(select(p, "y") == std::vector<ValueId>{p.output("y")});
}

TEST_CASE("megatron MLP: the hidden activation is tiled on model and y is a partial sum over model") {
  const Partitioned p = partition(mlp_forward(), mesh2x2, {mp});
  CHECK(layout(p, "params/mlp/w1") == "[{},{model}]");
  CHECK(layout(p, "params/mlp/w2") == "[{model},{}]");
  CHECK(layout(p, "params/mlp/h") == "[{},{model}]");
  CHECK(layout(p, "y") == "[{},{}] sum{model}");
  CHECK(layout(p, "x") == "[{},{}]");
  CHECK(p.typed(p.value("y")) == "f32[16,8] sum{model}");
  CHECK(p.conflicts().empty());
  CHECK(p.stops().empty());
}

TEST_CASE("megatron MLP backward: weight gradients follow the weights") {
  const Partitioned p = partition(value_and_grad(mlp_loss(), "loss"), mesh2x2, {mp});
  CHECK(layout(p, "grad/params/mlp/w1") == "[{},{model}]");
  CHECK(layout(p, "grad/params/mlp/w2") == "[{model},{}]");
  CHECK(layout(p, "params/mlp/h") == "[{},{model}]");
  CHECK(layout(p, "y") == "[{},{}] sum{model}");
  CHECK(layout(p, "loss") == "[]");
  CHECK(p.conflicts().empty());
}

TEST_CASE("batch parallelism: x's batch tiling reaches the whole forward and backward") {
  const Partitioned p = partition(value_and_grad(mlp_loss(), "loss"), mesh2x2, {bp});
  const Program& prog = p.program();
  int batch_sized = 0;
  for (ValueId v = 0; v < prog.size(); ++v)
    if (prog.type(v).rank() > 0 && prog.type(v).shape[0] == 16) {
      ++batch_sized;
      CHECK_MESSAGE(p.sharding(v).dims[0] == AxisList{"batch"}, to_string(prog, v));
    }
  CHECK(batch_sized >= 15);
  CHECK(layout(p, "grad/params/mlp/w1") == "[{},{}] sum{batch}");
  CHECK(layout(p, "grad/params/mlp/w2") == "[{},{}] sum{batch}");
  CHECK(layout(p, "loss") == "[] sum{batch}");
  CHECK(layout(p, "params/mlp/w1") == "[{},{}]");
  CHECK(p.conflicts().empty());
}

TEST_CASE("composition: BP then MP on a 2x2 mesh gives both") {
  const Partitioned p = partition(value_and_grad(mlp_loss(), "loss"), mesh2x2, {bp, mp});
  CHECK(layout(p, "params/mlp/h") == "[{batch},{model}]");
  CHECK(layout(p, "y") == "[{batch},{}] sum{model}");
  CHECK(layout(p, "grad/params/mlp/w1") == "[{},{model}] sum{batch}");
  CHECK(layout(p, "grad/params/mlp/w2") == "[{model},{}] sum{batch}");
  CHECK(layout(p, "loss") == "[] sum{batch}");
  CHECK(p.conflicts().empty());
}

TEST_CASE("train step: BP + MP tie new parameters and optimizer state to their inputs") {
  nn::Mlp model{"params/mlp", {8, 32, 8}};
  const Program step = train_step([&](Tensor x, Tensor t) { return mse(model(x), t); }, Adam{},
                                  {{"x", {16, 8}}, {"t", {16, 8}}});
  const Partitioned p = partition(step, mesh2x2, {bp, mp});
  CHECK(p.conflicts().empty());
  CHECK(layout(p, "params/mlp/h1") == "[{batch},{model}]");
  CHECK(layout(p, "loss") == "[] sum{batch}");
  const std::map<std::string, std::string> expected{{"params/mlp/w1", "[{},{model}]"},
                                                    {"params/mlp/b1", "[{model}]"},
                                                    {"params/mlp/w2", "[{model},{}]"},
                                                    {"params/mlp/b2", "[{}]"}};
  for (const auto& [name, s] : expected) {
    CAPTURE(name);
    CHECK(layout(p, name) == s);
    CHECK(layout(p, *step.find_output(name)) == s);  // the new value, tied to the input
    CHECK(layout(p, "opt/adam/m/" + name) == s);
    CHECK(layout(p, "opt/adam/v/" + name) == s);
    CHECK(layout(p, *step.find_output("opt/adam/m/" + name)) == s);
  }
  CHECK(layout(p, "opt/adam/step") == "[]");

  // Under SGD the gradient feeds the update directly: w - lr * g with g a partial sum over batch.
  const Program sgd = train_step([&](Tensor x, Tensor t) { return mse(model(x), t); }, SGD{0.1},
                                 {{"x", {16, 8}}, {"t", {16, 8}}});
  const Partitioned q = partition(sgd, mesh2x2, {bp, mp});
  CHECK(q.conflicts().empty());
  CHECK(layout(q, *sgd.find_output("params/mlp/w1")) == "[{},{model}]");
}

TEST_CASE("conflicting tactics: the earlier one wins, in either order") {
  const ManualPartition cols{{{"params/mlp/w1", 1}}, "model", "cols"};
  const ManualPartition rows{{{"params/mlp/w1", 0}}, "model", "rows"};
  const Program prog = mlp_forward();
  const ValueId w1 = prog.input("params/mlp/w1");

  const Partitioned a = partition(prog, mesh2x2, {cols, rows});
  CHECK(layout(a, w1) == "[{},{model}]");
  CHECK(layout(a, "params/mlp/h") == "[{},{model}]");
  REQUIRE(a.conflicts().size() == 1);
  CHECK(a.conflicts()[0].wanted == Origin{1, w1, 0});
  CHECK(a.conflicts()[0].existing == Origin{0, w1, 1});
  CHECK(a.conflicts()[0].message ==
        "tactic 2 (rows): 'model' at params/mlp/w1: params/mlp/w1 dim 0 by tactic 2 (rows) conflicts with "
        "params/mlp/w1 dim 1 by tactic 1 (cols)");

  const Partitioned b = partition(prog, mesh2x2, {rows, cols});
  CHECK(layout(b, w1) == "[{model},{}]");
  CHECK(layout(b, "x") == "[{},{model}]");  // the contracting dim
  CHECK(layout(b, "params/mlp/h") == "[{},{}]");  // relu of a partial sum: not linear
  REQUIRE(b.conflicts().size() == 1);
  CHECK(b.conflicts()[0].wanted == Origin{1, w1, 1});
  CHECK(b.conflicts()[0].existing == Origin{0, w1, 0});
}

TEST_CASE("a conflict at an op records both origins and leaves the op unsharded on the axis") {
  const Program prog = mlp_forward();
  const ValueId x = prog.input("x"), w1 = prog.input("params/mlp/w1");
  const ValueId xw = prog.op(prog.output("y")).operands[0] - 3;  // the first dot_general
  REQUIRE(prog.op(xw).kind == OpKind::dot_general);

  // Within one tactic: x's rows and w1's rows are different factors of x @ w1.
  const Partitioned p = partition(prog, mesh2x2, {ManualPartition{{{"x", 0}, {"params/mlp/w1", 0}}, "model"}});
  CHECK(layout(p, xw) == "[{},{}]");
  CHECK(layout(p, "y") == "[{},{}]");
  REQUIRE(p.conflicts().size() == 1);
  const Conflict& c = p.conflicts()[0];
  CHECK(c.site == "%3 dot_general");
  CHECK(c.wanted == Origin{0, w1, 0});
  CHECK(c.existing == Origin{0, x, 0});
  CHECK(c.message == "tactic 1 (tile x:0,params/mlp/w1:0 on model): 'model' at %3 dot_general: params/mlp/w1 dim 0 "
                     "by tactic 1 (tile x:0,params/mlp/w1:0 on model) conflicts with x dim 0 by tactic 1 (tile "
                     "x:0,params/mlp/w1:0 on model)");

  // Across tactics: the earlier tactic's tiling of the op stays, the later one stops there.
  const Partitioned q = partition(prog, mesh2x2, {bp_x, ManualPartition{{{"params/mlp/w1", 0}}, "batch", "rows"}});
  CHECK(layout(q, xw) == "[{batch},{}]");
  REQUIRE(q.conflicts().size() == 1);
  CHECK(q.conflicts()[0].wanted == Origin{1, w1, 0});
  CHECK(q.conflicts()[0].existing == Origin{0, x, 0});
}

TEST_CASE("idempotence: applying a tactic twice changes nothing") {
  const Program prog = value_and_grad(mlp_loss(), "loss");
  const Partitioned p = partition(prog, mesh2x2, {bp, mp, mp, bp});
  REQUIRE(p.history().size() == 4);
  CHECK(p.history()[1].shardings == p.history()[2].shardings);
  CHECK(p.history()[1].shardings == p.history()[3].shardings);
  CHECK(p.history()[3].conflicts.empty());

  const ManualPartition cols{{{"params/mlp/w1", 1}}, "model", "cols"};
  const ManualPartition rows{{{"params/mlp/w1", 0}}, "model", "rows"};
  const Partitioned q = partition(prog, mesh2x2, {cols, rows, rows});
  CHECK(q.history()[1] .shardings == q.history()[2].shardings);
  CHECK(q.history()[1].conflicts == q.history()[2].conflicts);
}

TEST_CASE("history: one snapshot per tactic") {
  const Partitioned p = partition(mlp_forward(), mesh2x2, {bp_x, mp});
  REQUIRE(p.history().size() == 2);
  CHECK(p.history()[0].tactic == "bp");
  CHECK(p.history()[1].tactic == "mp");
  const ValueId h = p.value("params/mlp/h");
  CHECK(to_string(p.history()[0].shardings[static_cast<std::size_t>(h)]) == "[{batch},{}]");
  CHECK(to_string(p.history()[1].shardings[static_cast<std::size_t>(h)]) == "[{batch},{model}]");
  CHECK(p.history()[1].shardings == p.shardings());
  CHECK(to_string(p, 0).starts_with("program mlp on {batch=2,model=2} after tactic 1 (bp) {\n"));
  CHECK(to_string(p, 0).find("f32[16{batch},32] ") == std::string::npos);
  CHECK(to_string(p, 0).find("\"params/mlp/h\" = max %3, %5 : f32[16{batch},32]\n") != std::string::npos);
  CHECK(partition(mlp_forward(), mesh2x2, {}).history().empty());
}

TEST_CASE("determinism: the same input gives the same plan, byte for byte") {
  const Program prog = value_and_grad(mlp_loss(), "loss");
  const Partitioned a = partition(prog, mesh2x2, {bp, mp});
  const Partitioned b = partition(prog, mesh2x2, {bp, mp});
  CHECK(a == b);
  CHECK(to_string(a) == to_string(b));
  CHECK(explain(a, "grad/params/mlp/w1") == explain(b, "grad/params/mlp/w1"));
}

TEST_CASE("loop-carried state: an output that updates an input shares its sharding") {
  Program p("loop");
  const ValueId w = p.add_input("w", {{8, 4}}, InputKind::parameter);
  const ValueId g = p.add_input("g", {{8, 4}});
  const ValueId next = p.add(OpKind::exp, {g});
  p.add_output("w", next, "w");
  p.add_output("norm", p.add(OpKind::mul, {w, w}));
  const Partitioned a = partition(p, mesh2x2, {ManualPartition{{{"g", 0}}, "batch"}});
  CHECK(layout(a, w) == "[{batch},{}]");
  CHECK(layout(a, "norm") == "[{batch},{}]");
  CHECK(explain(a, "w") ==
        "%0 \"w\" : f32[8{batch},4]\n"
        "  w dim 0 on 'batch': from %2 dim 0 through output 'w' updates input 'w'\n"
        "    %2 dim 0 on 'batch': from g dim 0 through %2 exp\n"
        "    g dim 0 on 'batch': set by tactic 1 (tile g:0 on batch)\n");
  const Partitioned b = partition(p, mesh2x2, {ManualPartition{{{"w", 1}}, "model"}});
  CHECK(layout(b, g) == "[{},{model}]");
}

TEST_CASE("axes in a different order on one factor are a conflict") {
  // batch is kept off c, so x's dim 0 holds batch alone; model then comes from c's dim 0 with nothing before it.
  const Program prog = trace("order", [](Tensor x, Tensor c) { return tag(x + c, "z"); }, {{"x", {8, 4}}, {"c", {8, 4}}});
  const Partitioned p = partition(prog, mesh2x2, {Replicate{"c", "batch"}, ManualPartition{{{"x", 0}}, "batch"},
                                                  ManualPartition{{{"c", 0}}, "model"}});
  CHECK(layout(p, "x") == "[{batch},{}]");
  CHECK(layout(p, "c") == "[{model},{}]");
  CHECK(layout(p, "z") == "[{},{}]");
  REQUIRE(p.conflicts().size() == 2);
  CHECK(p.conflicts()[1].existing == Origin{1, 0, 0});
  CHECK(p.conflicts()[1].message ==
        "tactic 3 (tile c:0 on model): 'model' at %2 add: c dim 0 by tactic 3 (tile c:0 on model) conflicts with x "
        "dim 0 by tactic 2 (tile x:0 on batch) (axis order: 'model' would follow {batch} here but {} at the source)");
}

TEST_CASE("Replicate keeps an axis off values, and an earlier Replicate wins") {
  const Program prog = mlp_forward();
  const Partitioned p = partition(prog, mesh2x2, {Replicate{"params/mlp/h", "model"}, mp});
  const ValueId h = p.value("params/mlp/h");
  CHECK(layout(p, h) == "[{},{}]");
  CHECK(layout(p, "y") == "[{},{}]");
  CHECK(explain(p, "params/mlp/h").starts_with(
      "%6 \"params/mlp/h\" : f32[16,32]\n"
      "  params/mlp/h replicated on 'model': set by tactic 1 (replicate params/mlp/h on model)\n"
      "  conflict: tactic 2 (mp): 'model' at %7 dot_general: "));
  REQUIRE(p.conflicts().size() == 2);
  for (const auto& c : p.conflicts()) CHECK(c.existing == Origin{0, h, replicated_dim});
  CHECK(p.conflicts()[0].message ==
        "tactic 2 (mp): 'model' at %7 dot_general: params/mlp/w2 dim 0 by tactic 2 (mp) conflicts with params/mlp/h "
        "kept replicated by tactic 1 (replicate params/mlp/h on model)");

  const Partitioned q = partition(prog, mesh2x2, {mp, Replicate{"params/mlp/w*", "model"}});
  CHECK(layout(q, "params/mlp/w1") == "[{},{model}]");
  REQUIRE(q.conflicts().size() == 2);
  CHECK(q.conflicts()[0].wanted.dim == replicated_dim);
}

TEST_CASE("reshape: an axis that fits the major factor passes, one that straddles stops with the reason") {
  const Mesh mesh{{"a", 2}, {"b", 4}};
  const Program split = trace("split", [](Tensor x) { return tag(reshape(x, {2, 4, 32}), "r"); }, {{"x", {8, 32}}});
  CHECK(to_string(partition(split, mesh, {ManualPartition{{{"x", 0}}, "a"}}).sharding("r")) == "[{a},{},{}]");
  CHECK(to_string(partition(split, mesh, {ManualPartition{{{"x", 0}}, "a"}, ManualPartition{{{"x", 0}}, "b"}}).sharding("r")) == "[{a},{b},{}]");
  CHECK(to_string(partition(split, mesh, {ManualPartition{{{"r", 0}}, "a"}, ManualPartition{{{"r", 1}}, "b"}}).sharding("x")) == "[{a,b},{}]");

  // A dim of 8 tiled on an axis of 4, reshaped to 2x4: the axis would need a sub-axis of size 2 per new dim.
  const Partitioned straddle = partition(split, mesh, {ManualPartition{{{"x", 0}}, "b"}});
  CHECK(layout(straddle, "r") == "[{},{},{}]");
  REQUIRE(straddle.stops().size() == 1);
  CHECK(straddle.stops()[0].message ==
        "tactic 1 (tile x:0 on b): 'b' stops at %1 reshape (from x dim 0 by tactic 1 (tile x:0 on b)): x dim 0 {b} "
        "does not line up with the factors of ([(ij),k])->([i,j,k]) {i=2,j=4,k=32} (that needs a sub-axis)");
  CHECK(straddle.conflicts().empty());

  // Tiling the minor half of a merged dim alone would need a sub-axis too.
  const Partitioned minor = partition(split, mesh, {ManualPartition{{{"r", 1}}, "b"}});
  CHECK(layout(minor, "x") == "[{},{}]");
  REQUIRE(minor.stops().size() == 1);
  CHECK(minor.stops()[0].reason == "x dim 0 is a merged dim whose major part is not tiled (that needs a sub-axis)");

  const Program merge = trace("merge", [](Tensor x) { return tag(reshape(x, {8, 32}), "r"); }, {{"x", {2, 4, 32}}});
  CHECK(to_string(partition(merge, mesh, {ManualPartition{{{"x", 0}}, "a"}}).sharding("r")) == "[{a},{}]");
}

TEST_CASE("convolution with feature groups: the batch passes, the features stay whole (a stop says why)") {
  const Program grouped = trace(
      "grouped", [](Tensor x, Tensor w) { return tag(conv(x, w, {.feature_groups = 2}), "y"); },
      {{"x", {4, 5, 5, 6}}, {"w", {3, 3, 3, 8}}});
  const Mesh mesh{{"a", 2}};
  CHECK(layout(partition(grouped, mesh, {ManualPartition{{{"x", 0}}, "a"}}), "y") == "[{a},{},{},{}]");
  const Partitioned channels = partition(grouped, mesh, {ManualPartition{{{"w", 3}}, "a"}});
  CHECK(layout(channels, "y") == "[{},{},{},{}]");
  REQUIRE(channels.stops().size() == 1);
  CHECK(channels.stops()[0].reason ==
        "convolution: 2 feature groups: each output feature reads its group's input features");
}

TEST_CASE("gather: the table's vocab dim makes a partial sum, its feature dim passes through") {
  const Program prog = trace("emb", [](Tensor ids) {
    Tensor e = tag(nn::Embedding{"params/emb", 16, 8}(ids), "e");
    return NamedTensors{{"loss", sum(e * e)}};
  }, {{"ids", {4, 6}, DType::i32}});
  CHECK(to_string(partition(prog, mesh2x2, {ManualPartition{{{"params/emb/table", 0}}, "model"}}).sharding("e")) == "[{},{},{}] sum{model}");
  CHECK(to_string(partition(prog, mesh2x2, {ManualPartition{{{"params/emb/table", 1}}, "model"}}).sharding("e")) == "[{},{},{model}]");
  // Batch-tiled ids: the lookup is tiled alike, and the table's gradient (a scatter_add) sums over batch.
  const Partitioned p = partition(value_and_grad(prog, "loss"), mesh2x2, {ManualPartition{{{"ids", 0}}, "batch"}});
  CHECK(layout(p, "e") == "[{batch},{},{}]");
  CHECK(layout(p, "grad/params/emb/table") == "[{},{}] sum{batch}");
}

TEST_CASE("reduce_max stops on a tiled reduced dim, and partial sums pass linear ops only") {
  const Program prog = trace("lin", [](Tensor h, Tensor w, Tensor c) {
    Tensor y = matmul(h, w);
    return NamedTensors{{"scaled", y * 2.0},       {"twice", y + y},        {"square", y * y},
                        {"exp", exp(y)},           {"plus_c", y + c},       {"t", transpose(y)},
                        {"sum", sum(y, {0})},      {"neg", -y},             {"div", y / c},
                        {"over", c / y},           {"max", max(h, {1})}};
  }, {{"h", {16, 32}}, {"w", {32, 8}}, {"c", {16, 8}}});
  const Partitioned p = partition(prog, mesh2x2, {ManualPartition{{{"w", 0}}, "model"}});
  const std::string partial2 = "[{},{}] sum{model}";
  CHECK(layout(p, "scaled") == partial2);
  CHECK(layout(p, "twice") == partial2);
  CHECK(layout(p, "t") == partial2);
  CHECK(layout(p, "neg") == partial2);
  CHECK(layout(p, "div") == partial2);
  CHECK(layout(p, "sum") == "[{}] sum{model}");
  CHECK(layout(p, "square") == "[{},{}]");
  CHECK(layout(p, "exp") == "[{},{}]");
  CHECK(layout(p, "plus_c") == "[{},{}]");
  CHECK(layout(p, "over") == "[{},{}]");
  CHECK(layout(p, "max") == "[{}]");
  CHECK(layout(p, "h") == "[{},{model}]");
  REQUIRE(p.stops().size() == 1);
  CHECK(p.stops()[0].reason == "reduce_max over a tiled dim (a max of maxima is no sum)");
}

TEST_CASE("a tiling that meets a partial sum stops there: lowering reduce-scatters it") {
  const Program prog = trace("rs", [](Tensor h, Tensor w, Tensor c) { return tag(matmul(h, w) + c, "z"); },
                             {{"h", {16, 32}}, {"w", {32, 8}}, {"c", {16, 8}}});
  const Partitioned p =
      partition(prog, mesh2x2, {ManualPartition{{{"w", 0}}, "model"}, ManualPartition{{{"z", 0}}, "model"}});
  CHECK(layout(p, "z") == "[{model},{}]");
  CHECK(layout(p, "c") == "[{},{}]");  // the add is left unsharded on model
  CHECK(p.conflicts().empty());
  REQUIRE(p.stops().size() == 1);
  CHECK(p.stops()[0].reason ==
        "%3 is a partial sum over 'model' from tactic 1 (tile w:0 on model): lowering reduces it first");
  // Asking to tile the partial sum itself is a conflict with the tactic that made it one.
  const Partitioned q =
      partition(prog, mesh2x2, {ManualPartition{{{"w", 0}}, "model"}, ManualPartition{{{"h", 0}}, "model"}});
  REQUIRE(q.conflicts().size() == 1);
  CHECK(q.conflicts()[0].existing == Origin{0, 0, 1});
}

TEST_CASE("errors name the tactic and the rule it broke") {
  const Program prog = mlp_forward();
  auto run = [&](ManualPartition t) { return partition(prog, mesh2x2, {bp_x, t}); };
  CHECK_THROWS_WITH_AS(run({{{"params/*/w9", 0}}, "model"}),
                       "tactic 2 (tile params/*/w9:0 on model): selector 'params/*/w9' matches no input or tagged "
                       "value of program 'mlp'",
                       UserError);
  CHECK_THROWS_WITH_AS(run({{{"x", 0}}, "tensor"}),
                       "tactic 2 (tile x:0 on tensor): axis 'tensor' is not in mesh {batch=2,model=2}", UserError);
  CHECK_THROWS_WITH_AS(run({{{"x", 2}}, "model"}),
                       "tactic 2 (tile x:2 on model): dim 2 is out of range for x f32[16,8]", UserError);
  CHECK_THROWS_WITH_AS(run({{{"x", -3}}, "model"}),
                       "tactic 2 (tile x:-3 on model): dim -3 is out of range for x f32[16,8]", UserError);
  CHECK_THROWS_WITH_AS(partition(prog, Mesh{{"batch", 2}, {"model", 3}}, {bp_x, ManualPartition{{{"x", 0}}, "model"}}),
                       "tactic 2 (tile x:0 on model): x dim 0 (size 16) is not divisible by {batch,model} (6 tiles)",
                       UserError);
  CHECK_THROWS_WITH_AS(run({{{"params/mlp/w1", 0}, {"params/mlp/*", 1}}, "model", "mixed"}),
                       "tactic 2 (mixed): conflicting requests for params/mlp/w1 on 'model': dim 0 and dim 1",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {Replicate{"nothing", "model"}}),
                       "tactic 1 (replicate nothing on model): selector 'nothing' matches no input or tagged value of "
                       "program 'mlp'",
                       UserError);
}

TEST_CASE("tactics are values: names, equality, a Schedule of mixed kinds") {
  const Schedule s{bp, Replicate{"params/**", "batch"}, mp};
  CHECK(s[0].name() == "bp");
  CHECK(s[1].name() == "replicate params/** on batch");
  CHECK(ManualPartition{{{"x", 0}, {"y", 1}}, "batch"}.name() == "tile x:0,y:1 on batch");
  CHECK(s[0] == Tactic(bp));
  CHECK(!(s[0] == s[2]));
  CHECK(!(s[0] == s[1]));
  REQUIRE(s[2].as<ManualPartition>());
  CHECK(s[2].as<ManualPartition>()->axis == "model");
  CHECK(s[1].as<ManualPartition>() == nullptr);
}

TEST_CASE("printer and explain: golden text") {
  const Partitioned p = partition(mlp_forward(), mesh2x2, {bp_x, mp});
  CHECK(to_string(p) == R"(program mlp on {batch=2,model=2} {
  %0 "x" = input {data} : f32[16{batch},8]
  %1 "params/mlp/w1" = input {parameter, init=normal(0.1)} : f32[8,32{model}]
  %2 "params/mlp/w2" = input {parameter, init=normal(0.1)} : f32[32{model},8]
  %3 = dot_general %0, %1 {contract=[1]x[0]} : f32[16{batch},32{model}]
  %4 = constant {value=0} : f32[]
  %5 = broadcast_in_dim %4 {dims=[]} : f32[16{batch},32{model}]
  %6 "params/mlp/h" = max %3, %5 : f32[16{batch},32{model}]
  %7 "y" = dot_general %6, %2 {contract=[1]x[0]} : f32[16{batch},8] sum{model}
  output "y" = %7
}
)");
  CHECK(explain(p, "y") == R"(%7 "y" : f32[16{batch},8] sum{model}
  y dim 0 on 'batch': from params/mlp/h dim 0 through %7 dot_general
    params/mlp/h dim 0 on 'batch': from %3 dim 0 through %6 max
    %3 dim 0 on 'batch': from x dim 0 through %3 dot_general
    x dim 0 on 'batch': set by tactic 1 (bp)
  y partial sum over 'model': from params/mlp/w2 dim 0 through %7 dot_general
    params/mlp/w2 dim 0 on 'model': set by tactic 2 (mp)
)");
  CHECK(explain(p, "params/mlp/w1") == R"(%1 "params/mlp/w1" : f32[8,32{model}]
  params/mlp/w1 dim 1 on 'model': set by tactic 2 (mp)
)");

  // Conflicts show in the plan and in the explanation of the values they involve.
  const Partitioned q = partition(mlp_forward(), mesh2x2, {mp, ManualPartition{{{"x", 1}}, "model", "bad"}});
  const std::string conflict =
      "conflict: tactic 2 (bad): 'model' at %3 dot_general: x dim 1 by tactic 2 (bad) conflicts with params/mlp/w1 "
      "dim 1 by tactic 1 (mp)\n";
  CHECK(to_string(q).ends_with("  output \"y\" = %7\n  " + conflict + "}\n"));
  CHECK(explain(q, "x") == "%0 \"x\" : f32[16,8{model}]\n"
                           "  x dim 1 on 'model': set by tactic 2 (bad)\n  " + conflict);

  // Two axes on one dim, major to minor in tactic order, carried alike through every op.
  const Partitioned r = partition(mlp_forward(), mesh2x2, {mp, ManualPartition{{{"params/mlp/h", 1}}, "batch"}});
  CHECK(r.typed(r.value("params/mlp/w2")) == "f32[32{model,batch},8]");
  CHECK(r.typed(r.value("y")) == "f32[16,8] sum{batch,model}");
}

TEST_CASE("viz: which devices hold which tile") {
  CHECK(visualize(TensorType{{8, 4}}, sh({{"batch"}, {"model"}}), mesh2x2) == R"(f32[8{batch},4{model}] on {batch=2,model=2}
+-----+-----+-----+
|     | 0:2 | 2:4 |
+-----+-----+-----+
| 0:4 | 0   | 1   |
| 4:8 | 2   | 3   |
+-----+-----+-----+
)");
  CHECK(visualize(TensorType{{8, 4}}, sh({{"model"}, {}}, {"batch"}), mesh2x2) == R"(f32[8{model},4] sum{batch} on {batch=2,model=2}
+-----+-----+
|     | 0:4 |
+-----+-----+
| 0:4 | 0,2 |
| 4:8 | 1,3 |
+-----+-----+
each cell holds partial sums: the value is their sum over {batch}
)");
  // Major to minor: tile p of {model,batch} sits at model = p / 2, batch = p % 2.
  CHECK(visualize(TensorType{{8}}, sh({{"model", "batch"}}), mesh2x2) == R"(f32[8{model,batch}] on {batch=2,model=2}
+-----+---+
|     |   |
+-----+---+
| 0:2 | 0 |
| 2:4 | 2 |
| 4:6 | 1 |
| 6:8 | 3 |
+-----+---+
)");
  const Partitioned p = partition(mlp_forward(), mesh2x2, {bp_x, mp});
  CHECK(visualize(p, "params/mlp/w2").starts_with("f32[32{model},8] on {batch=2,model=2}\n"));
  CHECK_THROWS_WITH_AS(visualize(TensorType{{2, 2, 2}}, Sharding::replicated(3), mesh2x2),
                       "visualize: f32[2,2,2] has rank 3; only values of rank 0, 1 or 2 can be drawn", UserError);
}
