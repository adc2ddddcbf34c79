#pragma once
// HardwareProfile: what the simulator knows about one device and the links between devices. Compute is a
// roofline (peak FLOP/s per dtype, memory bandwidth, a fixed cost per op); communication is alpha-beta
// (latency per message, seconds per byte) chosen per mesh axis, collective kind and group size by rules,
// the most specific matching rule winning. Profiles are values: built in (this CPU class, A100/H100/H200
// NVLink from public specs), calibrated on the real machine (calibrate/calibrate.hpp), saved and loaded as JSON.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "partir/config.hpp"
#include "partir/sim/json_value.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// Cost of one message of b bytes: alpha + beta * b. A calibrated link also keeps what it measured: the
// seconds of a whole collective by buffer size, {bytes, seconds} in increasing bytes. One alpha-beta line
// cannot follow the caches (on the 2-core VM a 16 MiB all_reduce takes 9x a 4 MiB one, not 4x), so within
// the measured sizes the simulator interpolates them instead (cost_model.hpp).
struct Link {
  double alpha = 0;  // seconds per message
  double beta = 0;   // seconds per byte (1 / bandwidth)
  std::vector<std::pair<double, double>> measured;
  friend bool operator==(const Link&, const Link&) = default;
};

// Where a link applies: "*" or a mesh axis name, "*" or a collective kind, 0 (any) or a group size.
struct LinkRule {
  std::string axis = "*";
  std::string collective = "*";
  std::int64_t group_size = 0;
  Link link;
  friend bool operator==(const LinkRule&, const LinkRule&) = default;
};

inline CollectiveKind parse_collective_kind(std::string_view s) {
  for (auto k : {CollectiveKind::all_gather, CollectiveKind::all_slice, CollectiveKind::all_reduce,
                 CollectiveKind::reduce_scatter, CollectiveKind::all_to_all, CollectiveKind::collective_permute})
    if (name_of(k) == s) return k;
  user_error("unknown collective '" + std::string(s) +
             "' (expected all_gather, all_slice, all_reduce, reduce_scatter, all_to_all or collective_permute)");
}

inline OpKind parse_op_kind(std::string_view s) {
  for (int k = 0; k < static_cast<int>(OpKind::count_); ++k)
    if (name_of(static_cast<OpKind>(k)) == s) return static_cast<OpKind>(k);
  user_error("unknown op kind '" + std::string(s) + "'");
}

struct HardwareProfile {
  std::string name;
  std::string source;                  // where the figures come from (spec sheet, calibration run)
  std::map<DType, double> peak_flops;  // per device, FLOP/s of dot_general
  // GEMMs with a small dim run below the peak (packing and edges weigh more): {the smallest of M, N and K,
  // fraction of peak_flops} in increasing dims, log-interpolated, the nearest point's outside them. Empty:
  // the peak whatever the shape.
  std::vector<std::pair<double, double>> gemm_curve;
  // FLOP/s of elementwise arithmetic and reductions (one operation per element), which run on vector units
  // at a fraction of the GEMM peak on CPUs: what a fused chain's steps pay besides its one pass over memory.
  // A dtype without an entry: its peak_flops.
  std::map<DType, double> elementwise_flops;
  double memory_bandwidth = 0;         // bytes/s per device, operands read plus results written
  // Op kinds whose kernels move bytes at another rate than streaming elementwise ops (strided copies such
  // as transpose and broadcast_in_dim): bytes/s, by op kind.
  std::map<OpKind, double> op_bandwidth;
  // Caches: streaming bandwidth by reuse distance, the bytes a device touched since it last touched the data
  // (an op that rereads its own operands: its working set, bytes read plus written), as {bytes, bytes/s}
  // points in increasing bytes. Where memory_bandwidth was measured is one of them; a calibrated curve ends
  // with a point for data that no cache holds any more. Between points the rate is interpolated in
  // log(bytes); outside them it is the nearest point's. Empty: memory_bandwidth whatever the size.
  std::vector<std::pair<double, double>> cache_curve;
  double op_overhead = 0;              // seconds per local op: dispatch, allocation, kernel launch
  std::int64_t memory_capacity = 0;    // bytes per device, 0 if unknown
  std::vector<LinkRule> links;
  // How much of a collective on the communication stream compute can go on beside: 1 where copy engines and
  // NICs move the bytes (GPUs), 0 where the device's own cores copy and add them (a CPU: this machine's BP step
  // is no faster with the stream, bench/step_time). The simulator charges the compute stream the rest.
  double overlap = 1;
  // Backends with two all_reduce algorithms (ChoosesAllReduce: MPI's library and partir's ring), by group size:
  // the buffer bytes from which calibration measured the ring faster at every larger size it tried
  // (ring_all_reduce_never: at none). tune_collectives gives them to a communicator; a group size without an
  // entry keeps its default.
  std::map<std::int64_t, std::int64_t> ring_all_reduce_from;
  // Hosts: device ids fill them in order, devices_per_host to a host (mpirun's default placement; 0: every device
  // on one host). `links` cost collectives among the devices of one host; `between_hosts` (per device: a ring
  // with one member per host) costs the rest, in two levels where the mpi backend runs them so
  // (collective_seconds, sim/cost_model.hpp).
  std::int64_t devices_per_host = 0;
  Link between_hosts;

