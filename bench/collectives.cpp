// Collectives microbenchmark in nccl-tests' conventions, through partir's Communicator backends.
//   collectives -b 8 -e 64M -f 2 -n 20 -w 5 -r 3
//               -o all_reduce|all_gather|reduce_scatter|all_to_all|sendrecv|collective_permute|all
//               --backend threads|mpi|nccl  --devices 4 (threads)  --mesh batch=2,model=2 --axis model
//               --json out.json  --raw (mpi: also time MPI called directly; prints the ratio)
//               --algorithms (mpi: all_reduce three ways, reduce_scatter five, all_gather and all_to_all two)
//               --calibrate profile.json
//               --profile machine|default|profile.json (mpi: where all_reduce switches to the ring; machine, the
//               default: where this machine's cached profile measured it faster, as the examples run)
// size is the full buffer S in bytes (count = S / 4 floats): the all_reduce buffer, the all_gather result,
// the reduce_scatter operand, the all_to_all operand. algbw = S / time; busbw = algbw x 2(n-1)/n for
// all_reduce, (n-1)/n for the others; sendrecv (pipeline stages' point to point, as OSU's bidirectional test): each
// member sends S to the next member of its group and receives S from the previous one, busbw = algbw; collective_permute (a halo exchange) the same without the wrap-around: the last member only
// receives, the first only sends. time: the slowest device's mean over -n back-to-back calls, best of
// -r rounds (3; a shared machine's noise only ever adds time).
// #wrong counts elements that differ from the exactly known result of one checked call.
//
//   mpirun -np 2 build/bench/collectives -b 1K -e 16M -f 4 --backend mpi --raw
//   build/bench/collectives --backend nccl -o all          (one thread per GPU; under mpirun: one rank per GPU)
// With --backend nccl the timed calls run on device buffers; the checked call goes through host buffers,
// which the NCCL communicator stages through the device.
#include <partir/runtime/comm/threads.hpp>
#include <partir/calibrate/calibrate.hpp>
#include <partir/calibrate/machine_profile.hpp>
#include <partir/sim/json.hpp>
#ifdef PARTIR_BENCH_MPI
#include <partir/runtime/comm/mpi.hpp>
#endif
#ifdef PARTIR_BENCH_NCCL
#include <partir/runtime/comm/nccl.hpp>
#ifdef PARTIR_BENCH_MPI
#include <partir/runtime/comm/nccl_mpi.hpp>
#endif
#endif

#include <array>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>

#include "../examples/cli.hpp"

namespace p = partir;
using p::CollectiveKind;

