// The bad-input catalog: one check per misuse a user can make, across the DSL, the IR, meshes, tactics,
// lowering and the runtime. Each checks the exact message and the exception type (UserError for the
// caller's mistakes; InternalError is reserved for partir's own bugs). Numbered E01.. so the catalog in
// docs and issue notes can point at them.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

#include "../examples/training_loop.hpp"  // the examples' backend choice

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

using namespace partir;

namespace {

// x [16, 8] -> relu(x @ w1 + b1) @ w2 + b2, w1 [8, 32], w2 [32, 8].
Program mlp() {
  nn::Mlp model{"params/mlp", {8, 32, 8}};
  return trace("mlp", [&](Tensor x) { return model(x); }, {{"x", {16, 8}}});
}

Program adam_step() {
  nn::Mlp model{"params/mlp", {8, 32, 8}};
  return train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{1e-2},
                    {{"x", {16, 8}}, {"y", {16, 8}}});
}

template <class F>
Program trace2(F f, Shape a = {4, 6}, Shape b = {6, 4}) {
  return trace("bad", f, {{"a", std::move(a)}, {"b", std::move(b)}});
}

NamedArrays inputs_of(const Program& p) { return init_inputs(p, 0, true); }

const Mesh mesh2x2{{"batch", 2}, {"model", 2}};

}  // namespace

TEST_CASE("catalog: DSL and tracing") {
  // E01 shape mismatch in matmul
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return matmul(a, a); }),
                       "matmul: cannot multiply f32[4,6] by f32[4,6]: inner dims 6 and 4 differ", UserError);
  // E02 elementwise shapes that do not broadcast
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor b) { return a + b; }),
                       "add: shapes [4,6] and [6,4] do not broadcast (dim 0: 4 vs 6)", UserError);
  // E03 dtype mismatch
  CHECK_THROWS_WITH_AS(trace("bad", [](Tensor a, Tensor b) { return a + b; }, {{"a", {2}}, {"b", {2}, DType::f64}}),
                       "add: dtypes differ: f32[2] vs f64[2] (partir never promotes implicitly: convert() one operand)",
                       UserError);
  CHECK_THROWS_WITH_AS(trace("bad", [](Tensor a, Tensor b) { return a * b; }, {{"a", {2}, DType::bf16}, {"b", {2}}}),
                       "mul: dtypes differ: bf16[2] vs f32[2] (partir never promotes implicitly: convert() one operand)",
                       UserError);
  // E04 reshape to a different element count
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return reshape(a, {5, 5}); }),
                       "reshape: cannot reshape f32[4,6] to [5,5]: element counts differ", UserError);
  // E05 two inferred dims in a reshape
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return reshape(a, {-1, -1}); }),
                       "reshape: only one dim of [-1,-1] may be -1", UserError);
  // E06 reduction over a dim the tensor lacks
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return sum(a, {2}); }),
                       "reduce_sum: dim 2 is out of range for rank 2", UserError);
  // E07 transpose with a repeated dim
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return transpose(a, {1, 1}); }),
                       "transpose: permutation dim 1 appears twice", UserError);
  // E08 slice past the end
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return slice(a, {0, 0}, {5, 6}); }),
                       "slice: bounds [0, 5) of dim 0 are outside f32[4,6]", UserError);
  // E09 concatenate along an axis whose other dims disagree
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor b) { return concatenate({a, b}, 0); }),
                       "concatenate: operand 1 f32[6,4] does not fit f32[4,6] along axis 0", UserError);
  // E10 gather with float indices
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor b) { return gather(a, b); }),
                       "gather: indices must be i32, got f32[6,4]", UserError);
  // E11 tensor dim out of range (was std::out_of_range from vector::at)
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return full_like(a, a.dim(2)); }),
                       "Tensor f32[4,6]: dim 2 is out of range for rank 2", UserError);
  // E12 an op outside any trace
  CHECK_THROWS_WITH_AS(input("x", {2}), "input 'x': called outside partir::trace (no program is being traced)",
                       UserError);
  // E13 tensors of two traces mixed
  {
    Program other("other");
    Tensor stray(other, other.add_input("s", {{4, 6}}));
    CHECK_THROWS_WITH_AS(trace2([&](Tensor a, Tensor) { return a + stray; }),
                         "add: operands belong to different programs (tensors from two traces were mixed)", UserError);
  }
  // E14 the function's arity differs from the inputs given
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor a) { return a; }, {{"a", {1}}, {"b", {1}}}),
                       "trace: the function takes 1 tensors but 2 inputs were given", UserError);
  // E15 the same parameter name with two shapes
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor a) {
                               Tensor w = param("w", {4}, zeros_init());
                               return a * w + param("w", {2}, zeros_init());
                             },
                             {{"a", {4}}}),
                       "param 'w': declared as f32[4], used again as f32[2]", UserError);
  // E16 two inputs with one name
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor a, Tensor b) { return a + b; }, {{"a", {1}}, {"a", {1}}}),
                       "input 'a' is declared twice in program 't'", UserError);
  // E17 a layer fed the wrong feature count
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor x) { return nn::Linear{"params/l", 5, 3}(x); }, {{"x", {2, 4}}}),
                       "dense 'params/l/w': input f32[2,4] has 4 features, the layer expects 5", UserError);
  // E18 cross_entropy with float labels
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor l, Tensor y) { return cross_entropy(l, y); }, {{"l", {2, 3}}, {"y", {2}}}),
                       "cross_entropy: labels must be i32 class indices, got f32[2]", UserError);
  // E19 mse of different shapes
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor a, Tensor b) { return mse(a, b); }, {{"a", {2, 3}}, {"b", {3, 2}}}),
                       "mse: prediction f32[2,3] and target f32[3,2] differ in shape", UserError);
  // E20 unary math on integers
  CHECK_THROWS_WITH_AS(trace("t", [](Tensor a) { return exp(a); }, {{"a", {2}, DType::i32}}),
                       "exp: needs a floating-point operand, got i32[2]", UserError);
  // E21 an Array with the wrong number of values
  CHECK_THROWS_WITH_AS(Array({2, 2}, std::vector<float>{1, 2, 3}), "Array: 3 values for shape [2,2]", UserError);
  // E22 an unknown dtype name
  CHECK_THROWS_WITH_AS(parse_dtype("fp8"), "unknown dtype 'fp8' (expected f32, f64, i32, bf16 or f16)", UserError);
}

TEST_CASE("catalog: autodiff") {
  nn::Mlp model{"params/mlp", {8, 8}};
  // E23 a non-scalar loss
  CHECK_THROWS_WITH_AS(train_step([&](Tensor x) { return model(x); }, SGD{0.1}, {{"x", {4, 8}}}),
                       "train_step 'train_step': the loss must be a scalar floating-point value, got f32[4,8]",
                       UserError);
  // E24 a loss without parameters
  CHECK_THROWS_WITH_AS(train_step([&](Tensor x) { return sum(x); }, SGD{0.1}, {{"x", {4, 8}}}),
                       "train_step 'train_step': the loss function declares no parameters (see param() and nn)",
                       UserError);
  // E25 value_and_grad of an output that does not exist
  CHECK_THROWS_WITH_AS(value_and_grad(mlp(), "loss"), "value_and_grad: program 'mlp' has no output named 'loss'",
                       UserError);
}

