#pragma once
// AutomaticPartition{axes, objective, memory_budget_bytes, search_budget}: the automatic tactic of PartIR (after
// Automap, "Automatic Discovery of Composite SPMD Partitioning Strategies in PartIR"). It is an ordinary tactic:
// it starts from the program as earlier tactics left it, searches over actions "tile the values of group g along
// dim d on axis a" (or stop), scores each candidate plan with its Evaluator (by default: lowering and simulating
// it), and commits the best
// sequence of actions as ManualPartition steps. Later tactics compose on top; earlier decisions and Replicate
// constraints are never undone, because the actions go through the same PartitionState as any manual tactic.
//
// The action space is kept small on purpose, since every candidate costs a lowering and a simulation:
// - a group is the inputs (and tagged values) that should move together: a parameter with its optimizer state
//   (opt/adam/m/<param>, ...), and the same value in every layer (names equal up to numeric path segments,
//   params/layers/*/mlp/w1), so a 12-layer transformer has as many actions as one layer;
// - only dims whose size divides by the tiles they would have, on values not yet using the axis or kept off it;
//   a plan that lowering refuses (a convolution's halo wider than its tiles) is never chosen.
// Two action sequences that propagate to the same shardings are one candidate (evaluated once).
//
// Two strategies, both deterministic: Monte Carlo tree search (UCT, random rollouts from a seeded generator) and
// beam search (width 1: greedy). Candidates are evaluated in parallel threads; results do not depend on timing.
// The choice and its reasons (the actions, predicted time and memory of the chosen plan, the runners-up and the
// baseline) are a SearchReport: returned by search(), and left in `report` by apply() when set.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <functional>
#include <optional>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <thread>

#include "partir/config.hpp"
#include "partir/sharding/partitioned.hpp"
#include "partir/sim/hardware_profile.hpp"
#include "partir/sim/simulator.hpp"
#include "partir/spmd/lower.hpp"
#include "partir/tactics/manual.hpp"

namespace partir {

enum class Objective : std::uint8_t { step_time, peak_memory };
enum class SearchStrategy : std::uint8_t { mcts, beam };

inline std::string_view name_of(Objective o) { return o == Objective::step_time ? "step_time" : "peak_memory"; }
inline std::string_view name_of(SearchStrategy s) { return s == SearchStrategy::mcts ? "mcts" : "beam"; }

struct SearchBudget {
  SearchStrategy strategy = SearchStrategy::mcts;
  int evaluations = 64;    // distinct plans lowered and simulated: what the search time is made of
  int max_actions = 6;     // actions in one plan
  int beam_width = 1;      // beam search: plans kept per depth (1: greedy)
  std::uint64_t seed = 0;  // MCTS rollouts
  int threads = 0;         // evaluation threads; 0: the hardware's
  friend bool operator==(const SearchBudget&, const SearchBudget&) = default;
};

inline SearchBudget greedy(int evaluations = 64) { return {SearchStrategy::beam, evaluations, 6, 1}; }

// One evaluated plan: the actions that make it (on top of the earlier tactics) and what the simulator predicts.
struct Candidate {
  std::vector<ManualPartition> actions;
  double step_seconds = 0;
  std::int64_t peak_bytes = 0;
  bool fits = true;  // peak_bytes within the memory budget
  friend bool operator==(const Candidate&, const Candidate&) = default;
};

struct SearchReport {
  std::string tactic;
  SearchBudget budget;
  Objective objective = Objective::step_time;
  std::int64_t memory_budget_bytes = 0;  // 0: none
  int actions = 0;                       // the action space where the search started
  int evaluations = 0;                   // distinct plans lowered and simulated
  Candidate baseline;                    // the program as the earlier tactics left it (no action)
  Candidate chosen;
  std::vector<Candidate> runners_up;     // the next best distinct plans, best first

