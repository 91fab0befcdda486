"""nerf.render.occluded_samples: the share of a training step's packed samples that lie behind an
opaque surface (transmittance already below 1e-4), which the packed step evaluates and instant-ngp
and nerfacc cull (benchmarks/sample_waste.py, bench_nerf_quality's rows)."""
from __future__ import annotations

import pytest
import torch

from conftest import requires_gpu
from stages.reconstruct.config import NerfParams
from stages.reconstruct.nerf.field import NerfField
from stages.reconstruct.nerf.render import occluded_samples

BOX = torch.tensor([[-1.0, -1, -1], [1, 1, 1]])


class _Slab(NerfField):
    """A field whose density is ``rho`` in the slab |z| < 0.2 where x < 0, and 0 elsewhere."""

    rho = 1000.0

    def density(self, x, return_feat=False):
        sigma = torch.where((x[:, 2].abs() < 0.2) & (x[:, 0] < 0), self.rho, 0.0)
        return (sigma, None) if return_feat else sigma


def _rays(n: int = 16):
    xs = torch.linspace(-0.9, 0.9, n)
    o = torch.stack([xs, torch.zeros(n), torch.full((n,), -2.0)], -1)
    d = torch.tensor([0.0, 0.0, 1.0]).expand(n, 3).contiguous()
    return o, d


def test_samples_behind_an_opaque_slab_are_counted_and_nothing_in_front_of_it():
    field = _Slab(NerfParams(levels=2, log2_hashmap_size=10, max_resolution=16), BOX, use_kernels=False)
    o, d = _rays()
    step = 2.0 / 64
    jitter = torch.full((len(o),), 0.5)
    got = occluded_samples(field, None, o, d, jitter, step, 1024)
    # by hand: every ray marches the box's 64 steps (t from 1 to 3, midpoints); a ray with x < 0 keeps
    # the samples before the slab and the slab's first one (1000 x step = 31 of optical thickness:
    # transmittance e^-31 after it), and every later sample is occluded; rays with x >= 0 keep all 64
    t = 1.0 + (torch.arange(64) + 0.5) * step
    z = t - 2.0
    first_in = int((z <= -0.2).sum())  # samples in front of the slab
    want_kept = torch.where(o[:, 0] < 0, first_in + 1, 64)
    assert got["samples"] == 64 * len(o)
    assert torch.equal(got["kept_per_ray"], want_kept.long())
    assert got["occluded"] == int((64 - want_kept).sum()) > 0
    # a thin density lets the light through: nothing is occluded
    field.rho = 1.0
    thin = occluded_samples(field, None, o, d, jitter, step, 1024)
    assert thin["occluded"] == 0 and torch.equal(thin["kept_per_ray"], torch.full((len(o),), 64))


def test_rays_that_miss_the_box_keep_nothing_and_break_nothing():
    field = _Slab(NerfParams(levels=2, log2_hashmap_size=10, max_resolution=16), BOX, use_kernels=False)
    o = torch.tensor([[5.0, 5.0, -2.0], [-0.5, 0.0, -2.0], [5.0, -5.0, -2.0]])
    d = torch.tensor([0.0, 0.0, 1.0]).expand(3, 3).contiguous()
    got = occluded_samples(field, None, o, d, torch.full((3,), 0.5), 2.0 / 64, 1024)
    assert got["kept_per_ray"][0] == 0 and got["kept_per_ray"][2] == 0 and 0 < got["kept_per_ray"][1] < 64
    assert got["samples"] == 64 and got["occluded"] == 64 - int(got["kept_per_ray"][1])


# ---------------------------------------------------------------- nerf.cull_occluded: training without them

def _opaque_method(**nerf):
    """A tiny NeRF whose density starts high everywhere (e^7 ~ 1100 in the box), so rays saturate
    within a few samples and most of what they march lies behind that."""
    from test_nerf_training import _method, _scene

    scene = _scene()
    m = _method(scene, fused_render="on", **nerf)
    with torch.no_grad():
        m.field.density_mlp[-1].bias[0] += 8.0
    return m, scene


def _rays_of(scene, n=256, seed=0):
    from stages.reconstruct.data import RaySampler

    g = torch.Generator().manual_seed(seed)
    o, d, rgb = RaySampler(scene.train, g).sample(n)
    return o, d, rgb, torch.rand(n, generator=g)


def test_culled_samples_render_the_same_colours_and_gradients_with_fewer_samples():
    from stages.reconstruct.nerf.render import render_packed

    m, scene = _opaque_method()
    o, d, rgb, jitter = _rays_of(scene)
    args = (m.field, m.grid, o, d, jitter, m.step_size, m.max_steps, m.cfg.near)
    grads = []
    outs = []
    for cull in (False, True):
        m.field.zero_grad(set_to_none=True)
        out = render_packed(*args, cull=cull)
        torch.nn.functional.mse_loss(out["rgb"], rgb).backward()
        grads.append([p.grad.clone() for p in m.field.parameters() if p.grad is not None])
        outs.append(out)
    full, culled = outs
    census = occluded_samples(*args)
    assert int(full["num_samples"]) == census["samples"]
    assert int(culled["num_samples"]) == census["samples"] - census["occluded"] < 0.5 * census["samples"]
    # what the cut leaves out: at most EARLY_STOP_T of light a ray, and as much of the background's share
    torch.testing.assert_close(culled["rgb"], full["rgb"], atol=2e-4, rtol=0)
    torch.testing.assert_close(culled["opacity"], full["opacity"], atol=1e-4, rtol=0)
    assert len(grads[0]) == len(grads[1])
    for g_full, g_cull in zip(*grads):  # the culled samples carried next to no gradient
        scale = float(g_full.abs().max()) + 1e-12
        assert float((g_full - g_cull).abs().max()) <= 1e-3 * scale


