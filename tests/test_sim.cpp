// Simulator: cost formulas, liveness-based peak memory on hand-built SpmdPrograms with known answers (and
// against what the executor measures), hardware profiles and their JSON, report and trace JSON, and the
// ZeRO relations on a lowered MLP train step.
#include <doctest/doctest.h>

#include <partir/partir.hpp>
#include <partir/runtime/exec/executor.hpp>
#include <partir/calibrate/trace.hpp>
#include <partir/spmd/lower.hpp>

#include <cstdio>
#include <limits>
#include <sstream>

using namespace partir;

namespace {

Op local_op(OpKind kind, std::vector<ValueId> operands, TensorType type, Attrs attrs = {}, std::string name = "") {
  return Op{kind, std::move(operands), std::move(attrs), std::move(type), std::move(name)};
}

Op input_op(const std::string& name, TensorType type, InputKind kind) {
  Attrs a;
  a.input_kind = kind;
  return local_op(OpKind::input, {}, std::move(type), a, name);
}

// 1 GFLOP/s, 1 GB/s, no per-op cost, one link: alpha 1 us, beta 1 ns/byte. Round numbers for hand checks.
HardwareProfile unit_profile() {
  return {.name = "unit", .peak_flops = {{DType::f32, 1e9}}, .memory_bandwidth = 1e9, .links = {{"*", "*", 0, {1e-6, 1e-9}}}};
}

// On mesh {batch=2}: a parameter w (tiled, f32[4] locally) and data x (f32[8]);
//   %2 = neg x; %3 = reduce_sum %2; %4 = all_reduce %3 -> "loss";  %5 = neg w; %6 = add w, %5 -> updates w.
SpmdProgram toy_step() {
  const Mesh mesh{{"batch", 2}};
  const TensorType vec4{{4}}, vec8{{8}}, scalar{{}};
  const Sharding tiled{{{"batch"}}, {}};
  SpmdProgram p("toy", mesh);
  auto w = p.add({input_op("w", vec4, InputKind::parameter)});
  p.add_input({"w", w, vec8, tiled, ""});
  auto x = p.add({input_op("x", vec8, InputKind::data)});
  p.add_input({"x", x, vec8, Sharding::replicated(1), ""});
  auto a = p.add({local_op(OpKind::neg, {x}, vec8)});
  Attrs all;
  all.dims = {0};
  auto s = p.add({local_op(OpKind::reduce_sum, {a}, scalar, all)});
  auto loss = p.add({local_op(OpKind::input, {s}, scalar), Collective{CollectiveKind::all_reduce, {"batch"}}});
  p.add_output({"loss", loss, scalar, Sharding::replicated(0), ""});
  auto g = p.add({local_op(OpKind::neg, {w}, vec4)});
  auto w_new = p.add({local_op(OpKind::add, {w, g}, vec4)});
  p.add_output({"w", w_new, vec8, tiled, "w"});
  return p;
}

// Each device's piece of the program's global inputs, and what execute() measures with them.
std::vector<DeviceResult> execute_local(const SpmdProgram& p, const NamedArrays& global) {
  std::vector<DeviceResult> out(static_cast<std::size_t>(p.mesh().num_devices()));
  threads::run(static_cast<int>(p.mesh().num_devices()), [&](threads::Communicator& c) {
    NamedArrays local;
    for (const auto& b : p.inputs()) local[b.name] = layout::shard(global.at(b.name), b.sharding, p.mesh(), c.device());
    out[static_cast<std::size_t>(c.device())] = execute(p, c, local, {false, false});
  });
  return out;
}

}  // namespace

TEST_CASE("cost model: FLOPs from the rule's iteration space, bytes read and written") {
  Attrs mm;
  mm.dot = {{}, {}, {1}, {0}};
  const std::vector<TensorType> dot_in{{{8, 16}}, {{16, 4}}};
  const Work dot = local_work(local_op(OpKind::dot_general, {0, 1}, {{8, 4}}, mm), dot_in);
  CHECK(dot.flops == 2 * 8 * 16 * 4);
  CHECK(dot.bytes == (8 * 16 + 16 * 4 + 8 * 4) * 4);
  CHECK(dot.gemm_dim == 4);  // M 8, K 16, N 4

  Attrs batched;
  batched.dot = {{0}, {0}, {2}, {1}};
  const std::vector<TensorType> bmm_in{{{3, 8, 16}}, {{3, 16, 4}}};
  CHECK(local_work(local_op(OpKind::dot_general, {0, 1}, {{3, 8, 4}}, batched), bmm_in).flops == 2 * 3 * 8 * 16 * 4);
  // The batch dim (3) is a loop, not a GEMM dim.
  CHECK(local_work(local_op(OpKind::dot_general, {0, 1}, {{3, 8, 4}}, batched), bmm_in).gemm_dim == 4);
  const std::vector<TensorType> weight_grad_in{{{2, 64, 16}}, {{2, 64, 8}}};  // [B,T,D] x [B,T,H] over B,T
  Attrs over_tokens;
  over_tokens.dot = {{}, {}, {0, 1}, {0, 1}};
  CHECK(local_work(local_op(OpKind::dot_general, {0, 1}, {{16, 8}}, over_tokens), weight_grad_in).gemm_dim == 8);

  const std::vector<TensorType> pair{{{10}}, {{10}}};
  const Work add = local_work(local_op(OpKind::add, {0, 1}, {{10}}), pair);
  CHECK(add.flops == 10);
  CHECK(add.bytes == 30 * 4);

  Attrs rows;
  rows.dims = {1};
  const std::vector<TensorType> matrix{{{4, 5}}};
  const Work sum = local_work(local_op(OpKind::reduce_sum, {0}, {{4}}, rows), matrix);
  CHECK(sum.flops == 20);
  CHECK(sum.bytes == (20 + 4) * 4);

  // A 3x3 convolution [2, 8, 8, 3] -> [2, 4, 4, 5] at stride 2: a multiply-add per output element, tap and
  // input feature; its im2col GEMM is [2 images x 16 positions, 27] x [27, 5].
  Attrs window;
  window.conv = {{2, 2}, {1, 1}, {1, 1}};
  window.lo = window.hi = {1, 1};
  const std::vector<TensorType> conv_in{{{2, 8, 8, 3}}, {{3, 3, 3, 5}}};
  const Work conv = local_work(local_op(OpKind::convolution, {0, 1}, {{2, 4, 4, 5}}, window), conv_in);
  CHECK(conv.flops == 2 * (2 * 4 * 4 * 5) * (3 * 3 * 3));
  CHECK(conv.gemm_dim == 5);
  // With 64 output features taps x C bound it (27); with 2x2 positions, the rows of all 4 images do (16).
  const std::vector<TensorType> wide_in{{{2, 8, 8, 3}}, {{3, 3, 3, 64}}};
  CHECK(local_work(local_op(OpKind::convolution, {0, 1}, {{2, 4, 4, 64}}, window), wide_in).gemm_dim == 27);
  const std::vector<TensorType> few_positions{{{4, 4, 4, 3}}, {{3, 3, 3, 64}}};
  CHECK(local_work(local_op(OpKind::convolution, {0, 1}, {{4, 2, 2, 64}}, window), few_positions).gemm_dim == 16);
  // 64 features in 4 groups: a quarter of the dense FLOPs, a GEMM [128, 3 x 3 x 16] x [3 x 3 x 16, 16] per group.
  Attrs grouped = window;
  grouped.conv.feature_groups = 4;
  const std::vector<TensorType> grouped_in{{{2, 8, 8, 64}}, {{3, 3, 16, 64}}};
  const Work grouped_work = local_work(local_op(OpKind::convolution, {0, 1}, {{2, 4, 4, 64}}, grouped), grouped_in);
  CHECK(grouped_work.flops == 2 * (2 * 4 * 4 * 64) * (3 * 3 * 16));
  CHECK(grouped_work.gemm_dim == 16);

  Attrs perm;
  perm.dims = {1, 0};
  const Work t = local_work(local_op(OpKind::transpose, {0}, {{5, 4}}, perm), matrix);
  CHECK(t.flops == 0);
  CHECK(t.bytes == 40 * 4);
  CHECK(local_work(input_op("x", {{4, 5}}, InputKind::data), {}).bytes == 0);

  // A slice reads what it keeps, not its whole operand: rows 1..3 of [4, 5].
  Attrs middle_rows;
  middle_rows.lo = {1, 0};
  middle_rows.hi = {3, 5};
  CHECK(local_work(local_op(OpKind::slice, {0}, {{2, 5}}, middle_rows), matrix).bytes == 2 * 10 * 4);
}

