"""The NeRF field's view encoding and the renderer's sample culling (CPU)."""
from __future__ import annotations

import math

import pytest
import torch

from stages.reconstruct.config import GaussianParams, NerfParams, ReconstructParams
from stages.reconstruct.nerf.field import NerfField, sh_encode_deg4, sh_encode_deg4_reference
from stages.reconstruct.nerf.occupancy import OccupancyGrid
from stages.reconstruct.nerf.render import render_rays


def _sphere(n: int) -> torch.Tensor:
    """Fibonacci points on the unit sphere: near-uniform, for quadrature over it."""
    i = torch.arange(n, dtype=torch.float64) + 0.5
    z = 1 - 2 * i / n
    phi = math.pi * (1 + 5**0.5) * i
    r = (1 - z * z).sqrt()
    return torch.stack([r * phi.cos(), r * phi.sin(), z], dim=-1)


def test_sh_matmul_form_matches_the_term_by_term_reference():
    d = _sphere(4096)
    torch.testing.assert_close(sh_encode_deg4(d), sh_encode_deg4_reference(d), rtol=0, atol=1e-14)
    d32 = torch.nn.functional.normalize(torch.randn(10000, 3, generator=torch.Generator().manual_seed(0)), dim=-1)
    # float32: the same products summed in another order, |values| <= 1.1
    torch.testing.assert_close(sh_encode_deg4(d32), sh_encode_deg4_reference(d32), rtol=0, atol=1e-6)


def test_sh_basis_is_orthonormal_over_the_sphere():
    d = _sphere(20000)
    y = sh_encode_deg4(d)
    gram = (y.T @ y) * (4 * math.pi / len(d))
    torch.testing.assert_close(gram, torch.eye(16, dtype=torch.float64), rtol=0, atol=2e-3)


def _field(structured: bool = True) -> NerfField:
    torch.manual_seed(0)
    cfg = NerfParams(levels=4, log2_hashmap_size=10, base_resolution=4, max_resolution=32, hidden_dim=16)
    field = NerfField(cfg, torch.tensor([[-1.0, -1, -1], [1, 1, 1]]), use_kernels=False)
    if structured:  # a field with structure, not the near-zero init
        with torch.no_grad():
            field.encoding.table.uniform_(-1, 1)
    return field


def test_field_takes_directions_or_their_encoding():
    field = _field()
    g = torch.Generator().manual_seed(1)
    x = torch.rand(50, 3, generator=g) * 2 - 1
    d = torch.nn.functional.normalize(torch.randn(50, 3, generator=g), dim=-1)
    s1, c1 = field(x, d)
    s2, c2 = field(x, d_enc=sh_encode_deg4(d))
    assert torch.equal(s1, s2) and torch.equal(c1, c2)


def test_occupancy_culling_drops_exactly_the_samples_in_empty_cells():
    field = _field()
    g = torch.Generator().manual_seed(2)
    o = torch.tensor([[0.0, 0.0, -3.0]]).repeat(64, 1) + torch.randn(64, 3, generator=g) * 0.2
    d = torch.nn.functional.normalize(torch.tensor([0.0, 0.0, 1.0]) + torch.randn(64, 3, generator=g) * 0.1, dim=-1)
    grid = OccupancyGrid(field.aabb, resolution=8)
    with torch.no_grad():
        full = render_rays(field, None, o, d, step_size=0.05, max_samples=64)
        same = render_rays(field, grid, o, d, step_size=0.05, max_samples=64)  # every cell occupied
        assert torch.equal(full["rgb"], same["rgb"]) and int(full["num_samples"]) == int(same["num_samples"]) > 0
        grid.mask.zero_()
        empty = render_rays(field, grid, o, d, step_size=0.05, max_samples=64)
        assert int(empty["num_samples"]) == 0
        assert torch.equal(empty["rgb"], field.background_rgb().expand(64, 3))
        # the half-space z > 0 empty: only samples with z < 0 (cells 0..3 of 8 along z) survive
        grid.mask.view(8, 8, 8)[:, :, :4] = True
        half = render_rays(field, grid, o, d, step_size=0.05, max_samples=64)
        assert 0 < int(half["num_samples"]) < int(full["num_samples"])


def test_occupancy_warmup_records_densities_but_prunes_nothing():
    """A freshly initialised field has about the same density everywhere, so the threshold
    min(occ_threshold, mean) would drop a random half of the cells: the warm-up keeps them all."""
    field = _field(structured=False)  # as initialised
    grid = OccupancyGrid(field.aabb, resolution=8)
    with torch.no_grad():
        # a march step whose opacity at the initial density (~0.47) is under occ_threshold 0.01
        occupied = grid.update(field.density, 0.01, generator=torch.Generator().manual_seed(0), prune=False)
        assert occupied == 1.0 and bool(grid.mask.all())
        assert bool((grid.density > 0).all())  # the record is kept up to date meanwhile
        spread = float(grid.density.max() / grid.density.min()) - 1
        pruned = grid.update(field.density, 0.01, generator=torch.Generator().manual_seed(1))
        assert spread < 1e-3 and 0.2 < pruned < 0.8  # densities within 0.1 %, yet about half the cells go


