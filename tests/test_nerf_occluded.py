"""nerf.render.occluded_samples: the share of a training step's packed samples that lie behind an
opaque surface (transmittance already below 1e-4), which the packed step evaluates and instant-ngp
and nerfacc cull (benchmarks/sample_waste.py, bench_nerf_quality's rows)."""
from __future__ import annotations

import torch

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
