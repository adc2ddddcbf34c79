#pragma once
// One thread budget for the whole process: the kernels of every device that runs at once share the cores.
// The budget is PARTIR_NUM_THREADS (default: the hardware threads). A single device (interpret, or one
// device on the threads backend) gets all of it; N devices on the threads backend get budget / N each, and an
// MPI rank gets budget / (ranks on its host): with one device per core that is one GEMM thread each, so GEMM
// pools never fight the device threads or each other. Only the GEMMs, large fused elementwise groups and converts
// use more than one thread: OpenBLAS's pool is sized here (process-wide); oneDNN's OpenMP team is sized per
// calling thread from kernel_threads() (onednn.hpp), and the groups and large converts run on that same team
// (split_over_kernel_threads). Eigen's product and the other loops run on the calling thread.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>

#ifdef PARTIR_USE_BLAS
#include <cblas.h>
#endif

namespace partir {

inline int thread_budget() {
  if (const char* v = std::getenv("PARTIR_NUM_THREADS"); v && std::atoi(v) > 0) return std::atoi(v);
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

namespace detail {
inline std::atomic<int>& kernel_threads_now() {
  static std::atomic<int> n{0};  // 0: not applied yet (the BLAS library still runs its own default)
  return n;
}
inline void apply_kernel_threads(int n) {
  kernel_threads_now() = n;
#ifdef PARTIR_USE_BLAS
  openblas_set_num_threads(n);  // process-wide in OpenBLAS, hence one setting for all devices
#endif
}
}  // namespace detail

// Threads one device's kernels use now.
inline int kernel_threads() {
  const int n = detail::kernel_threads_now();
  return n > 0 ? n : thread_budget();
}

// Applies the budget before the first GEMM when nothing has set a count yet.
inline void ensure_kernel_threads() {
  if (detail::kernel_threads_now() == 0) detail::apply_kernel_threads(thread_budget());
}

// Sets the per-device kernel thread count for its lifetime, then restores the previous one. The threads
// backend scopes one around its device threads and mpi::Session one around the rank.
class KernelThreads {
 public:
  explicit KernelThreads(int per_device) : previous_(kernel_threads()) {
    detail::apply_kernel_threads(std::max(1, per_device));
  }
  // The share of the budget of one of `devices` devices running at once.
  static KernelThreads shared_by(int devices) { return KernelThreads(thread_budget() / std::max(1, devices)); }
  ~KernelThreads() { detail::apply_kernel_threads(previous_); }
  KernelThreads(const KernelThreads&) = delete;
  KernelThreads& operator=(const KernelThreads&) = delete;

 private:
  int previous_;
};

// Elements a loop must have to be split across the kernel threads (~0.1 ms of work or more).
inline constexpr std::int64_t kParallelElements = 1 << 18;

// f(lo, hi) over [0, n): one range per kernel thread, bounds on multiples of `unit` (the last range takes the
// rest), run by the calling thread's OpenMP team, the one oneDNN's GEMMs use (a second pool would fight its
// spinning threads for the cores). Small loops (`elements`: what the whole loop touches, n itself unless the
// caller says), and builds without OpenMP, run f(0, n) here.
template <class F>
void split_over_kernel_threads(std::int64_t n, std::int64_t unit, F&& f, std::int64_t elements = -1) {
  const std::int64_t units = n / unit;
  const int parts = (elements < 0 ? n : elements) < kParallelElements
                        ? 1
                        : static_cast<int>(std::clamp<std::int64_t>(units, 1, kernel_threads()));
  if (parts == 1) return f(std::int64_t{0}, n);  // no parallel region: entering one costs even with one thread
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1)
#endif
  for (int t = 0; t < parts; ++t) f(units * t / parts * unit, t + 1 == parts ? n : units * (t + 1) / parts * unit);
}

}  // namespace partir
