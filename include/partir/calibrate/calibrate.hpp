#pragma once
// calibrate(comm): measures the machine a Communicator runs on and returns a HardwareProfile whose figures
// are what an SPMD step pays there. Every device calls it at the same time (it issues collectives), so
// compute is measured with all devices busy at once, as in a real step (devices that share cores or memory
// bandwidth see their share). Measured:
//   - peak FLOP/s per dtype and the GEMM curve: dot_general through the CPU kernels on GEMMs whose
//     smallest dim runs from 16 to 1024, on cold operands;
//   - elementwise FLOP/s per dtype: the steps of a fused elementwise chain on data in cache;
//   - memory bandwidth: an elementwise add, counting both reads and the write, from cache-sized arrays to
//     arrays larger than the caches, and over data last touched long ago (the cache curve); the strided
//     copies broadcast_in_dim and transpose on large arrays, whose kernels stream at other rates;
//   - op overhead: what the executor pays per op besides the kernel's work (dispatch, buffers, liveness), the
//     slope between chains of 1 and 65 ops on one element, run by execute() (devices sharing cores pay more);
//   - alpha-beta per collective kind and group size: the executor's own collective path (the communicator
//     plus its staging copies), each call made as a step makes it, on cold buffers (collective_seconds),
//     fitted to the ring formula over a range of message sizes with relative least squares;
//   - backends with two all_reduce algorithms (MPI): from which size partir's ring beats the library's, per
//     group size (tune_collectives makes a communicator choose by it).
// Each figure is the best of several rounds: what the machine does when nothing else runs on it (or, with
// CalibrationOptions::typical, the median round).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "partir/dsl/ops.hpp"
#include "partir/dsl/trace.hpp"
#include "partir/runtime/exec/executor.hpp"
#include "partir/runtime/state/init.hpp"
#include "partir/runtime/kernels/elements.hpp"
#include "partir/runtime/kernels/eval.hpp"
#include "partir/runtime/kernels/gemm_engine.hpp"
#include "partir/sim/cost_model.hpp"
#include "partir/spmd/lower.hpp"
#include "partir/tactics/partition.hpp"

