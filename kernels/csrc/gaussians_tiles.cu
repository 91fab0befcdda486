// Tile binning of projected Gaussians (Python side: kernels/_gs_cuda.py; twins:
// intersect_tiles_reference, isect_offset_encode_reference in kernels/_gs_reference.py).
//
// The keys are sorted depth first: the host sorts the C*N depths once (stable), tile_emit writes
// each Gaussian's tiles in that order, and a stable sort of the 32-bit (camera, tile) part alone
// then gives the order of the full 64-bit keys camera | tile | depth bits (ties in Gaussian order)
// at the cost of a sort of N keys plus a sort of M 32-bit keys, instead of M 64-bit keys.
//
// With conics and opacities (the rasterizer's own binning) a tile inside a Gaussian's box is kept
// only when the Gaussian's alpha can reach 1/255 at one of the tile's pixel centres: the minimum
// of the conic's quadratic over the tile's rectangle of centres against ln(255 opacity). Pixels
// of dropped tiles would all have skipped the Gaussian, so the image is the same, with fewer
// intersections to sort and blend.

#include "gaussians.cuh"

// The tiles of one Gaussian: its box, and (exact culling) the per-tile test. Calls f(tile id).
template <typename F>
__device__ __forceinline__ int gs_for_tiles(long long i, const float* __restrict__ means2d, const int* __restrict__ radii,
                                            int per_axis, const float* __restrict__ conics,
                                            const float* __restrict__ opacities, int ts, int tw, int th,
                                            int width, int height, F f) {
  const int rx = per_axis ? radii[2 * i] : radii[i];
  const int ry = per_axis ? radii[2 * i + 1] : radii[i];
  if (rx <= 0 || ry <= 0) return 0;
  const float mx = means2d[2 * i], my = means2d[2 * i + 1];
  int x0, x1, y0, y1;
  gs_tile_box(mx, my, (float)rx, (float)ry, ts, tw, th, x0, x1, y0, y1);
  bool exact = conics != nullptr;
  float a = 0.f, b = 0.f, c = 0.f, tau = 0.f;
  if (exact) {
    a = conics[3 * i]; b = conics[3 * i + 1]; c = conics[3 * i + 2];
    const float o = opacities[i];
    tau = gs_reach(o);
    exact = a > 0.f && c > 0.f && a * c - b * b > 0.f;  // else keep the whole box
  }
  int n = 0;
  for (int ty = y0; ty < y1; ++ty) {
    for (int tx = x0; tx < x1; ++tx) {
      if (exact) {
        // centres of the tile's pixels inside the image, relative to the mean
        const float lx = __fsub_rn((float)(tx * ts) + 0.5f, mx);
        const float hx = __fsub_rn(fminf((float)((tx + 1) * ts), (float)width) - 0.5f, mx);
        const float ly = __fsub_rn((float)(ty * ts) + 0.5f, my);
        const float hy = __fsub_rn(fminf((float)((ty + 1) * ts), (float)height) - 0.5f, my);
        if (!(gs_min_sigma(a, b, c, lx, hx, ly, hy) <= tau)) continue;
      }
      f(ty * tw + tx, n);
      ++n;
    }
  }
  return n;
}

// counts[i] = tiles of (camera, Gaussian) i.
__global__ void tile_counts(long long CN, const float* __restrict__ means2d,  // [C*N, 2]
                            const int* __restrict__ radii,                      // [C*N] or [C*N, 2]
                            int per_axis,
                            const float* __restrict__ conics,                   // [C*N, 3] or nullptr
                            const float* __restrict__ opacities,                // [C*N] or nullptr
                            int ts, int tw, int th, int width, int height,
                            int* __restrict__ counts) {                          // [C*N]
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= CN) return;
  counts[i] = gs_for_tiles(i, means2d, radii, per_axis, conics, opacities, ts, tw, th, width, height,
                           [](int, int) {});
}