TEST_CASE("simulate: an all_slice copies this device's tile, reading only the tile") {
  // ZeRO-2's shard of a replicated parameter: f32[8] -> f32[4] on {batch=2}, 16 bytes read and 16 written.
  SpmdProgram p("all_slice", Mesh{{"batch", 2}});
  const TensorType vec8{{8}}, vec4{{4}};
  auto w = p.add({input_op("w", vec8, InputKind::parameter)});
  p.add_input({"w", w, vec8, Sharding::replicated(1), ""});
  Collective slice{CollectiveKind::all_slice, {"batch"}};
  slice.dim = 0;
  auto tile = p.add({local_op(OpKind::input, {w}, vec4), slice});
  p.add_output({"w_tile", tile, vec8, Sharding{{{"batch"}}, {}}, ""});
  const Report r = simulate(p, unit_profile(), {.overlap = false});
  REQUIRE(r.timeline.size() == 1);
  CHECK(r.timeline[0].bytes == 32);
  CHECK(r.timeline[0].seconds == doctest::Approx(32e-9));  // 1 GB/s, no per-op cost
  CHECK(r.communication_seconds == 0);
}

TEST_CASE("cost model: roofline and ring formulas") {
  const HardwareProfile hw = unit_profile();
  bool compute_bound = false;
  CHECK(roofline_seconds({2e9, 1e9}, OpKind::add, DType::f32, hw, &compute_bound) == doctest::Approx(2.0));
  CHECK(compute_bound);
  CHECK(roofline_seconds({1e9, 3e9}, OpKind::add, DType::f32, hw, &compute_bound) == doctest::Approx(3.0));
  CHECK(!compute_bound);
  HardwareProfile strided = hw;
  strided.op_bandwidth[OpKind::transpose] = 0.5e9;
  CHECK(roofline_seconds({0, 1e9}, OpKind::transpose, DType::f32, strided) == doctest::Approx(2.0));
  CHECK(roofline_seconds({0, 1e9}, OpKind::add, DType::f32, strided) == doctest::Approx(1.0));
  // Caches: streaming at 4 GB/s up to 1 KB of working set, 2 GB/s (memory) from 100 KB, log-interpolated.
  HardwareProfile cached = strided;
  cached.memory_bandwidth = 2e9;
  cached.cache_curve = {{1e3, 4e9}, {1e5, 2e9}};
  CHECK(cached.bandwidth(OpKind::add, 1e2) == doctest::Approx(4e9));
  CHECK(cached.bandwidth(OpKind::add, 1e4) == doctest::Approx(3e9));
  CHECK(cached.bandwidth(OpKind::add, 1e7) == doctest::Approx(2e9));
  CHECK(cached.bandwidth(OpKind::transpose, 1e2) == doctest::Approx(1e9));
  // GEMMs with a small dim: the curve's fraction of the peak at their smallest of M, N, K (log-interpolated).
  HardwareProfile shaped = hw;
  shaped.gemm_curve = {{16, 0.25}, {256, 0.75}, {1024, 1}};
  CHECK(roofline_seconds({1e9, 0, 16}, OpKind::dot_general, DType::f32, shaped) == doctest::Approx(4.0));
  CHECK(roofline_seconds({1e9, 0, 64}, OpKind::dot_general, DType::f32, shaped) == doctest::Approx(2.0));
  CHECK(roofline_seconds({1e9, 0, 4096}, OpKind::dot_general, DType::f32, shaped) == doctest::Approx(1.0));
  CHECK(roofline_seconds({1e9, 0, 16}, OpKind::add, DType::f32, shaped) == doctest::Approx(1.0));
  CHECK_THROWS_WITH_AS(roofline_seconds({1, 1}, OpKind::add, DType::f64, hw),
                       "hardware profile 'unit' has no peak FLOP/s for f64", UserError);

  // n = 4, S = 4000 bytes: each of the n-1 steps moves S/n = 1000 bytes: 1 us + 1 us.
  const Link link{1e-6, 1e-9};
  using CK = CollectiveKind;
  CHECK(ring_seconds(CK::all_gather, 4, 4000, link) == doctest::Approx(6e-6));
  CHECK(ring_seconds(CK::reduce_scatter, 4, 4000, link) == doctest::Approx(6e-6));
  CHECK(ring_seconds(CK::all_to_all, 4, 4000, link) == doctest::Approx(6e-6));
  CHECK(ring_seconds(CK::all_reduce, 4, 4000, link) == doctest::Approx(12e-6));
  CHECK(ring_seconds(CK::all_slice, 4, 4000, link) == 0);
  CHECK(ring_seconds(CK::all_reduce, 1, 4000, link) == 0);
  // Measured points: interpolated between them, at the largest one's rate above, the formula below.
  Link measured = link;
  measured.measured = {{1000, 1e-3}, {3000, 5e-3}};
  CHECK(ring_seconds(CK::all_gather, 4, 2000, measured) == doctest::Approx(3e-3));
  CHECK(ring_seconds(CK::all_gather, 4, 3000, measured) == doctest::Approx(5e-3));
  CHECK(ring_seconds(CK::all_gather, 4, 6000, measured) == doctest::Approx(10e-3));
  CHECK(ring_seconds(CK::all_gather, 4, 4000, measured) == doctest::Approx(5e-3 * 4 / 3));
  CHECK(ring_seconds(CK::all_gather, 4, 400, measured) == ring_seconds(CK::all_gather, 4, 400, link));
  // A halo exchange moves its rows one hop, whatever the group: 1 us + 4 us.
  CHECK(ring_seconds(CK::collective_permute, 2, 4000, measured) == doctest::Approx(5e-6));
  CHECK(wire_bytes(CK::collective_permute, 2, 4000) == 4000);
  CHECK(wire_bytes(CK::all_reduce, 4, 4000) == 6000);
  CHECK(wire_bytes(CK::all_gather, 4, 4000) == 3000);
  CHECK(bus_factor(CK::all_reduce, 4) == 1.5);
  CHECK(bus_factor(CK::all_to_all, 4) == 0.75);
}

TEST_CASE("hardware profile: the most specific link rule wins") {
  HardwareProfile hw = unit_profile();
  hw.links = {{"*", "*", 0, {1, 0}},
              {"*", "*", 4, {2, 0}},
              {"*", "reduce_scatter", 0, {3, 0}},
              {"batch", "*", 0, {4, 1e-9}},
              {"model", "*", 0, {5, 2e-9}},
              {"batch", "all_gather", 0, {6, 0}}};
  using CK = CollectiveKind;
  CHECK(hw.link(CK::all_reduce, {"data"}, 2).alpha == 1);
  CHECK(hw.link(CK::all_reduce, {"data"}, 4).alpha == 2);
  CHECK(hw.link(CK::reduce_scatter, {"data"}, 4).alpha == 3);
  CHECK(hw.link(CK::reduce_scatter, {"batch"}, 4).alpha == 4);
  CHECK(hw.link(CK::all_gather, {"batch"}, 4).alpha == 6);
  CHECK(hw.link(CK::all_reduce, {"batch", "model"}, 4).alpha == 5);  // the slower of two axes' links
  hw.links = {{"batch", "*", 0, {}}};
  CHECK_THROWS_WITH_AS(hw.link(CK::all_reduce, {"model"}, 2),
                       "hardware profile 'unit' has no link for all_reduce over {model} (2 devices); add a rule "
                       "with axis \"*\"",
                       UserError);
}

