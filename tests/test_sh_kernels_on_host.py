"""The SH kernels' CUDA source, built as host C++ and run one thread at a time, against the twin.

CI has no GPU, so the kernels themselves run only in the marked GPU tests. Their spherical-harmonics
part (csrc/gaussians_project.cu from its "spherical harmonics" rule to the end) uses no CUDA intrinsic
besides rsqrtf, so a few lines of shim let g++ build it for the CPU: each launch becomes a loop
over the grid's threads, in index order. That checks the kernels' indexing and arithmetic on every
commit (the one-thread-per-coefficient-set backward: the broadcast over cameras, the unused
coefficients written with 0, v_dirs left alone when not asked for), not their parallel behaviour,
which the GPU tests cover.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from kernels import _gs_reference as ref
from kernels import loader

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or clang++)")

SECTION = "// ---------------------------------------------------------------------------- spherical harmonics"

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
struct Dim { long long x; };
static Dim blockIdx, threadIdx, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::fmaxf;
"""

# argv: degree sets cameras K with_dirs in.bin out.bin; a launch = every thread of the grid in turn
MAIN = r"""
static void grid(long long threads, void (*body)()) {
  blockDim.x = 256;
  for (long long t = 0; t < (threads + 255) / 256 * 256; ++t) { blockIdx.x = t / 256; threadIdx.x = t % 256; body(); }
}
static int degree, K, with_dirs; static long long sets, items;
static std::vector<float> dirs, coeffs, v_colors, colors, v_coeffs, v_dirs;
int main(int argc, char** argv) {
  degree = atoi(argv[1]); sets = atoll(argv[2]); items = sets * atoll(argv[3]); K = atoi(argv[4]);
  with_dirs = atoi(argv[5]);
  dirs.resize(items * 3); coeffs.resize(sets * K * 3); v_colors.resize(items * 3);
  colors.assign(items * 3, -7.f); v_coeffs.assign(sets * K * 3, -7.f); v_dirs.assign(items * 3, -7.f);
  FILE* f = fopen(argv[6], "rb");
  if (!f || fread(dirs.data(), 4, dirs.size(), f) != dirs.size() ||
      fread(coeffs.data(), 4, coeffs.size(), f) != coeffs.size() ||
      fread(v_colors.data(), 4, v_colors.size(), f) != v_colors.size()) return 2;
  fclose(f);
  grid(items, [] { sh_fwd(degree, items, sets, K, dirs.data(), coeffs.data(), colors.data()); });
  grid(sets, [] { sh_bwd(degree, items, sets, K, dirs.data(), coeffs.data(), v_colors.data(), v_coeffs.data(),
                         with_dirs ? v_dirs.data() : nullptr); });
  f = fopen(argv[7], "wb");
  fwrite(colors.data(), 4, colors.size(), f); fwrite(v_coeffs.data(), 4, v_coeffs.size(), f);
  fwrite(v_dirs.data(), 4, v_dirs.size(), f);
  fclose(f);
  return 0;
}
"""


@pytest.fixture(scope="module")
def host_sh(tmp_path_factory):
    source = (loader.CSRC_DIR / "gaussians_project.cu").read_text()
    assert SECTION in source, "gaussians_project.cu lost its spherical-harmonics rule: update this test"
    folder = tmp_path_factory.mktemp("sh_host")
    (folder / "sh.cpp").write_text(SHIM + source[source.index(SECTION):] + MAIN)
    exe = folder / "sh"
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-o", str(exe), str(folder / "sh.cpp")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return folder, exe


def _run(host_sh, degree, sets, cams, K, with_dirs, seed):
    folder, exe = host_sh
    g = torch.Generator().manual_seed(seed)
    dirs, coeffs = torch.randn(cams, sets, 3, generator=g), torch.randn(sets, K, 3, generator=g)
    v_colors = torch.randn(cams, sets, 3, generator=g)
    (folder / "in.bin").write_bytes(dirs.numpy().tobytes() + coeffs.numpy().tobytes() + v_colors.numpy().tobytes())
    done = subprocess.run([str(exe), str(degree), str(sets), str(cams), str(K), str(int(with_dirs)),
                           str(folder / "in.bin"), str(folder / "out.bin")])
    assert done.returncode == 0
    raw = torch.from_numpy(np.fromfile(folder / "out.bin", dtype=np.float32))
    items = cams * sets
    colors, v_coeffs, v_dirs = raw.split([items * 3, sets * K * 3, items * 3])
    return (dirs, coeffs, v_colors), (colors.view(cams, sets, 3), v_coeffs.view(sets, K, 3), v_dirs.view(cams, sets, 3))


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
@pytest.mark.parametrize("cams", [1, 3], ids=["one camera", "three cameras share a set"])
def test_host_built_sh_kernels_match_the_twin(host_sh, degree, cams):
    (dirs, coeffs, v_colors), (colors, v_coeffs, v_dirs) = _run(host_sh, degree, 300, cams, 16, True, degree + cams)
    d, c = dirs.double().requires_grad_(), coeffs.double().requires_grad_()
    want = ref.spherical_harmonics_reference(degree, d, c.expand(cams, *c.shape))
    g_dirs, g_coeffs = torch.autograd.grad((want * v_colors.double()).sum(), (d, c), allow_unused=True)
    g_dirs = torch.zeros_like(d) if g_dirs is None else g_dirs  # degree 0 does not depend on the direction
    # float32 sums of at most 16 terms (x3 cameras) of O(1) values against float64
    torch.testing.assert_close(colors.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_coeffs.double(), g_coeffs, rtol=1e-5, atol=1e-5)  # every one written
    torch.testing.assert_close(v_dirs.double(), g_dirs, rtol=1e-4, atol=1e-4)
    assert (v_coeffs[:, (degree + 1) ** 2:] == 0).all(), "coefficients past the degree get a zero gradient"


def test_host_built_sh_backward_leaves_v_dirs_alone_when_not_asked(host_sh):
    _, (_, v_coeffs, v_dirs) = _run(host_sh, 3, 50, 2, 16, False, 7)
    assert (v_dirs == -7.0).all(), "v_dirs == nullptr: nothing may be written"
    assert (v_coeffs != -7.0).all()


def test_host_built_sh_backward_zeroes_coefficients_past_16(host_sh):
    """K > 16 (a caller's padded layout): rows 16.. get 0, not whatever the buffer held."""
    _, (_, v_coeffs, _) = _run(host_sh, 3, 20, 1, 18, True, 8)
    assert (v_coeffs[:, 16:] == 0).all() and (v_coeffs[:, :16] != -7.0).all()
