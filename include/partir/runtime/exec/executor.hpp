#pragma once
// The one walker (detail::Walk<Device, Communicator>): runs one device's share of an ExecutionPlan
// (spmd/execution_plan.hpp) on a Device — here the CPU's (CpuDevice: the CPU kernels, the plan's fused groups as
// one loop each, the thread's buffer cache), in runtime/gpu/executor.hpp the GPU's — with collectives through
// any Communicator backend, on the device's communication stream where the plan's stream policy says so, and
// buffers freed by the plan's frees; records peak bytes, the time of every collective and, when asked, of every op.
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <span>

#include "partir/config.hpp"
#include "partir/runtime/comm/comm_stream.hpp"
#include "partir/runtime/comm/communicator.hpp"
#include "partir/runtime/comm/threads.hpp"
#include "partir/runtime/exec/run_op.hpp"
#include "partir/runtime/kernels/buffer_cache.hpp"
#include "partir/runtime/kernels/elements.hpp"
#include "partir/runtime/kernels/layout.hpp"
#include "partir/spmd/execution_plan.hpp"

namespace partir {

// How one run binds its inputs and outputs; how it runs (fusion, frees, donation, the stream policy) is the
// ExecutionPlan's.
struct ExecuteOptions {
  bool global_inputs = true;   // inputs are global arrays (each device takes its piece), else local pieces
  bool global_outputs = true;  // outputs are gathered to global arrays on every device, else local pieces
  bool check_finite = false;   // a NaN or Inf in any input is a UserError naming the input and element
  bool timeline = false;       // time every op into DeviceResult::timeline (calibrate/trace.hpp makes it a trace)
  // Inputs the caller gives up (JAX's donate_argnums), with a plan made with donate_state: each input that an
  // output updates is moved out of *donate (which holds it as `inputs` does; it may be the same map) and freed
  // after its last use, so a step never holds its old and new state at once; the output holds the new value.
  // With global_inputs the caller's arrays stay and the device's own pieces of them are freed so.
  // Executable::step donates its state.
  NamedArrays* donate = nullptr;
};

// When an op ran, in seconds from the start of execute(). A fused chain is timed at its root.
struct OpTiming {
  ValueId value = -1;
  double start = 0, seconds = 0;
  friend bool operator==(const OpTiming&, const OpTiming&) = default;
};

// Of the time a device spent in collectives (a timeline of execute() on p), the fraction during which it also
// ran local ops: the communication its stream hid behind compute. 0 without collectives.
inline double hidden_communication_fraction(const SpmdProgram& p, const std::vector<OpTiming>& timeline) {
  std::vector<const OpTiming*> compute, communication;
  for (const auto& t : timeline) {
    (p.op(t.value).communicates() ? communication : compute).push_back(&t);
  }
  double total = 0, hidden = 0;
  for (const auto* c : communication) {
    total += c->seconds;
    for (const auto* o : compute)
      hidden += std::max(0.0, std::min(c->start + c->seconds, o->start + o->seconds) - std::max(c->start, o->start));
  }
  return total > 0 ? hidden / total : 0;
}

struct DeviceResult {
  NamedArrays outputs;
  std::int64_t peak_bytes = 0;              // counted as by interpret(): inputs resident throughout
  std::vector<double> collective_seconds;   // one per entry of SpmdProgram::collectives()
  std::vector<OpTiming> timeline;           // with ExecuteOptions::timeline: every op that ran, in order
  double gpu_seconds = 0;                   // GPU executor: its ops on the stream, host<->GPU copies excluded
};

namespace detail {

inline Group group_of(const Mesh& mesh, std::int64_t device, const AxisList& axes) {
  Group g;
  for (auto d : mesh.group(device, axes)) g.devices.push_back(static_cast<int>(d));
  return g;
}

// A collective_permute's target and source for the member at `position` of a group of k: group indices, -1
// past either end.
inline std::pair<int, int> permute_peers(const Collective& c, std::int64_t position, std::int64_t k) {
  auto member = [&](std::int64_t q) { return q >= 0 && q < k ? static_cast<int>(q) : -1; };
  return {member(position + c.shift), member(position - c.shift)};
}

// Staging for a collective's blocks, every byte of which is written before it is read (no zeroing).
inline std::unique_ptr<std::byte[]> scratch_bytes(std::int64_t bytes) {
  return bytes ? std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(bytes)) : nullptr;
}

// Runs a collective other than all_slice into `out`, a buffer of its result type that the caller made (on the
// device's own thread: the buffer cache is per thread), so a stream can run it on another thread.
template <Communicator C>
void run_collective_into(const Collective& c, const Array& in, Array& out, const Mesh& mesh, C& comm) {
  const std::int64_t device = comm.device();
  const Group group = group_of(mesh, device, c.axes);
  const std::int64_t k = group.size();
  switch (c.kind) {
    case CollectiveKind::all_reduce:  // in place when the executor handed over the operand's buffer (in is out)
      if (&in != &out) std::memcpy(layout::bytes(out), layout::bytes(in), static_cast<std::size_t>(in.bytes()));
      comm.all_reduce(group, layout::bytes(out), out.size(), out.dtype());
      return;
    case CollectiveKind::all_gather: {
      if (layout::tiles_are_blocks(out.shape(), c.dim)) {
        comm.all_gather(group, layout::bytes(in), layout::bytes(out), in.size(), in.dtype());
        return;
      }
      const auto blocks = scratch_bytes(out.bytes());
      comm.all_gather(group, layout::bytes(in), blocks.get(), in.size(), in.dtype());
      layout::unpack(blocks.get(), c.dim, k, out);
      return;
    }
    case CollectiveKind::reduce_scatter: {
      if (layout::tiles_are_blocks(in.shape(), c.dim)) {
        comm.reduce_scatter(group, layout::bytes(in), layout::bytes(out), out.size(), out.dtype());
        return;
      }
      const auto packed = scratch_bytes(in.bytes());
      layout::pack(in, c.dim, k, packed.get());
      comm.reduce_scatter(group, packed.get(), layout::bytes(out), out.size(), out.dtype());
      return;
    }
    case CollectiveKind::all_to_all: {
      const bool send_in_place = layout::tiles_are_blocks(in.shape(), c.to_dim),
                 receive_in_place = layout::tiles_are_blocks(out.shape(), c.dim);
      const auto sent = scratch_bytes(send_in_place ? 0 : in.bytes()),
                 received = scratch_bytes(receive_in_place ? 0 : out.bytes());
      if (!send_in_place) layout::pack(in, c.to_dim, k, sent.get());
      comm.all_to_all(group, send_in_place ? layout::bytes(in) : sent.get(),
                      receive_in_place ? layout::bytes(out) : received.get(), in.size() / k, in.dtype());
      if (!receive_in_place) layout::unpack(received.get(), c.dim, k, out);
      return;
    }
    case CollectiveKind::collective_permute: {
      const auto [to, from] = permute_peers(c, mesh.position(device, c.axes), k);
      if (from < 0) std::memset(layout::bytes(out), 0, static_cast<std::size_t>(out.bytes()));
      comm.collective_permute(group, to, layout::bytes(in), from, layout::bytes(out), in.size(), in.dtype());
      return;
    }
    case CollectiveKind::all_slice:
    case CollectiveKind::send:
    case CollectiveKind::recv: break;  // local (run_collective) / run_transfer's
  }
  internal_error("run_collective_into: " + std::string(name_of(c.kind)) + " is not run here");
}

template <Communicator C>
Array run_collective(const Collective& c, const Array& in, const TensorType& result, const Mesh& mesh, C& comm) {
  if (c.kind == CollectiveKind::all_slice)
    return layout::tile(in, c.dim, group_of(mesh, comm.device(), c.axes).size(), mesh.position(comm.device(), c.axes));
  Array out = kernels::buffer_cache().take(result);  // every collective writes all of it
  run_collective_into(c, in, out, mesh, comm);
  return out;
}

// A pipeline transfer: a send hands this device's operand to the device at stage `peer` (the same position on
// every other axis) and holds nothing; a recv makes the value it receives. Where the backend sends in place, the
// caller keeps the operand unchanged until comm.finish_sends().
template <Communicator C>
Array run_transfer(const Collective& c, const Array* in, const TensorType& result, const Mesh& mesh, C& comm) {
  const Group stages = group_of(mesh, comm.device(), c.axes);
  const int peer = stages.devices.at(static_cast<std::size_t>(c.peer));
  if (c.kind == CollectiveKind::send) {
    if constexpr (SendsInPlace<C>) comm.send_in_place(peer, layout::bytes(*in), in->size(), in->dtype(), c.tag);
    else comm.send(peer, layout::bytes(*in), in->size(), in->dtype(), c.tag);
    return Array(result);  // an empty shape: what the sender keeps
  }
  Array out = kernels::buffer_cache().take(result);
  comm.recv(peer, layout::bytes(out), out.size(), out.dtype(), c.tag);
  return out;
}

// gather / scatter_add over a table whose rows are tiled: only rows this device holds take part.
// Every device checks every index against the global row count, so a bad index fails as it does on one
// device instead of silently reading (or dropping) nothing on each.
inline Array row_sharded(const SpmdOp& s, std::span<const Array* const> in, std::int64_t first_row,
                         std::int64_t global_rows) {
  const bool is_gather = s.op.kind == OpKind::gather;
  const Array& indices = *in[is_gather ? 1 : 0];
  const Array& rows_in = *in[is_gather ? 0 : 1];
  Array out(s.op.type);  // zeros
  const auto table_rows = (is_gather ? rows_in.shape() : out.shape()).at(0);
  const auto row_elems = (is_gather ? rows_in.size() : out.size()) / std::max<std::int64_t>(table_rows, 1);
  auto idx = indices.data<std::int32_t>();
  TensorType global = is_gather ? rows_in.type() : out.type();
  global.shape.at(0) = global_rows;
  kernels::visit_dtype(out.dtype(), [&](auto t) {
    using T = decltype(t);
    auto src = rows_in.data<T>();
    auto dst = out.data<T>();
    for (std::size_t i = 0; i < idx.size(); ++i) {
      const std::int64_t r = kernels::checked_row(idx[i], global_rows, s.op.kind, global) - first_row;
      if (r < 0 || r >= table_rows) continue;
      for (std::int64_t e = 0; e < row_elems; ++e) {
        if (is_gather) dst[i * row_elems + e] = src[r * row_elems + e];
        else dst[r * row_elems + e] = plus(dst[r * row_elems + e], src[i * row_elems + e]);
      }
    }
  });
  return out;
}

inline void check_finite(const std::string& where, const std::string& name, const Array& a) {
  if (!is_float(a.dtype())) return;
  for (std::int64_t i = 0; i < a.size(); ++i) {
    const double x = a.at(i);
    if (std::isfinite(x)) continue;
    user_error(where + ": input '" + name + "' " + to_string(a.type()) + " has a non-finite value (" +
               (std::isnan(x) ? "nan" : x > 0 ? "inf" : "-inf") + ") at element " + std::to_string(i) +
               " (check_finite)");
  }
}

}  // namespace detail

