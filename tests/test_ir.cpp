// IR, DSL and printer: types, verifier diagnostics, golden text.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

using namespace partir;

namespace {
Program mlp_program() {
  return trace("mlp", [](Tensor x, Tensor y) {
    nn::Mlp mlp{"params/mlp", {4, 8, 2}};
    return NamedTensors{{"loss", mse(mlp(x), y)}};
  }, {{"x", {16, 4}}, {"y", {16, 2}}});
}
}  // namespace

TEST_CASE("ir: builder infers dot_general type") {
  Program p("t");
  auto x = p.add_input("x", {{8, 4}});
  auto w = p.add_input("w", {{4, 16}}, InputKind::parameter);
  Attrs a;
  a.dot.lhs_contract = {1};
  a.dot.rhs_contract = {0};
  auto y = p.add(OpKind::dot_general, {x, w}, a);
  CHECK(p.type(y) == TensorType{{8, 16}, DType::f32});
  p.add_output("y", y);
  verify(p);
}

TEST_CASE("printer: golden text of a traced MLP") {
  const char* golden = R"(program mlp {
  %0 "x" = input {data} : f32[16,4]
  %1 "y" = input {data} : f32[16,2]
  %2 "params/mlp/w1" = input {parameter, init=normal(0.5)} : f32[4,8]
  %3 = dot_general %0, %2 {contract=[1]x[0]} : f32[16,8]
  %4 "params/mlp/b1" = input {parameter, init=zeros} : f32[8]
  %5 = broadcast_in_dim %4 {dims=[1]} : f32[16,8]
  %6 = add %3, %5 : f32[16,8]
  %7 = constant {value=0} : f32[]
  %8 = broadcast_in_dim %7 {dims=[]} : f32[16,8]
  %9 "params/mlp/h1" = max %6, %8 : f32[16,8]
  %10 "params/mlp/w2" = input {parameter, init=normal(0.353553391)} : f32[8,2]
  %11 = dot_general %9, %10 {contract=[1]x[0]} : f32[16,2]
  %12 "params/mlp/b2" = input {parameter, init=zeros} : f32[2]
  %13 = broadcast_in_dim %12 {dims=[1]} : f32[16,2]
  %14 = add %11, %13 : f32[16,2]
  %15 = sub %14, %1 : f32[16,2]
  %16 = mul %15, %15 : f32[16,2]
  %17 = reduce_sum %16 {dims=[0,1]} : f32[]
  %18 = constant {value=0.03125} : f32[]
  %19 = mul %17, %18 : f32[]
  output "loss" = %19
}
)";
  CHECK(to_string(mlp_program()) == golden);
}

TEST_CASE("printer: every attribute form") {
  Program p = trace("attrs", [](Tensor x, Tensor ids) {
    Tensor t = transpose(x, {1, 0});
    Tensor s = slice(t, {0, 1}, {3, 4});
    Tensor q = pad(s, {1, 0}, {0, 2});
    Tensor c = concatenate({q, q}, 0);
    Tensor m = compare(c, c, CompareDir::lt);
    Tensor g = gather(x, ids);
    Tensor b = dot_general(x, x, {{1}, {1}, {0}, {0}});
    Tensor image = reshape(x, {1, 4, 3});
    Tensor kernel = reshape(x, {2, 3, 2});
    Tensor v = conv_general(image, kernel, {{2}, {1}, {1}, true}, {1}, {-1});
    Tensor pooled = reduce_window(x, OpKind::reduce_window_sum, {{2, 1}, {2, 1}, {1, 1}, {1, 1}}, {0, 0}, {0, 0});
    return NamedTensors{{"m", m}, {"g", g}, {"b", b}, {"v", v}, {"pooled", pooled}, {"k", constant(x.program(), {1, 2}, {2})}};
  }, {{"x", {4, 3}}, {"ids", {2}, DType::i32}});
  const std::string text = to_string(p);
  CHECK(text.find("transpose %0 {perm=[1,0]} : f32[3,4]") != std::string::npos);
  CHECK(text.find("slice %2 {start=[0,1], limit=[3,4]} : f32[3,3]") != std::string::npos);
  CHECK(text.find("pad %3 {low=[1,0], high=[0,2]} : f32[4,5]") != std::string::npos);
  CHECK(text.find("concatenate %4, %4 {axis=0} : f32[8,5]") != std::string::npos);
  CHECK(text.find("compare %5, %5 {lt} : f32[8,5]") != std::string::npos);
  CHECK(text.find("gather %0, %1 : f32[2,3]") != std::string::npos);
  CHECK(text.find("dot_general %0, %0 {batch=[1]x[1], contract=[0]x[0]} : f32[3]") != std::string::npos);
  CHECK(text.find("constant {values=[1,2]} : f32[2]") != std::string::npos);
  CHECK(text.find("convolution %9, %10 {strides=[2], low=[1], high=[-1], lhs_dilation=[1], rhs_dilation=[1], flip} : "
                  "f32[1,2,2]") != std::string::npos);
  CHECK(text.find("reduce_window_sum %0 {window=[2,1], strides=[2,1], low=[0,0], high=[0,0], base_dilation=[1,1], "
                  "window_dilation=[1,1]} : f32[2,3]") != std::string::npos);
}

