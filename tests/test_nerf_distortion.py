"""The NeRF's distortion loss (mip-NeRF 360, Barron et al. 2022, eq. 15): per ray
``sum_ij w_i w_j |t_i - t_j| + 1/3 sum_i w_i^2 dt_i``, which is small when a ray's weight sits in
one short stretch and large when it is spread out (floaters in front of the surface, fog).

CPU: the single-pass form of the compositing twin (``kernels.composite_reference(distortion=True)``)
is the pairwise double sum, ray by ray (empty rays, padding rows past a budget included), its
gradient reaches the densities, a ray whose optical depth overflows leaves the others alone, the
loss is off by default (the training loss is then the MSE itself), and training with it
concentrates each ray's weight. The kernels against the twin: tests/test_render_kernels.py (GPU)
and tests/test_render_kernels_on_host.py (their host build).
"""
from __future__ import annotations

import pytest
import torch

from stages.reconstruct.data import RaySampler
import kernels
from kernels._reference import distortion_reference
from stages.reconstruct.nerf.render import render_rays

from conftest import requires_gpu
from test_nerf_training import _method, _scene, _train
from test_render_kernels import AABB, _rays


BASE = 0.01  # the march's step: _packed's steps are BASE or longer, as contracted rays' are


def _packed(counts: list[int], seed: int = 0, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts_t = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.cumsum(counts_t.long(), 0) - counts_t.long()
    t = torch.cat([torch.sort(torch.rand(c, generator=g, dtype=torch.float64) * 2)[0] for c in counts])
    # a contracted ray's steps: BASE up to T1 = 0.8, then BASE (t / T1)^2 (uniform in disparity)
    steps = BASE * (t / 0.8).clamp(min=1.0) ** 2
    sigma = torch.rand(t.shape[0], generator=g, dtype=torch.float64) * 5
    if pad:  # rows past the last sample, as a fixed budget leaves them: t 0, sigma of whatever
        t, steps = torch.cat([t, t.new_zeros(pad)]), torch.cat([steps, steps.new_full((pad,), 0.05)])
        sigma = torch.cat([sigma, sigma.new_full((pad,), 3.0)])
    rgb = torch.rand(t.shape[0], 3, generator=g, dtype=torch.float64)
    return sigma, rgb, t, steps, offsets, counts_t


def _by_hand(sigma, t, steps):
    """One ray: the compositing weights w_i = alpha_i prod_{j<i} (1 - alpha_j + 1e-10) and the double
    sum over the march coordinates u_i = t_i (2 r_i - r_i^2), r_i = sqrt(BASE / step_i)."""
    alpha = -torch.expm1(-sigma * steps)
    trans = torch.cumprod(torch.cat([alpha.new_ones(1), 1.0 - alpha[:-1] + 1e-10]), 0)
    w = alpha * trans
    r = torch.sqrt(torch.tensor(BASE, dtype=torch.float32).double() / steps)
    u = t * (2 * r - r * r)
    pair = (w[:, None] * w[None, :] * (u[:, None] - u[None, :]).abs()).sum()
    return w, pair + (w * w).sum() * BASE / 3.0


@pytest.mark.parametrize("pad", [0, 7])
def test_the_single_pass_form_is_the_pairwise_sum_ray_by_ray(pad):
    counts = [3, 0, 5, 1, 4, 9]
    sigma, rgb, t, steps, offsets, counts_t = _packed(counts, pad=pad)
    _, opacity, _, per_ray = kernels.composite_reference(sigma, rgb, t, offsets, counts_t, steps, distortion=True,
                                                         base_step=BASE)
    for r, c in enumerate(counts):
        rows = slice(int(offsets[r]), int(offsets[r]) + c)
        if c == 0:
            assert float(per_ray[r]) == 0.0
            continue
        w_r, want = _by_hand(sigma[rows], t[rows], steps[rows])
        torch.testing.assert_close(opacity[r], w_r.sum())
        torch.testing.assert_close(per_ray[r], want)


def test_the_gradient_reaches_the_densities():
    sigma, rgb, t, steps, offsets, counts = _packed([4, 2, 6], seed=1)
    sigma.requires_grad_()

    def loss(s):
        return kernels.composite_reference(s, rgb, t, offsets, counts, steps, distortion=True, base_step=BASE)[3]

    assert torch.autograd.gradcheck(loss, (sigma,))


def test_a_saturated_ray_leaves_the_others_alone():
    """One ray whose optical depth overflows (a density of 1e38, or inf) composites to its first
    sample and has finite distortion and gradients; the other rays get what they get without it. (The
    earlier packed form summed optical depths over all rays of a batch, so one such ray turned every
    later ray's weights into inf - inf: fern diverged with the term on, 2026-12-03.)"""
    sigma, rgb, t, steps, offsets, counts = _packed([3, 5, 4, 6], seed=3)
    sigma, rgb, t, steps = sigma.float(), rgb.float(), t.float(), steps.float()
    for big in (1e38, float("inf")):
        hot = sigma.clone()
        hot[3:8] = big  # every sample of ray 1
        hot.requires_grad_()
        out = kernels.composite(hot, rgb, t, offsets, counts, BASE, steps=steps, distortion=True)
        grad, = torch.autograd.grad(sum(o.sum() for o in out), hot)
        assert all(bool(torch.isfinite(o).all()) for o in out) and bool(torch.isfinite(grad).all())
        torch.testing.assert_close(out[1][1], torch.tensor(1.0))  # opaque at its first sample
        cold = kernels.composite(sigma, rgb, t, offsets, counts, BASE, steps=steps, distortion=True)
        for o_hot, o_cold in zip(out, cold):
            torch.testing.assert_close(o_hot[[0, 2, 3]], o_cold[[0, 2, 3]])


def test_dense_weights_of_no_sample_add_nothing():
    g = torch.Generator().manual_seed(2)
    W, T = torch.rand(4, 6, generator=g, dtype=torch.float64), torch.rand(4, 6, generator=g, dtype=torch.float64)
    T = T.sort(1).values
    W[:, 4:] = 0.0
    want = distortion_reference(W[:, :4], T[:, :4], 0.05)
    T[:, 4:] = 9.0  # invalid dense samples: weight 0, any t
    torch.testing.assert_close(distortion_reference(W, T, 0.05), want)
    torch.testing.assert_close(distortion_reference(W, T, 0.05), distortion_reference(W, T, torch.full_like(T, 0.05)))


def test_every_march_step_counts_the_base_step_in_the_distortion_coordinate():
    """On contracted rays the march is linear up to T1, then uniform in disparity; in the distortion's
    coordinate u every one of its steps is the base step (u = t before T1), so the background's far,
    long steps weigh as much as the near ones, as in mip-NeRF 360's normalised ray distance."""
    from kernels._reference import distortion_coords, march_steps_reference

    o, d = _rays(64, 0, "cpu")
    aabb = torch.tensor(AABB)
    t, steps, valid = march_steps_reference(o.double(), d.double(), torch.full((64,), 0.5, dtype=torch.float64),
                                            aabb.double(), 0.02, 600, 0.02, True)
    assert bool((steps[valid] > 1.5 * 0.02).any()) and bool((steps[valid] == 0.02).any())  # both parts
    u = distortion_coords(t, steps, 0.02)
    lin = steps == 0.02
    torch.testing.assert_close(u[lin], t[lin].double())
    pair = valid[:, 1:]
    du = u[:, 1:] - u[:, :-1]
    both_lin, both_far = lin[:, 1:] & lin[:, :-1] & pair, ~lin[:, 1:] & ~lin[:, :-1] & pair
    for part in (both_lin, both_far):
        torch.testing.assert_close(du[part], torch.full_like(du[part], 0.02), rtol=0, atol=1e-6)
    # the one step from the linear part into the disparity part: T1 is not on the linear grid, so it
    # is between half and one and a half steps (jitter 0.5)
    cross = lin[:, :-1] & ~lin[:, 1:] & pair
    assert int(cross.sum()) > 0 and bool((cross.sum(1) <= 1).all())
    assert bool(((du[cross] > 0.5 * 0.02) & (du[cross] <= 1.5 * 0.02 + 1e-9)).all())
    assert float(t[valid].max()) > 50 * float(u[valid].max()) / 2  # metric t runs far past u's range


def test_contracted_distortion_ignores_how_far_the_background_is():
    """Two contracted rays, each with its weight split between a surface and a background sample at the
    same march-step distance; one background is 10x farther in metric t. Their distortion is the same in
    u (it grew with t in the metric form: fern collapsed to 20.3 dB with it, 2026-12-04)."""
    base, t1 = 0.01, 1.0
    rows = []
    for far in (5.0, 50.0):
        t = torch.tensor([0.5, far], dtype=torch.float64)
        steps = torch.tensor([base, base * far * far / (t1 * t1)], dtype=torch.float64)
        rows.append((t, steps))
    sigma = torch.tensor([30.0, 1e3], dtype=torch.float64)
    rgb = torch.zeros(2, 3, dtype=torch.float64)
    offs, cnt = torch.tensor([0]), torch.tensor([2], dtype=torch.int32)
    got = [float(kernels.composite_reference(sigma, rgb, t, offs, cnt, s, distortion=True, base_step=base)[3])
           for t, s in rows]
    assert got[0] > 0.01
    # u = 2 T1 - T1^2 / t: 1.8 and 1.98, so the 10x farther background moves u by only 10 %
    assert got[1] / got[0] < 1.2, got


def test_off_by_default_and_a_term_of_the_loss_when_on():
    scene = _scene()
    batch_gen = torch.Generator().manual_seed(0)
    for fused in ("off", "on"):  # the dense renderer and the packed one (PyTorch twins here)
        m = _method(scene, fused_render=fused)
        assert m.cfg.distortion_loss == 0.0
        batch = m.make_sampler(m.place(scene.train), batch_gen).sample(m.batch_size())
        m.step_pre_forward(0, torch.Generator().manual_seed(1))
        info = m.forward_backward(batch, torch.Generator().manual_seed(2))
        assert float(info["loss"]) == float(info["mse"]) and "distortion" not in info
        on = _method(scene, fused_render=fused, distortion_loss=0.5)
        on.step_pre_forward(0, torch.Generator().manual_seed(1))
        info_on = on.forward_backward(batch, torch.Generator().manual_seed(2))
        assert float(info_on["distortion"]) > 0
        # the same field and samples: the MSE is the same, the loss adds 0.5 x the distortion
        torch.testing.assert_close(info_on["mse"], info["mse"])
        torch.testing.assert_close(info_on["loss"], info_on["mse"] + 0.5 * info_on["distortion"])


def test_training_with_it_concentrates_each_rays_weight():
    scene = _scene()
    o, d, _ = RaySampler(scene.test, torch.Generator().manual_seed(3)).sample(256)
    spread = {}
    for lam in (0.0, 0.2):
        m = _method(scene, lr=3e-2, distortion_loss=lam)
        _train(m, scene, 60)
        with torch.no_grad():
            out = render_rays(m.field, m.grid, o, d, m.step_size, m.max_steps, m.cfg.near, distortion=True)
        spread[lam] = float(out["distortion"].mean())
    assert spread[0.2] < 0.7 * spread[0.0], spread


def test_a_negative_weight_is_refused():
    from stages.reconstruct.config import NerfParams

    with pytest.raises(ValueError, match="distortion_loss"):
        NerfParams(distortion_loss=-0.1)


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_replayed_step_adds_the_distortion_term_as_an_eager_step_does():
    """The CUDA-graph step (packed kernels, fixed sample budget) with the distortion term: the same
    loss, distortion and gradients as the eager step on the same rays and jitter draws."""
    from stages.reconstruct.config import NerfParams, ReconstructParams
    from stages.reconstruct.nerf.method import NerfMethod

    runs = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        nerf = NerfParams(levels=8, log2_hashmap_size=14, max_resolution=128, hidden_dim=32, samples_per_ray=128,
                          occ_resolution=16, fused_render="on", cuda_graph=mode, distortion_loss=0.01)
        m = NerfMethod(ReconstructParams(nerf=nerf, steps=100), torch.tensor(AABB), torch.device("cuda"))
        gen = torch.Generator(device="cuda").manual_seed(7)
        for step in range(2):  # step 0 runs eagerly in both modes; step 1 is the first replay
            m.step_pre_forward(step, gen)
            o, d = _rays(2048, step, "cuda")
            info = m.forward_backward((o, d, (d + 1) / 2), gen)
            if step == 0:
                m.optimizer_step(step, torch.zeros((), device="cuda"))
        runs[mode] = (info, [p.grad.clone() for p in m.parameters()], m)
    (i_off, g_off, _), (i_on, g_on, m_on) = runs["off"], runs["on"]
    assert m_on.graphed is not None and m_on.graphed.replays >= 1
    assert float(i_on["distortion"]) > 0
    for key in ("mse", "distortion", "loss"):
        torch.testing.assert_close(i_on[key], i_off[key], rtol=1e-4, atol=1e-7)
    for a, b in zip(g_on, g_off):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6 * max(1.0, float(b.abs().max())))
