// Adam over up to six tensors in one launch (the six parameters of 3D Gaussian Splatting, each
// with its own learning rate), as torch.optim.Adam(fused=True) computes it:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps),  t = step + 1
// The step counts live on the device (torch's fused layout: one float32 per tensor) and are read
// here, so the host needs no sync; adam_bump_steps advances them afterwards. A set found_inf (a
// non-finite loss or gradient this step) leaves every tensor as it was, as fused Adam does.
// Grid: x strides over a tensor's elements, y picks the tensor.
#include "common.cuh"

#define ADAM_TENSOR_ARGS(k) float *p##k, const float *g##k, float *m##k, float *v##k, const float *s##k, \
                            long long n##k, float lr##k

extern "C" __global__ void adam_multi(ADAM_TENSOR_ARGS(0), ADAM_TENSOR_ARGS(1), ADAM_TENSOR_ARGS(2),
                                      ADAM_TENSOR_ARGS(3), ADAM_TENSOR_ARGS(4), ADAM_TENSOR_ARGS(5),
                                      const float* __restrict__ found_inf, float beta1, float beta2, float eps) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  float* p;
  const float* g;
  float *m, *v;
  const float* s;
  long long n;
  float lr;
  switch (blockIdx.y) {
#define ADAM_PICK(k) case k: p = p##k; g = g##k; m = m##k; v = v##k; s = s##k; n = n##k; lr = lr##k; break;
    ADAM_PICK(0) ADAM_PICK(1) ADAM_PICK(2) ADAM_PICK(3) ADAM_PICK(4) ADAM_PICK(5)
    default: return;
  }
  if (n == 0) return;
  const float t = *s + 1.0f;
  const float step_size = lr / (1.0f - powf(beta1, t));
  const float bc2_sqrt = sqrtf(1.0f - powf(beta2, t));
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float gi = g[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
  }
}

extern "C" __global__ void adam_bump_steps(float* s0, float* s1, float* s2, float* s3, float* s4, float* s5,
                                           const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  float* s[6] = {s0, s1, s2, s3, s4, s5};
  if (threadIdx.x < 6 && s[threadIdx.x] != nullptr) *s[threadIdx.x] += 1.0f;
}

// Adam for a hash table as tiny-cuda-nn steps its non-matrix parameters (tiny-cuda-nn
// optimizers/adam.h): an entry whose gradient is exactly 0 is left alone (no step, no moment decay)
// and its bias correction counts its own steps. One thread per entry, one pass over the table
// (the same arithmetic in PyTorch: kernels/_reference.py, sparse_adam_reference).
extern "C" __global__ void sparse_adam(float* __restrict__ param,            // [n]
                                       const float* __restrict__ grad,       // [n]
                                       float* __restrict__ exp_avg,          // [n]
                                       float* __restrict__ exp_avg_sq,       // [n]
                                       int* __restrict__ steps,              // [n]: steps taken by each entry
                                       const float* __restrict__ found_inf,  // [1]: non-zero skips, or nullptr
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
