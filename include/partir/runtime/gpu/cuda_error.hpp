#pragma once
// CUDA runtime and cuBLAS status codes turned into partir exceptions that name the call and carry the
// runtime's own text (cudaGetErrorName / cudaGetErrorString), so a failure on a GPU machine reads as what
// went wrong, not as a number.
#include <cuda_runtime_api.h>

#include <string>

#include "partir/error.hpp"

namespace partir::gpu {

inline std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ", code " + std::to_string(static_cast<int>(e)) + ")";
}

// A failing CUDA call is an environment problem the user must act on (no driver, out of memory, a bad
// device id), so it is a UserError, like the MPI backend's failures.
inline void check_cuda(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear the sticky-until-read error so later calls report their own status
  throw UserError(std::string("cuda: ") + call + " failed: " + cuda_error_text(e));
}

}  // namespace partir::gpu
