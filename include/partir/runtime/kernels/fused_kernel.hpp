#pragma once
// Runs one fusion group (fusion.hpp) in a single pass: the output is cut into tiles that fit in L1, and each
// step of the group computes its tile into a small register buffer that the next steps read, so only the
// group's inputs are read from memory and only its root is written. Every step computes each element with
// the same fixed-size block code as the op's own kernel (kernels::blockwise), so fused results are bitwise
// equal to unfused ones (16-bit groups: see run_group) and independent of buffer addresses.
#include <span>

#include "partir/runtime/kernels/eval.hpp"
#include "partir/spmd/fusion.hpp"
#include "partir/runtime/kernels/kernels.hpp"

namespace partir {

namespace kernels {

// Fills buf[0, len) with the pattern input's elements i0 .. i0 + len - 1 (mod 0: the elements themselves),
// widened from 16 bits where S is a 16-bit type.
template <class S, class T>
void load_pattern(const FusedInput& in, const S* x, std::int64_t i0, std::int64_t len, T* buf) {
  auto copy = [](const S* from, std::int64_t n, T* to) { convert_elements(from, to, n); };
  if (in.mod == 0) {
    copy(x + i0, len, buf);
  } else if (in.mod == 1) {
    std::fill_n(buf, len, static_cast<T>(x[0]));
  } else if (in.div == 1) {  // a row repeated
    for (std::int64_t j = 0; j < len;) {
      const std::int64_t at = (i0 + j) % in.mod, run = std::min(in.mod - at, len - j);
      copy(x + at, run, buf + j);
      j += run;
    }
  } else {  // each element stretched over `div` consecutive outputs
    for (std::int64_t j = 0; j < len;) {
      const std::int64_t e = i0 + j, run = std::min(in.div - e % in.div, len - j);
      std::fill_n(buf + j, run, static_cast<T>(x[(e / in.div) % in.mod]));
      j += run;
    }
  }
}

// out[j] = step(args[j]...) for the blocks of a tile of `len` elements (len >= one block; the last block
// overlaps its neighbour when len is not a multiple of the block: same code, same values).
template <class T>
void run_step(const FusedStep& s, std::span<const T* const> a, std::int64_t len, T* out) {
  constexpr std::int64_t b = block_size<T>;
  using In = Eigen::Map<const Block<T>>;
  auto each = [&](auto f) {
    // In locals: stores through `out` could alias the span's pointers, which would reload them every block
    // (1.2-1.4x on 3-input chains here).
    const T* a0 = a[0];
    const T* a1 = a.size() > 1 ? a[1] : nullptr;
    const T* a2 = a.size() > 2 ? a[2] : nullptr;
    auto at = [&](std::int64_t j) {
      if constexpr (std::is_invocable_v<decltype(f), In>) Eigen::Map<Block<T>>(out + j) = f(In(a0 + j));
      else if constexpr (std::is_invocable_v<decltype(f), In, In>)
        Eigen::Map<Block<T>>(out + j) = f(In(a0 + j), In(a1 + j));
      else Eigen::Map<Block<T>>(out + j) = f(In(a0 + j), In(a1 + j), In(a2 + j));
    };
    for (std::int64_t j = 0; j + b <= len; j += b) at(j);
    if (len % b) at(len - b);
  };
  switch (s.kind) {
    case OpKind::neg: each([](const auto& x) { return -x; }); break;
    case OpKind::exp: each([](const auto& x) { return x.exp(); }); break;
    case OpKind::log: each([](const auto& x) { return x.log(); }); break;
    case OpKind::tanh: each([](const auto& x) { return x.tanh(); }); break;
    case OpKind::rsqrt: each([](const auto& x) { return x.rsqrt(); }); break;
    case OpKind::sqrt: each([](const auto& x) { return x.sqrt(); }); break;
    case OpKind::abs: each([](const auto& x) { return x.abs(); }); break;
    case OpKind::convert: each([](const auto& x) { return x; }); break;  // f32 to 16 bits: rounded where stored
    case OpKind::add: each([](const auto& x, const auto& y) { return x + y; }); break;
    case OpKind::sub: each([](const auto& x, const auto& y) { return x - y; }); break;
    case OpKind::mul: each([](const auto& x, const auto& y) { return x * y; }); break;
    case OpKind::div: each([](const auto& x, const auto& y) { return x / y; }); break;
    case OpKind::max: each([](const auto& x, const auto& y) { return x.max(y); }); break;
    case OpKind::min: each([](const auto& x, const auto& y) { return x.min(y); }); break;
    case OpKind::pow: each([](const auto& x, const auto& y) { return x.pow(y); }); break;
    case OpKind::compare:
      switch (s.cmp) {
        case CompareDir::eq: each([](const auto& x, const auto& y) { return (x == y).template cast<T>(); }); break;
        case CompareDir::ne: each([](const auto& x, const auto& y) { return (x != y).template cast<T>(); }); break;
        case CompareDir::lt: each([](const auto& x, const auto& y) { return (x < y).template cast<T>(); }); break;
        case CompareDir::le: each([](const auto& x, const auto& y) { return (x <= y).template cast<T>(); }); break;
        case CompareDir::gt: each([](const auto& x, const auto& y) { return (x > y).template cast<T>(); }); break;
        case CompareDir::ge: each([](const auto& x, const auto& y) { return (x >= y).template cast<T>(); }); break;
      }
      break;
    case OpKind::select:
      each([](const auto& m, const auto& x, const auto& y) { return (m != T(0)).select(x, y); });
      break;
    default: internal_error("fused kernel: " + std::string(name_of(s.kind)) + " is not elementwise");
  }
}

// S: the stored element type. 16-bit groups compute in f32 and round only what they store, the root: the
// steps between keep f32's precision (XLA's allow_excess_precision, Inductor's upcast; PyTorch's own fused
// GELU and layer norm kernels do the same). Rounding every step as the unfused ops do cost half of a large
// group's time.
// Side outputs (fusion.hpp) stay in their registers to the end of each tile and are stored from there, after
// every read of the tile's inputs (a side output may take an input's buffer). A 16-bit group rounds them in the
// register too, so the steps that read them see what is stored, as they did when another group stored it.
template <class S>
void run_group(const FusionGroup& g, std::span<const Array* const> inputs, Array& out, std::span<Array* const> sides) {
  constexpr bool half = is_half_type<S>;
  using T = std::conditional_t<half, float, S>;
  constexpr std::int64_t b = block_size<T>, tile = 32 * b;  // 2 KiB per register
  const std::int64_t n = out.size();
  if (n == 0) return;
  const std::int64_t width = std::max(n, b) < tile ? std::max(n, b) : tile;
  const std::size_t steps = g.steps.size(), ins = g.inputs.size();
  // Step s writes register slot[s]; a slot is free again after the last step that reads it, so a large group
  // keeps only the values still to be read in L1.
  std::vector<std::size_t> slot(steps), last_read(steps), free_slots;
  for (std::size_t s = 0; s < steps; ++s) {
    last_read[s] = s;
    for (int a : g.steps[s].args)
      if (a >= 0) last_read[static_cast<std::size_t>(a)] = s;
  }
  for (int k : g.side_outputs) last_read[static_cast<std::size_t>(k)] = steps;  // read by the store
  std::size_t slots = 0;
  for (std::size_t s = 0; s < steps; ++s) {
    if (free_slots.empty()) slot[s] = slots++;
    else slot[s] = free_slots.back(), free_slots.pop_back();
    for (int a : g.steps[s].args)  // freed after slot[s] is taken: a step never writes over its operands
      if (a >= 0 && last_read[static_cast<std::size_t>(a)] == s &&
          std::ranges::find(free_slots, slot[static_cast<std::size_t>(a)]) == free_slots.end())
        free_slots.push_back(slot[static_cast<std::size_t>(a)]);
  }
  const bool padded = n < b;  // one block with every input padded by its first element, as blockwise does
  // The whole inputs, which tiles stream from memory: each tile's are prefetched while the tile before it computes,
  // so that a long group (an optimizer's update) waits on memory or computes, not one after the other (Adam on
  // 4M f32 elements: 12.7 -> 9.5 ms on one core).
  std::vector<std::pair<const char*, std::size_t>> streams;  // {first byte, element size}
  for (std::size_t k = 0; k < ins; ++k)
    if (g.inputs[k].mod == 0)
      std::visit([&](const auto& v) { streams.emplace_back(reinterpret_cast<const char*>(v.data()), sizeof(v[0])); },
                 inputs[k]->storage());
  auto prefetch = [&](std::int64_t i0, std::int64_t len) {
    const auto first = static_cast<std::size_t>(i0), end = static_cast<std::size_t>(i0 + len);
    for (const auto& [base, size] : streams)
      for (std::size_t at = first * size; at < end * size; at += 64) __builtin_prefetch(base + at);
  };
  // Elements [lo, hi) (hi - lo >= one block), tile by tile, with buffers of its own.
  auto run_range = [&](std::int64_t lo, std::int64_t hi) {
    // Registers and load buffers on cache lines, as Arrays are (array.hpp): in cache, a step is ~20% faster so.
    const std::size_t w = static_cast<std::size_t>(width);
    Elements<T> space((slots + ins) * w);
    auto reg = [&](std::size_t s) { return space.data() + slot[s] * w; };
    auto buf = [&](std::size_t i) { return space.data() + (slots + i) * w; };
    std::vector<const T*> in(ins), args;
    // Input k's elements from i0 into its buffer, widened to T where they are 16-bit (a 16-bit group's inputs,
    // the operand of a widening convert into an f32 group); the f32 inputs of a group that narrows at its store
    // (fusion.hpp) are read as they are.
    auto load = [&](std::size_t k, const FusedInput& fi, std::int64_t i0, std::int64_t len) {
      if constexpr (std::is_same_v<T, float>) {
        switch (inputs[k]->dtype()) {
          case DType::bf16: return load_pattern(fi, ptr<bf16>(*inputs[k]), i0, len, buf(k));
          case DType::f16: return load_pattern(fi, ptr<f16>(*inputs[k]), i0, len, buf(k));
          default: return load_pattern(fi, ptr<float>(*inputs[k]), i0, len, buf(k));
        }
      }
      load_pattern(fi, ptr<S>(*inputs[k]), i0, len, buf(k));
    };
    auto run_tile = [&](std::int64_t i0, std::int64_t len) {
      for (std::size_t k = 0; k < ins; ++k) {
        const FusedInput& fi = g.inputs[k];
        const bool widens = inputs[k]->dtype() != Array::dtype_of<T>();
        if (padded) {
          load(k, fi.mod ? fi : FusedInput{fi.value, 1, n}, 0, n);
          std::fill(buf(k) + n, buf(k) + b, buf(k)[0]);
          in[k] = buf(k);
        } else if (fi.mod == 0 && widens) {
          load(k, fi, i0, len);
          in[k] = buf(k);
        } else if (fi.mod == 0) {
          in[k] = ptr<T>(*inputs[k]) + i0;
        } else if (fi.mod != 1 || i0 == lo) {  // a scalar is loaded once
          load(k, fi, i0, len);
          in[k] = buf(k);
        }
      }
      for (std::size_t s = 0; s < steps; ++s) {
        args.clear();
        for (int a : g.steps[s].args)
          args.push_back(a < 0 ? in[static_cast<std::size_t>(-1 - a)] : reg(static_cast<std::size_t>(a)));
        const bool root = s + 1 == steps;
        if constexpr (half) {
          run_step<T>(g.steps[s], args, len, reg(s));
          if (std::ranges::binary_search(g.side_outputs, static_cast<int>(s)))
            for (T* r = reg(s), *end = r + len; r != end; ++r) *r = static_cast<T>(S(*r));
          if (root) convert_elements(reg(s), ptr<S>(out) + (padded ? 0 : i0), padded ? n : len);
        } else {
          run_step<T>(g.steps[s], args, len, root && !padded ? ptr<T>(out) + i0 : reg(s));
        }
      }
      if constexpr (!half)
        if (padded) std::copy_n(reg(steps - 1), n, ptr<T>(out));
      for (std::size_t k = 0; k < sides.size(); ++k)
        convert_elements(reg(static_cast<std::size_t>(g.side_outputs[k])), ptr<S>(*sides[k]) + (padded ? 0 : i0),
                         padded ? n : len);
    };
    if (padded) return run_tile(0, b);
    for (std::int64_t i0 = lo; i0 < hi; i0 += width) {
      // A short last tile (under one block) is taken together with the end of the one before it.
      const std::int64_t len = std::min(width, hi - i0);
      if (i0 + width < hi) prefetch(i0 + width, std::min(width, hi - i0 - width));
      if (len < b) run_tile(hi - b, b);
      else run_tile(i0, len);
    }
  };
  // Large groups run as ranges of whole tiles on the kernel threads: every element is computed by the same
  // code whatever the split, so results do not depend on it.
  split_over_kernel_threads(n, width, run_range);
}

}  // namespace kernels

PARTIR_ENTRY void eval_fused_into(const FusionGroup& g, std::span<const Array* const> inputs, Array& out,
                                  std::span<Array* const> side_outputs) {
  if (side_outputs.size() != g.side_outputs.size())
    internal_error("fused kernel: " + std::to_string(side_outputs.size()) + " buffers for " +
                   std::to_string(g.side_outputs.size()) + " side outputs");
  switch (g.type.dtype) {
    case DType::bf16: kernels::run_group<bf16>(g, inputs, out, side_outputs); break;
    case DType::f16: kernels::run_group<f16>(g, inputs, out, side_outputs); break;
    default:
      kernels::visit_float_dtype(g.type.dtype, g.steps.back().kind,
                                 [&](auto t) { kernels::run_group<decltype(t)>(g, inputs, out, side_outputs); });
  }
}

PARTIR_ENTRY Array eval_fused(const FusionGroup& g, std::span<const Array* const> inputs) {
  Array out = kernels::buffer_cache().take(g.type);
  eval_fused_into(g, inputs, out, {});
  return out;
}

}  // namespace partir