// In depth order: rank r's Gaussian g = order[r] writes its tiles at ends[r] - counts[g] ...:
// key = (camera << tile_bits | tile) ^ 0x80000000 (so that a signed sort orders the unsigned
// value), value = g. Never more than counts[g] of them (the same test as tile_counts decides),
// and none at or past ``capacity`` (a CUDA graph's fixed budget; the exact path passes M).
__global__ void tile_emit(long long CN, int N, const float* __restrict__ means2d, const int* __restrict__ radii,
                          int per_axis, const float* __restrict__ conics, const float* __restrict__ opacities,
                          int ts, int tw, int th, int width, int height, int tile_bits,
                          const long long* __restrict__ order,   // [C*N] depth-sorted indices
                          const long long* __restrict__ ends,    // [C*N] inclusive scan of counts[order]
                          const int* __restrict__ counts,        // [C*N]
                          long long capacity,                    // entries keys and values hold
                          int* __restrict__ keys,                // [capacity]
                          int* __restrict__ values) {            // [capacity]
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= CN) return;
  const long long g = order[r];
  const int n = counts[g];
  if (n == 0) return;
  const long long start = ends[r] - n;
  const unsigned cam = (unsigned)(g / N) << tile_bits;
  gs_for_tiles(g, means2d, radii, per_axis, conics, opacities, ts, tw, th, width, height, [&](int tile, int k) {
    const long long at = start + k;
    if (k >= n || at >= capacity) return;  // past a fixed budget: the farthest Gaussians' tiles drop
    keys[at] = (int)((cam | (unsigned)tile) ^ 0x80000000u);
    values[at] = (int)g;
  });
}

// offsets[t] for the tiles t in (previous entry's tile, this entry's tile]; the last entry fills
// the rest with M. offsets index = camera * n_tiles + tile.
__device__ __forceinline__ void gs_fill_offsets(long long j, long long M, long long prev, long long cur,
                                                long long total, int* __restrict__ offsets) {
  for (long long t = prev + 1; t <= cur; ++t) offsets[t] = (int)j;
  if (j == M - 1)
    for (long long t = cur + 1; t < total; ++t) offsets[t] = (int)M;
}

__device__ __forceinline__ long long gs_tile_index(unsigned hi, int tile_bits, int n_tiles) {
  return (long long)(hi >> tile_bits) * n_tiles + (hi & ((1u << tile_bits) - 1u));
}

// After the stable sort of the keys: flatten_ids, the 64-bit keys and the tile offsets. With
// ``needed`` (a fixed budget of M entries, the tail padded with INT_MAX keys that sort last) only
// the first min(*needed, M) entries are real.
__global__ void tile_finish(long long M, const long long* __restrict__ needed,  // [1] or nullptr
                            const int* __restrict__ sorted_keys,               // [M]
                            const long long* __restrict__ perm,                // [M] torch.sort's permutation,
                                                                               // or nullptr: values sorted too
                            const int* __restrict__ values,                    // [M]
                            const float* __restrict__ depths,                  // [C*N]
                            int tile_bits, int n_tiles, long long total_tiles,
                            int* __restrict__ flatten_ids,                     // [M]
                            long long* __restrict__ isect_ids,                 // [M]
                            int* __restrict__ offsets) {                       // [C * n_tiles]
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (needed != nullptr) M = min(M, *needed);
  if (j >= M) return;
  const unsigned hi = (unsigned)sorted_keys[j] ^ 0x80000000u;
  const int g = perm != nullptr ? values[perm[j]] : values[j];
  flatten_ids[j] = g;
  isect_ids[j] = (long long)(((unsigned long long)hi << 32) | (unsigned long long)__float_as_uint(depths[g]));
  const long long cur = gs_tile_index(hi, tile_bits, n_tiles);
  const long long prev = j == 0 ? -1 : gs_tile_index((unsigned)sorted_keys[j - 1] ^ 0x80000000u, tile_bits, n_tiles);
  gs_fill_offsets(j, M, prev, cur, total_tiles, offsets);
}

