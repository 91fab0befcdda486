"""The project's CUDA sources built for the host CPU, so CI (no GPU) runs the kernels' own code.

A few lines of shim turn the CUDA C++ of a ``csrc/*.cu`` file into host C++: ``__global__`` and
``__device__`` vanish, the explicitly rounded intrinsics (``__fmul_rn``, ``__fmaf_rn``, ...) become
the operations they round (the build passes ``-ffp-contract=off``, so nothing else is fused),
atomics become plain read-modify-writes, and ``blockIdx`` / ``threadIdx`` are globals. A launch
runs the grid's blocks in turn, with the arguments packed exactly as the GPU launch packs them
(:func:`kernels._driver.packed_args`). A block's threads are coroutines (``ucontext``, a stack each)
that the launch resumes in index order: each runs to its next ``__syncthreads`` or its end, so no
thread passes a barrier before all of the block reach it, and ``__shared__`` arrays (function
statics here) are the block's shared memory.

That is right for kernels whose threads share at most a block's barrier and memory: projection,
spherical harmonics (which stage their coefficients through shared memory), tile binning.
Kernels that work as a warp (``__shfl_sync``, ``__ballot_sync``: the radix sort, the blending)
need threads in lockstep; the shim compiles them but aborts if they are launched, and their
tests stay on the GPU.

:class:`HostProgram` stands in for :class:`kernels._driver.KernelProgram` (same ``launch``), so the
ops' CUDA path in ``kernels/_gs_cuda.py`` runs unchanged on CPU tensors with it; see
``tests/test_gs_kernels_on_host.py``.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

from kernels import loader
from kernels._driver import KernelProgram, packed_args

CXX = shutil.which("g++") or shutil.which("clang++")

SHIM = r"""
#define RF_HOST_BUILD 1
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>
using std::isfinite;
using std::isinf;
using std::isnan;
// CUDA's integer min / max for any pair of arithmetic types
template <typename A, typename B> static inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <typename A, typename B> static inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
struct rf_dim3 { unsigned x, y, z; };
static rf_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
[[noreturn]] static void rf_needs_gpu(const char* what) {
  fprintf(stderr, "host build: %s synchronises threads; this kernel runs on a GPU only\n", what);
  abort();
}
// the launch's scheduler and the running thread's context (see LAUNCHER)
static ucontext_t rf_scheduler;
static ucontext_t* rf_running = nullptr;
static bool rf_barrier_hit = false;  // set by a thread that parks at a barrier, not by one that ends
static inline void __syncthreads() { rf_barrier_hit = true; swapcontext(rf_running, &rf_scheduler); }
static inline unsigned __match_any_sync(unsigned, int) { rf_needs_gpu("__match_any_sync"); }
static inline unsigned __ballot_sync(unsigned, int) { rf_needs_gpu("__ballot_sync"); }
template <typename T> static inline T __shfl_sync(unsigned, T, int, int = 32) { rf_needs_gpu("__shfl_sync"); }
template <typename T> static inline T __shfl_xor_sync(unsigned, T, int, int = 32) { rf_needs_gpu("__shfl_xor_sync"); }
template <typename T> static inline T __shfl_down_sync(unsigned, T, int, int = 32) { rf_needs_gpu("__shfl_down_sync"); }
// __expf and __logf: glibc declares them (its expf and logf), which is what they stand for here
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
template <typename T> static inline T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }
template <typename T> static inline T atomicOr(T* p, T v) { const T old = *p; *p = old | v; return old; }
template <typename T> static inline T atomicMax(T* p, T v) { const T old = *p; if (v > old) *p = v; return old; }
template <typename T> static inline T __ldg(const T* p) { return *p; }
"""

# a launch: block after block; in a block, every thread a coroutine resumed in index order until
# all have returned (each resume runs a thread to its next __syncthreads or its end); each kernel
# parameter is read from its slot of the void** array the GPU launch would hand to cuLaunchKernel
LAUNCHER = r"""
template <typename... A, std::size_t... I>
static void rf_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
static void (*rf_thread_body)();  // the kernel call of the launch in progress
static void rf_thread_entry() { rf_thread_body(); }  // returns to rf_scheduler (uc_link)
struct rf_thread { ucontext_t ctx; rf_dim3 idx; bool done; };
static constexpr size_t RF_STACK = 256 * 1024;
template <typename... A>
static void rf_launch(void (*kernel)(A...), const long long* dims, void** args) {
  gridDim = {(unsigned)dims[0], (unsigned)dims[1], (unsigned)dims[2]};
  blockDim = {(unsigned)dims[3], (unsigned)dims[4], (unsigned)dims[5]};
  static void (*the_kernel)(A...);
  static void** the_args;
  the_kernel = kernel;
  the_args = args;
  rf_thread_body = [] { rf_call(the_kernel, the_args, std::index_sequence_for<A...>{}); };
  const size_t n = (size_t)blockDim.x * blockDim.y * blockDim.z;
  std::vector<rf_thread> threads(n);
  std::vector<char> stacks(n * RF_STACK);
  for (unsigned bz = 0; bz < gridDim.z; ++bz)
    for (unsigned by = 0; by < gridDim.y; ++by)
      for (unsigned bx = 0; bx < gridDim.x; ++bx) {
        blockIdx = {bx, by, bz};
        size_t k = 0;
        for (unsigned tz = 0; tz < blockDim.z; ++tz)
          for (unsigned ty = 0; ty < blockDim.y; ++ty)
            for (unsigned tx = 0; tx < blockDim.x; ++tx, ++k) {
              rf_thread& t = threads[k];
              t.idx = {tx, ty, tz};
              t.done = false;
              getcontext(&t.ctx);
              t.ctx.uc_stack.ss_sp = stacks.data() + k * RF_STACK;
              t.ctx.uc_stack.ss_size = RF_STACK;
              t.ctx.uc_link = &rf_scheduler;
              makecontext(&t.ctx, rf_thread_entry, 0);
            }
        for (size_t live = n; live > 0;) {  // one round: every live thread to its next barrier or end
          live = 0;
          for (rf_thread& t : threads) {
            if (t.done) continue;
            threadIdx = t.idx;
            rf_running = &t.ctx;
            rf_barrier_hit = false;
            // back here when the thread parks at a barrier (its place saved in t.ctx) or returns
            // (uc_link resumes the scheduler)
            swapcontext(&rf_scheduler, &t.ctx);
            if (rf_barrier_hit) ++live; else t.done = true;
          }
        }
      }
}
"""


def _symbol(name_expression: str) -> str:
    return "rf_run_" + re.sub(r"\W", "_", name_expression)


class HostProgram:
    """A kernel program built for the host: ``launch`` as :meth:`KernelProgram.launch`, on CPU memory.

    Args:
        program: the GPU program to mirror (its source, kernels and defines).
        build_dir: where the shared library goes.
        kernels: the name expressions to expose (default: all of the program's).
    """

    def __init__(self, program: KernelProgram, build_dir: Path, kernels: list[str] | None = None):
        if CXX is None:
            raise RuntimeError("no host C++ compiler (g++ or clang++)")
        self.source = program.source
        self.name_expressions = tuple(kernels or program.name_expressions)
        stem = f"{self.source.stem}_{abs(hash((self.name_expressions, tuple(sorted(program.defines.items())))))}"
        cpp, lib = build_dir / f"{stem}.cpp", build_dir / f"{stem}.so"
        wrappers = "".join(
            f'extern "C" void {_symbol(n)}(const long long* dims, void** args) {{ rf_launch(&{n}, dims, args); }}\n'
            for n in self.name_expressions)
        cpp.write_text(SHIM + f'#include "{self.source}"\n' + LAUNCHER + wrappers)
        defines = [f"-D{k}={v}" for k, v in program.defines.items()]
        cmd = [CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-Wno-unknown-pragmas",
               f"-I{loader.CSRC_DIR}", *defines, "-o", str(lib), str(cpp)]
        build = subprocess.run(cmd, capture_output=True, text=True)
        if build.returncode != 0:
            raise RuntimeError(f"host build of {self.source.name} failed:\n{build.stderr[-4000:]}")
        self._lib = ctypes.CDLL(str(lib))
        self.launched: list[str] = []

    def launch(self, name_expression, grid, block, args, device=None, shared_mem=0) -> None:
        if name_expression not in self.name_expressions:
            raise KeyError(f"{name_expression} is not built for the host")
        params = packed_args(args)
        if not isinstance(params, int):
            raise ValueError(f"{name_expression}: arguments that do not pack: {args}")
        dims = (ctypes.c_longlong * 6)(*(*grid, 1, 1, 1)[:3], *(*block, 1, 1, 1)[:3])
        getattr(self._lib, _symbol(name_expression))(dims, ctypes.c_void_p(params))
        self.launched.append(name_expression)