// The CPU Device of the walk (Eigen's TensorDevice, in the role of one): values are host Arrays, buffers come
// from and go back to the thread's buffer cache, local ops run the CPU kernels (a fused group as one loop; a
// reshape takes a dying operand's buffer), collectives go through the communicator on host memory. The caller's
// arrays are read in place; the walk's outputs are its own buffers.
//
// A Device D gives the walk (see gpu::Device for the other):
//   using Buffer (bytes()); take(type); release(Buffer&); take_storage(Buffer&, shape) (the storage, leaving a
//   husk); bind(given, slot) (an input the caller keeps: a pointer to read it through, slot filled if copied);
//   adopt(Array&&) (an input handed over); compute(op, group, values, owned, dying) (a local op or fused group);
//   row_sharded(op, operands, first_row, rows); collective(c, in, type, mesh, comm);
//   collective_into(c, in, out, mesh, comm); transfer(c, in, type, mesh, comm) (pipeline send/recv);
//   copy(buffer); download(Buffer&&) (an output, valid after finish()); Span start_span() / stop_span(Span&) and
//   span_times(Span&) (start and seconds from the run's start); begin(), ops_done(), finish(), abandon() around
//   a run; bind_side_outputs(group, values, owned) (a fused group's stored inner values: their bytes).
struct CpuDevice {
  using Buffer = Array;
  using clock = std::chrono::steady_clock;
  struct Span {
    clock::time_point start;
    double seconds = 0;
  };

