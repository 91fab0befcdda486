// Volume rendering of a NeRF on packed samples (Python side: kernels/render.py; references with the
// same arithmetic: kernels/_reference.py, march_rays_reference and composite_reference).
//
// The PyTorch renderer spends ~60 small kernel launches per batch on marching and compositing
// (dense [rays, max_samples] tensors, a boolean occupancy test, nonzero, cumprod, sums, and their
// backward); here marching is two launches (count, then write at scanned offsets) and compositing
// one forward and one backward launch, one thread per ray (samples of a ray are contiguous).
//
// Rounding: every product and sum that decides *which* samples exist (t, the sample point, its
// occupancy cell) uses the __f*_rn intrinsics, so no FMA contraction changes a value against
// PyTorch's separately rounded tensor ops: kernel and reference keep the same samples.

#include "common.cuh"

// Entry and exit distances of the ray with the box lo = box[0..2], hi = box[3..5], as
// stages/reconstruct/nerf/render.py ray_aabb: direction components below 1e-9 in magnitude are
// replaced by +1e-9; entry clamped to >= near. Exit <= entry means a miss.
__device__ __forceinline__ void ray_box(const float (&o)[3], const float (&d)[3], const float (&box)[6],
                                        float near, float& tmin, float& tmax) {
  float lo = -__int_as_float(0x7f800000), hi = __int_as_float(0x7f800000);  // -inf, +inf (no <cmath> in NVRTC)
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float dk = fabsf(d[k]) < 1e-9f ? 1e-9f : d[k];
    const float inv = __fdiv_rn(1.0f, dk);
    const float t0 = __fmul_rn(__fsub_rn(box[k], o[k]), inv);
    const float t1 = __fmul_rn(__fsub_rn(box[3 + k], o[k]), inv);
    lo = fmaxf(lo, fminf(t0, t1));
    hi = fminf(hi, fmaxf(t0, t1));
  }
  tmin = fmaxf(lo, near);
  tmax = hi;
}

// The outermost of `cascades` nested boxes around aabb (box k: aabb scaled by 2^k about its centre),
// as cascade_box_reference: centre -+ (hi - lo) * 0.5 * 2^(cascades - 1).
__device__ __forceinline__ void cascade_box(const float* __restrict__ aabb, int cascades, float (&box)[6]) {
  const float scale = ldexpf(1.0f, cascades - 1);
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float lo = __ldg(aabb + k), hi = __ldg(aabb + 3 + k);
    const float centre = __fmul_rn(__fadd_rn(lo, hi), 0.5f);
    const float half = __fmul_rn(__fmul_rn(__fsub_rn(hi, lo), 0.5f), scale);
    box[k] = __fsub_rn(centre, half);
    box[3 + k] = __fadd_rn(centre, half);
  }
}

// Flat occupancy cell of point p, as OccupancyGrid.cell_index: ((p - lo) / (hi - lo) * r)
// truncated toward zero, clamped to [0, r - 1] per axis, then (i * r + j) * r + k.
__device__ __forceinline__ u32 occupancy_cell(const float (&p)[3], const float* __restrict__ aabb, int r) {
  long long ijk[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float lo = __ldg(aabb + k);
    const float xn = __fdiv_rn(__fsub_rn(p[k], lo), __fsub_rn(__ldg(aabb + 3 + k), lo));
    const float s = __fmul_rn(xn, (float)r);
    long long c = (s != s) ? 0 : (long long)fmaxf(fminf(s, 1e18f), -1e18f);  // NaN -> cell 0
    ijk[k] = c < 0 ? 0 : (c > r - 1 ? r - 1 : c);
  }
  return (u32)((ijk[0] * r + ijk[1]) * r + ijk[2]);
}

