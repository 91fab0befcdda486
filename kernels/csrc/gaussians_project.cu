// EWA projection of 3D Gaussians into pinhole cameras and spherical-harmonics colours, forward and
// backward (Python side: kernels/_gs_cuda.py; twins: kernels/_gs_reference.py,
// project_gaussians_reference and spherical_harmonics_reference, same arithmetic).
//
// One thread per (camera, Gaussian). The backward recomputes the forward from the inputs (a few
// hundred flops) instead of saving intermediates, and adds into the per-Gaussian gradients with
// atomics (several cameras touch one Gaussian).

#include "gaussians.cuh"

// Everything the projection of Gaussian g into camera `cam` computes; valid = false when culled.
struct GsProjection {
  float mc[3];          // camera-space mean
  float R[3][3];        // rotation of the normalised quaternion
  float qn[4];          // normalised quaternion
  float inv_norm;       // 1 / |q|
  float s[3];           // scales
  float covc[3][3];     // camera-space covariance
  float J[2][3];        // perspective Jacobian at the (fov-clamped) mean
  float rz, tx, ty;     // 1 / z and the clamped x, y of the Jacobian
  bool clamp_x, clamp_y;  // the Jacobian's x / z or y / z was clamped to the field of view
  float a0, b0, c0;     // 2D covariance before the low-pass
  float a, b, c, det;   // after it, and its determinant
};

// Returns false when the depth is outside [near, far] or det <= 0 (the other culls are the caller's).
__device__ bool gs_project(const float* __restrict__ means, const float* __restrict__ quats,
                           const float* __restrict__ scales, const float* __restrict__ V,
                           const float* __restrict__ K, int g, int width, int height, float eps2d,
                           float near, float far, GsProjection& p) {
  const float m[3] = {means[3 * g], means[3 * g + 1], means[3 * g + 2]};
#pragma unroll
  for (int i = 0; i < 3; ++i) p.mc[i] = V[4 * i] * m[0] + V[4 * i + 1] * m[1] + V[4 * i + 2] * m[2] + V[4 * i + 3];
  const float z = p.mc[2];
  if (!(z >= near && z <= far)) return false;
  p.inv_norm = gs_quat_to_rot(quats + 4 * g, p.R, p.qn);
#pragma unroll
  for (int i = 0; i < 3; ++i) p.s[i] = scales[3 * g + i];
  float M[3][3], sig[3][3], WS[3][3];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) M[i][j] = p.R[i][j] * p.s[j];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) sig[i][j] = M[i][0] * M[j][0] + M[i][1] * M[j][1] + M[i][2] * M[j][2];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) WS[i][j] = V[4 * i] * sig[0][j] + V[4 * i + 1] * sig[1][j] + V[4 * i + 2] * sig[2][j];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) p.covc[i][j] = WS[i][0] * V[4 * j] + WS[i][1] * V[4 * j + 1] + WS[i][2] * V[4 * j + 2];
  const float fx = K[0], cx = K[2], fy = K[4], cy = K[5];
  const float lim_xp = (width - cx) / fx + 0.3f * (0.5f * width / fx);
  const float lim_xn = cx / fx + 0.3f * (0.5f * width / fx);
  const float lim_yp = (height - cy) / fy + 0.3f * (0.5f * height / fy);
  const float lim_yn = cy / fy + 0.3f * (0.5f * height / fy);
  p.rz = 1.f / z;
  const float xr = p.mc[0] * p.rz, yr = p.mc[1] * p.rz;
  p.clamp_x = !(xr <= lim_xp && xr >= -lim_xn);
  p.clamp_y = !(yr <= lim_yp && yr >= -lim_yn);
  p.tx = z * fminf(lim_xp, fmaxf(-lim_xn, xr));
  p.ty = z * fminf(lim_yp, fmaxf(-lim_yn, yr));
  p.J[0][0] = fx * p.rz; p.J[0][1] = 0.f; p.J[0][2] = -fx * p.tx * p.rz * p.rz;
  p.J[1][0] = 0.f; p.J[1][1] = fy * p.rz; p.J[1][2] = -fy * p.ty * p.rz * p.rz;
  float JC[2][3];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) JC[i][j] = p.J[i][0] * p.covc[0][j] + p.J[i][1] * p.covc[1][j] + p.J[i][2] * p.covc[2][j];
  p.a0 = JC[0][0] * p.J[0][0] + JC[0][1] * p.J[0][1] + JC[0][2] * p.J[0][2];
  p.b0 = JC[0][0] * p.J[1][0] + JC[0][1] * p.J[1][1] + JC[0][2] * p.J[1][2];
  p.c0 = JC[1][0] * p.J[1][0] + JC[1][1] * p.J[1][1] + JC[1][2] * p.J[1][2];
  p.a = p.a0 + eps2d;
  p.b = p.b0;
  p.c = p.c0 + eps2d;
  p.det = p.a * p.c - p.b * p.b;
  return p.det > 0.f;
}

