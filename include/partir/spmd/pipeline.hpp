#pragma once
// cut_into_stages: the last step of lowering a pipelined plan (tactics/pipeline.hpp). Every op of the lowered
// program gets the stage its global value was given; an op with no stage of its own is copied onto each stage
// that reads it; a value read on another stage than its own is sent there once, right after it is made, and
// received right before its first use there (a send/recv pair with one tag); a plain output (the loss) is sent
// to every stage, so every device returns it. Each stage's ops are then ordered by the schedule: its tasks
// (microbatch m's forward or backward pass through one of its chunks, the backward split into B and W where
// the schedule says so, then the update) in the schedule's order, each task's ops in program order. The B/W
// split comes from the graph, by data dependence: nothing is written per layer. The stages' sequences are
// interleaved into one program by running them as the devices will (sends never wait, a recv waits for its
// send): if that stalls, the stages wait on each other in a cycle and the plan is refused.
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "partir/config.hpp"
#include "partir/ir/program.hpp"
#include "partir/sharding/op_work.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// `lowered` (with `source`: each lowered op's value of `prog`) cut into `stages` as above; a schedule whose
// stages would wait on each other in a cycle is a UserError.
PARTIR_ENTRY SpmdProgram cut_into_stages(SpmdProgram lowered, const std::vector<ValueId>& source, const Program& prog,
                                         const PipelineStages& stages);

// Each device's tasks in the order it runs them, for p devices and m microbatches. GPipe, 1F1B and
// Megatron-LM's interleaved 1F1B by their definitions; the zero-bubble schedules by list scheduling their task
// graph over each virtual stage's task costs (unit costs where none are given): the device that is free first
// runs, of the tasks whose inputs are ready, a B first (it unblocks the stages before), else an F while within
// its memory limits, else a W that would not delay a B whose inputs are on their way: so W fills the bubbles.
// Memory counts a microbatch's activations as 2 halves, one freed by its B and one by its W (which still reads
// the layer inputs); zb1 keeps 1F1B's shape, at most p - s microbatches past F and not yet through B on stage
// s, and 1F1B's peak, 2p halves (stage 0's p microbatches); zbv's chunks are half a stage, so 2p chunks past F
// and 4p halves. Ties go to the earlier microbatch, then the later chunk. Should every device wait with none
// running, the limits rise by one: the order never deadlocks.
struct TaskCosts {
  double forward = 1, backward = 1, weight = 1;  // a microbatch's F, B and W on one virtual stage
};
PARTIR_ENTRY std::vector<std::vector<StageTask>> pipeline_tasks(const PipelineSchedule& schedule, int p, int m,
                                                                const std::vector<TaskCosts>& costs = {});

// The task of each global value: the segment it lies in (a program without segments is one forward pass) on
// its virtual stage. Where the schedule splits the backward pass, a backward value is B if a backward value of
// another virtual stage (the input gradient sent on) depends on it within its microbatch, else W.
PARTIR_ENTRY std::vector<StageTask> value_tasks(const Program& prog, const PipelineStages& st);

#if PARTIR_DEFINE_ENTRIES