TEST_CASE("catalog: meshes and shardings") {
  // E26 axis named twice
  CHECK_THROWS_WITH_AS(Mesh({{"a", 2}, {"a", 2}}), "mesh {a=2,a=2}: axis 'a' appears twice", UserError);
  // E27 axis of size 0
  CHECK_THROWS_WITH_AS(Mesh({{"a", 0}}), "mesh {a=0}: axis 'a' has size 0 (must be at least 1)", UserError);
  // E28 unparsable mesh text
  CHECK_THROWS_WITH_AS(Mesh::parse("batch=2,model"),
                       "mesh 'batch=2,model': expected axes as name=size separated by commas, got 'model'", UserError);
  // E29 axis not in the mesh
  CHECK_THROWS_WITH_AS(mesh2x2.axis_index("foo"), "axis 'foo' is not in mesh {batch=2,model=2}", UserError);
  // E30 device out of range
  CHECK_THROWS_WITH_AS(mesh2x2.coordinates(4), "mesh {batch=2,model=2}: device 4 is out of range (4 devices)",
                       UserError);
  const TensorType t{{6, 4}};
  // E31 an axis reused on two dims of one value
  CHECK_THROWS_WITH_AS(validate(Sharding{{{"batch"}, {"batch"}}, {}}, t, mesh2x2, "x"),
                       "sharding of 'x' f32[6,4]: axis 'batch' is used twice", UserError);
  // E32 a dim not divisible by its axes
  CHECK_THROWS_WITH_AS(validate(Sharding{{{"batch", "model"}, {}}, {}}, t, mesh2x2, "x"),
                       "sharding of 'x' f32[6,4]: dim 0 (size 6) is not divisible by {batch,model} (4 tiles)",
                       UserError);
  // E33 a sharding of the wrong rank
  CHECK_THROWS_WITH_AS(validate(Sharding{{{}}, {}}, t, mesh2x2, "x"), "sharding of 'x' f32[6,4]: 1 dims given for rank 2",
                       UserError);
}

TEST_CASE("catalog: tactics and schedules") {
  const Program prog = mlp();
  const Tactic bp = ManualPartition{{{"x", 0}}, "batch"};
  // E34 unknown selector
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {ManualPartition{{{"params/*/w9", 0}}, "model"}}),
                       "tactic 1 (tile params/*/w9:0 on model): selector 'params/*/w9' matches no input or tagged "
                       "value of program 'mlp'",
                       UserError);
  // E35 axis not in the mesh
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {bp, ManualPartition{{{"x", 1}}, "tensor"}}),
                       "tactic 2 (tile x:1 on tensor): axis 'tensor' is not in mesh {batch=2,model=2}", UserError);
  // E36 dim out of range
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {ManualPartition{{{"x", 2}}, "model"}}),
                       "tactic 1 (tile x:2 on model): dim 2 is out of range for x f32[16,8]", UserError);
  // E37 non-divisible dim
  CHECK_THROWS_WITH_AS(partition(prog, Mesh{{"model", 3}}, {ManualPartition{{{"x", 0}}, "model"}}),
                       "tactic 1 (tile x:0 on model): x dim 0 (size 16) is not divisible by {model} (3 tiles)",
                       UserError);
  // E38 one tactic asks for two dims of one value on one axis
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {ManualPartition{{{"x", 0}, {"x", 1}}, "model"}}),
                       "tactic 1 (tile x:0,x:1 on model): conflicting requests for x on 'model': dim 0 and dim 1",
                       UserError);
  // E39 Replicate with an unknown selector
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {Replicate{"nothing", "model"}}),
                       "tactic 1 (replicate nothing on model): selector 'nothing' matches no input or tagged value "
                       "of program 'mlp'",
                       UserError);
  // E40 an axis reused by a later tactic is a recorded conflict, not a silent override
  {
    const Partitioned p = partition(prog, mesh2x2, {bp, ManualPartition{{{"x", 1}}, "batch"}});
    CHECK(p.sharding("x") == Sharding{{{"batch"}, {}}, {}});
    CHECK(p.conflicts().size() == 1);
  }
  // E41 ZeRO on a program that is not a training step
  CHECK_THROWS_WITH_AS(partition(prog, mesh2x2, {zero2("batch")}),
                       "tactic 1 (zero2(batch)): program 'mlp' has no optimizer state or parameter update divisible by "
                       "axis 'batch' (ZeRO shards a training step's optimizer state: partition a train_step)",
                       UserError);
  // E42 Megatron on a model without Megatron names
  {
    const Program lin = trace("lin", [](Tensor x) { return nn::Linear{"params/l", 8, 8}(x); }, {{"x", {4, 8}}});
    CHECK_THROWS_WITH_AS(partition(lin, mesh2x2, {megatron("model")}),
                         "tactic 1 (megatron(model)): no parameter of 'lin' has a Megatron name (params/**/w1, w2, "
                         "wq, wk, wv, wo, or Llama's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)",
                         UserError);
  }
  // E43 data parallelism on a program without data inputs
  {
    const Program noin = trace("noin", [](const std::vector<Tensor>&) { return param("w", {4}, zeros_init()) * 2.0; }, {});
    CHECK_THROWS_WITH_AS(partition(noin, mesh2x2, {data_parallel("batch")}),
                         "tactic 1 (bp(batch)): program 'noin' has no data input to tile", UserError);
    // spatial partitioning of a program without images
    CHECK_THROWS_WITH_AS(partition(mlp(), mesh2x2, {spatial("model")}),
                         "tactic 1 (sp(model)): program 'mlp' has no data input with spatial dims ([batch, spatial..., "
                         "features], rank >= 3) to tile",
                         UserError);
  }
  // E44 an unknown preset name
  CHECK_THROWS_WITH_AS(parse_schedule("bp,tp"),
                       "schedule 'bp,tp': unknown tactic 'tp' (expected none, bp, mp, z2, z3, emb, mq, ep, sp, pp, pp:gpipe, "
                       "pp:interleaved:<v>, pp:zb1, pp:zbv, auto:<axis>)", UserError);
  // E45 explain() of a name the program lacks
  CHECK_THROWS_WITH_AS(explain(partition(prog, mesh2x2, {bp}), "params/mlp/w7"),
                       "partitioned program 'mlp' has no input, tag or output named 'params/mlp/w7'", UserError);
}

