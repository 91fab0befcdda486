"""instant-ngp's occupancy cascades for unbounded captures (``reconstruct.nerf.scene_contraction:
cascades``): the nested boxes and their cells, the march with steps growing with the distance, the
distortion's coordinate along it, the grid's refresh, the three renderers agreeing, a short training
run; the march kernel built for the host CPU against its reference, and on a GPU (marked ``gpu``)."""
from __future__ import annotations

import math

import pytest
import torch

import kernels
import kernels.render
from kernels._reference import (cascade_box_reference, cascade_level_reference, distortion_coords,
                                march_rays_reference, march_steps_reference, occupancy_cell_reference)
from stages.reconstruct.config import NerfParams
from stages.reconstruct.nerf.field import NerfField
from stages.reconstruct.nerf.method import BOX_FINEST, finest_resolution
from stages.reconstruct.nerf.occupancy import OccupancyGrid
from stages.reconstruct.nerf.render import render_rays, render_rays_early_stop
from stages.common.params import ParamsError

from _host_cuda import CXX, HostProgram
from conftest import requires_gpu

AABB = torch.tensor([[-1.0, -0.5, 0.0], [1.0, 0.5, 2.0]])
CASCADES, CONE = 4, 1.0 / 64  # aabb_scale 8; a wide cone keeps the reference's step loop short