// Scene contraction, as contract_reference: u = (p - centre) / half, n = max |u_k|; for n > 1,
// u *= (2 - 1/n) / n (L-inf mip-NeRF 360); x = (u + 2) / 4 in [0, 1]^3. Then the flat cell of x in
// an r^3 grid as occupancy_cell (truncated, clamped, NaN -> cell 0).
__device__ __forceinline__ u32 contracted_cell(const float (&p)[3], const float* __restrict__ aabb, int r) {
  float u[3];
  float n = 0.0f;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float lo = __ldg(aabb + k), hi = __ldg(aabb + 3 + k);
    const float centre = __fmul_rn(__fadd_rn(lo, hi), 0.5f), half = __fmul_rn(__fsub_rn(hi, lo), 0.5f);
    u[k] = __fdiv_rn(__fsub_rn(p[k], centre), half);
    n = fmaxf(n, fabsf(u[k]));
  }
  const float scale = n > 1.0f ? __fdiv_rn(__fsub_rn(2.0f, __fdiv_rn(1.0f, n)), n) : 1.0f;
  long long ijk[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float uk = n > 1.0f ? __fmul_rn(u[k], scale) : u[k];
    const float s = __fmul_rn(__fmul_rn(__fadd_rn(uk, 2.0f), 0.25f), (float)r);
    long long c = (s != s) ? 0 : (long long)fmaxf(fminf(s, 1e18f), -1e18f);
    ijk[k] = c < 0 ? 0 : (c > r - 1 ? r - 1 : c);
  }
  return (u32)((ijk[0] * r + ijk[1]) * r + ijk[2]);
}

// Occupancy cascades (instant-ngp's aabb_scale = 2^(cascades - 1)), as occupancy_cell_reference:
// u = (p - centre) / half, n = max |u_k|; the level is the smallest k < cascades with n <= 2^k (the
// last past them all), u is scaled by 2^-level (exact), and the cell is that of (u + 1) / 2 in the
// level's r^3 grid (truncated, clamped, NaN -> cell 0), after the level * r^3 cells of the levels inside.
__device__ __forceinline__ u32 cascade_cell(const float (&p)[3], const float* __restrict__ aabb, int r, int cascades) {
  float u[3];
  float n = 0.0f;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float lo = __ldg(aabb + k), hi = __ldg(aabb + 3 + k);
    const float centre = __fmul_rn(__fadd_rn(lo, hi), 0.5f), half = __fmul_rn(__fsub_rn(hi, lo), 0.5f);
    u[k] = __fdiv_rn(__fsub_rn(p[k], centre), half);
    n = fmaxf(n, fabsf(u[k]));
  }
  int level = 0;
  for (int k = 0; k < cascades - 1; ++k) level += n > ldexpf(1.0f, k) ? 1 : 0;
  const float scale = ldexpf(1.0f, -level);
  long long ijk[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const float s = __fmul_rn(__fmul_rn(__fadd_rn(__fmul_rn(u[k], scale), 1.0f), 0.5f), (float)r);
    long long c = (s != s) ? 0 : (long long)fmaxf(fminf(s, 1e18f), -1e18f);
    ijk[k] = c < 0 ? 0 : (c > r - 1 ? r - 1 : c);
  }
  return (u32)((((long long)level * r + ijk[0]) * r + ijk[1]) * r + ijk[2]);
}

// How a ray is marched (march_rays' SPACE): inside the box, through the contracted scene, or through
// occupancy cascades with steps growing with the distance.
#define SPACE_BOX 0
#define SPACE_CONTRACT 1
#define SPACE_CASCADES 2

