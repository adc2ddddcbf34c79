#pragma once
// Collective bucketing (PyTorch DDP's buckets and FSDP's flat parameters, XLA's all-reduce, reduce-scatter and
// all-gather combiners): small all_reduces, reduce_scatters and all_gathers over the same devices, dtype and
// pipeline stage are fused into one collective, up to a bucket size (of each member's larger side: an
// all_gather's result). Each collective costs a latency on every backend (one rendezvous, one MPI call, one
// NCCL launch); under data parallelism a model has one gradient all_reduce per parameter, under ZeRO one
// reduce_scatter per parameter, and under ZeRO-3 an all_gather per parameter and pass, most of them small.
//
// An all_reduce bucket joins the flattened operands; a reduce_scatter bucket lays each operand out as
// [group size, rest] (the scattered dim moved first, so row p is the tile member p keeps), joins them along
// the rest and scatters rows: every member gets each operand's own tile, as it would alone. An all_gather
// bucket joins the flattened tiles as one row and gathers rows: row p holds member p's tiles, which make each
// result again.
//
// A reduction bucket runs as soon as the last of its operands is ready (where DDP launches a bucket: when
// backward has produced all its gradients), its members taken in that order; a gather bucket runs right before
// its first member's result is used, its members taken in the order their results are used (the layers'
// order, as FSDP gathers a unit), so that it holds gathered parameters no longer than it must. Either way a
// collective joins a bucket only if every operand is ready before any member's result is used: buckets never
// delay a value an op waits for. A bucket of one is left where it was. Sums are taken element by element as
// before, so results are unchanged up to the backend's summation order (on the threads backend, bitwise).
#include <algorithm>
#include <map>
#include <string>
#include <tuple>

#include "partir/config.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// The program with its small all_reduces, reduce_scatters and all_gathers fused into buckets of at most
// `bucket_bytes` each, counting each member's larger side (0: unchanged).
PARTIR_ENTRY SpmdProgram bucket_collectives(const SpmdProgram& p, std::int64_t bucket_bytes);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

struct Bucket {
  std::vector<ValueId> members;  // collectives of one kind, in the order the bucket takes them
  std::int64_t bytes = 0;        // of the members' larger sides (operands; an all_gather's results)
  ValueId ready = -1;            // the last operand's instruction (-1: program inputs only)
  ValueId first_use = 0;         // the earliest use of any member's result
  bool gathers = false;
  // The instruction the bucket runs after: a reduction right after its last operand, as soon as it can; a
  // gather right before its first use, as late as it can (the longer its results would be held).
  ValueId runs_after() const { return std::max<ValueId>(gathers ? first_use - 1 : ready, 0); }
};

inline bool is_gather(const SpmdOp& s) { return s.collective && s.collective->kind == CollectiveKind::all_gather; }

// What collective v counts against a bucket's size: its larger side (an operand; an all_gather's result).
inline std::int64_t member_bytes(const SpmdProgram& p, ValueId v) {
  return std::max(p.type(p.op(v).op.operands.at(0)).bytes(), p.type(v).bytes());
}

inline bool bucketable(const SpmdOp& s) {
  return s.collective && (s.collective->kind == CollectiveKind::all_reduce ||
                          s.collective->kind == CollectiveKind::reduce_scatter || is_gather(s));
}

// The buckets (of two or more members) that a program's all_reduces, reduce_scatters and all_gathers fall into.
inline std::vector<Bucket> plan_buckets(const SpmdProgram& p, std::int64_t bucket_bytes) {
  std::vector<ValueId> first_use(static_cast<std::size_t>(p.size()), p.size());  // outputs: at the end
  for (ValueId i = p.size() - 1; i >= 0; --i)
    for (auto v : p.op(i).op.operands) first_use[static_cast<std::size_t>(v)] = i;
  // Reductions are taken in the order their operands are ready (backward's order), gathers in the order
  // their results are first used (the layers').
  std::vector<std::pair<ValueId, ValueId>> candidates;  // (ready or first use, collective)
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!bucketable(p.op(v))) continue;
    const ValueId operand = p.op(v).op.operands.at(0);
    if (member_bytes(p, v) < bucket_bytes && !bucketable(p.op(operand)))
      candidates.emplace_back(is_gather(p.op(v)) ? first_use[static_cast<std::size_t>(v)] : operand, v);
  }
  std::sort(candidates.begin(), candidates.end());

  std::vector<Bucket> done;
  // by kind, group, dtype and pipeline stage
  std::map<std::tuple<CollectiveKind, AxisList, DType, int>, Bucket> open;
  auto close = [&](Bucket& b) {
    if (b.members.size() > 1) done.push_back(std::move(b));
    b = {};
  };
  for (const auto& [order, v] : candidates) {
    const SpmdOp& s = p.op(v);
    // A program input is ready from the start: a bucket that runs before it takes it along (a ZeRO-3 gather's
    // parameter tile, placed by lowering right before its own gather).
    const ValueId operand = is_program_input(p.op(s.op.operands[0])) ? -1 : s.op.operands[0];
    const std::int64_t bytes = member_bytes(p, v);
    const ValueId use = first_use[static_cast<std::size_t>(v)];
    Bucket& b = open[{s.collective->kind, s.collective->axes, s.op.type.dtype, s.stage}];
    // Every operand must be ready before any result is used. A tile gathered again (ZeRO-3's backward pass
    // gathers each parameter anew) starts a bucket of its own, at its own first use: the pass between frees it.
    const bool again = std::ranges::any_of(b.members, [&](ValueId m) { return p.op(m).op.operands == s.op.operands; });
    if (!b.members.empty() &&
        (again || b.bytes + bytes > bucket_bytes || std::max(b.ready, operand) >= std::min(b.first_use, use)))
      close(b);
    b.first_use = b.members.empty() ? use : std::min(b.first_use, use);
    b.ready = std::max(b.ready, operand);
    b.gathers = is_gather(s);
    b.members.push_back(v);
    b.bytes += bytes;
  }
  for (auto& [key, b] : open) close(b);
  std::sort(done.begin(), done.end(), [](const Bucket& a, const Bucket& b) { return a.runs_after() < b.runs_after(); });
  return done;
}