// The input checks of kernels/gaussians.py in one pass (one host read instead of a dozen small
// reductions): flags |= 1 non-finite mean, 2 non-finite scale, 4 non-finite quaternion,
// 8 quaternion of squared norm 0 or inf, 16 non-finite viewmat, 32 Ks non-finite or fx, fy <= 0.
__global__ void check_inputs(long long N, const float* __restrict__ means,  // [N, 3]
                             const float* __restrict__ quats,                // [N, 4]
                             const float* __restrict__ scales,               // [N, 3]
                             int C, const float* __restrict__ viewmats,      // [C, 4, 4]
                             const float* __restrict__ Ks,                   // [C, 3, 3]
                             int* __restrict__ flags) {                      // [1] zero
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  int bad = 0;
  if (i < N) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (!isfinite(means[3 * i + k])) bad |= 1;
      if (!isfinite(scales[3 * i + k])) bad |= 2;
    }
    float n2 = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float q = quats[4 * i + k];
      if (!isfinite(q)) bad |= 4;
      n2 = __fmaf_rn(q, q, n2);
    }
    if (!(n2 > 0.f && isfinite(n2))) bad |= 8;
  }
  if (i < C) {
    for (int k = 0; k < 16; ++k)
      if (!isfinite(viewmats[16 * i + k])) bad |= 16;
    for (int k = 0; k < 9; ++k)
      if (!isfinite(Ks[9 * i + k])) bad |= 32;
    if (!(Ks[9 * i] > 0.f && Ks[9 * i + 4] > 0.f)) bad |= 32;
  }
  if (bad) atomicOr(flags, bad);
}

// Culled entries keep the zeros the caller allocated (radii 0).
__global__ void projection_fwd(const float* __restrict__ means,      // [N, 3]
                               const float* __restrict__ quats,      // [N, 4]
                               const float* __restrict__ scales,     // [N, 3]
                               const float* __restrict__ opacities,  // [N] or nullptr (no opacity-aware box)
                               const float* __restrict__ viewmats,   // [C, 4, 4]
                               const float* __restrict__ Ks,         // [C, 3, 3]
                               int C, int N, int width, int height, float eps2d, float near, float far,
                               float radius_clip, int antialiased,
                               int* __restrict__ radii,              // [C, N, 2] zeros
                               float* __restrict__ means2d,          // [C, N, 2] zeros
                               float* __restrict__ depths,           // [C, N] zeros
                               float* __restrict__ conics,           // [C, N, 3] zeros
                               float* __restrict__ comps) {          // [C, N] zeros
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)C * N) return;
  const int cam = (int)(idx / N), g = (int)(idx % N);
  GsProjection p;
  if (!gs_project(means, quats, scales, viewmats + 16 * cam, Ks + 9 * cam, g, width, height, eps2d, near, far, p))
    return;
  const float comp = sqrtf(fmaxf(0.f, (p.a0 * p.c0 - p.b0 * p.b0) / p.det));
  float extend = RF_EXTEND;
  if (opacities != nullptr) {
    const float op = opacities[g] * (antialiased ? comp : 1.f);
    if (op < RF_ALPHA_MIN) return;
    extend = fminf(extend, sqrtf(2.f * logf(fmaxf(op, RF_ALPHA_MIN) / RF_ALPHA_MIN)));  // alpha's 1/255 contour
  }
  const float rx = ceilf(extend * sqrtf(fmaxf(p.a, 0.f))), ry = ceilf(extend * sqrtf(fmaxf(p.c, 0.f)));
  if (rx <= radius_clip && ry <= radius_clip) return;
  const float* K = Ks + 9 * cam;
  const float u = K[0] * p.mc[0] * p.rz + K[2], v = K[4] * p.mc[1] * p.rz + K[5];
  if (!(u + rx > 0.f && u - rx < width && v + ry > 0.f && v - ry < height)) return;
  radii[2 * idx] = (int)rx;
  radii[2 * idx + 1] = (int)ry;
  means2d[2 * idx] = u;
  means2d[2 * idx + 1] = v;
  depths[idx] = p.mc[2];
  conics[3 * idx] = p.c / p.det;
  conics[3 * idx + 1] = -p.b / p.det;
  conics[3 * idx + 2] = p.a / p.det;
  comps[idx] = comp;
}

