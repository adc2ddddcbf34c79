// The one nvcc translation unit of partir's own build: it defines the CUDA kernels declared in
// gpu/launch.hpp. A program of yours that runs partir on the GPU compiles the same one-line file.
#include <partir/runtime/gpu/kernels.cuh>
