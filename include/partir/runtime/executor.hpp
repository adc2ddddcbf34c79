#pragma once
// Runs one device's share of an SpmdProgram: local ops on the CPU kernels (elementwise chains fused, see
// fusion.hpp), collectives through any Communicator backend, buffers freed by liveness into the thread's
// buffer cache; records peak bytes, the time of every collective and, when asked, of every op.
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>

#include "partir/config.hpp"
#include "partir/runtime/comm_stream.hpp"
#include "partir/runtime/communicator.hpp"
#include "partir/runtime/kernels/buffer_cache.hpp"
#include "partir/runtime/kernels/elements.hpp"
#include "partir/runtime/run_op.hpp"
#include "partir/runtime/layout.hpp"
#include "partir/runtime/threads.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

struct ExecuteOptions {
  bool global_inputs = true;   // inputs are global arrays (each device takes its piece), else local pieces
  bool global_outputs = true;  // outputs are gathered to global arrays on every device, else local pieces
  bool check_finite = false;   // a NaN or Inf in any input is a UserError naming the input and element
  bool timeline = false;       // time every op into DeviceResult::timeline (sim/trace.hpp makes it a trace)
  // Collectives run on the device's communication stream (comm_stream.hpp), overlapping the ops up to the first
  // use of their result; off: each blocks where the program places it. Pipelined programs, whose transfers
  // already do not block the sender, and backends that cannot stream (StreamableCommunicator) run inline.
  bool async_collectives = async_collectives_enabled();
  // Smaller collectives (the larger of operand and result) run inline while the stream is idle.
  std::int64_t stream_min_bytes = partir::stream_min_bytes();
  // plan_fusion(p) made once for many runs (Executable keeps one); null: made per run. Pipelined programs, whose
  // stage program is cut per run, make their own.
  const FusionPlan* fusion = nullptr;
  // Inputs the caller gives up (JAX's donate_argnums): each input that an output updates is moved out of *donate
  // (which holds it as `inputs` does; it may be the same map) and freed after its last use, so a step never holds
  // its old and new state at once; the output holds the new value. With global_inputs the caller's arrays stay
  // and the device's own pieces of them are freed so. Executable::step donates its state.
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

// The global array of a bound value, on every device of the mesh, from this device's piece: partial sums
// all_reduced, tiled dims all_gathered. Every device must call it (a collective).
template <Communicator C>
Array gather_global(Array piece, const Binding& b, const Mesh& mesh, C& comm) {
  Shape shape = piece.shape();
  if (!b.sharding.partial.empty())
    piece = run_collective({CollectiveKind::all_reduce, b.sharding.partial}, piece, piece.type(), mesh, comm);
  for (std::size_t d = 0; d < b.sharding.dims.size(); ++d) {
    if (b.sharding.dims[d].empty()) continue;
    shape[d] = b.global.shape[d];
    piece = run_collective({CollectiveKind::all_gather, b.sharding.dims[d], static_cast<std::int64_t>(d)}, piece,
                           TensorType{shape, piece.dtype()}, mesh, comm);
  }
  return piece;
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

template <Communicator C>
DeviceResult execute_stage(const SpmdProgram& p, C& comm, const NamedArrays& inputs, ExecuteOptions options,
                           const std::string& where);

}  // namespace detail

// Runs this device's share of p. A pipelined program runs the ops of this device's stage (stage_program):
// `inputs` may hold every stage's; the result holds this stage's outputs, with the timeline in p's numbering.
template <Communicator C>
DeviceResult execute(const SpmdProgram& p, C& comm, const NamedArrays& inputs, ExecuteOptions options = {}) {
  const Mesh& mesh = p.mesh();
  const std::string where = "execute " + p.name() + " (device " + std::to_string(comm.device()) + ")";
  if (mesh.num_devices() != comm.num_devices())
    user_error(where + ": mesh " + mesh.to_string() + " has " + std::to_string(mesh.num_devices()) +
               " devices but the communicator has " + std::to_string(comm.num_devices()));
  for (const auto& [name, array] : inputs) {
    bool known = false;
    for (const auto& b : p.inputs()) known |= b.name == name;
    if (!known) user_error(where + ": no input named '" + name + "'");
  }
  if (!p.pipeline()) return detail::execute_stage(p, comm, inputs, options, where);
  std::vector<ValueId> ids;
  const SpmdProgram stage = stage_program(p, p.stage_of(comm.device()), &ids);
  options.async_collectives = false;  // a stage's transfers already leave the sender free (see ExecuteOptions)
  options.fusion = nullptr;            // p's, not the stage's
  DeviceResult r = detail::execute_stage(stage, comm, inputs, options, where);
  for (auto& t : r.timeline) t.value = ids[static_cast<std::size_t>(t.value)];
  return r;
}

namespace detail {

template <Communicator C>
DeviceResult execute_stage(const SpmdProgram& p, C& comm, const NamedArrays& inputs, ExecuteOptions options,
                           const std::string& where) {
  const Mesh& mesh = p.mesh();
  const auto n = static_cast<std::size_t>(p.size());
  std::vector<const Array*> values(n, nullptr);
  std::vector<std::optional<Array>> owned(n);  // everything but local-piece inputs, which stay the caller's
  DeviceResult result;
  std::int64_t resident = 0;
  for (const auto& b : p.inputs()) {
    auto it = inputs.find(b.name);
    if (it == inputs.end()) user_error(where + ": missing input '" + b.name + "'");
    const TensorType& expect = options.global_inputs ? b.global : p.type(b.value);
    if (it->second.type() != expect)
      user_error(where + ": input '" + b.name + "' expects " + to_string(expect) +
                 (options.global_inputs ? "" : " (local piece)") + ", got " + to_string(it->second.type()));
    if (options.check_finite) check_finite(where, b.name, it->second);
    resident += p.type(b.value).bytes();
  }
  // Every input checked before any donated one is taken: a bad input leaves the caller's arrays as they were.
  const std::vector<bool> donated = options.donate ? updated_inputs(p) : std::vector<bool>(n, false);
  for (const auto& b : p.inputs()) {
    const auto v = static_cast<std::size_t>(b.value);
    const Array& given = inputs.at(b.name);
    if (options.global_inputs) {
      owned[v] = layout::shard(given, b.sharding, mesh, comm.device());
    } else if (donated[v]) {
      if (auto d = options.donate->find(b.name); d != options.donate->end()) owned[v] = std::move(d->second);
    }
    values[v] = owned[v] ? &*owned[v] : &given;
  }
  std::int64_t peak = resident;
  using clock = std::chrono::steady_clock;
  using seconds = std::chrono::duration<double>;
  const auto run_start = clock::now();
  std::optional<FusionPlan> planned;
  const FusionPlan& fusion = options.fusion ? *options.fusion : planned.emplace(plan_fusion(p));
  const auto& frees = fusion.last_uses();

  // The communication stream and what runs on it: a collective's result buffer and operand stay as they are
  // until it has run (`stream_uses`); a value whose last use comes earlier is counted free at that use, as the
  // simulator counts it, and its buffer handed back when the collectives using it are done.
  struct InFlight {
    ValueId value;
    std::int64_t ticket;
    std::size_t collective_index, timeline_index;
    double start = 0, seconds = 0;   // written by the stream
    std::vector<ValueId> released;   // buffers to hand back once it has run
  };
  std::deque<InFlight> in_flight;  // in issue order: each finishes no later than the next
  std::vector<int> stream_uses(n, 0);
  std::vector<std::int64_t> ticket_of(n, -1);  // values still being made on the stream
  std::optional<CommStream> stream;  // after what its tasks write: destroyed (joined) first; made at first use
  bool streams = false;
  if constexpr (StreamableCommunicator<C>) streams = options.async_collectives && comm.streams_collectives();
  // Values sent in place: their buffers are neither reused nor freed before the sends are done, at the end.
  std::vector<char> sent_in_place(n, 0);
  std::vector<ValueId> freed_after_sends;
  auto pinned = [&](ValueId v) {
    return stream_uses[static_cast<std::size_t>(v)] > 0 || sent_in_place[static_cast<std::size_t>(v)] != 0;
  };

  // An all_reduce whose operand dies there sums in the operand's buffer (a gradient straight from its GEMM): no
  // copy, no second buffer. The husk left behind is freed as the operand, so the peak counts both, as the
  // simulator does.
  auto reduce_in_place = [&](const SpmdOp& s, ValueId v) -> std::optional<Array> {
    const auto operand = static_cast<std::size_t>(s.op.operands.at(0));
    auto& buffer = owned[operand];
    const auto& dies = frees[static_cast<std::size_t>(v)];
    if (s.collective->kind != CollectiveKind::all_reduce || !buffer || pinned(s.op.operands[0]) ||
        std::find(dies.begin(), dies.end(), s.op.operands[0]) == dies.end())
      return std::nullopt;
    return take_storage(*buffer, s.op.type.shape);
  };
  auto release = [&](ValueId dead) {
    auto& buffer = owned[static_cast<std::size_t>(dead)];
    kernels::buffer_cache().give(std::move(*buffer));  // reused by later ops and steps: no fresh pages
    buffer.reset();
  };
  // Bookkeeping of collectives that have run, oldest first; with `until`, first waits for that ticket.
  auto retire = [&](std::int64_t until) {
    if (until >= 0) stream->wait(until);
    while (!in_flight.empty() && (in_flight.front().ticket <= until || stream->done(in_flight.front().ticket))) {
      InFlight& f = in_flight.front();
      stream->wait(f.ticket);  // rethrows a failure of the poll's task; orders its writes before the reads below
      result.collective_seconds[f.collective_index] = f.seconds;
      if (options.timeline) result.timeline[f.timeline_index] = {f.value, f.start, f.seconds};
      ticket_of[static_cast<std::size_t>(f.value)] = -1;
      for (auto v : {p.op(f.value).op.operands.at(0), f.value}) --stream_uses[static_cast<std::size_t>(v)];
      for (auto v : f.released) release(v);
      in_flight.pop_front();
    }
  };

  std::vector<const Array*> operands;
  std::vector<ValueId> dying;
  try {
    for (ValueId v = 0; v < p.size(); ++v) {
      const SpmdOp& s = p.op(v);
      auto& slot = owned[static_cast<std::size_t>(v)];
      const bool streamed = streams && s.communicates() &&
                            (!in_flight.empty() || std::max(s.op.type.bytes(), p.type(s.op.operands[0]).bytes()) >=
                                                       options.stream_min_bytes);
      if (s.op.kind == OpKind::input && !s.collective) {
        if (!values[static_cast<std::size_t>(v)]) internal_error(where + ": input %" + std::to_string(v) + " has no binding");
      } else if (streamed) {
        if constexpr (StreamableCommunicator<C>)
          if (!stream) stream.emplace([&comm](const std::string& why) { comm.abort(why); });
        const ValueId operand = s.op.operands.at(0);
        slot = reduce_in_place(s, v);
        const bool in_place = slot.has_value();
        if (!in_place) slot = kernels::buffer_cache().take(s.op.type);
        InFlight& f = in_flight.emplace_back(InFlight{v, -1, result.collective_seconds.size(), result.timeline.size()});
        result.collective_seconds.push_back(0);
        if (options.timeline) result.timeline.push_back({v, 0, 0});
        // The stream runs collectives in order, so an operand made by an earlier one is ready when this starts.
        f.ticket = stream->issue([&comm, &mesh, &where, run_start, v, record = &f, c = &*s.collective,
                                  in = in_place ? &*slot : values[static_cast<std::size_t>(operand)], out = &*slot] {
          const auto t0 = clock::now();
          try {
            run_collective_into(*c, *in, *out, mesh, comm);
          } catch (const UserError& e) {
            user_error(where + ": %" + std::to_string(v) + ": " + e.what());
          }
          record->start = seconds(t0 - run_start).count();
          record->seconds = seconds(clock::now() - t0).count();
        });
        ticket_of[static_cast<std::size_t>(v)] = f.ticket;
        for (auto u : {operand, v}) ++stream_uses[static_cast<std::size_t>(u)];
        values[static_cast<std::size_t>(v)] = &*slot;
        resident += slot->bytes();
        peak = std::max(peak, resident);
      } else if (fusion.runs_at(v)) {
        if (stream) {  // wait for the collectives whose results this op reads (a fused chain: any of its inputs)
          std::int64_t needed = -1;
          auto need = [&](ValueId o) { needed = std::max(needed, ticket_of[static_cast<std::size_t>(o)]); };
          for (auto o : s.op.operands) need(o);
          if (const FusionGroup* g = fusion.group_at(v))
            for (const auto& in : g->inputs) need(in.value);
          retire(needed);
        }
        operands.clear();
        for (auto o : s.op.operands) operands.push_back(values[static_cast<std::size_t>(o)]);
        const auto t0 = clock::now();
        try {
          if (s.collective && (s.collective->kind == CollectiveKind::send || s.collective->kind == CollectiveKind::recv)) {
            slot = run_transfer(*s.collective, operands.empty() ? nullptr : operands[0], s.op.type, mesh, comm);
            if constexpr (SendsInPlace<C>)
              if (s.collective->kind == CollectiveKind::send) sent_in_place[static_cast<std::size_t>(s.op.operands.at(0))] = 1;
          } else if (s.collective) {
            if ((slot = reduce_in_place(s, v))) run_collective_into(*s.collective, *slot, *slot, mesh, comm);
            else slot = run_collective(*s.collective, *operands[0], s.op.type, mesh, comm);
          } else if (!s.row_shard.empty()) {
            const auto rows = (s.op.kind == OpKind::gather ? operands[0]->shape() : s.op.type.shape).at(0);
            slot = row_sharded(s, operands, mesh.position(comm.device(), s.row_shard) * rows,
                               rows * tile_count(s.row_shard, mesh));
          } else {
            // A reshape takes a dying operand's buffer, unless the stream or a send still reads it.
            dying = frees[static_cast<std::size_t>(v)];
            std::erase_if(dying, pinned);
            slot = run_op(s.op, fusion.group_at(v), values, owned, dying);
          }
        } catch (const UserError& e) {
          user_error(where + ": %" + std::to_string(v) + ": " + e.what());
        }
        const double took = seconds(clock::now() - t0).count();
        if (s.collective) result.collective_seconds.push_back(took);
        if (options.timeline) result.timeline.push_back({v, seconds(t0 - run_start).count(), took});
        values[static_cast<std::size_t>(v)] = &*slot;
        resident += slot->bytes() + bind_side_outputs(fusion.group_at(v), values, owned);
        peak = std::max(peak, resident);
      }
      for (auto dead : frees[static_cast<std::size_t>(v)]) {
        const bool kept = is_program_input(p.op(dead)) && !donated[static_cast<std::size_t>(dead)];
        auto& buffer = owned[static_cast<std::size_t>(dead)];
        if (kept || !buffer) continue;  // inputs stay resident (parameters, state) unless donated
        resident -= buffer->bytes();
        values[static_cast<std::size_t>(dead)] = nullptr;
        if (stream_uses[static_cast<std::size_t>(dead)] > 0) in_flight.back().released.push_back(dead);
        else if (sent_in_place[static_cast<std::size_t>(dead)]) freed_after_sends.push_back(dead);
        else release(dead);
      }
      if (stream) retire(-1);
    }
    if (stream && !in_flight.empty()) retire(in_flight.back().ticket);
    if constexpr (SendsInPlace<C>) comm.finish_sends();
    for (auto v : freed_after_sends) release(v);
  } catch (const std::exception& e) {
    if (stream) stream->abandon(e.what());
    throw;
  }
  kernels::buffer_cache().end_run();
  result.peak_bytes = peak;

  for (const auto& b : p.outputs()) {
    const auto v = static_cast<std::size_t>(b.value);
    // An intermediate output hands over its buffer (unless a later output names it too); inputs are copied.
    bool named_later = false;
    for (const auto* o = &b + 1; o != p.outputs().data() + p.outputs().size(); ++o) named_later |= o->value == b.value;
    Array piece = owned[v] && !named_later ? std::move(*owned[v]) : *values[v];
    result.outputs[b.name] = options.global_outputs ? gather_global(std::move(piece), b, mesh, comm) : std::move(piece);
  }
  return result;
}

}  // namespace detail

#if !PARTIR_DEFINE_ENTRIES
// libpartir holds the executor for the threads backend, instantiated once (src/libpartir.cpp).
extern template DeviceResult execute(const SpmdProgram&, threads::Communicator&, const NamedArrays&, ExecuteOptions);
#endif

// Runs the program on mesh.num_devices() threads of this process; returns each device's result.
inline std::vector<DeviceResult> execute_on_threads(const SpmdProgram& p, const NamedArrays& inputs,
                                                    ExecuteOptions options = {}) {
  std::vector<DeviceResult> results(static_cast<std::size_t>(p.mesh().num_devices()));
  threads::run(static_cast<int>(p.mesh().num_devices()), [&](threads::Communicator& c) {
    results[static_cast<std::size_t>(c.device())] = execute(p, c, inputs, options);
  });
  return results;
}

}  // namespace partir