namespace {

struct Options {
  std::int64_t min_bytes = 8, max_bytes = std::int64_t{64} << 20, factor = 2;
  int iterations = 20, warmup = 5, rounds = 3;
  bool check = true;
  std::vector<CollectiveKind> ops = {CollectiveKind::all_reduce};
  std::string backend = "threads";
  int devices = 0;  // threads: 2; nccl: every GPU present
  std::string mesh, axis, json_path, calibrate_path, profile_path = "machine";
  bool raw = false, algorithms = false;
  std::optional<p::HardwareProfile> profile;  // mpi: the one tuning the backend; its prediction is printed per row
};

[[noreturn]] void fail(const std::string& why) {
  std::cerr << "error: " << why << " (see --help)\n";
  std::exit(2);
}

// nccl-tests sizes: a number with an optional K, M or G (powers of 1024).
std::int64_t parse_bytes(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  const std::string unit = end;
  const double scale = unit.empty() ? 1 : unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : unit == "G" ? 1 << 30 : -1;
  if (end == s.c_str() || scale < 0 || x < 0) fail(flag + ": expected a size such as 8, 64K or 16M, got '" + s + "'");
  return static_cast<std::int64_t>(x * scale);
}

Options parse(int argc, char** argv) {
  Options o;
  std::string min = "8", max = "64M", factor = "2", op = "all_reduce";
  cli::App app("Collectives through partir's communicators, in nccl-tests' conventions.", "collectives");
  app.add_option("-b,--minbytes", min, "smallest buffer (bytes; K, M, G suffixes)");
  app.add_option("-e,--maxbytes", max, "largest buffer");
  app.add_option("-f,--stepfactor", factor, "size multiplier between rows (>= 2)");
  app.add_option("-n,--iters", o.iterations, "timed calls per round")->check(cli::at_least(1));
  app.add_option("-w,--warmup_iters", o.warmup, "untimed calls first")->check(cli::at_least(0));
  app.add_option("-r,--rounds", o.rounds, "rounds; the best counts")->check(cli::at_least(1));
  app.add_option("-c,--check", o.check, "check one call's result (0 or 1)");
  app.add_option("-o,--op", op, "all_reduce, all_gather, reduce_scatter, all_to_all, sendrecv, collective_permute or all")
      ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv", "collective_permute", "all"}));
  app.add_option("--backend", o.backend, "threads, mpi (under mpirun) or nccl")->check(CLI::IsMember({"threads", "mpi", "nccl"}));
  app.add_option("--devices", o.devices, "threads: devices (default 2); nccl: GPUs (default all)")->check(cli::at_least(0));
  app.add_option("--mesh", o.mesh, "a mesh over the devices, e.g. a=2,b=2 (default: one axis d)");
  app.add_option("--axis", o.axis, "the group's axes, e.g. a or a,b (default: all)");
  app.add_option("--json", o.json_path, "also write the rows as JSON");
  app.add_flag("--raw", o.raw, "mpi: also time MPI called directly and print partir/raw");
  app.add_flag("--algorithms,--rs-alternatives", o.algorithms,
               "mpi: each algorithm the backend chooses between, side by side (all_reduce three ways, reduce_scatter "
               "five, all_gather and all_to_all two)");
  app.add_option("--calibrate", o.calibrate_path, "measure this machine and write a hardware profile (JSON) instead");
  app.add_option("--profile", o.profile_path,
                 "mpi: where all_reduce switches to the ring: machine (this machine's cached profile, calibrated on "
                 "first use, as the examples run), default (16 MiB) or a --calibrate file")
      ->check(CLI::IsMember({"machine", "default"}) | CLI::ExistingFile);
  app.parse(argc, argv);
  o.min_bytes = parse_bytes("-b", min);
  o.max_bytes = parse_bytes("-e", max);
  o.factor = parse_bytes("-f", factor);
  o.ops = op == "all"        ? std::vector{CollectiveKind::all_reduce, CollectiveKind::all_gather,
                                           CollectiveKind::reduce_scatter, CollectiveKind::all_to_all, CollectiveKind::send,
                                           CollectiveKind::collective_permute}
          : op == "sendrecv" ? std::vector{CollectiveKind::send}
                             : std::vector{p::parse_collective_kind(op)};
  if (o.min_bytes < 1 || o.max_bytes < o.min_bytes || o.factor < 2) fail("need 1 <= -b <= -e and -f >= 2");
  if ((o.raw || o.algorithms) && o.backend != "mpi") fail("--raw and --algorithms compare against MPI: use --backend mpi");
  return o;
}

p::AxisList split_axes(const std::string& s) {
  p::AxisList out;
  std::size_t start = 0;
  while (start <= s.size()) {
    const auto end = std::min(s.find(',', start), s.size());
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Device d's element i: distinct per device and element, and sums of a few of them are exact in float.
float value(int device, std::int64_t i) { return static_cast<float>(device * 1000 + i % 997); }

// One collective call on this device's buffers: count is elements per device contribution (the block).
using Call = std::function<void(const p::Group&, CollectiveKind, float* in, float* out, std::int64_t count)>;

template <p::Communicator C>
Call partir_call(C& comm) {
  return [&comm](const p::Group& g, CollectiveKind k, float* in, float* out, std::int64_t count) {
    switch (k) {
      case CollectiveKind::all_reduce: comm.all_reduce(g, in, count, p::DType::f32); break;
      case CollectiveKind::all_gather: comm.all_gather(g, in, out, count, p::DType::f32); break;
      case CollectiveKind::reduce_scatter: comm.reduce_scatter(g, in, out, count, p::DType::f32); break;
      case CollectiveKind::all_to_all: comm.all_to_all(g, in, out, count, p::DType::f32); break;
      case CollectiveKind::send: {  // as the executor runs a stage's transfers: in place where the backend can
        const int pos = g.index_of(comm.device()), n = g.size(), next = g.devices[static_cast<std::size_t>((pos + 1) % n)];
        if constexpr (p::SendsInPlace<C>) comm.send_in_place(next, in, count, p::DType::f32, 0);
        else comm.send(next, in, count, p::DType::f32, 0);
        comm.recv(g.devices[static_cast<std::size_t>((pos + n - 1) % n)], out, count, p::DType::f32, 0);
        if constexpr (p::SendsInPlace<C>) comm.finish_sends();
        break;
      }
      case CollectiveKind::collective_permute: {
        const int pos = g.index_of(comm.device()), n = g.size();
        comm.collective_permute(g, pos + 1 < n ? pos + 1 : -1, in, pos > 0 ? pos - 1 : -1, out, count, p::DType::f32);
        break;
      }
      case CollectiveKind::all_slice: case CollectiveKind::recv: break;
    }
  };
}

std::string row_name(CollectiveKind k) { return k == CollectiveKind::send ? "sendrecv" : std::string(p::name_of(k)); }

// Elements of the input and output buffers, and the count per contribution, for a full buffer of S bytes
// (rounded down to a whole number of blocks).
struct Buffers {
  std::int64_t count, in, out;
};
Buffers buffers(CollectiveKind k, std::int64_t bytes, std::int64_t n) {
  const std::int64_t full = std::max<std::int64_t>(bytes / 4 / n, 1) * n;
  switch (k) {
    case CollectiveKind::all_reduce: return {full, full, 0};
    case CollectiveKind::all_gather: return {full / n, full / n, full};
    case CollectiveKind::reduce_scatter: return {full / n, full, full / n};
    case CollectiveKind::send: case CollectiveKind::collective_permute: return {full, full, full};
    default: return {full / n, full, full};
  }
}

// Elements of one checked call that differ from the known result; fills the buffers first.
long wrong_elements(const Call& call, const p::Group& g, int me, CollectiveKind k, const Buffers& b,
                    std::vector<float>& in, std::vector<float>& out) {
  const int n = g.size(), pos = g.index_of(me);
  for (std::int64_t i = 0; i < b.in; ++i) in[i] = value(me, i);
  call(g, k, in.data(), out.data(), b.count);
  long wrong = 0;
  auto sum_over_group = [&](std::int64_t i) {
    float s = 0;
    for (int d : g.devices) s += value(d, i);
    return s;
  };
  switch (k) {
    case CollectiveKind::all_reduce:
      for (std::int64_t i = 0; i < b.in; ++i) wrong += in[i] != sum_over_group(i);
      break;
    case CollectiveKind::all_gather:
      for (int q = 0; q < n; ++q)
        for (std::int64_t i = 0; i < b.count; ++i) wrong += out[q * b.count + i] != value(g.devices[q], i);
      break;
    case CollectiveKind::reduce_scatter:
      for (std::int64_t i = 0; i < b.count; ++i) wrong += out[i] != sum_over_group(pos * b.count + i);
      break;
    case CollectiveKind::send:  // sendrecv: the previous member's input
      for (std::int64_t i = 0; i < b.count; ++i) wrong += out[i] != value(g.devices[static_cast<std::size_t>((pos + n - 1) % n)], i);
      break;
    case CollectiveKind::collective_permute:  // the previous member's input; the first member receives nothing
      for (std::int64_t i = 0; i < b.count && pos > 0; ++i) wrong += out[i] != value(g.devices[static_cast<std::size_t>(pos - 1)], i);
      break;
    default:  // all_to_all: block q of the output is block `pos` of member q's input
      for (int q = 0; q < n; ++q)
        for (std::int64_t i = 0; i < b.count; ++i) wrong += out[q * b.count + i] != value(g.devices[q], pos * b.count + i);
      break;
  }
  return wrong;
}

struct Row {
  std::string op;
  std::int64_t bytes, count;
  double seconds, algbw, busbw;
  long wrong;
  std::optional<double> raw_seconds, raw_busbw, predicted_seconds;
};

// Where the timed calls' buffers live: host vectors, or (NCCL) device memory from this hook, which returns
// a buffer of at least `elements` floats for slot 0 (in) or 1 (out).
using DeviceBuffers = std::function<float*(int slot, std::int64_t elements)>;

// Sizes -b, -b*f, ... up to -e; every row is timed on every device, printed by device 0.
template <p::Communicator C>
std::vector<Row> sweep(C& comm, const Options& o, const p::Mesh& mesh, const p::AxisList& axes, const Call& call,
                       const Call* raw, const DeviceBuffers& device_buffers = {}) {
  const int me = comm.device();
  p::Group g;
  for (auto d : mesh.group(me, axes)) g.devices.push_back(static_cast<int>(d));
  const int n = g.size();
  std::vector<Row> rows;
  for (auto kind : o.ops) {
    // NCCL pairs a send with its recv only when both are posted together; partir's nccl send/recv wait one by one.
    if (kind == CollectiveKind::send && o.backend == "nccl") continue;
    for (std::int64_t size = o.min_bytes; size <= o.max_bytes; size *= o.factor) {
      const Buffers b = buffers(kind, size, n);
      std::vector<float> in(static_cast<std::size_t>(b.in)), out(static_cast<std::size_t>(b.out));
      float* timed_in = device_buffers ? device_buffers(0, b.in) : in.data();
      float* timed_out = device_buffers ? device_buffers(1, b.out) : out.data();
      auto time = [&](const Call& c) {
        return p::calibration::seconds_per_call(comm, o.warmup, o.iterations,
                                                [&] { c(g, kind, timed_in, timed_out, b.count); });
      };
      // Rounds alternate partir and raw, so that both see the same machine; the best round of each counts.
      Row r{row_name(kind), std::max(b.in, b.out) * 4, std::max(b.in, b.out), 1e30, 0, 0, 0, {}, {}, {}};
      if (o.profile)  // what the simulator charges for this collective
        r.predicted_seconds = p::ring_seconds(kind, n, static_cast<double>(r.bytes), o.profile->link(kind, axes, n));
      for (int round = 0; round < o.rounds; ++round) {
        r.seconds = std::min(r.seconds, time(call));
        if (raw) r.raw_seconds = std::min(r.raw_seconds.value_or(1e30), time(*raw));
      }
      r.algbw = static_cast<double>(r.bytes) / r.seconds / 1e9;
      const double bus = kind == CollectiveKind::send || kind == CollectiveKind::collective_permute ? 1 : p::bus_factor(kind, n);
      r.busbw = r.algbw * bus;
      if (raw) r.raw_busbw = static_cast<double>(r.bytes) / *r.raw_seconds / 1e9 * bus;
      if (o.check) {
        double wrong = static_cast<double>(wrong_elements(call, g, me, kind, b, in, out));
        if (raw) wrong += static_cast<double>(wrong_elements(*raw, g, me, kind, b, in, out));
        r.wrong = static_cast<long>(p::calibration::max_over_devices(comm, wrong));
      }
      rows.push_back(r);
    }
  }
  return rows;
}

void print(const std::vector<Row>& rows, const Options& o, const std::string& setup) {
  std::printf("# partir collectives benchmark: %s\n# iters %d warmup %d rounds %d check %d; time: the slowest device's "
              "mean, best round\n#\n",
              setup.c_str(), o.iterations, o.warmup, o.rounds, o.check ? 1 : 0);
  std::printf("# %-14s %12s %12s %6s %6s %10s %8s %8s %6s", "collective", "size", "count", "type", "redop", "time",
              "algbw", "busbw", "#wrong");
  if (o.raw) std::printf(" %10s %8s %7s", "raw time", "raw bus", "ratio");
  if (o.profile) std::printf(" %10s %9s", "predicted", "pred/time");
  std::printf("\n# %-14s %12s %12s %6s %6s %10s %8s %8s %6s", "", "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "");
  if (o.raw) std::printf(" %10s %8s %7s", "(us)", "(GB/s)", "");
  if (o.profile) std::printf(" %10s %9s", "(us)", "");
  std::printf("\n");
  for (const auto& r : rows) {
    const bool reduces = r.op == "all_reduce" || r.op == "reduce_scatter";
    std::printf("  %-14s %12lld %12lld %6s %6s %10.2f %8.3f %8.3f %6ld", r.op.c_str(), static_cast<long long>(r.bytes),
                static_cast<long long>(r.count), "float", reduces ? "sum" : "none", r.seconds * 1e6, r.algbw, r.busbw,
                r.wrong);
    if (r.raw_seconds) std::printf(" %10.2f %8.3f %7.3f", *r.raw_seconds * 1e6, *r.raw_busbw, r.busbw / *r.raw_busbw);
    if (r.predicted_seconds) std::printf(" %10.2f %9.3f", *r.predicted_seconds * 1e6, *r.predicted_seconds / r.seconds);
    std::printf("\n");
  }
  if (o.raw) {  // the target: partir >= 0.95x raw busbw from 1 MiB up
    double worst = 0;
    bool any = false;
    for (const auto& r : rows)
      if (r.bytes >= (1 << 20) && r.raw_busbw) {
        const double ratio = r.busbw / *r.raw_busbw;
        worst = any ? std::min(worst, ratio) : ratio;
        any = true;
      }
    if (any) std::printf("# partir/raw busbw, sizes >= 1 MiB: worst %.3f (target >= 0.95)\n", worst);
    const Row* lowest = nullptr;  // over every size
    for (const auto& r : rows)
      if (r.raw_busbw && (!lowest || r.busbw / *r.raw_busbw < lowest->busbw / *lowest->raw_busbw)) lowest = &r;
    if (lowest)
      std::printf("worst row partir/raw: %.3f (%s, %lld B)\n", lowest->busbw / *lowest->raw_busbw, lowest->op.c_str(),
                  static_cast<long long>(lowest->bytes));
    for (const auto& r : rows)
      if (r.op == "all_reduce" && r.bytes == (64 << 20) && r.raw_busbw)
        std::printf("all_reduce 64 MiB partir/raw: %.2f\n", r.busbw / *r.raw_busbw);
  }
  std::string errors;  // the simulator's charge for all_reduce against its measured time
  for (const auto& r : rows)
    if (r.op == "all_reduce" && r.predicted_seconds && (r.bytes == (1 << 20) || r.bytes == (16 << 20) || r.bytes == (64 << 20)))
      errors += " " + std::to_string(r.bytes >> 20) + " MiB " + std::to_string(*r.predicted_seconds / r.seconds - 1).substr(0, 6);
  if (!errors.empty()) std::printf("simulator all_reduce predicted/measured - 1:%s (--profile %s)\n", errors.c_str(), o.profile_path.c_str());
}

void write_json(const std::vector<Row>& rows, const std::string& path, const std::string& setup) {
  p::json::Value list = p::json::Value::array();
  for (const auto& r : rows) {
    p::json::Value row = {{"collective", r.op},      {"size", r.bytes},          {"count", r.count},
                          {"type", "float"},         {"time_us", r.seconds * 1e6}, {"algbw_gbs", r.algbw},
                          {"busbw_gbs", r.busbw},    {"wrong", r.wrong}};
    if (r.raw_seconds) row.update({{"raw_time_us", *r.raw_seconds * 1e6}, {"raw_busbw_gbs", *r.raw_busbw}});
    list.push_back(std::move(row));
  }
  p::json::write_file(path, {{"setup", setup}, {"rows", list}});
}

// Which all_reduce the mpi backend runs on g, and why ("" for backends with one).
template <p::Communicator C>
std::string all_reduce_choice(C& comm, const Options& o, const p::Group& g) {
  if constexpr (p::ChoosesAllReduce<C>) {
    auto by_size = [&](int group_size) {
      const std::int64_t from = comm.ring_all_reduce_from(group_size);
      const std::string size = from % (1 << 20) ? std::to_string(from) + " B" : std::to_string(from >> 20) + " MiB";
      return (from == p::ring_all_reduce_never ? "MPI_Allreduce at every size" : "partir's ring from " + size) +
             " (--profile " + o.profile_path + ")";
    };
    if (comm.shared_memory_enabled() && comm.shared_memory().covers(g)) return "the host's shared memory";
    if (const auto levels = comm.shared_memory_enabled() ? comm.shared_memory().levels(g) : std::nullopt)
      return "shared memory within each host, then across hosts " + by_size(levels->across.size());
    return by_size(g.size());
  }
  return "";
}

// Runs the benchmark (or the calibration) on this device; device 0 reports.
template <p::Communicator C>
void run(C& comm, const Options& o, const Call* raw, const DeviceBuffers& device_buffers = {}) {
  const p::Mesh mesh = o.mesh.empty() ? p::Mesh{{"d", comm.num_devices()}} : p::Mesh::parse(o.mesh);
  if (mesh.num_devices() != comm.num_devices())
    p::user_error("mesh " + mesh.to_string() + " has " + std::to_string(mesh.num_devices()) + " devices, the " +
                  o.backend + " backend " + std::to_string(comm.num_devices()));
  if (!o.calibrate_path.empty()) {
    p::CalibrationOptions co;
    co.name = "calibrated-" + o.backend + "-" + std::to_string(comm.num_devices());
    const auto profile = p::calibrate(comm, co);
    if (comm.device() == 0) {
      profile.save(o.calibrate_path);
      std::cout << profile.to_json().dump(2) << "\nwrote " << o.calibrate_path << "\n";
    }
    return;
  }
  p::AxisList axes;
  if (o.axis.empty())
    for (const auto& a : mesh.axes()) axes.push_back(a.name);
  else
    axes = split_axes(o.axis);
  const auto rows = sweep(comm, o, mesh, axes, partir_call(comm), raw, device_buffers);
  if (comm.device() != 0) return;
  const auto group_size = static_cast<int>(p::tile_count(axes, mesh));
  p::Group first;  // device 0's
  for (auto d : mesh.group(0, axes)) first.devices.push_back(static_cast<int>(d));
  const std::string choice = all_reduce_choice(comm, o, first);
  const std::string setup = "backend " + o.backend + ", " + std::to_string(comm.num_devices()) + " devices, mesh " +
                            mesh.to_string() + ", groups along " + p::to_string(axes) + " (" +
                            std::to_string(group_size) + " devices each)" +
                            (choice.empty() ? "" : "; all_reduce: " + choice);
  print(rows, o, setup);
  if (!o.json_path.empty()) write_json(rows, o.json_path, setup);
}

#ifdef PARTIR_BENCH_MPI
// MPI called directly on one communicator per group, split once: the baseline partir's mpi backend is
// measured against.
class RawMpi {
 public:
  MPI_Comm comm(const p::Group& g) {
    auto it = comms_.find(g.devices);
    if (it != comms_.end()) return it->second;
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm c;
    MPI_Comm_split(MPI_COMM_WORLD, g.devices.front(), g.index_of(me), &c);
    return comms_[g.devices] = c;
  }
  ~RawMpi() {
    for (auto& [k, c] : comms_) MPI_Comm_free(&c);
  }
  Call call() {
    return [this](const p::Group& g, CollectiveKind k, float* in, float* out, std::int64_t count) {
      const MPI_Comm c = comm(g);
      const int n = static_cast<int>(count);
      switch (k) {
        case CollectiveKind::all_reduce: MPI_Allreduce(MPI_IN_PLACE, in, n, MPI_FLOAT, MPI_SUM, c); break;
        case CollectiveKind::all_gather: MPI_Allgather(in, n, MPI_FLOAT, out, n, MPI_FLOAT, c); break;
        case CollectiveKind::reduce_scatter: MPI_Reduce_scatter_block(in, out, n, MPI_FLOAT, MPI_SUM, c); break;
        case CollectiveKind::all_to_all: MPI_Alltoall(in, n, MPI_FLOAT, out, n, MPI_FLOAT, c); break;
        case CollectiveKind::send: {
          int pos = 0, size = 1;
          MPI_Comm_rank(c, &pos);
          MPI_Comm_size(c, &size);
          MPI_Sendrecv(in, n, MPI_FLOAT, (pos + 1) % size, 0, out, n, MPI_FLOAT, (pos + size - 1) % size, 0, c,
                       MPI_STATUS_IGNORE);
          break;
        }
        case CollectiveKind::collective_permute: {
          int pos = 0, size = 1;
          MPI_Comm_rank(c, &pos);
          MPI_Comm_size(c, &size);
          MPI_Sendrecv(in, n, MPI_FLOAT, pos + 1 < size ? pos + 1 : MPI_PROC_NULL, 0, out, n, MPI_FLOAT,
                       pos > 0 ? pos - 1 : MPI_PROC_NULL, 0, c, MPI_STATUS_IGNORE);
          break;
        }
        case CollectiveKind::all_slice: case CollectiveKind::recv: break;
      }
    };
  }

  // all_reduce three ways: the figures behind mpi::Communicator::all_reduce's choice.
  std::vector<std::pair<std::string, Call>> all_reduce_variants(p::mpi::Communicator& partir) {
    return {
        {"MPI_Allreduce", Call([this](const p::Group& g, CollectiveKind, float* in, float*, std::int64_t count) {
           MPI_Allreduce(MPI_IN_PLACE, in, static_cast<int>(count), MPI_FLOAT, MPI_SUM, comm(g));
         })},
        {"partir ring (MPI_Sendrecv)", Call([&partir](const p::Group& g, CollectiveKind, float* in, float*, std::int64_t count) {
           partir.ring_all_reduce(g, in, count, p::DType::f32);
         })},
        {"partir shared memory", Call([&partir](const p::Group& g, CollectiveKind, float* in, float*, std::int64_t count) {
           partir.shared_memory().all_reduce(g, in, count, p::DType::f32);
         })},
    };
  }

  // all_gather and all_to_all two ways: MPI's and the host's shared memory.
  std::vector<std::pair<std::string, Call>> exchange_variants(p::mpi::Communicator& partir) {
    return {
        {"MPI's", Call([this](const p::Group& g, CollectiveKind k, float* in, float* out, std::int64_t count) {
           const int n = static_cast<int>(count);
           if (k == CollectiveKind::all_gather) MPI_Allgather(in, n, MPI_FLOAT, out, n, MPI_FLOAT, comm(g));
           else MPI_Alltoall(in, n, MPI_FLOAT, out, n, MPI_FLOAT, comm(g));
         })},
        {"partir shared memory", Call([&partir](const p::Group& g, CollectiveKind k, float* in, float* out, std::int64_t count) {
           if (k == CollectiveKind::all_gather) partir.shared_memory().all_gather(g, in, out, count, p::DType::f32);
           else partir.shared_memory().all_to_all(g, in, out, count, p::DType::f32);
         })},
    };
  }

  // reduce_scatter five ways: the figures behind mpi::Communicator::reduce_scatter's choice.
  std::vector<std::pair<std::string, Call>> reduce_scatter_variants(p::mpi::Communicator& partir) {
    auto wrap = [this](auto body) {
      return Call([this, body](const p::Group& g, CollectiveKind, float* in, float* out, std::int64_t count) {
        body(comm(g), g.size(), in, out, static_cast<int>(count));
      });
    };
    return {
        {"MPI_Reduce_scatter_block", wrap([](MPI_Comm c, int, float* in, float* out, int n) {
           MPI_Reduce_scatter_block(in, out, n, MPI_FLOAT, MPI_SUM, c);
         })},
        {"MPI_Allreduce+copy", wrap([this](MPI_Comm c, int k, float* in, float* out, int n) {
           scratch_.assign(in, in + static_cast<std::ptrdiff_t>(n) * k);
           MPI_Allreduce(MPI_IN_PLACE, scratch_.data(), n * k, MPI_FLOAT, MPI_SUM, c);
           int r = 0;
           MPI_Comm_rank(c, &r);
           std::copy_n(scratch_.data() + static_cast<std::ptrdiff_t>(r) * n, n, out);
         })},
        {"MPI_Reduce+MPI_Scatter", wrap([this](MPI_Comm c, int k, float* in, float* out, int n) {
           scratch_.resize(static_cast<std::size_t>(n) * k);
           MPI_Reduce(in, scratch_.data(), n * k, MPI_FLOAT, MPI_SUM, 0, c);
           MPI_Scatter(scratch_.data(), n, MPI_FLOAT, out, n, MPI_FLOAT, 0, c);
         })},
        {"partir ring (MPI_Sendrecv)", Call([&partir](const p::Group& g, CollectiveKind, float* in, float* out, std::int64_t count) {
           partir.ring_reduce_scatter(g, in, out, count, p::DType::f32);
         })},
        {"partir shared memory", Call([&partir](const p::Group& g, CollectiveKind, float* in, float* out, std::int64_t count) {
           partir.shared_memory().reduce_scatter(g, in, out, count, p::DType::f32);
         })},
    };
  }

 private:
  std::map<std::vector<int>, MPI_Comm> comms_;
  std::vector<float> scratch_;
};

// busbw of each implementation of `kind` per size: the figures behind the mpi backend's choice.
void compare_algorithms(p::mpi::Communicator& comm, const Options& o, CollectiveKind kind,
                        const std::vector<std::pair<std::string, Call>>& variants) {
  const p::Mesh mesh = o.mesh.empty() ? p::Mesh{{"d", comm.num_devices()}} : p::Mesh::parse(o.mesh);
  p::AxisList axes = o.axis.empty() ? p::AxisList{} : split_axes(o.axis);
  if (axes.empty())
    for (const auto& a : mesh.axes()) axes.push_back(a.name);
  const int me = comm.device();
  p::Group g;
  for (auto d : mesh.group(me, axes)) g.devices.push_back(static_cast<int>(d));
  if (me == 0) {
    std::printf("# %s busbw (GB/s) by implementation, groups of %d, #wrong in brackets\n# %12s", std::string(p::name_of(kind)).c_str(),
                g.size(), "size(B)");
    for (const auto& [name, call] : variants) std::printf(" %26s", name.c_str());
    std::printf("\n");
  }
  for (std::int64_t size = o.min_bytes; size <= o.max_bytes; size *= o.factor) {
    const Buffers b = buffers(kind, size, g.size());
    std::vector<float> in(static_cast<std::size_t>(b.in)), out(static_cast<std::size_t>(b.out));
    std::vector<double> best(variants.size(), 1e30);
    for (int round = 0; round < o.rounds; ++round)
      for (std::size_t v = 0; v < variants.size(); ++v)
        best[v] = std::min(best[v], p::calibration::seconds_per_call(comm, o.warmup, o.iterations, [&] {
          variants[v].second(g, kind, in.data(), out.data(), b.count);
        }));
    if (me == 0) std::printf("  %12lld", static_cast<long long>(b.in * 4));
    for (std::size_t v = 0; v < variants.size(); ++v) {
      const auto wrong = p::calibration::max_over_devices(
          comm, static_cast<double>(wrong_elements(variants[v].second, g, me, kind, b, in, out)));
      const double busbw = static_cast<double>(b.in * 4) / best[v] / 1e9 * p::bus_factor(kind, g.size());
      if (me == 0) std::printf(" %22.3f [%.0f]", busbw, wrong);
    }
    if (me == 0) std::printf("\n");
  }
  if (me == 0 && kind == CollectiveKind::all_reduce)
    std::printf("# partir's all_reduce on groups of %d: %s\n", g.size(), all_reduce_choice(comm, o, g).c_str());
}
#endif

#ifdef PARTIR_BENCH_NCCL
// Two device buffers per GPU, grown as the sizes grow, zero-filled (the timed calls' data does not matter;
// the checked call uses host buffers).
class NcclBuffers {
 public:
  ~NcclBuffers() {
    for (auto* b : buffers_)
      if (b) cudaFree(b);
  }
  float* get(int slot, std::int64_t elements) {
    auto& b = buffers_[static_cast<std::size_t>(slot)];
    auto& have = sizes_[static_cast<std::size_t>(slot)];
    if (elements > have) {
      if (b) cudaFree(b);
      b = nullptr;
      const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(elements, 1)) * sizeof(float);
      p::gpu::check_cuda(cudaMalloc(reinterpret_cast<void**>(&b), bytes), "cudaMalloc (benchmark buffer)");
      p::gpu::check_cuda(cudaMemset(b, 0, bytes), "cudaMemset");
      have = elements;
    }
    return b;
  }

 private:
  std::array<float*, 2> buffers_{};
  std::array<std::int64_t, 2> sizes_{};
};

void run_nccl(p::nccl::Communicator& comm, const Options& o) {
  NcclBuffers buffers;
  run(comm, o, nullptr, [&](int slot, std::int64_t elements) { return buffers.get(slot, elements); });
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    if (o.backend == "threads") {
      const int devices = o.mesh.empty() ? (o.devices ? o.devices : 2) : static_cast<int>(p::Mesh::parse(o.mesh).num_devices());
      p::threads::run(devices, [&](p::threads::Communicator& c) { run(c, o, nullptr); });
    } else if (o.backend == "mpi") {
#ifdef PARTIR_BENCH_MPI
      p::mpi::Session session(argc, argv);
      p::mpi::Communicator comm;
      RawMpi raw;
      // The all_reduce algorithm a training run would use: the examples tune it from the machine's profile.
      Options tuned = o;
      if (o.profile_path == "machine") tuned.profile = p::machine_profile(comm);
      else if (o.profile_path != "default") tuned.profile = p::HardwareProfile::load(o.profile_path);
      if (tuned.profile) p::tune_collectives(comm, *tuned.profile);
      if (o.algorithms) {
        compare_algorithms(comm, o, CollectiveKind::all_reduce, raw.all_reduce_variants(comm));
        compare_algorithms(comm, o, CollectiveKind::reduce_scatter, raw.reduce_scatter_variants(comm));
        compare_algorithms(comm, o, CollectiveKind::all_gather, raw.exchange_variants(comm));
        compare_algorithms(comm, o, CollectiveKind::all_to_all, raw.exchange_variants(comm));
      } else {
        const Call raw_call = raw.call();
        run(comm, tuned, o.raw ? &raw_call : nullptr);
      }
#else
      fail("--backend mpi: this build has no MPI (configure with -Dmpi=enabled and an MPI installation)");
#endif
    } else if (o.backend == "nccl") {
#ifdef PARTIR_BENCH_NCCL
      if (!o.calibrate_path.empty()) fail("--calibrate times CPU kernels: use it with --backend threads or mpi");
#ifdef PARTIR_BENCH_MPI
      if (std::getenv("OMPI_COMM_WORLD_SIZE")) {  // under mpirun: one rank per GPU
        p::mpi::Session session(argc, argv);
        auto comm = p::nccl::from_mpi();
        run_nccl(*comm, o);
        return 0;
      }
#endif
      const int devices = !o.mesh.empty() ? static_cast<int>(p::Mesh::parse(o.mesh).num_devices())
                          : o.devices    ? o.devices
                                         : std::max(p::gpu::device_count(), 1);
      p::nccl::run(devices, [&](p::nccl::Communicator& c) { run_nccl(c, o); });
#else
      fail("--backend nccl: this build has no NCCL backend (configure with -Dnccl=enabled; needs CUDA and NCCL under CUDA_HOME)");
#endif
    } else {
      fail("unknown backend '" + o.backend + "' (threads, mpi or nccl)");
    }
  } catch (const p::UserError& e) {
    std::cerr << "collectives: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
