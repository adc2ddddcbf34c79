#pragma once
// Checks every collective of a Communicator against values computed locally, on a 2x2 device grid
// (groups: rows, columns, all). Shared by the threads test and the mpirun test so both backends are held
// to the same expectations. Returns the number of wrong elements.
#include <partir/runtime/comm/communicator.hpp>

#include <cstdint>
#include <vector>

namespace collective_checks {

// Device d's contribution, element i: distinct per device and element, exact in float.
inline float value(int device, std::int64_t i) { return static_cast<float>(device * 1000 + i % 997); }

template <class C>
long check_all(C& c) {
  using partir::DType;
  using partir::Group;
  const int me = c.device();
  const int row = me / 2, col = me % 2;
  const std::vector<Group> groups = {Group{{row * 2, row * 2 + 1}}, Group{{col, col + 2}}, Group{{0, 1, 2, 3}}};
  long wrong = 0;
  for (std::int64_t n : {1, 7, 1000, 100000}) {
    for (const Group& g : groups) {
      const int k = g.size();
      std::vector<float> mine(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) mine[i] = value(me, i);

      std::vector<float> reduced = mine;
      c.all_reduce(g, reduced.data(), n, DType::f32);
      for (std::int64_t i = 0; i < n; ++i) {
        float expect = 0;
        for (int d : g.devices) expect += value(d, i);
        wrong += reduced[i] != expect;
      }

      std::vector<float> gathered(static_cast<std::size_t>(n * k));
      c.all_gather(g, mine.data(), gathered.data(), n, DType::f32);
      for (int b = 0; b < k; ++b)
        for (std::int64_t i = 0; i < n; ++i) wrong += gathered[b * n + i] != value(g.devices[b], i);

      // reduce_scatter and all_to_all: device d's block b holds value(d, b * n + i)
      std::vector<float> blocks(static_cast<std::size_t>(n * k)), out(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n * k; ++i) blocks[i] = value(me, i);
      c.reduce_scatter(g, blocks.data(), out.data(), n, DType::f32);
      const int pos = g.index_of(me);
      for (std::int64_t i = 0; i < n; ++i) {
        float expect = 0;
        for (int d : g.devices) expect += value(d, pos * n + i);
        wrong += out[i] != expect;
      }

      std::vector<float> exchanged(static_cast<std::size_t>(n * k));
      c.all_to_all(g, blocks.data(), exchanged.data(), n, DType::f32);
      for (int b = 0; b < k; ++b)
        for (std::int64_t i = 0; i < n; ++i) wrong += exchanged[b * n + i] != value(g.devices[b], pos * n + i);

      // collective_permute one member along (a halo exchange): the ends keep what `out` held
      for (int shift : {1, -1}) {
        const int to = pos + shift, from = pos - shift;
        std::vector<float> received(static_cast<std::size_t>(n), -1.0f);
        c.collective_permute(g, to >= 0 && to < k ? to : -1, mine.data(), from >= 0 && from < k ? from : -1,
                             received.data(), n, DType::f32);
        for (std::int64_t i = 0; i < n; ++i)
          wrong += received[i] != (from >= 0 && from < k ? value(g.devices[from], i) : -1.0f);
      }
    }
  }
  // reduce_scatter of the other dtypes, large enough for the mpi backend's ring and spanning segments.
  const Group all{{0, 1, 2, 3}};
  const std::int64_t n = 70000;
  std::vector<double> f64_blocks(static_cast<std::size_t>(4 * n)), f64_out(static_cast<std::size_t>(n));
  std::vector<std::int32_t> i32_blocks(f64_blocks.size()), i32_out(f64_out.size());
  for (std::int64_t i = 0; i < 4 * n; ++i) {
    f64_blocks[i] = 0.5 * value(me, i);
    i32_blocks[i] = static_cast<std::int32_t>(value(me, i)) - 2000;
  }
  c.reduce_scatter(all, f64_blocks.data(), f64_out.data(), n, DType::f64);
  c.reduce_scatter(all, i32_blocks.data(), i32_out.data(), n, DType::i32);
  // all_reduce of the same, large enough for the mpi backend's ring, on an odd count (the ring's blocks differ
  // in size) over all devices and over pairs.
  const std::int64_t odd = n + 1;
  for (const Group& g : {all, groups[0]}) {
    std::vector<double> f64_sum(static_cast<std::size_t>(odd));
    std::vector<std::int32_t> i32_sum(f64_sum.size());
    for (std::int64_t i = 0; i < odd; ++i) f64_sum[i] = f64_blocks[i], i32_sum[i] = i32_blocks[i];
    c.all_reduce(g, f64_sum.data(), odd, DType::f64);
    c.all_reduce(g, i32_sum.data(), odd, DType::i32);
    for (std::int64_t i = 0; i < odd; ++i) {
      double f64_expect = 0;
      std::int32_t i32_expect = 0;
      for (int d : g.devices) {
        f64_expect += 0.5 * value(d, i);
        i32_expect += static_cast<std::int32_t>(value(d, i)) - 2000;
      }
      wrong += f64_sum[i] != f64_expect;
      wrong += i32_sum[i] != i32_expect;
    }
  }
  for (std::int64_t i = 0; i < n; ++i) {
    double f64_expect = 0;
    std::int32_t i32_expect = 0;
    for (int d = 0; d < 4; ++d) {
      f64_expect += 0.5 * value(d, me * n + i);
      i32_expect += static_cast<std::int32_t>(value(d, me * n + i)) - 2000;
    }
    wrong += f64_out[i] != f64_expect;
    wrong += i32_out[i] != i32_expect;
  }

  // 16-bit floats: sums in f32, rounded once; these values and their sums are exact in bf16 and f16.
  auto small = [](int device, std::int64_t i) { return 0.5f * static_cast<float>(device + 1) + 0.25f * static_cast<float>(i % 7); };
  for (DType t : {DType::bf16, DType::f16}) {
    auto check_half = [&](auto zero) {
      using H = decltype(zero);
      std::vector<H> blocks(static_cast<std::size_t>(4 * n)), out(static_cast<std::size_t>(n)), gathered(blocks.size());
      for (std::int64_t i = 0; i < 4 * n; ++i) blocks[i] = H(small(me, i));
      c.reduce_scatter(all, blocks.data(), out.data(), n, t);
      for (std::int64_t i = 0; i < n; ++i) {
        float expect = 0;
        for (int d = 0; d < 4; ++d) expect += small(d, me * n + i);
        wrong += static_cast<float>(out[i]) != expect;
      }
      c.all_reduce(all, blocks.data(), n, t);
      for (std::int64_t i = 0; i < n; ++i) {
        float expect = 0;
        for (int d = 0; d < 4; ++d) expect += small(d, i);
        wrong += static_cast<float>(blocks[i]) != expect;
      }
      const Group pair = groups[0];  // the mpi backend's ring reduce_scatter runs for pairs
      for (std::int64_t i = 0; i < 2 * n; ++i) blocks[i] = H(small(me, i));
      c.reduce_scatter(pair, blocks.data(), out.data(), n, t);
      for (std::int64_t i = 0; i < n; ++i) {
        float expect = 0;
        for (int d : pair.devices) expect += small(d, pair.index_of(me) * n + i);
        wrong += static_cast<float>(out[i]) != expect;
      }
      for (std::int64_t i = 0; i < n; ++i) out[i] = H(small(me, i));
      c.all_gather(all, out.data(), gathered.data(), n, t);
      for (int d = 0; d < 4; ++d)
        for (std::int64_t i = 0; i < n; ++i) wrong += static_cast<float>(gathered[d * n + i]) != small(d, i);
    };
    if (t == DType::bf16) check_half(partir::bf16{});
    else check_half(partir::f16{});
  }

  std::vector<double> d64 = {1.5 * me};
  c.all_reduce(Group{{0, 1, 2, 3}}, d64.data(), 1, DType::f64);
  wrong += d64[0] != 1.5 * 6;
  c.barrier();
  return wrong;
}

}  // namespace collective_checks
