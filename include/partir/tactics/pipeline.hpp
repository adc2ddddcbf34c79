#pragma once
// Pipeline: the pipeline-parallel tactic. The positions of a mesh axis are stages; each stage holds some of
// the parameters and computes what they make, values crossing a stage boundary travel point to point
// (activations forward, their gradients back), and every stage runs the microbatches of a train step
// (StepOptions::microbatches) in the schedule's order: GPipe runs all forward passes, then all backward
// passes; 1F1B starts p - 1 - s forward passes on stage s, then alternates one forward and one backward, so
// at most p - s microbatches' activations are alive on a stage at once; interleaved, zb1 and zbv are
// sharding/stages.hpp's. The tactic shards nothing: every other tactic (bp, mp, z2, z3, emb, auto) acts within
// the stages on the other axes, before or after it.
//
// With v chunks per device the model is cut into p * v virtual stages, dealt to the devices as the schedule
// places them; the rules below assign virtual stages, and "stage" there means virtual stage.
//
// Which stage computes a value (the rules lowering follows; values with no stage of their own, such as data,
// constants and what only they make, are computed on every stage that uses them):
//  - a parameter: the stage whose selectors match it; with no selectors, whole layers (.../layers/<i>/...) in
//    order, parameters declared before the first layer with layer 0 (an embedding) and after the last with the
//    last (the final norm, a head): StageBalance::cost (the default) cuts where the stages' predicted work is
//    most even (each layer's forward, backward and update ops on the nominal machine of sharding/op_work.hpp,
//    so a stage that holds a large head or loss gets fewer layers, as Megatron-LM's
//    --decoder-last-pipeline-num-layers does by hand); StageBalance::layers gives each stage the same number of
//    layers (layer i to stage i * p / L);
//  - a forward value: the latest stage among its operands' (a pipeline only moves forward);
//  - a value of the backward pass (the VJP of forward value f): f's stage, where f's operands are;
//  - a value computed from gradients (accumulation, clipping, the update): the stage holding most of its
//    operands' bytes (ties: the later stage), so a parameter's update stays with the parameter;
//  - a value remat recomputes: its original's stage, or a later stage that reads it (the backward pass runs the
//    later stage first: made on the earlier one, it would make the later stage wait for a later task); a cheap one
//    (a parameter's cast, made from inputs alone) none: each stage that reads it computes its own;
//  - optimizer state: the stage of the ops that read it.
#include <charconv>
#include <climits>
#include <set>

#include "partir/ir/selector.hpp"
#include "partir/sharding/op_work.hpp"
#include "partir/sharding/propagate.hpp"

namespace partir {

// How a pipeline without selectors deals the layers to its stages: by their predicted work, or by count.
enum class StageBalance : std::uint8_t { cost, layers };

struct Pipeline {
  std::string axis;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  std::vector<std::vector<std::string>> stages = {};  // parameter selectors per stage; empty: whole layers per stage
  StageBalance balance = StageBalance::cost;

  std::string name() const {
    return "pp(" + axis + (schedule == PipelineSchedule::one_f_one_b ? "" : ", " + name_of(schedule)) +
           (balance == StageBalance::layers ? ", equal layers" : "") + ")";
  }

  void apply(PartitionState& s) const;
  friend bool operator==(const Pipeline&, const Pipeline&) = default;

 private:
  static std::string owner(const PartitionState& s, ValueId v, int axis) {
    for (const auto& o : s.provenance(v))
      if (o.axis == axis && o.tactic >= 0) return "from " + s.tactic_label(o.tactic);
    return "from an earlier tactic";
  }

  // i of ".../layers/<i>/...", or -1.
  static int layer_of(std::string_view name) {
    const auto at = name.find("layers/");
    if (at == std::string_view::npos) return -1;
    int i = -1;
    const char* first = name.data() + at + 7;
    const auto [end, error] = std::from_chars(first, name.data() + name.size(), i);
    return error == std::errc{} && end != first ? i : -1;
  }