TEST_CASE("catalog: runtime") {
  const Program step = adam_step();
  const SpmdProgram spmd = lower(partition(step, mesh2x2, {data_parallel("batch"), megatron("model")}));
  NamedArrays good = inputs_of(step);
  // E46 mesh size different from the number of devices
  CHECK_THROWS_WITH_AS(threads::run(3, [&](threads::Communicator& c) { execute(spmd, c, good); }),
                       "execute train_step (device 0): mesh {batch=2,model=2} has 4 devices but the communicator has 3",
                       UserError);
  // E47 wrong input shape
  {
    NamedArrays bad = good;
    bad.at("x") = Array(TensorType{{16, 9}});
    CHECK_THROWS_WITH_AS(execute_on_threads(spmd, bad),
                         "execute train_step (device 0): input 'x' expects f32[16,8], got f32[16,9]", UserError);
  }
  // E48 wrong input dtype
  {
    NamedArrays bad = good;
    bad.at("x") = Array(TensorType{{16, 8}, DType::f64});
    CHECK_THROWS_WITH_AS(execute_on_threads(spmd, bad),
                         "execute train_step (device 0): input 'x' expects f32[16,8], got f64[16,8]", UserError);
  }
  // E49 missing input
  {
    NamedArrays bad = good;
    bad.erase("y");
    CHECK_THROWS_WITH_AS(execute_on_threads(spmd, bad), "execute train_step (device 0): missing input 'y'", UserError);
  }
  // E50 an input the program does not have
  {
    NamedArrays bad = good;
    bad.emplace("z", Array(TensorType{{1}}));
    CHECK_THROWS_WITH_AS(execute_on_threads(spmd, bad), "execute train_step (device 0): no input named 'z'", UserError);
  }
  // E51 a local piece of the wrong (global) shape
  CHECK_THROWS_WITH_AS(execute_on_threads(spmd, good, {.global_inputs = false}),
                       "execute train_step (device 0): input 'x' expects f32[8,8] (local piece), got f32[16,8]",
                       UserError);
  // E52 NaN in an input with check_finite on; E53 Inf likewise; off by default (NaN flows through)
  {
    NamedArrays bad = good;
    bad.at("x").set(5, std::numeric_limits<double>::quiet_NaN());
    CHECK_THROWS_WITH_AS(execute_on_threads(spmd, bad, {.check_finite = true}),
                         "execute train_step (device 0): input 'x' f32[16,8] has a non-finite value (nan) at element 5 "
                         "(check_finite)",
                         UserError);
    CHECK(std::isnan(execute_on_threads(spmd, bad)[0].outputs.at("loss").at(0)));
    bad = good;
    bad.at("params/mlp/w2").set(3, -std::numeric_limits<double>::infinity());
    CHECK_THROWS_WITH_AS(execute_on_threads(spmd, bad, {.check_finite = true}),
                         "execute train_step (device 0): input 'params/mlp/w2' f32[32,8] has a non-finite value (-inf) "
                         "at element 3 (check_finite)",
                         UserError);
  }
  // E54 interpret with a wrong input shape
  CHECK_THROWS_WITH_AS(interpret(mlp(), NamedArrays{{"x", Array(TensorType{{16, 7}})}}),
                       "interpret mlp: input 'x' expects f32[16,8], got f32[16,7]", UserError);
  // E55 an embedding index out of range, single device and with the table's rows sharded (where each device
  // used to skip the rows it does not hold, so a bad index silently read zeros)
  {
    nn::Embedding emb{"params/emb", 8, 4};
    const Program lookup = trace("lookup", [&](Tensor ids) { return emb(ids); }, {{"ids", {4}, DType::i32}});
    NamedArrays in = inputs_of(lookup);
    in.at("ids") = Array({4}, std::vector<std::int32_t>{0, 3, 9, 1});
    CHECK_THROWS_WITH_AS(interpret(lookup, in),
                         "interpret lookup: %2: gather: index 9 is out of range [0, 8) of table f32[8,4]", UserError);
    const SpmdProgram rows = lower(partition(lookup, Mesh{{"model", 2}}, {embedding("model")}));
    CHECK_THROWS_WITH_AS(execute_on_threads(rows, in),
                         "execute lookup (device 0): %2: gather: index 9 is out of range [0, 8) of table f32[8,4]", UserError);
  }
  // E56 carry_state with a step output missing
  {
    NamedArrays state = good;
    CHECK_THROWS_WITH_AS(carry_state(step, state, {}), "carry_state: output 'params/mlp/w1' is missing", UserError);
  }
  // E57 a threads world of no devices
  CHECK_THROWS_WITH_AS(threads::World(0), "threads::World: needs at least 1 device, got 0", UserError);
  // E58 one device failing does not hang the others in a collective: its error is the one reported
  CHECK_THROWS_WITH_AS(threads::run(4, [&](threads::Communicator& c) {
                         NamedArrays mine = good;
                         if (c.device() == 2) mine.at("x") = Array(TensorType{{16, 9}});
                         execute(spmd, c, mine);
                       }),
                       "execute train_step (device 2): input 'x' expects f32[16,8], got f32[16,9]", UserError);
}

TEST_CASE("catalog: shapes that used to crash, and run-time setup") {
  // E59 reshape to negative dims whose product matches (was accepted, then a negative-size buffer)
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return reshape(a, {-2, -12}); }),
                       "reshape: dim 0 of [-2,-12] is negative (only -1, inferred from the rest, is allowed)",
                       UserError);
  // E60 the same through the IR builder
  {
    Program p("ir");
    const ValueId x = p.add_input("x", {{4, 6}});
    Attrs a;
    a.shape = {-4, -6};
    CHECK_THROWS_WITH_AS(p.add(OpKind::reshape, {x}, a), "reshape: negative dimension in shape [-4,-6]", UserError);
  }
  // E61 iota along a dim the shape lacks (was std::out_of_range)
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return a + iota(a.program(), {4, 6}, 2); }),
                       "iota: dim 2 is out of range for shape [4,6]", UserError);
  // E62 an Array of negative size (was a length_error from the allocator)
  CHECK_THROWS_WITH_AS(Array(TensorType{{2, -1}}), "Array: negative dimension in shape [2,-1]", UserError);
  // E63 softmax over an axis the tensor lacks
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return softmax(a, 2); }),
                       "reduce_max: dim 2 is out of range for rank 2", UserError);
  // E64 a constant with the wrong number of values
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return a + constant(a.program(), {1, 2, 3}, {4, 6}); }),
                       "constant: literal has 3 values for shape [4,6]", UserError);
  // E65 broadcast to an incompatible shape
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return broadcast_to(a, {4, 5}); }),
                       "broadcast: cannot broadcast f32[4,6] to [4,5]", UserError);
  // E66 tagging an input
  CHECK_THROWS_WITH_AS(trace2([](Tensor a, Tensor) { return tag(a, "h"); }), "tag 'h': input 'a' already has a name",
                       UserError);
  // E67 value_and_grad with respect to an input the program lacks
  CHECK_THROWS_WITH_AS(value_and_grad(adam_step(), "loss", {"params/none"}),
                       "value_and_grad: program 'train_step' has no input named 'params/none'", UserError);
  // E68 an empty mesh description
  CHECK_THROWS_WITH_AS(Mesh::parse(""), "mesh '': expected axes as name=size separated by commas, got ''", UserError);
  // E69 a hardware profile file that does not exist
  CHECK_THROWS_WITH_AS(HardwareProfile::load("/nonexistent/profile.json"),
                       "hardware profile /nonexistent/profile.json: cannot open '/nonexistent/profile.json' for reading",
                       UserError);
  // E70 the MPI backend asked of a build without MPI, and an unknown backend (the examples' --backend)
  int argc = 0;
  char** argv = nullptr;
  auto nothing = [](auto&) {};
  CHECK_THROWS_WITH_AS(examples::run_on_backend("mpi", 2, argc, argv, nothing),
                       "--backend mpi: this build has no MPI (configure with -Dmpi=enabled)", UserError);
  CHECK_THROWS_WITH_AS(examples::run_on_backend("gpu", 2, argc, argv, nothing),
                       "--backend: expected threads, mpi or nccl, got 'gpu'", UserError);
}