TEST_CASE("cost model: collectives across hosts, in two levels where the mpi backend runs them so") {
  // Hosts of 2 devices: within one, alpha 1 us and 1 ns/byte; between them, 10 us and 10 ns/byte.
  HardwareProfile hw = unit_profile();
  hw.devices_per_host = 2;
  hw.between_hosts = {1e-5, 1e-8, {}};
  using CK = CollectiveKind;
  const double bytes = 4000;
  const Mesh grid{{"batch", 2}, {"model", 2}};  // model pairs {0,1} {2,3} within hosts; batch pairs across them
  // Within a host: 2 (n-1) (alpha + beta S / n) on the host's link = 2 (1 us + 2 us).
  CHECK(collective_seconds({CK::all_reduce, {"model"}}, grid, 0, bytes, hw) == doctest::Approx(6e-6));
  CHECK(collective_seconds({CK::all_reduce, {"model"}}, grid, 3, bytes, hw) == doctest::Approx(6e-6));
  // One member per host: the ring between hosts = 2 (10 us + 20 us).
  CHECK(collective_seconds({CK::all_reduce, {"batch"}}, grid, 1, bytes, hw) == doctest::Approx(60e-6));
  // All 4, 2 per host: within each host (6 us), then across on half the buffer: 2 (10 us + 10 us).
  CHECK(collective_seconds({CK::all_reduce, {"batch", "model"}}, grid, 0, bytes, hw) == doctest::Approx(46e-6));
  // reduce_scatter and all_gather too: within each host (1 us + 2 us), across on half: 10 us + 10 us.
  CHECK(collective_seconds({CK::reduce_scatter, {"batch", "model"}}, grid, 2, bytes, hw) == doctest::Approx(23e-6));
  CHECK(collective_seconds({CK::all_gather, {"batch", "model"}}, grid, 1, bytes, hw) == doctest::Approx(23e-6));
  // Other collectives spanning hosts: one ring over all 4, paced by its hops between hosts: 3 (10 us + 10 us).
  CHECK(collective_seconds({CK::all_to_all, {"batch", "model"}}, grid, 2, bytes, hw) == doctest::Approx(60e-6));
  // A pipeline send: one hop, within a host (stages on devices 0 and 1) or between hosts (0 and 2).
  const Mesh stage_minor{{"batch", 2}, {"stage", 2}}, stage_major{{"stage", 2}, {"batch", 2}};
  Collective send{CK::send, {"stage"}};
  send.peer = 1;
  CHECK(collective_seconds(send, stage_minor, 0, bytes, hw) == doctest::Approx(1e-6 + 4e-6));
  CHECK(collective_seconds(send, stage_major, 0, bytes, hw) == doctest::Approx(1e-5 + 4e-5));
  // Uneven members per host (3 devices a host, a group of 4): one ring paced by the hops between hosts.
  hw.devices_per_host = 3;
  CHECK(collective_seconds({CK::all_reduce, {"batch", "model"}}, grid, 0, bytes, hw) ==
        doctest::Approx(6 * (1e-5 + 1e-5)));
  // Every device on one host: the host's link alone.
  hw.devices_per_host = 0;
  CHECK(collective_seconds({CK::all_reduce, {"batch"}}, grid, 1, bytes, hw) == doctest::Approx(6e-6));

  // The simulator costs each collective so: BP on 4 devices, 2 hosts of 2 vs one host of 4.
  const Program step = train_step([](Tensor x, Tensor y) { return mse(nn::Mlp{"mlp", {8, 16, 8}}(x), y); }, SGD{0.1},
                                  {{"x", {16, 8}}, {"y", {16, 8}}});
  const SpmdProgram bp = lower(partition(step, Mesh{{"batch", 4}}, {data_parallel("batch")}));
  HardwareProfile one_host = unit_profile(), two_hosts = unit_profile();
  two_hosts.devices_per_host = 2;
  two_hosts.between_hosts = hw.between_hosts;
  const Report near = simulate(bp, one_host, {.overlap = false}), far = simulate(bp, two_hosts, {.overlap = false});
  double expected = 0;
  for (const TimedOp* c : near.collectives())
    expected += collective_seconds(*bp.op(c->value).collective, bp.mesh(), 0, c->bytes, two_hosts);
  CHECK(far.communication_seconds == doctest::Approx(expected));
  CHECK(far.communication_seconds > near.communication_seconds);
}

TEST_CASE("cluster profiles: an axis inside a node rides NVLink, across nodes InfiniBand, spanning both in two levels") {
  using CK = CollectiveKind;
  const HardwareProfile selene = HardwareProfile::builtin("a100-80gb-selene");
  CHECK(selene.devices_per_host == 8);
  CHECK(selene.memory_capacity == std::int64_t{80} << 30);
  CHECK(selene.flops_per_second(DType::bf16) == 312e12);
  const double S = 64 << 20, nvlink = 300e9, ib = 25e9;
  // Megatron's placement, tensor parallelism last: each 'tensor' group is one node.
  const Mesh tp_last{{"data", 2}, {"tensor", 8}};
  CHECK(collective_seconds({CK::all_reduce, {"tensor"}}, tp_last, 9, S, selene) ==
        doctest::Approx(2 * 7 * (5e-6 + S / 8 / nvlink)));
  // 'data' pairs device d with d + 8, on the other node: one member per node, the ring between nodes.
  CHECK(collective_seconds({CK::all_reduce, {"data"}}, tp_last, 3, S, selene) == doctest::Approx(2 * (1e-5 + S / 2 / ib)));
  // All 16: within each node over the whole buffer, then between the nodes on an eighth of it.
  CHECK(collective_seconds({CK::all_reduce, {"data", "tensor"}}, tp_last, 0, S, selene) ==
        doctest::Approx(2 * 7 * (5e-6 + S / 8 / nvlink) + 2 * (1e-5 + S / 8 / 2 / ib)));
  // Tensor parallelism first spreads each 'tensor' group over both nodes (4 on each): it costs more.
  const Mesh tp_first{{"tensor", 8}, {"data", 2}};
  CHECK(collective_seconds({CK::all_reduce, {"tensor"}}, tp_first, 0, S, selene) ==
        doctest::Approx(2 * 3 * (5e-6 + S / 4 / nvlink) + 2 * (1e-5 + S / 4 / 2 / ib)));
  CHECK(collective_seconds({CK::all_reduce, {"tensor"}}, tp_first, 0, S, selene) >
        2 * collective_seconds({CK::all_reduce, {"tensor"}}, tp_last, 0, S, selene));
  CHECK(HardwareProfile::builtin("h100-sxm").between_hosts.beta == doctest::Approx(1 / 50e9));
  CHECK(HardwareProfile::builtin("h200").memory_capacity == std::int64_t{141} << 30);
}