def test_occupancy_schedule_scale_refreshes_after_the_same_rays():
    """With occ_schedule_scale 1/2 (twice the rays per step) the grid is refreshed every 8 steps
    instead of 16 and its 64-step warm-up ends at step 32: the 1-GPU schedule in rays seen."""
    from stages.reconstruct.config import ReconstructParams
    from stages.reconstruct.nerf.method import NerfMethod

    def refreshes(scale: float) -> list[tuple[int, torch.Tensor]]:
        # 512 samples a ray: a march step whose opacity at the initial density is under
        # occ_threshold, so a prune drops about half the cells (see the test above)
        nerf = NerfParams(levels=2, log2_hashmap_size=10, max_resolution=32, hidden_dim=8,
                          samples_per_ray=512, occ_resolution=8, occ_warmup_steps=64,
                          occ_schedule_scale=scale)
        m = NerfMethod(ReconstructParams(nerf=nerf, steps=200),
                       torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]), torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        return [(step, occ) for step in range(80)
                if (occ := m.step_pre_forward(step, gen)) is not None]

    full, half = refreshes(1.0), refreshes(0.5)
    assert [s for s, _ in full] == [0, 16, 32, 48, 64]
    assert [s for s, _ in half] == list(range(0, 80, 8))
    assert all(occ == 1.0 for s, occ in full if s < 64) and full[4][1] < 1.0  # warm-up, then prunes
    assert all(occ == 1.0 for s, occ in half if s < 32) and half[4][1] < 1.0  # pruning from step 32
    with pytest.raises(ValueError, match="occ_schedule_scale"):
        NerfParams(occ_schedule_scale=0.0)


def test_switches_read_yaml_bools_as_on_off():
    """YAML 1.1 reads a bare on / off as a bool: the auto|on|off switches take it as meant."""
    p = NerfParams(fused_render=True, cuda_graph=False)
    assert (p.fused_render, p.cuda_graph) == ("on", "off")
    assert ReconstructParams(kernels=False).kernels == "off"
    assert GaussianParams(random_background=True).random_background == "on"


def test_early_stop_renders_what_the_dense_renderer_does_with_fewer_samples():
    """Rendering views: the same colours as render_rays up to the light early stop leaves out (at
    most EARLY_STOP_T per ray), on a field dense enough that most rays stop inside the box."""
    from stages.reconstruct.nerf.render import EARLY_STOP_T, render_rays_early_stop

    field = _field()
    g = torch.Generator().manual_seed(3)
    o = torch.tensor([[0.0, 0.0, -3.0]]).repeat(256, 1) + torch.randn(256, 3, generator=g) * 0.3
    d = torch.nn.functional.normalize(torch.tensor([0.0, 0.0, 1.0]) + torch.randn(256, 3, generator=g) * 0.2, dim=-1)
    grid = OccupancyGrid(field.aabb, resolution=8)
    grid.mask.view(8, 8, 8)[:, :, :2] = False  # the first quarter of the box empty: skipped either way
    for density in (1.0, 40.0):  # a faint field (no ray stops) and an opaque one

        class Scaled(torch.nn.Module):  # the same field, `density` times as dense
            aabb, contract, cascades, cone = field.aabb, field.contract, field.cascades, field.cone

            def forward(self, x, d_enc=None, **kw):
                sigma, rgb = field(x, d_enc=d_enc, **kw)
                return sigma * density, rgb

            def background_rgb(self):
                return field.background_rgb()

        with torch.no_grad():
            dense = render_rays(Scaled(), grid, o, d, step_size=0.03, max_samples=96)
            early = render_rays_early_stop(Scaled(), grid, o, d, step_size=0.03, max_samples=96, segment=16)
        # float32 sums in another order (segments) add a few ulps to the light early stop leaves out
        torch.testing.assert_close(early["rgb"], dense["rgb"], rtol=0, atol=EARLY_STOP_T + 1e-6)
        torch.testing.assert_close(early["opacity"], dense["opacity"], rtol=0, atol=EARLY_STOP_T + 1e-6)
        n_dense, n_early = int(dense["num_samples"]), int(early["num_samples"])
        if density == 1.0:
            assert dense["opacity"].max() < 0.99 and n_early == n_dense  # nothing to stop early
        else:
            assert (dense["opacity"] > 1 - EARLY_STOP_T).float().mean() > 0.5 and n_early < 0.8 * n_dense


def test_grid_offset_reaches_the_encoding_and_is_checked():
    """``nerf.grid_offset`` (tiny-cuda-nn's half-cell shift) is the field's encoding offset; the same
    table then gives other features, and a value outside [0, 1) is refused by name."""
    box = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    torch.manual_seed(0)
    plain = NerfField(NerfParams(max_resolution=64, log2_hashmap_size=12), box)
    shifted = NerfField(NerfParams(max_resolution=64, log2_hashmap_size=12, grid_offset=0.5), box)
    shifted.load_state_dict(plain.state_dict())  # same weights: the offset is config, not state
    assert plain.encoding.offset == 0.0 and shifted.encoding.offset == 0.5
    x = torch.rand(64, 3) * 2 - 1
    assert not torch.allclose(plain.encoding(plain.normalize(x)), shifted.encoding(shifted.normalize(x)))
    for bad in (1.0, -0.25):
        with pytest.raises(ValueError, match="grid_offset"):
            NerfParams(grid_offset=bad)
