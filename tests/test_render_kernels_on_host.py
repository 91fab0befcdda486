"""The NeRF's compositing kernels (csrc/render.cu: composite_fwd, composite_bwd, with and without
the distortion term; one step for all samples, or the per-sample steps of contracted or cascaded
rays), built for the host CPU (tests/_host_cuda.py) and run through ``kernels.composite``'s CUDA path
on CPU tensors, against ``composite_reference``: the GPU test's own body (tests/test_render_kernels.py)
with its inputs and tolerances. One thread per ray and no shared memory, so the host build runs them as
the GPU does, up to the GPU's own arithmetic (``expf``, FMA contraction), which the marked GPU test
covers."""

from __future__ import annotations

import pytest

import kernels.render
from _host_cuda import CXX, HostProgram
from test_render_kernels import composite_kernel_matches_the_twin

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or clang++)")


@pytest.fixture(scope="module")
def host_render(tmp_path_factory):
    names = ["composite_fwd", "composite_bwd"]
    return HostProgram(kernels.render.program(), tmp_path_factory.mktemp("host_render"), names)


@pytest.mark.parametrize("distortion", [False, True])
@pytest.mark.parametrize("steps", ["box", "contracted", "cascades"])
def test_composite_kernels_match_the_twin(host_render, monkeypatch, distortion, steps):
    monkeypatch.setattr(kernels.render, "program", lambda: host_render)
    monkeypatch.setattr(kernels.render, "_use_kernels", lambda device, use: use is not False)
    host_render.launched.clear()
    composite_kernel_matches_the_twin("cpu", distortion, steps != "box", n_rays=600, cone=steps == "cascades")
    assert host_render.launched == ["composite_fwd", "composite_bwd"]