  // The chosen actions as manual tactics, to freeze the plan in a schedule in place of the search.
  Schedule schedule() const {
    Schedule s;
    for (const auto& a : chosen.actions) s.push_back(a);
    return s;
  }
  friend bool operator==(const SearchReport&, const SearchReport&) = default;
};

inline std::string to_string(const Candidate& c) {
  std::string s = c.actions.empty() ? std::string("no action") : std::string();
  for (std::size_t i = 0; i < c.actions.size(); ++i) s += (i ? "; " : "") + c.actions[i].name();
  return s + " -> step " + human_seconds(c.step_seconds) + ", peak " +
         human_bytes(static_cast<double>(c.peak_bytes)) + (c.fits ? "" : " (over budget)");
}

inline std::ostream& operator<<(std::ostream& os, const SearchReport& r) {
  os << r.tactic << ": " << name_of(r.budget.strategy) << " (seed " << r.budget.seed << "), " << r.evaluations
     << " plans evaluated over " << r.actions << " actions, objective " << name_of(r.objective) << ", memory budget "
     << (r.memory_budget_bytes ? human_bytes(static_cast<double>(r.memory_budget_bytes)) : "none") << "\n";
  os << "  chosen:    " << to_string(r.chosen) << "\n";
  for (std::size_t i = 0; i < r.runners_up.size(); ++i)
    os << "  runner-up: " << to_string(r.runners_up[i]) << "\n";
  os << "  baseline:  " << to_string(r.baseline) << "\n";
  const bool time = r.objective == Objective::step_time;
  auto metric = [&](const Candidate& c) { return time ? c.step_seconds : static_cast<double>(c.peak_bytes); };
  os << "  why: the best " << (time ? "predicted step time" : "predicted peak memory") << " of the plans"
     << (r.memory_budget_bytes ? " within the budget" : "");
  if (metric(r.chosen) > 0) os << ", " << metric(r.baseline) / metric(r.chosen) << "x the baseline";
  if (!r.runners_up.empty() && metric(r.chosen) > 0)
    os << ", " << metric(r.runners_up.front()) / metric(r.chosen) << "x the runner-up";
  return os << "\n";
}

// What a candidate plan is scored by: its predicted step time and per-device peak memory.
struct Evaluation {
  double step_seconds = 0;
  std::int64_t peak_bytes = 0;
  friend bool operator==(const Evaluation&, const Evaluation&) = default;
};
// Scores a plan; called from several search threads at once. A UserError means a plan that cannot run (never
// chosen). The default, simulated_on(profile), lowers the plan and simulates it; another model (measured runs,
// a learned cost model) plugs in here without the search knowing.
using Evaluator = std::function<Evaluation(const Partitioned&)>;

inline Evaluator simulated_on(HardwareProfile profile) {
  return [profile = std::move(profile)](const Partitioned& plan) {
    const Report r = simulate(lower(plan), profile);
    return Evaluation{r.step_seconds, r.peak_bytes};
  };
}

struct AutomaticPartition {
  std::vector<std::string> axes;
  Objective objective = Objective::step_time;
  std::int64_t memory_budget_bytes = 0;  // per-device peak; 0: none
  SearchBudget search_budget = {};
  HardwareProfile profile = HardwareProfile::cpu();  // what the candidates are simulated on
  std::string label = {};                             // "" gives "auto(model)"
  // Where apply() leaves its report (shared by the copies a Schedule holds); not part of the tactic's identity.
  std::shared_ptr<SearchReport> report = nullptr;
  // What scores the candidates; null: simulated_on(profile). Not part of the tactic's identity either.
  Evaluator evaluator = nullptr;

  std::string name() const {
    if (!label.empty()) return label;
    std::string s = "auto(";
    for (std::size_t i = 0; i < axes.size(); ++i) s += (i ? "," : "") + axes[i];
    return s + ")";
  }

  // The search from state s (the program as the earlier tactics left it); s is not changed.
  SearchReport search(const PartitionState& s) const { return run(s).first; }

  void apply(PartitionState& s) const;

