// Trains a byte-level GPT (nn::Gpt: token + position embedding, pre-LayerNorm attention and GELU MLP blocks,
// tied output projection) on examples/data/corpus.txt. The train step (forward, backward, Adam) is one partir
// Program; the schedule partitions it over the mesh, and the same SPMD program runs on N threads of this
// process or on N MPI ranks. --sample N then generates N bytes greedily (or at --temperature) with a
// forward-only program.
//   build/examples/gpt_train --steps 300 --sample 200
//   build/examples/gpt_train --mesh batch=2,model=2 --schedule bp,mp,z3,emb
//   mpirun -np 4 build/examples/gpt_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp,z3
#include <partir/partir.hpp>

#include "cli.hpp"
#include "gpt_common.hpp"
#include "training_loop.hpp"

namespace p = partir;

int main(int argc, char** argv) {
  cli::Args args(argc, argv, "usage: gpt_train [flags]\nTrains a byte-level GPT on a text file with partir.");
  const long steps = args.get_int("steps", 300, "training steps");
  const long batch = args.get_int("batch", 16, "sequences per step (global)");
  const long seq = args.get_int("seq", 64, "context length in bytes");
  const long layers = args.get_int("layers", 2, "transformer blocks");
  const long dmodel = args.get_int("dmodel", 64, "model width");
  const long heads = args.get_int("heads", 4, "attention heads");
  const long tied = args.get_int("tied", 1, "1: output projection is the token table; 0: its own weights");
  const long seed = args.get_int("seed", 0, "seed of parameters, batches and sampling");
  const std::string corpus_path = args.get("corpus", PARTIR_GPT_CORPUS, "training text");
  const std::string mesh_text = args.get("mesh", "batch=1", "device mesh, axes major to minor");
  const std::string schedule_text =
      args.get("schedule", "none", "tactics in order: bp, mp, z2, z3, emb, pp (1F1B on axis stage), pp:gpipe, auto:model (comma-separated)");
  const std::string backend = args.get("backend", "threads", "threads (one process), mpi (under mpirun) or nccl (one GPU per device)");
  const std::string report = args.get("report", "", "'json' writes a JSON report of the run");
  const std::string report_file = args.get("report-file", "gpt_train_report.json", "where --report json writes");
  const long sample = args.get_int("sample", 0, "bytes to generate after training");
  const double temperature = args.get_double("temperature", 0, "sampling temperature; 0 picks the likeliest byte");
  const examples::Recipe recipe = examples::recipe_flags(args, steps, 3e-3);
  const double holdout = args.get_double("holdout", 0.1, "fraction of the corpus held out for validation (0: none)");
  const long eval_every = args.get_int("eval-every", 0, "a validation loss every N steps (0: steps/5) and after the last");
  const long eval_batches = args.get_int("eval-batches", 4, "held-out batches per validation");
  const long log_every = examples::log_every_flag(args, steps);
  const p::MixedPrecision precision = examples::precision_flag(args);
  const examples::CheckpointOptions checkpoint = examples::checkpoint_flags(args);
  args.finish();

  try {
    if (!report.empty() && report != "json") p::user_error("--report: expected 'json', got '" + report + "'");
    const p::nn::Gpt model{{.vocab = 256, .seq = seq, .d_model = dmodel, .heads = heads, .layers = layers,
                            .tied = tied != 0}};
    const std::string text = gpt::load_corpus(corpus_path, seq);
    if (eval_batches < 1) p::user_error("--eval-batches: expected >= 1, got " + std::to_string(eval_batches));
    const auto [train_text, held_out] = gpt::split_corpus(text, holdout, seq);
    const p::Program step = gpt::train_program(model, batch, recipe, precision);
    const p::Mesh mesh = p::Mesh::parse(mesh_text);
    const p::SpmdProgram spmd = p::lower(examples::partition_and_report(step, mesh, p::parse_schedule(schedule_text)));
    // Validation: the loss alone, partitioned by the same schedule (ZeRO-2 shards only optimizer state, which
    // the forward pass does not read).
    const p::Program eval = gpt::eval_program(model, batch, precision);
    const p::SpmdProgram eval_spmd = p::lower(p::partition(eval, mesh, p::parse_schedule(examples::without_tactic(schedule_text, "z2"))));
    examples::LoopOptions options{steps, static_cast<std::uint64_t>(seed), batch * seq,
                                  report == "json" ? report_file : "",
                                  "gpt_train mesh " + mesh.to_string() + " schedule " + schedule_text +
                                      " backend " + backend + " precision " + std::string(name_of(precision.compute)),
                                  checkpoint, log_every, recipe, eval_every > 0 ? eval_every : std::max(1L, steps / 5)};
    auto next_batch = [&](long s) { return gpt::batch_at(train_text, batch, seq, static_cast<std::uint64_t>(seed), s); };

    auto run = [&]<p::Communicator C>(C& comm) {
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
      if (sample <= 0) return;
      p::NamedArrays state = exe.gather_state(trained.state);
      if (comm.device() != 0) return;
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

    examples::run_on_backend(backend, mesh.num_devices(), argc, argv, run);
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
