#pragma once
// The profile a GPU is predicted with before it is calibrated: the built-in datasheet of its model.
#include <cuda_runtime_api.h>

#include <string>

#include "partir/runtime/gpu/cuda_error.hpp"
#include "partir/sim/hardware_profile.hpp"

namespace partir::gpu {

// The built-in datasheet profile for a GPU of this name ("NVIDIA H200" gets h200-nvlink), else detect()'s.
inline HardwareProfile datasheet_profile(const std::string& device_name) {
  for (const auto& [model, profile] : {std::pair{"H200", "h200-nvlink"}, {"H100", "h100-nvlink"}, {"A100", "a100-nvlink"}})
    if (device_name.find(model) != std::string::npos) return HardwareProfile::named(profile);
  return HardwareProfile::detect();
}
inline HardwareProfile datasheet_profile(int gpu) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, gpu), "cudaGetDeviceProperties");
  return datasheet_profile(std::string(prop.name));
}

}  // namespace partir::gpu