  friend bool operator==(const AutomaticPartition& a, const AutomaticPartition& b) {
    return a.axes == b.axes && a.objective == b.objective && a.memory_budget_bytes == b.memory_budget_bytes &&
           a.search_budget == b.search_budget && a.profile == b.profile && a.label == b.label;
  }

 private:
  std::vector<int> axis_ids(const PartitionState& s) const {
    if (axes.empty()) user_error(s.tactic_label() + ": AutomaticPartition needs at least one mesh axis to search over");
    std::vector<int> out;
    for (const auto& a : axes) out.push_back(s.axis(a));
    return out;
  }
  std::pair<SearchReport, std::vector<int>> run(const PartitionState& s) const;
};

#if PARTIR_DEFINE_ENTRIES
namespace detail {

// The values an action tiles together, and how to name them in a ManualPartition: a glob where one names
// exactly the members, else the members' names.
struct ActionGroup {
  std::vector<ValueId> members;
  std::vector<std::string> selectors;  // the owner's first
  std::string owner;                   // the selector that names the group in reports
  bool each_first_dim = false;         // the ZeRO-3-like group: every member on its first dim that divides
};

// params/layers/3/mlp/w1 -> params/layers/*/mlp/w1: the same value in every layer.
inline std::string layer_pattern(std::string_view name) {
  std::string out;
  std::size_t start = 0;
  while (start <= name.size()) {
    const auto end = std::min(name.find('/', start), name.size());
    const auto seg = name.substr(start, end - start);
    const bool digits = !seg.empty() && std::all_of(seg.begin(), seg.end(), [](char c) { return c >= '0' && c <= '9'; });
    out += digits ? std::string("*") : std::string(seg);
    if (end < name.size()) out += '/';
    start = end + 1;
  }
  return out;
}

inline std::vector<ActionGroup> action_groups(const Program& p) {
  const NameIndex names(p);
  std::vector<std::pair<std::string, ValueId>> keyed;  // group key, member
  std::map<std::string, ValueId> params;               // parameter name -> value
  for (ValueId v : p.inputs())
    if (p.op(v).attrs.input_kind == InputKind::parameter) params.emplace(p.op(v).name, v);
  auto key_of = [&](ValueId v) { return layer_pattern(p.op(v).name) + " " + to_string(p.type(v)); };
  for (ValueId v = 0; v < p.size(); ++v) {
    const Op& op = p.op(v);
    if (op.name.empty() || op.type.rank() == 0) continue;
    ValueId owner = v;
    if (op.kind == OpKind::input && op.attrs.input_kind == InputKind::optimizer_state)
      for (const auto& [name, pv] : params)  // opt/adam/m/<param> moves with <param>
        if (op.name.size() > name.size() && op.name.ends_with("/" + name) && p.type(pv) == op.type) owner = pv;
    keyed.emplace_back(key_of(owner), v);
  }
  std::vector<std::string> order;  // groups in program order of their first member
  std::map<std::string, ActionGroup> groups;
  for (const auto& [key, v] : keyed) {
    auto [it, fresh] = groups.try_emplace(key);
    if (fresh) order.push_back(key);
    it->second.members.push_back(v);
  }
  std::vector<ActionGroup> out;
  for (const auto& key : order) {
    ActionGroup g = std::move(groups[key]);
    const std::string owner = layer_pattern(p.op(g.members.front()).name);  // a parameter precedes its state
    std::sort(g.members.begin(), g.members.end());
    std::map<std::string, std::vector<ValueId>> by_pattern;
    for (ValueId v : g.members) by_pattern[layer_pattern(p.op(v).name)].push_back(v);
    for (int pass = 0; pass < 2; ++pass)
      for (const auto& [pattern, vs] : by_pattern) {
        if ((pattern == owner) != (pass == 0)) continue;
        if (names.select(pattern) == vs) g.selectors.push_back(pattern);
        else
          for (ValueId v : vs) g.selectors.push_back(p.op(v).name);
      }
    g.owner = g.selectors.front();
    out.push_back(std::move(g));
  }
  // Every parameter with its state, each on the first dim that divides (as zero3 does): one action that cuts
  // the resident model state by the axis size, which a tight memory budget needs and which would take one
  // action per group otherwise (offered only under a memory budget).
  ActionGroup all{{}, {}, "every parameter", true};
  for (const auto& g : out)
    if (std::any_of(g.members.begin(), g.members.end(), [&](ValueId v) {
          return p.op(v).kind == OpKind::input && p.op(v).attrs.input_kind == InputKind::parameter;
        }))
      all.members.insert(all.members.end(), g.members.begin(), g.members.end());
  std::sort(all.members.begin(), all.members.end());
  if (!all.members.empty()) out.push_back(std::move(all));
  return out;
}

struct Action {
  int group = 0;
  std::int64_t dim = 0;
  int axis = 0;
};

class AutoSearch {
 public:
  AutoSearch(const PartitionState& root, std::vector<int> axes, Objective objective, std::int64_t budget_bytes,
             SearchBudget budget, Evaluator evaluate)
      : root_(root), groups_(action_groups(root.program())), objective_(objective),
        budget_bytes_(budget_bytes), budget_(budget), evaluate_(std::move(evaluate)), rng_(budget.seed) {
    for (int a : axes)
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        const auto rank = root.program().type(groups_[g].members.front()).rank();
        if (groups_[g].each_first_dim) {
          // A memory move: offered under a budget only, where it is needed (greedy would otherwise take it
          // first on a small model and be locked out of Megatron-like plans).
          if (budget_bytes > 0) actions_.push_back({static_cast<int>(g), -1, a});
        } else
          for (std::int64_t d = 0; d < rank; ++d) actions_.push_back({static_cast<int>(g), d, a});
      }
    if (budget_.threads <= 0) budget_.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }

  // The members of the action's group that can still take its axis at state s, or nullopt if the action cannot
  // apply there (no member free, or a free member whose dim does not divide by its tiles).
  // (An action with dim -1 takes each member's first dim that divides, and skips members with none.)
  std::optional<std::vector<std::pair<ValueId, std::int64_t>>> free_members(const PartitionState& s, const Action& a) const {
    std::vector<std::pair<ValueId, std::int64_t>> out;
    for (ValueId v : groups_[static_cast<std::size_t>(a.group)].members) {
      const auto& prov = s.provenance(v);
      if (std::any_of(prov.begin(), prov.end(), [&](const Provenance& p) { return p.axis == a.axis; })) continue;
      const Sharding now = s.sharding(v);
      auto divides = [&](std::int64_t d) {
        AxisList axes = now.dims[static_cast<std::size_t>(d)];
        axes.push_back(s.mesh().axes()[static_cast<std::size_t>(a.axis)].name);
        return s.program().type(v).shape[static_cast<std::size_t>(d)] % tile_count(axes, s.mesh()) == 0;
      };
      if (a.dim >= 0) {
        if (!divides(a.dim)) return std::nullopt;
        out.emplace_back(v, a.dim);
      } else {
        for (std::int64_t d = 0; d < now.rank(); ++d)
          if (divides(d)) {
            out.emplace_back(v, d);
            break;
          }
      }
    }
    if (out.empty()) return std::nullopt;
    return out;
  }

  std::vector<int> valid_actions(const PartitionState& s) const {
    std::vector<int> out;
    for (std::size_t i = 0; i < actions_.size(); ++i)
      if (free_members(s, actions_[i])) out.push_back(static_cast<int>(i));
    return out;
  }

  // Applies action i to s and propagates (the next action sees where this one went).
  void apply(PartitionState& s, int i) const {
    const Action& a = actions_[static_cast<std::size_t>(i)];
    if (auto members = free_members(s, a))
      for (const auto& [v, d] : *members) s.tile(v, d, a.axis);
    s.propagate();
  }

