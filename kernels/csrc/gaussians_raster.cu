// Front-to-back alpha blending of depth-sorted Gaussians per tile, forward and backward
// (Python side: kernels/_gs_cuda.py; twin: rasterize_to_pixels_reference in kernels/_gs_reference.py).
//
// One block per (tile, camera), one thread per pixel. The block walks its tile's list in batches
// of blockDim Gaussians staged through shared memory.
//
// Backward: the reference 3DGS replay, back to front per pixel (T recovered by dividing by
// 1 - alpha, the colour behind accumulated), chosen over a per-splat backward because it needs
// nothing from the forward but each pixel's final T (saved as T, not as 1 - alpha, which rounds
// away T's low bits where a pixel is nearly opaque) and last index, no per-pixel checkpoints.
// What makes it cheap:
//  * per Gaussian, a warp's 16 gradient values (mean 2, |mean| 2, conic 3, opacity 1, colour D,
//    padding) are summed across the 32 lanes by a reduce-scatter (16 shuffles instead of
//    5 x 16: at each of four halvings a lane sends the half of its values its partner keeps), so
//    lane 2j ends with the warp's sum of value j;
//  * those sums go to a per-batch accumulator in shared memory (8 warps add to one slot) and one
//    thread per Gaussian adds the block's total to global memory after the batch: one set of
//    global atomics per (tile, Gaussian) instead of one per (warp, Gaussian);
//  * a warp skips a Gaussian no lane of it blends (ballot), and the part of the list beyond the
//    last Gaussian any of its pixels blended.
// Both passes stage with each Gaussian a mask of the block's warps whose pixel rows it can reach
// at alpha >= 1/255 (conservatively: the rows within the ellipse's vertical extent); a warp skips
// the Gaussians whose bit is clear without evaluating them, which changes nothing but the work:
// its pixels would all have skipped them.

#include "gaussians.cuh"

constexpr int kValues = 16;  // gradient values per Gaussian in the backward's reduction

struct GsEntry {             // one staged Gaussian
  float x, y, opacity, a;
  float b, c;
};

__device__ __forceinline__ void gs_load_entry(int g, const float* __restrict__ means2d,
                                              const float* __restrict__ conics,
                                              const float* __restrict__ opacities, float4& p, float2& q) {
  const float2 m = reinterpret_cast<const float2*>(means2d)[g];
  p = make_float4(m.x, m.y, opacities[g], conics[3 * (long long)g]);
  q = make_float2(conics[3 * (long long)g + 1], conics[3 * (long long)g + 2]);
}

// alpha of a staged Gaussian at pixel centre (px, py); false when skipped (sigma < 0, alpha < 1/255,
// or either NaN: a garbage Gaussian is skipped, as the twin skips it).
__device__ __forceinline__ bool gs_alpha(const float4& p, const float2& q, float px, float py, float& dx,
                                         float& dy, float& vis, float& alpha) {
  dx = __fsub_rn(p.x, px);
  dy = __fsub_rn(p.y, py);
  const float sigma = gs_sigma(p.w, q.x, q.y, dx, dy);
  vis = __expf(-sigma);
  alpha = fminf(RF_ALPHA_MAX, __fmul_rn(p.z, vis));
  return sigma >= 0.f && alpha >= RF_ALPHA_MIN;
}

// Bit w: warp w's rows of the tile (32 / ts rows) hold a pixel centre whose row lies within the
// vertical extent of the staged Gaussian's alpha >= 1/255 ellipse, p = (x, y, opacity, a), q = (b, c):
// sigma <= tau bounds |dy| by sqrt(2 tau (Q^-1)_yy) = sqrt(2 tau a / det Q), with 0.1 % + 0.001 px
// of slack (cheap enough for the staging step: few registers, no division per warp).
__device__ __forceinline__ unsigned gs_warp_mask(const float4& p, const float2& q, int y0, int ts) {
  const float a = p.w, b = q.x, c = q.y;
  const int n_warps = ts * ts / 32, rows = 32 / ts;
  const unsigned all = n_warps == 32 ? 0xffffffffu : (1u << n_warps) - 1u;
  const float det = a * c - b * b;
  if (!(a > 0.f && c > 0.f && det > 0.f)) return all;  // no bound: every warp looks
  const float tau = gs_reach(p.z);
  if (!(tau > 0.f)) return 0u;
  const float ext = sqrtf(2.f * tau * a / det) * 1.001f + 0.001f;
  // rows whose centre r + 0.5 is within p.y +- ext, relative to the tile's first row
  const float lo = ceilf(p.y - ext - 0.5f) - (float)y0, hi = floorf(p.y + ext - 0.5f) - (float)y0;
  if (!(hi >= 0.f && lo <= (float)(ts - 1))) return 0u;
  const int w0 = (int)fmaxf(lo, 0.f) / rows, w1 = (int)fminf(hi, (float)(ts - 1)) / rows;
  const unsigned upto = w1 >= 31 ? 0xffffffffu : (2u << w1) - 1u;  // bits 0 .. w1
  return upto & ~((1u << w0) - 1u) & all;                           // minus bits 0 .. w0 - 1
}

