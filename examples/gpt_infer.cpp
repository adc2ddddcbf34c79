// Multi-query attention decoding: trains a byte-level GPT whose attention shares one K/V head across its query
// heads (nn::GptConfig::multi_query), then continues several prompts at once with a forward-only next-token
// program partitioned by the multi_query preset (MQ: query heads and the MLP split on the model axis, the one
// K/V head whole on every device). Each step recomputes the window of the last --seq bytes (no K/V cache).
// Prints the collective plan of the decode program, the continuations, decode tokens/s, and how far the
// partitioned logits are from the single-device program's.
//   build/examples/gpt_infer
//   build/examples/gpt_infer --mesh batch=2,model=2 --schedule mq --train-schedule bp,mq
//   mpirun -np 2 build/examples/gpt_infer --backend mpi
#include <partir/partir.hpp>

#include "cli.hpp"
#include "gpt_common.hpp"
#include "training_loop.hpp"

namespace p = partir;

namespace {

// "all_reduce{model} x4, ..." for collectives that communicate (all_slice is a local copy).
std::string plan_summary(const p::SpmdProgram& spmd) {
  std::map<std::string, int> count;
  for (const auto& c : spmd.collectives())
    if (c.collective.kind != p::CollectiveKind::all_slice)
      ++count[std::string(p::name_of(c.collective.kind)) + p::to_string(c.collective.axes)];
  std::string s;
  for (const auto& [what, n] : count) s += (s.empty() ? "" : ", ") + what + " x" + std::to_string(n);
  return s.empty() ? "no communication" : s;
}

}  // namespace