  ManualPartition manual(int i) const {
    const Action& a = actions_[static_cast<std::size_t>(i)];
    const ActionGroup& g = groups_[static_cast<std::size_t>(a.group)];
    ManualPartition m{{}, root_.mesh().axes()[static_cast<std::size_t>(a.axis)].name};
    if (g.each_first_dim) {  // the members free where the search started, each with its dim
      for (const auto& [v, d] : free_members(root_, a).value_or(std::vector<std::pair<ValueId, std::int64_t>>{}))
        m.tiles.push_back({root_.program().op(v).name, d});
      m.label = "tile every parameter and its state (ZeRO-3-like) on " + m.axis;
      return m;
    }
    for (const auto& sel : g.selectors) m.tiles.push_back({sel, a.dim});
    m.label = "tile " + g.owner + ":" + std::to_string(a.dim) +
              (g.selectors.size() > 1 ? " (+" + std::to_string(g.selectors.size() - 1) + " tied)" : "") + " on " + m.axis;
    return m;
  }

  SearchReport run() {
    SearchReport r;
    r.budget = budget_;
    r.objective = objective_;
    r.memory_budget_bytes = budget_bytes_;
    r.actions = static_cast<int>(valid_actions(root_).size());
    {
      std::vector<Plan> root;
      root.push_back(plan({}));
      evaluate(std::move(root));
    }
    if (budget_.strategy == SearchStrategy::mcts) mcts();
    else beam();
    simplify();
    std::vector<const Seen*> ranked;
    for (const auto& [key, seen] : seen_) ranked.push_back(&seen);
    std::sort(ranked.begin(), ranked.end(), [&](const Seen* a, const Seen* b) { return better(*a, *b); });
    r.evaluations = static_cast<int>(seen_.size());
    r.baseline = candidate(seen_.at(key_of_root_));
    r.chosen = candidate(*ranked.front());
    for (std::size_t i = 1; i < ranked.size() && i <= 3; ++i) r.runners_up.push_back(candidate(*ranked[i]));
    return r;
  }

  // The chosen actions' indices, replayed by commit().
  const std::vector<int>& best_sequence() const { return best_->sequence; }

 private:
  struct Seen {
    std::vector<int> sequence;
    Evaluation eval;
    bool fits = true;
  };
  struct Plan {  // a propagated state and the sequence that made it
    std::vector<int> sequence;
    PartitionState state;
  };

  bool fits(const Evaluation& e) const { return budget_bytes_ <= 0 || e.peak_bytes <= budget_bytes_; }
  double metric(const Evaluation& e) const {
    return objective_ == Objective::step_time ? e.step_seconds : static_cast<double>(e.peak_bytes);
  }
  // Plans that fit first; then the objective; then the other figure, fewer actions, and action order, so the
  // ranking is total and the result deterministic. Over budget: the smaller peak first.
  bool better(const Seen& a, const Seen& b) const {
    if (a.fits != b.fits) return a.fits;
    const double ma = a.fits ? metric(a.eval) : static_cast<double>(a.eval.peak_bytes);
    const double mb = b.fits ? metric(b.eval) : static_cast<double>(b.eval.peak_bytes);
    if (ma != mb) return ma < mb;
    if (a.eval.step_seconds != b.eval.step_seconds) return a.eval.step_seconds < b.eval.step_seconds;
    if (a.sequence.size() != b.sequence.size()) return a.sequence.size() < b.sequence.size();
    return a.sequence < b.sequence;
  }
  // MCTS reward: a plan that fits scores 1 + baseline/metric (1 to ~3), one over budget budget/peak (0 to 1).
  double reward(const Seen& s) const {
    if (!s.fits) return static_cast<double>(budget_bytes_) / static_cast<double>(std::max<std::int64_t>(1, s.eval.peak_bytes));
    const double base = metric(seen_.at(key_of_root_).eval), m = metric(s.eval);
    return 1 + (m > 0 ? std::min(4.0, base / m) : 1.0);
  }