TEST_CASE("catalog: GEMM engines") {
  // E78 an unknown PARTIR_GEMM value names the choices and what this build has
  CHECK_THROWS_WITH_AS(parse_gemm_engine("mkl"),
                       ("PARTIR_GEMM=mkl: unknown GEMM engine (choices: onednn, blas, eigen; built in: " +
                        gemm_engines_built_in() + ")").c_str(),
                       UserError);
  // E79 an engine this build lacks (a -Dgemm=eigen build is checked by tests/consumer; here every one may be in)
  for (GemmEngine e : all_gemm_engines)
    if (!built_in(e)) {
      const std::string name(name_of(e));
      CHECK_THROWS_WITH_AS(set_gemm_engine(e),
                           ("set_gemm_engine=" + name + ": this build has no " + name + " GEMM engine (built in: " +
                            gemm_engines_built_in() + "; Meson -Dgemm=" + (name == "blas" ? "openblas" : name) +
                            " builds it)").c_str(),
                           UserError);
    }
}

TEST_CASE("catalog: partir's own bugs are InternalErrors, a different type") {
  // E71 a kernel asked to run an input op (only a broken executor would): not a UserError
  const Op in{OpKind::input, {}, {}, TensorType{{2}}, "x"};
  const std::vector<const Array*> none;
  CHECK_THROWS_WITH_AS(eval(in, none), "partir internal error: eval: input 'x' has no kernel; the caller binds inputs",
                       InternalError);
  CHECK_FALSE(std::is_base_of_v<UserError, InternalError>);
  CHECK_FALSE(std::is_base_of_v<InternalError, UserError>);
}

TEST_CASE("catalog: a compiled step's state and batch") {
  const Program step = adam_step();
  const Partitioned plan = partition(step, Mesh{{"batch", 2}}, {data_parallel("batch")});
  NamedArrays batch = inputs_of(step), global_state = init_inputs(step, 0);
  std::erase_if(batch, [](const auto& kv) { return kv.first != "x" && kv.first != "y"; });
  auto on_device_0 = [&](auto f) {  // the error of device 0; the other device fails the same way
    threads::run(2, [&](threads::Communicator& c) {
      const Executable<threads::Communicator> exe = compile(plan, c);
      f(exe);
    });
  };
  auto with = [&](NamedArrays b, const std::string& name, Array a) {
    b.insert_or_assign(name, std::move(a));
    return b;
  };
  // E72 the mesh and the communicator disagree
  CHECK_THROWS_WITH_AS(threads::run(4, [&](threads::Communicator& c) { (void)compile(plan, c); }),
                       "program 'train_step' (device 0): mesh {batch=2} has 2 devices but the communicator has 4",
                       UserError);
  // E73 a batch entry the program has no input for (a typo)
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays state = exe.init(0);
                         exe.step(state, with(batch, "labels", Array(TensorType{{16, 8}})));
                       }),
                       "program 'train_step' (device 0): the batch has 'labels', which is no input of the program",
                       UserError);
  // E74 a parameter passed in the batch
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays state = exe.init(0);
                         exe.step(state, with(batch, "params/mlp/b1", global_state.at("params/mlp/b1")));
                       }),
                       "program 'train_step' (device 0): 'params/mlp/b1' is a parameter input: it belongs in the "
                       "state (init, shard_state), not the batch",
                       UserError);
  // E75 a data input missing from the batch
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays state = exe.init(0), only_x{{"x", batch.at("x")}};
                         exe.step(state, only_x);
                       }),
                       "program 'train_step' (device 0): the batch has no 'y' f32[16,8]", UserError);
  // E76 a batch array of the wrong shape (a local piece instead of the global array)
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays state = exe.init(0);
                         exe.step(state, with(batch, "x", Array(TensorType{{8, 8}})));
                       }),
                       "program 'train_step' (device 0): input 'x' is f32[16,8], got f32[8,8]", UserError);
  // E77 shard_state without a parameter, and gather_state of a state that lost one
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays partial = global_state;
                         partial.erase("opt/adam/m/params/mlp/w1");
                         exe.shard_state(partial);
                       }),
                       "program 'train_step' (device 0): shard_state: no array for state input "
                       "'opt/adam/m/params/mlp/w1' f32[8,32]",
                       UserError);
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays state = exe.init(0);
                         state.erase("params/mlp/w2");
                         exe.gather_state(state);
                       }),
                       "program 'train_step' (device 0): gather_state: the state has no 'params/mlp/w2'", UserError);
  CHECK_THROWS_WITH_AS(on_device_0([&](const auto& exe) {
                         NamedArrays state = exe.init(0);
                         state.erase("opt/adam/v/params/mlp/b2");
                         exe.step(state, batch);
                       }),
                       "program 'train_step' (device 0): step: the state has no 'opt/adam/v/params/mlp/b2' (a failed "
                       "step drops the state it took; init, shard_state or a checkpoint make it again)",
                       UserError);
}

TEST_CASE("catalog: the training recipe") {
  nn::Mlp model{"params/mlp", {8, 32, 8}};
  auto loss = [&](Tensor x, Tensor y) { return mse(model(x), y); };
  const std::vector<InputSpec> data{{"x", {16, 8}}, {"y", {16, 8}}};
  // E85 a negative learning rate
  CHECK_THROWS_WITH_AS(train_step(loss, AdamW{.learning_rate = -1e-3}, data),
                       "AdamW: learning_rate -0.001 is out of range (a learning rate is >= 0)", UserError);
  CHECK_THROWS_WITH_AS(train_step(loss, SGD{-0.1}, data), "SGD: learning_rate -0.1 is out of range (a learning rate is >= 0)",
                       UserError);
  // E86 a negative weight decay, and Nesterov without momentum
  CHECK_THROWS_WITH_AS(train_step(loss, AdamW{.weight_decay = -0.1}, data),
                       "AdamW: weight_decay -0.1 is out of range (a weight decay is >= 0)", UserError);
  CHECK_THROWS_WITH_AS(train_step(loss, SGD{.learning_rate = 0.1, .nesterov = true}, data),
                       "SGD: nesterov needs a momentum > 0", UserError);
  // E87 a gradient clip at or below zero
  StepOptions clip;
  clip.clip_norm = 0;
  CHECK_THROWS_WITH_AS(train_step(loss, Adam{}, data, clip),
                       "train_step 'train_step': clip_norm 0 (a gradient norm limit is > 0)", UserError);
  // E88 a warmup not shorter than the run, and a warmup given to a schedule without one
  CHECK_THROWS_WITH_AS(LRSchedule::parse("warmup_cosine", 100, 100, 0.1, "--lr-schedule"),
                       "--lr-schedule warmup_cosine: warmup of 100 steps is not shorter than the run (100 steps)",
                       UserError);
  CHECK_THROWS_WITH_AS(LRSchedule::parse("cosine", 10, 100, 0.1, "--lr-schedule"),
                       "--lr-schedule cosine: a warmup of 10 steps needs a warmup schedule (warmup, warmup_cosine or "
                       "warmup_linear)",
                       UserError);
  // E89 an AdamW decay selector that matches no parameter (a typo)
  CHECK_THROWS_WITH_AS(train_step(loss, AdamW{.decay = {"params/mlp/w1", "params/mpl/**"}}, data),
                       "train_step 'train_step': AdamW decay selector 'params/mpl/**' matches no parameter (parameters "
                       "are named like 'params/mlp/w1')",
                       UserError);
  // E90 an unknown schedule name, and a schedule phase of no steps
  CHECK_THROWS_WITH_AS(LRSchedule::parse("cosine_warmup", 0, 100, 0.1, "--lr-schedule"),
                       "--lr-schedule: unknown schedule 'cosine_warmup' (expected constant, warmup, cosine, linear, "
                       "warmup_cosine or warmup_linear)",
                       UserError);
  CHECK_THROWS_WITH_AS(LRSchedule::warmup(0), "LRSchedule: a phase of 0 steps (a phase lasts >= 1 step)", UserError);
  // E91 a scheduled step run without its learning-rate scale: the missing data input is named
  StepOptions scheduled;
  scheduled.scheduled_learning_rate = true;
  const Program step = train_step(loss, Adam{}, data, scheduled);
  NamedArrays in = inputs_of(step);
  in.erase(StepOptions::lr_scale_name);
  CHECK_THROWS_WITH_AS(interpret(step, in), "interpret train_step: missing input 'opt/lr_scale'", UserError);
}

