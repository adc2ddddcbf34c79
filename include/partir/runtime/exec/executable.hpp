#pragma once
// A lowered program bound to one device's communicator: what a training or decoding loop needs around
// execute(). The state (parameters and optimizer state) stays as this device's pieces, laid out as the
// SPMD program wants, from init() to the last step; batches go in and the other outputs come out as global
// arrays, so the loop never names a sharding.
//   auto exe = partir::compile(plan, comm);            // every device (thread or MPI rank) does this
//   partir::NamedArrays state = exe.init(/*seed=*/0);
//   for (...) double loss = exe.step(state, next_batch()).outputs.at("loss").at(0);
//   partir::NamedArrays trained = exe.gather_state(state);  // global arrays, on every device
// With an nccl::Communicator, include <partir/runtime/gpu/executor.hpp> too: step() then runs on the GPU.
#include <string>

#include "partir/runtime/exec/executor.hpp"
#include "partir/runtime/state/init.hpp"
#include "partir/runtime/state/state.hpp"
#include "partir/sharding/partitioned.hpp"
#include "partir/spmd/lower.hpp"

namespace partir {

// Whether a backend's executor runs the plan's fused groups as one kernel each (the GPU's runs every op by
// itself for now, so its plan frees as the unfused program does).
template <class C>
inline constexpr bool runs_fused_groups = true;

template <Communicator C>
class Executable {
 public:
  // The plan (fusion, frees, donation, stream policy, a pipeline's stage programs) is made here, once, and
  // every step runs it.
  Executable(SpmdProgram program, C& comm)
      : plan_(std::move(program), PlanOptions{.donate_state = true, .fuse = runs_fused_groups<C> && fusion_enabled()}),
        comm_(&comm) {
    detail::check_run(spmd(), comm.num_devices(), {}, where());
  }

  const ExecutionPlan& plan() const { return plan_; }
  const SpmdProgram& spmd() const { return plan_.program(); }
  C& communicator() const { return *comm_; }

  // This device's pieces of every state input, drawn by its Init: pieces of the values init_inputs(program,
  // seed) gives, whatever the mesh, schedule or backend, drawn without making any whole tensor.
  NamedArrays init(std::uint64_t seed) const {
    NamedArrays state;
    for (const auto& b : spmd().inputs())
      if (holds(b))
        state[b.name] = init_piece(b.global, spmd().op(b.value).op.attrs.init, seed, b.name, b.sharding, spmd().mesh(),
                                   comm_->device());
    return state;
  }

  // This device's pieces of every state input, taken from global arrays (a trained model, another plan's
  // gather_state); entries the program does not read as state are ignored.
  NamedArrays shard_state(const NamedArrays& global) const {
    NamedArrays state;
    for (const auto& b : spmd().inputs()) {
      if (!holds(b)) continue;
      auto it = global.find(b.name);
      if (it == global.end()) user_error(where() + ": shard_state: no array for state input '" + b.name + "' " + to_string(b.global));
      state[b.name] = piece(it->second, b);
    }
    return state;
  }

  // The global arrays of every state input, on every device (a collective: every device calls it). In a
  // pipelined program each stage gathers its own and sends them to the other stages.
  NamedArrays gather_state(const NamedArrays& state) const {
    NamedArrays global;
    const Mesh& mesh = spmd().mesh();
    for (const auto& b : spmd().inputs()) {
      if (!is_state(spmd(), b)) continue;
      if (holds(b)) {
        auto it = state.find(b.name);
        if (it == state.end()) user_error(where() + ": gather_state: the state has no '" + b.name + "'");
        global[b.name] = detail::gather_global(it->second, b, mesh, *comm_);
      }
      const auto& pp = spmd().pipeline();
      const int owner = spmd().op(b.value).stage;
      if (!pp || owner < 0) continue;
      const Group stages = detail::group_of(mesh, comm_->device(), {pp->axis});
      const std::int64_t tag = &b - spmd().inputs().data();
      if (holds(b)) {
        const Array& a = global[b.name];
        for (int s = 0; s < pp->stages; ++s)
          if (s != owner) comm_->send(stages.devices[static_cast<std::size_t>(s)], layout::bytes(a), a.size(), a.dtype(), tag);
      } else {
        Array a(b.global);
        comm_->recv(stages.devices[static_cast<std::size_t>(owner)], layout::bytes(a), a.size(), a.dtype(), tag);
        global[b.name] = std::move(a);
      }
    }
    return global;
  }

