#pragma once
// machine_profile(comm): this machine's own hardware profile, calibrated once and cached, so that a first
// prediction is worth reading without a calibration step. The cache key is what the figures depend on: the
// host and its CPU, the GEMM engine and the compiler that built the kernels, the communicator type, the device
// count and the kernel threads per device (devices sharing cores measure their share). Files live in $PARTIR_CACHE_DIR, else
// $XDG_CACHE_HOME/partir, else ~/.cache/partir; `refresh` (or deleting the file) measures again.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <typeinfo>

#include "partir/runtime/kernels/gemm_engine.hpp"
#include "partir/runtime/kernels/kernel_threads.hpp"
#include "partir/calibrate/calibrate.hpp"

namespace partir {

// A calibration short enough to run on first use (seconds on a 2-core machine): fewer iterations and messages,
// each figure the median of 3 rounds (the examples compare the prediction with a measured median step). A 4 KiB
// message pins the collectives' latency, which the small collectives of a small model's step pay.
inline CalibrationOptions quick_calibration() {
  return {.name = "calibrated", .message_bytes = {1 << 12, 1 << 16, 1 << 20, 1 << 23}, .warmup = 1, .iterations = 3,
          .rounds = 3, .typical = true};
}

inline std::filesystem::path profile_cache_dir() {
  if (const char* d = std::getenv("PARTIR_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return std::filesystem::path(d) / "partir";
  if (const char* h = std::getenv("HOME"); h && *h) return std::filesystem::path(h) / ".cache" / "partir";
  return std::filesystem::temp_directory_path() / "partir";
}

namespace detail {

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("model name")) return line.substr(line.find(':') + 2);
  return "unknown cpu";
}

// The build's compiler and whether it optimized: the kernels' speed depends on both.
inline std::string compiler() {
#ifdef __VERSION__
  std::string c = __VERSION__;
#else
  std::string c = "a C++ compiler";
#endif
#ifdef __OPTIMIZE__
  return c + " (optimized)";
#else
  return c + " (unoptimized)";
#endif
}

// Bumped when calibrate() measures something differently, or the kernels it times change (7: fused groups keep
// 16-bit values in f32 and split over the kernel threads; 8: arrays on cache lines; 9: collectives on cold buffers,
// without staging copies along a leading dim; 10: GEMMs on cold operands; 11: the mpi backend's collectives within a
// host through shared memory): a cached profile of an older version is measured again.
inline constexpr int calibration_version = 11;

// What the figures depend on, as text (recorded in the profile) and as the cache file's path.
template <Communicator C>
std::pair<std::string, std::filesystem::path> machine_key(const C& comm) {
  char host[256] = "unknown";
  gethostname(host, sizeof host - 1);
  const std::string key = std::string(host) + ", " + cpu_model() + ", " + std::string(name_of(gemm_engine())) +
                          " GEMMs built by " + compiler() + ", " + typeid(C).name() + " with " +
                          std::to_string(comm.num_devices()) + " devices, " + std::to_string(kernel_threads()) +
                          " kernel threads each, calibration v" + std::to_string(calibration_version);
  char name[64];
  std::snprintf(name, sizeof name, "profile-%016zx.json", std::hash<std::string>{}(key));
  return {key, profile_cache_dir() / name};
}

}  // namespace detail

// Where machine_profile(comm) keeps this machine's profile for comm's layout.
template <Communicator C>
std::filesystem::path machine_profile_path(const C& comm) {
  return detail::machine_key(comm).second;
}

// Every device calls it at once (a calibration issues collectives). Devices agree: if any lacks the cached
// file (or `refresh`), all calibrate together and each writes the file where it was missing.
template <Communicator C>
HardwareProfile machine_profile(C& comm, bool refresh = false, const CalibrationOptions& options = quick_calibration()) {
  const auto [key, path] = detail::machine_key(comm);
  std::optional<HardwareProfile> cached;
  if (!refresh && std::filesystem::exists(path)) try {
      cached = HardwareProfile::load(path.string());
    } catch (const UserError&) {  // a damaged cache file is measured again
    }
  if (calibration::max_over_devices(comm, cached ? 0.0 : 1.0) == 0) return *cached;
  HardwareProfile hw = calibrate(comm, options);
  hw.source = "calibrated on " + key + " (cached in " + path.string() + ")";
  if (!cached) {
    std::error_code ignored;
    std::filesystem::create_directories(path.parent_path(), ignored);
    const std::string partial = path.string() + "." + std::to_string(getpid()) + "." + std::to_string(comm.device());
    try {
      hw.save(partial);
      std::filesystem::rename(partial, path);  // atomic: a reader sees the old file or the whole new one
    } catch (const std::exception&) {  // an unwritable cache costs a calibration next time, nothing else
      std::filesystem::remove(partial, ignored);
    }
  }
  return hw;
}

}  // namespace partir