  Array take(const TensorType& type) { return kernels::buffer_cache().take(type); }
  void release(Array& a) { kernels::buffer_cache().give(std::move(a)); }  // reused by later ops and steps
  static Array take_storage(Array& from, const Shape& shape) { return partir::take_storage(from, shape); }
  const Array* bind(const Array& given, std::optional<Array>&) { return &given; }
  Array adopt(Array&& a) { return std::move(a); }
  Array compute(const Op& op, const FusionGroup* group, std::span<const Array* const> values,
                std::span<std::optional<Array>> owned, std::span<const ValueId> dying) {
    return run_op(op, group, values, owned, dying);
  }
  std::int64_t bind_side_outputs(const FusionGroup* group, std::span<const Array*> values,
                                 std::span<std::optional<Array>> owned) {
    return partir::bind_side_outputs(group, values, owned);
  }
  Array row_sharded(const SpmdOp& s, std::span<const Array* const> in, std::int64_t first_row, std::int64_t rows) {
    return detail::row_sharded(s, in, first_row, rows);
  }
  template <Communicator C>
  Array collective(const Collective& c, const Array& in, const TensorType& result, const Mesh& mesh, C& comm) {
    return detail::run_collective(c, in, result, mesh, comm);
  }
  template <Communicator C>
  void collective_into(const Collective& c, const Array& in, Array& out, const Mesh& mesh, C& comm) {
    detail::run_collective_into(c, in, out, mesh, comm);
  }
  template <Communicator C>
  Array transfer(const Collective& c, const Array* in, const TensorType& result, const Mesh& mesh, C& comm) {
    return detail::run_transfer(c, in, result, mesh, comm);
  }
  Array copy(const Array& a) { return a; }
  Array download(Array&& a) { return std::move(a); }

