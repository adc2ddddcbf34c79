#pragma once
// The strategies of the PartIR paper as ready-made tactics (values, composable in any Schedule):
//   data_parallel(axis)  BP: every data input tiled on its batch dim (dim 0)
//   megatron(axis)       MP: Megatron-LM tensor parallelism by parameter names: the first matmul of a block
//                        (…/w1, attention …/wq …/wk …/wv) tiled on its output features (last dim, with bias
//                        …/b1), the second (…/w2, …/wo) on its input features (the dim before the last), so
//                        stacked expert weights [E, in, out] split inside each expert; nn::Llama's [out, in]
//                        weights (Hugging Face's names) alike: …/q_proj, k_proj, v_proj, gate_proj, up_proj
//                        on dim 0, …/o_proj, down_proj on dim 1; grouped-query attention's K/V projections
//                        split only where the axis divides the K/V heads, else kept whole on every device
//   expert_parallel(axis) EP: GShard's expert parallelism: every data input tiled on its batch dim (as BP) and
//                        every expert weight (params/**/experts/*, as nn::MixtureOfExperts names them) on
//                        dim 0, the experts; the MoE layers' hand-over values (…/dispatched, …/returned by
//                        group; …/expert_in, …/expert_out by expert; and their grad/ cotangents) fix each
//                        side's layout, so tokens cross devices by one all_to_all each way per layer and pass
//   spatial(axis)        SP: every image-like data input ([batch, spatial..., features], rank >= 3) tiled on
//                        its first spatial dim (the rows); convolutions exchange halos between neighbouring
//                        tiles (sharding/halo.hpp), as GSPMD's spatial partitioning
//   zero2(axis)          Z2: optimizer state and each parameter's update tiled on `axis`; the gradient
//                        all_reduce becomes a reduce_scatter and the new parameters are all-gathered
//   zero3(axis)          Z3: parameters too; each is all-gathered where it is used
//   embedding(axis, dim) EMB: every embedding table (params/**/table, as nn::Embedding names it, or
//                        nn::Llama's params/**/embed_tokens/weight) tiled on
//                        dim 0, the vocabulary (each device looks up the rows it holds: the lookup is a
//                        partial sum), or dim 1, the model features
//   multi_query(axis)    MQ: inference sharding of multi-query attention (nn::Attention with one K/V head):
//                        query heads (…/attn/wq, bq) and the MLP split as in Megatron, attention output
//                        (…/attn/wo) on its input features, the shared K/V projections (…/attn/wk, wv, bv)
//                        kept whole on the axis, so every device holds the one K/V head
// Preconditions: BP needs data inputs; MP and MQ need parameters named as above; Z2/Z3 need a training step
// (Z2 with any optimizer: without state it shards only the update) and a dim of each tensor divisible by the
// axis; EMB needs a table. A preset that finds nothing to act on is a UserError naming it.
#include "partir/tactics/manual.hpp"
#include "partir/tactics/pipeline.hpp"
#include "partir/ir/selector.hpp"
#include "partir/tactics/tactic.hpp"

