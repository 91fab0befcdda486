// Multi-resolution hash encoding (Mueller et al. 2022, "Instant Neural Graphics Primitives with a
// Multiresolution Hash Encoding", Sec. 3). Python side: kernels/hashgrid.py; reference with the same
// arithmetic: kernels/_reference.py (hash_encode_reference).
//
// Per level l with resolution R = resolutions[l] and the grid offset o (0 <= o < 1, the same for all
// levels): pos = clamp(x, 0, 1) * R + o, cell = min(floor(pos), V-2) with V = R+1 vertices per axis
// when o = 0 and R+2 otherwise, trilinear weights from frac = pos - cell over the 8 corners (integer
// corners in [0, V-1]). o = 0.5 is tiny-cuda-nn's half-cell shift: a level's vertices sit at
// (k - 0.5) / R, so the levels no longer share the vertices of the box's corners and centre planes.
// Corner row: dense x + y*V + z*V^2 when V^3 <= T, else the spatial hash
// (x * 1 ^ y * 2654435761 ^ z * 805459861) mod T, all in uint32.
//
// Threads: one per (point, level). Template G = levels per block row: the grid is
// (ceil(N * G / block), ceil(L / G)), thread t of a row owns point t / G and level row * G + t % G.
//   G = 0 : all L levels in one row (G = L at run time): a warp writes whole output rows.
//   G = 1 : one level per row: the row's table slice stays hot, but output writes are 8-byte
//           pieces strided by L * F floats (partial sectors).
//   G = 8/F (4 for F = 2): a point's G levels fill one 32-byte output sector, and the blocks run
//           row by row, so the table working set is G levels at a time (fits in L2 even for fp32).
//
// Backward: the coarse dense levels (see hash_encode_bwd_private) may be accumulated per block in
// shared memory first; the host picks them (kernels/hashgrid.py, private_plan) and passes l0.
//
// Defines: RF_NO_STREAMING (plain stores of outputs and loads of output gradients instead of the
// evict-first ones that keep the table and its gradient in L2; points are re-read by every block
// row, so they are cached normally), RF_NO_PAIR_MERGE (two accesses per x-pair of corners even when
// both rows sit in one aligned pair), RF_SCALAR_ATOMICS (see common.cuh).

#include "common.cuh"

#ifdef RF_NO_STREAMING
#define RF_LOAD_STREAM(p) __ldg(p)
#define RF_STORE_STREAM(p, v) (*(p) = (v))
#else
#define RF_LOAD_STREAM(p) __ldcs(p)
#define RF_STORE_STREAM(p, v) __stcs(p, v)
#endif

// The 8 corner rows and trilinear weights of point p at one level.
// pos uses __fmul_rn so it is never fused into a later FMA: it rounds exactly as PyTorch's float32
// multiply does, so kernel and reference pick the same cell and the same weights.
__device__ __forceinline__ void trilinear_corners(const float* __restrict__ p,  // [3]
                                                  int R, float off, u32 T, u32 (&idx)[8],
                                                  float (&w)[8]) {
  const float Rf = (float)R;
  const int last = (off > 0.0f) ? R : R - 1;  // the last cell: V - 2
  u32 c0[3];
  float fr[3];
#pragma unroll
  for (int d = 0; d < 3; ++d) {
    const float x = fminf(fmaxf(__ldg(p + d), 0.0f), 1.0f);  // NaN -> 0, as the reference
    const float pos = __fadd_rn(__fmul_rn(x, Rf), off);
    const int cell = min((int)floorf(pos), last);
    fr[d] = pos - (float)cell;
    c0[d] = (u32)cell;
  }
  const u32 R1 = (u32)last + 2u;  // V
  const bool dense = (u64)R1 * R1 * R1 <= (u64)T;
  const bool pow2 = (T & (T - 1u)) == 0u;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const u32 x = c0[0] + (c & 1), y = c0[1] + ((c >> 1) & 1), z = c0[2] + ((c >> 2) & 1);
    const float wx = (c & 1) ? fr[0] : 1.0f - fr[0];
    const float wy = (c & 2) ? fr[1] : 1.0f - fr[1];
    const float wz = (c & 4) ? fr[2] : 1.0f - fr[2];
    w[c] = (wx * wy) * wz;
    u32 h;
    if (dense) {
      h = x + y * R1 + z * R1 * R1;
    } else {
      h = x ^ (y * 2654435761u) ^ (z * 805459861u);
      h = pow2 ? (h & (T - 1u)) : (h % T);
    }
    idx[c] = h;
  }
}

// Which (point n, level l) this thread owns; false when past the end.
template <int G>
__device__ __forceinline__ bool thread_item(u32 N, u32 L, u32& n, u32& l) {
  const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
  if (G == 1) {
    n = t;
    l = blockIdx.y;
  } else {
    const u32 g = (G == 0) ? L : (u32)G;  // constant G: the division is a shift or a multiply
    n = t / g;
    l = blockIdx.y * g + (t - n * g);
  }
  return n < N && l < L;
}