// Backward of projection_fwd for the visible entries (radii > 0): the gradients of means2d, depths,
// conics and (antialiased) compensations go to means, quats and scales.
__global__ void projection_bwd(const float* __restrict__ means, const float* __restrict__ quats,
                               const float* __restrict__ scales, const float* __restrict__ viewmats,
                               const float* __restrict__ Ks, int C, int N, int width, int height, float eps2d,
                               float near, float far,
                               const int* __restrict__ radii,          // [C, N, 2]
                               const float* __restrict__ v_means2d,    // [C, N, 2]
                               const float* __restrict__ v_depths,     // [C, N]
                               const float* __restrict__ v_conics,     // [C, N, 3]
                               const float* __restrict__ v_comps,      // [C, N] or nullptr
                               float* __restrict__ v_means,            // [N, 3] zeros, accumulated
                               float* __restrict__ v_quats,            // [N, 4]
                               float* __restrict__ v_scales) {         // [N, 3]
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)C * N || radii[2 * idx] <= 0 || radii[2 * idx + 1] <= 0) return;
  const int cam = (int)(idx / N), g = (int)(idx % N);
  const float* V = viewmats + 16 * cam;
  const float* K = Ks + 9 * cam;
  GsProjection p;
  if (!gs_project(means, quats, scales, V, K, g, width, height, eps2d, near, far, p)) return;
  const float fx = K[0], fy = K[4], rz = p.rz;
  // conic = [[A, B], [B, Cc]] = inverse of [[a, b], [b, c]]: dL/dSigma2d = -Q G Q (G: dL/dQ, symmetric)
  const float A = p.c / p.det, B = -p.b / p.det, Cc = p.a / p.det;
  const float gA = v_conics[3 * idx], gB = 0.5f * v_conics[3 * idx + 1], gC = v_conics[3 * idx + 2];
  const float P00 = A * gA + B * gB, P01 = A * gB + B * gC, P10 = B * gA + Cc * gB, P11 = B * gB + Cc * gC;
  float ga = -(P00 * A + P01 * B), gb = -2.f * (P00 * B + P01 * Cc), gc = -(P10 * B + P11 * Cc);
  if (v_comps != nullptr) {  // comp = sqrt(r), r = det(Sigma2d - eps I) / det(Sigma2d)
    const float r = (p.a0 * p.c0 - p.b0 * p.b0) / p.det;
    if (r > 0.f) {
      const float k = v_comps[idx] * 0.5f / sqrtf(r) / p.det;
      ga += k * (p.c0 - r * p.c);
      gc += k * (p.a0 - r * p.a);
      gb += k * (-2.f * p.b0 * (1.f - r));
    }
  }
  // Sigma2d = J covc J^T: dL/dcovc = J^T G2 J, dL/dJ = 2 G2 J covc (G2 symmetric)
  const float G2[2][2] = {{ga, 0.5f * gb}, {0.5f * gb, gc}};
  float G2J[2][3], GC[3][3], GJ[2][3];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) G2J[i][j] = G2[i][0] * p.J[0][j] + G2[i][1] * p.J[1][j];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) GC[i][j] = p.J[0][i] * G2J[0][j] + p.J[1][i] * G2J[1][j];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j)
      GJ[i][j] = 2.f * (G2J[i][0] * p.covc[0][j] + G2J[i][1] * p.covc[1][j] + G2J[i][2] * p.covc[2][j]);
  // camera-space mean: through means2d, depth and the Jacobian
  const float gu = v_means2d[2 * idx], gv = v_means2d[2 * idx + 1];
  float gm[3];
  gm[0] = gu * fx * rz;
  gm[1] = gv * fy * rz;
  gm[2] = v_depths[idx] - (gu * fx * p.mc[0] + gv * fy * p.mc[1]) * rz * rz;
  gm[2] -= (GJ[0][0] * fx + GJ[1][1] * fy) * rz * rz;  // J00 = fx / z, J11 = fy / z
  if (!p.clamp_x) {  // J02 = -fx x / z^2
    gm[0] -= GJ[0][2] * fx * rz * rz;
    gm[2] += GJ[0][2] * 2.f * fx * p.mc[0] * rz * rz * rz;
  } else {  // J02 = -fx L / z with L the clamp limit: d/dz = fx tx / z^3
    gm[2] += GJ[0][2] * fx * p.tx * rz * rz * rz;
  }
  if (!p.clamp_y) {
    gm[1] -= GJ[1][2] * fy * rz * rz;
    gm[2] += GJ[1][2] * 2.f * fy * p.mc[1] * rz * rz * rz;
  } else {
    gm[2] += GJ[1][2] * fy * p.ty * rz * rz * rz;
  }
  // world: mc = W m + t -> W^T gm; covc = W sig W^T -> dL/dsig = W^T GC W
  float WG[3][3], Gs[3][3];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) WG[i][j] = V[i] * GC[0][j] + V[4 + i] * GC[1][j] + V[8 + i] * GC[2][j];  // W^T GC
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int j = 0; j < 3; ++j) Gs[i][j] = WG[i][0] * V[j] + WG[i][1] * V[4 + j] + WG[i][2] * V[8 + j];
#pragma unroll
  for (int j = 0; j < 3; ++j) atomicAdd(v_means + 3 * g + j, V[j] * gm[0] + V[4 + j] * gm[1] + V[8 + j] * gm[2]);
  // sig = M M^T, M = R diag(s): dL/dM = 2 Gs M; dL/dR = dL/dM diag(s); dL/ds_j = sum_i dL/dM_ij R_ij
  float GR[3][3];
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    float gs = 0.f;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const float gM = 2.f * (Gs[i][0] * p.R[0][j] + Gs[i][1] * p.R[1][j] + Gs[i][2] * p.R[2][j]) * p.s[j];
      GR[i][j] = gM * p.s[j];
      gs += gM * p.R[i][j];
    }
    atomicAdd(v_scales + 3 * g + j, gs);
  }
  // rotation of the normalised quaternion (w, x, y, z), then through the normalisation
  const float w = p.qn[0], x = p.qn[1], y = p.qn[2], z = p.qn[3];
  float gq[4];
  gq[0] = 2.f * (x * (GR[2][1] - GR[1][2]) + y * (GR[0][2] - GR[2][0]) + z * (GR[1][0] - GR[0][1]));
  gq[1] = 2.f * (y * (GR[0][1] + GR[1][0]) + z * (GR[0][2] + GR[2][0]) + w * (GR[2][1] - GR[1][2]) -
                 2.f * x * (GR[1][1] + GR[2][2]));
  gq[2] = 2.f * (x * (GR[0][1] + GR[1][0]) + w * (GR[0][2] - GR[2][0]) + z * (GR[1][2] + GR[2][1]) -
                 2.f * y * (GR[0][0] + GR[2][2]));
  gq[3] = 2.f * (w * (GR[1][0] - GR[0][1]) + x * (GR[0][2] + GR[2][0]) + y * (GR[1][2] + GR[2][1]) -
                 2.f * z * (GR[0][0] + GR[1][1]));
  const float dot = gq[0] * w + gq[1] * x + gq[2] * y + gq[3] * z;
