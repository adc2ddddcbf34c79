#pragma once
// The GEMM engine behind dot_general: a cblas sgemm/dgemm (OpenBLAS) when the build defines PARTIR_USE_BLAS
// (Meson -Dblas=auto|openblas adds it together with the library; a header-only consumer defines it and links
// cblas itself), else Eigen's product. Which one runs is a process-wide setting, so a benchmark or a
// differential test can run both in one binary; the default is BLAS where it is built in, or
// PARTIR_GEMM=eigen in the environment.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "partir/runtime/kernels/kernel_threads.hpp"

namespace partir {

enum class GemmEngine : std::uint8_t { eigen, blas };

inline constexpr bool blas_built_in =
#ifdef PARTIR_USE_BLAS
    true;
#else
    false;
#endif

namespace detail {
inline std::atomic<GemmEngine>& gemm_engine_now() {
  static std::atomic<GemmEngine> engine{[] {
    const char* v = std::getenv("PARTIR_GEMM");
    return blas_built_in && !(v && std::string_view(v) == "eigen") ? GemmEngine::blas : GemmEngine::eigen;
  }()};
  return engine;
}
}  // namespace detail

inline GemmEngine gemm_engine() { return detail::gemm_engine_now(); }
// Selects the engine for every later dot_general; asking for BLAS in a build without it keeps Eigen.
inline void set_gemm_engine(GemmEngine e) { detail::gemm_engine_now() = blas_built_in ? e : GemmEngine::eigen; }
inline std::string_view name_of(GemmEngine e) { return e == GemmEngine::blas ? "blas" : "eigen"; }

namespace blas {

// One row-major C[m,n] = alpha * A[m,k] B[k,n] + beta * C. Each operand is row-major with leading dimension
// ld (A(i,p) at a[i * lda + p]) or, when not row_major, column-major (A(i,p) at a[i + p * lda]). Returns
// false when this build has no BLAS or the layout is not one cblas accepts; the caller then uses Eigen.
template <class T>
bool gemm(bool a_row_major, bool b_row_major, std::int64_t m, std::int64_t n, std::int64_t k, const T* a,
          std::int64_t lda, const T* b, std::int64_t ldb, T* c, std::int64_t ldc, T alpha = 1, T beta = 0) {
#ifdef PARTIR_USE_BLAS
  constexpr std::int64_t limit = 0x7fffffff;  // cblas takes int sizes
  const bool ok = m > 0 && n > 0 && k > 0 && m < limit && n < limit && k < limit && lda < limit && ldb < limit &&
                  ldc < limit && lda >= (a_row_major ? k : m) && ldb >= (b_row_major ? n : k) && ldc >= n;
  if (!ok) return false;
  ensure_kernel_threads();
  const auto ta = a_row_major ? CblasNoTrans : CblasTrans, tb = b_row_major ? CblasNoTrans : CblasTrans;
  const auto i = [](std::int64_t x) { return static_cast<int>(x); };
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  else if constexpr (std::is_same_v<T, double>)
    cblas_dgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  else
    return false;
  return true;
#else
  (void)a_row_major, (void)b_row_major, (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)c,
      (void)ldc, (void)alpha, (void)beta;
  return false;
#endif
}

}  // namespace blas
}  // namespace partir