TEST_CASE("catalog: rematerialization") {
  const nn::Gpt gpt{{.vocab = 16, .seq = 4, .d_model = 8, .heads = 2, .layers = 1}};
  auto loss = [&](Tensor t, Tensor y) { return gpt.loss(t, y); };
  const std::vector<InputSpec> data{{"tokens", {2, 4}, DType::i32}, {"targets", {2, 4}, DType::i32}};
  auto step = [&](const Remat& r) {
    StepOptions o;
    o.remat = r;
    return train_step(loss, Adam{}, data, o);
  };
  // E92 a remat glob that matches no checkpoint name (a typo, or a model without marks)
  CHECK_THROWS_WITH_AS(step(Remat{"mine", {{{"**/attn/query"}, {"**/attn/context"}}}}),
                       "remat 'mine': '**/attn/query' matches no checkpoint name of program 'train_step' (the model "
                       "marks region boundaries with checkpoint_name())",
                       UserError);
  // E93 a region ending at a value the backward pass or the update computes (it has side effects in the step)
  Program p = train_step(loss, Adam{}, data);
  p.checkpoint_name(p.output("params/ln_f/gamma"), "late");
  CHECK_THROWS_WITH_AS(rematerialize(p, Remat{"late", {{{"**/embed"}, {"late"}}}}),
                       "remat 'late': 'late' is computed after the loss (by the backward pass or the update), so no "
                       "forward region can end there",
                       UserError);
  // E94 a region with nothing between its marks, and a program without a backward pass
  CHECK_THROWS_WITH_AS(step(Remat{"empty", {{{"**/attn/context"}, {"**/attn/q"}}}}),
                       "remat 'empty': its regions of program 'train_step' hold no value to recompute", UserError);
  const Program forward = trace("fwd", [&](Tensor t, Tensor y) { return gpt.loss(t, y); }, data);
  CHECK_THROWS_WITH_AS(rematerialize(forward, Remat::blocks()),
                       "remat 'blocks': program 'fwd' has no backward pass to recompute in", UserError);
  // E95 an unknown --remat policy
  CHECK_THROWS_WITH_AS(Remat::parse("core", "--remat"),
                       "--remat: unknown remat policy 'core' (expected none, blocks, selective or attention)", UserError);
}

TEST_CASE("catalog: gradient accumulation") {
  nn::Mlp model{"params/mlp", {8, 32, 8}};
  auto loss = [&](Tensor x, Tensor y) { return mse(model(x), y); };
  // E96 microbatches that do not divide a data input's batch dim, and fewer than one
  StepOptions three;
  three.microbatches = 3;
  CHECK_THROWS_WITH_AS(train_step(loss, Adam{}, {{"x", {16, 8}}, {"y", {16, 8}}}, three),
                       "train_step 'train_step': data input 'x' f32[16,8] has no leading batch dim that 3 microbatches "
                       "divide",
                       UserError);
  StepOptions none;
  none.microbatches = 0;
  CHECK_THROWS_WITH_AS(train_step(loss, Adam{}, {{"x", {16, 8}}, {"y", {16, 8}}}, none),
                       "train_step 'train_step': microbatches 0 (a step runs at least 1 microbatch)", UserError);
}