  double flops_per_second(DType t) const {
    auto it = peak_flops.find(t);
    if (it == peak_flops.end() || it->second <= 0)
      user_error("hardware profile '" + name + "' has no peak FLOP/s for " + std::string(name_of(t)));
    return it->second;
  }
  // The arithmetic rate of an op of kind k: the GEMM peak for dot_general, the elementwise rate otherwise.
  // gemm_dim: a dot_general's smallest of M, N and K.
  double flops_per_second(OpKind k, DType t, double gemm_dim = 0) const {
    if (k == OpKind::dot_general || k == OpKind::convolution)  // a convolution runs as a GEMM (cost_model.hpp)
      return flops_per_second(t) * (gemm_curve.empty() ? 1 : interpolate(gemm_curve, gemm_dim));
    auto it = elementwise_flops.find(t);
    return it != elementwise_flops.end() && it->second > 0 ? it->second : flops_per_second(t);
  }

  // Bytes/s of an op of kind k whose data was last touched `reuse` bytes ago: the kind's rate (measured where
  // memory_bandwidth was), scaled as the cache curve scales streaming at this reuse distance.
  double bandwidth(OpKind k, double reuse) const {
    auto it = op_bandwidth.find(k);
    const double large = it != op_bandwidth.end() ? it->second : memory_bandwidth;
    if (cache_curve.empty() || memory_bandwidth <= 0) return large;
    return large * interpolate(cache_curve, reuse) / memory_bandwidth;
  }

  // A curve's value at x: interpolated in log(x) between points, the nearest point's outside them.
  static double interpolate(const std::vector<std::pair<double, double>>& c, double x) {
    if (x <= c.front().first) return c.front().second;
    for (std::size_t i = 1; i < c.size(); ++i)
      if (x <= c[i].first) {
        const double f = std::log(x / c[i - 1].first) / std::log(c[i].first / c[i - 1].first);
        return c[i - 1].second + f * (c[i].second - c[i - 1].second);
      }
    return c.back().second;
  }

  // The link a collective over `axes` (a group of `group_size` devices) uses. Specificity: a named axis
  // outranks a collective kind, which outranks a group size. Among equally specific rules for different
  // axes of a multi-axis group, the slowest per byte bounds the ring and is taken.
  Link link(CollectiveKind kind, const AxisList& axes, std::int64_t group_size) const {
    const LinkRule* best = nullptr;
    int best_score = -1;
    for (const auto& r : links) {
      const bool axis_named = r.axis != "*";
      if (axis_named && std::find(axes.begin(), axes.end(), r.axis) == axes.end()) continue;
      if (r.collective != "*" && r.collective != name_of(kind)) continue;
      if (r.group_size != 0 && r.group_size != group_size) continue;
      const int score = 4 * axis_named + 2 * (r.collective != "*") + (r.group_size != 0);
      if (score > best_score || (score == best_score && r.link.beta > best->link.beta)) {
        best = &r;
        best_score = score;
      }
    }
    if (!best)
      user_error("hardware profile '" + name + "' has no link for " + std::string(name_of(kind)) + " over " +
                 to_string(axes) + " (" + std::to_string(group_size) + " devices); add a rule with axis \"*\"");
    return best->link;
  }

  json::Value to_json() const;
  // A UserError names the member that is missing or of the wrong type.
  static HardwareProfile from_json(const json::Value& v);

  void save(const std::string& path) const;
  static HardwareProfile load(const std::string& path);