  void begin() { start = clock::now(); }
  void ops_done() {}
  void finish() { kernels::buffer_cache().end_run(); }
  void abandon() {}
  Span start_span() const { return {clock::now()}; }
  void stop_span(Span& s) const { s.seconds = std::chrono::duration<double>(clock::now() - s.start).count(); }
  OpTiming span_times(const Span& s) const {
    return {-1, std::chrono::duration<double>(s.start - start).count(), s.seconds};
  }

  clock::time_point start;
};

namespace detail {

// The global value of a bound value on device `dev`, on every device of the mesh, from this device's piece: partial
// sums all_reduced, tiled dims all_gathered, each step's operand given back. Every device must call it (a
// collective).
template <class D, Communicator C>
typename D::Buffer gather_global(D& dev, typename D::Buffer piece, const Binding& b, const Mesh& mesh, C& comm) {
  auto step = [&](const Collective& c, const TensorType& type) {
    auto next = dev.collective(c, piece, type, mesh, comm);
    dev.release(piece);
    piece = std::move(next);
  };
  Shape shape = piece.type().shape;
  if (!b.sharding.partial.empty()) step({CollectiveKind::all_reduce, b.sharding.partial}, piece.type());
  for (std::size_t d = 0; d < b.sharding.dims.size(); ++d) {
    if (b.sharding.dims[d].empty()) continue;
    shape[d] = b.global.shape[d];
    step({CollectiveKind::all_gather, b.sharding.dims[d], static_cast<std::int64_t>(d)}, {shape, piece.type().dtype});
  }
  return piece;
}

// The same for a host array (Executable's outputs and gather_state).
template <Communicator C>
Array gather_global(Array piece, const Binding& b, const Mesh& mesh, C& comm) {
  CpuDevice dev;
  return gather_global(dev, std::move(piece), b, mesh, comm);
}

// The caller's array for input b, checked against what the program expects of it (a global array or a local
// piece; finite where asked).
inline const Array& checked_input(const SpmdProgram& p, const Binding& b, const NamedArrays& inputs,
                                  const ExecuteOptions& options, const std::string& where) {
  auto it = inputs.find(b.name);
  if (it == inputs.end()) user_error(where + ": missing input '" + b.name + "'");
  const TensorType& expect = options.global_inputs ? b.global : p.type(b.value);
  if (it->second.type() != expect)
    user_error(where + ": input '" + b.name + "' expects " + to_string(expect) +
               (options.global_inputs ? "" : " (local piece)") + ", got " + to_string(it->second.type()));
  if (options.check_finite) check_finite(where, b.name, it->second);
  return it->second;
}

// A run's preconditions: as many devices as the mesh, and no input the program does not have.
inline void check_run(const SpmdProgram& p, int devices, const NamedArrays& inputs, const std::string& where) {
  if (p.mesh().num_devices() != devices)
    user_error(where + ": mesh " + p.mesh().to_string() + " has " + std::to_string(p.mesh().num_devices()) +
               " devices but the communicator has " + std::to_string(devices));
  for (const auto& [name, array] : inputs)
    if (std::none_of(p.inputs().begin(), p.inputs().end(), [&](const Binding& b) { return b.name == name; }))
      user_error(where + ": no input named '" + name + "'");
}

// The one walker: one device's run of one stage of an ExecutionPlan on a Device D (CpuDevice above, gpu::Device),
// over the values in program order, with the bookkeeping of buffers (made, handed over, freed by the plan's
// frees), of the communication stream and of timing. The memory it counts is the simulator's by construction:
// both free by the same plan.
template <class D, Communicator C>
class Walk {
 public:
  using Buffer = typename D::Buffer;