// Corners c and c + 1 differ in x only. When their rows are the two halves of one aligned pair
// (row ^ 1), one load of 2F features fetches both: one memory request instead of two. With the
// x-coherent hash (prime 1 for x) that is every even x on hashed levels, every even row on dense.
// The pair is 2F-element aligned only when the level's base is, i.e. when T is even.
__device__ __forceinline__ bool same_pair(u32 a, u32 b, u32 T) {
#ifdef RF_NO_PAIR_MERGE
  return false;
#else
  return (a ^ b) == 1u && (T & 1u) == 0u;
#endif
}

template <typename scalar_t, int F, int G>
__global__ void hash_encode_fwd(const float* __restrict__ points,      // [N, 3]
                                const scalar_t* __restrict__ table,    // [L, T, F]
                                const int* __restrict__ resolutions,   // [L]
                                float* __restrict__ out,               // [N, L * F]
                                u32 N, u32 L, u32 T, float off) {
  u32 n, l;
  if (!thread_item<G>(N, L, n, l)) return;
  const int R = max(__ldg(resolutions + l), 1);
  u32 idx[8];
  float w[8];
  trilinear_corners(points + (u64)n * 3, R, off, T, idx, w);
  const scalar_t* __restrict__ level = table + (u64)l * T * F;
  float v[8][F];
#pragma unroll
  for (int c = 0; c < 8; c += 2) {  // all loads issued before the first use
    if (same_pair(idx[c], idx[c + 1], T)) {
      float both[2 * F];
      load_features<2 * F>(level + (u64)(idx[c] & ~1u) * F, both);
      const bool swap = idx[c] & 1u;
#pragma unroll
      for (int f = 0; f < F; ++f) {
        v[c][f] = swap ? both[F + f] : both[f];
        v[c + 1][f] = swap ? both[f] : both[F + f];
      }
    } else {
      load_features<F>(level + (u64)idx[c] * F, v[c]);
      load_features<F>(level + (u64)idx[c + 1] * F, v[c + 1]);
    }
  }
  float acc[F];
#pragma unroll
  for (int f = 0; f < F; ++f) acc[f] = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
#pragma unroll
    for (int f = 0; f < F; ++f) acc[f] = fmaf(w[c], v[c][f], acc[f]);
  }
  float* __restrict__ dst = out + (u64)n * L * F + (u64)l * F;
  if constexpr (F % 2 == 0) {
#pragma unroll
    for (int f = 0; f < F; f += 2)
      RF_STORE_STREAM(reinterpret_cast<float2*>(dst + f), make_float2(acc[f], acc[f + 1]));
  } else {
#pragma unroll
    for (int f = 0; f < F; ++f) RF_STORE_STREAM(dst + f, acc[f]);
  }
}

// grad_table is float32 whatever the table's dtype: atomics accumulate in fp32 and the Python side
// casts to fp16 afterwards (fp16 atomics would round every partial sum to 11 bits). Summing fp16
// tables' gradients in fp16 instead (half2 atomics, and red.global.add.noftz.v2.f16x2 for merged
// pairs, as tiny-cuda-nn and torch-ngp do for half gradients) was tried on the H200: 2.45 ms
// against 2.25 ms at 2^21 points, with a 1.5e-3 relative L2 error, so it is not built.
// Levels below l0 are left to hash_encode_bwd_private (the grid covers levels l0..L-1 only).
template <int F, int G>
__global__ void hash_encode_bwd(const float* __restrict__ points,      // [N, 3]
                                const float* __restrict__ grad_out,    // [N, L * F]
                                const int* __restrict__ resolutions,   // [L]
                                float* __restrict__ grad_table,        // [L, T, F], float32, zeroed
                                u32 N, u32 L, u32 T, u32 l0, float off) {
  u32 n, l;
  if (!thread_item<G>(N, L - l0, n, l)) return;
  l += l0;
  float g[F];
  const float* __restrict__ src = grad_out + (u64)n * L * F + (u64)l * F;
  if constexpr (F % 2 == 0) {
#pragma unroll
    for (int f = 0; f < F; f += 2) {
      const float2 q = RF_LOAD_STREAM(reinterpret_cast<const float2*>(src + f));
      g[f] = q.x;
      g[f + 1] = q.y;
    }
  } else {
#pragma unroll
    for (int f = 0; f < F; ++f) g[f] = RF_LOAD_STREAM(src + f);
  }
  bool any = false;
#pragma unroll
  for (int f = 0; f < F; ++f) any |= (g[f] != 0.0f);
  if (!any) return;  // nothing to add (e.g. masked samples)
  const int R = max(__ldg(resolutions + l), 1);
  u32 idx[8];
  float w[8];
  trilinear_corners(points + (u64)n * 3, R, off, T, idx, w);
  float* __restrict__ level = grad_table + (u64)l * T * F;
#pragma unroll
  for (int c = 0; c < 8; c += 2) {
    if (same_pair(idx[c], idx[c + 1], T)) {
      // One atomic over both rows of the pair: the even row gets the even corner's share.
      const bool swap = idx[c] & 1u;
      const float w_lo = swap ? w[c + 1] : w[c], w_hi = swap ? w[c] : w[c + 1];
      float both[2 * F];
#pragma unroll
      for (int f = 0; f < F; ++f) {
        both[f] = w_lo * g[f];
        both[F + f] = w_hi * g[f];
      }
      atomic_add_features<2 * F>(level + (u64)(idx[c] & ~1u) * F, both);
    } else {
      atomic_add_scaled<F>(level + (u64)idx[c] * F, w[c], g);
      atomic_add_scaled<F>(level + (u64)idx[c + 1] * F, w[c + 1], g);
    }
  }
}