#pragma unroll
  for (int i = 0; i < 4; ++i) atomicAdd(v_quats + 4 * g + i, (gq[i] - dot * p.qn[i]) * p.inv_norm);
}

// ---------------------------------------------------------------------------- spherical harmonics

#define SH_C0 0.28209479177387814f
#define SH_C1 0.4886025119029199f

// Basis of degree <= 3 at the unit direction (x, y, z) (3DGS order and constants) and, with
// grad != nullptr, its partial derivatives d basis_k / d(x, y, z) (treating x, y, z as free).
__device__ __forceinline__ void gs_sh_basis(int degree, float x, float y, float z, float (&Y)[16],
                                            float (*grad)[3]) {
  Y[0] = SH_C0;
  if (grad) grad[0][0] = grad[0][1] = grad[0][2] = 0.f;
  if (degree < 1) return;
  Y[1] = -SH_C1 * y; Y[2] = SH_C1 * z; Y[3] = -SH_C1 * x;
  if (grad) {
    grad[1][0] = 0.f; grad[1][1] = -SH_C1; grad[1][2] = 0.f;
    grad[2][0] = 0.f; grad[2][1] = 0.f; grad[2][2] = SH_C1;
    grad[3][0] = -SH_C1; grad[3][1] = 0.f; grad[3][2] = 0.f;
  }
  if (degree < 2) return;
  const float xx = x * x, yy = y * y, zz = z * z, xy = x * y, yz = y * z, xz = x * z;
  const float c20 = 1.0925484305920792f, c21 = -1.0925484305920792f, c22 = 0.31539156525252005f,
              c23 = -1.0925484305920792f, c24 = 0.5462742152960396f;
  Y[4] = c20 * xy; Y[5] = c21 * yz; Y[6] = c22 * (2.f * zz - xx - yy); Y[7] = c23 * xz; Y[8] = c24 * (xx - yy);
  if (grad) {
    grad[4][0] = c20 * y; grad[4][1] = c20 * x; grad[4][2] = 0.f;
    grad[5][0] = 0.f; grad[5][1] = c21 * z; grad[5][2] = c21 * y;
    grad[6][0] = -2.f * c22 * x; grad[6][1] = -2.f * c22 * y; grad[6][2] = 4.f * c22 * z;
    grad[7][0] = c23 * z; grad[7][1] = 0.f; grad[7][2] = c23 * x;
    grad[8][0] = 2.f * c24 * x; grad[8][1] = -2.f * c24 * y; grad[8][2] = 0.f;
  }
  if (degree < 3) return;
  const float c30 = -0.5900435899266435f, c31 = 2.890611442640554f, c32 = -0.4570457994644658f,
              c33 = 0.3731763325901154f, c34 = -0.4570457994644658f, c35 = 1.445305721320277f,
              c36 = -0.5900435899266435f;
  Y[9] = c30 * y * (3.f * xx - yy);
  Y[10] = c31 * xy * z;
  Y[11] = c32 * y * (4.f * zz - xx - yy);
  Y[12] = c33 * z * (2.f * zz - 3.f * xx - 3.f * yy);
  Y[13] = c34 * x * (4.f * zz - xx - yy);
  Y[14] = c35 * z * (xx - yy);
  Y[15] = c36 * x * (xx - 3.f * yy);
  if (grad) {
    grad[9][0] = 6.f * c30 * xy; grad[9][1] = 3.f * c30 * (xx - yy); grad[9][2] = 0.f;
    grad[10][0] = c31 * yz; grad[10][1] = c31 * xz; grad[10][2] = c31 * xy;
    grad[11][0] = -2.f * c32 * xy; grad[11][1] = c32 * (4.f * zz - xx - 3.f * yy); grad[11][2] = 8.f * c32 * yz;
    grad[12][0] = -6.f * c33 * xz; grad[12][1] = -6.f * c33 * yz; grad[12][2] = c33 * (6.f * zz - 3.f * xx - 3.f * yy);
    grad[13][0] = c34 * (4.f * zz - 3.f * xx - yy); grad[13][1] = -2.f * c34 * xy; grad[13][2] = 8.f * c34 * xz;
    grad[14][0] = 2.f * c35 * xz; grad[14][1] = -2.f * c35 * yz; grad[14][2] = c35 * (xx - yy);
    grad[15][0] = 3.f * c36 * (xx - yy); grad[15][1] = -6.f * c36 * xy; grad[15][2] = 0.f;
  }
}