  // The 2-core x86 VM partir is developed on (DESIGN.md, environment facts), one device per core:
  // Eigen sgemm ~80 GFLOP/s per thread (40% of it with a dim of 16, 73% at 64), fused elementwise steps ~9 G/s (f32), memcpy ~11 GB/s, Open MPI
  // shared memory ~4.8 GB/s bus bandwidth.
  // A calibration run (bench/collectives --calibrate) replaces these with measured figures.
  static HardwareProfile cpu() {
    return {.name = "cpu",
            .source = "DESIGN.md environment facts (2-core x86 VM, Eigen, Open MPI shared memory)",
            .peak_flops = {{DType::f32, 80e9}, {DType::f64, 40e9}, {DType::i32, 20e9}, {DType::bf16, 160e9},
                           {DType::f16, 80e9}},
            .gemm_curve = {{16, 0.4}, {64, 0.73}, {256, 0.88}, {1024, 1}},
            .elementwise_flops = {{DType::f32, 9e9}, {DType::f64, 3e9}, {DType::i32, 9e9}, {DType::bf16, 4e9},
                                  {DType::f16, 4e9}},
            .memory_bandwidth = 11e9,
            .op_overhead = 2e-6,
            .memory_capacity = std::int64_t{24} << 30,
            .links = {{"*", "*", 0, {2e-6, 1 / 4.8e9}}},
            .overlap = 0};
  }
  // Public spec sheets (SXM parts; f32 without tensor cores, bf16/f16 dense on tensor cores; bandwidth per
  // direction of one GPU's NVLink;
  // alpha: NCCL's few-microsecond ring step). Real runs reach ~80% of these; calibrate to know.
  static HardwareProfile a100_nvlink() {
    return nvlink_gpu("a100-nvlink",
                      "NVIDIA A100 SXM4 80GB datasheet: 19.5 TFLOP/s fp32, 9.7 fp64, 312 bf16/fp16, 2.04 TB/s HBM2e, "
                      "NVLink3 600 GB/s",
                      19.5e12, 9.7e12, 312e12, 2.039e12, 80, 300e9);
  }
  static HardwareProfile h100_nvlink() {
    return nvlink_gpu("h100-nvlink",
                      "NVIDIA H100 SXM5 80GB datasheet: 67 TFLOP/s fp32, 34 fp64, 989 bf16/fp16, 3.35 TB/s HBM3, "
                      "NVLink4 900 GB/s",
                      67e12, 34e12, 989e12, 3.35e12, 80, 450e9);
  }
  static HardwareProfile h200_nvlink() {
    return nvlink_gpu("h200-nvlink",
                      "NVIDIA H200 SXM 141GB datasheet: 67 TFLOP/s fp32, 34 fp64, 989 bf16/fp16, 4.8 TB/s HBM3e, "
                      "NVLink4 900 GB/s",
                      67e12, 34e12, 989e12, 4.8e12, 141, 450e9);
  }

  // Clusters of 8-GPU nodes (NVLink and NVSwitch inside, one InfiniBand NIC per GPU between nodes): device ids
  // fill nodes in order and a mesh numbers its devices with the last axis fastest, so a mesh's last axes lie
  // inside a node; put tensor parallelism last, as Megatron-LM does. alpha between nodes: ~10 us, an estimate
  // of one inter-node ring step of NCCL's.
  static HardwareProfile a100_selene() {
    return cluster(a100_nvlink(), "a100-80gb-selene",
                   "Selene (Narayanan et al. 2021, arXiv 2104.04473): DGX A100 80GB nodes of 8, 8 x 200 Gb/s HDR "
                   "InfiniBand per node, 25 GB/s per GPU",
                   25e9);
  }
  static HardwareProfile h100_sxm() {
    return cluster(h100_nvlink(), "h100-sxm", "DGX H100 nodes of 8, 400 Gb/s NDR InfiniBand per GPU (50 GB/s)", 50e9);
  }
  static HardwareProfile h200() {
    return cluster(h200_nvlink(), "h200", "HGX H200 nodes of 8, 400 Gb/s NDR InfiniBand per GPU (50 GB/s)", 50e9);
  }

