"""Scene contraction for unbounded captures (``reconstruct.nerf.scene_contraction: mipnerf360``):
the map and its inverse, the march past the box (linear, then uniform in disparity), the three
renderers agreeing on it, the occupancy grid over the contracted space, the inner box from the
cameras and the points; the CUDA kernels against their references on a GPU (marked ``gpu``)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels._reference import (FAR_RATIO, contract_reference, march_rays_reference, march_steps_reference,
                                uncontract_reference)
from stages.reconstruct.config import NerfParams
from stages.reconstruct.nerf.field import NerfField
from stages.reconstruct.nerf.method import contraction_box
from stages.reconstruct.nerf.occupancy import OccupancyGrid
from stages.reconstruct.nerf.render import EARLY_STOP_T, render_rays, render_rays_early_stop

from conftest import requires_gpu

AABB = torch.tensor([[-1.0, -0.5, 0.0], [1.0, 0.5, 2.0]])


def _rays(n: int, seed: int, device="cpu"):
    """Rays from cameras around and inside the box, looking every way (many leave it at once)."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, 3, generator=g) * torch.tensor([1.5, 1.0, 1.0]) + torch.tensor([0.0, 0.0, 1.0])
    d = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=-1)
    return o.to(device), d.to(device)


def _field(device="cpu", use_kernels=False) -> NerfField:
    torch.manual_seed(0)
    cfg = NerfParams(levels=4, log2_hashmap_size=10, base_resolution=4, max_resolution=32, hidden_dim=16,
                     scene_contraction="mipnerf360")
    field = NerfField(cfg, AABB, use_kernels=use_kernels).to(device)
    with torch.no_grad():
        field.encoding.table.uniform_(-1, 1)
    return field


def test_contraction_keeps_the_box_and_squeezes_the_world_into_a_shell():
    g = torch.Generator().manual_seed(0)
    inside = AABB[0] + torch.rand(1000, 3, generator=g) * (AABB[1] - AABB[0])
    x = contract_reference(inside, AABB)
    assert bool((x >= 0.25).all() and (x <= 0.75).all())
    # linear inside: the box's corners go to the corners of the middle cube
    torch.testing.assert_close(contract_reference(AABB, AABB), torch.tensor([[0.25] * 3, [0.75] * 3]))
    far = torch.nn.functional.normalize(torch.randn(1000, 3, generator=g), dim=-1) * 1e6
    y = contract_reference(far, AABB)
    assert bool((y >= 0).all() and (y <= 1).all())
    assert float((y - 0.5).abs().amax(dim=-1).min()) > 0.4999  # the outer surface of the shell
    # continuous at the box surface and monotone along a ray leaving it
    t = torch.linspace(0, 50, 2001)[:, None]
    ray = torch.tensor([0.0, 0.0, 1.0]) + t * torch.tensor([0.6, 0.3, 0.74])
    c = contract_reference(ray, AABB)
    gaps = (c[1:] - c[:-1]).norm(dim=-1)  # no jump at the surface: outside only ever shrinks the steps
    assert float(gaps.max()) <= float(gaps[0]) * (1 + 1e-4)
    radius = (c - 0.5).abs().amax(dim=-1)
    assert bool((radius[1:] >= radius[:-1] - 1e-7).all())
    # the inverse, out to 100 box sizes
    pts = torch.randn(1000, 3, generator=g) * 30
    torch.testing.assert_close(uncontract_reference(contract_reference(pts, AABB), AABB), pts, rtol=1e-3, atol=1e-3)


def test_contracted_steps_run_past_the_box_uniform_in_disparity():
    o, d = _rays(300, 1)
    jitter = torch.rand(300, generator=torch.Generator().manual_seed(2))
    dt = 0.02
    t, step, valid = march_steps_reference(o, d, jitter, AABB, dt, 2000, near=0.05, contract=True)
    n = valid.sum(dim=1)
    assert bool((valid == (torch.arange(2000)[None, :] < n[:, None])).all())  # a prefix of every row
    assert bool((n > 0).all()) and int(n.max()) < 2000  # every ray ends before the cap
    for i in range(300):
        ti, si = t[i, : n[i]], step[i, : n[i]]
        assert bool((ti[1:] > ti[:-1]).all())
        assert float(ti[0]) >= 0.05 and float(si[0]) == pytest.approx(dt)
        lin = int((si == dt).sum())  # the linear segment: every gap one step
        assert lin >= 10  # at least half the box diagonal (1.2 here) of linear steps
        torch.testing.assert_close(ti[1:lin] - ti[: lin - 1], si[: lin - 1], rtol=1e-4, atol=1e-6)
        disp = 1.0 / ti[lin:]  # then uniform in disparity, starting with a step of about dt
        gaps = disp[:-1] - disp[1:]
        torch.testing.assert_close(gaps, gaps.mean().expand_as(gaps), rtol=2e-3, atol=1e-7)
        assert 0.5 * dt < float(si[lin]) < 2 * dt
        # the last sample is far out: the contracted point is in the outermost shell
        far = contract_reference((o[i] + ti[-1] * d[i])[None], AABB)
        assert float((far - 0.5).abs().max()) > 0.49