// The run of tile ``tile_global`` in flatten_ids; the last tile's ends at M, or at min(M, *needed)
// under a fixed budget (tile_finish's ``needed``: only that many entries are real).
__device__ __forceinline__ void gs_tile_range(const int* __restrict__ offsets, long long tile_global,
                                              long long total_tiles, int M, const long long* __restrict__ needed,
                                              int& start, int& end) {
  start = offsets[tile_global];
  if (tile_global + 1 < total_tiles) {
    end = offsets[tile_global + 1];
  } else {
    end = needed != nullptr ? (int)min((long long)M, *needed) : M;
  }
}

// grid (tw, th, C), block (ts, ts), dynamic shared memory blockDim * (7 + D) * 4 bytes.
template <int D>
__global__ void rasterize_fwd(const float* __restrict__ means2d,      // [C*N, 2]
                              const float* __restrict__ conics,       // [C*N, 3]
                              const float* __restrict__ colors,       // [C*N, D]
                              const float* __restrict__ opacities,    // [C*N]
                              const float* __restrict__ backgrounds,  // [C, D] or nullptr
                              const int* __restrict__ offsets,        // [C, th, tw]
                              const int* __restrict__ flatten_ids,    // [M]
                              int M, const long long* __restrict__ needed,  // [1] or nullptr
                              int width, int height,
                              float* __restrict__ out_colors,         // [C, H, W, D]
                              float* __restrict__ out_alphas,         // [C, H, W]: 1 - T
                              float* __restrict__ out_T,              // [C, H, W]: T itself, for the backward
                              int* __restrict__ last_ids) {           // [C, H, W]
  extern __shared__ float4 smem_fwd[];
  const int bs = blockDim.x * blockDim.y;
  float4* s_p = smem_fwd;
  float2* s_q = reinterpret_cast<float2*>(s_p + bs);
  float* s_col = reinterpret_cast<float*>(s_q + bs);
  unsigned* s_mask = reinterpret_cast<unsigned*>(s_col + bs * D);
  const int cam = blockIdx.z, tw = gridDim.x, th = gridDim.y;
  const long long total_tiles = (long long)gridDim.z * tw * th;
  const int tr = threadIdx.y * blockDim.x + threadIdx.x, warp = tr >> 5;
  const int y0 = blockIdx.y * blockDim.y;
  const int px_i = blockIdx.x * blockDim.x + threadIdx.x, py_i = blockIdx.y * blockDim.y + threadIdx.y;
  const bool inside = px_i < width && py_i < height;
  const float px = px_i + 0.5f, py = py_i + 0.5f;
  int start, end;
  gs_tile_range(offsets, ((long long)cam * th + blockIdx.y) * tw + blockIdx.x, total_tiles, M, needed, start, end);
  float T = 1.f, acc[D];
#pragma unroll
  for (int k = 0; k < D; ++k) acc[k] = 0.f;
  int last = -1;
  bool done = !inside;
  for (int b0 = start; b0 < end; b0 += bs) {
    if (__syncthreads_count(done) == bs) break;  // also: the previous batch is no longer read
    if (b0 + tr < end) {
      const int g = flatten_ids[b0 + tr];
      float4 p;
      float2 q;
      gs_load_entry(g, means2d, conics, opacities, p, q);
      s_p[tr] = p;
      s_q[tr] = q;
      s_mask[tr] = gs_warp_mask(p, q, y0, blockDim.x);
#pragma unroll
      for (int k = 0; k < D; ++k) s_col[tr * D + k] = colors[(long long)g * D + k];
    }
    __syncthreads();
    const int n = min(bs, end - b0);
    for (int t = 0; t < n && !done; ++t) {
      if (!((s_mask[t] >> warp) & 1u)) continue;  // none of this warp's pixels reaches it
      float dx, dy, vis, alpha;
      if (!gs_alpha(s_p[t], s_q[t], px, py, dx, dy, vis, alpha)) continue;
      const float next = T * (1.f - alpha);
      if (next <= RF_T_MIN) {
        done = true;
        break;
      }
      const float w = alpha * T;
#pragma unroll
      for (int k = 0; k < D; ++k) acc[k] += w * s_col[t * D + k];
      last = b0 + t;
      T = next;
    }
  }
  if (!inside) return;
  const long long pix = ((long long)cam * height + py_i) * width + px_i;
  out_alphas[pix] = 1.f - T;
  out_T[pix] = T;  // 1 - alpha in float32 loses T's low bits where T is small (saturated pixels)
  last_ids[pix] = last;
#pragma unroll
  for (int k = 0; k < D; ++k)
    out_colors[pix * D + k] = acc[k] + (backgrounds != nullptr ? T * backgrounds[cam * D + k] : 0.f);
}