TEST_CASE("report: model FLOPs count each GEMM once, hardware FLOPs add remat's; MFU against the dtype's peak; the fit verdict") {
  const std::int64_t B = 16, D = 8, H = 32, N = 4;
  nn::Mlp model{"params/mlp", {D, H, D}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{}, {{"x", {B, D}}, {"y", {B, D}}});
  // Forward x W1 and h W2; backward dW2, dh and dW1 (no gradient of the data x): 2BDH each.
  const double gemm_flops = 5 * 2.0 * B * D * H;
  const HardwareProfile cpu = HardwareProfile::cpu();
  const Report one = simulate(lower(partition(step, Mesh{{"batch", 1}}, {})), cpu);
  CHECK(one.model_flops == gemm_flops);
  CHECK(one.hardware_flops == gemm_flops);
  CHECK(one.flops_dtype == DType::f32);
  CHECK(one.peak_flops == 80e9);
  CHECK(one.mfu() == doctest::Approx(gemm_flops / (one.step_seconds * 80e9)));
  const Report dp = simulate(lower(partition(step, Mesh{{"batch", N}}, {data_parallel("batch")})), cpu);
  CHECK(dp.model_flops == gemm_flops / N);  // per device
  // bf16 compute: the bf16 peak.
  const Program mixed = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{}, {{"x", {B, D}}, {"y", {B, D}}},
                                   MixedPrecision::with_compute(DType::bf16));
  const Report half = simulate(lower(partition(mixed, Mesh{{"batch", 1}}, {})), cpu);
  CHECK(half.flops_dtype == DType::bf16);
  CHECK(half.peak_flops == 160e9);
  CHECK(half.model_flops == gemm_flops);
  // Remat recomputes the blocks' forward GEMMs: the hardware does them twice, the model once.
  const nn::Gpt gpt{{.vocab = 32, .seq = 8, .d_model = 16, .heads = 2, .layers = 2}};
  auto gpt_step = [&](Remat remat) {
    return train_step([&](Tensor t, Tensor y) { return gpt.loss(t, y); }, Adam{},
                      {{"tokens", {4, 8}, DType::i32}, {"targets", {4, 8}, DType::i32}}, StepOptions{.remat = remat});
  };
  const Report plain = simulate(lower(partition(gpt_step(Remat::none()), Mesh{{"batch", 2}}, {data_parallel("batch")})), cpu);
  const Report remat = simulate(lower(partition(gpt_step(Remat::blocks()), Mesh{{"batch", 2}}, {data_parallel("batch")})), cpu);
  CHECK(plain.hardware_flops == plain.model_flops);
  CHECK(remat.model_flops == doctest::Approx(plain.model_flops));
  CHECK(remat.hardware_flops > 1.2 * remat.model_flops);
  CHECK(remat.hfu() > remat.mfu());
  // The verdict flips where the peak meets the capacity.
  HardwareProfile tight = cpu;
  tight.memory_capacity = one.peak_bytes;
  const SpmdProgram single = lower(partition(step, Mesh{{"batch", 1}}, {}));
  CHECK(simulate(single, tight).fits());
  tight.memory_capacity = one.peak_bytes - 1;
  const Report over = simulate(single, tight);
  CHECK(!over.fits());
  std::ostringstream text;
  text << over;
  CHECK(text.str().find("DOES NOT FIT in") != std::string::npos);
  CHECK(text.str().find("MFU ") != std::string::npos);
  CHECK(over.to_json().dump().find("\"fits\":false") != std::string::npos);
}

TEST_CASE("simulate_repeated: one microbatch's tasks replayed predict the step the unrolled program simulates") {
  // A GPT in bf16 with remat, 2 data x 2 pipeline stages, 2 sequences a microbatch. The step of M microbatches
  // simulated from a program of 3 against the program of M: time, bubble, bytes, FLOPs; memory in the band the
  // replay's model holds (each stage's peak plus what more microbatches hold).
  const nn::Gpt gpt{{.vocab = 64, .seq = 16, .d_model = 32, .heads = 2, .layers = 4}};
  auto spmd = [&](int m, const char* schedule) {
    const Program step = train_step([&](Tensor t, Tensor y) { return gpt.loss(t, y); }, Adam{},
                                    {{"tokens", {4 * m, 16}, DType::i32}, {"targets", {4 * m, 16}, DType::i32}},
                                    StepOptions{.precision = MixedPrecision::with_compute(DType::bf16),
                                                .remat = Remat::blocks(), .microbatches = m});
    return lower(partition(step, Mesh{{"batch", 2}, {"stage", 2}}, parse_schedule(schedule)));
  };
  const HardwareProfile hw = HardwareProfile::builtin("a100-80gb-selene");
  for (const char* schedule : {"bp,pp", "bp,pp:gpipe", "bp,pp:zb1"}) {
    const SpmdProgram three = spmd(3, schedule);
    for (int m : {3, 8}) {
      CAPTURE(std::string(schedule));
      CAPTURE(m);
      const Report unrolled = simulate(spmd(m, schedule), hw, {.donate_state = true});
      const Report repeated = simulate_repeated(three, hw, m, {.donate_state = true});
      CHECK(repeated.step_seconds == doctest::Approx(unrolled.step_seconds).epsilon(0.03));
      CHECK(std::abs(repeated.bubble_fraction - unrolled.bubble_fraction) < 0.03);
      CHECK(repeated.wire_bytes == doctest::Approx(unrolled.wire_bytes));  // gradients reduced once a step
      CHECK(repeated.model_flops == doctest::Approx(unrolled.model_flops));
      CHECK(repeated.hardware_flops == doctest::Approx(unrolled.hardware_flops));
      CHECK(repeated.flops_dtype == DType::bf16);
      CHECK(repeated.replayed_microbatches == m);
      CHECK(repeated.timeline.empty());
      CHECK(static_cast<double>(repeated.peak_bytes) == doctest::Approx(static_cast<double>(unrolled.peak_bytes)).epsilon(0.05));
      for (std::size_t s = 0; s < 2; ++s)
        CHECK(repeated.stages[s].busy_seconds == doctest::Approx(unrolled.stages[s].busy_seconds).epsilon(0.03));
    }
  }
  // The accumulated gradients are widened, summed and reduced once: M microbatches move the bytes of 2 in f32;
  // one running sum per gradient: the peak does not grow with the microbatches once 1F1B's are in flight (it grew
  // by a gradient per microbatch when the update summed them all).
  const Report two = simulate(spmd(2, "bp,pp"), hw), four = simulate(spmd(4, "bp,pp"), hw), eight = simulate(spmd(8, "bp,pp"), hw);
  CHECK(eight.wire_bytes == doctest::Approx(two.wire_bytes));
  CHECK(static_cast<double>(eight.peak_bytes) < 1.01 * static_cast<double>(four.peak_bytes));
  CHECK_THROWS_WITH_AS(simulate_repeated(lower(partition(train_step([&](Tensor t, Tensor y) { return gpt.loss(t, y); }, Adam{},
                                                                    {{"tokens", {4, 16}, DType::i32}, {"targets", {4, 16}, DType::i32}}),
                                                         Mesh{{"batch", 2}}, {data_parallel("batch")})),
                                         hw, 8),
                       "simulate_repeated: program 'train_step' is not pipelined (a step without stages is its one "
                       "microbatch pass; simulate it)",
                       UserError);
  CHECK_THROWS_WITH_AS(simulate_repeated(spmd(3, "bp,pp"), hw, 0),
                       "simulate_repeated: 0 microbatches (a step runs at least 1)", UserError);
  CHECK_THROWS_WITH_AS(simulate_repeated(spmd(2, "bp,pp"), hw, 8),
                       "simulate_repeated: program 'train_step' runs 2 microbatches; it needs 3 or more (a microbatch "
                       "between two others stands for each)",
                       UserError);
}