  // Each parameter's virtual stage, of p * chunks; `cut` gets, per virtual stage, the layers it holds.
  void assign_parameters(const Program& prog, int p, const std::string& who, std::vector<int>& stage,
                         std::vector<std::string>& cut) const {
    const int devices = p;
    p *= schedule.chunks;
    const std::string what = schedule.chunks == 1 ? "stage" : "virtual stage";
    std::vector<ValueId> params;
    for (ValueId v : prog.inputs())
      if (prog.op(v).attrs.input_kind == InputKind::parameter) params.push_back(v);
    std::vector<int> count(static_cast<std::size_t>(p), 0);
    if (stages.empty()) {
      int layers = 0;
      for (ValueId v : params) layers = std::max(layers, layer_of(prog.op(v).name) + 1);
      if (layers == 0)
        user_error(who + ": no parameter of '" + prog.name() +
                   "' is named .../layers/<i>/... to split into stages; give each stage its parameter selectors");
      if (layers < p)
        user_error(who + ": " + std::to_string(p) + " " + what + "s on '" + axis + "' but '" + prog.name() + "' has " +
                   std::to_string(layers) + " layers: " + what + " " + std::to_string(layers) +
                   " would have no ops (use at most as many " + what + "s as layers)");
      if (balance == StageBalance::layers && schedule.chunks > 1 && layers % p != 0)
        user_error(who + ": '" + prog.name() + "' has " + std::to_string(layers) + " layers, which do not split into " +
                   std::to_string(devices) + " stages x " + std::to_string(schedule.chunks) +
                   " chunks of equal size (a chunked schedule deals equal chunks round the devices; use a chunk count "
                   "that divides the layers per stage, or StageBalance::cost)");
      // Each parameter's layer: what precedes the first layer goes with it, what follows the last with that.
      std::vector<int> layer(static_cast<std::size_t>(prog.size()), -1);
      bool seen_layer = false;
      for (ValueId v : params) {
        const int i = layer_of(prog.op(v).name);
        seen_layer |= i >= 0;
        layer[static_cast<std::size_t>(v)] = i >= 0 ? i : seen_layer ? layers - 1 : 0;
      }
      std::vector<int> first(static_cast<std::size_t>(p) + 1);  // each virtual stage's first layer, then `layers`
      std::vector<double> work;
      if (balance == StageBalance::layers) {
        for (int k = 0; k <= p; ++k) first[static_cast<std::size_t>(k)] = static_cast<int>((std::int64_t{k} * layers + p - 1) / p);
      } else {
        work = layer_work(prog, layer, layers);
        first = balanced_cut(work, p);
      }
      for (ValueId v : params) {
        const int i = layer[static_cast<std::size_t>(v)];
        stage[static_cast<std::size_t>(v)] = static_cast<int>(std::upper_bound(first.begin(), first.end(), i) - first.begin()) - 1;
      }
      double total = 0;
      for (double w : work) total += w;
      for (int k = 0; k < p; ++k) {
        const int a = first[static_cast<std::size_t>(k)], b = first[static_cast<std::size_t>(k) + 1] - 1;
        double share = 0;
        for (int i = a; i <= b && total > 0; ++i) share += work[static_cast<std::size_t>(i)] / total;
        cut.push_back((a == b ? "layer " + std::to_string(a) : "layers " + std::to_string(a) + "-" + std::to_string(b)) +
                      (total > 0 ? ", " + std::to_string(static_cast<int>(std::lround(100 * share))) + "% of the predicted work"
                                 : std::string(", equal layers")));
      }
    } else {
      if (static_cast<int>(stages.size()) != p)
        user_error(who + ": " + std::to_string(stages.size()) + " stages' selectors for axis '" + axis + "' of size " +
                   std::to_string(devices) +
                   (schedule.chunks == 1 ? std::string(" (one list per stage)")
                                         : " with " + std::to_string(schedule.chunks) + " chunks each (one list per virtual stage: " +
                                               std::to_string(p) + ")"));
      const NameIndex names(prog);
      for (int k = 0; k < p; ++k)
        for (const auto& selector : stages[static_cast<std::size_t>(k)]) {
          bool any = false;
          for (ValueId v : names.select(selector)) {
            if (prog.op(v).kind != OpKind::input || prog.op(v).attrs.input_kind != InputKind::parameter) continue;
            any = true;
            int& at = stage[static_cast<std::size_t>(v)];
            if (at >= 0 && at != k)
              user_error(who + ": parameter '" + prog.op(v).name + "' matches the selectors of stages " +
                         std::to_string(at) + " and " + std::to_string(k));
            at = k;
          }
          if (!any) user_error(who + ": stage " + std::to_string(k) + "'s selector '" + selector + "' matches no parameter of '" + prog.name() + "'");
        }
      for (ValueId v : params)
        if (stage[static_cast<std::size_t>(v)] < 0)
          user_error(who + ": parameter '" + prog.op(v).name + "' matches no stage's selectors");
    }
    for (ValueId v : params) ++count[static_cast<std::size_t>(stage[static_cast<std::size_t>(v)])];
    for (int k = 0; k < p; ++k)
      if (count[static_cast<std::size_t>(k)] == 0)
        user_error(who + ": " + what + " " + std::to_string(k) + " of '" + axis + "' holds no parameter, so it would have no ops");
  }

