#pragma once
// OpenBLAS's cblas GEMMs, built in when the build defines PARTIR_USE_BLAS (Meson -Dgemm=auto|openblas adds it
// together with the library; a header-only consumer defines it and links cblas itself).
#include <cstdint>
#include <type_traits>

#include "partir/runtime/kernels/kernel_threads.hpp"

namespace partir {

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