// The SH kernels run one thread per (item, channel): grid thread t takes item t / 3 and channel
// t % 3. A coefficient set is 3K consecutive floats (192 bytes at degree 3); the three threads of
// an item read its set at offsets ch, ch + 3, ..., so a warp's loads of one basis function fall on
// the ~11 sets it covers, and the loads of the next functions hit the same cache lines. One thread
// per item instead (each reading its whole set) touches a cache line per thread per load, and
// staging the sets through shared memory capped the blocks an SM holds (both measured slower on
// the H200, benchmarks/bench_rasterizer.py --profile). Blocks are a multiple of 3 threads, so an
// item's three threads share a block (sh_bwd sums their direction gradients in shared memory).
#ifndef RF_SH_BLOCK
#define RF_SH_BLOCK 192
#endif
static_assert(RF_SH_BLOCK % 3 == 0, "an item's three channel threads must share a block");

// colors[i, ch] = sum_k basis_k(dirs[i] / |dirs[i]|) coeff(i % n_coeff_items, k, ch), K coefficients a set,
// read from two arrays so that 3DGS's sh0 [N, 1, 3] and shN [N, K - 1, 3] need no concatenation:
// coefficient 0 of set s is dc[s * dc_stride + ch], coefficient k >= 1 is rest[s * rest_stride + 3 (k - 1) + ch]
// (one [N, K, 3] tensor: dc = coeffs, rest = coeffs + 3, both strides 3 K).
// n_coeff_items < items broadcasts one coefficient set over several cameras ([C, N] dirs, [N] sets).
// The loops over the 16 basis functions are unrolled with a guard on the degree, so the basis stays
// in registers (a loop to a runtime bound indexes it, which puts it in local memory).
__global__ void __launch_bounds__(RF_SH_BLOCK) sh_fwd(int degree, long long items, long long n_coeff_items, int K,
                       const float* __restrict__ dirs,     // [items, 3]
                       const float* __restrict__ dc,       // coefficient 0 of each set
                       long long dc_stride,
                       const float* __restrict__ rest,     // coefficients 1 .. K - 1 of each set
                       long long rest_stride,
                       float* __restrict__ colors) {       // [items, 3]
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= 3 * items) return;
  const long long i = t / 3;
  const int ch = (int)(t - 3 * i);
  const int nb = (degree + 1) * (degree + 1);
  const float dx = dirs[3 * i], dy = dirs[3 * i + 1], dz = dirs[3 * i + 2];
  const float inv = rsqrtf(fmaxf(dx * dx + dy * dy + dz * dz, 1e-30f));
  float Y[16];
  gs_sh_basis(degree, dx * inv, dy * inv, dz * inv, Y, nullptr);
  const long long set = i % n_coeff_items;
  const float* c = rest + set * rest_stride + ch;  // c[3 (k - 1)]: coefficient k >= 1
  float sum = Y[0] * dc[set * dc_stride + ch];
