"""Packed-sample ray marching and compositing (kernels/render.py): references on the CPU, and the
CUDA kernels against them on a GPU (marked ``gpu``)."""
from __future__ import annotations

import pytest
import torch

import kernels
from stages.reconstruct.config import NerfParams
from stages.reconstruct.nerf.field import NerfField
from stages.reconstruct.nerf.occupancy import OccupancyGrid
from stages.reconstruct.nerf.render import render_rays

from conftest import requires_gpu

AABB = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]


def _rays(n: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, 3, generator=g) * 0.3 + torch.tensor([0.0, 0.0, -2.5])
    d = torch.nn.functional.normalize(torch.tensor([0.0, 0.0, 1.0]) + torch.randn(n, 3, generator=g) * 0.3, dim=-1)
    d[0] = torch.tensor([0.0, 0.0, 1.0])  # axis-aligned: two direction components are 0
    if n > 2:
        o[1], d[1] = torch.tensor([5.0, 5.0, 5.0]), torch.tensor([1.0, 0.0, 0.0])  # misses the box
        o[2] = torch.tensor([0.1, -0.2, 0.3])  # starts inside the box
    return o.to(device), d.to(device)


def _grid(r: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(r, r, r, generator=g) < 0.6).reshape(-1).to(device)


def _field(device="cpu", use_kernels=False) -> NerfField:
    torch.manual_seed(0)
    cfg = NerfParams(levels=4, log2_hashmap_size=10, base_resolution=4, max_resolution=32, hidden_dim=16)
    field = NerfField(cfg, torch.tensor(AABB), use_kernels=use_kernels).to(device)
    with torch.no_grad():
        field.encoding.table.uniform_(-1, 1)
    return field


# ---------------------------------------------------------------------------- CPU (references)


def test_march_example_and_packing():
    o, d = _rays(300, 0)
    jitter = torch.rand(300, generator=torch.Generator().manual_seed(1))
    s = kernels.march_rays(o, d, jitter, torch.tensor(AABB), _grid(8, 2), dt=0.02, max_samples=256, near=0.05)
    assert s.counts[1] == 0  # the ray that misses the box
    assert int(s.counts.sum()) == s.t.numel() == s.points.shape[0] == s.ray_index.numel()
    assert torch.equal(s.offsets, torch.cumsum(s.counts.long(), 0) - s.counts.long())
    assert torch.equal(s.ray_index, torch.repeat_interleave(torch.arange(300), s.counts.long()))
    same_ray = s.ray_index[1:] == s.ray_index[:-1]
    assert bool((s.t[1:][same_ray] > s.t[:-1][same_ray]).all())  # marching order within a ray
    torch.testing.assert_close(s.points, o[s.ray_index] + s.t[:, None] * d[s.ray_index])
    assert bool((s.t >= 0.05).all()) and bool((s.points.abs() <= 1 + 1e-5).all())