namespace partir {

struct DataParallel {
  std::string axis;
  std::string name() const { return "bp(" + axis + ")"; }
  void apply(PartitionState& s) const;
  friend bool operator==(const DataParallel&, const DataParallel&) = default;
};

struct SpatialParallel {
  std::string axis;
  std::string name() const { return "sp(" + axis + ")"; }
  void apply(PartitionState& s) const;
  friend bool operator==(const SpatialParallel&, const SpatialParallel&) = default;
};

struct Megatron {
  std::string axis;
  std::string name() const { return "megatron(" + axis + ")"; }
  void apply(PartitionState& s) const;
  friend bool operator==(const Megatron&, const Megatron&) = default;
};

// Z2 / Z3: tiles optimizer state (and for stage 3 parameters) on the first dim the axis divides.
struct Zero {
  std::string axis;
  int stage = 2;
  std::string name() const { return "zero" + std::to_string(stage) + "(" + axis + ")"; }
  void apply(PartitionState& s) const;
  friend bool operator==(const Zero&, const Zero&) = default;
};

struct ExpertParallel {
  std::string axis;
  std::string name() const { return "ep(" + axis + ")"; }
  void apply(PartitionState& s) const;
  friend bool operator==(const ExpertParallel&, const ExpertParallel&) = default;
};

struct MultiQuery {
  std::string axis;
  std::string name() const { return "mq(" + axis + ")"; }
  void apply(PartitionState& s) const;
  friend bool operator==(const MultiQuery&, const MultiQuery&) = default;
};

inline DataParallel data_parallel(std::string axis) { return {std::move(axis)}; }
inline SpatialParallel spatial(std::string axis) { return {std::move(axis)}; }
inline Megatron megatron(std::string axis) { return {std::move(axis)}; }
inline Zero zero2(std::string axis) { return {std::move(axis), 2}; }
inline Zero zero3(std::string axis) { return {std::move(axis), 3}; }
inline ManualPartition embedding(std::string axis, std::int64_t dim = 0) {
  std::string label = "emb(" + axis + ")";
  return {{{"params/**/table|params/**/embed_tokens/weight", dim}}, std::move(axis), std::move(label)};
}
inline MultiQuery multi_query(std::string axis) { return {std::move(axis)}; }
inline ExpertParallel expert_parallel(std::string axis) { return {std::move(axis)}; }

#if PARTIR_DEFINE_ENTRIES
namespace detail {
// Tiles dim `dim` of every data input of rank >= min_rank on `axis`; how many it tiled.
inline int tile_data_inputs(PartitionState& s, const std::string& axis, std::int64_t dim, std::int64_t min_rank) {
  const int a = s.axis(axis);
  int tiled = 0;
  for (ValueId v : s.program().inputs()) {
    const Op& op = s.program().op(v);
    if (op.attrs.input_kind != InputKind::data || op.type.rank() < min_rank) continue;
    s.tile(v, dim, a);
    ++tiled;
  }
  return tiled;
}
}  // namespace detail

PARTIR_ENTRY void DataParallel::apply(PartitionState& s) const {
  if (!detail::tile_data_inputs(s, axis, 0, 1))
    user_error(s.tactic_label() + ": program '" + s.program().name() + "' has no data input to tile");
}

PARTIR_ENTRY void SpatialParallel::apply(PartitionState& s) const {
  if (!detail::tile_data_inputs(s, axis, 1, 3))
    user_error(s.tactic_label() + ": program '" + s.program().name() +
               "' has no data input with spatial dims ([batch, spatial..., features], rank >= 3) to tile");
}

PARTIR_ENTRY void Megatron::apply(PartitionState& s) const {
  static const std::vector<std::pair<const char*, std::int64_t>> layout = {
      {"params/**/w1", -1}, {"params/**/b1", -1}, {"params/**/wq", -1}, {"params/**/wk", -1},
      {"params/**/wv", -1}, {"params/**/bq", -1}, {"params/**/bk", -1}, {"params/**/bv", -1},
      {"params/**/w2", -2}, {"params/**/wo", -2},
      {"params/**/q_proj/weight", 0}, {"params/**/gate_proj/weight", 0}, {"params/**/up_proj/weight", 0},
      {"params/**/o_proj/weight", 1}, {"params/**/down_proj/weight", 1}};
  const int a = s.axis(axis);
  const NameIndex names(s.program());
  int tiled = 0;
  for (const auto& [selector, dim] : layout)
    for (ValueId v : names.select(selector)) {
      if (s.program().op(v).kind != OpKind::input) continue;
      s.tile(v, dim < 0 ? s.program().type(v).rank() + dim : dim, a);
      ++tiled;
    }
  // Grouped-query attention (nn::Llama tags …/self_attn/kv_heads, [batch, seq, kv_heads, head_dim]): the K/V
  // projections split by heads where the axis divides their number; where it does not, every device keeps
  // all of them (Megatron-LM's rule when tensor parallelism exceeds the K/V heads) and reads the heads its
  // query heads use, rather than splitting a head's features.
  for (ValueId heads : names.select("params/**/self_attn/kv_heads")) {
    const std::string& tag = s.program().op(heads).name;
    const std::string attention = tag.substr(0, tag.size() - std::string_view("/kv_heads").size());
    const bool split = s.program().type(heads).shape.at(2) % tile_count(AxisList{axis}, s.mesh()) == 0;
    for (const char* projection : {"/k_proj/weight", "/v_proj/weight"})
      for (ValueId v : names.select(attention + projection)) {
        split ? s.tile(v, 0, a) : s.forbid(v, a);
        ++tiled;
      }
  }
  if (!tiled)
    user_error(s.tactic_label() + ": no parameter of '" + s.program().name() +
               "' has a Megatron name (params/**/w1, w2, wq, wk, wv, wo, or Llama's q_proj, k_proj, v_proj, o_proj, "
               "gate_proj, up_proj, down_proj)");
}

PARTIR_ENTRY void Zero::apply(PartitionState& s) const {
  const int a = s.axis(axis);
  const Program& program = s.program();
  // Tiles v on the first dim the axis (after the dim's axes so far) divides, unless the axis is on it already;
  // whether it did.
  auto tile_first_divisible = [&](ValueId v) {
    const Sharding now = s.sharding(v);
    if (now.uses(axis)) return false;
    for (std::int64_t d = 0; d < program.type(v).rank(); ++d) {
      AxisList axes = now.dims[static_cast<std::size_t>(d)];
      axes.push_back(axis);
      if (program.type(v).shape[static_cast<std::size_t>(d)] % tile_count(axes, s.mesh()) == 0) {
        s.tile(v, d, a);
        return true;
      }
    }
    return false;
  };
  auto is_parameter = [&](ValueId v) { return program.op(v).attrs.input_kind == InputKind::parameter; };
  // Z2 keeps parameters whole on the axis; without this, propagation from the state would shard them (Z3).
  if (stage < 3)
    for (ValueId v : program.inputs())
      if (is_parameter(v) && !s.sharding(v).uses(axis)) s.forbid(v, a);
  int tiled = 0;
  for (ValueId v : program.inputs()) {
    const Op& op = program.op(v);
    if (op.type.rank() > 0 && (op.attrs.input_kind == InputKind::optimizer_state || (stage >= 3 && is_parameter(v))))
      tiled += tile_first_divisible(v);
  }
  // Z2 computes each new parameter on its shard, as ZeRO's partitioned update does (with or without optimizer
  // state: the weight-update sharding of data-parallel training): the step reduce-scatters the gradient and
  // all-gathers the new parameter, rather than updating the whole parameter on every device.
  if (stage < 3)
    for (const auto& o : program.outputs())
      if (!o.updates.empty() && program.op(o.value).kind != OpKind::input && is_parameter(program.input(o.updates)) &&
          program.type(o.value).rank() > 0)
        tiled += tile_first_divisible(o.value);
  if (!tiled)
    user_error(s.tactic_label() + ": program '" + program.name() + "' has no " +
               (stage >= 3 ? "parameter or optimizer state" : "optimizer state or parameter update") +
               " divisible by axis '" + axis + "' (ZeRO shards a training step's " +
               (stage >= 3 ? "parameters and " : "") + "optimizer state: partition a train_step)");
}

PARTIR_ENTRY void ExpertParallel::apply(PartitionState& s) const {
  const int a = s.axis(axis);
  const NameIndex names(s.program());
  std::vector<ValueId> experts;
  for (ValueId v : names.select("params/**/experts/*"))
    if (s.program().op(v).kind == OpKind::input) experts.push_back(v);
  if (experts.empty())
    user_error(s.tactic_label() + ": no parameter of '" + s.program().name() +
               "' is an expert weight (params/**/experts/*, as nn::MixtureOfExperts names them)");
  for (ValueId v : experts) {
    AxisList axes = s.sharding(v).dims.at(0);
    axes.push_back(axis);
    const std::int64_t count = s.program().type(v).shape.at(0), tiles = tile_count(axes, s.mesh());
    if (count % tiles != 0)
      user_error(s.tactic_label() + ": " + s.program().op(v).name + " holds " + std::to_string(count) +
                 " experts, not divisible by " + to_string(axes) + " (" + std::to_string(tiles) +
                 " tiles): expert parallelism gives each device whole experts");
  }
  DataParallel{axis}.apply(s);
  for (ValueId v : experts) s.tile(v, 0, a);
  for (const char* selector : {"**/dispatched", "**/returned", "**/expert_in", "**/expert_out"})
    for (ValueId v : names.select(selector)) s.tile(v, 0, a);
}

PARTIR_ENTRY void MultiQuery::apply(PartitionState& s) const {
  static const std::vector<std::pair<const char*, std::int64_t>> layout = {
      {"params/**/attn/wq", -1}, {"params/**/attn/bq", 0}, {"params/**/attn/wo", 0},
      {"params/**/w1", -1},      {"params/**/b1", 0},      {"params/**/w2", 0}};
  static const char* const shared_kv[] = {"params/**/attn/wk", "params/**/attn/wv", "params/**/attn/bv"};
  const int a = s.axis(axis);
  const NameIndex names(s.program());
  int kv = 0;
  for (const char* selector : shared_kv)
    for (ValueId v : names.select(selector)) {
      s.forbid(v, a);
      ++kv;
    }
  if (!kv)
    user_error(s.tactic_label() + ": no parameter of '" + s.program().name() +
               "' is a K/V projection (params/**/attn/wk, wv) to keep whole");
  for (const auto& [selector, dim] : layout)
    for (ValueId v : names.select(selector)) s.tile(v, dim < 0 ? s.program().type(v).rank() + dim : dim, a);
}

#endif

}  // namespace partir