TEST_CASE("hardware profile: JSON round trip, files, built-ins") {
  for (const auto& name : HardwareProfile::builtin_names()) {
    const HardwareProfile hw = HardwareProfile::builtin(name);
    CHECK(hw.name == name);
    CHECK(HardwareProfile::from_json(json::parse(hw.to_json().dump())) == hw);
  }
  HardwareProfile hw = unit_profile();
  hw.name = "odd \"name\"\n\twith escapes";
  hw.links.push_back({"model", "all_to_all", 8, {1.0 / 3, 1e-10 / 7, {{65536, 2e-5}, {1 << 20, 3e-4}}}});
  hw.op_bandwidth = {{OpKind::transpose, 2.5e9}, {OpKind::broadcast_in_dim, 1e10}};
  hw.cache_curve = {{786432, 6.1e10}, {5e7, 1e9}};
  hw.gemm_curve = {{16, 0.3}, {1024, 1}};
  hw.elementwise_flops = {{DType::f32, 9e9}};
  hw.memory_capacity = std::int64_t{141} << 30;
  hw.ring_all_reduce_from = {{2, std::int64_t{16} << 20}, {4, std::numeric_limits<std::int64_t>::max()}};
  hw.devices_per_host = 8;
  hw.between_hosts = {5e-6, 1e-10, {{1 << 20, 1e-4}, {1 << 24, 2e-3}}};
  CHECK(HardwareProfile::from_json(json::parse(hw.to_json().dump(2))) == hw);

  const std::string path = "test_sim_profile.json";
  hw.save(path);
  CHECK(HardwareProfile::load(path) == hw);
  CHECK(HardwareProfile::named(path) == hw);
  std::remove(path.c_str());
  CHECK(HardwareProfile::named("h200-nvlink").memory_capacity == std::int64_t{141} << 30);
  CHECK_THROWS_WITH_AS(HardwareProfile::builtin("tpu"),
                       "no built-in hardware profile 'tpu' (cpu, a100-nvlink, h100-nvlink, h200-nvlink, "
                       "a100-80gb-selene, h100-sxm, h200)", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(R"({"name": "x", "peak_flops": {"fp8": 1}})")),
                       "unknown dtype 'fp8' (expected f32, f64, i32, bf16 or f16)", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(R"({"name": "x", "peak_flops": {}})")),
                       "json: object has no member 'memory_bandwidth'", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(
                           R"({"name": "x", "peak_flops": {}, "memory_bandwidth": 1, "op_bandwidth": {"fft": 1}})")),
                       "unknown op kind 'fft'", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(R"({"name": "x", "peak_flops": {}, "memory_bandwidth": 1,
                           "links": [{"alpha": 0, "beta": 0, "measured": [[2048, 1e-5], [1024, 2e-5]]}]})")),
                       "links: measured: points must increase", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(
                           R"({"name": "x", "peak_flops": {}, "memory_bandwidth": 1, "cache_curve": [[1, 2, 3]]})")),
                       "cache_curve: each point is [bytes, bytes per second]", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(
                           R"({"name": "x", "peak_flops": {}, "memory_bandwidth": 1, "ring_all_reduce_from": {"pair": 1}})")),
                       "hardware profile: ring_all_reduce_from: 'pair' is not a group size (an integer >= 2)", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse(
                           R"({"name": "x", "peak_flops": {}, "memory_bandwidth": 1, "links": [],
                               "devices_per_host": 4})")),
                       "hardware profile 'x': devices_per_host 4 needs a between_hosts link {\"alpha\": seconds, "
                       "\"beta\": seconds per byte}",
                       UserError);
}

TEST_CASE("calibrate: a ring's fit keeps a finite bandwidth when noise orders the samples wrong") {
  // all_reduce on 2 devices: 2 steps of alpha + beta * S / 2.
  const Link fit = calibration::fit_ring({{4096, 2e-5}, {1 << 20, 2.1e-4}}, 2, 2);
  CHECK(fit.alpha > 0);
  CHECK(fit.beta == doctest::Approx((2.1e-4 - 2e-5) / ((1 << 20) - 4096)).epsilon(1e-9));
  // A preempted 4 KiB call slower than the 1 MiB one: through the origin, not an infinitely fast link.
  const Link noisy = calibration::fit_ring({{4096, 3e-4}, {1 << 20, 2.1e-4}}, 2, 2);
  CHECK(noisy.alpha == 0);
  CHECK(noisy.beta > 0);
  CHECK(2 * noisy.beta * (1 << 20) / 2 == doctest::Approx(2.1e-4).epsilon(0.05));  // the large message dominates
}

TEST_CASE("calibrate: devices agree on every figure; the op overhead is the executor's; links per kind and size") {
  const CalibrationOptions quick{.name = "test", .message_bytes = {1 << 12, 1 << 20}, .warmup = 1, .iterations = 2,
                                 .rounds = 1};
  std::vector<HardwareProfile> got(2);
  threads::run(2, [&](threads::Communicator& c) { got[static_cast<std::size_t>(c.device())] = calibrate(c, quick); });
  const HardwareProfile& hw = got[0];
  CHECK(got[1] == hw);
  CHECK(hw.name == "test");
  CHECK(hw.peak_flops.at(DType::f32) > 0);
  CHECK(hw.memory_bandwidth > 0);
  // The cache curve ends with data last touched long ago, beyond where memory_bandwidth was measured.
  REQUIRE(hw.cache_curve.size() >= 2);
  CHECK(hw.cache_curve.back().first > hw.cache_curve[hw.cache_curve.size() - 2].first);
  CHECK(hw.cache_curve[hw.cache_curve.size() - 2].second == hw.memory_bandwidth);
  CHECK(hw.cache_curve.back().second > 0);
  // What execute() adds per op (dispatch, buffers, liveness) is far above a one-element kernel's ~0.1 us.
  CHECK(hw.op_overhead > 2e-7);
  for (const char* kind : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}) {
    const auto rule = std::find_if(hw.links.begin(), hw.links.end(),
                                   [&](const LinkRule& r) { return r.collective == kind && r.group_size == 2; });
    REQUIRE(rule != hw.links.end());
    CHECK(rule->link.measured.size() == quick.message_bytes.size());
    CHECK(rule->link.beta > 0);
  }
  CHECK(hw.ring_all_reduce_from.empty());  // the threads backend has one all_reduce (MPI's: mpi_collectives)
  CHECK(HardwareProfile::from_json(json::parse(hw.to_json().dump())) == hw);
}

TEST_CASE("json: malformed profiles and mistyped members are UserErrors that say where") {
  CHECK_THROWS_WITH_AS(json::parse("[1, 2"),
                       "json: parse error at line 1, column 6: syntax error while parsing array - unexpected end of "
                       "input; expected ']'",
                       UserError);
  CHECK_THROWS_WITH_AS(json::parse("{\"a\": }"),
                       "json: parse error at line 1, column 7: syntax error while parsing value - unexpected '}'; "
                       "expected '[', '{', or a literal",
                       UserError);
  const std::string base = R"("name": "x", "peak_flops": {}, "memory_bandwidth": )";
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse("{" + base + R"("fast", "links": []})")),
                       "json: type must be number, but is string", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse("{" + base + R"(1, "memory_capacity": 1.5, "links": []})")),
                       "json: expected an integer, got 1.5", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse("{" + base + R"(1, "links": {}})")),
                       "json: expected an array, got {}", UserError);
  CHECK_THROWS_WITH_AS(HardwareProfile::from_json(json::parse("[1]")), "json: expected an object, got [1]", UserError);
}