def test_culling_in_fixed_budgets_packs_what_the_eager_cull_keeps():
    """The CUDA-graph form of culling (a fixed budget for the march, another for the kept samples, no
    host sync): with room in both, the same colours, depths and kept count as the eager cull; with
    too little room for the kept samples, the first ``capacity`` in ray order, later rays cut, and
    the uncut count reported; padding rows of either budget are never kept."""
    from stages.reconstruct.nerf.render import render_packed

    m, scene = _opaque_method()
    o, d, rgb, jitter = _rays_of(scene)
    args = (m.field, m.grid, o, d, jitter, m.step_size, m.max_steps, m.cfg.near)
    eager = render_packed(*args, cull=True)
    kept = int(eager["num_samples"])
    marched = occluded_samples(*args)["samples"]
    roomy = render_packed(*args, cull=True, capacity=kept + 100, march_capacity=marched + 300)
    assert int(roomy["num_samples"]) == int(roomy["total_samples"]) == kept
    assert int(roomy["march_total"]) == marched
    for key in ("rgb", "opacity", "depth"):
        torch.testing.assert_close(roomy[key], eager[key], atol=1e-6, rtol=1e-6)
    # the kept budget too small: the first rays keep their samples, the last ones lose theirs
    tight = render_packed(*args, cull=True, capacity=kept // 2, march_capacity=marched + 300)
    assert int(tight["num_samples"]) == kept // 2 and int(tight["total_samples"]) == kept
    same = (tight["rgb"] - eager["rgb"]).abs().amax(-1) < 1e-6
    assert bool(same[:10].all()) and not bool(same.all())
    # the march's budget too small: its cut rays keep nothing past it, and nothing comes from padding
    short = render_packed(*args, cull=True, capacity=kept + 100, march_capacity=marched // 2)
    assert int(short["march_total"]) == marched and int(short["num_samples"]) < kept
    with pytest.raises(ValueError, match="both capacity and march_capacity"):
        render_packed(*args, cull=True, capacity=kept)


def test_training_with_culling_follows_the_full_march_on_a_fraction_of_the_samples():
    """The same steps with and without culling (same draws): the losses agree (the culled samples
    carried next to no light or gradient), and the step evaluates far fewer samples (its count, which
    target_samples budgets, is the kept samples')."""
    from test_nerf_training import _train

    runs = {}
    for cull in (False, True):
        m, scene = _opaque_method(cull_occluded=cull)
        runs[cull] = (_train(m, scene, 40), int(m._last_count[0]))
    (full, n_full), (culled, n_culled) = runs[False], runs[True]
    torch.testing.assert_close(torch.tensor(culled), torch.tensor(full), rtol=1e-3, atol=0)
    assert n_culled < 0.25 * n_full  # this opaque start: 230 of 3139 samples kept at the last step


def test_culling_needs_the_packed_renderer():
    from test_nerf_training import _method, _scene

    with pytest.raises(ValueError, match="cull_occluded needs the packed renderer"):
        _method(_scene(), fused_render="off", cull_occluded=True)


@requires_gpu
@pytest.mark.gpu
def test_culling_on_the_cuda_kernels_matches_the_full_march():
    """The CUDA march and compositing kernels with culling: the colours of the full march within the
    light the cut leaves out, on far fewer samples, and an eager training step with culling on (the
    graph is switched off here; tests/test_cuda_graph.py covers culling inside the graph)."""
    from stages.reconstruct.config import ReconstructParams
    from stages.reconstruct.nerf.method import NerfMethod
    from stages.reconstruct.nerf.render import render_packed
    from test_nerf_training import AABB, TINY, _scene

    scene = _scene()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    params = ReconstructParams(nerf=NerfParams(**{**TINY, "cull_occluded": True, "cuda_graph": "off"}), steps=10, batch_rays=256,
                               device="cuda")
    m = NerfMethod(params, AABB.clone(), dev, None, scene)
    assert m.use_kernels and m.fused and m.graphed is None
    with torch.no_grad():
        m.field.density_mlp[-1].bias[0] += 8.0
    o, d, rgb, jitter = (t.to(dev) for t in _rays_of(scene))
    args = (m.field, m.grid, o, d, jitter, m.step_size, m.max_steps, m.cfg.near)
    full, culled = render_packed(*args), render_packed(*args, cull=True)
    census = occluded_samples(*args)
    assert int(culled["num_samples"]) == census["samples"] - census["occluded"] < 0.5 * int(full["num_samples"])
    torch.testing.assert_close(culled["rgb"], full["rgb"], atol=2e-4, rtol=0)
    info = m.forward_backward((o, d, rgb), torch.Generator(device=dev).manual_seed(0))
    assert torch.isfinite(info["loss"]) and 0 < int(info["num_samples"]) < int(full["num_samples"])