// Backward of the coarse dense levels with block-private accumulation. On a dense level of
// V^3 rows every row collects thousands of corner updates; sending each to L2 as an atomic
// makes those levels as costly as the hashed ones. Here a block owns a group of slabs (slab =
// {level, first row, rows, offset in shared memory}; group g holds slabs groups[g] ..
// groups[g+1]-1, their rows * F floats side by side in dynamic shared memory), walks a strided
// share of all points once (each point's slabs in turn), adds the corners that fall in its slabs with shared-memory atomics,
// and finally adds its non-zero partial sums to grad_table: one global atomic per touched row per
// block instead of one per corner. Grid: (blocks per group, groups).
template <int F>
__global__ void hash_encode_bwd_private(const float* __restrict__ points,      // [N, 3]
                                        const float* __restrict__ grad_out,    // [N, L * F]
                                        const int* __restrict__ resolutions,   // [L]
                                        const int* __restrict__ slabs,         // [S, 4]
                                        const int* __restrict__ groups,        // [groups + 1]
                                        float* __restrict__ grad_table,        // [L, T, F]
                                        u32 N, u32 L, u32 T, float off) {
  extern __shared__ float acc[];
  const int s_begin = __ldg(groups + blockIdx.y), s_end = __ldg(groups + blockIdx.y + 1);
  const int* last = slabs + 4 * (s_end - 1);
  const u32 total = (u32)(__ldg(last + 3) + __ldg(last + 2)) * F;  // floats in use
  for (u32 i = threadIdx.x; i < total; i += blockDim.x) acc[i] = 0.0f;
  __syncthreads();
  const u32 stride = gridDim.x * blockDim.x;
  for (u32 n = blockIdx.x * blockDim.x + threadIdx.x; n < N; n += stride) {
    const float* __restrict__ p = points + (u64)n * 3;
    for (int s = s_begin; s < s_end; ++s) {  // the slabs' levels share the point's output sector
      const int* slab = slabs + 4 * s;
      const u32 l = (u32)__ldg(slab), row0 = (u32)__ldg(slab + 1), rows = (u32)__ldg(slab + 2);
      const float* __restrict__ src = grad_out + (u64)n * L * F + (u64)l * F;
      float g[F];
      bool any = false;
#pragma unroll
      for (int f = 0; f < F; ++f) {
        g[f] = __ldg(src + f);
        any |= (g[f] != 0.0f);
      }
      if (!any) continue;
      float* __restrict__ mine = acc + (u32)__ldg(slab + 3) * F;
      u32 idx[8];
      float w[8];
      trilinear_corners(p, max(__ldg(resolutions + l), 1), off, T, idx, w);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const u32 r = idx[c] - row0;  // wraps to a large value below the slab
        if (r < rows) {
#pragma unroll
          for (int f = 0; f < F; ++f) atomicAdd(mine + r * F + f, w[c] * g[f]);
        }
      }
    }
  }
  __syncthreads();
  for (int s = s_begin; s < s_end; ++s) {
    const int* slab = slabs + 4 * s;
    const u32 l = (u32)__ldg(slab), row0 = (u32)__ldg(slab + 1), rows = (u32)__ldg(slab + 2);
    const float* __restrict__ mine = acc + (u32)__ldg(slab + 3) * F;
    float* __restrict__ dst = grad_table + ((u64)l * T + row0) * F;
    for (u32 r = threadIdx.x; r < rows; r += blockDim.x) {
      float v[F];
      bool any = false;
#pragma unroll
      for (int f = 0; f < F; ++f) {
        v[f] = mine[r * F + f];
        any |= (v[f] != 0.0f);
      }
      if (any) atomic_add_features<F>(dst + (u64)r * F, v);
    }
  }
}
