// MLP train step (batch 256, 1024 -> 4096 -> 1024, ReLU, MSE, SGD, f32) through partir's interpreter vs the
// same step written by hand with Eigen matrix products, in one run; prints the ratio (target >= 0.9x).
// Both run on one thread (Eigen without OpenMP).
#include <partir/partir.hpp>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

namespace p = partir;
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Row = Eigen::Matrix<float, 1, Eigen::Dynamic>;

namespace {

double median_ms(int reps, const std::function<void()>& fn) {
  fn();  // warm-up: first-touch of buffers
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct HandWritten {
  Matrix w1, w2;
  Row b1, b2;
  float lr;
  float step(const Matrix& x, const Matrix& y) {
    const float n = static_cast<float>(y.size());
    Matrix h = x * w1;
    h.rowwise() += b1;
    Matrix a = h.cwiseMax(0.f);
    Matrix out = a * w2;
    out.rowwise() += b2;
    Matrix d = out - y;
    const float loss = d.squaredNorm() / n;
    Matrix dout = (2.f / n) * d;
    Matrix dw2 = a.transpose() * dout;
    Row db2 = dout.colwise().sum();
    Matrix da = dout * w2.transpose();
    Matrix dh = (h.array() > 0.f).select(da, 0.f);
    Matrix dw1 = x.transpose() * dh;
    Row db1 = dh.colwise().sum();
    w1 -= lr * dw1;
    b1 -= lr * db1;
    w2 -= lr * dw2;
    b2 -= lr * db2;
    return loss;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  const long batch = 256, in = 1024, hidden = 4096;
  const float lr = 1e-2f;
  p::nn::Mlp model{"params/mlp", {in, hidden, in}};
  p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); }, p::SGD{lr},
                                  {{"x", {batch, in}}, {"y", {batch, in}}});
  p::NamedArrays state = p::init_inputs(step, 0);
  Matrix x = Matrix::Random(batch, in), y = Matrix::Random(batch, in);
  state["x"] = p::Array({batch, in}, std::vector<float>(x.data(), x.data() + x.size()));
  state["y"] = p::Array({batch, in}, std::vector<float>(y.data(), y.data() + y.size()));

  auto as_matrix = [&](const std::string& name, long r, long c) {
    auto d = state.at(name).data<float>();
    return Matrix(Eigen::Map<const Matrix>(d.data(), r, c));
  };
  HandWritten hand{as_matrix("params/mlp/w1", in, hidden), as_matrix("params/mlp/w2", hidden, in),
                   as_matrix("params/mlp/b1", 1, hidden), as_matrix("params/mlp/b2", 1, in), lr};

  float partir_loss = 0, hand_loss = 0;
  p::RunStats stats;
  double partir_ms = median_ms(reps, [&] {
    p::NamedArrays out = p::interpret(step, state, &stats);
    partir_loss = static_cast<float>(out.at("loss").at(0));
    p::carry_state(step, state, std::move(out));
  });
  double hand_ms = median_ms(reps, [&] { hand_loss = hand.step(x, y); });
  const double flops = 6.0 * batch * in * hidden * 2;  // 3 GEMMs per layer, 2 layers
  std::printf("# MLP train step: batch %ld, %ld-%ld-%ld, ReLU, MSE, SGD, f32, median of %d\n", batch, in, hidden, in,
              reps);
  std::printf("%-22s %10s %10s %12s\n", "variant", "ms", "GFLOP/s", "loss");
  std::printf("%-22s %10.2f %10.1f %12.6f\n", "partir interpret", partir_ms, flops / partir_ms / 1e6, partir_loss);
  std::printf("%-22s %10.2f %10.1f %12.6f\n", "hand-written Eigen", hand_ms, flops / hand_ms / 1e6, hand_loss);
  std::printf("partir speed vs hand-written: %.3fx (target >= 0.9x)\n", hand_ms / partir_ms);
  std::printf("partir peak memory: %.1f MiB\n", static_cast<double>(stats.peak_bytes) / (1 << 20));
}