TEST_CASE("simulate: times by hand on a toy step") {
  const Report r = simulate(toy_step(), unit_profile(), {.overlap = false});
  // neg x: 64 B; reduce_sum: 36 B; neg w: 32 B; add: 48 B -> 180 ns of memory traffic at 1 GB/s.
  CHECK(r.compute_seconds == doctest::Approx(180e-9));
  // all_reduce of 4 bytes on 2 devices: 2 (n-1) (alpha + beta S / n) = 2 (1 us + 2 ns).
  CHECK(r.communication_seconds == doctest::Approx(2.004e-6));
  CHECK(r.step_seconds == doctest::Approx(r.compute_seconds + r.communication_seconds));
  CHECK(r.wire_bytes == 4);
  REQUIRE(r.timeline.size() == 5);
  for (std::size_t i = 1; i < r.timeline.size(); ++i)
    CHECK(r.timeline[i].start == doctest::Approx(r.timeline[i - 1].start + r.timeline[i - 1].seconds));
  REQUIRE(r.collectives().size() == 1);
  CHECK(r.collectives()[0]->what == "all_reduce{batch}");
  CHECK(r.flops == 8 + 8 + 4 + 4);
  CHECK_FALSE(r.overlap);
  CHECK(r.hidden_communication_seconds == 0);

  // Two streams: the all_reduce starts when reduce_sum has made its operand (100 ns) and runs while neg w and
  // add compute (80 ns, hidden); the step ends with the all_reduce.
  const Report two = simulate(toy_step(), unit_profile(), {.overlap = true, .stream_min_bytes = 0});
  CHECK(two.overlap);
  CHECK(two.compute_seconds == doctest::Approx(r.compute_seconds));
  CHECK(two.communication_seconds == doctest::Approx(r.communication_seconds));
  CHECK(two.timeline[2].start == doctest::Approx(100e-9));  // the all_reduce
  CHECK(two.timeline[3].start == doctest::Approx(100e-9));  // neg w, beside it
  CHECK(two.step_seconds == doctest::Approx(100e-9 + 2.004e-6));
  CHECK(two.hidden_communication_seconds == doctest::Approx(80e-9));
  // A local op that reads a collective's result waits for it.
  SpmdProgram waits = toy_step();
  const ValueId loss = waits.outputs()[0].value;
  waits.add({local_op(OpKind::neg, {loss}, waits.type(loss))});
  const Report after = simulate(waits, unit_profile(), {.overlap = true, .stream_min_bytes = 0});
  CHECK(after.timeline.back().start == doctest::Approx(100e-9 + 2.004e-6));
  // A CPU's collectives copy on the cores that compute (overlap 0): the compute stream pays their time.
  HardwareProfile shared_cores = unit_profile();
  shared_cores.overlap = 0;
  const Report shared = simulate(toy_step(), shared_cores, {.overlap = true, .stream_min_bytes = 0});
  CHECK(shared.step_seconds == doctest::Approx(r.step_seconds));
  CHECK(shared.timeline[3].start == doctest::Approx(100e-9 + 2.004e-6));  // neg w after the stolen time
  // Below the stream's minimum size, a collective issued while the stream is idle runs inline, serialized.
  const Report small = simulate(toy_step(), unit_profile(), {.overlap = true, .stream_min_bytes = 5});
  CHECK(small.step_seconds == doctest::Approx(r.step_seconds));
  CHECK(small.hidden_communication_seconds < 1e-15);  // rounding of compute + communication - step
}

// The executor runs a chain of elementwise ops as one blocked loop (spmd/fusion.hpp); so does the cost.
TEST_CASE("simulate: a fused elementwise chain is one pass over memory") {
  const TensorType v{{256}};  // 1 KiB
  SpmdProgram p("chain", Mesh{{"batch", 1}});
  auto x = p.add({input_op("x", v, InputKind::data)});
  p.add_input({"x", x, v, Sharding::replicated(1), ""});
  auto square = p.add({local_op(OpKind::mul, {x, x}, v)});
  auto y = p.add({local_op(OpKind::add, {square, x}, v)});
  p.add_output({"y", y, v, Sharding::replicated(1), ""});
  set_fusion(false);
  const Report unfused = simulate(p, unit_profile());
  set_fusion(true);
  const Report fused = simulate(p, unit_profile());
  // Op by op: mul and add each read two operands and write one: 6 KiB at 1 GB/s.
  CHECK(unfused.compute_seconds == doctest::Approx(6 * 1024 / 1e9));
  // Fused: mul only computes (256 FLOPs at 1 GFLOP/s); add reads x once and writes y: 2 KiB.
  CHECK(fused.compute_seconds == doctest::Approx(256 / 1e9 + 2 * 1024 / 1e9));
  CHECK(fused.timeline.at(0).bound == "fused");
  CHECK(fused.timeline.at(0).bytes == 0);
  CHECK(fused.flops == unfused.flops);
  // With an elementwise rate below the GEMM peak, steps pay it: mul 256 FLOPs, and the root's 256 FLOPs now
  // outlast its 2 KiB of memory traffic.
  HardwareProfile vector_bound = unit_profile();
  vector_bound.elementwise_flops[DType::f32] = 0.1e9;
  const Report slow = simulate(p, vector_bound);
  CHECK(slow.compute_seconds == doctest::Approx(2 * 256 / 0.1e9));
  CHECK(slow.timeline.at(1).bound == "compute");
}

// A value two groups read is computed in each (fusion.hpp's producer duplication): its FLOPs count twice.
TEST_CASE("simulate: a value computed again in two groups costs its FLOPs in each") {
  const TensorType v{{256}};  // 1 KiB
  SpmdProgram p("twice", Mesh{{"batch", 1}});
  auto x = p.add({input_op("x", v, InputKind::data)});
  p.add_input({"x", x, v, Sharding::replicated(1), ""});
  auto square = p.add({local_op(OpKind::mul, {x, x}, v)});
  auto y = p.add({local_op(OpKind::add, {square, x}, v)});
  auto z = p.add({local_op(OpKind::sub, {square, x}, v)});
  p.add_output({"y", y, v, Sharding::replicated(1), ""});
  p.add_output({"z", z, v, Sharding::replicated(1), ""});
  const FusionPlan plan = plan_fusion(p);
  CHECK(plan.groups().size() == 2);
  CHECK(plan.copies(square) == 2);
  CHECK(plan.skipped(square));
  HardwareProfile vector_bound = unit_profile();
  vector_bound.elementwise_flops[DType::f32] = 0.1e9;
  const Report r = simulate(p, vector_bound);
  // mul twice (once per group), add and sub once: 4 x 256 FLOPs at 0.1 GFLOP/s, each outlasting its memory.
  CHECK(r.timeline.at(0).flops == 2 * 256);
  CHECK(r.compute_seconds == doctest::Approx(4 * 256 / 0.1e9));
  CHECK(r.peak_bytes == 3 * 1024);  // x, y, z: the square never stored
}

TEST_CASE("simulate: data a step last touched streams at the cache curve's far rate, data just made at its near one") {
  const TensorType v{{256}};  // 1 KiB
  SpmdProgram p("reuse", Mesh{{"batch", 1}});
  auto x = p.add({input_op("x", v, InputKind::data)});
  p.add_input({"x", x, v, Sharding::replicated(1), ""});
  auto a = p.add({local_op(OpKind::add, {x, x}, v)});
  auto b = p.add({local_op(OpKind::add, {a, a}, v)});
  p.add_output({"b", b, v, Sharding::replicated(1), ""});
  // Each add touches 3 KiB, the step 6 KiB: the input was last read a step (6 KiB) ago, `a` just made.
  HardwareProfile hw = unit_profile();
  hw.cache_curve = {{3 * 1024, 1e9}, {6 * 1024, 0.25e9}};
  set_fusion(false);
  const Report r = simulate(p, hw);
  set_fusion(true);
  CHECK(r.timeline.at(0).seconds == doctest::Approx(3 * 1024 / 0.25e9));
  CHECK(r.timeline.at(1).seconds == doctest::Approx(3 * 1024 / 1e9));
}

TEST_CASE("simulate: peak memory from liveness, with its breakdown, equals the executor's") {
  const SpmdProgram p = toy_step();
  const Report r = simulate(p, unit_profile());
  // Inputs 16 + 32 B; neg x adds 32; reduce_sum adds 4 (peak: 84 B), then neg x dies. all_reduce +4 -3 dies,
  // neg w +16, add +16 = 84 again (not above), neg w dies.
  CHECK(r.peak_bytes == 84);
  CHECK(r.peak_at == 3);
  CHECK(r.peak[MemoryKind::parameters] == 16);
  CHECK(r.peak[MemoryKind::data] == 32);
  CHECK(r.peak[MemoryKind::activations] == 36);
  CHECK(r.peak.total() == r.peak_bytes);
  CHECK(r.inputs[MemoryKind::parameters] == 16);
  CHECK(r.inputs[MemoryKind::data] == 32);

  NamedArrays global{{"w", Array({8}, std::vector<float>(8, 1.f))}, {"x", Array({8}, std::vector<float>(8, 2.f))}};
  for (const auto& d : execute_local(p, global)) CHECK(d.peak_bytes == r.peak_bytes);
}