  Walk(const StagePlan& plan, D& device, C& comm, const ExecuteOptions& options, const std::string& where)
      : plan_(plan), p_(*plan.program), mesh_(p_.mesh()), dev_(device), comm_(comm), options_(options), where_(where),
        values_(size()), owned_(size()), donated_(size(), false), stream_uses_(size(), 0), ticket_of_(size(), -1),
        sent_in_place_(size(), 0) {
    if (options.donate) donated_ = plan.donated;
    if constexpr (StreamableCommunicator<C>) streams_ = plan.overlap && comm.streams_collectives();
  }

  DeviceResult run(const NamedArrays& inputs) {
    try {
      bind_inputs(inputs);
      dev_.begin();
      for (ValueId v = 0; v < p_.size(); ++v) {
        const SpmdOp& s = p_.op(v);
        if (is_program_input(s)) {
          if (!values_[at(v)]) internal_error(where_ + ": input %" + std::to_string(v) + " has no binding");
        } else if (streams_ && plan_.streamed(v, !in_flight_.empty())) {
          issue(v);
        } else if (plan_.fusion.runs_at(v)) {
          run_here(v);
        }
        free_after(v);
        if (stream_) retire(-1);
      }
      if (stream_ && !in_flight_.empty()) retire(in_flight_.back().ticket);
      if constexpr (SendsInPlace<C>) comm_.finish_sends();
      for (auto v : freed_after_sends_) release(v);
      result_.peak_bytes = peak_;
      dev_.ops_done();
      collect_outputs();
      dev_.finish();
    } catch (const std::exception& e) {
      if (stream_) stream_->abandon(e.what());
      dev_.abandon();
      throw;
    }
    for (auto& [slots, span] : spans_) {
      const OpTiming t = dev_.span_times(span);
      if (slots.collective >= 0) result_.collective_seconds[static_cast<std::size_t>(slots.collective)] = t.seconds;
      if (slots.timeline >= 0)
        result_.timeline[static_cast<std::size_t>(slots.timeline)] = {slots.value, t.start, t.seconds};
    }
    return std::move(result_);
  }

 private:
  // A collective on the stream: its result buffer and operand stay as they are until it has run (stream_uses_);
  // a value whose last use comes earlier is counted free at that use, as the simulator counts it, and its buffer
  // handed back when the collectives using it are done.
  struct InFlight {
    ValueId value;
    std::int64_t ticket;
    std::size_t collective_index, timeline_index;
    double start = 0, seconds = 0;  // written by the stream
    std::vector<ValueId> released;  // buffers to hand back once it has run
  };
  // Where the time of an op run here goes once the device can tell it (-1: nowhere).
  struct Slots {
    ValueId value;
    std::int64_t collective = -1, timeline = -1;
  };

  std::size_t size() const { return static_cast<std::size_t>(p_.size()); }
  static std::size_t at(ValueId v) { return static_cast<std::size_t>(v); }
  bool pinned(ValueId v) const { return stream_uses_[at(v)] > 0 || sent_in_place_[at(v)] != 0; }

  void hold(std::int64_t bytes) {
    resident_ += bytes;
    peak_ = std::max(peak_, resident_);
  }