int main(int argc, char** argv) {
  cli::Args args(argc, argv, "usage: gpt_infer [flags]\nTrains a multi-query GPT, then decodes with the MQ sharding.");
  const long steps = args.get_int("steps", 200, "training steps before decoding");
  const long batch = args.get_int("batch", 16, "training sequences per step (global)");
  const long seq = args.get_int("seq", 64, "context length in bytes");
  const long layers = args.get_int("layers", 2, "transformer blocks");
  const long dmodel = args.get_int("dmodel", 64, "model width");
  const long heads = args.get_int("heads", 4, "query heads (one shared K/V head)");
  const long prompts = args.get_int("prompts", 4, "prompts decoded together (the decode batch)");
  const long tokens = args.get_int("tokens", 48, "bytes generated per prompt");
  const long seed = args.get_int("seed", 0, "seed of parameters, batches, prompts and sampling");
  const double lr = args.get_double("lr", 3e-3, "Adam learning rate");
  const double temperature = args.get_double("temperature", 0, "sampling temperature; 0 picks the likeliest byte");
  const std::string corpus_path = args.get("corpus", PARTIR_GPT_CORPUS, "training text");
  const std::string mesh_text = args.get("mesh", "model=2", "device mesh, axes major to minor");
  const std::string schedule_text = args.get("schedule", "mq", "decode tactics: bp, mq, ... (comma-separated)");
  const std::string train_schedule_text = args.get("train-schedule", "mq", "training tactics (comma-separated)");
  const std::string backend = args.get("backend", "threads", "threads (one process), mpi (under mpirun) or nccl (one GPU per device)");
  const std::string report = args.get("report", "", "'json' writes a JSON report of the decoding");
  const std::string report_file = args.get("report-file", "gpt_infer_report.json", "where --report json writes");
  const examples::CheckpointOptions checkpoint = examples::checkpoint_flags(args);
  args.finish();

  try {
    if (!report.empty() && report != "json") p::user_error("--report: expected 'json', got '" + report + "'");
    const p::nn::Gpt model{{.vocab = 256, .seq = seq, .d_model = dmodel, .heads = heads, .layers = layers,
                            .multi_query = true}};
    const std::string text = gpt::load_corpus(corpus_path, seq);
    const p::Mesh mesh = p::Mesh::parse(mesh_text);
    examples::Recipe recipe;
    recipe.lr = lr;
    const p::Program step = gpt::train_program(model, batch, recipe);
    const p::SpmdProgram train_spmd = p::lower(p::partition(step, mesh, p::parse_schedule(train_schedule_text)));
    const p::Program next = gpt::next_token_program(model, prompts);
    const p::SpmdProgram decode = p::lower(p::partition(next, mesh, p::parse_schedule(schedule_text)));
    const examples::LoopOptions options{steps, static_cast<std::uint64_t>(seed), batch * seq, "",
                                        "gpt_infer training", checkpoint, 1, recipe};
    auto next_batch = [&](long s) { return gpt::batch_at(text, batch, seq, static_cast<std::uint64_t>(seed), s); };

    auto run = [&]<p::Communicator C>(C& comm) {
      const bool lead = comm.device() == 0;
      const p::Executable trainer(train_spmd, comm);
      const auto trained = examples::train(trainer, next_batch, options);
      p::NamedArrays params = trainer.gather_state(trained.state);
      std::erase_if(params, [&](const auto& kv) { return !next.find_input(kv.first); });  // no optimizer state
      const p::Executable decoder(decode, comm);
      p::NamedArrays local = decoder.shard_state(params);
      // Prompts: windows of the corpus at offsets drawn from the seed (the same on every device).
      std::mt19937_64 rng(static_cast<std::uint64_t>(seed) + 1);
      std::vector<std::int32_t> windows(static_cast<std::size_t>(prompts * seq));
      std::vector<std::string> prompt_text;
      std::vector<std::vector<std::int32_t>> generated(static_cast<std::size_t>(prompts));
      for (long i = 0; i < prompts; ++i) {
        const std::size_t offset = rng() % (text.size() - static_cast<std::size_t>(seq));
        gpt::window(text, offset, seq, &windows[static_cast<std::size_t>(i * seq)]);
        prompt_text.push_back(text.substr(offset, static_cast<std::size_t>(seq)));
      }
      if (lead) std::cout << "decode plan (" << schedule_text << " on " << mesh.to_string() << "): " << plan_summary(decode) << std::endl;
      double max_diff = 0;
      std::int64_t peak = 0;
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (long t = 0; t < tokens; ++t) {
        const p::Array window({prompts, seq}, windows);
        const p::DeviceResult r = decoder.step(local, {{"tokens", window}});
        peak = std::max(peak, r.peak_bytes);
        const p::Array& logits = r.outputs.at("logits");
        if (t == 0 && lead) {  // the partitioned program against the single-device one, once
          params["tokens"] = window;
          const p::Array expect = p::interpret(next, params).at("logits");
          for (std::int64_t i = 0; i < expect.size(); ++i) max_diff = std::max(max_diff, std::abs(expect.at(i) - logits.at(i)));
        }
        for (long i = 0; i < prompts; ++i) {
          const std::int32_t b = gpt::pick(logits, i, temperature, rng);
          generated[static_cast<std::size_t>(i)].push_back(b);
          auto row = windows.begin() + i * seq;
          std::copy(row + 1, row + seq, row);
          *(row + seq - 1) = b;
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!lead) return;
      for (long i = 0; i < prompts; ++i)
        std::cout << "--- prompt " << i << ": " << prompt_text[static_cast<std::size_t>(i)] << "\n--- continues: "
                  << gpt::printable(generated[static_cast<std::size_t>(i)]) << "\n";
      const double per_s = static_cast<double>(prompts * tokens) / seconds;
      std::cout << "decoded " << prompts * tokens << " bytes in " << seconds << " s: " << per_s << " tokens/s, "
                << 1e3 * seconds / static_cast<double>(tokens) << " ms per step\n"
                << "max |partitioned - single-device| logit difference at step 1: " << max_diff << std::endl;
      if (report != "json") return;
      std::ofstream f(report_file);
      f << "{\n  \"run\": \"gpt_infer mesh " << examples::json_escape(mesh.to_string()) << " schedule "
        << examples::json_escape(schedule_text) << " backend " << backend << "\",\n  \"tokens_per_s\": " << per_s
        << ",\n  \"ms_per_step\": " << 1e3 * seconds / static_cast<double>(tokens) << ",\n  \"peak_bytes_device0\": "
        << peak << ",\n  \"max_logit_difference\": " << max_diff << ",\n  \"collectives\": [";
      const auto plan = decode.collectives();
      for (std::size_t i = 0; i < plan.size(); ++i)
        f << (i ? ",\n" : "\n") << "    {\"kind\": \"" << p::name_of(plan[i].collective.kind) << "\", \"axes\": \""
          << p::to_string(plan[i].collective.axes) << "\", \"bytes\": " << plan[i].bytes << ", \"reason\": \""
          << examples::json_escape(plan[i].collective.reason) << "\"}";
      f << "\n  ]\n}\n";
      std::cout << "report written to " << report_file << std::endl;
    };

    examples::run_on_backend(backend, mesh.num_devices(), argc, argv, run);
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
