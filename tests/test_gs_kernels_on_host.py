"""The 3DGS kernels that do not work as warps, built for the host CPU (tests/_host_cuda.py) and
run through the ops' CUDA path (kernels/_gs_cuda.py) on CPU tensors, against the twins.

CI has no GPU, so without this the kernels' code ran only in the marked GPU tests, on the few
sessions a GPU is lent. Here the projection (forward, backward and the input check), spherical
harmonics (forward and backward) and the tile binning kernels (counts, emit, finish, offsets) run on
every commit: the GPU tests' own bodies from tests/test_gs_kernels.py, with the same inputs and
tolerances, and ``kernels.gaussians`` sending CPU tensors down the CUDA path. What this cannot
check is how the threads run together (a race, a missing atomic) and the GPU's own arithmetic
(``__expf``, FMA contraction; the build here contracts nothing): the GPU tests stay for that. The
radix sort and the blending work as warps (shuffles, ballots) and stay GPU-only.
"""

from __future__ import annotations

import pytest
import torch

import kernels
import test_gs_kernels as gpu_tests
from _host_cuda import CXX, HostProgram
from kernels import _gs_cuda

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or clang++)")

HOST = ["project", "tiles"]  # programs whose kernels are thread-independent (tiles: not the radix sort)


@pytest.fixture(scope="module")
def host_programs(tmp_path_factory):
    build = tmp_path_factory.mktemp("host_kernels")
    tiles = [n for n in _gs_cuda.program("tiles").name_expressions if not n.startswith("radix_")]
    return {"project": HostProgram(_gs_cuda.program("project"), build),
            "tiles": HostProgram(_gs_cuda.program("tiles"), build, tiles)}


@pytest.fixture
def host(host_programs, monkeypatch):
    """CPU tensors take the ops' CUDA path, whose launches run the host builds."""

    def program(name):
        if name not in host_programs:
            raise AssertionError(f"program {name!r} synchronises threads: it has no host build")
        return host_programs[name]

    monkeypatch.setattr(_gs_cuda, "program", program)
    monkeypatch.setattr(kernels.gaussians, "_use_cuda", lambda device: True)
    monkeypatch.setattr(_gs_cuda, "SORT", "torch")
    for p in host_programs.values():
        p.launched.clear()
    return torch.device("cpu")


@pytest.mark.parametrize("antialiased", [False, True])
def test_projection_kernels_match_the_twin(host, host_programs, antialiased):
    gpu_tests.test_projection_matches_the_twin(host, antialiased)
    assert {"projection_fwd", "projection_bwd"} <= set(host_programs["project"].launched)


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_spherical_harmonics_kernels_match_the_twin(host, host_programs, degree):
    gpu_tests.test_spherical_harmonics_match_the_twin(host, degree)
    assert {"sh_fwd", "sh_bwd"} <= set(host_programs["project"].launched)


@pytest.mark.parametrize("n_sets, n_cams, degree", [(37, 5, 3), (300, 2, 1), (65, 1, 2)])
def test_spherical_harmonics_kernels_across_blocks(host, host_programs, n_sets, n_cams, degree):
    gpu_tests.test_spherical_harmonics_across_blocks(host, n_sets, n_cams, degree)
    assert {"sh_fwd", "sh_bwd"} <= set(host_programs["project"].launched)


@pytest.mark.parametrize("sort", ["torch", "torch16"])
@pytest.mark.parametrize("tile_size", [8, 16, 32])
def test_tile_kernels_match_the_twin(host, host_programs, tile_size, sort, monkeypatch):
    gpu_tests.test_intersections_and_offsets_equal_the_twin(host, tile_size, sort, monkeypatch)
    assert {"tile_counts", "tile_emit", "tile_finish", "tile_offsets"} <= set(host_programs["tiles"].launched)


def test_exact_binning_kernels_drop_only_tiles_alpha_cannot_reach(host):
    gpu_tests.test_rasterizer_binning_drops_only_tiles_alpha_cannot_reach(host)


def test_sh_backward_writes_every_coefficient_and_no_unasked_direction(host):
    """sh_bwd runs three threads per coefficient set and writes the whole set, those past the degree
    and past 16 rows with 0 (its buffer is not zero-filled), and v_dirs only when asked for."""
    g = torch.Generator().manual_seed(4)
    dirs = torch.randn(2, 50, 3, generator=g)
    coeffs = torch.randn(50, 18, 3, generator=g, requires_grad=True)  # K = 18: two rows no degree reads
    (_gs_cuda.spherical_harmonics(2, dirs, coeffs) * torch.randn(2, 50, 3, generator=g)).sum().backward()
    assert torch.isfinite(coeffs.grad).all()
    assert (coeffs.grad[:, 9:] == 0).all() and (coeffs.grad[:, :9] != 0).all()


def test_check_kernel_flags_bad_values(host):
    """The projection program's input check (check_inputs) names non-finite means and zero quaternions."""
    means, quats, scales, opac, _ = gpu_tests.gaussians(200, seed=0)
    views, Ks = gpu_tests.camera(32, 32, 30.0, n=1)
    means[7, 1] = float("nan")
    with pytest.raises(ValueError, match="means must be finite"):
        kernels.project_gaussians(means, quats, scales, views, Ks, 32, 32)
    means[7, 1] = 0.0
    quats[3] = 0.0
    with pytest.raises(ValueError, match="quat"):
        kernels.project_gaussians(means, quats, scales, views, Ks, 32, 32)