// How a member enters and leaves its bucket: `into` brings its operand to the bucket's layout (each op reads
// the one before, the first the operand): flat for an all_reduce, [group size, rest] for a reduce_scatter,
// [1, operand] for an all_gather; `piece` is its part of the bucket's result, of type piece_type ([group size,
// operand] for an all_gather: one row per member of the group), and `back` brings the piece to the member's
// result (each op reads the one before, the first the slice of the piece).
struct BucketMember {
  std::vector<Op> into, back;
  TensorType piece_type;
};

inline BucketMember bucket_member(const SpmdProgram& p, ValueId m) {
  const Collective& c = *p.op(m).collective;
  const TensorType& operand = p.type(p.op(m).op.operands[0]);
  const TensorType& result = p.type(m);
  const DType dtype = result.dtype;
  auto reshape = [&](const Shape& to) {
    Op r{OpKind::reshape, {}, {}, {to, dtype}, ""};
    r.attrs.shape = to;
    return r;
  };
  BucketMember b;
  if (c.kind == CollectiveKind::all_reduce) {
    b.piece_type = {{operand.elements()}, dtype};
    if (operand.rank() != 1) b.into.push_back(reshape(b.piece_type.shape)), b.back.push_back(reshape(result.shape));
    return b;
  }
  // The full side (a reduce_scatter's operand, an all_gather's result) is k tiles along c.dim: with that dim
  // moved first, tile p is row p of [k, rest].
  const bool gather = c.kind == CollectiveKind::all_gather;
  const TensorType& tile = gather ? operand : result;
  const TensorType& full = gather ? result : operand;
  const std::int64_t k = full.shape[static_cast<std::size_t>(c.dim)] / tile.shape[static_cast<std::size_t>(c.dim)];
  std::vector<std::int64_t> first{c.dim}, inverse(static_cast<std::size_t>(operand.rank()));  // dim c.dim first
  for (std::int64_t d = 0; d < operand.rank(); ++d)
    if (d != c.dim) first.push_back(d);
  for (std::size_t i = 0; i < first.size(); ++i) inverse[static_cast<std::size_t>(first[i])] = static_cast<std::int64_t>(i);
  auto transpose = [&](const TensorType& from, const std::vector<std::int64_t>& dims) {
    Op t{OpKind::transpose, {}, {}, {{}, dtype}, ""};
    for (auto d : dims) t.type.shape.push_back(from.shape[static_cast<std::size_t>(d)]);
    t.attrs.dims = dims;
    return t;
  };
  const bool moves = c.dim != 0;
  if (moves) b.into.push_back(transpose(operand, first));
  const Shape moved_operand = moves ? b.into.back().type.shape : operand.shape;
  const Shape rows = gather ? Shape{1, operand.elements()} : Shape{k, operand.elements() / k};
  if (moved_operand != rows) b.into.push_back(reshape(rows));
  b.piece_type = gather ? TensorType{{k, operand.elements()}, dtype} : TensorType{{1, result.elements()}, dtype};
  const Shape front = moves ? transpose(result, first).type.shape : result.shape;  // the result, c.dim first
  if (front != b.piece_type.shape) b.back.push_back(reshape(front));
  if (moves) b.back.push_back(transpose({front, dtype}, inverse));
  return b;
}

}  // namespace detail

