"""The NeRF's distortion loss (mip-NeRF 360, Barron et al. 2022, eq. 15): per ray
``sum_ij w_i w_j |t_i - t_j| + 1/3 sum_i w_i^2 dt_i``, which is small when a ray's weight sits in
one short stretch and large when it is spread out (floaters in front of the surface, fog).

CPU: the O(n) prefix-sum form on packed samples is the pairwise double sum, ray by ray (empty rays,
padding rows past a budget included), the packed and dense layouts agree, the gradient reaches the
densities, the loss is off by default (the training loss is then the MSE itself), and training
with it concentrates each ray's weight.
"""
from __future__ import annotations

import pytest
import torch

from stages.reconstruct.data import RaySampler
from stages.reconstruct.nerf.render import distortion_dense, distortion_packed, packed_weights, render_rays

from conftest import requires_gpu
from test_nerf_training import _method, _scene, _train
from test_render_kernels import AABB, _rays


def _packed(counts: list[int], seed: int = 0, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts_t = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.cumsum(counts_t.long(), 0) - counts_t.long()
    ray_index = torch.repeat_interleave(torch.arange(len(counts)), counts_t.long())
    t = torch.cat([torch.sort(torch.rand(c, generator=g, dtype=torch.float64) * 2)[0] for c in counts])
    steps = torch.rand(t.shape[0], generator=g, dtype=torch.float64) * 0.1 + 0.01
    sigma = torch.rand(t.shape[0], generator=g, dtype=torch.float64) * 5
    if pad:  # rows past the last sample, as a fixed budget leaves them: ray 0, t 0, sigma of whatever
        ray_index = torch.cat([ray_index, torch.zeros(pad, dtype=torch.int64)])
        t, steps = torch.cat([t, t.new_zeros(pad)]), torch.cat([steps, steps.new_full((pad,), 0.05)])
        sigma = torch.cat([sigma, sigma.new_full((pad,), 3.0)])
    return sigma, t, steps, ray_index, offsets, counts_t


def _by_hand(sigma, t, steps):
    """One ray: weights w_i = (1 - exp(-sigma_i dt_i)) prod_{j<i} exp(-sigma_j dt_j) and the double sum."""
    x = sigma * steps
    trans = torch.exp(-torch.cat([x.new_zeros(1), torch.cumsum(x, 0)[:-1]]))
    w = -torch.expm1(-x) * trans
    pair = (w[:, None] * w[None, :] * (t[:, None] - t[None, :]).abs()).sum()
    return w, pair + (w * w * steps).sum() / 3.0


@pytest.mark.parametrize("pad", [0, 7])
def test_the_prefix_sum_form_is_the_pairwise_sum_ray_by_ray(pad):
    counts = [3, 0, 5, 1, 4, 9]
    sigma, t, steps, ray_index, offsets, counts_t = _packed(counts, pad=pad)
    w, inside = packed_weights(sigma, steps, ray_index, offsets, counts_t)
    assert int(inside.sum()) == sum(counts) and not inside[sum(counts):].any()
    assert (w[sum(counts):] == 0).all()  # padding rows weigh nothing
    per_ray = distortion_packed(w, t, steps, ray_index, offsets, len(counts))
    for r, c in enumerate(counts):
        rows = slice(int(offsets[r]), int(offsets[r]) + c)
        if c == 0:
            assert float(per_ray[r]) == 0.0
            continue
        w_r, want = _by_hand(sigma[rows], t[rows], steps[rows])
        torch.testing.assert_close(w[rows], w_r)
        torch.testing.assert_close(per_ray[r], want)


def test_the_gradient_reaches_the_densities():
    sigma, t, steps, ray_index, offsets, counts = _packed([4, 2, 6], seed=1)
    sigma.requires_grad_()

    def loss(s):
        return distortion_packed(packed_weights(s, steps, ray_index, offsets, counts)[0], t, steps, ray_index,
                                 offsets, 3)

    assert torch.autograd.gradcheck(loss, (sigma,))


def test_dense_rows_give_the_packed_result():
    counts = [3, 0, 5, 2]
    sigma, t, steps, ray_index, offsets, counts_t = _packed(counts, seed=2)
    w, _ = packed_weights(sigma, steps, ray_index, offsets, counts_t)
    packed = distortion_packed(w, t, steps, ray_index, offsets, len(counts))
    width = max(counts)
    W, T, D = (torch.zeros(len(counts), width, dtype=torch.float64) for _ in range(3))
    for r, c in enumerate(counts):  # invalid dense samples have weight 0 and any t
        rows = slice(int(offsets[r]), int(offsets[r]) + c)
        W[r, :c], T[r, :c], D[r, :c] = w[rows], t[rows], steps[rows]
        T[r, c:] = 9.0
    torch.testing.assert_close(distortion_dense(W, T, D), packed)
    torch.testing.assert_close(distortion_dense(W, T, 0.05), distortion_dense(W, T, torch.full_like(T, 0.05)))


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