PARTIR_ENTRY std::vector<std::vector<StageTask>> pipeline_tasks(const PipelineSchedule& schedule, int p, int m,
                                                                const std::vector<TaskCosts>& costs) {
  using P = StageTask::Phase;
  std::vector<std::vector<StageTask>> out(static_cast<std::size_t>(p));
  const int v = schedule.chunks, stages = p * v;
  if (schedule.order == PipelineSchedule::Order::gpipe) {
    for (int s = 0; s < p; ++s) {
      for (int j = 0; j < m; ++j) out[static_cast<std::size_t>(s)].push_back({s, P::forward, j});
      for (int j = 0; j < m; ++j) out[static_cast<std::size_t>(s)].push_back({s, P::backward, j});
    }
  } else if (!schedule.splits_backward()) {
    // Megatron-LM's order (1F1B when v is 1): microbatches in groups of p (the last group what is left), each
    // group through chunk 0, then chunk 1, ... forward and through the chunks in reverse backward; stage s warms
    // up with 2 (p - s - 1) + (v - 1) p of these (chunk, microbatch) passes, then alternates one forward and
    // one backward.
    std::vector<std::pair<int, int>> order;  // (chunk, microbatch), forward
    for (int first = 0; first < m; first += p)
      for (int c = 0; c < v; ++c)
        for (int j = first; j < std::min(m, first + p); ++j) order.emplace_back(c, j);
    const int total = m * v;
    for (int s = 0; s < p; ++s) {
      auto& tasks = out[static_cast<std::size_t>(s)];
      auto at = [&](int k) { return order[static_cast<std::size_t>(k)]; };
      auto forward = [&](int k) { tasks.push_back({at(k).first * p + s, P::forward, at(k).second}); };
      auto backward = [&](int k) { tasks.push_back({(v - 1 - at(k).first) * p + s, P::backward, at(k).second}); };
      const int warmup = std::min(total, v == 1 ? p - 1 - s : 2 * (p - s - 1) + (v - 1) * p);
      for (int k = 0; k < warmup; ++k) forward(k);
      for (int k = 0; k < total; ++k) {
        if (warmup + k < total) forward(warmup + k);
        backward(k);
      }
    }
  } else {
    const auto V = static_cast<std::size_t>(stages);
    if (!costs.empty() && costs.size() != V)
      internal_error("pipeline_tasks: " + std::to_string(costs.size()) + " task costs for " + std::to_string(stages) + " virtual stages");
    auto cost = [&](int c, P phase) {
      if (costs.empty()) return 1.0;
      const TaskCosts& k = costs[static_cast<std::size_t>(c)];
      return std::max(1e-12, phase == P::forward ? k.forward : phase == P::backward ? k.backward : k.weight);
    };
    // When each task ends (-1: not run yet), and how far each chunk has got with each kind of task.
    std::vector<std::vector<double>> forward_end(V, std::vector<double>(static_cast<std::size_t>(m), -1)), backward_end = forward_end;
    std::vector<int> next_f(V, 0), next_b(V, 0), next_w(V, 0);
    std::vector<double> free_at(static_cast<std::size_t>(p), 0);
    std::vector<int> before_b(static_cast<std::size_t>(p), 0), held(before_b), limit_b(before_b), limit_w(before_b);
    std::vector<std::vector<int>> chunks_of(static_cast<std::size_t>(p));
    for (int c = stages; c-- > 0;) chunks_of[static_cast<std::size_t>(schedule.device_of(c, p))].push_back(c);  // later first
    for (int d = 0; d < p; ++d) {
      limit_b[static_cast<std::size_t>(d)] = v == 1 ? p - d : 2 * p;
      limit_w[static_cast<std::size_t>(d)] = 2 * v * p;
    }
    std::vector<int> left(static_cast<std::size_t>(p), 0);  // tasks each device has still to run
    for (int c = 0; c < stages; ++c) left[static_cast<std::size_t>(schedule.device_of(c, p))] += 3 * m;
    std::set<double> ends;  // every task's end, for the times a waiting device looks again
    auto done = [](double end, double t) { return end >= 0 && end <= t; };
    std::vector<char> waiting(static_cast<std::size_t>(p), 0);  // for a task another device has yet to decide
    // When chunk c's next B can start: once its F and the next chunk's B of that microbatch have ended (-1: one of
    // them is not decided yet, or every B has run).
    auto b_ready = [&](int c) {
      const auto cc = static_cast<std::size_t>(c);
      if (next_b[cc] >= m) return -1.0;
      const auto j = static_cast<std::size_t>(next_b[cc]);
      const double f = forward_end[cc][j], after = c == stages - 1 ? 0 : backward_end[cc + 1][j];
      return f < 0 || after < 0 ? -1.0 : std::max(f, after);
    };
    // The device that is free first (of those with tasks left) decides next: no task that could make one of
    // its candidates ready by then is still undecided.
    for (;;) {
      int d = -1;
      bool any_left = false;
      for (int k = 0; k < p; ++k) {
        const auto kk = static_cast<std::size_t>(k);
        any_left |= left[kk] > 0;
        if (left[kk] > 0 && !waiting[kk] && (d < 0 || free_at[kk] < free_at[static_cast<std::size_t>(d)])) d = k;
      }
      if (!any_left) break;
      if (d < 0) {  // every device waits, with nothing running: relax the limits
        for (int k = 0; k < p; ++k) ++limit_b[static_cast<std::size_t>(k)], ++limit_w[static_cast<std::size_t>(k)];
        std::fill(waiting.begin(), waiting.end(), 0);
        continue;
      }
      const auto dd = static_cast<std::size_t>(d);
      const double t = free_at[dd];
      StageTask best{-1, P::update, m};
      for (P phase : {P::backward, P::forward, P::weight}) {
        for (int c : chunks_of[dd]) {
          const auto cc = static_cast<std::size_t>(c);
          std::optional<int> j;
          if (phase == P::backward && done(b_ready(c), t)) j = next_b[cc];
          if (phase == P::forward && next_f[cc] < m && before_b[dd] < limit_b[dd] && held[dd] + 2 <= limit_w[dd] &&
              (c == 0 || done(forward_end[cc - 1][static_cast<std::size_t>(next_f[cc])], t)))
            j = next_f[cc];
          if (phase == P::weight && next_w[cc] < next_b[cc] && done(backward_end[cc][static_cast<std::size_t>(next_w[cc])], t))
            j = next_w[cc];
          if (j && (best.chunk < 0 || *j < best.microbatch)) best = {c, phase, *j};
        }
        if (best.chunk >= 0) break;
      }
      // A W (the filler) must not delay a B already on its way: wait for that B instead.
      if (best.phase == P::weight) {
        double first_b = -1;
        for (int c : chunks_of[dd])
          if (const double r = b_ready(c); r >= 0 && (first_b < 0 || r < first_b)) first_b = r;
        if (first_b >= 0 && first_b < t + cost(best.chunk, best.phase)) {
          free_at[dd] = first_b;
          continue;
        }
      }
      if (best.chunk < 0) {  // look again when the next task ends, or when another device decides one
        if (const auto next = ends.upper_bound(t); next != ends.end()) free_at[dd] = *next;
        else waiting[dd] = 1;
        continue;
      }
      const auto cc = static_cast<std::size_t>(best.chunk);
      const double end = t + cost(best.chunk, best.phase);
      if (best.phase == P::forward) forward_end[cc][static_cast<std::size_t>(next_f[cc]++)] = end, ++before_b[dd], held[dd] += 2;
      if (best.phase == P::backward) backward_end[cc][static_cast<std::size_t>(next_b[cc]++)] = end, --before_b[dd], --held[dd];
      if (best.phase == P::weight) ++next_w[cc], --held[dd];
      free_at[dd] = end;
      ends.insert(end);
      std::fill(waiting.begin(), waiting.end(), 0);
      --left[dd];
      out[dd].push_back(best);
    }
  }
  for (auto& tasks : out) tasks.push_back({0, P::update, 0});
  return out;
}

