// partition() speed on an N-layer MLP train step (Adam: forward, backward and optimizer update in one
// program) under BP then Megatron MP on a 2x2 mesh. Propagation is a worklist per axis, so the time should
// grow linearly with the number of ops (target: 48 layers in under 100 ms).
#include <partir/autodiff/train_step.hpp>
#include <partir/dsl/nn.hpp>
#include <partir/tactics/manual.hpp>
#include <partir/tactics/partition.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace p = partir;

int main() {
  const p::Mesh mesh{{"batch", 2}, {"model", 2}};
  std::printf("%8s %8s %12s %12s\n", "layers", "ops", "ms", "us/op");
  for (int layers : {12, 48, 96}) {
    std::vector<std::int64_t> sizes{64};
    for (int i = 0; i < layers; ++i) sizes.push_back(i % 2 ? 64 : 256);
    const p::nn::Mlp model{"params/mlp", sizes};
    const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                          p::Adam{}, {{"x", {32, 64}}, {"y", {32, 64}}});
    // Megatron: odd layers split by output features, even layers by input features.
    p::ManualPartition megatron{{}, "model", "megatron"};
    for (int i = 1; i <= layers; ++i) megatron.tiles.push_back({"params/mlp/w" + std::to_string(i), i % 2 ? 1 : 0});
    const p::Schedule schedule{p::ManualPartition{{{"x", 0}, {"y", 0}}, "batch", "bp"}, megatron};

    std::vector<double> ms;
    std::size_t conflicts = 0;
    for (int rep = 0; rep < 7; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const p::Partitioned plan = p::partition(step, mesh, schedule);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      conflicts = plan.conflicts().size();
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    std::printf("%8d %8lld %12.2f %12.3f%s\n", layers, static_cast<long long>(step.size()), median,
                1000.0 * median / static_cast<double>(step.size()), conflicts ? "  (conflicts!)" : "");
  }
}