TEST_CASE("donated state: each old piece is freed after its last read; the peak as predicted, the results unchanged") {
  nn::Mlp model{"params/mlp", {8, 64, 8}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{},
                                  {{"x", {16, 8}}, {"y", {16, 8}}});
  const HardwareProfile hw = HardwareProfile::cpu();
  const NamedArrays global = init_inputs(step, 0, true);
  const NamedArrays batch{{"x", global.at("x")}, {"y", global.at("y")}};
  for (const bool zero : {false, true}) {
    CAPTURE(zero);
    Schedule schedule{data_parallel("batch")};
    if (zero) schedule.push_back(zero3("batch"));
    const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 2}}, schedule));
    const Report kept = simulate(spmd, hw), donated = simulate(spmd, hw, {.donate_state = true});
    // Under DP the peak is the update, where old and new state met: it drops by more than the parameters'
    // bytes (26844 -> 21904 B). ZeRO-3's peak is a gathered layer in the backward pass, which donation leaves.
    if (zero) CHECK(donated.peak_bytes == kept.peak_bytes);
    else CHECK(donated.peak_bytes < kept.peak_bytes - kept.inputs[MemoryKind::parameters]);
    // Each device: two steps through Executable::step (donating) and through execute() keeping its inputs.
    std::vector<std::vector<std::int64_t>> peaks(2), kept_peaks(2);
    std::vector<NamedArrays> stepped(2), plain(2);
    threads::run(2, [&](threads::Communicator& c) {
      const auto d = static_cast<std::size_t>(c.device());
      const Executable<threads::Communicator> exe(spmd, c);
      NamedArrays state = exe.shard_state(global), inputs = state;
      for (const auto& b : spmd.inputs())
        if (!is_state(spmd, b)) inputs[b.name] = layout::shard(batch.at(b.name), b.sharding, spmd.mesh(), c.device());
      for (int s = 0; s < 2; ++s) {
        peaks[d].push_back(exe.step(state, batch).peak_bytes);
        DeviceResult r = execute(spmd, c, inputs, {.global_inputs = false, .global_outputs = false});
        kept_peaks[d].push_back(r.peak_bytes);
        for (const auto& o : spmd.outputs())
          if (!o.updates.empty()) inputs[o.updates] = std::move(r.outputs.at(o.name));
      }
      stepped[d] = std::move(state);
      plain[d] = std::move(inputs);
    });
    for (std::size_t d = 0; d < 2; ++d) {
      CHECK(peaks[d] == std::vector<std::int64_t>(2, donated.peak_bytes));
      CHECK(kept_peaks[d] == std::vector<std::int64_t>(2, kept.peak_bytes));
      for (const auto& [name, a] : stepped[d]) CHECK_MESSAGE(a == plain[d].at(name), name);  // bitwise
    }
  }
}

TEST_CASE("execute: the measured timeline names the ops the simulator names, in program order") {
  const SpmdProgram p = toy_step();
  const Report r = simulate(p, unit_profile());
  const NamedArrays global{{"w", Array({8}, std::vector<float>(8, 1.f))}, {"x", Array({8}, std::vector<float>(8, 2.f))}};
  CHECK(execute_local(p, global).at(0).timeline.empty());  // off unless asked for
  std::vector<std::vector<OpTiming>> timelines(2);
  threads::run(2, [&](threads::Communicator& c) {
    NamedArrays local;
    for (const auto& b : p.inputs()) local[b.name] = layout::shard(global.at(b.name), b.sharding, p.mesh(), c.device());
    timelines[static_cast<std::size_t>(c.device())] =
        execute(p, c, local, {.global_inputs = false, .global_outputs = false, .timeline = true}).timeline;
  });
  const FusionPlan fusion = plan_fusion(p);
  std::vector<std::string> simulated;  // a fused chain runs (and is timed) at its root
  for (const auto& t : r.timeline)
    if (fusion.runs_at(t.value)) simulated.push_back(t.what + " " + t.label);
  for (std::int64_t d = 0; d < 2; ++d) {
    const auto events = trace_events(p, timelines[static_cast<std::size_t>(d)], d);
    std::vector<std::string> measured;
    for (const auto& e : events) measured.push_back(e.name);
    CHECK(measured == simulated);
    std::map<std::string, double> track_free;  // each track runs its ops one after another
    for (std::size_t i = 0; i < events.size(); ++i) {
      CHECK(events[i].device == d);
      CHECK(events[i].seconds >= 0);
      CHECK(events[i].category == (events[i].name.starts_with("all_reduce") ? "communication" : "compute"));
      CHECK(events[i].start >= track_free[events[i].category] - 1e-9);
      track_free[events[i].category] = events[i].start + events[i].seconds;
    }
  }
}

TEST_CASE("report: JSON and Chrome trace are well-formed") {
  const Report r = simulate(toy_step(), unit_profile());
  const json::Value v = json::parse(r.to_json().dump(2));
  CHECK(v.at("step_seconds").get<double>() == doctest::Approx(r.step_seconds));
  CHECK(v.at("memory").at("peak_bytes") == 84);
  CHECK(v.at("memory").at("breakdown").at("activations") == 36);
  CHECK(v.at("timeline").size() == 5);
  CHECK(v.at("time_model") == (r.overlap ? "compute and communication on two streams, overlapped"
                                          : "compute and communication serialized"));
  CHECK(v.at("hidden_communication_seconds").get<double>() == doctest::Approx(r.hidden_communication_seconds));

  const json::Value trace = json::parse(chrome_trace(r, 2).dump());
  int spans = 0, on_comm_track = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    ++spans;
    on_comm_track += e.at("tid") == 1;
    CHECK(e.at("dur").get<double>() >= 0);
  }
  CHECK(spans == 10);
  CHECK(on_comm_track == 2);

  std::ostringstream table;
  table << r;
  CHECK(table.str().find(r.overlap ? "compute and communication on two streams" : "compute and communication serialized") !=
        std::string::npos);
  CHECK(table.str().find("all_reduce{batch}") != std::string::npos);
}

TEST_CASE("ZeRO on a lowered MLP train step: collective bytes and model-state memory") {
  const std::int64_t B = 16, D = 8, H = 32, N = 4;
  nn::Mlp model{"params/mlp", {D, H, D}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{},
                                  {{"x", {B, D}}, {"y", {B, D}}});
  const Mesh mesh{{"batch", N}};
  const SpmdProgram dp_plan = lower(partition(step, mesh, {data_parallel("batch")}));
  const SpmdProgram z2_plan = lower(partition(step, mesh, {data_parallel("batch"), zero2("batch")}));
  const SpmdProgram z3_plan = lower(partition(step, mesh, {data_parallel("batch"), zero3("batch")}));
  const HardwareProfile hw = HardwareProfile::cpu();
  const Report dp = simulate(dp_plan, hw), zero2 = simulate(z2_plan, hw), zero3 = simulate(z3_plan, hw);

  // Bytes each device sends for the parameters; the loss's scalar all_reduce is left out.
  auto parameter_wire_bytes = [](const SpmdProgram& p, const Report& r) {
    double bytes = 0;
    for (const auto* c : r.collectives())
      if (p.type(c->value).rank() > 0) bytes += c->wire_bytes;
    return bytes;
  };
  const double psi = (D * H + H + H * D + D) * 4;  // parameter bytes
  CHECK(parameter_wire_bytes(dp_plan, dp) == doctest::Approx(2 * psi * (N - 1) / N));
  CHECK(parameter_wire_bytes(z2_plan, zero2) == doctest::Approx(parameter_wire_bytes(dp_plan, dp)));

  // Model state per device: parameters 1/N, Adam's m and v 1/N (its step counter is one scalar).
  CHECK(zero3.inputs[MemoryKind::parameters] * N == dp.inputs[MemoryKind::parameters]);
  CHECK(zero3.inputs[MemoryKind::optimizer_state] - 4 == (dp.inputs[MemoryKind::optimizer_state] - 4) / N);
  CHECK(zero2.inputs[MemoryKind::optimizer_state] - 4 == (dp.inputs[MemoryKind::optimizer_state] - 4) / N);
  CHECK(zero2.inputs[MemoryKind::parameters] == dp.inputs[MemoryKind::parameters]);

  // What the executor measures agrees with the prediction, device by device.
  const NamedArrays global = init_inputs(step, 0, true);
  for (const auto* plan : {&dp_plan, &z3_plan}) {
    const std::int64_t predicted = simulate(*plan, hw).peak_bytes;
    for (const auto& d : execute_local(*plan, global)) CHECK(d.peak_bytes == predicted);
  }
}