PARTIR_ENTRY std::vector<StageTask> value_tasks(const Program& prog, const PipelineStages& st) {
  using P = StageTask::Phase;
  const auto n = static_cast<std::size_t>(prog.size());
  std::vector<StageTask> out(n);
  auto seg = prog.segments().begin();
  StageTask current;
  for (ValueId v = 0; v < prog.size(); ++v) {
    for (; seg != prog.segments().end() && seg->begin <= v; ++seg)
      current = {0, seg->pass == Segment::Pass::forward ? P::forward : seg->pass == Segment::Pass::backward ? P::backward : P::update,
                 seg->pass == Segment::Pass::update ? 0 : seg->microbatch};
    out[static_cast<std::size_t>(v)] = current;
    if (current.phase != P::update) out[static_cast<std::size_t>(v)].chunk = st.chunk[static_cast<std::size_t>(v)];
  }
  if (!st.schedule.splits_backward()) return out;
  std::vector<std::vector<ValueId>> users(n);
  for (ValueId v = 0; v < prog.size(); ++v)
    for (ValueId o : prog.op(v).operands) users[static_cast<std::size_t>(o)].push_back(v);
  std::vector<char> input_gradient(n, 0);
  for (auto v = n; v-- > 0;) {
    const StageTask t = out[v];
    if (t.phase != P::backward || t.chunk < 0) continue;
    for (ValueId u : users[v]) {
      const auto uu = static_cast<std::size_t>(u);
      const bool backward = out[uu].phase == P::backward || out[uu].phase == P::weight;
      if (!backward || out[uu].microbatch != t.microbatch || out[uu].chunk < 0) continue;
      input_gradient[v] |= out[uu].chunk != t.chunk || input_gradient[uu];
    }
    if (!input_gradient[v]) out[v].phase = P::weight;
  }
  return out;
}