def _rays(n: int, seed: int, device="cpu"):
    """Rays from cameras around and inside the box, looking every way (many leave it at once)."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, 3, generator=g) * torch.tensor([1.5, 1.0, 1.0]) + torch.tensor([0.0, 0.0, 1.0])
    d = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=-1)
    return o.to(device), d.to(device)


def _params(**kw) -> NerfParams:
    return NerfParams(levels=4, log2_hashmap_size=10, base_resolution=4, max_resolution=32, hidden_dim=16,
                      scene_contraction="cascades", aabb_scale=2 ** (CASCADES - 1), cone_angle=CONE, **kw)


def _field(device="cpu", use_kernels=False) -> NerfField:
    torch.manual_seed(0)
    field = NerfField(_params(), AABB, use_kernels=use_kernels).to(device)
    with torch.no_grad():
        field.encoding.table.uniform_(-1, 1)
    return field


def test_points_fall_in_the_smallest_box_that_holds_them():
    centre, half = (AABB[0] + AABB[1]) / 2, (AABB[1] - AABB[0]) / 2
    # on the diagonal at 0.5, 1.5, 3, 6 and 100 half-sizes from the centre
    pts = centre + torch.tensor([0.5, 1.5, 3.0, 6.0, 100.0])[:, None] * half
    level, u = cascade_level_reference(pts, AABB, CASCADES)
    assert level.tolist() == [0, 1, 2, 3, 3]  # the last box also takes everything past it
    torch.testing.assert_close(u[:4], torch.tensor([0.5, 0.75, 0.75, 0.75])[:, None].expand(4, 3))
    torch.testing.assert_close(cascade_box_reference(AABB, CASCADES), torch.stack([centre - 8 * half,
                                                                                   centre + 8 * half]))
    r = 8
    cells = occupancy_cell_reference(pts, AABB, r, cascades=CASCADES)
    # each level's r^3 cells after those of the levels inside it; 0.5 and 0.75 of the way to a corner
    assert cells.tolist() == [0 * r**3 + 6 * 73, 1 * r**3 + 7 * 73, 2 * r**3 + 7 * 73, 3 * r**3 + 7 * 73,
                              3 * r**3 + 7 * 73]
    # a point on a box's surface still belongs to it (n <= 2^k)
    assert cascade_level_reference(centre[None] + 2.0 * half, AABB, CASCADES)[0].tolist() == [1]


def test_cascaded_steps_grow_with_the_distance_and_cross_the_outer_box():
    o, d = _rays(300, 1)
    jitter = torch.rand(300, generator=torch.Generator().manual_seed(2))
    dt = 0.01
    t, step, valid = march_steps_reference(o, d, jitter, AABB, dt, 2000, near=0.05, cascades=CASCADES, cone=CONE)
    torch.testing.assert_close(step, torch.clamp(t * CONE, min=dt))
    assert bool((t[:, 1:] == t[:, :-1] + step[:, :-1]).all())  # one step after the other
    assert bool((valid[:, 1:] <= valid[:, :-1]).all())  # a prefix of each row
    outer = cascade_box_reference(AABB, CASCADES)
    _, tmax = kernels._reference.ray_box_reference(o, d, outer, 0.05)
    last = t.gather(1, (valid.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]
    # every ray runs to the outer box's exit (well inside 2000 steps) and no further
    assert bool((last < tmax).all()) and bool((last + step.gather(1, (valid.sum(1, keepdim=True) - 1))[:, 0]
                                                >= tmax).all())
    assert int(valid.sum(1).max()) < 1000
    pts = o[:, None] + t[..., None] * d[:, None]
    inside = ((pts >= outer[0] - 1e-4) & (pts <= outer[1] + 1e-4)).all(-1)
    assert bool(inside[valid].all())
    # past dt / cone the steps are cone t: geometric, as instant-ngp's cone tracing
    far = valid & (t > 2 * dt / CONE)
    assert int(far.sum()) > 1000
    torch.testing.assert_close(step[far], t[far] * CONE)


def test_distortion_coordinate_counts_one_base_step_per_march_step():
    o, d = _rays(50, 3)
    dt = 0.01
    t, step, valid = march_steps_reference(o, d, torch.full((50,), 0.5), AABB, dt, 2000, 0.05, cascades=CASCADES,
                                           cone=CONE)
    u = distortion_coords(t, step, dt, cone=True)
    du = (u[:, 1:] - u[:, :-1])[valid[:, 1:]]
    # du/dt = dt / step: each step moves u by dt, up to the step's growth within it (a factor 1 + cone)
    assert float(du.min()) > dt / (1 + CONE) * 0.999 and float(du.max()) < dt * 1.001
    near = valid & (step == dt)
    torch.testing.assert_close(u[near], t[near].double())  # metric t while the step is the base step


def test_a_refreshed_cell_is_the_cell_its_points_fall_in():
    grid = OccupancyGrid(AABB, resolution=8, cascades=CASCADES)
    assert grid.mask.numel() == CASCADES * 8**3
    seen = []
    grid.update(lambda x: seen.append(x) or torch.ones(len(x)), step_size=0.01,
                generator=torch.Generator().manual_seed(0))
    x = torch.cat(seen)
    cells = torch.arange(grid.mask.numel())
    level, _ = cascade_level_reference(x, AABB, CASCADES)
    # cells of box k inside box k - 1 are never looked up (the smaller box's cells are); the rest round-trip
    own = level == cells // 8**3
    assert int(own.sum()) >= 8**3 + (CASCADES - 1) * (8**3 - 4**3)
    assert torch.equal(grid.cell_index(x[own]), cells[own])


def test_dense_packed_and_early_stop_renderers_agree_with_cascades():
    field = _field()
    grid = OccupancyGrid(field.aabb, resolution=8, cascades=CASCADES)
    grid.mask.copy_(torch.rand(grid.mask.numel(), generator=torch.Generator().manual_seed(4)) < 0.6)
    o, d = _rays(120, 5)
    outs, grads = {}, {}
    for fused in (False, True):
        field.zero_grad()
        out = render_rays(field, grid, o, d, 0.02, 1500, 0.05, perturb=True,
                          generator=torch.Generator().manual_seed(6), fused=fused, distortion=True)
        (out["rgb"].square().sum() + out["opacity"].sum() + 3.0 * out["distortion"].sum()).backward()
        outs[fused], grads[fused] = out, [p.grad.clone() for p in field.parameters() if p.grad is not None]
    assert int(outs[True]["num_samples"]) == int(outs[False]["num_samples"]) > 5000
    for key in ("rgb", "opacity", "depth", "distortion"):
        torch.testing.assert_close(outs[True][key], outs[False][key], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    mid = render_rays(field, grid, o, d, 0.02, 1500, 0.05)
    early = render_rays_early_stop(field, grid, o, d, 0.02, 1500, 0.05)
    torch.testing.assert_close(early["rgb"], mid["rgb"], rtol=0, atol=2e-4)
    assert int(early["num_samples"]) <= int(mid["num_samples"])


def test_the_field_spans_the_outer_box_and_the_finest_level_scales_with_it():
    field = _field()
    outer = cascade_box_reference(AABB, CASCADES)
    torch.testing.assert_close(field.normalize(outer), torch.tensor([[0.0] * 3, [1.0] * 3]))
    far = outer[1] + 1.0  # past every box: no density
    inside = (AABB[0] + AABB[1]) / 2 + 3.0
    sigma = field.density(torch.stack([far, inside]))
    assert float(sigma[0].detach()) == 0.0 and float(sigma[1].detach()) > 0.0
    cfg = NerfParams(scene_contraction="cascades", aabb_scale=16, max_resolution="auto")
    assert finest_resolution(cfg, None, AABB) == BOX_FINEST * 16  # instant-ngp's 2048 per box, over 16 of them
    for bad in (3, 0, 256):
        with pytest.raises(ParamsError, match="aabb_scale"):
            NerfParams(scene_contraction="cascades", aabb_scale=bad)


@pytest.mark.parametrize("call, match", [
    (lambda o, d, j: kernels.march_rays(o, d, j, AABB, None, 0.1, 8, contract=True, cascades=2), "exclude"),
    (lambda o, d, j: kernels.march_rays(o, d, j, AABB, torch.ones(8**3, dtype=torch.bool), 0.1, 8, cascades=2),
     r"occupancy must have 2 r\^3 cells, got 512"),
    (lambda o, d, j: kernels.march_rays(o, d, j, AABB, None, 0.1, 8, cascades=-1), "cascades must be an int"),
])
def test_bad_cascade_arguments_are_named(call, match):
    o, d = _rays(5, 7)
    with pytest.raises(ValueError, match=match):
        call(o, d, torch.zeros(5))


def test_a_cascaded_nerf_trains_and_its_model_renders_back(tmp_path):
    from stages.reconstruct.config import ReconstructParams
    from stages.reconstruct.nerf.method import NerfMethod

    params = ReconstructParams(method="nerf", steps=30, batch_rays=256, nerf=_params(samples_per_ray=64))
    method = NerfMethod(params, AABB, torch.device("cpu"))
    assert method.field.cascades == CASCADES
    assert method.grid.mask.numel() == CASCADES * params.nerf.occ_resolution**3
    # a ray from a corner of the box to the far corner of the outermost one ends inside its steps
    corner = AABB[0][None]
    outer = cascade_box_reference(AABB, CASCADES)
    d = torch.nn.functional.normalize(outer[1] - corner, dim=-1)
    t, step, valid = march_steps_reference(corner, d, torch.zeros(1), AABB, method.step_size, method.max_steps,
                                           0.0, cascades=CASCADES, cone=CONE)
    assert bool(valid[0, -1]) is False and float(t[0, valid[0]][-1]) > 0.99 * float((outer[1] - corner).norm())
    o, d = _rays(64, 8)
    before = method.render_rays(o, d)
    state = method.state_dict()
    again = NerfMethod(params, AABB * 2, torch.device("cpu"))  # another box until the state is loaded
    again.load_state_dict(state)
    torch.testing.assert_close(again.render_rays(o, d), before)
    assert math.isclose(again.step_size, method.step_size)


# --------------------------------------------------------------- the march kernel, built for the host CPU


@pytest.fixture(scope="module")
def host_march(tmp_path_factory):
    if CXX is None:
        pytest.skip("needs a host C++ compiler (g++ or clang++)")
    names = [n for n in kernels.render._NAMES if n.startswith("march_rays")]  # compositing: test_render_kernels_on_host
    return HostProgram(kernels.render.program(), tmp_path_factory.mktemp("host_march"), names)


def _march_both(o, d, jitter, occ, capacity, space: dict):
    got = kernels.march_rays(o, d, jitter, AABB.to(o.device), occ, 0.01, 1500, 0.05, capacity=capacity,
                             use_kernels=True, **space)
    want = kernels.march_rays(o, d, jitter, AABB.to(o.device), occ, 0.01, 1500, 0.05, capacity=capacity,
                              use_kernels=False, **space)
    assert int(got.total) == int(want.total) > 3000
    for name in ("ray_index", "t", "points", "offsets", "counts", "steps"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and torch.equal(a, b), name  # same rounding, step by step (render.cu)


@pytest.mark.parametrize("space", [{}, {"contract": True}, {"cascades": CASCADES, "cone": CONE}],
                         ids=["box", "contract", "cascades"])
@pytest.mark.parametrize("capacity", [None, 4000])
def test_host_built_march_kernel_keeps_exactly_the_reference_samples(host_march, monkeypatch, space, capacity):
    monkeypatch.setattr(kernels.render, "program", lambda: host_march)
    monkeypatch.setattr(kernels.render, "_use_kernels", lambda device, use: use is not False)
    o, d = _rays(300, 9)
    jitter = torch.rand(300, generator=torch.Generator().manual_seed(10))
    cells = max(1, space.get("cascades", 0)) * 16**3
    occ = torch.rand(cells, generator=torch.Generator().manual_seed(11)) < 0.7
    _march_both(o, d, jitter, occ, capacity, space)


# ---------------------------------------------------------------------------- GPU: kernels vs references


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("capacity", [None, 60_000])
def test_cascaded_march_kernel_matches_the_reference(capacity):
    o, d = _rays(2000, 12, "cuda")
    jitter = torch.rand(2000, generator=torch.Generator().manual_seed(13)).cuda()
    occ = (torch.rand(CASCADES * 32**3, generator=torch.Generator().manual_seed(14)) < 0.5).cuda()
    _march_both(o, d, jitter, occ, capacity, {"cascades": CASCADES, "cone": CONE})


@pytest.mark.gpu
@requires_gpu
def test_composite_kernel_with_cascade_steps_matches_the_reference():
    from test_render_kernels import composite_kernel_matches_the_twin

    composite_kernel_matches_the_twin("cuda", True, True, cone=True)


@pytest.mark.gpu
@requires_gpu
def test_fused_render_with_cascades_on_gpu_matches_the_dense_renderer():
    field = _field("cuda", use_kernels=True)
    grid = OccupancyGrid(field.aabb, resolution=16, cascades=CASCADES).cuda()
    grid.mask.copy_((torch.rand(grid.mask.numel(), generator=torch.Generator().manual_seed(15)) < 0.6).cuda())
    o, d = _rays(1000, 16, "cuda")
    a = render_rays(field, grid, o, d, 0.02, 1500, 0.05, fused=True, distortion=True)
    b = render_rays(field, grid, o, d, 0.02, 1500, 0.05, fused=False, distortion=True)
    assert int(a["num_samples"]) == int(b["num_samples"]) > 20_000
    for key in ("rgb", "opacity", "depth", "distortion"):
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4)
