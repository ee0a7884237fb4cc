// MIRRORED_HD marks a function that both the host and a CUDA kernel call:
// __host__ __device__ under nvcc, nothing in plain C++ (the host kernels and
// the simulated runtime, which runs the kernels' bodies on the CPU).
#pragma once

#if defined(__CUDACC__)
#define MIRRORED_HD __host__ __device__
#else
#define MIRRORED_HD
#endif