// One thread per ray. SPACE_BOX: sample s (0 <= s < max_samples) sits at
// t = tmin + (s + jitter) * dt and is kept when t < tmax and its occupancy cell is set (occ ==
// nullptr: every cell). SPACE_CONTRACT (march_steps_reference): linear steps t = near + (s +
// jitter) * dt up to T1 = max(box exit, the ray's point nearest the box centre, near + half the box
// diagonal), then
// steps uniform in disparity, t = 1 / (1/T1 - (k + jitter) * dd), dd = dt / T1^2, while 1/t >
// far_ratio / T1; each sample's step length (dt, or dd t^2) goes to steps_out, and cells are those
// of the contracted space. SPACE_CASCADES: through the outermost cascade box (cascade_box), t_0 =
// tmin + jitter * step(tmin), t_(s+1) = t_s + step(t_s) with step(t) = max(dt, cone * t) (instant-ngp's
// cone tracing) while t < tmax; cells of the cascades (cascade_cell), each sample's step to steps_out.
// WRITE = false: counts[ray] = kept samples. WRITE = true: the kept samples
// of the ray go to offsets[ray] .. (ray index, t, point[, step]), those at or past `capacity` are
// dropped, and counts[ray] becomes the number written (a fixed-size sample buffer, as a
// CUDA-graph-captured training step needs).
template <bool WRITE, int SPACE>
__global__ void march_rays(const float* __restrict__ origins,     // [R, 3]
                           const float* __restrict__ dirs,        // [R, 3]
                           const float* __restrict__ jitter,      // [R]
                           const float* __restrict__ aabb,        // [6]: lo xyz, hi xyz
                           const unsigned char* __restrict__ occ, // [r^3] bool ([cascades r^3]), or nullptr
                           int r, float dt, int max_samples, float near, float far_ratio,
                           int cascades, float cone, u32 R,
                           int* __restrict__ counts,              // [R]: out, or clamped (WRITE)
                           const long long* __restrict__ offsets, // [R] exclusive scan (WRITE = true)
                           long long capacity,                    // sample slots (WRITE = true)
                           long long* __restrict__ ray_index,     // [S_total]
                           float* __restrict__ t_out,             // [S_total]
                           float* __restrict__ points,            // [S_total, 3]
                           float* __restrict__ steps_out) {       // [S_total] (not SPACE_BOX; WRITE)
  constexpr bool CONTRACT = SPACE == SPACE_CONTRACT, CASCADES = SPACE == SPACE_CASCADES;
  const u32 ray = blockIdx.x * blockDim.x + threadIdx.x;
  if (ray >= R) return;
  float o[3], d[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    o[k] = __ldg(origins + 3 * (u64)ray + k);
    d[k] = __ldg(dirs + 3 * (u64)ray + k);
  }
  float box[6];
  if (CASCADES) {
    cascade_box(aabb, cascades, box);
  } else {
#pragma unroll
    for (int k = 0; k < 6; ++k) box[k] = __ldg(aabb + k);
  }
  float tmin, tmax;
  ray_box(o, d, box, near, tmin, tmax);
  const float j = __ldg(jitter + ray);
  const long long first = WRITE ? __ldg(offsets + ray) : 0;
  if (WRITE && first >= capacity) {  // no slot left for this ray
    counts[ray] = 0;
    return;
  }
  float t1_end = 0.0f, inv = 0.0f, dd = 0.0f, inv_far = 0.0f;
  if (CONTRACT) {
    float w[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const float centre = __fmul_rn(__fadd_rn(__ldg(aabb + k), __ldg(aabb + 3 + k)), 0.5f);
      w[k] = __fmul_rn(__fsub_rn(centre, o[k]), d[k]);
    }
    const float t_close = __fadd_rn(__fadd_rn(w[0], w[1]), w[2]);
    float e[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) e[k] = __fsub_rn(__ldg(aabb + 3 + k), __ldg(aabb + k));
    const float reach = __fmul_rn(__fsqrt_rn(__fadd_rn(__fadd_rn(__fmul_rn(e[0], e[0]), __fmul_rn(e[1], e[1])),
                                                       __fmul_rn(e[2], e[2]))), 0.5f);  // half the diagonal
    t1_end = fmaxf(fmaxf(tmax, t_close), __fadd_rn(near, reach));
    inv = __fdiv_rn(1.0f, t1_end);
    dd = __fdiv_rn(dt, __fmul_rn(t1_end, t1_end));
    inv_far = __fmul_rn(inv, far_ratio);
  }
  long long out = first;
  int n = 0, n1 = -1;  // n1: the first step past the linear segment (CONTRACT)
  float t_next = CASCADES ? __fadd_rn(tmin, __fmul_rn(j, fmaxf(dt, __fmul_rn(tmin, cone)))) : 0.0f;
  for (int s = 0; s < max_samples; ++s) {
    if (WRITE && out >= capacity) break;
    float t, step = dt;
    if (CASCADES) {
      t = t_next;
      if (!(t < tmax)) break;  // t only grows
      step = fmaxf(dt, __fmul_rn(t, cone));
      t_next = __fadd_rn(t, step);
    } else if (!CONTRACT) {
      t = __fadd_rn(tmin, __fmul_rn(__fadd_rn((float)s, j), dt));
      if (!(t < tmax)) break;  // t grows with s (rounding is monotone): the rest are out too
    } else {
      t = __fadd_rn(near, __fmul_rn(__fadd_rn((float)s, j), dt));
      if (n1 < 0 && !(t < t1_end)) n1 = s;
      if (n1 >= 0) {
        const float den = __fsub_rn(inv, __fmul_rn(__fadd_rn((float)(s - n1), j), dd));
        if (!(den > inv_far)) break;  // den falls with s: the rest are past the far end too
        t = __fdiv_rn(1.0f, den);
        step = __fmul_rn(__fmul_rn(dd, t), t);
      }
    }
    float p[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) p[k] = __fadd_rn(o[k], __fmul_rn(t, d[k]));
    if (occ != nullptr && !__ldg(occ + (CONTRACT   ? contracted_cell(p, aabb, r)
                                        : CASCADES ? cascade_cell(p, aabb, r, cascades)
                                                   : occupancy_cell(p, aabb, r))))
      continue;
    if (WRITE) {
      ray_index[out] = (long long)ray;
      t_out[out] = t;
      points[3 * out] = p[0];
      points[3 * out + 1] = p[1];
      points[3 * out + 2] = p[2];
      if (SPACE != SPACE_BOX) steps_out[out] = step;
      ++out;
    }
    ++n;
  }
  counts[ray] = n;  // WRITE: the samples that found a slot (the same as the count pass otherwise)
}