namespace detail {

class StageCutter {
 public:
  StageCutter(SpmdProgram lowered, const std::vector<ValueId>& source, const Program& prog, const PipelineStages& st)
      : in_(std::move(lowered)), source_(source), prog_(prog), st_(st), tasks_(value_tasks(prog, st)),
        stage_(in_.size()), needs_(static_cast<std::size_t>(in_.size())),
        local_(static_cast<std::size_t>(st.stages), std::vector<int>(static_cast<std::size_t>(in_.size()), -1)),
        order_(static_cast<std::size_t>(st.stages)) {
    for (ValueId v = 0; v < in_.size(); ++v) stage_[static_cast<std::size_t>(v)] = in_.op(v).stage;
    // A plain output no stage makes (a constant) is made on stage 0, and sent from there like the others.
    for (const auto& b : in_.outputs())
      if (stage_[static_cast<std::size_t>(b.value)] < 0 && !is_input(b.value)) stage_[static_cast<std::size_t>(b.value)] = 0;
    for (const auto& s : prog.segments()) microbatches_ = std::max(microbatches_, s.microbatch + 1);
    order_of_tasks_ = pipeline_tasks(st_.schedule, st_.stages, microbatches_,
                                     st_.schedule.splits_backward() ? task_costs() : std::vector<TaskCosts>{});
  }

  SpmdProgram run() {
    find_needs();
    for (int s = 0; s < st_.stages; ++s) sequence(s);
    return interleave();
  }

 private:
  struct Node {
    SpmdOp op;       // operands: node ids
    int stage = -1;
    ValueId of = -1;  // the lowered value it computes, moves or copies
  };

  // Each virtual stage's F, B and W of microbatch 0: the roofline time of their ops on the nominal machine.
  std::vector<TaskCosts> task_costs() const {
    std::vector<TaskCosts> costs(static_cast<std::size_t>(st_.stages * st_.schedule.chunks), TaskCosts{0, 0, 0});
    std::vector<TensorType> operands;
    for (ValueId v = 0; v < in_.size(); ++v) {
      const StageTask t = task(v);
      if (stage(v) < 0 || is_input(v) || t.microbatch != 0 || t.chunk < 0 || t.phase == StageTask::Phase::update) continue;
      operands.clear();
      for (ValueId o : in_.op(v).op.operands) operands.push_back(in_.type(o));
      const Work w = in_.op(v).collective ? Work{0, 2.0 * static_cast<double>(in_.type(v).bytes())} : local_work(in_.op(v).op, operands);
      const double seconds = nominal_seconds(w);
      TaskCosts& c = costs[static_cast<std::size_t>(t.chunk)];
      (t.phase == StageTask::Phase::forward ? c.forward : t.phase == StageTask::Phase::backward ? c.backward : c.weight) += seconds;
    }
    return costs;
  }

  bool is_input(ValueId v) const { return in_.op(v).op.kind == OpKind::input && !in_.op(v).collective; }
  int stage(ValueId v) const { return stage_[static_cast<std::size_t>(v)]; }
  StageTask task(ValueId v) const { return tasks_[static_cast<std::size_t>(source_[static_cast<std::size_t>(v)])]; }

  // The stages that run each stage-less op (the stages of the ops that read it), and for each value the
  // other stages that read it (its sends).
  void find_needs() {
    const auto n = static_cast<std::size_t>(in_.size());
    std::vector<std::set<int>> runs_on(n);
    for (ValueId v = 0; v < in_.size(); ++v)
      if (stage(v) >= 0 && !is_input(v)) runs_on[static_cast<std::size_t>(v)].insert(stage(v));
    for (const auto& b : in_.outputs()) {
      const Binding* updated = nullptr;
      for (const auto& i : in_.inputs()) updated = i.name == b.updates ? &i : updated;
      const bool state = updated && stage(updated->value) >= 0;
      for (int s = 0; s < st_.stages; ++s)
        if (!state || s == stage(updated->value)) outputs_on_[s].push_back(&b - in_.outputs().data());
    }
    for (const auto& [s, list] : outputs_on_)
      for (auto i : list) {
        const ValueId v = in_.outputs()[static_cast<std::size_t>(i)].value;
        if (stage(v) < 0) runs_on[static_cast<std::size_t>(v)].insert(s);
      }
    for (auto v = n; v-- > 0;)
      for (ValueId o : in_.op(static_cast<ValueId>(v)).op.operands)
        if (stage(o) < 0 && !is_input(o)) runs_on[static_cast<std::size_t>(o)].insert(runs_on[v].begin(), runs_on[v].end());
    auto need = [&](ValueId o, int s) {
      if (stage(o) >= 0 && stage(o) != s) needs_[static_cast<std::size_t>(o)].insert(s);
    };
    for (ValueId v = 0; v < in_.size(); ++v)
      for (int s : runs_on[static_cast<std::size_t>(v)])
        for (ValueId o : in_.op(v).op.operands) need(o, s);
    for (const auto& [s, list] : outputs_on_)
      for (auto i : list) need(in_.outputs()[static_cast<std::size_t>(i)].value, s);
  }