  // Every input checked before any donated one is taken: a bad input leaves the caller's arrays as they were.
  void bind_inputs(const NamedArrays& inputs) {
    for (const auto& b : p_.inputs()) {
      (void)checked_input(p_, b, inputs, options_, where_);
      resident_ += p_.type(b.value).bytes();
    }
    peak_ = resident_;
    for (const auto& b : p_.inputs()) {
      auto& slot = owned_[at(b.value)];
      const Array& given = inputs.at(b.name);
      if (options_.global_inputs) {
        slot = dev_.adopt(layout::shard(given, b.sharding, mesh_, comm_.device()));
      } else if (donated_[at(b.value)]) {
        if (auto d = options_.donate->find(b.name); d != options_.donate->end())
          slot = dev_.adopt(std::move(d->second));
      }
      values_[at(b.value)] = slot ? &*slot : dev_.bind(given, slot);
    }
  }

  // An all_reduce whose operand dies there sums in the operand's buffer (a gradient straight from its GEMM): no
  // copy, no second buffer. The husk left behind is freed as the operand, so the peak counts both, as the
  // simulator does.
  std::optional<Buffer> reduce_in_place(ValueId v) {
    const SpmdOp& s = p_.op(v);
    const ValueId operand = s.op.operands.at(0);
    auto& buffer = owned_[at(operand)];
    const auto& dies = plan_.frees()[at(v)];
    if (s.collective->kind != CollectiveKind::all_reduce || !buffer || pinned(operand) ||
        std::find(dies.begin(), dies.end(), operand) == dies.end())
      return std::nullopt;
    return D::take_storage(*buffer, s.op.type.shape);
  }

  // Hands the collective at v to the stream, which runs collectives in order: an operand made by an earlier one
  // is ready when this one starts.
  void issue(ValueId v) {
    const SpmdOp& s = p_.op(v);
    if constexpr (StreamableCommunicator<C>)
      if (!stream_) stream_.emplace([this](const std::string& why) { comm_.abort(why); });
    const ValueId operand = s.op.operands.at(0);
    auto& slot = owned_[at(v)];
    slot = reduce_in_place(v);
    const bool in_place = slot.has_value();
    if (!in_place) slot = dev_.take(s.op.type);
    InFlight& f = in_flight_.emplace_back(InFlight{v, -1, result_.collective_seconds.size(), result_.timeline.size()});
    result_.collective_seconds.push_back(0);
    if (options_.timeline) result_.timeline.push_back({v, 0, 0});
    f.ticket = stream_->issue([this, v, record = &f, c = &*s.collective,
                               in = in_place ? &*slot : values_[at(operand)], out = &*slot] {
      auto span = dev_.start_span();
      try {
        dev_.collective_into(*c, *in, *out, mesh_, comm_);
      } catch (const UserError& e) {
        user_error(where_ + ": %" + std::to_string(v) + ": " + e.what());
      }
      dev_.stop_span(span);
      const OpTiming t = dev_.span_times(span);
      record->start = t.start;
      record->seconds = t.seconds;
    });
    ticket_of_[at(v)] = f.ticket;
    for (auto u : {operand, v}) ++stream_uses_[at(u)];
    values_[at(v)] = &*slot;
    hold(slot->bytes());
  }

  // Bookkeeping of collectives that have run, oldest first; with `until`, first waits for that ticket.
  void retire(std::int64_t until) {
    if (until >= 0) stream_->wait(until);
    while (!in_flight_.empty() && (in_flight_.front().ticket <= until || stream_->done(in_flight_.front().ticket))) {
      InFlight& f = in_flight_.front();
      stream_->wait(f.ticket);  // rethrows a failure of the poll's task; orders its writes before the reads below
      result_.collective_seconds[f.collective_index] = f.seconds;
      if (options_.timeline) result_.timeline[f.timeline_index] = {f.value, f.start, f.seconds};
      ticket_of_[at(f.value)] = -1;
      for (auto v : {p_.op(f.value).op.operands.at(0), f.value}) --stream_uses_[at(v)];
      for (auto v : f.released) release(v);
      in_flight_.pop_front();
    }
  }

  // Waits for the collectives whose results the op at v reads (a fused group: any of its inputs).
  void wait_for_operands(ValueId v) {
    std::int64_t needed = -1;
    auto need = [&](ValueId o) { needed = std::max(needed, ticket_of_[at(o)]); };
    for (auto o : p_.op(v).op.operands) need(o);
    if (const FusionGroup* g = plan_.fusion.group_at(v))
      for (const auto& in : g->inputs) need(in.value);
    retire(needed);
  }

