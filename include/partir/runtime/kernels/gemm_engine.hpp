#pragma once
// Which library runs dot_general's GEMMs: oneDNN's matmul (PARTIR_USE_ONEDNN), OpenBLAS's cblas
// (PARTIR_USE_BLAS) or Eigen's product (always there). The build decides which are built in (Meson
// -Dgemm=auto|onednn|openblas|eigen); a process-wide setting picks one at run time, so a benchmark or a
// differential test runs several in one binary. The default is the best built in (onednn, then blas, then
// eigen), or PARTIR_GEMM=onednn|blas|eigen in the environment.
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "partir/error.hpp"

namespace partir {

enum class GemmEngine : std::uint8_t { eigen, blas, onednn };

inline constexpr std::array<GemmEngine, 3> all_gemm_engines{GemmEngine::onednn, GemmEngine::blas, GemmEngine::eigen};

inline std::string_view name_of(GemmEngine e) {
  switch (e) {
    case GemmEngine::onednn: return "onednn";
    case GemmEngine::blas: return "blas";
    case GemmEngine::eigen: return "eigen";
  }
  return "?";
}

inline constexpr bool built_in(GemmEngine e) {
  switch (e) {
    case GemmEngine::onednn:
#ifdef PARTIR_USE_ONEDNN
      return true;
#else
      return false;
#endif
    case GemmEngine::blas:
#ifdef PARTIR_USE_BLAS
      return true;
#else
      return false;
#endif
    case GemmEngine::eigen: return true;
  }
  return false;
}

// The fastest engine this build has.
inline constexpr GemmEngine best_gemm_engine() {
  for (GemmEngine e : all_gemm_engines)
    if (built_in(e)) return e;
  return GemmEngine::eigen;
}

inline std::string gemm_engines_built_in() {
  std::string names;
  for (GemmEngine e : all_gemm_engines)
    if (built_in(e)) names += (names.empty() ? "" : ", ") + std::string(name_of(e));
  return names;
}

// A GEMM engine by name; `source` says where the name came from, for the error.
inline GemmEngine parse_gemm_engine(std::string_view name, std::string_view source = "PARTIR_GEMM") {
  for (GemmEngine e : all_gemm_engines) {
    if (name != name_of(e)) continue;
    if (!built_in(e))
      user_error(std::string(source) + "=" + std::string(name) + ": this build has no " + std::string(name) +
                 " GEMM engine (built in: " + gemm_engines_built_in() + "; Meson -Dgemm=" +
                 (e == GemmEngine::blas ? "openblas" : std::string(name)) + " builds it)");
    return e;
  }
  user_error(std::string(source) + "=" + std::string(name) + ": unknown GEMM engine (choices: onednn, blas, eigen; built in: " +
             gemm_engines_built_in() + ")");
}

namespace detail {
inline std::atomic<GemmEngine>& gemm_engine_now() {
  static std::atomic<GemmEngine> engine{[] {
    const char* v = std::getenv("PARTIR_GEMM");
    return v && *v ? parse_gemm_engine(v) : best_gemm_engine();
  }()};
  return engine;
}
}  // namespace detail

inline GemmEngine gemm_engine() { return detail::gemm_engine_now(); }

// Selects the engine for every later dot_general; an engine this build lacks is a UserError.
inline void set_gemm_engine(GemmEngine e) {
  if (!built_in(e)) parse_gemm_engine(name_of(e), "set_gemm_engine");
  detail::gemm_engine_now() = e;
}

}  // namespace partir