PARTIR_ENTRY SpmdProgram bucket_collectives(const SpmdProgram& p, std::int64_t bucket_bytes) {
  if (bucket_bytes < 0)
    user_error("bucket_collectives: bucket size " + std::to_string(bucket_bytes) + " bytes is negative (0 turns bucketing off)");
  if (bucket_bytes == 0) return p;
  const auto buckets = detail::plan_buckets(p, bucket_bytes);
  if (buckets.empty()) return p;
  std::map<ValueId, detail::BucketMember> layout;  // of every bucketed collective
  std::multimap<ValueId, const detail::Bucket*> runs_after;  // buckets by the instruction they follow
  for (const auto& b : buckets) {
    for (auto v : b.members) layout.emplace(v, detail::bucket_member(p, v));
    runs_after.emplace(b.runs_after(), &b);
  }

  // Program inputs a bucket reads before their own place are emitted with it, not again at their place.
  std::map<const detail::Bucket*, std::vector<ValueId>> inputs_along;
  std::vector<bool> along(static_cast<std::size_t>(p.size()), false);
  // Where each value lands, known before building: a recv names its send, which may come later.
  std::vector<ValueId> moved(static_cast<std::size_t>(p.size()), -1);
  for (ValueId v = 0, next = 0; v < p.size(); ++v) {
    if (!layout.contains(v) && !along[static_cast<std::size_t>(v)]) moved[static_cast<std::size_t>(v)] = next++;
    for (auto [it, end] = runs_after.equal_range(v); it != end; ++it) {
      const auto& members = it->second->members;
      for (auto m : members)
        if (const ValueId o = p.op(m).op.operands[0]; o > v && !along[static_cast<std::size_t>(o)]) {
          along[static_cast<std::size_t>(o)] = true;
          inputs_along[it->second].push_back(o);
          moved[static_cast<std::size_t>(o)] = next++;
        }
      for (auto m : members) next += static_cast<ValueId>(layout.at(m).into.size());
      next += 2;  // join, collective
      for (auto m : members)  // slice, back
        moved[static_cast<std::size_t>(m)] = (next += 1 + static_cast<ValueId>(layout.at(m).back.size())) - 1;
    }
  }

  SpmdProgram out(p.name(), p.mesh());
  if (p.pipeline()) out.set_pipeline(*p.pipeline());
  // Brings the operands into the bucket's layout, joins them, runs the collective once, and cuts its result
  // back into the members' results.
  auto run_bucket = [&](const detail::Bucket& bucket) {
    const SpmdOp& first = p.op(bucket.members.front());
    const DType dtype = first.op.type.dtype;
    const bool scatters = first.collective->kind == CollectiveKind::reduce_scatter, gathers = bucket.gathers;
    const bool by_rows = scatters || gathers;  // members side by side along dim 1, the collective along dim 0
    auto add = [&](Op op, std::optional<Collective> c = std::nullopt) {
      return out.add({std::move(op), std::move(c), {}, first.stage});
    };
    auto chain = [&](ValueId from, const std::vector<Op>& ops) {
      for (Op op : ops) {
        op.operands = {from};
        from = add(std::move(op));
      }
      return from;
    };
    for (auto input : inputs_along[&bucket]) out.add(p.op(input));
    std::vector<ValueId> parts;
    std::int64_t width = 0;  // of the joined operand's last dim
    std::string why = "bucket of " + std::to_string(bucket.members.size()) + " " +
                      std::string(name_of(first.collective->kind)) + "s, " + std::to_string(bucket.bytes) +
                      " bytes (bucket size " + std::to_string(bucket_bytes) + "):";
    for (auto m : bucket.members) {
      const auto& member = layout.at(m);
      parts.push_back(chain(moved[static_cast<std::size_t>(p.op(m).op.operands[0])], member.into));
      width += member.piece_type.shape.back();
      why += " [" + p.op(m).collective->reason + "]";
    }
    const std::int64_t rows = by_rows ? out.type(parts.front()).shape[0] : 1;
    Op joined{OpKind::concatenate, parts, {}, {by_rows ? Shape{rows, width} : Shape{width}, dtype}, ""};
    joined.attrs.axis = by_rows ? 1 : 0;
    const ValueId all = add(std::move(joined));
    Collective c = *first.collective;
    c.reason = std::move(why);
    if (by_rows) c.dim = 0;
    TensorType collected = out.type(all);
    if (by_rows) collected.shape = {scatters ? 1 : layout.at(bucket.members.front()).piece_type.shape[0], width};
    const ValueId whole = add(Op{OpKind::input, {all}, {}, collected, ""}, std::move(c));
    std::int64_t at = 0;
    for (auto m : bucket.members) {
      const auto& member = layout.at(m);
      const std::int64_t n = member.piece_type.shape.back();
      Op slice{OpKind::slice, {whole}, {}, member.piece_type, ""};
      slice.attrs.lo = by_rows ? std::vector<std::int64_t>{0, at} : std::vector<std::int64_t>{at};
      slice.attrs.hi = by_rows ? std::vector<std::int64_t>{member.piece_type.shape[0], at + n} : std::vector<std::int64_t>{at + n};
      at += n;
      if (chain(add(std::move(slice)), member.back) != moved[static_cast<std::size_t>(m)])
        internal_error("bucket_collectives: the bucket of %" + std::to_string(m) + " is laid out differently than planned");
    }
  };
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!layout.contains(v) && !along[static_cast<std::size_t>(v)]) {
      SpmdOp s = p.op(v);
      for (auto& o : s.op.operands) o = moved[static_cast<std::size_t>(o)];
      out.add(std::move(s));
    }
    for (auto [it, end] = runs_after.equal_range(v); it != end; ++it) run_bucket(*it->second);
  }
  add_bindings(p, out, moved);
  return out;
}
#endif

}  // namespace partir