  // Runs what the plan places at v on this thread: its op, its fused group, a transfer or a collective inline.
  void run_here(ValueId v) {
    if (stream_) wait_for_operands(v);
    const SpmdOp& s = p_.op(v);
    operands_.clear();
    for (auto o : s.op.operands) operands_.push_back(values_[at(o)]);
    Slots slots{v};
    if (s.collective) {
      slots.collective = static_cast<std::int64_t>(result_.collective_seconds.size());
      result_.collective_seconds.push_back(0);
    }
    if (options_.timeline) {
      slots.timeline = static_cast<std::int64_t>(result_.timeline.size());
      result_.timeline.push_back({v, 0, 0});
    }
    const bool timed = slots.collective >= 0 || slots.timeline >= 0;
    std::optional<typename D::Span> span;
    if (timed) span = dev_.start_span();
    auto& slot = owned_[at(v)];
    try {
      slot = compute(v);
    } catch (const UserError& e) {
      user_error(where_ + ": %" + std::to_string(v) + ": " + e.what());
    }
    if (timed) {
      dev_.stop_span(*span);
      spans_.emplace_back(slots, *span);
    }
    values_[at(v)] = &*slot;
    hold(slot->bytes() + dev_.bind_side_outputs(plan_.fusion.group_at(v), values_, owned_));
  }

  Buffer compute(ValueId v) {
    const SpmdOp& s = p_.op(v);
    if (s.collective && (s.collective->kind == CollectiveKind::send || s.collective->kind == CollectiveKind::recv)) {
      Buffer out = dev_.transfer(*s.collective, operands_.empty() ? nullptr : operands_[0], s.op.type, mesh_, comm_);
      if constexpr (SendsInPlace<C>)
        if (s.collective->kind == CollectiveKind::send) sent_in_place_[at(s.op.operands.at(0))] = 1;
      return out;
    }
    if (s.collective) {
      if (auto in_place = reduce_in_place(v)) {
        dev_.collective_into(*s.collective, *in_place, *in_place, mesh_, comm_);
        return std::move(*in_place);
      }
      return dev_.collective(*s.collective, *operands_[0], s.op.type, mesh_, comm_);
    }
    if (!s.row_shard.empty()) {
      const auto rows = (s.op.kind == OpKind::gather ? operands_[0]->type() : s.op.type).shape.at(0);
      return dev_.row_sharded(s, operands_, mesh_.position(comm_.device(), s.row_shard) * rows,
                              rows * tile_count(s.row_shard, mesh_));
    }
    // A reshape may take a dying operand's buffer, unless the stream or a send still reads it.
    dying_ = plan_.frees()[at(v)];
    std::erase_if(dying_, [this](ValueId d) { return pinned(d); });
    return dev_.compute(s.op, plan_.fusion.group_at(v), values_, owned_, dying_);
  }

  // Frees what dies at v: at once, after the collectives still reading it, or after the sends still reading it.
  // Inputs stay resident (parameters, state) unless donated.
  void free_after(ValueId v) {
    for (auto dead : plan_.frees()[at(v)]) {
      const bool kept = is_program_input(p_.op(dead)) && !donated_[at(dead)];
      auto& buffer = owned_[at(dead)];
      if (kept || !buffer) continue;
      resident_ -= buffer->bytes();
      values_[at(dead)] = nullptr;
      if (stream_uses_[at(dead)] > 0) in_flight_.back().released.push_back(dead);
      else if (sent_in_place_[at(dead)]) freed_after_sends_.push_back(dead);
      else release(dead);
    }
  }

  void release(ValueId dead) {
    auto& buffer = owned_[at(dead)];
    dev_.release(*buffer);
    buffer.reset();
  }