  // One run of the program on this device: `batch` holds a global array for every data input, `state` this
  // device's pieces of the state inputs. Outputs that update an input replace it in `state` (the next step
  // reads what this one wrote, without a reshard); the result holds the others as global arrays. The step
  // donates the state it replaces (ExecuteOptions::donate): each old piece is freed once read for the last time,
  // so the old and new state are never held whole at once. A step that fails after its inputs were checked has
  // consumed that state: it is dropped from `state`, and init(), shard_state or a checkpoint make it again.
  DeviceResult step(NamedArrays& state, const NamedArrays& batch, ExecuteOptions options = {}) const {
    for (const auto& [name, array] : batch) {
      const Binding* b = input(name);
      if (!b) user_error(where() + ": the batch has '" + name + "', which is no input of the program");
      if (is_state(spmd(), *b))
        user_error(where() + ": '" + name + "' is a " + std::string(name_of(spmd().op(b->value).op.attrs.input_kind)) +
                   " input: it belongs in the state (init, shard_state), not the batch");
    }
    NamedArrays pieces;
    for (const auto& b : spmd().inputs()) {
      if (holds(b) && !state.contains(b.name))
        user_error(where() + ": step: the state has no '" + b.name +
                   "' (a failed step drops the state it took; init, shard_state or a checkpoint make it again)");
      if (is_state(spmd(), b)) continue;
      auto it = batch.find(b.name);
      if (it == batch.end()) user_error(where() + ": the batch has no '" + b.name + "' " + to_string(b.global));
      pieces[b.name] = piece(it->second, b);
    }
    for (auto& [name, p] : pieces) state.insert_or_assign(name, std::move(p));  // for execute(); out again below
    options.global_inputs = options.global_outputs = false;
    options.donate = &state;
    DeviceResult result;
    try {
      result = execute(plan_, *comm_, state, options);
    } catch (...) {
      drop_batch(state);
      drop_donated(state);
      throw;
    }
    drop_batch(state);
    for (const auto& b : spmd().outputs()) {
      auto it = result.outputs.find(b.name);
      if (it == result.outputs.end()) continue;  // another pipeline stage's
      const Binding* updated = b.updates.empty() ? nullptr : input(b.updates);
      if (updated && is_state(spmd(), *updated)) {
        state[b.updates] = std::move(it->second);
        result.outputs.erase(it);
      } else {
        it->second = detail::gather_global(std::move(it->second), b, spmd().mesh(), *comm_);
      }
    }
    return result;
  }

 private:
  bool holds(const Binding& b) const { return holds_state(spmd(), b, comm_->device()); }

  std::string where() const { return "program '" + spmd().name() + "' (device " + std::to_string(comm_->device()) + ")"; }

  const Binding* input(const std::string& name) const {
    for (const auto& b : spmd().inputs())
      if (b.name == name) return &b;
    return nullptr;
  }

  Array piece(const Array& global, const Binding& b) const {
    if (global.type() != b.global)
      user_error(where() + ": input '" + b.name + "' is " + to_string(b.global) + ", got " + to_string(global.type()));
    return layout::shard(global, b.sharding, spmd().mesh(), comm_->device());
  }

  void drop_batch(NamedArrays& state) const {
    for (const auto& b : spmd().inputs())
      if (!is_state(spmd(), b)) state.erase(b.name);
  }

  // After a failed step: the pieces it had taken (husks, their storage moved into the executor).
  static void drop_donated(NamedArrays& state) {
    std::erase_if(state, [](const auto& entry) { return entry.second.is_husk(); });
  }

  ExecutionPlan plan_;
  C* comm_;
};

// Lowers the plan and binds it to this device's communicator.
template <Communicator C>
Executable<C> compile(const Partitioned& plan, C& comm, const LowerOptions& options = {}) {
  return {lower(plan, options), comm};
}

#if !PARTIR_DEFINE_ENTRIES
extern template class Executable<threads::Communicator>;  // instantiated once, in libpartir
#endif

}  // namespace partir