  int add(Node node) {
    nodes_.push_back(std::move(node));
    return static_cast<int>(nodes_.size()) - 1;
  }

  // The send of v to stage t (made once, placed on v's stage right after v).
  int send_of(ValueId v, int t) {
    auto [it, fresh] = sends_.try_emplace({v, t}, -1);
    if (fresh) {
      SpmdOp s{Op{OpKind::input, {}, {}, in_.type(v), ""},
               Collective{CollectiveKind::send, {st_.axis}, -1, -1, reason(v, stage(v), t), t,
                          static_cast<std::int64_t>(sends_.size() - 1)},
               {}, stage(v)};
      it->second = add({std::move(s), stage(v), v});
    }
    return it->second;
  }

  std::string reason(ValueId v, int from, int to) const {
    const ValueId g = source_[static_cast<std::size_t>(v)];
    return st_.tactic_label + ": " + prog_.label(g) + " " + to_string(prog_.type(g)) + " from stage " +
           std::to_string(from) + " to stage " + std::to_string(to) + " (" + (to > from ? "forward" : "backward") +
           " across the stage boundary)";
  }

  void place(int s, int node) { order_[static_cast<std::size_t>(s)].push_back(node); }

  // Right after v is made on its stage s (as `node`): its sends to the other stages that read it.
  void send_everywhere(int s, ValueId v, int node) {
    for (int t : needs_[static_cast<std::size_t>(v)]) {
      const int send = send_of(v, t);
      nodes_[static_cast<std::size_t>(send)].op.op.operands = {node};
      nodes_[static_cast<std::size_t>(send)].op.task = current_;
      place(s, send);
    }
  }

  // The node holding lowered value v on stage s, made (with what it reads) if it is not there yet.
  int on(int s, ValueId v) {
    int& slot = local_[static_cast<std::size_t>(s)][static_cast<std::size_t>(v)];
    if (slot >= 0) return slot;
    if (is_input(v)) {
      if (stage(v) < 0 || stage(v) == s) return slot = input_node(v);
    } else if (stage(v) < 0 || stage(v) == s) {
      Node node{in_.op(v), s, v};
      for (auto& o : node.op.op.operands) o = on(s, o);
      node.op.stage = s;
      node.op.task = current_;
      slot = add(std::move(node));
      place(s, slot);
      send_everywhere(s, v, slot);
      return slot;
    }
    // Made on another stage: received here, before its first use.
    const int send = send_of(v, s);
    SpmdOp r{Op{OpKind::input, {send}, {}, in_.type(v), ""},
             Collective{CollectiveKind::recv, {st_.axis}, -1, -1, reason(v, stage(v), s), stage(v),
                        nodes_[static_cast<std::size_t>(send)].op.collective->tag},
             {}, s};
    r.task = current_;
    slot = add({std::move(r), s, v});
    place(s, slot);
    return slot;
  }

  int input_node(ValueId v) {
    auto [it, fresh] = inputs_.try_emplace(v, -1);
    if (fresh) {
      SpmdOp op = in_.op(v);
      op.stage = stage(v);
      it->second = add({std::move(op), stage(v), v});
    }
    return it->second;
  }

  void sequence(int s) {
    current_ = {0, StageTask::Phase::update, 0};
    // A stage's state inputs that other stages read (a tied embedding) go out first.
    for (const auto& b : in_.inputs())
      if (stage(b.value) == s) send_everywhere(s, b.value, on(s, b.value));
    std::map<StageTask, std::vector<ValueId>> by_task;
    for (ValueId v = 0; v < in_.size(); ++v)
      if (stage(v) == s && !is_input(v)) by_task[task(v)].push_back(v);
    for (const auto& t : order_of_tasks_[static_cast<std::size_t>(s)]) {
      auto it = by_task.find(t);
      if (it == by_task.end()) continue;
      current_ = t;
      for (ValueId v : it->second) on(s, v);
      by_task.erase(it);
    }
    if (!by_task.empty())
      internal_error("pipeline: stage " + std::to_string(s) + " has ops of a task its schedule does not run");
    current_ = {0, StageTask::Phase::update, 0};
    for (auto i : outputs_on_[s]) on(s, in_.outputs()[static_cast<std::size_t>(i)].value);
  }