// Per sample: alpha = 1 - exp(-sigma * dt) and the transmittance factor (1 - alpha) + 1e-10, as the
// PyTorch renderer (its 1e-10 keeps cumprod's gradient finite at alpha = 1).
__device__ __forceinline__ void sample_alpha(float sigma, float dt, float& alpha, float& ex, float& factor) {
  ex = expf(__fmul_rn(-sigma, dt));
  alpha = __fsub_rn(1.0f, ex);
  factor = __fadd_rn(__fsub_rn(1.0f, alpha), 1e-10f);
}

// The distortion loss's coordinate of a sample at distance t with march step `step` (base step dt).
// Box rays (per_sample false): t. Contracted rays march linearly in steps of dt up to T1, then
// uniformly in disparity with step dt t^2 / T1^2 (kernels/_reference.py march_steps_reference), so
// u = t (2 r - r^2), r = sqrt(dt / step) (= T1 / t past T1, 1 before it), is t up to T1 and
// 2 T1 - T1^2 / t past it: every march step is dt in u. This is mip-NeRF 360's normalised ray
// distance (linear, then linear in disparity) in the box's units; in metric t the background's
// far samples would dominate the sum and the loss would pull all weight in front of them.
// Cascaded rays (cone = true) step max(dt, c t): u = t / q (1 + ln q) with q = max(1, step / dt) is t
// while the step is dt and logarithmic in t past dt / c, again dt in u a step (distortion_coords).
__device__ __forceinline__ double distortion_u(float t, float step, float dt, bool per_sample, bool cone) {
  if (!per_sample) return (double)t;
  if (cone) {
    const double q = fmax(1.0, (double)step / (double)dt);
    return (double)t / q * (1.0 + log(q));
  }
  const double r = fmin(1.0, sqrt((double)dt / (double)step));
  return (double)t * (2.0 * r - r * r);
}

