#pragma once
// Gradient bucketing (PyTorch DDP's buckets and FSDP's flat reduce-scatter, XLA's all-reduce and reduce-scatter
// combiners): small all_reduces, and small reduce_scatters, over the same devices, dtype and pipeline stage are
// fused into one collective of their operands, concatenated in the order the operands become ready (the order
// backward produces gradients), up to a bucket size. Each collective costs a latency on every backend (one
// rendezvous, one MPI call, one NCCL launch); under data parallelism a model has one gradient all_reduce per
// parameter, under ZeRO one reduce_scatter per parameter, most of them small.
//
// An all_reduce bucket joins the flattened operands; a reduce_scatter bucket lays each operand out as
// [group size, rest] (the scattered dim moved first, so row p is the tile member p keeps), joins them along
// the rest and scatters rows: every member gets each operand's own tile, as it would alone.
//
// A bucket runs as soon as the last of its operands is ready (where DDP launches a bucket: when backward has
// produced all its gradients), so a collective joins a bucket only if that point comes before any member's
// result is used: buckets never delay a value an op waits for. Members are taken in the order their operands
// are ready. A bucket of one is left where it was. Sums are taken element by element as before, so results
// are unchanged up to the backend's summation order (on the threads backend, bitwise).
#include <algorithm>
#include <map>
#include <string>
#include <tuple>

#include "partir/config.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// The program with its small all_reduces and reduce_scatters fused into buckets of at most `bucket_bytes`
// operand bytes each (0: unchanged).
PARTIR_ENTRY SpmdProgram bucket_collectives(const SpmdProgram& p, std::int64_t bucket_bytes);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

struct Bucket {
  std::vector<ValueId> members;  // collectives of one kind, in the order their operands are ready
  std::int64_t bytes = 0;        // of the operands
  ValueId ready = -1;            // the last operand's instruction: the bucket runs right after it
  ValueId first_use = 0;         // the earliest use of any member's result
};

inline bool bucketable(const SpmdOp& s) {
  return s.collective &&
         (s.collective->kind == CollectiveKind::all_reduce || s.collective->kind == CollectiveKind::reduce_scatter);
}

// The buckets (of two or more members) that a program's all_reduces and reduce_scatters fall into.
inline std::vector<Bucket> plan_buckets(const SpmdProgram& p, std::int64_t bucket_bytes) {
  std::vector<ValueId> first_use(static_cast<std::size_t>(p.size()), p.size());  // outputs: at the end
  for (ValueId i = p.size() - 1; i >= 0; --i)
    for (auto v : p.op(i).op.operands) first_use[static_cast<std::size_t>(v)] = i;
  std::vector<std::pair<ValueId, ValueId>> candidates;  // (operand, collective)
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!bucketable(p.op(v))) continue;
    const ValueId operand = p.op(v).op.operands.at(0);
    if (p.type(operand).bytes() < bucket_bytes && !bucketable(p.op(operand))) candidates.emplace_back(operand, v);
  }
  std::sort(candidates.begin(), candidates.end());

  std::vector<Bucket> done;
  // by kind, group, dtype and pipeline stage
  std::map<std::tuple<CollectiveKind, AxisList, DType, int>, Bucket> open;
  auto close = [&](Bucket& b) {
    if (b.members.size() > 1) done.push_back(std::move(b));
    b = {};
  };
  for (const auto& [operand, v] : candidates) {
    const SpmdOp& s = p.op(v);
    const std::int64_t bytes = p.type(operand).bytes();
    const ValueId use = first_use[static_cast<std::size_t>(v)];
    Bucket& b = open[{s.collective->kind, s.collective->axes, s.op.type.dtype, s.stage}];
    if (!b.members.empty() && (b.bytes + bytes > bucket_bytes || std::max(b.ready, operand) >= std::min(b.first_use, use)))
      close(b);
    b.first_use = b.members.empty() ? use : std::min(b.first_use, use);
    b.ready = std::max(b.ready, operand);
    b.members.push_back(v);
    b.bytes += bytes;
  }
  for (auto& [key, b] : open) close(b);
  std::sort(done.begin(), done.end(), [](const Bucket& a, const Bucket& b) { return a.ready < b.ready; });
  return done;
}

// How a member enters and leaves its bucket: `into` brings its operand to the bucket's layout (each op reads
// the one before, the first the operand): flat for an all_reduce, [group size, rest] for a reduce_scatter;
// `piece` is its part of the bucket's result, of type piece_type, and `back` brings the piece to the member's
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
  const std::int64_t k = operand.shape[static_cast<std::size_t>(c.dim)] / result.shape[static_cast<std::size_t>(c.dim)];
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
  Shape front = result.shape;  // the result with its scattered dim first
  if (moves) {
    front = transpose(result, first).type.shape;
    b.into.push_back(transpose(operand, first));
  }
  const Shape rows{k, operand.elements() / k};
  if ((moves ? b.into.back().type.shape : operand.shape) != rows) b.into.push_back(reshape(rows));
  b.piece_type = {{1, result.elements()}, dtype};
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
    runs_after.emplace(b.ready, &b);
  }

  // Where each value lands, known before building: a recv names its send, which may come later.
  std::vector<ValueId> moved(static_cast<std::size_t>(p.size()), -1);
  for (ValueId v = 0, next = 0; v < p.size(); ++v) {
    if (!layout.contains(v)) moved[static_cast<std::size_t>(v)] = next++;
    for (auto [it, end] = runs_after.equal_range(v); it != end; ++it) {
      const auto& members = it->second->members;
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
    const bool scatters = first.collective->kind == CollectiveKind::reduce_scatter;
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
    const std::int64_t rows = scatters ? out.type(parts.front()).shape[0] : 1;
    Op joined{OpKind::concatenate, parts, {}, {scatters ? Shape{rows, width} : Shape{width}, dtype}, ""};
    joined.attrs.axis = scatters ? 1 : 0;
    const ValueId all = add(std::move(joined));
    Collective c = *first.collective;
    c.reason = std::move(why);
    if (scatters) c.dim = 0;
    TensorType reduced = out.type(all);
    if (scatters) reduced.shape = {1, width};
    const ValueId sum = add(Op{OpKind::input, {all}, {}, reduced, ""}, std::move(c));
    std::int64_t at = 0;
    for (auto m : bucket.members) {
      const auto& member = layout.at(m);
      const std::int64_t n = member.piece_type.shape.back();
      Op slice{OpKind::slice, {sum}, {}, member.piece_type, ""};
      slice.attrs.lo = scatters ? std::vector<std::int64_t>{0, at} : std::vector<std::int64_t>{at};
      slice.attrs.hi = scatters ? std::vector<std::int64_t>{1, at + n} : std::vector<std::int64_t>{at + n};
      at += n;
      if (chain(add(std::move(slice)), member.back) != moved[static_cast<std::size_t>(m)])
        internal_error("bucket_collectives: the bucket of %" + std::to_string(m) + " is laid out differently than planned");
    }
  };
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!layout.contains(v)) {
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