  Candidate candidate(const Seen& s) const {
    Candidate c{{}, s.eval.step_seconds, s.eval.peak_bytes, s.fits};
    for (int i : s.sequence) c.actions.push_back(manual(i));
    return c;
  }

  // The shardings identify a plan: sequences that reach the same ones are evaluated once.
  static std::string key(const PartitionState& s) {
    std::string k;
    for (ValueId v = 0; v < s.program().size(); ++v) {
      const Sharding sh = s.sharding(v);
      if (sh.is_replicated()) continue;
      k += std::to_string(v) + to_string(sh) + ";";
    }
    return k;
  }

  Plan plan(const std::vector<int>& sequence) const {
    Plan p{sequence, root_};
    for (int i : sequence) apply(p.state, i);
    return p;
  }

  // Evaluates the plans not seen before (in parallel), within the evaluation budget; returns each plan's key
  // (empty for a plan left out by the budget).
  std::vector<std::string> evaluate(std::vector<Plan> plans) {
    std::vector<std::string> keys;
    std::vector<std::size_t> fresh;
    for (std::size_t i = 0; i < plans.size(); ++i) {
      keys.push_back(key(plans[i].state));
      if (auto it = seen_.find(keys.back()); it != seen_.end()) {
        if (plans[i].sequence.size() < it->second.sequence.size()) it->second.sequence = plans[i].sequence;
        continue;
      }
      if (
          std::any_of(fresh.begin(), fresh.end(), [&](std::size_t j) { return keys[j] == keys.back(); }))
        continue;
      if (static_cast<int>(seen_.size() + fresh.size()) >= budget_.evaluations && !seen_.empty()) {
        keys.back().clear();
        continue;
      }
      fresh.push_back(i);
    }
    std::vector<Evaluation> results(fresh.size());
    std::vector<std::exception_ptr> errors(fresh.size());
    std::atomic<std::size_t> next{0};
    auto worker = [&] {
      for (std::size_t j; (j = next++) < fresh.size();) try {
          results[j] = evaluate_(Partitioned(plans[fresh[j]].state, {}));
        } catch (const UserError&) {  // a plan lowering refuses (a halo wider than a tile): never the best
          results[j] = {std::numeric_limits<double>::infinity(), std::numeric_limits<std::int64_t>::max()};
          if (seen_.empty() && j == 0) errors[j] = std::current_exception();  // the earlier tactics' plan itself
        } catch (...) {
          errors[j] = std::current_exception();
        }
    };
    const auto n = std::min<std::size_t>(static_cast<std::size_t>(budget_.threads), fresh.size());
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < n; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
    for (std::size_t j = 0; j < fresh.size(); ++j) {
      Seen s{plans[fresh[j]].sequence, results[j], fits(results[j])};
      if (seen_.empty()) key_of_root_ = keys[fresh[j]];
      seen_.emplace(keys[fresh[j]], s);
    }
    for (const auto& [k, s] : seen_)
      if (!best_ || better(s, *best_)) best_ = &s;
    return keys;
  }
  // Drops from the best plan each action without which it is as good (random rollouts add idle actions);
  // up to max_actions evaluations beyond the budget.
  void simplify() {
    budget_.evaluations += budget_.max_actions;
    for (std::size_t i = 0; i < best_->sequence.size();) {
      std::vector<int> shorter = best_->sequence;
      shorter.erase(shorter.begin() + static_cast<std::ptrdiff_t>(i));
      const Seen* before = best_;
      std::vector<Plan> one;
      one.push_back(plan(shorter));
      const auto keys = evaluate(std::move(one));
      const Seen* s = keys[0].empty() ? nullptr : &seen_.at(keys[0]);
      if (s && !better(*before, *s)) best_ = s;  // at least as good, with fewer actions
      else ++i;
    }
    budget_.evaluations -= budget_.max_actions;
  }

  bool exhausted() const { return static_cast<int>(seen_.size()) >= budget_.evaluations; }