def test_dense_packed_and_early_stop_renderers_agree_with_contraction():
    field = _field()
    grid = OccupancyGrid(field.aabb, resolution=8, contract=True)
    grid.mask.copy_(torch.rand(512, generator=torch.Generator().manual_seed(3)) < 0.7)
    o, d = _rays(150, 4)
    outs, grads = {}, {}
    for fused in (False, True):
        field.zero_grad()
        out = render_rays(field, grid, o, d, step_size=0.03, max_samples=300, near=0.02, perturb=True,
                          generator=torch.Generator().manual_seed(5), fused=fused)
        (out["rgb"].square().sum() + out["opacity"].sum() + 0.1 * out["depth"].sum()).backward()
        outs[fused] = out
        grads[fused] = [p.grad.clone() for p in field.parameters() if p.grad is not None]
    assert int(outs[True]["num_samples"]) == int(outs[False]["num_samples"]) > 3000
    for key in ("rgb", "opacity", "depth"):
        torch.testing.assert_close(outs[True][key], outs[False][key], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the early-stopping renderer of views: the midpoint render, up to what it skips
        mid = render_rays(field, grid, o, d, step_size=0.03, max_samples=300, near=0.02)
        early = render_rays_early_stop(field, grid, o, d, step_size=0.03, max_samples=300, near=0.02)
    torch.testing.assert_close(early["rgb"], mid["rgb"], rtol=0, atol=2 * EARLY_STOP_T + 1e-5)
    assert int(early["num_samples"]) <= int(mid["num_samples"])


def test_contracted_field_and_grid_cover_the_world():
    field = _field()
    far = torch.tensor([[30.0, -40.0, 5.0], [-200.0, 3.0, 90.0]])
    assert bool((field.density(far) > 0).all())  # a box-only field has no density there
    boxed = NerfField(NerfParams(levels=4, log2_hashmap_size=10, max_resolution=32), AABB)
    assert bool((boxed.density(far) == 0).all())
    grid = OccupancyGrid(AABB, resolution=8, contract=True)
    seen = []
    grid.update(lambda x: (seen.append(x), torch.zeros(len(x)))[1], 0.01, torch.Generator().manual_seed(0))
    x = torch.cat(seen)  # one jittered point per cell, in the world: it lands in its own cell
    assert torch.equal(grid.cell_index(x), torch.arange(512))
    assert float(x.abs().max()) > 10 * float(AABB.abs().max())


def test_contraction_box_holds_the_cameras_and_the_middle_of_the_points():
    from types import SimpleNamespace

    c2w = torch.eye(4).repeat(4, 1, 1)
    c2w[:, :3, 3] = torch.tensor([[2.0, 0, 0], [-2.0, 0, 0], [0, 2.0, 0], [0, -2.0, 0.5]])
    g = torch.Generator().manual_seed(0)
    pts = torch.cat([torch.randn(400, 3, generator=g) * 0.3 + torch.tensor([0.0, 0.0, 3.0]),
                     torch.full((4, 3), 500.0)])  # a few stray points far away do not blow it up
    box = contraction_box(SimpleNamespace(train=SimpleNamespace(c2w=c2w), points=pts))
    assert bool((box[0] <= c2w[:, :3, 3].min(0).values).all() and (box[1] >= c2w[:, :3, 3].max(0).values).all())
    assert float(box[1, 2]) > 3.2 and float(box[1].max()) < 10
    flat = contraction_box(SimpleNamespace(train=SimpleNamespace(c2w=c2w), points=None))
    assert bool((flat[1] - flat[0] > 0.3).all())  # cameras on a plane still give a box with a height


# ---------------------------------------------------------------------------- GPU: kernels vs references


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("capacity", [None, 5000])
def test_contracted_march_kernel_matches_the_reference(capacity):
    o, d = _rays(2000, 6, "cuda")
    jitter = torch.rand(2000, generator=torch.Generator().manual_seed(7)).cuda()
    occ = (torch.rand(32**3, generator=torch.Generator().manual_seed(8)) < 0.5).cuda()
    box = AABB.cuda()
    got = kernels.march_rays(o, d, jitter, box, occ, 0.01, 900, 0.05, capacity=capacity, contract=True,
                             use_kernels=True)
    want = kernels.march_rays(o, d, jitter, box, occ, 0.01, 900, 0.05, capacity=capacity, contract=True,
                              use_kernels=False)
    assert int(got.total) == int(want.total) > 20_000
    for name in ("ray_index", "t", "points", "offsets", "counts", "steps"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name  # same rounding, step by step (render.cu)


@pytest.mark.gpu
@requires_gpu
def test_composite_kernel_with_per_sample_steps_matches_the_reference():
    o, d = _rays(500, 9, "cuda")
    s = march_rays_reference(o, d, torch.full((500,), 0.5, device="cuda"), AABB.cuda(), None, 0.02, 600, 0.05,
                             contract=True)
    ray, t, _, offsets, counts, steps = s
    g = torch.Generator(device="cuda").manual_seed(1)
    sigma = (torch.rand(t.numel(), generator=g, device="cuda") * 20).requires_grad_()
    rgb = torch.rand(t.numel(), 3, generator=g, device="cuda").requires_grad_()
    cot = [torch.rand(500, 3, generator=g, device="cuda"), torch.rand(500, generator=g, device="cuda"),
           torch.rand(500, generator=g, device="cuda")]
    res = {}
    for use in (True, False):
        out = kernels.composite(sigma, rgb, t, offsets, counts, 0.02, steps=steps, use_kernels=use)
        grads = torch.autograd.grad(out, (sigma, rgb), cot)
        res[use] = (out, grads)
    # float sums in another order (the kernel's running sums vs cumprod): a few ulps per sample
    for a, b in zip(res[True][0], res[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(res[True][1], res[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert FAR_RATIO < 1