def test_fused_render_matches_the_dense_renderer_values_and_gradients():
    field = _field()
    grid = OccupancyGrid(field.aabb, resolution=8)
    grid.mask.copy_(_grid(8, 3))
    o, d = _rays(200, 4)
    outs, grads = {}, {}
    for fused in (False, True):
        field.zero_grad()
        gen = torch.Generator().manual_seed(5)  # same jitter draws for both paths
        out = render_rays(field, grid, o, d, step_size=0.02, max_samples=256, near=0.02, perturb=True,
                          generator=gen, fused=fused, distortion=True)
        (out["rgb"].square().sum() + out["opacity"].sum() + 0.1 * out["depth"].sum()
         + 3.0 * out["distortion"].sum()).backward()
        outs[fused] = out
        grads[fused] = [p.grad.clone() for p in field.parameters() if p.grad is not None]
    assert int(outs[True]["num_samples"]) == int(outs[False]["num_samples"]) > 1000
    assert float(outs[True]["distortion"].max()) > 1e-3
    for key in ("rgb", "opacity", "depth", "distortion"):
        torch.testing.assert_close(outs[True][key], outs[False][key], rtol=1e-5, atol=1e-6)
    assert len(grads[True]) == len(grads[False])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_composite_reference_gradients_in_float64():
    g = torch.Generator().manual_seed(6)
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    offsets = torch.cumsum(counts.long(), 0) - counts.long()
    n = int(counts.sum())
    sigma = (torch.rand(n, generator=g, dtype=torch.float64) * 20).requires_grad_()
    rgb = torch.rand(n, 3, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.rand(n, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s, c: kernels.composite_reference(s, c, t, offsets, counts, 0.05),
                                    (sigma, rgb))
    color, opacity, _ = kernels.composite_reference(sigma, rgb, t, offsets, counts, 0.05)
    assert float(opacity[1].detach()) == 0.0 and bool((opacity <= 1).all())


@pytest.mark.parametrize("call, match", [
    (lambda o, d, j, b: kernels.march_rays(o[:, :2], d, j, b, None, 0.1, 8), r"origins must have shape \[N, 3\]"),
    (lambda o, d, j, b: kernels.march_rays(o, d[:3], j, b, None, 0.1, 8), r"dirs must have shape \[5, 3\]"),
    (lambda o, d, j, b: kernels.march_rays(o, d, j.double(), b, None, 0.1, 8), "jitter must be torch.float32"),
    (lambda o, d, j, b: kernels.march_rays(o, d, j, b, torch.ones(10, dtype=torch.bool), 0.1, 8),
     "occupancy must have r\\^3 cells, got 10"),
    (lambda o, d, j, b: kernels.march_rays(o, d, j, b, torch.ones(8), 0.1, 8), "occupancy must be a bool tensor"),
    (lambda o, d, j, b: kernels.march_rays(o, d, j, b, None, 0.0, 8), "dt must be > 0"),
    (lambda o, d, j, b: kernels.composite(torch.zeros(4), torch.zeros(4, 2), torch.zeros(4),
                                          torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32), 0.1),
     r"rgb must have shape \[4, 3\]"),
    (lambda o, d, j, b: kernels.composite(torch.zeros(4), torch.zeros(4, 3), torch.zeros(4),
                                          torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1),
     "offsets must be torch.int64"),
])
def test_bad_arguments_are_named(call, match):
    o, d = _rays(5, 7)
    with pytest.raises(ValueError, match=match):
        call(o, d, torch.zeros(5), torch.tensor(AABB))


