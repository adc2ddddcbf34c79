#pragma once
// The training program of gpt_train, moe_train and llama_train: a byte-level GPT (nn::Gpt: token + position
// embedding, pre-LayerNorm attention and GELU MLP blocks, or mixtures of experts with --experts, tied output
// projection) or Llama (nn::Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) on
// examples/data/corpus.txt. The train step (forward, backward, Adam) is one partir Program; the schedule
// partitions it over the mesh, and the same SPMD program runs on N threads of this process or on N MPI ranks.
// --sample N then generates N bytes greedily (or at --temperature) with a forward-only program.
#include <partir/partir.hpp>

#include "cli.hpp"
#include "gpt_common.hpp"
#include "plan_summary.hpp"
#include "training_loop.hpp"

namespace gpt {

namespace p = partir;

// What gpt_train, moe_train and llama_train differ in: their description, name, model and defaults.
struct TrainDefaults {
  std::string description, name, mesh = "batch=1", schedule = "none";
  long experts = 0;
  bool llama = false;
};

inline int train_main(int argc, char** argv, const TrainDefaults& defaults) {
  cli::App app(defaults.description, defaults.name);
  long steps = 300, batch = 16, seq = 64, layers = 2, dmodel = 64, heads = 4, tied = 1, seed = 0, sample = 0;
  long experts = defaults.experts, top_k = 1;
  double capacity_factor = 1.25, aux_loss_weight = 0.01;
  long eval_every = 0, eval_batches = 4;
  double temperature = 0, holdout = 0.1;
  long kv_heads = 2, ffn = 0;
  double rope_theta = 10000;
  std::string corpus_path = PARTIR_GPT_CORPUS, predict, predict_out = "predict.safetensors";
  app.add_option("--steps", steps, "training steps")->check(cli::at_least(1));
  app.add_option("--batch", batch, "sequences per step (global)")->check(cli::at_least(1));
  app.add_option("--seq", seq, "context length in bytes")->check(cli::at_least(1));
  app.add_option("--layers", layers, "transformer blocks")->check(cli::at_least(1));
  app.add_option("--dmodel", dmodel, "model width")->check(cli::at_least(1));
  app.add_option("--heads", heads, "attention heads")->check(cli::at_least(1));
  if (defaults.llama) {
    tied = 0;
    app.add_option("--kv-heads", kv_heads, "K/V heads of grouped-query attention (dividing --heads)")->check(cli::at_least(1));
    app.add_option("--ffn", ffn, "SwiGLU's hidden width (0: 8/3 dmodel rounded up to 32)")->check(cli::at_least(0));
    app.add_option("--rope-theta", rope_theta, "base of the rotary embedding's frequencies")->check(CLI::PositiveNumber);
  }
  app.add_option("--tied", tied, "1: output projection is the token table; 0: its own weights")->check(CLI::Range(0, 1));
  app.add_option("--seed", seed, "seed of parameters, batches and sampling");
  app.add_option("--corpus", corpus_path, "training text");
  if (!defaults.llama) {
    app.add_option("--experts", experts, "experts per MLP (a mixture of experts, dsl/moe.hpp; 0: a dense MLP)")
        ->check(cli::at_least(0));
    app.add_option("--top-k", top_k, "experts per token")->check(CLI::Range(1, 2));
    app.add_option("--capacity-factor", capacity_factor, "expert slots per group: factor * top-k * seq / experts")
        ->check(CLI::PositiveNumber);
    app.add_option("--aux-loss-weight", aux_loss_weight, "weight of the experts' load-balancing loss")->check(cli::at_least(0));
  }
  examples::RunFlags run(app, defaults.mesh, defaults.schedule,
                         "tactics in order: bp, mp, z2, z3, emb, ep (experts on axis expert), pp (1F1B on axis stage), "
                         "pp:gpipe, pp:interleaved:<v>, pp:zb1, pp:zbv, auto:model (comma-separated)",
                         defaults.name + "_report.json");
  app.add_option("--sample", sample, "bytes to generate after training")->check(cli::at_least(0));
  app.add_option("--temperature", temperature, "sampling temperature; 0 picks the likeliest byte")->check(cli::at_least(0));
  app.add_option("--predict", predict, "after training, the logits and loss of the batch in this .safetensors file "
                                       "(i32 tokens and targets [batch, seq]), on one device")
      ->check(CLI::ExistingFile);
  app.add_option("--predict-out", predict_out, "where --predict writes logits [batch, seq, vocab] (in the --precision "
                                               "compute dtype), loss (f32) and each parameter's gradient (grad.<name>)");
  const examples::RecipeFlags recipe_flags(app, 3e-3);
  app.add_option("--holdout", holdout, "fraction of the corpus held out for validation (0: none)");
  app.add_option("--eval-every", eval_every, "a validation loss every N steps (0: steps/5) and after the last")
      ->check(cli::at_least(0));
  app.add_option("--eval-batches", eval_batches, "held-out batches per validation")->check(cli::at_least(1));
  const examples::LoopFlags loop(app);
  app.parse(argc, argv);
  const examples::Recipe recipe = recipe_flags.recipe(steps);

  try {
    const p::MixedPrecision precision = loop.mixed_precision();
    // The rest reads the model through its config's vocab and seq, and logits() and loss(): either model.
    auto train_model = [&](const auto& model) {
      const std::string text = gpt::load_corpus(corpus_path, seq);
      const auto [train_text, held_out] = gpt::split_corpus(text, holdout, seq);
      const p::Program step = gpt::train_program(model, batch, recipe, precision);
      const p::Mesh mesh = p::Mesh::parse(run.mesh);
      const p::Partitioned plan = examples::partition_and_report(step, mesh, p::parse_schedule(run.schedule));
      const p::SpmdProgram spmd = p::lower(plan, loop.lower_options());
      if (experts > 0 && examples::lead_process())  // where the experts went, and the all_to_alls that reach them
        examples::print_plan_summary(std::cout, plan, spmd, run.schedule, "params/layers/0/moe/experts/b1");
      // Validation: the loss alone, partitioned by the same schedule (ZeRO-2 shards only optimizer state, which
      // the forward pass does not read).
      const p::Program eval = gpt::eval_program(model, batch, precision);
      const p::SpmdProgram eval_spmd = p::lower(p::partition(eval, mesh, p::parse_schedule(examples::without_tactic(run.schedule, "z2"))), loop.lower_options());
      examples::LoopOptions options = examples::loop_options(defaults.name, run, loop, recipe, mesh, steps, seed, batch * seq);
      options.validate_every = eval_every > 0 ? eval_every : std::max(1L, steps / 5);
      auto next_batch = [&](long s) { return gpt::batch_at(train_text, batch, seq, static_cast<std::uint64_t>(seed), s); };

      auto train = [&]<p::Communicator C>(C& comm) {
        const p::Executable exe(spmd, comm);
        const p::Executable evaluator(eval_spmd, comm);
        examples::LoopOptions o = options;
        if (holdout > 0)  // the mean loss of the same held-out batches each time
          o.validate = [&](const p::NamedArrays& state) {
            p::NamedArrays params = examples::state_for(evaluator, exe, state);
            double total = 0;
            for (long b = 1; b <= eval_batches; ++b)
              total += evaluator.step(params, gpt::batch_at(held_out, batch, seq, static_cast<std::uint64_t>(seed), -b))
                           .outputs.at("loss").at(0);
            return total / static_cast<double>(eval_batches);
          };
        const examples::Trained trained = examples::train(exe, next_batch, o);
        if (sample <= 0 && predict.empty()) return;
        p::NamedArrays state = exe.gather_state(trained.state);
        if (comm.device() != 0) return;
        if (!predict.empty()) gpt::write_predictions(model, state, predict, predict_out, precision);
        if (sample <= 0) return;
        // Continue the corpus's first window, one byte at a time, on this device, with the trained parameters.
        const p::Program next = gpt::next_token_program(model, 1);
        std::erase_if(state, [&](const auto& kv) { return !next.find_input(kv.first); });
        std::vector<std::int32_t> window(static_cast<std::size_t>(seq)), generated;
        gpt::window(text, 0, seq, window.data());
        std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
        for (long i = 0; i < sample; ++i) {
          state["tokens"] = p::Array({1, seq}, window);
          const auto b = gpt::pick(p::interpret(next, state).at("logits"), 0, temperature, rng);
          generated.push_back(b);
          window.erase(window.begin());
          window.push_back(b);
        }
        std::cout << "prompt: " << text.substr(0, static_cast<std::size_t>(seq)) << "\nsample: "
                  << gpt::printable(generated) << std::endl;
      };

      examples::run_on_backend(run.backend, mesh.num_devices(), argc, argv, train);
    };
    if (defaults.llama)
      train_model(p::nn::Llama{{.vocab = 256, .seq = seq, .d_model = dmodel, .layers = layers, .heads = heads,
                                .kv_heads = kv_heads, .ffn = ffn, .rope_theta = rope_theta, .tie_embeddings = tied != 0}});
    else
      train_model(p::nn::Gpt{{.vocab = 256, .seq = seq, .d_model = dmodel, .heads = heads, .layers = layers,
                              .tied = tied != 0, .experts = experts, .top_k = static_cast<int>(top_k),
                              .capacity_factor = capacity_factor, .aux_loss_weight = aux_loss_weight}});
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace gpt