TEST_CASE("catalog: pipeline parallelism") {
  const nn::GptConfig c{.vocab = 16, .seq = 4, .d_model = 8, .heads = 2, .layers = 2};
  const nn::Gpt gpt{c};
  const std::vector<InputSpec> data{{"tokens", {4, c.seq}, DType::i32}, {"targets", {4, c.seq}, DType::i32}};
  const Program step = train_step([&](Tensor t, Tensor y) { return gpt.loss(t, y); }, Adam{}, data,
                                  StepOptions{.microbatches = 2});
  // E97 more stages than layers to split, and a model without layers/<i> names
  CHECK_THROWS_WITH_AS(partition(step, Mesh{{"stage", 4}}, parse_schedule("pp")),
                       "tactic 1 (pp(stage)): 4 stages on 'stage' but 'train_step' has 2 layers: stage 2 would have no "
                       "ops (use at most as many stages as layers)",
                       UserError);
  nn::Mlp mlp{"params/mlp", {8, 16, 8}};
  const Program mlp_step = train_step([&](Tensor x, Tensor y) { return mse(mlp(x), y); }, Adam{}, {{"x", {8, 8}}, {"y", {8, 8}}});
  CHECK_THROWS_WITH_AS(partition(mlp_step, Mesh{{"stage", 2}}, parse_schedule("pp")),
                       "tactic 1 (pp(stage)): no parameter of 'train_step' is named .../layers/<i>/... to split into stages; "
                       "give each stage its parameter selectors",
                       UserError);
  // E98 stage selectors: not one list per stage, a selector matching no parameter, a parameter in two stages or
  // in none, a stage with no parameter
  const Mesh two{{"stage", 2}};
  auto with = [&](std::vector<std::vector<std::string>> stages) {
    return partition(mlp_step, two, {pipeline("stage", PipelineSchedule::one_f_one_b, std::move(stages))});
  };
  CHECK_THROWS_WITH_AS(with({{"params/**"}}),
                       "tactic 1 (pp(stage)): 1 stages' selectors for axis 'stage' of size 2 (one list per stage)",
                       UserError);
  CHECK_THROWS_WITH_AS(with({{"params/mlp/w1", "params/mlp/b1"}, {"params/mlp/w9"}}),
                       "tactic 1 (pp(stage)): stage 1's selector 'params/mlp/w9' matches no parameter of 'train_step'",
                       UserError);
  CHECK_THROWS_WITH_AS(with({{"params/mlp/*1"}, {"params/mlp/w*"}}),
                       "tactic 1 (pp(stage)): parameter 'params/mlp/w1' matches the selectors of stages 0 and 1", UserError);
  CHECK_THROWS_WITH_AS(with({{"params/mlp/*1"}, {"params/mlp/w2"}}),
                       "tactic 1 (pp(stage)): parameter 'params/mlp/b2' matches no stage's selectors", UserError);
  CHECK_THROWS_WITH_AS(with({{"params/**"}, {}}),
                       "tactic 1 (pp(stage)): stage 1 of 'stage' holds no parameter, so it would have no ops", UserError);
  // E99 the pipeline axis partitioned by another tactic, before or after it, and two pipeline tactics
  const Mesh mesh{{"stage", 2}, {"batch", 2}};
  CHECK_THROWS_WITH_AS(partition(step, mesh, {data_parallel("stage"), pipeline("stage")}),
                       "tactic 2 (pp(stage)): axis 'stage' already partitions tokens (from tactic 1 (bp(stage))); a "
                       "pipeline axis carries stages, not tiles",
                       UserError);
  CHECK_THROWS_WITH_AS(lower(partition(step, mesh, {pipeline("stage"), data_parallel("stage")})),
                       "tactic 1 (pp(stage)): tactic 2 (bp(stage)) partitions tokens over 'stage', the pipeline's axis (a "
                       "pipeline axis carries stages; give other tactics other axes)",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(step, mesh, {pipeline("stage"), pipeline("batch")}),
                       "tactic 2 (pp(batch)): the schedule already pipelines over 'stage' (tactic 1 (pp(stage))); one "
                       "pipeline tactic per schedule",
                       UserError);
  // E100 an unknown pipeline schedule name
  CHECK_THROWS_WITH_AS(parse_schedule("pp:zb2"),
                       "schedule 'pp:zb2': unknown tactic 'pp:zb2' (expected none, bp, mp, z2, z3, emb, mq, ep, sp, pp, "
                       "pp:gpipe, pp:interleaved:<v>, pp:zb1, pp:zbv, auto:<axis>)",
                       UserError);
  // E117 chunked schedules: a chunk count below 1 or one the order does not run, layers that do not split into
  // equal chunks (by count), microbatches the stages do not divide (interleaved), selectors not one list per virtual stage
  CHECK_THROWS_WITH_AS(parse_schedule("pp:interleaved:0"),
                       "schedule 'pp:interleaved:0': 'pp:interleaved:0' needs a chunk count of at least 1, as in pp:interleaved:2",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(step, two, {pipeline("stage", PipelineSchedule{PipelineSchedule::Order::gpipe, 2, false})}),
                       "tactic 1 (pp(stage, gpipe:2)): schedule gpipe:2 is not one partir runs (gpipe and zb1 hold one "
                       "chunk per device, interleaved:v at least one, zbv two placed as a V)",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(step, two, {pipeline("stage", PipelineSchedule{PipelineSchedule::Order::one_f_one_b, 2, true})}),
                       "tactic 1 (pp(stage, 1f1b:v2)): schedule 1f1b:v2 is not one partir runs (gpipe and zb1 hold one "
                       "chunk per device, interleaved:v at least one, zbv two placed as a V)",
                       UserError);
  const nn::Gpt three_layers{{.vocab = 16, .seq = 4, .d_model = 8, .heads = 2, .layers = 3}};
  const Program step3 = train_step([&](Tensor t, Tensor y) { return three_layers.loss(t, y); }, Adam{}, data,
                                   StepOptions{.microbatches = 2});
  CHECK_THROWS_WITH_AS(partition(step3, Mesh{{"stage", 1}}, {pipeline("stage", PipelineSchedule::interleaved(2), {}, StageBalance::layers)}),
                       "tactic 1 (pp(stage, interleaved:2, equal layers)): 'train_step' has 3 layers, which do not split "
                       "into 1 stages x 2 chunks of equal size (a chunked schedule deals equal chunks round the devices; "
                       "use a chunk count that divides the layers per stage, or StageBalance::cost)",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(step, Mesh{{"stage", 2}}, parse_schedule("pp:zbv")),
                       "tactic 1 (pp(stage, zbv)): 4 virtual stages on 'stage' but 'train_step' has 2 layers: virtual "
                       "stage 2 would have no ops (use at most as many virtual stages as layers)",
                       UserError);
  const nn::Gpt eight_layers{{.vocab = 16, .seq = 4, .d_model = 8, .heads = 2, .layers = 8}};
  const Program odd = train_step([&](Tensor t, Tensor y) { return eight_layers.loss(t, y); }, Adam{},
                                 {{"tokens", {6, c.seq}, DType::i32}, {"targets", {6, c.seq}, DType::i32}},
                                 StepOptions{.microbatches = 6});
  CHECK_THROWS_WITH_AS(partition(odd, Mesh{{"stage", 4}}, parse_schedule("pp:interleaved:2")),
                       "tactic 1 (pp(stage, interleaved:2)): 6 microbatches, which 4 stages do not divide (the "
                       "interleaved schedule runs microbatches through each chunk p at a time, as Megatron-LM's; use "
                       "at most 4, or a multiple)",
                       UserError);
  CHECK_THROWS_WITH_AS(partition(mlp_step, two, {pipeline("stage", PipelineSchedule::zbv, {{"params/mlp/w1"}, {"params/mlp/b1"}})}),
                       "tactic 1 (pp(stage, zbv)): 2 stages' selectors for axis 'stage' of size 2 with 2 chunks each (one "
                       "list per virtual stage: 4)",
                       UserError);
}

TEST_CASE("catalog: mixture of experts and expert parallelism") {
  // E104 a MoE layer's routing out of range; expert parallelism without experts, or experts the axis does not divide
  auto layer = [](int top_k, double factor) {
    return trace("moe", [&](Tensor x) { return nn::MixtureOfExperts{"params/moe", 8, 16, 4, top_k, factor}(x).y; },
                 {{"x", {2, 4, 8}}});
  };
  CHECK_THROWS_WITH_AS(layer(3, 1.0), "MixtureOfExperts 'params/moe': top_k 3 is not supported (1 or 2, at most the 4 experts)",
                       UserError);
  CHECK_THROWS_WITH_AS(layer(1, 0.0), "MixtureOfExperts 'params/moe': capacity_factor must be > 0, got 0.000000", UserError);
  CHECK_THROWS_WITH_AS(partition(adam_step(), Mesh{{"expert", 2}}, parse_schedule("ep")),
                       "tactic 1 (ep(expert)): no parameter of 'train_step' is an expert weight (params/**/experts/*, as "
                       "nn::MixtureOfExperts names them)",
                       UserError);
  nn::GptConfig c{.vocab = 16, .seq = 4, .d_model = 8, .heads = 2, .layers = 1, .experts = 3};
  const nn::Gpt model{c};
  const Program step = train_step([&](Tensor t, Tensor y) { return model.loss(t, y); }, Adam{1e-2},
                                  {{"tokens", {4, 4}, DType::i32}, {"targets", {4, 4}, DType::i32}});
  CHECK_THROWS_WITH_AS(partition(step, Mesh{{"expert", 2}}, parse_schedule("ep")),
                       "tactic 1 (ep(expert)): params/layers/0/moe/experts/b1 holds 3 experts, not divisible by {expert} "
                       "(2 tiles): expert parallelism gives each device whole experts",
                       UserError);
}

