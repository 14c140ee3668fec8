#pragma once
// Stand-in for the header PyTorch's CUDA build generates from
// c10/cuda/impl/cuda_cmake_macros.h.in; CPU-only LibTorch packages ship
// c10/cuda/ without it. Used only by the compile-only CUDA check
// (scripts/cuda-compile-check), never by a real CUDA build.
#define C10_CUDA_BUILD_SHARED_LIBS
