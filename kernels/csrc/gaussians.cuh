// Shared pieces of the 3D Gaussian Splatting kernels (gaussians_project.cu, gaussians_tiles.cu,
// gaussians_raster.cu; Python side kernels/_gs_cuda.py, twins kernels/_gs_reference.py).
//
// The blending constants come from Python as defines (kernels/_gs_cuda.py passes the twin's values),
// so the kernels and the twins cannot drift apart; the fallbacks below are the same numbers.
#pragma once

// No project headers or cuda_fp16.h: parsing those costs every program a fifth of a second of NVRTC time.

#ifndef RF_ALPHA_MIN
#define RF_ALPHA_MIN (1.0f / 255.0f)  // alpha below this: the Gaussian is skipped at that pixel
#endif
#ifndef RF_ALPHA_MAX
#define RF_ALPHA_MAX 0.99f  // alpha is clamped here
#endif
#ifndef RF_T_MIN
#define RF_T_MIN 1e-4f  // a pixel stops before the Gaussian that would bring T to this or below
#endif
#ifndef RF_EXTEND
#define RF_EXTEND 3.33f  // tile box half-size in standard deviations
#endif

// sigma of a Gaussian at pixel offset (dx, dy) = mean - pixel centre, conic (a, b, c). Explicitly
// rounded (no FMA contraction left to the compiler), so the forward and the backward kernels get the
// same bits and agree on which pairs blend.
__device__ __forceinline__ float gs_sigma(float a, float b, float c, float dx, float dy) {
  float s = __fmul_rn(b, __fmul_rn(dx, dy));
  s = __fmaf_rn(__fmul_rn(0.5f, a), __fmul_rn(dx, dx), s);
  return __fmaf_rn(__fmul_rn(0.5f, c), __fmul_rn(dy, dy), s);
}

// Rotation matrix (row-major) of the quaternion q = (w, x, y, z) normalised; returns 1 / |q|.
__device__ __forceinline__ float gs_quat_to_rot(const float* __restrict__ q, float (&R)[3][3], float (&qn)[4]) {
  const float inv = rsqrtf(q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3]);
  const float w = q[0] * inv, x = q[1] * inv, y = q[2] * inv, z = q[3] * inv;
  qn[0] = w; qn[1] = x; qn[2] = y; qn[3] = z;
  R[0][0] = 1.f - 2.f * (y * y + z * z); R[0][1] = 2.f * (x * y - w * z); R[0][2] = 2.f * (x * z + w * y);
  R[1][0] = 2.f * (x * y + w * z); R[1][1] = 1.f - 2.f * (x * x + z * z); R[1][2] = 2.f * (y * z - w * x);
  R[2][0] = 2.f * (x * z - w * y); R[2][1] = 2.f * (y * z + w * x); R[2][2] = 1.f - 2.f * (x * x + y * y);
  return inv;
}

// Tile box [x0, x1) x [y0, y1) covered by a box of half-sizes (rx, ry) pixels around (mx, my),
// clamped to the tw x th grid (the twin's tile_ranges, same float32 arithmetic).
__device__ __forceinline__ void gs_tile_box(float mx, float my, float rx, float ry, int ts, int tw, int th,
                                            int& x0, int& x1, int& y0, int& y1) {
  const float fts = (float)ts;
  const float cx = mx / fts, cy = my / fts, trx = rx / fts, try_ = ry / fts;
  x0 = (int)fminf(fmaxf(floorf(cx - trx), 0.f), (float)tw);
  x1 = (int)fminf(fmaxf(ceilf(cx + trx), 0.f), (float)tw);
  y0 = (int)fminf(fmaxf(floorf(cy - try_), 0.f), (float)th);
  y1 = (int)fminf(fmaxf(ceilf(cy + try_), 0.f), (float)th);
}

// The sigma below which alpha = opacity exp(-sigma) can reach 1/255: ln(255 opacity), with 0.01 of
// slack for the blender's rounding (__expf, sigma's own rounding: ~1e-6 relative).
__device__ __forceinline__ float gs_reach(float opacity) {
  return logf(fmaxf(opacity, 1e-30f) / RF_ALPHA_MIN) + 0.01f;
}

// Smallest sigma over pixel offsets d = centre - mean in [lx, hx] x [ly, hy] (conic a, b, c > 0).
// tile_counts and tile_emit must take the same decisions, so everything here is explicitly
// rounded (gs_sigma too): no FMA contraction that could differ between the two kernels. A box
// whose minimum exceeds gs_reach(opacity) holds no pixel centre the Gaussian's alpha reaches.
__device__ __forceinline__ float gs_min_sigma(float a, float b, float c, float lx, float hx, float ly, float hy) {
  if (lx <= 0.f && hx >= 0.f && ly <= 0.f && hy >= 0.f) return 0.f;
  float best = 3.4e38f;
  // edges x = const: minimise over y, at y = -b x / c clamped; edges y = const likewise
  const float xs[2] = {lx, hx}, ys[2] = {ly, hy};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float x = xs[e];
    const float y = fminf(fmaxf(__fdiv_rn(-__fmul_rn(b, x), c), ly), hy);
    best = fminf(best, gs_sigma(a, b, c, x, y));
    const float y2 = ys[e];
    const float x2 = fminf(fmaxf(__fdiv_rn(-__fmul_rn(b, y2), a), lx), hx);
    best = fminf(best, gs_sigma(a, b, c, x2, y2));
  }
  return best;
}