  void beam() {
    std::vector<Plan> frontier{plan({})};
    for (int depth = 0; depth < budget_.max_actions && !exhausted(); ++depth) {
      const Seen before = *best_;
      std::vector<Plan> children;
      std::set<std::string> queued;
      for (const auto& f : frontier)
        for (int i : valid_actions(f.state)) {
          Plan c{f.sequence, f.state};
          c.sequence.push_back(i);
          apply(c.state, i);
          if (queued.insert(key(c.state)).second) children.push_back(std::move(c));
        }
      const auto keys = evaluate(children);
      std::vector<std::size_t> order;
      for (std::size_t i = 0; i < children.size(); ++i)
        if (!keys[i].empty() && seen_.at(keys[i]).sequence == children[i].sequence) order.push_back(i);
      std::sort(order.begin(), order.end(),
                [&](std::size_t a, std::size_t b) { return better(seen_.at(keys[a]), seen_.at(keys[b])); });
      if (order.empty() || !better(*best_, before)) break;  // no child improves: stop
      std::vector<Plan> next;
      for (std::size_t k = 0; k < order.size() && k < static_cast<std::size_t>(std::max(1, budget_.beam_width)); ++k)
        next.push_back(std::move(children[order[k]]));
      frontier = std::move(next);
    }
  }

  struct Node {
    std::vector<int> sequence;
    std::optional<PartitionState> state;
    std::vector<int> untried;   // valid actions not expanded yet; -1 is "stop"
    std::vector<int> children;  // node indices
    int parent = -1;
    int visits = 0, pending = 0;
    double total = 0;
    bool terminal = false;
  };

  int pick(std::vector<int>& from) {
    const auto k = std::uniform_int_distribution<std::size_t>(0, from.size() - 1)(rng_);
    const int out = from[k];
    from.erase(from.begin() + static_cast<std::ptrdiff_t>(k));
    return out;
  }

  // One MCTS descent: select by UCT (pending rollouts count as visits, so a batch spreads out), expand one
  // untried action, roll out randomly to a stop. Returns the leaf and the rollout's plan.
  std::pair<int, Plan> descend(std::vector<Node>& tree) {
    int n = 0;
    while (true) {
      Node& node = tree[static_cast<std::size_t>(n)];
      if (node.terminal || (node.untried.empty() && node.children.empty())) break;
      if (!node.untried.empty()) {
        const int a = pick(node.untried);
        Node child{node.sequence, std::nullopt, {}, {}, n, 0, 0, 0, a < 0};
        if (a >= 0) {
          child.sequence.push_back(a);
          child.state = *node.state;
          apply(*child.state, a);
          if (static_cast<int>(child.sequence.size()) < budget_.max_actions) child.untried = valid_actions(*child.state);
          child.untried.push_back(-1);
        } else {
          child.state = node.state;
        }
        tree.push_back(std::move(child));
        tree[static_cast<std::size_t>(n)].children.push_back(static_cast<int>(tree.size() - 1));
        n = static_cast<int>(tree.size() - 1);
        break;
      }
      const double log_n = std::log(std::max(1, node.visits + node.pending));
      int best = -1;
      double best_score = -1;
      for (int c : node.children) {
        const Node& ch = tree[static_cast<std::size_t>(c)];
        const int visits = ch.visits + ch.pending;
        const double score = visits == 0 ? 1e9 : ch.total / std::max(1, ch.visits) + std::sqrt(2 * log_n / visits);
        if (score > best_score) best = c, best_score = score;
      }
      n = best;
    }
    Node& leaf = tree[static_cast<std::size_t>(n)];
    Plan p{leaf.sequence, *leaf.state};
    if (!leaf.terminal) {
      // Rollout: stop with probability 1/2 at each step, else a random valid action. Short rollouts keep the
      // reward about the actions the tree chose, not about random ones after them.
      std::vector<int> options = valid_actions(p.state);
      while (static_cast<int>(p.sequence.size()) < budget_.max_actions && !options.empty() &&
             std::uniform_int_distribution<int>(0, 1)(rng_) == 1) {
        const int a = pick(options);
        p.sequence.push_back(a);
        apply(p.state, a);
        options = valid_actions(p.state);
      }
    }
    for (int m = n; m >= 0;) {  // mark the path pending
      ++tree[static_cast<std::size_t>(m)].pending;
      m = parent(tree, m);
    }
    return {n, std::move(p)};
  }