// One thread per ray over its samples [offsets[ray], offsets[ray] + counts[ray]):
// w_i = alpha_i * T_i, T_0 = 1, T_{i+1} = T_i * factor_i; color = sum w_i rgb_i (no background),
// opacity = sum w_i, depth = sum w_i t_i. Each sample's step is steps[i], or dt when steps is nullptr.
// With distortion (not nullptr) also each ray's distortion (mip-NeRF 360, eq. 15), the double sum
// sum_ij w_i w_j |u_i - u_j| + 1/3 sum_i w_i^2 dt over the samples' march coordinates u
// (distortion_u), in one pass: sum_{j<i} w_j (u_i - u_j) is u_i W_i - U_i with W_i, U_i the sums of
// w_j and w_j u_j before i, kept in double (u reaches twice the linear reach on contracted rays,
// where float's u_i W_i - U_i would cancel to noise). dist_u gets each ray's U (the backward reads it).
__global__ void composite_fwd(const float* __restrict__ sigma,      // [S_total]
                              const float* __restrict__ rgb,        // [S_total, 3]
                              const float* __restrict__ t,          // [S_total]
                              const long long* __restrict__ offsets,// [R]
                              const int* __restrict__ counts,       // [R]
                              float dt, const float* __restrict__ steps,  // [S_total] or nullptr
                              int cone,                             // steps of cascades (distortion_u)
                              u32 R,
                              float* __restrict__ color,            // [R, 3]
                              float* __restrict__ opacity,          // [R]
                              float* __restrict__ depth,            // [R]
                              float* __restrict__ distortion,       // [R] or nullptr
                              float* __restrict__ dist_u) {         // [R] (with distortion)
  const u32 ray = blockIdx.x * blockDim.x + threadIdx.x;
  if (ray >= R) return;
  const long long start = __ldg(offsets + ray), end = start + __ldg(counts + ray);
  float T = 1.0f, c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, op = 0.0f, dp = 0.0f;
  double W = 0.0, U = 0.0, dist = 0.0;
  for (long long i = start; i < end; ++i) {
    float alpha, ex, factor;
    const float step = steps == nullptr ? dt : __ldg(steps + i);
    sample_alpha(__ldg(sigma + i), step, alpha, ex, factor);
    const float w = __fmul_rn(alpha, T), ti = __ldg(t + i);
    c0 += w * __ldg(rgb + 3 * i);
    c1 += w * __ldg(rgb + 3 * i + 1);
    c2 += w * __ldg(rgb + 3 * i + 2);
    op += w;
    dp += w * ti;
    if (distortion != nullptr) {
      const double wd = w, ud = distortion_u(ti, step, dt, steps != nullptr, cone != 0);
      dist += 2.0 * wd * (ud * W - U) + wd * wd * (double)dt / 3.0;
      W += wd;
      U += wd * ud;
    }
    T = __fmul_rn(T, factor);
  }
  color[3 * (u64)ray] = c0;
  color[3 * (u64)ray + 1] = c1;
  color[3 * (u64)ray + 2] = c2;
  opacity[ray] = op;
  depth[ray] = dp;
  if (distortion != nullptr) {
    distortion[ray] = (float)dist;
    dist_u[ray] = (float)U;
  }
}

