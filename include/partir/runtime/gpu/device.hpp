#pragma once
// Which CUDA devices this process can use. Without a GPU the runtime does not say "no device" (error 100):
// with the toolkit installed but no driver it says "driver version is insufficient" (error 35). Either way
// there is nothing to run on, so both mean zero devices, and the reason is kept for the message.
#include <cuda_runtime_api.h>

#include <string>

#include "partir/runtime/gpu/cuda_error.hpp"

namespace partir::gpu {

struct DeviceCount {
  int count = 0;
  std::string reason;  // why count is 0 ("" when there are devices)
};

inline DeviceCount probe_devices() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return {0, "cudaGetDeviceCount: " + cuda_error_text(e)};
  }
  if (n == 0) return {0, "cudaGetDeviceCount found 0 devices"};
  return {n, ""};
}

inline int device_count() { return probe_devices().count; }

// The message every GPU entry point gives when it has nothing to run on.
inline std::string no_device_message(const std::string& who) {
  return who + ": no CUDA device is present (" + probe_devices().reason + "); the GPU backend needs an NVIDIA GPU and driver";
}

// Throws a UserError naming `who` unless `needed` devices are present.
inline void require_devices(int needed, const std::string& who) {
  const DeviceCount d = probe_devices();
  if (d.count == 0) user_error(no_device_message(who));
  if (d.count < needed)
    user_error(who + ": needs " + std::to_string(needed) + " CUDA devices (one per mesh device), found " +
               std::to_string(d.count));
}

}  // namespace partir::gpu