  // An intermediate output hands over its buffer (unless a later output names it too); inputs are copied.
  // Global outputs: partial sums all_reduced and tiled dims all_gathered, on the device, then downloaded.
  void collect_outputs() {
    const auto& outputs = p_.outputs();
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const Binding& b = outputs[i];
      bool named_later = false;
      for (std::size_t j = i + 1; j < outputs.size(); ++j) named_later |= outputs[j].value == b.value;
      auto& buffer = owned_[at(b.value)];
      Buffer piece = buffer && !named_later ? std::move(*buffer) : dev_.copy(*values_[at(b.value)]);
      if (buffer && !named_later) buffer.reset();
      if (options_.global_outputs) piece = gather_global(dev_, std::move(piece), b, mesh_, comm_);
      result_.outputs[b.name] = dev_.download(std::move(piece));
    }
    for (auto& buffer : owned_)
      if (buffer) dev_.release(*buffer);
  }

  const StagePlan& plan_;
  const SpmdProgram& p_;
  const Mesh& mesh_;
  D& dev_;
  C& comm_;
  const ExecuteOptions& options_;
  const std::string& where_;
  std::vector<const Buffer*> values_;          // each live value's buffer
  std::vector<std::optional<Buffer>> owned_;   // all but the inputs the device reads where the caller keeps them
  std::vector<bool> donated_;
  DeviceResult result_;
  std::int64_t resident_ = 0, peak_ = 0;
  std::vector<std::pair<Slots, typename D::Span>> spans_;  // ops run here whose times are read at the end
  std::deque<InFlight> in_flight_;             // in issue order: each finishes no later than the next
  std::vector<int> stream_uses_;
  std::vector<std::int64_t> ticket_of_;        // values still being made on the stream
  std::vector<char> sent_in_place_;            // neither reused nor freed before the sends are done, at the end
  std::vector<ValueId> freed_after_sends_;
  std::vector<const Buffer*> operands_;
  std::vector<ValueId> dying_;
  bool streams_ = false;
  std::optional<CommStream> stream_;  // last: destroyed (joined) before what its tasks write; made at first use
};

}  // namespace detail

// Runs this device's share of a plan's program. A pipelined program runs the ops of this device's stage:
// `inputs` may hold every stage's; the result holds this stage's outputs, with the timeline in the pipelined
// program's numbering.
template <Communicator C>
DeviceResult execute(const ExecutionPlan& plan, C& comm, const NamedArrays& inputs,
                     const ExecuteOptions& options = {}) {
  const SpmdProgram& p = plan.program();
  const std::string where = "execute " + p.name() + " (device " + std::to_string(comm.device()) + ")";
  detail::check_run(p, comm.num_devices(), inputs, where);
  const StagePlan& stage = plan.stage_for(comm.device());
  CpuDevice device;
  DeviceResult r = detail::Walk<CpuDevice, C>(stage, device, comm, options, where).run(inputs);
  for (auto& t : r.timeline) t.value = stage.original(t.value);
  return r;
}

// One run of p: the plan made for it (donating state when options.donate is given).
template <Communicator C>
DeviceResult execute(const SpmdProgram& p, C& comm, const NamedArrays& inputs, const ExecuteOptions& options = {},
                     PlanOptions plan = {}) {
  plan.donate_state = options.donate != nullptr;
  return execute(ExecutionPlan::borrowing(p, plan), comm, inputs, options);
}

#if !PARTIR_DEFINE_ENTRIES
// libpartir holds the executor for the threads backend, instantiated once (src/libpartir.cpp).
extern template DeviceResult execute(const ExecutionPlan&, threads::Communicator&, const NamedArrays&,
                                     const ExecuteOptions&);
#endif

// Runs the plan on mesh.num_devices() threads of this process; returns each device's result.
inline std::vector<DeviceResult> execute_on_threads(const ExecutionPlan& plan, const NamedArrays& inputs,
                                                    const ExecuteOptions& options = {}) {
  const auto devices = plan.program().mesh().num_devices();
  std::vector<DeviceResult> results(static_cast<std::size_t>(devices));
  threads::run(static_cast<int>(devices), [&](threads::Communicator& c) {
    results[static_cast<std::size_t>(c.device())] = execute(plan, c, inputs, options);
  });
  return results;
}
inline std::vector<DeviceResult> execute_on_threads(const SpmdProgram& p, const NamedArrays& inputs,
                                                    const ExecuteOptions& options = {}, PlanOptions plan_options = {}) {
  plan_options.donate_state = options.donate != nullptr;
  return execute_on_threads(ExecutionPlan::borrowing(p, plan_options), inputs, options);
}

}  // namespace partir