// isect_offset_encode: tile offsets of sorted 64-bit keys.
__global__ void tile_offsets(long long M, const long long* __restrict__ isect_ids, int tile_bits, int n_tiles,
                             long long total_tiles, int* __restrict__ offsets) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= M) return;
  const long long cur = gs_tile_index((unsigned)((unsigned long long)isect_ids[j] >> 32), tile_bits, n_tiles);
  const long long prev =
      j == 0 ? -1 : gs_tile_index((unsigned)((unsigned long long)isect_ids[j - 1] >> 32), tile_bits, n_tiles);
  gs_fill_offsets(j, M, prev, cur, total_tiles, offsets);
}

// ---------------------------------------------------------------------------- radix sort
// A stable LSD radix sort of (key, value) pairs on the low bits of the keys, 8 bits a pass, for
// the camera | tile keys above (14 bits for one camera at 1080p: two passes, where torch.sort
// sorts all 32 bits and returns an int64 permutation). Per pass: radix_histogram counts each
// block's digits, the host scans the digit-major counts, radix_scatter writes each block's keys to
// their digit's place, in order (each 256-key round ranked with warp matches: stable).

constexpr int kSortThreads = 256, kSortRounds = 16, kSortItems = kSortThreads * kSortRounds;  // keys per block

// hist[d * n_blocks + b] = keys of block b whose digit ((key >> shift) & 255) is d.
__global__ void radix_histogram(long long M, const int* __restrict__ keys,  // [M]
                                int shift, int* __restrict__ hist) {        // [256 * n_blocks]
  __shared__ int s_hist[256];
  const int tid = threadIdx.x;
  const long long b = blockIdx.x, nb = gridDim.x;
  s_hist[tid] = 0;
  __syncthreads();
  for (int r = 0; r < kSortRounds; ++r) {
    const long long i = b * kSortItems + (long long)r * kSortThreads + tid;
    if (i < M) atomicAdd(&s_hist[((unsigned)keys[i] >> shift) & 255u], 1);
  }
  __syncthreads();
  hist[tid * nb + b] = s_hist[tid];
}

// offsets: the exclusive scan of radix_histogram's counts (digit-major), so block b's keys of digit
// d go to offsets[d * n_blocks + b] onwards, in their input order.
__global__ void radix_scatter(long long M, const int* __restrict__ keys_in, const int* __restrict__ values_in,
                              int shift, const long long* __restrict__ offsets,  // [256 * n_blocks]
                              int* __restrict__ keys_out, int* __restrict__ values_out) {
  __shared__ int s_count[kSortThreads / 32][256];  // per warp and digit, in the current round
  __shared__ long long s_next[256];                // where the block's next key of each digit goes
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long b = blockIdx.x, nb = gridDim.x;
  s_next[tid] = offsets[tid * nb + b];
  for (int w = 0; w < kSortThreads / 32; ++w) s_count[w][tid] = 0;
  __syncthreads();
  const unsigned before = (1u << lane) - 1u;  // lanes below this one
  for (int r = 0; r < kSortRounds; ++r) {
    const long long i = b * kSortItems + (long long)r * kSortThreads + tid;
    const bool valid = i < M;
    const int key = valid ? keys_in[i] : 0;
    const int d = valid ? (int)(((unsigned)key >> shift) & 255u) : 256;  // 256: no key
    const unsigned same = __match_any_sync(0xffffffffu, d);
    const int rank = __popc(same & before);
    if (valid && rank == 0) s_count[warp][d] = __popc(same);
    __syncthreads();
    if (valid) {
      long long pos = s_next[d] + rank;
      for (int w = 0; w < warp; ++w) pos += s_count[w][d];
      keys_out[pos] = key;
      values_out[pos] = values_in[i];
    }
    __syncthreads();
    int sum = 0;  // thread tid advances digit tid by this round's keys and clears its counts
    for (int w = 0; w < kSortThreads / 32; ++w) {
      sum += s_count[w][tid];
      s_count[w][tid] = 0;
    }
    s_next[tid] += sum;
    __syncthreads();
  }
}