namespace partir {

struct CalibrationOptions {
  std::string name = "calibrated";
  std::vector<std::int64_t> message_bytes = {1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24};
  int warmup = 2;
  int iterations = 5;
  int rounds = 5;  // each figure is the best round: on a shared machine, noise only ever adds time
  // Instead the median round: what a step typically meets on a shared machine rather than its best (a
  // prediction compared with a measured median).
  bool typical = false;
  // ChoosesAllReduce backends: the buffer sizes at which both all_reduce algorithms are timed.
  std::vector<std::int64_t> all_reduce_choice_bytes = {1 << 20, 1 << 22, 1 << 24, 1 << 25, 1 << 26};
};

namespace calibration {

// The largest of every device's `x` (a step waits for its slowest device), the same on all devices.
template <Communicator C>
double max_over_devices(C& comm, double x) {
  Group world;
  for (int d = 0; d < comm.num_devices(); ++d) world.devices.push_back(d);
  std::vector<double> all(static_cast<std::size_t>(comm.num_devices()));
  comm.all_gather(world, &x, all.data(), 1, DType::f64);
  return *std::max_element(all.begin(), all.end());
}

// Seconds per call of fn, all devices starting together, as nccl-tests times: warm-up calls, a barrier,
// then the mean of `iterations` back-to-back calls; the slowest device's figure.
template <Communicator C, class Fn>
double seconds_per_call(C& comm, int warmup, int iterations, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) fn();
  // A backend whose calls return before the work is done (NCCL on device buffers) says when it is done.
  if constexpr (requires { comm.synchronize(); }) comm.synchronize();
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return max_over_devices(comm, t / iterations);
}

// The best (o.typical: the median) of o.rounds rounds of seconds_per_call.
template <Communicator C, class Fn>
double best_seconds_per_call(C& comm, const CalibrationOptions& o, int iterations, Fn&& fn) {
  std::vector<double> rounds;
  for (int r = 0; r < std::max(o.rounds, 1); ++r) rounds.push_back(seconds_per_call(comm, o.warmup, iterations, fn));
  std::sort(rounds.begin(), rounds.end());
  return o.typical ? rounds[rounds.size() / 2] : rounds.front();
}

// alpha, beta of the ring formula `steps * (alpha + beta * S / n)` closest to the samples (S, t) in
// relative error (weights 1/t^2), so that small messages (latency) and large ones (bandwidth) count alike.
// A negative intercept (latency below timer noise) or slope (a small message slowed by a preemption past a large
// one, on a loaded machine) is fitted through the origin instead: a link always has a finite bandwidth.
inline Link fit_ring(const std::vector<std::pair<double, double>>& samples, double steps, double n) {
  double sw = 0, sx = 0, sxx = 0, sy = 0, sxy = 0;
  for (auto [s, t] : samples) {
    const double w = 1 / (t * t);
    sw += w, sx += w * s, sxx += w * s * s, sy += w * t, sxy += w * s * t;
  }
  const double det = sw * sxx - sx * sx;
  double intercept = (sxx * sy - sx * sxy) / det, slope = (sw * sxy - sx * sy) / det;
  if (intercept < 0 || slope <= 0) intercept = 0, slope = sxy / sxx;
  return {intercept / steps, slope * n / steps};
}

inline Op dot_op(std::int64_t m, std::int64_t n, DType t) {
  Attrs a;
  a.dot = {{}, {}, {1}, {0}};
  return Op{OpKind::dot_general, {0, 1}, a, {{m, n}, t}, ""};
}

// How many sets of `bytes` each a measurement rotates over so that a set comes back only after 192 MiB of the
// others: data a step last touched before the rest of the step ran, which no cache holds any more (cold_point).
inline std::size_t cold_sets(double bytes) {
  return static_cast<std::size_t>(std::clamp(std::ceil(192.0 * (1 << 20) / bytes), 2.0, 64.0));
}

// GEMMs [d, 1024] x [1024, 1024] for a smallest dim d from 16 to 1024: the fastest rate is the peak, and
// each d's fraction of it a point of the GEMM curve. On cold operands, as a step's GEMMs meet their weights (and
// mostly their activations): bf16 on AMX here 2000 GFLOP/s on the same operands, 1600-1750 on cold ones (f32 -4%).
template <Communicator C>
void measure_gemms(C& comm, DType t, const CalibrationOptions& o, HardwareProfile& hw) {
  std::vector<std::pair<double, double>> rates;
  for (std::int64_t d : {16, 64, 256, 1024}) {
    const std::int64_t k = 1024, n = 1024;
    const TensorType lhs{{d, k}, t}, rhs{{k, n}, t};
    const std::size_t sets = cold_sets(static_cast<double>(lhs.bytes() + rhs.bytes()));
    std::vector<Array> lhss, rhss;
    for (std::size_t i = 0; i < sets; ++i) lhss.emplace_back(lhs), rhss.emplace_back(rhs);
    const Op op = dot_op(d, n, t);
    std::size_t next = 0;
    const double s = best_seconds_per_call(comm, o, o.iterations, [&] {
      const std::array<const Array*, 2> operands{&lhss[next], &rhss[next]};
      next = (next + 1) % sets;
      (void)eval(op, operands);
    });
    rates.emplace_back(static_cast<double>(d), 2.0 * static_cast<double>(d * k * n) / s);
  }
  double peak = 0;
  for (const auto& [d, rate] : rates) peak = std::max(peak, rate);
  hw.peak_flops[t] = peak;
  if (t != DType::f32) return;  // one curve: the shape effect is the blocking's, whatever the dtype
  hw.gemm_curve.clear();
  for (const auto& [d, rate] : rates) hw.gemm_curve.emplace_back(d, rate / peak);
}

// A fused chain of `steps` elementwise steps over one input of `elements` ones, cycling through mul, add,
// div and sqrt (an optimizer update's mix); every step reads the previous one and the input.
inline FusionGroup elementwise_chain(int steps, std::int64_t elements, DType t) {
  FusionGroup g{.root = steps, .type = {{elements}, t}, .inputs = {{0, 1, 0}}, .steps = {}};
  const OpKind kinds[] = {OpKind::mul, OpKind::add, OpKind::div, OpKind::sqrt};
  for (int s = 0; s < steps; ++s) {
    const OpKind k = kinds[s % 4];
    const int previous = s == 0 ? -1 : s - 1;
    g.steps.push_back({s + 1, k, CompareDir::eq, k == OpKind::sqrt ? std::vector<int>{previous} : std::vector<int>{previous, -1}});
  }
  return g;
}

// FLOP/s of elementwise steps inside a fused chain, on data in cache: the slope between a chain of 9 steps
// and one of 1, so that reading the input and writing the result cancel out.
template <Communicator C>
double elementwise_flops_per_second(C& comm, DType t, const CalibrationOptions& o) {
  const std::int64_t elements = std::int64_t{1} << 15;  // 128 KiB in f32: in L2 with the chain's tiles
  Array x(TensorType{{elements}, t});
  kernels::visit_dtype(t, [&](auto zero) { std::fill_n(kernels::ptr<decltype(zero)>(x), elements, decltype(zero)(1.0f)); });
  const std::array<const Array*, 1> inputs{&x};
  auto seconds = [&](int steps) {
    const FusionGroup g = elementwise_chain(steps, elements, t);
    return best_seconds_per_call(comm, o, o.iterations * 10, [&] { (void)eval_fused(g, inputs); });
  };
  const double one = seconds(1), nine = seconds(9);
  return nine > one ? 8.0 * static_cast<double>(elements) / (nine - one) : 9.0 * static_cast<double>(elements) / nine;
}

// The cache curve's point for data no cache holds any more (a step's parameters and optimizer state, read once
// a step): an add over arrays of type t that cycles through 4 sets of them, so that between two uses of a set the
// device touches all 4. {those bytes, bytes/s}. The curve's largest working set (48 MiB) still streams from a
// cache here (26 GB/s on one core), 4 of them from memory (12-14 GB/s).
template <Communicator C>
std::pair<double, double> cold_point(C& comm, const TensorType& t, const CalibrationOptions& o) {
  const auto sets = static_cast<int>(cold_sets(3.0 * static_cast<double>(t.bytes())));  // 4 of 48 MiB
  std::vector<Array> lhs, rhs;
  for (int i = 0; i < sets; ++i) lhs.emplace_back(t), rhs.emplace_back(t);
  const Op add{OpKind::add, {0, 1}, {}, t, ""};
  int next = 0;
  const double s = best_seconds_per_call(comm, o, std::max(o.iterations, sets), [&] {
    const std::array<const Array*, 2> operands{&lhs[static_cast<std::size_t>(next)], &rhs[static_cast<std::size_t>(next)]};
    next = (next + 1) % sets;
    (void)eval(add, operands);
  });
  const double bytes = 3.0 * static_cast<double>(t.bytes());
  return {bytes * sets, bytes / s};
}

// Seconds of one op on zero-filled operands of the given types.
template <Communicator C>
double op_seconds(C& comm, const Op& op, const std::vector<TensorType>& operand_types, const CalibrationOptions& o,
                  int iterations) {
  std::vector<Array> arrays;
  for (const auto& t : operand_types) arrays.emplace_back(t);
  std::vector<const Array*> operands;
  for (const auto& a : arrays) operands.push_back(&a);
  return best_seconds_per_call(comm, o, iterations, [&] { (void)eval(op, operands); });
}

// Bytes per second of an op kind, counted as the cost model counts them (operands read, result written).
template <Communicator C>
double op_bandwidth(C& comm, const Op& op, const std::vector<TensorType>& operand_types, const CalibrationOptions& o) {
  double bytes = static_cast<double>(op.type.bytes());
  for (const auto& t : operand_types) bytes += static_cast<double>(t.bytes());
  return bytes / op_seconds(comm, op, operand_types, o, o.iterations);
}

// Seconds execute() spends per op besides its kernel's work: the slope between programs of 1 and 65 chained
// 1x1 matmuls (ops that do not fuse), replicated on every device, each run as an Executable runs it (its
// fusion planned once).
template <Communicator C>
double executor_op_seconds(C& comm, const CalibrationOptions& o) {
  const Mesh mesh{{"devices", comm.num_devices()}};
  auto seconds = [&](int ops) {
    const Program chain = trace("chain", [ops](Tensor x) {
      Tensor y = x;
      for (int i = 0; i < ops; ++i) y = matmul(y, x);
      return y;
    }, {{"x", {1, 1}}});
    const SpmdProgram spmd = lower(partition(chain, mesh, {}));
    const NamedArrays inputs = init_inputs(chain, 0, true);
    const ExecutionPlan plan(spmd);
    return best_seconds_per_call(comm, o, o.iterations * 20, [&] {
      (void)execute(plan, comm, inputs, {.global_inputs = false, .global_outputs = false});
    });
  };
  const double one = seconds(1), more = seconds(65);
  return std::max(more - one, 0.0) / 64;
}

// A collective of `kind` over groups of n consecutive devices moving a buffer of about `bytes`, and the
// local types it takes and makes: what run_collective is given.
struct CollectiveCase {
  Mesh mesh;
  Collective collective;
  TensorType operand, result;
};

inline CollectiveCase collective_case(CollectiveKind kind, std::int64_t n, std::int64_t devices, std::int64_t bytes) {
  const std::int64_t per_tile = std::max<std::int64_t>(bytes / 4 / (n * n), 1);  // elements
  const std::int64_t full = per_tile * n * n;
  CollectiveCase c{Mesh{{"rest", devices / n}, {"group", n}}, {kind, {"group"}}, {{full}}, {{full}}};
  switch (kind) {
    case CollectiveKind::all_gather: c.collective.dim = 0, c.operand = {{full / n}}; break;
    case CollectiveKind::reduce_scatter: c.collective.dim = 0, c.result = {{full / n}}; break;
    case CollectiveKind::all_to_all:
      c.collective.dim = 0, c.collective.to_dim = 1;
      c.operand = {{n, per_tile * n}}, c.result = {{n * n, per_tile}};
      break;
    default: break;
  }
  return c;
}

// One call of c as a step runs it: its result buffer goes back to the cache for the next call, which a fresh
// buffer would pay to fault in (64 MiB here: 10x the collective's own time).
template <Communicator C>
void run_case(const CollectiveCase& c, const Array& in, C& comm) {
  kernels::buffer_cache().give(detail::run_collective(c.collective, in, c.result, c.mesh, comm));
}

// Seconds of one call of c as a step meets it. Each device arrives from compute of its own (a short fused chain
// on data in cache, like the ops between a step's collectives), not in lockstep from the previous call; the
// compute's own time, measured alone, is taken off. Devices that share cores then pay what a step pays, the
// wake-up and the wait for a peer the scheduler has parked, which back-to-back calls hide (4 devices on 2 cores,
// a 37 KiB all_gather on 2: 15-20 us back to back, 45-80 us after compute, 88 us in the demo's step). And the
// buffers are cold, as a step's are (the rest of the step ran since its operand was made and its result buffer
// last used): calls rotate over cold_sets pairs of them. 16 MiB on 2 devices here: a reduce_scatter 1.4 ms on
// the same buffers, 2.8 ms on cold ones, 2.3 ms in the MLP step. An all_reduce runs in place, as the executor
// runs a gradient's.
template <Communicator C>
double collective_seconds(C& comm, const CollectiveCase& c, const CalibrationOptions& o) {
  const bool in_place = c.collective.kind == CollectiveKind::all_reduce;
  const std::size_t pairs = cold_sets(static_cast<double>(c.operand.bytes() + (in_place ? 0 : c.result.bytes())));
  std::vector<Array> operands, results;
  for (std::size_t i = 0; i < pairs; ++i) {
    operands.emplace_back(c.operand);
    if (!in_place) results.emplace_back(c.result);
  }
  std::size_t next = 0;
  auto call = [&](const CollectiveCase& k) {
    Array& in = operands[next];
    detail::run_collective_into(k.collective, in, in_place ? in : results[next], k.mesh, comm);
    next = (next + 1) % pairs;
  };
  const std::int64_t elements = std::int64_t{1} << 14;
  Array x(TensorType{{elements}});
  std::fill_n(kernels::ptr<float>(x), elements, 1.0f);
  const std::array<const Array*, 1> inputs{&x};
  const FusionGroup work = elementwise_chain(16, elements, DType::f32);
  auto compute = [&] { (void)eval_fused(work, inputs); };
  // Groups of consecutive devices, then of devices as far apart (a 2x2 mesh's model and batch groups): peers
  // change from call to call, as in a step, so no pair of devices settles into sharing the cores between them.
  CollectiveCase strided = c;
  strided.mesh = Mesh{{"group", c.mesh.axis_size("group")}, {"rest", c.mesh.axis_size("rest")}};
  bool consecutive = true;
  auto compute_then_collective = [&] {
    compute();
    call(consecutive ? c : strided);
    consecutive = !consecutive;
  };
  // Rounds of a millisecond or more: a scheduler's wake-ups and parked peers average out over many calls.
  const double once = seconds_per_call(comm, 1, 1, compute_then_collective);
  const int iterations = std::max(o.iterations, static_cast<int>(std::min(1e-3 / std::max(once, 1e-9), 100.0)));
  const double alone = best_seconds_per_call(comm, o, iterations, compute);
  const double both = best_seconds_per_call(comm, o, iterations, compute_then_collective);
  // Noise can take more off than the collective took (a fast one after slow compute): its back-to-back time then.
  if (both > alone) return both - alone;
  return best_seconds_per_call(comm, o, iterations, [&] { call(c); });
}

// Where partir's ring overtakes the library's all_reduce on groups of n (a ChoosesAllReduce backend): both are
// timed at each of o.all_reduce_choice_bytes; returns the smallest size from which the ring was as fast or
// faster at every larger size tried (ring_all_reduce_never: at none). The communicator's own choice is kept.
template <ChoosesAllReduce C>
std::int64_t ring_all_reduce_from(C& comm, std::int64_t n, const CalibrationOptions& o) {
  const int group_size = static_cast<int>(n);
  const std::int64_t before = comm.ring_all_reduce_from(group_size);
  // The choice serves groups the host's shared memory does not (those across hosts): MPI's paths are timed.
  constexpr bool has_shared_memory = requires { comm.set_shared_memory(false); };
  bool shared_before = false;
  if constexpr (has_shared_memory) shared_before = comm.shared_memory_enabled(), comm.set_shared_memory(false);
  std::vector<std::pair<std::int64_t, bool>> ring_wins;  // by size, ascending
  for (auto bytes : o.all_reduce_choice_bytes) {
    const auto c = collective_case(CollectiveKind::all_reduce, n, comm.num_devices(), bytes);
    const Array in(c.operand);
    auto time = [&](std::int64_t ring_from) {
      comm.set_ring_all_reduce_from(group_size, ring_from);
      // One call per round: large ones take tens of milliseconds (Open MPI's 64 MiB one ~200 ms here).
      return best_seconds_per_call(comm, {.warmup = 1, .rounds = o.rounds, .typical = o.typical}, 1,
                                   [&] { run_case(c, in, comm); });
    };
    const double library = time(ring_all_reduce_never), ring = time(0);
    ring_wins.emplace_back(c.operand.bytes(), ring <= library);
  }
  comm.set_ring_all_reduce_from(group_size, before);
  if constexpr (has_shared_memory) comm.set_shared_memory(shared_before);
  std::sort(ring_wins.begin(), ring_wins.end());
  std::int64_t from = ring_all_reduce_never;
  for (auto it = ring_wins.rbegin(); it != ring_wins.rend() && it->second; ++it) from = it->first;
  return from;
}

}  // namespace calibration

