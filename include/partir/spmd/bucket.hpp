#pragma once
// Gradient bucketing (PyTorch DDP's buckets, XLA's all-reduce combiner): small all_reduces over the same
// devices, dtype and pipeline stage are fused into one all_reduce of their flattened operands, concatenated in
// the order their operands become ready (the order backward produces gradients), up to a bucket size. Each
// collective costs a latency on every backend (one rendezvous, one MPI call, one NCCL launch); under data
// parallelism a model has one gradient all_reduce per parameter, most of them small.
//
// A bucket runs as soon as the last of its operands is ready (where DDP launches a bucket: when backward has
// produced all its gradients), so an all_reduce joins a bucket only if that point comes before any member's
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

// The program with its small all_reduces fused into buckets of at most `bucket_bytes` (0: unchanged).
PARTIR_ENTRY SpmdProgram bucket_all_reduces(const SpmdProgram& p, std::int64_t bucket_bytes);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

struct Bucket {
  std::vector<ValueId> members;  // all_reduces, in the order their operands are ready
  std::int64_t bytes = 0;
  ValueId ready = -1;            // the last operand's instruction: the bucket runs right after it
  ValueId first_use = 0;         // the earliest use of any member's result
};

// The buckets (of two or more members) that a program's all_reduces fall into.
inline std::vector<Bucket> plan_buckets(const SpmdProgram& p, std::int64_t bucket_bytes) {
  std::vector<ValueId> first_use(static_cast<std::size_t>(p.size()), p.size());  // outputs: at the end
  for (ValueId i = p.size() - 1; i >= 0; --i)
    for (auto v : p.op(i).op.operands) first_use[static_cast<std::size_t>(v)] = i;
  auto is_all_reduce = [&](ValueId v) {
    return p.op(v).collective && p.op(v).collective->kind == CollectiveKind::all_reduce;
  };
  std::vector<std::pair<ValueId, ValueId>> candidates;  // (operand, all_reduce)
  for (ValueId v = 0; v < p.size(); ++v)
    if (is_all_reduce(v) && p.type(v).bytes() < bucket_bytes && !is_all_reduce(p.op(v).op.operands.at(0)))
      candidates.emplace_back(p.op(v).op.operands[0], v);
  std::sort(candidates.begin(), candidates.end());

  std::vector<Bucket> done;
  std::map<std::tuple<AxisList, DType, int>, Bucket> open;  // by group, dtype and pipeline stage
  auto close = [&](Bucket& b) {
    if (b.members.size() > 1) done.push_back(std::move(b));
    b = {};
  };
  for (const auto& [operand, v] : candidates) {
    const SpmdOp& s = p.op(v);
    const std::int64_t bytes = s.op.type.bytes();
    const ValueId use = first_use[static_cast<std::size_t>(v)];
    Bucket& b = open[{s.collective->axes, s.op.type.dtype, s.stage}];
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

}  // namespace detail

PARTIR_ENTRY SpmdProgram bucket_all_reduces(const SpmdProgram& p, std::int64_t bucket_bytes) {
  if (bucket_bytes < 0)
    user_error("bucket_all_reduces: bucket size " + std::to_string(bucket_bytes) + " bytes is negative (0 turns bucketing off)");
  if (bucket_bytes == 0) return p;
  const auto buckets = detail::plan_buckets(p, bucket_bytes);
  if (buckets.empty()) return p;
  std::vector<bool> bucketed(static_cast<std::size_t>(p.size()), false);
  std::multimap<ValueId, const detail::Bucket*> runs_after;  // buckets by the instruction they follow
  for (const auto& b : buckets) {
    for (auto v : b.members) bucketed[static_cast<std::size_t>(v)] = true;
    runs_after.emplace(b.ready, &b);
  }

  auto already_flat = [&](ValueId m) { return p.type(m).rank() == 1; };
  // Where each value lands, known before building: a recv names its send, which may come later.
  std::vector<ValueId> moved(static_cast<std::size_t>(p.size()), -1);
  for (ValueId v = 0, next = 0; v < p.size(); ++v) {
    if (!bucketed[static_cast<std::size_t>(v)]) moved[static_cast<std::size_t>(v)] = next++;
    for (auto [it, end] = runs_after.equal_range(v); it != end; ++it) {
      const auto& members = it->second->members;
      for (auto m : members) next += already_flat(m) ? 0 : 1;
      next += 2;  // join, reduce
      for (auto m : members) moved[static_cast<std::size_t>(m)] = (next += already_flat(m) ? 1 : 2) - 1;  // slice[, reshape]
    }
  }

  SpmdProgram out(p.name(), p.mesh());
  if (p.pipeline()) out.set_pipeline(*p.pipeline());
  // Flattens and joins the operands, reduces once, and cuts the sum back into the members' results.
  auto run_bucket = [&](const detail::Bucket& bucket) {
    const SpmdOp& first = p.op(bucket.members.front());
    const DType dtype = first.op.type.dtype;
    auto add = [&](Op op, std::optional<Collective> c = std::nullopt) {
      return out.add({std::move(op), std::move(c), {}, first.stage});
    };
    std::vector<ValueId> flat;
    std::string why = "bucket of " + std::to_string(bucket.members.size()) + " all_reduces, " +
                      std::to_string(bucket.bytes) + " bytes (bucket size " + std::to_string(bucket_bytes) + "):";
    for (auto m : bucket.members) {
      const ValueId operand = moved[static_cast<std::size_t>(p.op(m).op.operands[0])];
      Op flatten{OpKind::reshape, {operand}, {}, {{p.type(m).elements()}, dtype}, ""};
      flatten.attrs.shape = flatten.type.shape;
      flat.push_back(already_flat(m) ? operand : add(std::move(flatten)));
      why += " [" + p.op(m).collective->reason + "]";
    }
    Op joined{OpKind::concatenate, flat, {}, {{bucket.bytes / size_of(dtype)}, dtype}, ""};
    joined.attrs.axis = 0;
    const ValueId all = add(std::move(joined));
    Collective c = *first.collective;
    c.reason = std::move(why);
    const ValueId sum = add(Op{OpKind::input, {all}, {}, out.type(all), ""}, std::move(c));
    std::int64_t at = 0;
    for (auto m : bucket.members) {
      const TensorType& t = p.type(m);
      Op slice{OpKind::slice, {sum}, {}, {{t.elements()}, dtype}, ""};
      slice.attrs.lo = {at};
      slice.attrs.hi = {at += t.elements()};
      const ValueId piece = add(std::move(slice));
      Op unflatten{OpKind::reshape, {piece}, {}, t, ""};
      unflatten.attrs.shape = t.shape;
      if ((already_flat(m) ? piece : add(std::move(unflatten))) != moved[static_cast<std::size_t>(m)])
        internal_error("bucket_all_reduces: the bucket of %" + std::to_string(m) + " is laid out differently than planned");
    }
  };
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!bucketed[static_cast<std::size_t>(v)]) {
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