  static int parent(const std::vector<Node>& tree, int n) { return tree[static_cast<std::size_t>(n)].parent; }

  void mcts() {
    std::vector<Node> tree(1);
    tree[0].state = root_;
    tree[0].untried = valid_actions(root_);
    if (budget_.max_actions <= 0) tree[0].untried.clear();
    const int rounds_cap = 3 * std::max(1, budget_.evaluations);  // rounds of cache hits end too
    for (int round = 0; round < rounds_cap && !exhausted(); ++round) {
      if (tree[0].untried.empty() && tree[0].children.empty()) break;
      std::vector<std::pair<int, Plan>> batch;
      for (int t = 0; t < budget_.threads; ++t) batch.push_back(descend(tree));
      std::vector<Plan> plans;
      for (auto& [leaf, p] : batch) plans.push_back(p);
      const auto keys = evaluate(std::move(plans));
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const double r = keys[i].empty() ? 0.0 : reward(seen_.at(keys[i]));
        for (int m = batch[i].first; m >= 0; m = parent(tree, m)) {
          Node& node = tree[static_cast<std::size_t>(m)];
          --node.pending;
          ++node.visits;
          node.total += r;
        }
      }
      if (tree[0].visits > 0 && fully_explored(tree, 0)) break;
    }
  }

  // Every node expanded down to its stops: nothing left to learn.
  static bool fully_explored(const std::vector<Node>& tree, int n) {
    const Node& node = tree[static_cast<std::size_t>(n)];
    if (node.terminal) return true;
    if (!node.untried.empty()) return false;
    return std::all_of(node.children.begin(), node.children.end(), [&](int c) { return fully_explored(tree, c); });
  }

  const PartitionState& root_;
  std::vector<ActionGroup> groups_;
  Objective objective_;
  std::int64_t budget_bytes_;
  SearchBudget budget_;
  Evaluator evaluate_;
  std::mt19937_64 rng_;
  std::vector<Action> actions_;
  std::map<std::string, Seen> seen_;  // std::map: node addresses stay valid, iteration order is fixed
  std::string key_of_root_;
  const Seen* best_ = nullptr;
};

}  // namespace detail

PARTIR_ENTRY void AutomaticPartition::apply(PartitionState& s) const {
  auto [r, sequence] = run(s);
  if (memory_budget_bytes > 0 && !r.chosen.fits)
    user_error(s.tactic_label() + ": no plan found fits the memory budget of " +
               human_bytes(static_cast<double>(memory_budget_bytes)) + " per device; the best of " +
               std::to_string(r.evaluations) + " plans evaluated (" + to_string(r.chosen) + ") needs " +
               human_bytes(static_cast<double>(r.chosen.peak_bytes)));
  // Replay the chosen actions exactly as evaluated: tile, then propagate, one action at a time.
  detail::AutoSearch replay(s, axis_ids(s), objective, memory_budget_bytes, search_budget, nullptr);
  for (int i : sequence) replay.apply(s, i);
  if (report) *report = std::move(r);
}

PARTIR_ENTRY std::pair<SearchReport, std::vector<int>> AutomaticPartition::run(const PartitionState& s) const {
  detail::AutoSearch search(s, axis_ids(s), objective, memory_budget_bytes, search_budget,
                            evaluator ? evaluator : simulated_on(profile));
  SearchReport r = search.run();
  r.tactic = s.tactic_label();
  return {std::move(r), search.best_sequence()};
}
#endif

}  // namespace partir