  static std::vector<std::string> builtin_names() {
    return {"cpu", "a100-nvlink", "h100-nvlink", "h200-nvlink", "a100-80gb-selene", "h100-sxm", "h200"};
  }
  static HardwareProfile builtin(std::string_view name) {
    if (name == "cpu") return cpu();
    if (name == "a100-nvlink") return a100_nvlink();
    if (name == "h100-nvlink") return h100_nvlink();
    if (name == "h200-nvlink") return h200_nvlink();
    if (name == "a100-80gb-selene") return a100_selene();
    if (name == "h100-sxm") return h100_sxm();
    if (name == "h200") return h200();
    std::string names;
    for (const auto& n : builtin_names()) names += (names.empty() ? "" : ", ") + n;
    user_error("no built-in hardware profile '" + std::string(name) + "' (" + names + ")");
  }
  // A built-in name or a JSON file.
  static HardwareProfile named(const std::string& name_or_path);
  // The profile of this machine: the file (or built-in name) in $PARTIR_PROFILE, else the CPU built-in.
  static HardwareProfile detect();

  friend bool operator==(const HardwareProfile&, const HardwareProfile&) = default;

 private:
  // [[x, y], ...] with x increasing.
  static std::vector<std::pair<double, double>> points(const json::Value& v, const std::string& what,
                                                       const std::string& point);

  static HardwareProfile cluster(HardwareProfile gpu, std::string name, std::string nodes, double per_gpu) {
    gpu.name = std::move(name);
    gpu.source += "; " + nodes;
    gpu.devices_per_host = 8;
    gpu.between_hosts = {1e-5, 1 / per_gpu, {}};
    return gpu;
  }
  static HardwareProfile nvlink_gpu(std::string name, std::string source, double f32, double f64, double half,
                                    double hbm, std::int64_t gib, double nvlink) {
    return {.name = std::move(name),
            .source = std::move(source),
            .peak_flops = {{DType::f32, f32}, {DType::f64, f64}, {DType::i32, f32 / 2}, {DType::bf16, half},
                           {DType::f16, half}},
            .elementwise_flops = {{DType::bf16, f32}, {DType::f16, f32}},
            .memory_bandwidth = hbm,
            .op_overhead = 4e-6,  // a kernel launch
            .memory_capacity = gib << 30,
            .links = {{"*", "*", 0, {5e-6, 1 / nvlink}}}};
  }
};

}  // namespace partir

#if PARTIR_DEFINE_ENTRIES
#include "partir/sim/json.hpp"