TEST_CASE("catalog: convolutions") {
  // E105 a convolution's kernel that does not fit its input: rank, features, window; a gradient it cannot take
  auto conv_of = [](Shape x, Shape w, ConvWindow window = {}) {
    return trace("c", [&](Tensor a, Tensor b) { return conv(a, b, window); }, {{"x", std::move(x)}, {"w", std::move(w)}});
  };
  CHECK_THROWS_WITH_AS(conv_of({2, 5, 5, 3}, {3, 3, 3}),
                       "convolution: kernel f32[3,3,3] must be [window..., in features, out features], of the input's "
                       "rank 4 (input f32[2,5,5,3])",
                       UserError);
  CHECK_THROWS_WITH_AS(conv_of({2, 5, 5, 3}, {3, 3, 4, 8}),
                       "convolution: kernel f32[3,3,4,8] reads 4 features, input f32[2,5,5,3] has 3", UserError);
  CHECK_THROWS_WITH_AS(conv_of({2, 5, 5, 6}, {3, 3, 3, 8}, {.feature_groups = 4}),
                       "convolution: 4 feature groups must divide the input's 6 features and the kernel's 8 output "
                       "features (f32[2,5,5,6], kernel f32[3,3,3,8])",
                       UserError);
  CHECK_THROWS_WITH_AS(conv_of({2, 5, 5, 6}, {3, 3, 2, 8}, {.feature_groups = 2}),
                       "convolution: kernel f32[3,3,2,8] reads 2 features in each of 2 groups, input f32[2,5,5,6] has 6",
                       UserError);
  CHECK_THROWS_WITH_AS(conv_of({2, 2, 5, 3}, {3, 3, 3, 8}),
                       "convolution: window of 3 on spatial dim 0 does not fit the padded input of 2 (f32[2,2,5,3], "
                       "kernel f32[3,3,3,8])",
                       UserError);
  CHECK_THROWS_WITH_AS(conv_of({2, 5, 5, 3}, {3, 3, 3, 8}, {.strides = {1}}),
                       "convolution: needs a stride, dilations and padding for each of the 2 spatial dims of f32[2,5,5,3]",
                       UserError);
  const Program dilated = trace(
      "g", [](Tensor x, Tensor w) { return NamedTensors{{"loss", sum(conv_general(x, w, {{1}, {2}, {1}}, {0}, {0}))}}; },
      {{"x", {1, 4, 2}}, {"w", {2, 2, 3}}});
  CHECK_THROWS_WITH_AS(value_and_grad(dilated, "loss", {"x"}),
                       "grad: the input gradient of a convolution with input dilation is not supported (partir "
                       "differentiates a convolution once, not its gradients)",
                       UserError);
  // E106 spatial tiles smaller than a convolution's halo (a 5x5 'same' window reads 2 rows of each neighbour,
  // tiles hold 1)
  const Program wide = conv_of({1, 4, 4, 1}, {5, 5, 1, 1}, {.padding_low = {2, 2}, .padding_high = {2, 2}});
  CHECK_THROWS_WITH_AS(lower(partition(wide, Mesh{{"space", 4}}, {ManualPartition{{{"x", 1}}, "space"}})),
                       "convolution %2: spatial dim 0 of x tiled on 'space' from tactic 1 (tile x:1 on space) into "
                       "tiles of 1 row, but each tile's windows read 2 rows of a neighbouring tile (a halo exchange "
                       "reaches only the next tile: use fewer tiles on {space} or larger inputs)",
                       UserError);
  // E107 pooling windows that do not fit their operand, or nn's pools on a tensor without spatial dims
  auto pool = [](Shape x, WindowDims w, std::vector<std::int64_t> lo) {
    return trace("p", [&](Tensor a) { return reduce_window(a, OpKind::reduce_window_max, w, lo, lo); }, {{"x", std::move(x)}});
  };
  CHECK_THROWS_WITH_AS(pool({2, 4}, {{2}, {1}, {1}, {1}}, {0}),
                       "reduce_window_max: needs a window size, stride, dilations and padding for each of the 2 dims of f32[2,4]",
                       UserError);
  CHECK_THROWS_WITH_AS(pool({2, 3}, {{1, 4}, {1, 1}, {1, 1}, {1, 1}}, {0, 0}),
                       "reduce_window_max: window of 4 on dim 1 does not fit the padded operand of 3 (f32[2,3])", UserError);
  CHECK_THROWS_WITH_AS(trace("p", [](Tensor a) { return nn::max_pool(a, {2, 2}); }, {{"x", {2, 4, 3}}}),
                       "max_pool: input f32[2,4,3] is not [batch, 2 spatial dims, features]", UserError);
  // ... and more windowed dims than the windowed kernels take (CPU and GPU alike: kernels/window.hpp)
  const std::vector<std::int64_t> ones(9, 1), zeros(9, 0);
  try {
    interpret(pool(ones, {ones, ones, ones, ones}, zeros), NamedArrays{{"x", Array({ones, DType::f32})}});
    FAIL("a pooling over 9 dims ran");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("reduce_window_max: 9 windowed dims exceed the kernels' limit of 8") != std::string::npos);
  }
}

TEST_CASE("catalog: communication") {
  // E108 a negative all_reduce bucket size
  const Program step = adam_step();
  CHECK_THROWS_WITH_AS(lower(partition(step, mesh2x2, {data_parallel("batch")}), {.bucket_bytes = -1}),
                       "bucket_collectives: bucket size -1 bytes is negative (0 turns bucketing off)", UserError);
  // E108 a prefetch budget below -1 (one_collective_ahead)
  CHECK_THROWS_WITH_AS(lower(partition(step, mesh2x2, {data_parallel("batch")}), {.prefetch_bytes = -2}),
                       "schedule_collectives: prefetch budget -2 bytes is negative (0 moves only collectives that cost no "
                       "memory; -1: one collective ahead)",
                       UserError);
}