// Backward of composite_fwd. With q_i = g_color . rgb_i + g_opacity + g_depth * t_i and
// e_i = dt_i * exp(-sigma_i dt_i) (= d alpha_i / d sigma_i; dt_i = steps[i] or dt):
//   d/d rgb_i   = w_i * g_color
//   d/d sigma_i = T_i e_i q_i - (e_i / factor_i) * sum_{j > i} w_j q_j
// (w_j for j > i holds factor_i in T_j). Two passes per ray: the total sum_j w_j q_j, then the
// suffix sums as total minus the running prefix.
// With g_distortion (not nullptr), q_i also carries g_distortion * d distortion / d w_i:
//   2 sum_j w_j |u_i - u_j| + 2/3 w_i dt = 2 (2 (u_i W_i - U_i) + U - u_i W) + 2/3 w_i dt
// with W_i, U_i the sums of w_j, w_j u_j before i (double, as the forward) and W, U their totals over
// the ray: the forward's opacity and dist_u, passed in.
__global__ void composite_bwd(const float* __restrict__ sigma, const float* __restrict__ rgb,
                              const float* __restrict__ t, const long long* __restrict__ offsets,
                              const int* __restrict__ counts, float dt,
                              const float* __restrict__ steps,      // [S_total] or nullptr
                              int cone,                             // steps of cascades (distortion_u)
                              u32 R,
                              const float* __restrict__ g_color,    // [R, 3]
                              const float* __restrict__ g_opacity,  // [R]
                              const float* __restrict__ g_depth,    // [R]
                              const float* __restrict__ g_distortion,  // [R] or nullptr
                              const float* __restrict__ opacity,    // [R] (read with g_distortion)
                              const float* __restrict__ dist_u,     // [R] (read with g_distortion)
                              float* __restrict__ g_sigma,          // [S_total]
                              float* __restrict__ g_rgb) {          // [S_total, 3]
  const u32 ray = blockIdx.x * blockDim.x + threadIdx.x;
  if (ray >= R) return;
  const long long start = __ldg(offsets + ray), end = start + __ldg(counts + ray);
  if (start == end) return;
  const float gc0 = __ldg(g_color + 3 * (u64)ray), gc1 = __ldg(g_color + 3 * (u64)ray + 1),
              gc2 = __ldg(g_color + 3 * (u64)ray + 2);
  const float go = __ldg(g_opacity + ray), gd = __ldg(g_depth + ray);
  const float gdist = g_distortion == nullptr ? 0.0f : __ldg(g_distortion + ray);
  const double W_all = g_distortion == nullptr ? 0.0 : (double)__ldg(opacity + ray);
  const double U_all = g_distortion == nullptr ? 0.0 : (double)__ldg(dist_u + ray);
  // q_i, and w_i with the sample's alpha terms, given T = the transmittance before sample i and
  // W, U = the sums of w_j and w_j u_j before it (advanced here when the distortion term is on)
  auto term = [&](long long i, float T, double& W, double& U, float& e, float& factor, float& w) {
    float alpha, ex;
    const float step = steps == nullptr ? dt : __ldg(steps + i);
    sample_alpha(__ldg(sigma + i), step, alpha, ex, factor);
    e = step * ex;
    w = __fmul_rn(alpha, T);
    const float ti = __ldg(t + i);
    float q = gc0 * __ldg(rgb + 3 * i) + gc1 * __ldg(rgb + 3 * i + 1) + gc2 * __ldg(rgb + 3 * i + 2) + go + gd * ti;
    if (gdist != 0.0f) {
      const double wd = w, ud = distortion_u(ti, step, dt, steps != nullptr, cone != 0);
      q += gdist * (float)(2.0 * (2.0 * (ud * W - U) + U_all - ud * W_all) + 2.0 / 3.0 * wd * (double)dt);
      W += wd;
      U += wd * ud;
    }
    return q;
  };
  float e, factor, w, T = 1.0f, total = 0.0f;
  double W = 0.0, U = 0.0;
  for (long long i = start; i < end; ++i) {
    const float q = term(i, T, W, U, e, factor, w);
    total += w * q;
    T = __fmul_rn(T, factor);
  }
  T = 1.0f;
  W = 0.0;
  U = 0.0;
  float prefix = 0.0f;
  for (long long i = start; i < end; ++i) {
    const float q = term(i, T, W, U, e, factor, w);
    prefix += w * q;
    g_sigma[i] = T * e * q - (e / factor) * (total - prefix);
    g_rgb[3 * i] = w * gc0;
    g_rgb[3 * i + 1] = w * gc1;
    g_rgb[3 * i + 2] = w * gc2;
    T = __fmul_rn(T, factor);
  }
}