# ---------------------------------------------------------------------------- GPU: kernels vs references


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n, r", [(1, 8), (1000, 16), (70000, 32)])
def test_march_kernel_keeps_exactly_the_reference_samples(n, r):
    o, d = _rays(n, 10 + n, "cuda")
    jitter = torch.rand(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
    box = torch.tensor(AABB, device="cuda")
    for occ in (None, _grid(r, n, "cuda")):
        got = kernels.march_rays(o, d, jitter, box, occ, 0.01, 512, 0.05, use_kernels=True)
        want = kernels.march_rays(o, d, jitter, box, occ, 0.01, 512, 0.05, use_kernels=False)
        for name in ("counts", "offsets", "ray_index", "t", "points"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, occ is not None)


def composite_case(device, n_rays: int = 5000, seed: int = 11, contracted: bool = False, cone: bool = False):
    """Packed samples of ``n_rays`` rays with 0 to 299 samples each (the first three 0, 1 and 299):
    sigma up to 50, t ascending in each ray over [0, 2); ``contracted``: each sample its own step, growing
    geometrically out to ~1000 times the first, as contracted rays' steps do; ``cone``: steps max(0.01, t / 64)
    one after the other from t in [0, 1), as rays through occupancy cascades take them. Returns (sigma, rgb, t,
    offsets, counts, steps or None, the cotangents of color, opacity, depth and distortion)."""
    g = torch.Generator(device=device).manual_seed(seed)
    counts = torch.randint(0, 300, (n_rays,), device=device, generator=g, dtype=torch.int32)
    counts[:3] = torch.tensor([0, 1, 299], dtype=torch.int32)
    offsets = torch.cumsum(counts.long(), 0) - counts.long()
    n = int(counts.sum())
    sigma = (torch.rand(n, device=device, generator=g) * 50).requires_grad_()
    rgb = torch.rand(n, 3, device=device, generator=g).requires_grad_()
    steps = None
    pos = torch.arange(n, device=device) - torch.repeat_interleave(offsets, counts.long())
    if cone:
        ray = torch.repeat_interleave(torch.arange(n_rays, device=device), counts.long())
        tr, ts, st = torch.rand(n_rays, device=device, generator=g), [], []
        for _ in range(int(counts.max())):
            st.append(torch.clamp(tr / 64.0, min=0.01))
            ts.append(tr)
            tr = tr + st[-1]
        t, steps = torch.stack(ts, 1)[ray, pos], torch.stack(st, 1)[ray, pos]
    elif contracted:
        steps = 0.01 * 1.024 ** pos.float() * (0.5 + torch.rand(n, device=device, generator=g))
        ray = torch.repeat_interleave(torch.arange(n_rays, device=device), counts.long())
        run = torch.cumsum(steps.double(), 0)  # in double: the running sum over all rays reaches ~1e6
        before_ray = torch.cat([run.new_zeros(1), run])[offsets][ray]  # the sum up to the ray's first
        t = (torch.rand(n_rays, device=device, generator=g)[ray] + run - before_ray - 0.5 * steps).float()
    else:
        t = (pos + torch.rand(n, device=device, generator=g)) / 150.0  # ascending over [0, 2) in a ray
    cots = [torch.randn(n_rays, 3, device=device, generator=g), torch.randn(n_rays, device=device, generator=g),
            torch.randn(n_rays, device=device, generator=g), torch.randn(n_rays, device=device, generator=g)]
    return sigma, rgb, t.contiguous(), offsets, counts, steps, cots


def composite_kernel_matches_the_twin(device, distortion: bool, contracted: bool, n_rays: int = 5000,
                                      cone: bool = False):
    """The compositing kernels against ``composite_reference``: outputs and the gradients of sigma and
    rgb under random cotangents (the body of the GPU test and of its host build, test_render_kernels_on_host);
    ``cone``: the per-sample steps are read as those of occupancy cascades (the distortion's coordinate)."""
    sigma, rgb, t, offsets, counts, steps, cots = composite_case(device, n_rays, contracted=contracted, cone=cone)
    cots = cots if distortion else cots[:3]
    results = []
    for use in (True, False):
        outs = kernels.composite(sigma, rgb, t, offsets, counts, 0.01, steps=steps, distortion=distortion,
                                 cone=cone, use_kernels=use)
        assert len(outs) == len(cots)
        grads = torch.autograd.grad(outs, (sigma, rgb), cots)
        results.append((outs, grads))
    (k_out, k_grad), (r_out, r_grad) = results
    if distortion:
        assert bool((k_out[3] >= 0).all()) and float(k_out[3][0]) == 0.0  # a ray of no samples has none
    # fp32 sums of up to 300 terms in another order (sequential vs PyTorch's reductions and cumprod);
    # the distortion's sums run in double on both sides, from float weights
    for a, b in zip(k_out, r_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * max(1.0, float(b.abs().max())))
    for a, b in zip(k_grad, r_grad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("distortion", [False, True])
@pytest.mark.parametrize("contracted", [False, True])
def test_composite_kernel_matches_the_reference_forward_and_backward(distortion, contracted):
    composite_kernel_matches_the_twin("cuda", distortion, contracted)


@pytest.mark.gpu
@requires_gpu
def test_fused_render_on_gpu_matches_the_dense_renderer():
    field = _field("cuda", use_kernels=True)
    grid = OccupancyGrid(field.aabb, resolution=16).cuda()
    grid.mask.copy_(_grid(16, 12, "cuda"))
    o, d = _rays(4096, 13, "cuda")
    outs = {}
    for fused in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(14)
        outs[fused] = render_rays(field, grid, o, d, step_size=0.01, max_samples=512, near=0.02, perturb=True,
                                  generator=gen, fused=fused)
    assert int(outs[True]["num_samples"]) == int(outs[False]["num_samples"])
    for key in ("rgb", "opacity", "depth"):
        torch.testing.assert_close(outs[True][key], outs[False][key], rtol=1e-5, atol=1e-5)
