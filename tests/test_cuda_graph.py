"""The CUDA-graph training step (stages/reconstruct/nerf/graph.py) and what it rests on: a fixed
sample budget in the marching (kernels.march_rays(capacity=...)) and state updated in place.
CPU tests use the PyTorch references; the graph itself runs on a GPU (marked ``gpu``)."""
from __future__ import annotations

import pytest
import torch

import kernels
from stages.reconstruct.config import NerfParams, ReconstructParams
from stages.reconstruct.nerf.graph import QUANTUM, budget_for
from stages.reconstruct.nerf.method import NerfMethod
from stages.reconstruct.nerf.occupancy import OccupancyGrid

from conftest import requires_gpu
from test_render_kernels import AABB, _rays


def _march(n, capacity, device="cpu", use_kernels=False, seed=0):
    o, d = _rays(n, seed, device)
    jitter = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    occ = (torch.rand(16**3, generator=torch.Generator().manual_seed(seed + 2)) < 0.5).to(device)
    return kernels.march_rays(o, d, jitter, torch.tensor(AABB, device=device), occ, 0.01, 512, 0.05,
                              capacity=capacity, use_kernels=use_kernels)


def test_capacity_cuts_samples_in_ray_order_and_pads_with_zeros():
    full = _march(200, None)
    n = full.t.numel()
    assert int(full.total) == n > 1000
    # a budget larger than needed: the same samples, then zero rows that belong to no ray
    big = _march(200, n + 500)
    assert big.t.shape == (n + 500,) and big.points.shape == (n + 500, 3) and int(big.total) == n
    assert torch.equal(big.counts, full.counts) and torch.equal(big.offsets, full.offsets)
    assert torch.equal(big.t[:n], full.t) and torch.equal(big.points[:n], full.points)
    assert not big.t[n:].any() and not big.points[n:].any() and not big.ray_index[n:].any()
    # a budget that is too small: the first `cut` samples survive, counts say exactly which
    cut = n // 2
    small = _march(200, cut)
    assert small.t.shape == (cut,) and int(small.total) == n
    assert int(small.counts.sum()) == cut
    assert torch.equal(small.t, full.t[:cut]) and torch.equal(small.ray_index, full.ray_index[:cut])
    straddle = int(full.ray_index[cut])  # the ray that was cut short, later ones got nothing
    assert 0 <= int(small.counts[straddle]) < int(full.counts[straddle])
    assert not small.counts[straddle + 1:].any()
    assert torch.equal(small.counts[:straddle], full.counts[:straddle])


def test_padded_samples_composite_like_the_exact_ones():
    full = _march(100, None)
    big = _march(100, full.t.numel() + 77)
    g = torch.Generator().manual_seed(3)
    sigma = torch.rand(big.t.numel(), generator=g) * 30
    rgb = torch.rand(big.t.numel(), 3, generator=g)
    n = full.t.numel()
    a = kernels.composite(sigma, rgb, big.t, big.offsets, big.counts, 0.01)
    b = kernels.composite(sigma[:n], rgb[:n], full.t, full.offsets, full.counts, 0.01)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bad_capacity_is_named():
    with pytest.raises(ValueError, match="capacity must be a positive int or None, got 0"):
        _march(4, 0)


def test_budget_has_headroom_and_is_quantised():
    assert budget_for(0) == QUANTUM
    b = budget_for(100_000)
    assert b % QUANTUM == 0 and 130_000 <= b < 130_000 + QUANTUM


class _CaptureFails:
    """A CapturedStep whose capture fails as an uncapturable op makes it fail (capturing itself
    needs a GPU; what is tested here is what the step does about it)."""

    @staticmethod
    def make(required: bool):
        from types import SimpleNamespace

        from stages.reconstruct.nerf.graph import CapturedStep

        class Failing(CapturedStep):
            attempts = 0

            def _capture(self, capacity):
                self.attempts += 1
                raise RuntimeError("operation not permitted when stream is capturing")

        class Owner(SimpleNamespace):  # a graph step holds its method weakly: the test keeps it alive
            pass

        owner = Owner(device=torch.device("cpu"), cfg=SimpleNamespace(cull_occluded=False))
        step = Failing(owner, required=required)
        step.owner = owner
        return step


def test_count_read_back_takes_finished_replays_in_order_and_counts_overflows():
    """GraphStep._drain (the read-back behind both NeRF budgets and 3DGS's): counts of replays whose
    event has fired go to ``observe`` oldest first; an unfinished one stops the read unless more than
    MAX_AHEAD wait, when the oldest is waited for; counts above the budget they ran with are overflows."""
    from collections import deque

    from stages.reconstruct.cuda_graph import MAX_AHEAD

    class Event:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    step = _CaptureFails.make(required=False)
    seen = []
    pending = deque([(Event(True), torch.tensor(10), 20), (Event(True), torch.tensor(30), 20),
                     (Event(False), torch.tensor(5), 20)])
    assert step._drain(pending, seen.append, "overflow") == 1 and seen == [10, 30] and len(pending) == 1
    assert step.events[-1][0] == "overflow" and step.events[-1][2:] == (30, 20)
    late = [Event(False) for _ in range(MAX_AHEAD + 1)]
    pending.extend((e, torch.tensor(7), 20) for e in late)  # too far ahead: the oldest are waited for
    assert step._drain(pending, seen.append, "overflow") == 0
    assert seen[2:] == [5, 7] and pending and not late[-1].waited


