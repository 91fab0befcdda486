// Fused SSIM (Wang et al. 2004, "Image Quality Assessment: From Error Visibility to Structural
// Similarity") as the 3DGS training loss uses it: an 11x11 Gaussian window (sigma 1.5), each image
// plane on its own, C1 = 0.01^2, C2 = 0.03^2, zero padding. Python side: kernels/ssim.py; PyTorch
// twin with the same arithmetic up to summation order: kernels/ssim.py (ssim_reference).
//
// Per pixel p, with G the separable Gaussian blur (zero outside the image):
//   mu1 = G x, mu2 = G y, s11 = G(x^2) - mu1^2, s22 = G(y^2) - mu2^2, s12 = G(xy) - mu1 mu2,
//   A = 2 mu1 mu2 + C1, B = 2 s12 + C2, C = mu1^2 + mu2^2 + C1, D = s11 + s22 + C2, S = AB / (CD).
// The forward kernel also writes S's partial derivatives with respect to the blurred moments:
//   dS/dmu1 = 2 (mu2 (B - A) + mu1 S (C - D)) / (CD)   (mu2 <-> mu1 for dS/dmu2)
//   dS/dG(x^2) = dS/dG(y^2) = -S / D,   dS/dG(xy) = 2 A / (CD).
// The backward kernel is the adjoint: with g = dL/dS per map pixel (0 outside the averaged region),
//   dL/dx = G(g dS/dmu1) + 2 x G(g dS/dG(x^2)) + y G(g dS/dG(xy)), and alike for y;
// the window is symmetric, so the adjoint of the zero-padded blur is the same zero-padded blur.
//
// Tiles: a 16 x 16 block computes 16 x 16 map pixels from a 26 x 26 patch (5-pixel halo) in shared
// memory, blurring rows first (26 x 16 partial sums), then columns. gridDim.z = image planes.

#define SSIM_TILE 16
#define SSIM_RADIUS 5
#define SSIM_TAPS (2 * SSIM_RADIUS + 1)
#define SSIM_SPAN (SSIM_TILE + 2 * SSIM_RADIUS)
#define SSIM_C1 1.0e-4f
#define SSIM_C2 9.0e-4f

__device__ __forceinline__ float pixel_or_zero(const float* __restrict__ plane, int y, int x, int H, int W) {
  return (y >= 0 && y < H && x >= 0 && x < W) ? __ldg(plane + (long long)y * W + x) : 0.0f;
}

__device__ __forceinline__ void load_taps(const float* __restrict__ taps, float (&w)[SSIM_TAPS]) {
#pragma unroll
  for (int k = 0; k < SSIM_TAPS; ++k) w[k] = __ldg(taps + k);
}

// Row pass over a [SSIM_SPAN][SSIM_SPAN] patch into [SSIM_SPAN][SSIM_TILE] (each thread some entries).
template <int M>
__device__ __forceinline__ void blur_rows(const float (*src)[SSIM_SPAN][SSIM_SPAN],
                                          float (*dst)[SSIM_SPAN][SSIM_TILE], const float (&w)[SSIM_TAPS],
                                          int tid) {
  for (int i = tid; i < SSIM_SPAN * SSIM_TILE; i += SSIM_TILE * SSIM_TILE) {
    const int r = i / SSIM_TILE, c = i - r * SSIM_TILE;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
#pragma unroll
    for (int k = 0; k < SSIM_TAPS; ++k) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[m] = fmaf(w[k], src[m][r][c + k], acc[m]);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) dst[m][r][c] = acc[m];
  }
}

// Column pass at this thread's pixel (ty, tx) of the tile.
template <int M>
__device__ __forceinline__ void blur_column(const float (*src)[SSIM_SPAN][SSIM_TILE], const float (&w)[SSIM_TAPS],
                                            int ty, int tx, float (&out)[M]) {
#pragma unroll
  for (int m = 0; m < M; ++m) out[m] = 0.0f;
#pragma unroll
  for (int k = 0; k < SSIM_TAPS; ++k) {
#pragma unroll
    for (int m = 0; m < M; ++m) out[m] = fmaf(w[k], src[m][ty + k][tx], out[m]);
  }
}

// Both passes over a patch the whole block has written (this thread's pixel of the tile into out).
// Every thread of the block must call it (two barriers); out-of-image threads discard the result.
template <int M>
__device__ __forceinline__ void blur_patch(const float (*patch)[SSIM_SPAN][SSIM_SPAN],
                                           float (*rows)[SSIM_SPAN][SSIM_TILE],
                                           const float* __restrict__ taps, float (&out)[M]) {
  float w[SSIM_TAPS];
  load_taps(taps, w);
  __syncthreads();
  blur_rows<M>(patch, rows, w, threadIdx.y * SSIM_TILE + threadIdx.x);
  __syncthreads();
  blur_column<M>(rows, w, threadIdx.y, threadIdx.x, out);
}

