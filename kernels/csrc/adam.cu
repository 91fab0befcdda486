// Adam for a hash table as tiny-cuda-nn steps its non-matrix parameters (tiny-cuda-nn
// optimizers/adam.h): an entry whose gradient is exactly 0 is left alone (no step, no moment decay)
// and its bias correction counts its own steps. One thread per entry, one pass over the table
// (the same arithmetic in PyTorch: kernels/_reference.py, sparse_adam_reference).

#include "common.cuh"

__global__ void sparse_adam(float* __restrict__ param,            // [n]
                            const float* __restrict__ grad,       // [n]
                            float* __restrict__ exp_avg,          // [n]
                            float* __restrict__ exp_avg_sq,       // [n]
                            int* __restrict__ steps,              // [n]: steps taken by each entry
                            const float* __restrict__ found_inf,  // [1]: non-zero skips the step, or nullptr
                            long long n, float lr, float beta1, float beta2, float eps) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (found_inf != nullptr && __ldg(found_inf) != 0.0f) return;
  const float g = __ldg(grad + i);
  if (g == 0.0f) return;
  const float m = beta1 * exp_avg[i] + (1.0f - beta1) * g;
  const float v = beta2 * exp_avg_sq[i] + (1.0f - beta2) * g * g;
  const int s = steps[i] + 1;
  const float scale = sqrtf(1.0f - powf(beta2, (float)s)) / (1.0f - powf(beta1, (float)s));
  param[i] -= lr * scale * m / (sqrtf(v) + eps);
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  steps[i] = s;
}