def test_a_failed_capture_falls_back_to_eager_steps_under_auto(caplog):
    step = _CaptureFails.make(required=False)
    o, d = _rays(8, 0)
    assert step(o, d, o, torch.rand(8)) is None and step.attempts == 0  # no count yet: eager
    step.observe(5000)
    with caplog.at_level("WARNING"):
        assert step(o, d, o, torch.rand(8)) is None
    assert step.attempts == 1 and "not permitted when stream is capturing" in step.failed
    assert "training continues with eager steps" in caplog.text
    step.observe(5000)
    assert step(o, d, o, torch.rand(8)) is None and step.attempts == 1  # not tried again


def test_a_failed_capture_is_an_error_under_on():
    step = _CaptureFails.make(required=True)
    o, d = _rays(8, 0)
    step.observe(5000)
    with pytest.raises(RuntimeError, match="cuda_graph is 'on' but capturing the training step failed"):
        step(o, d, o, torch.rand(8))


def test_occupancy_update_keeps_the_mask_tensor():
    grid = OccupancyGrid(torch.tensor(AABB), resolution=8)
    ptr = grid.mask.data_ptr()
    grid.update(lambda x: (x[:, 0] > 0).float() * 100.0, 0.01, generator=torch.Generator().manual_seed(0))
    assert grid.mask.data_ptr() == ptr  # a captured step reads the grid at this address
    assert 0.0 < float(grid.mask.float().mean()) < 1.0


def test_cuda_graph_on_where_it_cannot_run_is_an_error():
    p = ReconstructParams(nerf=NerfParams(cuda_graph="on", fused_render="on"))
    with pytest.raises(ValueError, match="cuda_graph is 'on' but the packed renderer does not run CUDA kernels"):
        NerfMethod(p, torch.tensor(AABB), torch.device("cpu"))
    assert NerfMethod(ReconstructParams(), torch.tensor(AABB), torch.device("cpu")).graphed is None  # auto


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("extra", [-3000, 0, 5000])
def test_march_kernel_with_a_budget_matches_the_reference(extra):
    n = _march(5000, None, "cuda", use_kernels=False, seed=4).t.numel()
    got = _march(5000, n + extra, "cuda", use_kernels=True, seed=4)
    want = _march(5000, n + extra, "cuda", use_kernels=False, seed=4)
    for name in ("counts", "offsets", "ray_index", "t", "points", "total"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _method(cuda_graph: str, seed: int = 0, **kw) -> NerfMethod:
    torch.manual_seed(seed)
    nerf = NerfParams(levels=8, log2_hashmap_size=14, max_resolution=128, hidden_dim=32, samples_per_ray=128,
                      occ_resolution=16, fused_render="on", cuda_graph=cuda_graph, **kw)
    return NerfMethod(ReconstructParams(nerf=nerf, steps=100), torch.tensor(AABB), torch.device("cuda"))


def _batch(step: int, rays: int = 2048):
    o, d = _rays(rays, step, "cuda")
    return o, d, (d + 1) / 2  # a colour the view-dependent head can learn


def _train_eager_and_graphed(steps: int = 30, density_bias: float = 0.0, **nerf):
    """The same ``steps`` training steps (same rays and jitter draws) eagerly and in a CUDA graph:
    for each, (losses, the gradients of step 1, the method). Step 0 runs eagerly in both modes (it
    sizes the graph's budget); step 1 is the first replay. ``density_bias`` is added to the density
    head's output first (a denser start)."""
    runs = []
    for mode in ("off", "on"):
        m = _method(mode, **nerf)
        with torch.no_grad():
            m.field.density_mlp[-1].bias[0] += density_bias
        gen = torch.Generator(device="cuda").manual_seed(7)
        losses, first_grads = [], None
        for step in range(steps):
            m.step_pre_forward(step, gen)
            info = m.forward_backward(_batch(step), gen)
            losses.append(float(info["mse"]))
            if step == 1:
                first_grads = [p.grad.clone() for p in m.parameters()]
            m.optimizer_step(step, torch.zeros((), device="cuda"))
        runs.append((losses, first_grads, m))
    return runs


@pytest.mark.gpu
@requires_gpu
def test_graph_step_gives_the_eager_gradients_and_trains_alike():
    """Same rays, same jitter draws: the replayed graph adds the eager step's gradients (up to the
    float sums of a different row count in the MLP's GEMMs) and 30 steps of training follow."""
    (l_off, g_off, _), (l_on, g_on, m_on) = _train_eager_and_graphed()
    assert m_on.graphed is not None and m_on.graphed.captures >= 1 and m_on.graphed.overflow_steps == 0
    for a, b in zip(g_on, g_off):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6 * max(1.0, float(b.abs().max())))
    assert abs(l_on[-1] - l_off[-1]) < 0.02 * l_off[-1] + 1e-4, (l_on[-5:], l_off[-5:])
    assert l_on[-1] < l_on[0]