#pragma unroll
  for (int k = 1; k < 16; ++k) {
    if (k < nb) sum += Y[k] * c[3 * (k - 1)];
  }
  colors[t] = sum;  // = colors[3 * i + ch]
}

// Backward of sh_fwd, one thread per (coefficient set, channel): it walks the items that share the
// set (items / n_coeff_items cameras, item = camera * n_coeff_items + set), sums its channel's
// v_coeffs in registers and stores them once, so there are no atomics and no zero fill: every
// coefficient of the set is written, those past the degree with 0. When v_dirs != nullptr, each
// item's direction gradient is the sum of its three channel threads' parts (through shared memory,
// so every thread of the block runs every camera's iteration), then goes through the normalisation.
__global__ void __launch_bounds__(RF_SH_BLOCK) sh_bwd(int degree, long long items, long long n_coeff_items, int K,
                       const float* __restrict__ dirs,
                       const float* __restrict__ dc, long long dc_stride,      // as in sh_fwd
                       const float* __restrict__ rest, long long rest_stride,
                       const float* __restrict__ v_colors,   // [items, 3]
                       float* __restrict__ v_dc,             // laid out as dc
                       float* __restrict__ v_rest,           // laid out as rest
                       float* __restrict__ v_dirs) {         // [items, 3] or nullptr
  __shared__ float part[RF_SH_BLOCK * 3];
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long set = t / 3;
  const int ch = (int)(t - 3 * set);
  const bool live = set < n_coeff_items;
  const int nb = (degree + 1) * (degree + 1);
  const long long cams = items / n_coeff_items;
  float c[16];  // this channel of the set's coefficients, read once for all cameras
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    c[k] = (live && v_dirs != nullptr && k < nb)
               ? (k == 0 ? dc[set * dc_stride + ch] : rest[set * rest_stride + 3 * (k - 1) + ch]) : 0.f;
  }
  float acc[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) acc[k] = 0.f;
  for (long long cam = 0; cam < cams; ++cam) {
    const long long i = cam * n_coeff_items + set;
    float u[3] = {0.f, 0.f, 0.f}, gu[3] = {0.f, 0.f, 0.f}, inv = 0.f;
    if (live) {
      const float dx = dirs[3 * i], dy = dirs[3 * i + 1], dz = dirs[3 * i + 2];
      inv = rsqrtf(fmaxf(dx * dx + dy * dy + dz * dz, 1e-30f));
      u[0] = dx * inv; u[1] = dy * inv; u[2] = dz * inv;
      float Y[16], dY[16][3];  // dY always: a conditional pointer to it would put it in local memory
      gs_sh_basis(degree, u[0], u[1], u[2], Y, dY);
      const float g = v_colors[3 * i + ch];
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        if (k < nb) {
          acc[k] += Y[k] * g;
#pragma unroll
          for (int j = 0; j < 3; ++j) gu[j] += c[k] * g * dY[k][j];
        }
      }
    }
    if (v_dirs != nullptr) {  // the same for the whole block
#pragma unroll
      for (int j = 0; j < 3; ++j) part[3 * threadIdx.x + j] = gu[j];
      __syncthreads();
      if (live && ch == 0) {  // u = d / |d|: dL/dd = (gu - (gu . u) u) / |d|
        const float* p = part + 3 * threadIdx.x;  // this item's three threads, 9 floats
        const float s[3] = {p[0] + p[3] + p[6], p[1] + p[4] + p[7], p[2] + p[5] + p[8]};
        const float dot = s[0] * u[0] + s[1] * u[1] + s[2] * u[2];
#pragma unroll
        for (int j = 0; j < 3; ++j) v_dirs[3 * i + j] = (s[j] - dot * u[j]) * inv;
      }
      __syncthreads();
    }
  }
  if (!live) return;
  v_dc[set * dc_stride + ch] = acc[0];
  float* vc = v_rest + set * rest_stride + ch;  // vc[3 (k - 1)]: coefficient k >= 1
#pragma unroll
  for (int k = 1; k < 16; ++k) {
    if (k < K) vc[3 * (k - 1)] = acc[k];  // 0 past the degree
  }
  for (int k = 16; k < K; ++k) vc[3 * (k - 1)] = 0.f;  // unused rows
}
