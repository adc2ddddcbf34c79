#pragma once
// calibrate(comm): measures the machine a Communicator runs on and returns a HardwareProfile whose figures
// are what an SPMD step pays there. Every device calls it at the same time (it issues collectives), so
// compute is measured with all devices busy at once, as in a real step (devices that share cores or memory
// bandwidth see their share). Measured:
//   - peak FLOP/s per dtype: dot_general through the CPU kernels on a few MLP-sized GEMMs (the median);
//   - memory bandwidth: an elementwise add of large arrays, counting both reads and the write;
//   - op overhead: the same add on one element;
//   - alpha-beta per collective kind and group size: the executor's own collective path (the communicator
//     plus its staging copies), fitted to the ring formula over a range of message sizes with relative
//     least squares.
#include <unistd.h>

#include <chrono>

#include "partir/runtime/executor.hpp"
#include "partir/sim/cost_model.hpp"

namespace partir {

struct CalibrationOptions {
  std::string name = "calibrated";
  std::vector<std::int64_t> message_bytes = {1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24};
  int warmup = 2;
  int iterations = 5;
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
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return max_over_devices(comm, t / iterations);
}

// alpha, beta of the ring formula `steps * (alpha + beta * S / n)` closest to the samples (S, t) in
// relative error (weights 1/t^2), so that small messages (latency) and large ones (bandwidth) count alike.
// A negative intercept (latency below timer noise) is clamped to zero.
inline Link fit_ring(const std::vector<std::pair<double, double>>& samples, double steps, double n) {
  double sw = 0, sx = 0, sxx = 0, sy = 0, sxy = 0;
  for (auto [s, t] : samples) {
    const double w = 1 / (t * t);
    sw += w, sx += w * s, sxx += w * s * s, sy += w * t, sxy += w * s * t;
  }
  const double det = sw * sxx - sx * sx;
  double intercept = (sxx * sy - sx * sxy) / det, slope = (sw * sxy - sx * sy) / det;
  if (intercept < 0) intercept = 0, slope = sxy / sxx;
  return {intercept / steps, std::max(slope, 0.0) * n / steps};
}

inline Op dot_op(std::int64_t m, std::int64_t n, DType t) {
  Attrs a;
  a.dot = {{}, {}, {1}, {0}};
  return Op{OpKind::dot_general, {0, 1}, a, {{m, n}, t}, ""};
}

template <Communicator C>
double gemm_flops_per_second(C& comm, DType t, const CalibrationOptions& o) {
  // MLP-sized products: forward [B,D]x[D,H], backward weight gradient [D,B]x[B,H], a square one.
  const std::vector<std::array<std::int64_t, 3>> shapes = {{256, 1024, 4096}, {1024, 256, 4096}, {1024, 1024, 1024}};
  std::vector<double> rates;
  for (const auto& [m, k, n] : shapes) {
    const Array lhs(TensorType{{m, k}, t}), rhs(TensorType{{k, n}, t});
    const std::array<const Array*, 2> operands{&lhs, &rhs};
    const Op op = dot_op(m, n, t);
    const double s = seconds_per_call(comm, 1, o.iterations, [&] { (void)eval(op, operands); });
    rates.push_back(2.0 * static_cast<double>(m * k * n) / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// Seconds of an add on [elements] f32 arrays.
template <Communicator C>
double add_seconds(C& comm, std::int64_t elements, int iterations) {
  const Array x(TensorType{{elements}, DType::f32}), y(TensorType{{elements}, DType::f32});
  const std::array<const Array*, 2> operands{&x, &y};
  const Op op{OpKind::add, {0, 1}, {}, x.type(), ""};
  return seconds_per_call(comm, 2, iterations, [&] { (void)eval(op, operands); });
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

}  // namespace calibration

template <Communicator C>
HardwareProfile calibrate(C& comm, const CalibrationOptions& o = {}) {
  namespace cal = calibration;
  HardwareProfile hw;
  hw.name = o.name;
  const std::int64_t devices = comm.num_devices();
  hw.source = "calibrated on " + std::to_string(devices) + " devices running at once";
  hw.peak_flops[DType::f32] = cal::gemm_flops_per_second(comm, DType::f32, o);
  hw.peak_flops[DType::f64] = cal::gemm_flops_per_second(comm, DType::f64, o);
  hw.peak_flops[DType::i32] = hw.peak_flops[DType::f32];  // i32 ops are elementwise: memory bound anyway
  const std::int64_t big = std::int64_t{1} << 22;
  hw.memory_bandwidth = 3.0 * 4 * static_cast<double>(big) / cal::add_seconds(comm, big, o.iterations);
  hw.op_overhead = cal::add_seconds(comm, 1, 1000);
  hw.memory_capacity = static_cast<std::int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / devices;

  for (std::int64_t n = 2; n <= devices; ++n) {
    if (devices % n) continue;
    for (auto kind : {CollectiveKind::all_reduce, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                      CollectiveKind::all_to_all}) {
      std::vector<std::pair<double, double>> samples;
      for (auto bytes : o.message_bytes) {
        const auto c = cal::collective_case(kind, n, devices, bytes);
        const Array in(c.operand);
        const double t = cal::seconds_per_call(comm, o.warmup, o.iterations, [&] {
          (void)detail::run_collective(c.collective, in, c.result, c.mesh, comm);
        });
        samples.emplace_back(static_cast<double>(std::max(c.operand.bytes(), c.result.bytes())), t);
      }
      const double steps = static_cast<double>((kind == CollectiveKind::all_reduce ? 2 : 1) * (n - 1));
      hw.links.push_back({"*", std::string(name_of(kind)), n, cal::fit_ring(samples, steps, static_cast<double>(n))});
    }
  }
  // Any other collective (group sizes not measured): the all_reduce link of the largest group.
  for (auto it = hw.links.rbegin(); it != hw.links.rend(); ++it)
    if (it->collective == "all_reduce") {
      hw.links.push_back({"*", "*", 0, it->link});
      break;
    }
  if (hw.links.empty()) hw.links.push_back({"*", "*", 0, {}});  // one device: no communication to cost
  return hw;
}

}  // namespace partir