// Mixed-precision Adam (bf16 compute, f32 master weights): the ZeRO paper's 16 bytes per parameter are 2 (the
// 16-bit copy) + 2 (its 16-bit gradient) + 12 (f32 master weights, m and v). The 12 persist: 1/N of them under
// ZeRO-3; the 16-bit copy is cast on each device's shard, so it is 1/N as well before its all_gather.
TEST_CASE("ZeRO under mixed precision: 12 persistent bytes per parameter, 16-bit copies of 2, all 1/N under ZeRO-3") {
  const std::int64_t B = 16, D = 8, H = 32, N = 4;
  nn::Mlp model{"params/mlp", {D, H, D}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{},
                                  {{"x", {B, D}}, {"y", {B, D}}}, MixedPrecision::with_compute(DType::bf16));
  const std::int64_t params = D * H + H + H * D + D;
  const Mesh mesh{{"batch", N}};
  const SpmdProgram dp_plan = lower(partition(step, mesh, {data_parallel("batch")}));
  const SpmdProgram z3_plan = lower(partition(step, mesh, {data_parallel("batch"), zero3("batch")}));
  const HardwareProfile hw = HardwareProfile::cpu();
  const Report dp = simulate(dp_plan, hw), zero3 = simulate(z3_plan, hw);
  auto model_state = [](const Report& r) {
    return r.inputs[MemoryKind::parameters] + r.inputs[MemoryKind::optimizer_state] - 4;  // Adam's step scalar
  };
  CHECK(model_state(dp) == 12 * params);
  CHECK(model_state(zero3) * N == 12 * params);
  // Every 16-bit cast of a parameter, resident or not at the peak: in the forward pass, and made again for the
  // backward pass rather than kept (remat.hpp's cheap values): the second weight's, which the hidden layer's
  // gradient reads (the data need none).
  auto copies = [](const SpmdProgram& p, bool again) {
    std::int64_t bytes = 0;
    for (ValueId v = 0; v < p.size(); ++v)
      if (p.op(v).op.kind == OpKind::convert && p.op(v).op.type.dtype == DType::bf16 &&
          p.op(p.op(v).op.operands[0]).op.attrs.input_kind == InputKind::parameter &&
          p.op(p.op(v).op.operands[0]).op.kind == OpKind::input && !p.op(p.op(v).op.operands[0]).collective &&
          p.op(v).op.name.starts_with("remat(cheap)") == again)
        bytes += p.type(v).bytes();
    return bytes;
  };
  CHECK(copies(dp_plan, false) == 2 * params);
  CHECK(copies(z3_plan, false) * N == 2 * params);
  CHECK(copies(dp_plan, true) == 2 * H * D);
  CHECK(copies(z3_plan, true) * N == 2 * H * D);
  // Gradients travel in bf16: 2 bytes per parameter into the all_reduce (DP) or the reduce_scatter (ZeRO-3).
  auto gradient_bytes = [](const SpmdProgram& p, CollectiveKind kind) {
    std::int64_t bytes = 0;
    for (const auto& c : p.collectives())
      if (c.collective.kind == kind && c.operand.rank() > 0) bytes += c.operand.bytes();
    return bytes;
  };
  CHECK(gradient_bytes(dp_plan, CollectiveKind::all_reduce) == 2 * params);
  CHECK(gradient_bytes(z3_plan, CollectiveKind::reduce_scatter) == 2 * params);
  // Predicted peak = measured, device by device.
  const NamedArrays global = init_inputs(step, 0, true);
  for (const auto* plan : {&dp_plan, &z3_plan}) {
    const std::int64_t predicted = simulate(*plan, hw).peak_bytes;
    for (const auto& d : execute_local(*plan, global)) CHECK(d.peak_bytes == predicted);
  }
}

// ZeRO-3 gathers each parameter for the forward pass and again for the backward pass, and reduce-scatters
// its gradient: 2 psi + the bytes the backward pass reads, against data parallelism's 2 psi (all_reduce).
// The ZeRO paper's 1.5x assumes the backward pass reads every parameter; here it reads only w2 (the
// gradient of h = relu(x w1 + b1) needs w2; x is data, so w1 and the biases are not read).
TEST_CASE("ZeRO-3 moves the ZeRO paper's bytes: gathers per pass, reduce-scatters gradients") {
  const std::int64_t B = 16, D = 8, H = 32, N = 4;
  nn::Mlp model{"params/mlp", {D, H, D}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{},
                                  {{"x", {B, D}}, {"y", {B, D}}});
  const Mesh mesh{{"batch", N}};
  const SpmdProgram dp_plan = lower(partition(step, mesh, {data_parallel("batch")}));
  const SpmdProgram z3_plan = lower(partition(step, mesh, {data_parallel("batch"), zero3("batch")}));
  const HardwareProfile hw = HardwareProfile::cpu();
  auto parameter_wire_bytes = [&](const SpmdProgram& p) {
    const Report r = simulate(p, hw);
    double bytes = 0;
    for (const auto* c : r.collectives())
      if (p.type(c->value).rank() > 0) bytes += c->wire_bytes;
    return bytes;
  };
  const double psi = (D * H + H + H * D + D) * 4, w2 = H * D * 4, ring = static_cast<double>(N - 1) / N;
  CHECK(parameter_wire_bytes(dp_plan) == doctest::Approx(2 * psi * ring));
  CHECK(parameter_wire_bytes(z3_plan) == doctest::Approx((2 * psi + w2) * ring));
}

TEST_CASE("buckets: one latency instead of one per gradient, the same wire bytes, and the peak still as measured") {
  nn::Mlp model{"params/mlp", {8, 16, 16, 16, 16, 8}};  // 10 parameters, all small
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{}, {{"x", {16, 8}}, {"y", {16, 8}}});
  const Partitioned plan = partition(step, Mesh{{"batch", 4}}, {data_parallel("batch")});
  const SpmdProgram plain = lower(plan), bucketed = lower(plan, {.bucket_bytes = 1 << 20});
  const HardwareProfile hw = HardwareProfile::cpu();
  const Report a = simulate(plain, hw), b = simulate(bucketed, hw);
  REQUIRE(plain.collectives().size() == 11);  // and the loss
  REQUIRE(bucketed.collectives().size() == 1);
  CHECK(b.wire_bytes == doctest::Approx(a.wire_bytes));
  // Small messages cost their latency: eleven all_reduces pay it eleven times, the bucket once.
  CHECK(b.communication_seconds * 5 < a.communication_seconds);
  for (const auto& d : execute_local(bucketed, init_inputs(step, 0, true))) CHECK(d.peak_bytes == b.peak_bytes);
}