TEST_CASE("catalog: hardware profiles and command lines (nlohmann-json and CLI11 errors in partir's wording)") {
  // E101 a malformed or mistyped hardware profile names the file, the place and the rule
  const std::string path = "test_errors_profile.json";
  std::ofstream(path) << "{\"name\": \"x\", \"peak_flops\": {\"f32\": 1e12}, \"memory_bandwidth\": 1e11,\n\"links\": [}";
  CHECK_THROWS_WITH_AS(HardwareProfile::load(path),
                       "hardware profile test_errors_profile.json: test_errors_profile.json: json: parse error at line "
                       "2, column 11: syntax error while parsing value - unexpected '}'; expected '[', '{', or a literal",
                       UserError);
  std::ofstream(path) << R"({"name": "x", "peak_flops": {"f32": "fast"}, "memory_bandwidth": 1e11, "links": []})";
  CHECK_THROWS_WITH_AS(HardwareProfile::load(path),
                       "hardware profile test_errors_profile.json: json: type must be number, but is string", UserError);
  std::remove(path.c_str());
  // E102 a bad command line of an example: one line naming the flag and the rule, the nearest flag for a typo
  auto problem = [](std::vector<const char*> args) {
    cli::App app("test", "mlp_train");
    long steps = 200;
    app.add_option("--steps", steps, "training steps")->check(cli::at_least(1));
    examples::RunFlags run(app, "batch=1", "none", "tactics", "report.json");
    const examples::RecipeFlags recipe(app, 3e-3);
    const examples::LoopFlags loop(app);
    args.insert(args.begin(), "mlp_train");
    return app.problem(static_cast<int>(args.size()), args.data());
  };
  CHECK(problem({"--steps=5", "--mesh", "batch=2", "--backend=mpi"}).empty());
  CHECK(problem({"--stpes", "5"}) == "error: unknown flag --stpes; did you mean --steps? (see --help)");
  CHECK(problem({"--steps", "0"}) == "error: --steps: expected a number >= 1, got 0 (see --help)");
  CHECK(problem({"--lr", "fast"}) == "error: --lr: expected a number, got 'fast' (see --help)");
  CHECK(problem({"--backend", "gpu"}) == "error: --backend: gpu not in {threads,mpi,nccl} (see --help)");
  CHECK(problem({"--precision", "fp8"}) == "error: --precision: fp8 not in {f32,bf16,f16} (see --help)");
  CHECK(problem({"--report", "csv"}) == "error: --report: csv not in {json} (see --help)");
  CHECK(problem({"--mesh"}) == "error: --mesh: 1 required TEXT missing (see --help)");
  CHECK(problem({"--microbatches", "0"}) == "error: --microbatches: expected a number >= 1, got 0 (see --help)");
  CHECK(problem({"extra"}) == "error: The following argument was not expected: extra (see --help)");
}

TEST_CASE("catalog: safetensors files (runtime/state/safetensors.hpp)") {
  const std::string dir = "test_errors_safetensors";
  std::filesystem::remove_all(dir);
  auto raw = [&](const std::string& name, const std::string& header, std::size_t data_bytes) {
    std::filesystem::create_directories(dir + "/" + name);
    std::ofstream out(dir + "/" + name + "/model.safetensors", std::ios::binary);
    const std::uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
    return dir + "/" + name;
  };
  const std::string f32 = R"({"dtype":"F32","shape":[2,2],"data_offsets":)";
  // E109 a file shorter than its header or its tensors say
  CHECK_THROWS_WITH_AS(load_safetensors(raw("truncated", "{\"a.w\":" + f32 + "[0,16]}}", 8)),
                       "safetensors 'test_errors_safetensors/truncated/model.safetensors': tensor 'a.w': truncated: its "
                       "data ends at byte 16 of the data, the file holds 8",
                       UserError);
  {
    const std::string length = raw("length", "{}", 0);
    std::fstream out(length + "/model.safetensors", std::ios::binary | std::ios::in | std::ios::out);
    const std::uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
  }
  CHECK_THROWS_WITH_AS(load_safetensors(dir + "/length"),
                       "safetensors 'test_errors_safetensors/length/model.safetensors': truncated: the header is 1000 "
                       "bytes, the file holds 2 after the length",
                       UserError);
  // E110 a dtype partir does not read
  CHECK_THROWS_WITH_AS(load_safetensors(raw("dtype", R"({"a.w":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})", 2)),
                       "safetensors 'test_errors_safetensors/dtype/model.safetensors': tensor 'a.w': unknown dtype 'I8' "
                       "(partir reads F32, BF16, F16, F64, I32)",
                       UserError);
  // E111 offsets that overlap, or span other than the shape's bytes
  CHECK_THROWS_WITH_AS(load_safetensors(raw("overlap", "{\"a.w\":" + f32 + "[0,16]},\"a.v\":" + f32 + "[8,24]}}", 24)),
                       "safetensors 'test_errors_safetensors/overlap/model.safetensors': tensors 'a.w' and 'a.v' overlap "
                       "(data_offsets [0, 16) and [8, 24))",
                       UserError);
  CHECK_THROWS_WITH_AS(load_safetensors(raw("span", "{\"a.w\":" + f32 + "[0,12]}}", 16)),
                       "safetensors 'test_errors_safetensors/span/model.safetensors': tensor 'a.w': data_offsets [0, 12) "
                       "span 12 bytes, f32[2,2] needs 16",
                       UserError);
  // E112 a header that is not JSON, or a directory without safetensors
  CHECK_THROWS_WITH_AS(load_safetensors(dir + "/none"),
                       "safetensors 'test_errors_safetensors/none': neither a .safetensors file nor a directory with "
                       "model.safetensors or model.safetensors.index.json",
                       UserError);
  CHECK_THROWS_AS(load_safetensors(raw("json", "{\"a.w\": [", 0)), UserError);

  // Against the model a plan restores into: a tensor it lacks, a shape it does not have, a tensor it needs.
  const nn::LlamaConfig c{.vocab = 16, .seq = 4, .d_model = 8, .layers = 1, .heads = 2, .kv_heads = 1, .ffn = 8};
  const Program forward = trace("llama", [&](Tensor t) { return NamedTensors{{"logits", nn::Llama{c}.logits(t)}}; },
                                {{"tokens", {2, c.seq}, DType::i32}});
  const SpmdProgram spmd = lower(partition(forward, Mesh{{"batch", 2}}, {data_parallel("batch")}));
  NamedArrays params = init_inputs(forward, 1);
  params.erase("tokens");
  auto restore_from = [&](const std::string& name, NamedArrays weights) {
    save_safetensors(dir + "/" + name, weights);
    threads::run(2, [&](threads::Communicator& comm) {
      NamedArrays state;
      restore_safetensors(dir + "/" + name, spmd, comm, state);
    });
  };
  // E113 a tensor that is not a parameter of the program
  NamedArrays extra = params;
  extra.emplace("params/model/layers/0/self_attn/rotary_emb/inv_freq", Array({4}, std::vector<float>{1, 2, 3, 4}));
  CHECK_THROWS_WITH_AS(restore_from("extra", extra),
                       "safetensors 'test_errors_safetensors/extra': tensor 'model.layers.0.self_attn.rotary_emb.inv_freq' "
                       "(model.safetensors) is not a parameter of program 'llama' (no "
                       "params/model/layers/0/self_attn/rotary_emb/inv_freq)",
                       UserError);
  // E114 a tensor of another shape than the parameter's
  NamedArrays reshaped = params;
  reshaped.at("params/model/norm/weight") = Array({4}, std::vector<float>{1, 2, 3, 4});
  CHECK_THROWS_WITH_AS(restore_from("reshaped", reshaped),
                       "safetensors 'test_errors_safetensors/reshaped': tensor 'model.norm.weight' is f32[4], program "
                       "'llama' needs f32[8]",
                       UserError);
  // E115 a parameter the files lack
  NamedArrays missing = params;
  missing.erase("params/lm_head/weight");
  CHECK_THROWS_WITH_AS(restore_from("missing", missing),
                       "safetensors 'test_errors_safetensors/missing' has no tensor 'lm_head.weight' that program "
                       "'llama' needs",
                       UserError);
  // E116 a parameter whose name has no tensor name
  CHECK_THROWS_WITH_AS(save_safetensors(dir + "/bad", {{"weights.a", Array({1}, std::vector<float>{1})}}),
                       "safetensors: parameter 'weights.a' is not named params/<path> without '.' (its tensor is named "
                       "by the path, '.' for '/')",
                       UserError);
  std::filesystem::remove_all(dir);
}