  // Each layer's work: the time, on the nominal machine, of the ops that a stage per layer would run (its
  // forward, backward and update ops, and what comes before the first layer or after the last).
  static std::vector<double> layer_work(const Program& prog, std::vector<int> layer, int layers) {
    assign_values(prog, layer);
    std::vector<double> work(static_cast<std::size_t>(layers), 0.0);
    std::vector<TensorType> in;
    for (ValueId v = 0; v < prog.size(); ++v) {
      const int i = layer[static_cast<std::size_t>(v)];
      if (i < 0 || prog.op(v).kind == OpKind::input) continue;
      in.clear();
      for (ValueId o : prog.op(v).operands) in.push_back(prog.type(o));
      work[static_cast<std::size_t>(i)] += nominal_seconds(local_work(prog.op(v), in));
    }
    return work;
  }

  // The first layer of each of p contiguous, non-empty stages (then the layer count) that minimizes the most
  // work any stage gets; among cuts within 1e-9 of it, the most even (the least sum of squares).
  static std::vector<int> balanced_cut(const std::vector<double>& work, int p) {
    const int layers = static_cast<int>(work.size());
    std::vector<double> prefix(work.size() + 1, 0.0);
    for (std::size_t i = 0; i < work.size(); ++i) prefix[i + 1] = prefix[i] + work[i];
    struct Cut {
      double most = 0, squares = 0;
      int from = -1;  // the previous stage's end; -1: no cut reaches here
    };
    auto better = [](const Cut& a, const Cut& b) {
      if (b.from < 0) return true;
      const double tolerance = 1e-9 * std::max(a.most, b.most);
      return a.most < b.most - tolerance || (a.most <= b.most + tolerance && a.squares < b.squares);
    };
    // best[k][j]: the best cut of layers [0, j) into k stages.
    std::vector<std::vector<Cut>> best(static_cast<std::size_t>(p) + 1, std::vector<Cut>(work.size() + 1));
    best[0][0].from = 0;
    for (int k = 1; k <= p; ++k)
      for (int j = k; j <= layers - (p - k); ++j)
        for (int i = k - 1; i < j; ++i) {
          const Cut& before = best[static_cast<std::size_t>(k) - 1][static_cast<std::size_t>(i)];
          if (before.from < 0) continue;
          const double w = prefix[static_cast<std::size_t>(j)] - prefix[static_cast<std::size_t>(i)];
          const Cut c{std::max(before.most, w), before.squares + w * w, i};
          Cut& at = best[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)];
          if (better(c, at)) at = c;
        }
    std::vector<int> first(static_cast<std::size_t>(p) + 1, layers);
    for (int k = p, j = layers; k > 0; --k) j = first[static_cast<std::size_t>(k) - 1] = best[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)].from;
    return first;
  }

  // "The latest stage among its operands'" cuts a block after its first parameter-free ops (a layer norm's
  // statistics run where the residual stream was made, and both the stream and the normalized value cross).
  // Where a forward value v crosses from stage s to later ones only, the parameter-free ops it is made of move
  // to the next stage when that lets fewer bytes cross: the cone of v is grown backwards (latest op first)
  // through ops all of whose users are in the cone or on later stages, and the smallest frontier wins.
  static void tighten_boundaries(const Program& prog, const std::vector<ValueId>& original,
                                 const std::vector<char>& from_gradients, std::vector<int>& stage) {
    const auto n = static_cast<std::size_t>(prog.size());
    std::vector<std::vector<ValueId>> users(n);  // in the forward pass
    for (ValueId v = 0; v < prog.size(); ++v)
      if (!from_gradients[static_cast<std::size_t>(v)] && original[static_cast<std::size_t>(v)] < 0)
        for (ValueId o : prog.op(v).operands) users[static_cast<std::size_t>(o)].push_back(v);
    auto movable = [&](ValueId v) {
      const Op& op = prog.op(v);
      const auto i = static_cast<std::size_t>(v);
      if (op.kind == OpKind::input || from_gradients[i] || original[i] >= 0 || stage[i] < 0) return false;
      return std::none_of(op.operands.begin(), op.operands.end(), [&](ValueId o) { return prog.op(o).kind == OpKind::input; });
    };
    // The earliest stage after s among v's users outside `cone`, or -1 if one is on s or before.
    auto later_users = [&](ValueId v, int s, const std::set<ValueId>& cone) {
      int t = INT_MAX;
      for (ValueId u : users[static_cast<std::size_t>(v)]) {
        if (cone.count(u)) continue;
        const int k = stage[static_cast<std::size_t>(u)];
        if (k >= 0 && k <= s) return -1;
        if (k > s) t = std::min(t, k);
      }
      return t;
    };
    for (ValueId v = prog.size(); v-- > 0;) {
      if (!movable(v)) continue;
      const int s = stage[static_cast<std::size_t>(v)];
      std::set<ValueId> cone{v};
      const int t = later_users(v, s, cone);
      if (t < 0 || t == INT_MAX) continue;
      // Bytes that would cross for the cone: its stage-s operands outside it that cross nowhere else.
      auto frontier_bytes = [&] {
        std::int64_t bytes = 0;
        std::set<ValueId> seen;
        for (ValueId c : cone)
          for (ValueId o : prog.op(c).operands)
            if (!cone.count(o) && stage[static_cast<std::size_t>(o)] == s && seen.insert(o).second &&
                later_users(o, s, cone) < 0)
              bytes += prog.type(o).bytes();
        return bytes;
      };
      std::int64_t best = prog.type(v).bytes();
      std::set<ValueId> best_cone;
      for (int grown = 0; grown < 256; ++grown) {
        ValueId next = -1;
        for (ValueId c : cone)
          for (ValueId o : prog.op(c).operands)
            if (!cone.count(o) && o > next && movable(o) && stage[static_cast<std::size_t>(o)] == s) {
              std::set<ValueId> with = cone;
              with.insert(o);
              if (later_users(o, s, with) >= 0) next = o;
            }
        if (next < 0) break;
        cone.insert(next);
        if (const auto b = frontier_bytes(); b < best) best = b, best_cone = cone;
      }
      for (ValueId c : best_cone) stage[static_cast<std::size_t>(c)] = t;
    }
  }

  static void assign_values(const Program& prog, std::vector<int>& stage) {
    const auto n = static_cast<std::size_t>(prog.size());
    std::vector<ValueId> original(n, -1);
    std::vector<char> cheap(n, 0);
    for (const auto& r : prog.recomputes()) {
      original[static_cast<std::size_t>(r.value)] = r.original;
      cheap[static_cast<std::size_t>(r.value)] = r.policy == "cheap";
    }
    std::vector<char> from_gradients(n, 0);
    auto staged_bytes = [&](const Op& op) {
      std::map<int, std::int64_t> bytes;  // per stage, of the staged operands
      for (ValueId o : op.operands)
        if (const int k = stage[static_cast<std::size_t>(o)]; k >= 0) bytes[k] += prog.type(o).bytes();
      return bytes;
    };
    // The forward pass first, its boundaries tightened; then what follows it (the backward pass and the update).
    for (ValueId v = 0; v < prog.size(); ++v) {
      const Op& op = prog.op(v);
      const auto i = static_cast<std::size_t>(v);
      for (ValueId o : op.operands) from_gradients[i] |= from_gradients[static_cast<std::size_t>(o)];
      from_gradients[i] |= prog.vjp_of(v) >= 0;
      if (op.kind == OpKind::input || original[i] >= 0 || from_gradients[i]) continue;
      const auto bytes = staged_bytes(op);
      if (!bytes.empty()) stage[i] = bytes.rbegin()->first;
    }
    tighten_boundaries(prog, original, from_gradients, stage);
    for (ValueId v = 0; v < prog.size(); ++v) {
      const auto i = static_cast<std::size_t>(v);
      const ValueId of = prog.vjp_of(v);
      if (original[i] >= 0) stage[i] = cheap[i] ? -1 : stage[static_cast<std::size_t>(original[i])];
      if (!from_gradients[i]) continue;
      if (of >= 0 && stage[static_cast<std::size_t>(of)] >= 0) {
        stage[i] = stage[static_cast<std::size_t>(of)];
        continue;
      }
      const auto bytes = staged_bytes(prog.op(v));
      if (bytes.empty()) continue;
      auto most = bytes.begin();
      for (auto it = bytes.begin(); it != bytes.end(); ++it)
        if (it->second >= most->second) most = it;
      stage[i] = most->first;
    }
    std::vector<std::vector<ValueId>> users(n);
    for (ValueId v = 0; v < prog.size(); ++v)
      for (ValueId o : prog.op(v).operands) users[static_cast<std::size_t>(o)].push_back(v);
    // A recomputed value whose readers lie on a later stage (a remat block across a stage boundary) is made there:
    // the backward pass runs the later stage first, and would wait for the earlier stage's later task.
    for (auto v = n; v-- > 0;)
      if (original[v] >= 0 && !cheap[v])
        for (ValueId u : users[v]) stage[v] = std::max(stage[v], stage[static_cast<std::size_t>(u)]);
    // Optimizer state (and any other stateful input) lives where it is read: the first stage among its users'
    // (through the stage-less ops between them).
    std::vector<int> used_on(n, -1);
    for (auto v = n; v-- > 0;) {
      if (stage[v] >= 0 && prog.op(static_cast<ValueId>(v)).kind != OpKind::input) {
        used_on[v] = stage[v];
        continue;
      }
      for (ValueId u : users[v]) {
        const int k = used_on[static_cast<std::size_t>(u)];
        if (k >= 0 && (used_on[v] < 0 || k < used_on[v])) used_on[v] = k;
      }
    }
    for (ValueId v : prog.inputs()) {
      const auto i = static_cast<std::size_t>(v);
      if (prog.op(v).attrs.input_kind == InputKind::optimizer_state && stage[i] < 0) stage[i] = std::max(0, used_on[i]);
    }
  }
};