TEST_CASE("verifier: rejects a stored type that differs from the inferred one") {
  Program p("bad");
  auto x = p.add_input("x", {{2, 3}});
  p.add_unchecked(Op{OpKind::neg, {x}, {}, {{3, 2}, DType::f32}, ""});
  CHECK_THROWS_WITH_AS(verify(p),
                       "verify bad: op %1 (neg): result type f32[3,2] differs from the inferred f32[2,3]", UserError);
}

TEST_CASE("verifier: rejects use before definition") {
  Program p("bad");
  p.add_input("x", {{2}});
  p.add_unchecked(Op{OpKind::add, {0, 2}, {}, {{2}, DType::f32}, ""});
  p.add_unchecked(Op{OpKind::neg, {0}, {}, {{2}, DType::f32}, ""});
  CHECK_THROWS_WITH_AS(verify(p), "verify bad: op %1 (add) uses %2 before it is defined", UserError);
}

TEST_CASE("verifier: wraps shape errors with the op") {
  Program p("bad");
  auto a = p.add_input("a", {{2, 3}});
  auto b = p.add_input("b", {{3, 2}});
  p.add_unchecked(Op{OpKind::add, {a, b}, {}, {{2, 3}, DType::f32}, ""});
  CHECK_THROWS_WITH_AS(verify(p), "verify bad: op %2 (add): add: operand types differ: f32[2,3] vs f32[3,2]",
                       UserError);
}

TEST_CASE("verifier: loop-carried output must match its input") {
  Program p("bad");
  auto w = p.add_input("w", {{2}}, InputKind::parameter);
  auto s = p.add(OpKind::reduce_sum, {w}, [] { Attrs a; a.dims = {0}; return a; }());
  CHECK_THROWS_WITH_AS(p.add_output("w", s, "w"), "output 'w' f32[] cannot update input 'w' f32[2]", UserError);
  CHECK_THROWS_WITH_AS(p.add_output("w", w, "nope"), "output 'w' updates unknown input 'nope'", UserError);
}

TEST_CASE("shape errors name the op and both shapes") {
  auto run = [](auto fn) { trace("t", fn, {{"a", {8, 4}}, {"b", {5, 16}}}); };
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor b) { return matmul(a, b); }),
                       "matmul: cannot multiply f32[8,4] by f32[5,16]: inner dims 4 and 5 differ", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor b) { return a + b; }),
                       "add: shapes [8,4] and [5,16] do not broadcast (dim 0: 8 vs 5)", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor) { return reshape(a, {3, 3}); }),
                       "reshape: cannot reshape f32[8,4] to [3,3]: element counts differ", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor) { return sum(a, {2}); }),
                       "reduce_sum: dim 2 is out of range for rank 2", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor) { return transpose(a, {0, 0}); }),
                       "transpose: permutation dim 0 appears twice", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor) { return slice(a, {0, 0}, {9, 4}); }),
                       "slice: bounds [0, 9) of dim 0 are outside f32[8,4]", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor) { return gather(a, a); }),
                       "gather: indices must be i32, got f32[8,4]", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor b) { return concatenate({a, b}, 0); }),
                       "concatenate: operand 1 f32[5,16] does not fit f32[8,4] along axis 0", UserError);
  CHECK_THROWS_WITH_AS(run([](Tensor a, Tensor) {
                         Tensor w = param("w", {4}, zeros_init());
                         return w + param("w", {5}, zeros_init()) + a;
                       }),
                       "param 'w': declared as f32[4], used again as f32[5]", UserError);
  CHECK_THROWS_WITH_AS(param("w", {4}, zeros_init()),
                       "param 'w': called outside partir::trace (no program is being traced)", UserError);
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor a) { return a; }, {{"a", {1}}, {"b", {1}}}),
                       "trace: the function takes 1 tensors but 2 inputs were given", UserError);
}

TEST_CASE("dsl: numpy broadcasting and matmul batch dims") {
  Program p = trace("b", [](Tensor a, Tensor b, Tensor c) {
    return NamedTensors{{"s", a + c}, {"m", matmul(a, b)}, {"k", a * 2.0}};
  }, {{"a", {3, 2, 4}}, {"b", {3, 4, 5}}, {"c", {2, 1}}});
  CHECK(p.type(p.output("s")) == TensorType{{3, 2, 4}, DType::f32});
  CHECK(p.type(p.output("m")) == TensorType{{3, 2, 5}, DType::f32});
  const auto& dot = p.op(p.output("m")).attrs.dot;
  CHECK(dot.lhs_batch == std::vector<std::int64_t>{0});
  CHECK(dot.lhs_contract == std::vector<std::int64_t>{2});
  CHECK(dot.rhs_contract == std::vector<std::int64_t>{1});
}

TEST_CASE("dsl: parameters are shared by name and tags name intermediates") {
  Program p = mlp_program();
  CHECK(p.inputs().size() == 6);
  CHECK(p.op(p.input("params/mlp/w1")).attrs.input_kind == InputKind::parameter);
  bool tagged = false;
  for (const auto& op : p.ops()) tagged |= op.name == "params/mlp/h1";
  CHECK(tagged);
}