template <Communicator C>
HardwareProfile calibrate(C& comm, const CalibrationOptions& o = {}) {
  namespace cal = calibration;
  HardwareProfile hw;
  hw.name = o.name;
  const std::int64_t devices = comm.num_devices();
  // GEMMs run on the engine in use (gemm_engine()): a profile describes the kernels that measured it.
  hw.source = "calibrated on " + std::to_string(devices) + " devices running at once, " +
              std::string(name_of(gemm_engine())) + " GEMMs";
  cal::measure_gemms(comm, DType::f32, o, hw);
  cal::measure_gemms(comm, DType::f64, o, hw);
  cal::measure_gemms(comm, DType::bf16, o, hw);
  cal::measure_gemms(comm, DType::f16, o, hw);
  hw.peak_flops[DType::i32] = hw.peak_flops[DType::f32];  // i32 ops are elementwise: memory bound anyway
  // 16-bit elementwise ops run as fused groups too, a lone one included: f32 math, each step rounded to 16 bits.
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16})
    hw.elementwise_flops[t] = cal::elementwise_flops_per_second(comm, t, o);
  hw.elementwise_flops[DType::i32] = hw.elementwise_flops[DType::f32];
  // 16 MiB per tensor, MLP-sized: bigger than the caches, small enough for the allocator to reuse.
  const TensorType flat{{std::int64_t{1} << 22}}, wide{{1024, 4096}}, tall{{4096, 1024}}, scalar{{}};
  for (std::int64_t elements = std::int64_t{1} << 18; elements <= flat.elements(); elements *= 2) {
    const TensorType t{{elements}};
    const double bytes = 3.0 * static_cast<double>(t.bytes());
    hw.cache_curve.emplace_back(bytes, cal::op_bandwidth(comm, Op{OpKind::add, {0, 1}, {}, t, ""}, {t, t}, o));
  }
  hw.memory_bandwidth = hw.cache_curve.back().second;
  hw.cache_curve.push_back(cal::cold_point(comm, flat, o));
  Attrs to_flat;
  to_flat.shape = flat.shape;
  hw.op_bandwidth[OpKind::broadcast_in_dim] =
      cal::op_bandwidth(comm, Op{OpKind::broadcast_in_dim, {0}, to_flat, flat, ""}, {scalar}, o);
  Attrs swap;
  swap.dims = {1, 0};
  hw.op_bandwidth[OpKind::transpose] =
      cal::op_bandwidth(comm, Op{OpKind::transpose, {0}, swap, tall, ""}, {wide}, o);
  hw.op_overhead = cal::executor_op_seconds(comm, o);
  hw.memory_capacity = static_cast<std::int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / devices;
  hw.overlap = 0;  // the CPU backends' collectives copy and add on the cores that compute

  // The mpi backend knows which ranks share a host: `links` are measured on groups within one.
  std::int64_t per_host = devices;
  if constexpr (requires { comm.shared_memory().ranks_on_this_host(); })
    if (devices % comm.shared_memory().ranks_on_this_host() == 0) per_host = comm.shared_memory().ranks_on_this_host();
  for (std::int64_t n = 2; n <= per_host; ++n) {
    if (per_host % n) continue;
    if constexpr (ChoosesAllReduce<C>) hw.ring_all_reduce_from[n] = cal::ring_all_reduce_from(comm, n, o);
    for (auto kind : {CollectiveKind::all_reduce, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                      CollectiveKind::all_to_all}) {
      std::vector<std::pair<double, double>> samples;
      for (auto bytes : o.message_bytes) {
        const auto c = cal::collective_case(kind, n, devices, bytes);
        const double t = cal::collective_seconds(comm, c, o);
        samples.emplace_back(static_cast<double>(std::max(c.operand.bytes(), c.result.bytes())), t);
      }
      const double steps = static_cast<double>((kind == CollectiveKind::all_reduce ? 2 : 1) * (n - 1));
      Link link = cal::fit_ring(samples, steps, static_cast<double>(n));
      link.measured = samples;
      hw.links.push_back({"*", std::string(name_of(kind)), n, std::move(link)});
    }
  }
  // Several hosts: the link between them, from all_reduces over groups of one device per host.
  if (const std::int64_t hosts = devices / per_host; hosts > 1) {
    hw.devices_per_host = per_host;
    std::vector<std::pair<double, double>> samples;
    for (auto bytes : o.message_bytes) {
      auto c = cal::collective_case(CollectiveKind::all_reduce, hosts, devices, bytes);
      c.mesh = Mesh{{"group", hosts}, {"rest", per_host}};  // the group's axis major: its members on different hosts
      samples.emplace_back(static_cast<double>(c.operand.bytes()), cal::collective_seconds(comm, c, o));
    }
    hw.between_hosts = cal::fit_ring(samples, 2.0 * static_cast<double>(hosts - 1), static_cast<double>(hosts));
    hw.between_hosts.measured = samples;
  }
  // Any other collective (group sizes not measured): the all_reduce line of the largest group (its measured
  // times are of that group size).
  for (auto it = hw.links.rbegin(); it != hw.links.rend(); ++it)
    if (it->collective == "all_reduce") {
      hw.links.push_back({"*", "*", 0, {it->link.alpha, it->link.beta, {}}});
      break;
    }
  if (hw.links.empty()) hw.links.push_back({"*", "*", 0, {}});  // one device: no communication to cost
  return hw;
}

// Gives comm the algorithm choices hw measured (ring_all_reduce_from); other backends have none to tune.
template <Communicator C>
void tune_collectives(C& comm, const HardwareProfile& hw) {
  if constexpr (ChoosesAllReduce<C>)
    for (auto [n, bytes] : hw.ring_all_reduce_from) comm.set_ring_all_reduce_from(static_cast<int>(n), bytes);
}

}  // namespace partir
