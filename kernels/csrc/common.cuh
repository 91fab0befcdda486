// Shared device helpers for the kernels in this folder: integer types (NVRTC has no <cstdint>),
// vectorised loads/stores of F features into float registers, and vector atomics.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

// The host build of tests/_host_cuda.py (kernels run on the CPU in CI) has no CUDA vector or half
// types: it gets the integer types above and none of the helpers below.
#ifndef RF_HOST_BUILD
#include <cuda_fp16.h>

// Load F consecutive features starting at p into v, widest aligned vectors first.
// Alignment: p is a multiple of F elements from a base the caller checked to be 16-byte aligned,
// so the widest vector that divides F (<= 16 bytes) is aligned.
template <int F>
__device__ __forceinline__ void load_features(const float* __restrict__ p, float (&v)[F]) {
  if constexpr (F % 4 == 0) {
#pragma unroll
    for (int i = 0; i < F; i += 4) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(p + i));
      v[i] = q.x; v[i + 1] = q.y; v[i + 2] = q.z; v[i + 3] = q.w;
    }
  } else if constexpr (F % 2 == 0) {
#pragma unroll
    for (int i = 0; i < F; i += 2) {
      const float2 q = __ldg(reinterpret_cast<const float2*>(p + i));
      v[i] = q.x; v[i + 1] = q.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < F; ++i) v[i] = __ldg(p + i);
  }
}

__device__ __forceinline__ float2 half2_bits_to_float2(unsigned int bits) {
  __half2 h;
  *reinterpret_cast<unsigned int*>(&h) = bits;
  return __half22float2(h);
}

template <int F>
__device__ __forceinline__ void load_features(const __half* __restrict__ p, float (&v)[F]) {
  if constexpr (F % 8 == 0) {
#pragma unroll
    for (int i = 0; i < F; i += 8) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p + i));
      const float2 a = half2_bits_to_float2(q.x), b = half2_bits_to_float2(q.y);
      const float2 c = half2_bits_to_float2(q.z), d = half2_bits_to_float2(q.w);
      v[i] = a.x; v[i + 1] = a.y; v[i + 2] = b.x; v[i + 3] = b.y;
      v[i + 4] = c.x; v[i + 5] = c.y; v[i + 6] = d.x; v[i + 7] = d.y;
    }
  } else if constexpr (F % 4 == 0) {
#pragma unroll
    for (int i = 0; i < F; i += 4) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(p + i));
      const float2 a = half2_bits_to_float2(q.x), b = half2_bits_to_float2(q.y);
      v[i] = a.x; v[i + 1] = a.y; v[i + 2] = b.x; v[i + 3] = b.y;
    }
  } else if constexpr (F % 2 == 0) {
#pragma unroll
    for (int i = 0; i < F; i += 2) {
      const float2 a = __half22float2(__ldg(reinterpret_cast<const __half2*>(p + i)));
      v[i] = a.x; v[i + 1] = a.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < F; ++i) v[i] = __half2float(__ldg(p + i));
  }
}

// p[i] += v[i] for i < F, atomically per element. On sm_90+ the 2- and 4-float vector atomics
// (one L2 operation for 8 or 16 bytes) are used unless RF_SCALAR_ATOMICS is defined.
template <int F>
__device__ __forceinline__ void atomic_add_features(float* __restrict__ p, const float (&v)[F]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(RF_SCALAR_ATOMICS)
  constexpr int kVec = (F % 4 == 0) ? 4 : (F % 2 == 0) ? 2 : 1;
#else
  constexpr int kVec = 1;
#endif
#pragma unroll
  for (int i = 0; i < F; i += kVec) {
    if constexpr (kVec == 4) {
      atomicAdd(reinterpret_cast<float4*>(p + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
    } else if constexpr (kVec == 2) {
      atomicAdd(reinterpret_cast<float2*>(p + i), make_float2(v[i], v[i + 1]));
    } else {
      atomicAdd(p + i, v[i]);
    }
  }
}

// p[i] += s * g[i] for i < F (see atomic_add_features).
template <int F>
__device__ __forceinline__ void atomic_add_scaled(float* __restrict__ p, float s, const float (&g)[F]) {
  float v[F];
#pragma unroll
  for (int i = 0; i < F; ++i) v[i] = s * g[i];
  atomic_add_features<F>(p, v);
}
#endif  // RF_HOST_BUILD