namespace partir {

PARTIR_ENTRY void HardwareProfile::save(const std::string& path) const { json::write_file(path, to_json()); }

PARTIR_ENTRY HardwareProfile HardwareProfile::load(const std::string& path) {
  try {
    return from_json(json::read_file(path));
  } catch (const UserError& e) {
    user_error("hardware profile " + path + ": " + e.what());
  }
}

PARTIR_ENTRY HardwareProfile HardwareProfile::named(const std::string& name_or_path) {
  for (const auto& n : builtin_names())
    if (n == name_or_path) return builtin(n);
  return load(name_or_path);
}

PARTIR_ENTRY HardwareProfile HardwareProfile::detect() {
  const char* env = std::getenv("PARTIR_PROFILE");
  return env && *env ? named(env) : cpu();
}

PARTIR_ENTRY std::vector<std::pair<double, double>> HardwareProfile::points(const json::Value& v,
                                                                        const std::string& what,
                                                                        const std::string& point) {
  std::vector<std::pair<double, double>> out;
  for (const auto& p : json::as_array(v)) {
    if (json::as_array(p).size() != 2) user_error(what + ": each point is " + point);
    out.emplace_back(json::get<double>(p[0]), json::get<double>(p[1]));
    if (out.size() > 1 && out.back().first <= out[out.size() - 2].first) user_error(what + ": points must increase");
  }
  return out;
}

PARTIR_ENTRY json::Value HardwareProfile::to_json() const {
  json::Value flops = json::Value::object(), elementwise = json::Value::object(), per_op = json::Value::object();
  for (const auto& [t, f] : peak_flops) flops[std::string(name_of(t))] = f;
  for (const auto& [t, f] : elementwise_flops) elementwise[std::string(name_of(t))] = f;
  for (const auto& [k, b] : op_bandwidth) per_op[std::string(name_of(k))] = b;
  json::Value ring_from = json::Value::object();  // {"group size": bytes}
  for (const auto& [n, b] : ring_all_reduce_from) ring_from[std::to_string(n)] = b;
  json::Value rules = json::Value::array();
  for (const auto& r : links) {
    json::Value rule = {{"axis", r.axis}, {"collective", r.collective}, {"group_size", r.group_size},
                        {"alpha", r.link.alpha}, {"beta", r.link.beta}};
    if (!r.link.measured.empty()) rule["measured"] = r.link.measured;  // [[bytes, seconds], ...]
    rules.push_back(std::move(rule));
  }
  return {{"name", name}, {"source", source}, {"peak_flops", flops}, {"gemm_curve", gemm_curve},
          {"elementwise_flops", elementwise}, {"memory_bandwidth", memory_bandwidth}, {"op_bandwidth", per_op},
          {"cache_curve", cache_curve}, {"op_overhead", op_overhead}, {"memory_capacity", memory_capacity},
          {"links", rules}, {"overlap", overlap}, {"ring_all_reduce_from", ring_from},
          {"devices_per_host", devices_per_host},
          {"between_hosts",
           {{"alpha", between_hosts.alpha}, {"beta", between_hosts.beta}, {"measured", between_hosts.measured}}}};
}

PARTIR_ENTRY HardwareProfile HardwareProfile::from_json(const json::Value& v) {
  using json::get;
  HardwareProfile p;
  p.name = get<std::string>(json::at(v, "name"));
  if (auto* s = json::find(v, "source")) p.source = get<std::string>(*s);
  for (const auto& [t, f] : json::as_object(json::at(v, "peak_flops")).items()) p.peak_flops[parse_dtype(t)] = get<double>(f);
  if (auto* g = json::find(v, "gemm_curve")) p.gemm_curve = points(*g, "gemm_curve", "[smallest dim, fraction of peak]");
  if (auto* e = json::find(v, "elementwise_flops"))
    for (const auto& [t, f] : json::as_object(*e).items()) p.elementwise_flops[parse_dtype(t)] = get<double>(f);
  p.memory_bandwidth = get<double>(json::at(v, "memory_bandwidth"));
  if (auto* per_op = json::find(v, "op_bandwidth"))
    for (const auto& [k, b] : json::as_object(*per_op).items()) p.op_bandwidth[parse_op_kind(k)] = get<double>(b);
  if (auto* curve = json::find(v, "cache_curve")) p.cache_curve = points(*curve, "cache_curve", "[bytes, bytes per second]");
  if (auto* o = json::find(v, "op_overhead")) p.op_overhead = get<double>(*o);
  if (auto* m = json::find(v, "memory_capacity")) p.memory_capacity = get<std::int64_t>(*m);
  if (auto* o = json::find(v, "overlap")) p.overlap = get<double>(*o);
  if (auto* r = json::find(v, "ring_all_reduce_from"))
    for (const auto& [n, b] : json::as_object(*r).items()) {
      std::int64_t size = 0;
      if (std::from_chars(n.data(), n.data() + n.size(), size).ptr != n.data() + n.size() || size < 2)
        user_error("hardware profile: ring_all_reduce_from: '" + n + "' is not a group size (an integer >= 2)");
      p.ring_all_reduce_from[size] = get<std::int64_t>(b);
    }
  if (auto* d = json::find(v, "devices_per_host")) p.devices_per_host = get<std::int64_t>(*d);
  if (p.devices_per_host < 0) user_error("hardware profile: devices_per_host must be >= 0 (0: one host)");
  if (auto* b = json::find(v, "between_hosts")) {
    p.between_hosts = {get<double>(json::at(*b, "alpha")), get<double>(json::at(*b, "beta")), {}};
    if (auto* m = json::find(*b, "measured"))
      p.between_hosts.measured = points(*m, "between_hosts: measured", "[bytes, seconds]");
  } else if (p.devices_per_host > 0) {
    user_error("hardware profile '" + p.name + "': devices_per_host " + std::to_string(p.devices_per_host) +
               " needs a between_hosts link {\"alpha\": seconds, \"beta\": seconds per byte}");
  }
  const json::Value links = json::at(v, "links");  // a copy: GCC 13 cannot tell the reference outlives "links"
  for (const auto& r : json::as_array(links)) {
    LinkRule rule;
    if (auto* a = json::find(r, "axis")) rule.axis = get<std::string>(*a);
    if (auto* c = json::find(r, "collective")) rule.collective = get<std::string>(*c);
    if (rule.collective != "*") parse_collective_kind(rule.collective);
    if (auto* g = json::find(r, "group_size")) rule.group_size = get<std::int64_t>(*g);
    rule.link = {get<double>(json::at(r, "alpha")), get<double>(json::at(r, "beta")), {}};
    if (auto* m = json::find(r, "measured")) rule.link.measured = points(*m, "links: measured", "[bytes, seconds]");
    p.links.push_back(std::move(rule));
  }
  return p;
}

}  // namespace partir
#endif