  // One program holding every stage's sequence in order, found by running them as devices do.
  SpmdProgram interleave() {
    SpmdProgram out(in_.name(), in_.mesh());
    std::vector<ValueId> id(nodes_.size(), -1);
    auto emit = [&](int node) {
      SpmdOp op = nodes_[static_cast<std::size_t>(node)].op;
      for (auto& o : op.op.operands) o = id[static_cast<std::size_t>(o)];
      id[static_cast<std::size_t>(node)] = out.add(std::move(op));
    };
    for (const auto& [v, node] : inputs_) emit(node);
    std::vector<std::size_t> next(order_.size(), 0);
    for (bool progress = true; progress;) {
      progress = false;
      for (std::size_t s = 0; s < order_.size(); ++s)
        for (; next[s] < order_[s].size(); ++next[s]) {
          const int node = order_[s][next[s]];
          const SpmdOp& op = nodes_[static_cast<std::size_t>(node)].op;
          if (op.collective && op.collective->kind == CollectiveKind::recv &&
              id[static_cast<std::size_t>(op.op.operands[0])] < 0)
            break;
          emit(node);
          progress = true;
        }
    }
    std::string waits;  // each stuck stage: what it waits for, in which of its tasks
    for (std::size_t s = 0; s < order_.size(); ++s)
      if (next[s] < order_[s].size()) {
        const Node& waiting = nodes_[static_cast<std::size_t>(order_[s][next[s]])];
        const StageTask& t = waiting.op.task;
        waits += (waits.empty() ? "" : "; ") + std::string("stage ") + std::to_string(s) + " waits for " +
                 prog_.label(source_[static_cast<std::size_t>(waiting.of)]) + " from stage " +
                 std::to_string(waiting.op.collective->peer) + " in its " + "FBWU"[static_cast<int>(t.phase)] +
                 " of chunk " + std::to_string(t.chunk) + ", microbatch " + std::to_string(t.microbatch);
      }
    if (!waits.empty())
      user_error(st_.tactic_label + ": the stages wait on each other: " + waits +
                 " (a stage boundary inside a value the schedule needs whole; assign the stages in model order)");
    for (Binding b : in_.inputs()) {
      b.value = id[static_cast<std::size_t>(inputs_.at(b.value))];
      out.add_input(std::move(b));
    }
    for (Binding b : in_.outputs()) {
      const int s = stage(b.value) >= 0 ? stage(b.value) : outputs_on_.begin()->first;
      b.value = id[static_cast<std::size_t>(is_input(b.value) ? inputs_.at(b.value) : local_[static_cast<std::size_t>(s)][static_cast<std::size_t>(b.value)])];
      out.add_output(std::move(b));
    }
    out.set_pipeline({st_.axis, st_.stages, st_.schedule, microbatches_});
    return out;
  }

  SpmdProgram in_;
  const std::vector<ValueId>& source_;
  const Program& prog_;
  const PipelineStages& st_;
  std::vector<StageTask> tasks_;  // per global value
  std::vector<int> stage_;        // per lowered value
  std::vector<std::set<int>> needs_;
  std::map<int, std::vector<std::ptrdiff_t>> outputs_on_;  // stage -> indices of the outputs its devices return
  std::vector<std::vector<int>> local_;  // stage -> lowered value -> node
  std::vector<std::vector<int>> order_;  // stage -> its nodes in running order
  std::vector<Node> nodes_;
  std::map<ValueId, int> inputs_;
  std::map<std::pair<ValueId, int>, int> sends_;
  int microbatches_ = 1;
  std::vector<std::vector<StageTask>> order_of_tasks_;  // per stage
  StageTask current_;  // the task being sequenced: its ops, sends and recvs are marked with it
};

}  // namespace detail

PARTIR_ENTRY SpmdProgram cut_into_stages(SpmdProgram lowered, const std::vector<ValueId>& source, const Program& prog,
                                   const PipelineStages& stages) {
  return detail::StageCutter(std::move(lowered), source, prog, stages).run();
}
#endif

}  // namespace partir