// Forward: the SSIM map and, when dm_mu1 is not null, the partials the backward needs.
__global__ void ssim_fwd(const float* __restrict__ img1,     // [P, H, W]
                         const float* __restrict__ img2,     // [P, H, W]
                         const float* __restrict__ taps,     // [11] normalised Gaussian
                         float* __restrict__ ssim_map,       // [P, H, W]
                         float* __restrict__ dm_mu1,         // [P, H, W] dS/dmu1, or null
                         float* __restrict__ dm_mu2,         // [P, H, W] dS/dmu2, or null
                         float* __restrict__ dm_sq,          // [P, H, W] dS/dG(x^2) = dS/dG(y^2), or null
                         float* __restrict__ dm_cross,       // [P, H, W] dS/dG(xy), or null
                         int H, int W) {
  __shared__ float patch[5][SSIM_SPAN][SSIM_SPAN];  // x, y, x^2, y^2, xy
  __shared__ float rows[5][SSIM_SPAN][SSIM_TILE];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * SSIM_TILE + tx;
  const int x0 = blockIdx.x * SSIM_TILE - SSIM_RADIUS, y0 = blockIdx.y * SSIM_TILE - SSIM_RADIUS;
  const long long base = (long long)blockIdx.z * H * W;
  for (int i = tid; i < SSIM_SPAN * SSIM_SPAN; i += SSIM_TILE * SSIM_TILE) {
    const int r = i / SSIM_SPAN, c = i - r * SSIM_SPAN;
    const float a = pixel_or_zero(img1 + base, y0 + r, x0 + c, H, W);
    const float b = pixel_or_zero(img2 + base, y0 + r, x0 + c, H, W);
    patch[0][r][c] = a;
    patch[1][r][c] = b;
    patch[2][r][c] = a * a;
    patch[3][r][c] = b * b;
    patch[4][r][c] = a * b;
  }
  float m[5];
  blur_patch<5>(patch, rows, taps, m);
  const int x = blockIdx.x * SSIM_TILE + tx, y = blockIdx.y * SSIM_TILE + ty;
  if (x >= W || y >= H) return;  // after the last barrier
  const float mu1 = m[0], mu2 = m[1];
  const float s11 = m[2] - mu1 * mu1, s22 = m[3] - mu2 * mu2, s12 = m[4] - mu1 * mu2;
  const float A = 2.0f * mu1 * mu2 + SSIM_C1, B = 2.0f * s12 + SSIM_C2;
  const float C = mu1 * mu1 + mu2 * mu2 + SSIM_C1, D = s11 + s22 + SSIM_C2;
  const float inv_cd = 1.0f / (C * D);
  const float S = A * B * inv_cd;
  const long long at = base + (long long)y * W + x;
  ssim_map[at] = S;
  if (dm_mu1 != nullptr) {
    const float common = S * (C - D);
    dm_mu1[at] = 2.0f * inv_cd * (mu2 * (B - A) + mu1 * common);
    if (dm_mu2 != nullptr) dm_mu2[at] = 2.0f * inv_cd * (mu1 * (B - A) + mu2 * common);
    dm_sq[at] = -S / D;
    dm_cross[at] = 2.0f * A * inv_cd;
  }
}

// Backward of mean(map over the region [border, H - border) x [border, W - border)) scaled by
// *grad_scale (dL/dmean / number of pixels averaged). grad2 and dm_mu2 may be null (no gradient for y).
__global__ void ssim_bwd(const float* __restrict__ img1,        // [P, H, W]
                         const float* __restrict__ img2,        // [P, H, W]
                         const float* __restrict__ taps,        // [11]
                         const float* __restrict__ dm_mu1,      // [P, H, W]
                         const float* __restrict__ dm_mu2,      // [P, H, W] or null
                         const float* __restrict__ dm_sq,       // [P, H, W]
                         const float* __restrict__ dm_cross,    // [P, H, W]
                         const float* __restrict__ grad_scale,  // [1] dL/dS of every averaged pixel
                         float* __restrict__ grad1,             // [P, H, W] dL/dimg1
                         float* __restrict__ grad2,             // [P, H, W] dL/dimg2, or null
                         int H, int W, int border) {
  __shared__ float patch[4][SSIM_SPAN][SSIM_SPAN];  // g dS/dmu1, g dS/dmu2, g dS/dG(x^2), g dS/dG(xy)
  __shared__ float rows[4][SSIM_SPAN][SSIM_TILE];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * SSIM_TILE + tx;
  const int x0 = blockIdx.x * SSIM_TILE - SSIM_RADIUS, y0 = blockIdx.y * SSIM_TILE - SSIM_RADIUS;
  const long long base = (long long)blockIdx.z * H * W;
  const float g = __ldg(grad_scale);
  const bool want2 = grad2 != nullptr;
  for (int i = tid; i < SSIM_SPAN * SSIM_SPAN; i += SSIM_TILE * SSIM_TILE) {
    const int r = i / SSIM_SPAN, c = i - r * SSIM_SPAN;
    const int py = y0 + r, px = x0 + c;
    const bool averaged = py >= border && py < H - border && px >= border && px < W - border;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (averaged) {
      const long long at = base + (long long)py * W + px;
      v[0] = g * __ldg(dm_mu1 + at);
      v[1] = want2 ? g * __ldg(dm_mu2 + at) : 0.0f;
      v[2] = g * __ldg(dm_sq + at);
      v[3] = g * __ldg(dm_cross + at);
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) patch[m][r][c] = v[m];
  }
  float t[4];
  blur_patch<4>(patch, rows, taps, t);
  const int x = blockIdx.x * SSIM_TILE + tx, y = blockIdx.y * SSIM_TILE + ty;
  if (x >= W || y >= H) return;
  const long long at = base + (long long)y * W + x;
  const float a = __ldg(img1 + at), b = __ldg(img2 + at);
  grad1[at] = t[0] + 2.0f * a * t[2] + b * t[3];
  if (want2) grad2[at] = t[1] + 2.0f * b * t[2] + a * t[3];
}
