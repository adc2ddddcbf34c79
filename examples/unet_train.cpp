// Trains a small U-Net (the diffusion models' denoiser) to remove Gaussian noise from synthetic images: each
// step draws `batch` images of a few Gaussian blobs (random centres, widths and signs), adds noise of
// standard deviation --noise, and the loss is the mean squared error of the U-Net's output against the clean
// image (predicting the noisy image itself scores noise^2). The U-Net: an input block, `levels` down blocks
// (a stride-2 convolution, then one at stride 1, channels doubling), as many up blocks (upsampling by
// repetition, two convolutions, channels halving, plus the skip connection from the down path), and a 1x1
// output convolution. Every convolution is 3x3 'same' (nn::conv_layer) with a ReLU.
// Blocks name their kernels w1 and w2 (HWIO: output features last), so `mp` splits a block's channels as
// Megatron splits an MLP: the first convolution's output channels, the second's input channels, one
// all_reduce per block. `bp` splits the images; `sp` their rows over the axis 'space' (GSPMD's spatial
// partitioning: each convolution receives the rows its windows read from the neighbouring tiles, one
// collective_permute each way, and its kernel gradient is a partial sum); `z3` the kernels.
//   build/examples/unet_train
//   build/examples/unet_train --mesh batch=2,space=2 --schedule bp,sp
//   build/examples/unet_train --mesh batch=2,model=2 --schedule bp,mp,z3
//   mpirun -np 4 build/examples/unet_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp
#include <partir/partir.hpp>

#include <cmath>
#include <random>

#include "cli.hpp"
#include "plan_summary.hpp"
#include "training_loop.hpp"

namespace p = partir;

namespace {

struct UNet {
  std::int64_t channels, levels;

  // Two 3x3 convolutions with ReLUs, the first at `stride`: name/w1, b1 [3, 3, in, out], name/w2, b2.
  static p::Tensor block(const std::string& name, const p::Tensor& x, std::int64_t in, std::int64_t out, std::int64_t stride) {
    const p::Tensor h = p::relu(p::nn::conv_layer(x, name + "/w1", name + "/b1", {3, 3}, in, out, stride));
    return p::relu(p::nn::conv_layer(h, name + "/w2", name + "/b2", {3, 3}, out, out));
  }
  // Nearest-neighbour upsampling by 2: [N, H, W, C] -> [N, 2H, 2W, C].
  static p::Tensor upsample(const p::Tensor& x) {
    const std::int64_t N = x.dim(0), H = x.dim(1), W = x.dim(2), C = x.dim(3);
    return p::reshape(p::broadcast_in_dim(x, {N, H, 2, W, 2, C}, {0, 1, 3, 5}), {N, 2 * H, 2 * W, C});
  }

  // images [N, S, S, 1] -> [N, S, S, 1]
  p::Tensor operator()(const p::Tensor& images) const {
    std::vector<p::Tensor> skips{block("params/in", images, 1, channels, 1)};
    for (std::int64_t l = 1; l <= levels; ++l)
      skips.push_back(block("params/down/" + std::to_string(l), skips.back(), channels << (l - 1), channels << l, 2));
    p::Tensor x = skips.back();
    for (std::int64_t l = levels; l >= 1; --l)
      x = block("params/up/" + std::to_string(l), upsample(x), channels << l, channels << (l - 1), 1) +
          skips[static_cast<std::size_t>(l - 1)];
    return p::nn::conv_layer(x, "params/out/w", "params/out/b", {1, 1}, channels, 1);
  }
};

// Step `step`'s noisy and clean images, the same on every device.
p::NamedArrays images_at(std::int64_t batch, std::int64_t size, double noise, std::uint64_t seed, long step) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(step));
  std::uniform_real_distribution<double> unit(0, 1);
  std::normal_distribution<double> gauss(0, 1);
  const std::int64_t pixels = size * size;
  std::vector<float> clean(static_cast<std::size_t>(batch * pixels)), noisy(clean.size());
  for (std::int64_t n = 0; n < batch; ++n)
    for (int blob = 0; blob < 3; ++blob) {
      const double cy = unit(rng) * size, cx = unit(rng) * size, width = 1.5 + 2.5 * unit(rng);
      const double height = unit(rng) < 0.5 ? -1 : 1;
      for (std::int64_t y = 0; y < size; ++y)
        for (std::int64_t x = 0; x < size; ++x) {
          const double r2 = ((y - cy) * (y - cy) + (x - cx) * (x - cx)) / (width * width);
          clean[static_cast<std::size_t>(n * pixels + y * size + x)] += static_cast<float>(height * std::exp(-r2 / 2));
        }
    }
  for (std::size_t i = 0; i < clean.size(); ++i) noisy[i] = clean[i] + static_cast<float>(noise * gauss(rng));
  return {{"noisy", p::Array({batch, size, size, 1}, std::move(noisy))},
          {"clean", p::Array({batch, size, size, 1}, std::move(clean))}};
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Trains a U-Net to denoise synthetic images with partir.", "unet_train");
  long steps = 300, batch = 8, size = 16, channels = 16, levels = 2, seed = 0;
  double noise = 0.3;
  app.add_option("--steps", steps, "training steps")->check(cli::at_least(1));
  app.add_option("--batch", batch, "images per step (global)")->check(cli::at_least(1));
  app.add_option("--size", size, "image height and width (divisible by 2^levels)")->check(cli::at_least(1));
  app.add_option("--channels", channels, "channels of the first level (doubling per level down)")->check(cli::at_least(1));
  app.add_option("--levels", levels, "down (and up) blocks")->check(cli::at_least(1));
  app.add_option("--noise", noise, "standard deviation of the added noise")->check(cli::at_least(0));
  app.add_option("--seed", seed, "seed of parameters and images");
  examples::RunFlags run(app, "batch=2,model=2", "bp,mp",
                         "tactics in order: bp (the images), mp (channels), sp (image rows, on axis 'space'), z2, z3 "
                         "(comma-separated), or none",
                         "unet_train_report.json");
  const examples::RecipeFlags recipe_flags(app, 3e-3);
  const examples::LoopFlags loop(app);
  app.parse(argc, argv);
  const examples::Recipe recipe = recipe_flags.recipe(steps);

  try {
    if (size % (1L << levels) != 0)
      p::user_error("--size " + std::to_string(size) + ": not divisible by 2^" + std::to_string(levels) +
                    " (each of the " + std::to_string(levels) + " levels halves it)");
    const UNet model{channels, levels};
    const p::MixedPrecision precision = loop.mixed_precision();
    const p::Program step =
        recipe.train_step([&](p::Tensor noisy, p::Tensor clean) { return p::mse(model(noisy), clean); },
                          {{"noisy", {batch, size, size, 1}}, {"clean", {batch, size, size, 1}}}, precision);
    const p::Mesh mesh = p::Mesh::parse(run.mesh);
    const p::Partitioned plan = examples::partition_and_report(step, mesh, p::parse_schedule(run.schedule));
    const p::SpmdProgram spmd = p::lower(plan, loop.lower_options());
    if (examples::lead_process()) examples::print_plan_summary(std::cout, plan, spmd, run.schedule, "params/down/1/b1");
    auto next_batch = [&](long s) { return images_at(batch, size, noise, static_cast<std::uint64_t>(seed), s); };
    const examples::LoopOptions options = examples::loop_options("unet_train", run, loop, recipe, mesh, steps, seed, batch);
    examples::run_on_backend(run.backend, mesh.num_devices(), argc, argv,
                             [&](auto& c) { examples::train(p::Executable(spmd, c), next_batch, options); });
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