@pytest.mark.gpu
@requires_gpu
def test_graph_step_with_culling_gives_the_eager_culled_gradients_and_resizes_its_march_budget():
    """nerf.cull_occluded in a CUDA graph (a march budget and a kept-sample budget, no host sync):
    the first replay adds the eager culled step's gradients, 30 steps train alike, and a march budget
    sized from a count far too small overflows once and is captured again larger."""
    (l_off, g_off, _), (l_on, g_on, m_on) = _train_eager_and_graphed(density_bias=4.0, cull_occluded=True)
    g = m_on.graphed
    assert g is not None and g.cull and g.captures >= 1 and g.march_capacity > g.capacity
    for a, b in zip(g_on, g_off):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6 * max(1.0, float(b.abs().max())))
    assert abs(l_on[-1] - l_off[-1]) < 0.02 * l_off[-1] + 1e-4, (l_on[-5:], l_off[-5:])
    # the march's budget: a pretended tiny count, an overflow, a larger capture
    g.flush()  # the replays' counts read, so that the pretended one is the latest
    g.observe_march(1000)
    m_on.forward_backward(_batch(40), torch.Generator(device="cuda").manual_seed(1))
    assert g.march_capacity == budget_for(1000)
    for step in range(41, 46):
        m_on.optimizer_step(step, torch.zeros((), device="cuda"))
        m_on.forward_backward(_batch(step), torch.Generator(device="cuda").manual_seed(step))
    torch.cuda.synchronize()
    m_on.forward_backward(_batch(47), torch.Generator(device="cuda").manual_seed(2))
    assert g.march_overflow_steps >= 1 and g.march_capacity > budget_for(1000)
    summary = m_on.summary()["cuda_graph"]
    assert summary["march_budget"] == g.march_capacity
    # every capture (the first and the re-captures after overflows) counts in capture_s
    assert summary["captures"] == g.captures >= 2 and summary["capture_s"] > 0


@pytest.mark.gpu
@requires_gpu
def test_graph_step_with_the_huber_loss_gives_the_eager_gradients():
    """nerf.loss: huber inside the captured step: the first replay adds the eager step's gradients,
    the replay reports the Huber value as its loss and the squared error as its mse."""
    (l_off, g_off, _), (l_on, g_on, m_on) = _train_eager_and_graphed(loss="huber", huber_delta=0.05)
    assert m_on.graphed is not None and m_on.graphed.captures >= 1
    for a, b in zip(g_on, g_off):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6 * max(1.0, float(b.abs().max())))
    assert abs(l_on[-1] - l_off[-1]) < 0.02 * l_off[-1] + 1e-4, (l_on[-5:], l_off[-5:])
    info = m_on.forward_backward(_batch(31), torch.Generator(device="cuda").manual_seed(3))
    assert float(info["loss"]) < float(info["mse"])  # Huber: half the square, or less, per pixel


@pytest.mark.gpu
@requires_gpu
def test_graph_budget_grows_after_an_overflow():
    m = _method("on")
    gen = torch.Generator(device="cuda").manual_seed(1)
    m.forward_backward(_batch(0), gen)  # eager: observes the count
    m.graphed.observe(1000)  # pretend the last count was tiny: the next capture gets a budget far too small
    m.forward_backward(_batch(1), gen)
    small = m.graphed.capacity
    assert small == budget_for(1000)
    for step in range(2, 8):
        m.optimizer_step(step, torch.zeros((), device="cuda"))
        m.forward_backward(_batch(step), gen)
    torch.cuda.synchronize()
    m.forward_backward(_batch(9), gen)
    assert m.graphed.overflow_steps >= 1 and m.graphed.capacity > small
    assert m.graphed.capacity >= m.graphed.max_count


@pytest.mark.gpu
@requires_gpu
def test_graph_step_accumulates_micro_batches_and_rebinds_after_the_optimizer():
    m = _method("on")
    m.forward_backward(_batch(0), torch.Generator(device="cuda").manual_seed(2))  # eager: the count
    grads = []
    for clear in (True, True, False):
        if clear:  # what optimizer_step's zero_grad(set_to_none=True) leaves
            for p in m.parameters():
                p.grad = None
        m.forward_backward(_batch(1), torch.Generator(device="cuda").manual_seed(3))  # same rays and jitter
        grads.append([p.grad.clone() for p in m.parameters()])
    assert m.graphed.captures == 1
    assert sum(float(g.norm()) for g in grads[0]) > 0
    # dropped gradients are re-bound and zeroed before the replay; kept ones are added to
    # (hash-table sums use atomics: equal up to their summation order)
    for a, b, c in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(c, 2 * a, rtol=1e-4, atol=1e-7)