// One halving of the reduce-scatter: lanes with bit 2 * HALF set keep the upper HALF of v[0 .. 2 HALF)
// and send the lower one to their partner, which keeps the lower; each adds what it receives.
template <int HALF>
__device__ __forceinline__ void gs_halve(float (&v)[kValues], int lane) {
  const bool upper = (lane & (2 * HALF)) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float send = upper ? v[i] : v[i + HALF];
    const float keep = upper ? v[i + HALF] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * HALF);
  }
}

// Sum v over the warp's 32 lanes; lanes 2j and 2j + 1 return the sum of value j.
__device__ __forceinline__ float gs_reduce_scatter16(float (&v)[kValues], int lane) {
  static_assert(kValues == 16, "four halvings and one exchange: 16 values over 32 lanes");
  gs_halve<8>(v, lane);
  gs_halve<4>(v, lane);
  gs_halve<2>(v, lane);
  gs_halve<1>(v, lane);
  return v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
}

__device__ __forceinline__ int gs_warp_max(int v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// grid (tw, th, C), block (ts, ts) (a multiple of 32 threads), dynamic shared memory
// blockDim * (8 + D + kValues) * 4 bytes. Gradients are added into zero-initialised buffers.
template <int D>
__global__ void rasterize_bwd(const float* __restrict__ means2d, const float* __restrict__ conics,
                              const float* __restrict__ colors, const float* __restrict__ opacities,
                              const float* __restrict__ backgrounds, const int* __restrict__ offsets,
                              const int* __restrict__ flatten_ids, int M,
                              const long long* __restrict__ needed, int width, int height,
                              const float* __restrict__ out_T,        // [C, H, W] final transmittance
                              const int* __restrict__ last_ids,       // [C, H, W]
                              const float* __restrict__ g_colors,     // [C, H, W, D]
                              const float* __restrict__ g_alphas,     // [C, H, W] or nullptr
                              float* __restrict__ v_means2d,          // [C*N, 2]
                              float* __restrict__ v_absgrad,          // [C*N, 2] or nullptr
                              float* __restrict__ v_conics,           // [C*N, 3]
                              float* __restrict__ v_colors,           // [C*N, D]
                              float* __restrict__ v_opacities) {      // [C*N]
  static_assert(8 + D <= kValues, "too many channels for the reduction");
  extern __shared__ float4 smem_bwd[];
  const int bs = blockDim.x * blockDim.y;
  float4* s_p = smem_bwd;
  float2* s_q = reinterpret_cast<float2*>(s_p + bs);
  float* s_col = reinterpret_cast<float*>(s_q + bs);
  float* s_acc = s_col + bs * D;                       // [bs, kValues]
  int* s_id = reinterpret_cast<int*>(s_acc + bs * kValues);
  unsigned* s_mask = reinterpret_cast<unsigned*>(s_id + bs);
  const int cam = blockIdx.z, tw = gridDim.x, th = gridDim.y;
  const long long total_tiles = (long long)gridDim.z * tw * th;
  const int tr = threadIdx.y * blockDim.x + threadIdx.x, lane = tr & 31, warp = tr >> 5;
  const int y0 = blockIdx.y * blockDim.y;
  const int px_i = blockIdx.x * blockDim.x + threadIdx.x, py_i = blockIdx.y * blockDim.y + threadIdx.y;
  const bool inside = px_i < width && py_i < height;
  const float px = px_i + 0.5f, py = py_i + 0.5f;
  int start, end;
  gs_tile_range(offsets, ((long long)cam * th + blockIdx.y) * tw + blockIdx.x, total_tiles, M, needed, start, end);
  const long long pix = inside ? ((long long)cam * height + py_i) * width + px_i : 0;
  const float T_final = inside ? out_T[pix] : 1.f;
  const int last = inside ? last_ids[pix] : -1;
  float g_c[D], behind[D], bg_dot = 0.f;
#pragma unroll
  for (int k = 0; k < D; ++k) {
    g_c[k] = inside ? g_colors[pix * D + k] : 0.f;
    behind[k] = 0.f;
    if (backgrounds != nullptr) bg_dot += backgrounds[cam * D + k] * g_c[k];
  }
  const float g_a = inside && g_alphas != nullptr ? g_alphas[pix] : 0.f;
  // dL/dT_final = background . dL/dcolour - dL/dalpha; every blended alpha scales T_final
  const float g_T = bg_dot - g_a;
  const int warp_last = gs_warp_max(last);
  float T = T_final;
  for (int b_end = end - 1; b_end >= start; b_end -= bs) {  // b_end: the batch's last list index
    const int n = min(bs, b_end + 1 - start);
    __syncthreads();  // the previous batch is flushed
    if (tr < n) {
      const int g = flatten_ids[b_end - tr];
      s_id[tr] = g;
      float4 p;
      float2 q;
      gs_load_entry(g, means2d, conics, opacities, p, q);
      s_p[tr] = p;
      s_q[tr] = q;
      s_mask[tr] = gs_warp_mask(p, q, y0, blockDim.x);
#pragma unroll
      for (int k = 0; k < D; ++k) s_col[tr * D + k] = colors[(long long)g * D + k];
#pragma unroll
      for (int j = 0; j < kValues; ++j) s_acc[tr * kValues + j] = 0.f;
    }
    __syncthreads();
    // entry t is list index b_end - t (back to front); skip those past the warp's last blended one
    for (int t = max(0, b_end - warp_last); t < n; ++t) {
      if (!((s_mask[t] >> warp) & 1u)) continue;  // none of this warp's pixels reaches it
      float dx, dy, vis, alpha;
      const float4 p = s_p[t];
      const float2 q = s_q[t];
      bool valid = b_end - t <= last && gs_alpha(p, q, px, py, dx, dy, vis, alpha);
      if (!__any_sync(0xffffffffu, valid)) continue;
      float v[kValues];
#pragma unroll
      for (int j = 0; j < kValues; ++j) v[j] = 0.f;
      if (valid) {
        const float ra = 1.f / (1.f - alpha);
        T *= ra;  // T before this Gaussian
        const float w = alpha * T;
        float v_alpha = 0.f;
#pragma unroll
        for (int k = 0; k < D; ++k) {
          const float col = s_col[t * D + k];
          v[8 + k] = w * g_c[k];
          v_alpha += (col * T - behind[k] * ra) * g_c[k];
          behind[k] += col * w;
        }
        v_alpha += T_final * ra * -g_T;
        if (__fmul_rn(p.z, vis) <= RF_ALPHA_MAX) {  // not clamped: alpha = opacity exp(-sigma)
          const float v_sigma = -p.z * vis * v_alpha;
          v[0] = v_sigma * (p.w * dx + q.x * dy);
          v[1] = v_sigma * (q.x * dx + q.y * dy);
          v[2] = fabsf(v[0]);
          v[3] = fabsf(v[1]);
          v[4] = 0.5f * v_sigma * dx * dx;
          v[5] = v_sigma * dx * dy;
          v[6] = 0.5f * v_sigma * dy * dy;
          v[7] = vis * v_alpha;
        }
      }
      const float sum = gs_reduce_scatter16(v, lane);
      const int j = lane >> 1;
      if ((lane & 1) == 0 && j < 8 + D && sum != 0.f) atomicAdd(s_acc + t * kValues + j, sum);
    }
    __syncthreads();
    if (tr < n) {  // one thread per staged Gaussian adds the block's sums
      const long long g = s_id[tr];
      const float* acc = s_acc + tr * kValues;
      if (acc[0] != 0.f) atomicAdd(v_means2d + 2 * g, acc[0]);
      if (acc[1] != 0.f) atomicAdd(v_means2d + 2 * g + 1, acc[1]);
      if (v_absgrad != nullptr) {
        if (acc[2] != 0.f) atomicAdd(v_absgrad + 2 * g, acc[2]);
        if (acc[3] != 0.f) atomicAdd(v_absgrad + 2 * g + 1, acc[3]);
      }
#pragma unroll
      for (int i = 0; i < 3; ++i)
        if (acc[4 + i] != 0.f) atomicAdd(v_conics + 3 * g + i, acc[4 + i]);
      if (acc[7] != 0.f) atomicAdd(v_opacities + g, acc[7]);
#pragma unroll
      for (int k = 0; k < D; ++k)
        if (acc[8 + k] != 0.f) atomicAdd(v_colors + g * D + k, acc[8 + k]);
    }
  }
}