inline Pipeline pipeline(std::string axis, PipelineSchedule schedule = PipelineSchedule::one_f_one_b,
                         std::vector<std::vector<std::string>> stages = {}, StageBalance balance = StageBalance::cost) {
  return {std::move(axis), schedule, std::move(stages), balance};
}

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY void Pipeline::apply(PartitionState& s) const {
  const int a = s.axis(axis);
  const int p = static_cast<int>(s.mesh().axes()[static_cast<std::size_t>(a)].size);
  const std::string who = s.tactic_label();
  if (s.pipeline())
    user_error(who + ": the schedule already pipelines over '" + s.pipeline()->axis + "' (" +
               s.pipeline()->tactic_label + "); one pipeline tactic per schedule");
  const Program& prog = s.program();
  const auto shardings = s.shardings();
  for (ValueId v = 0; v < prog.size(); ++v)
    if (shardings[static_cast<std::size_t>(v)].uses(axis))
      user_error(who + ": axis '" + axis + "' already partitions " + prog.label(v) + " (" + owner(s, v, a) +
                 "); a pipeline axis carries stages, not tiles");
  const int v = schedule.chunks;
  if (v < 1 || (schedule.order == PipelineSchedule::Order::gpipe && v > 1) ||
      (schedule.v_shape && (v != 2 || !schedule.splits_backward())))
    user_error(who + ": schedule " + name_of(schedule) + " is not one partir runs (gpipe and zb1 hold one chunk per "
               "device, interleaved:v at least one, zbv two placed as a V)");
  int microbatches = 1;
  for (const auto& seg : prog.segments()) microbatches = std::max(microbatches, seg.microbatch + 1);
  if (v > 1 && !schedule.v_shape && microbatches > p && microbatches % p != 0)
    user_error(who + ": " + std::to_string(microbatches) + " microbatches, which " + std::to_string(p) +
               " stages do not divide (the interleaved schedule runs microbatches through each chunk p at a time, "
               "as Megatron-LM's; use at most " + std::to_string(p) + ", or a multiple)");
  PipelineStages out{axis, p, schedule, static_cast<int>(s.tactics().size()) - 1, who,
                     std::vector<int>(static_cast<std::size_t>(prog.size()), -1), {}, {}};
  assign_parameters(prog, p, who, out.stage, out.cut);
  assign_values(prog, out.stage);
  out.chunk = out.stage;
  for (int& k : out.stage) k = k < 0 ? -1 : schedule.device_of(k, p);
  s.set_pipeline(std::move(out));
}
#endif

}  // namespace partir
