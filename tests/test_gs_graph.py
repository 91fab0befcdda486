"""The 3DGS training view in a CUDA graph (stages/reconstruct/gs/graph.py) and what it rests on:
the rasterizer's fixed budget of tile intersections (``kernels.rasterization(capacity=...)``),
which sizes its buffers without reading the count back.

CPU: where the graph cannot run it is off under ``auto`` and an error under ``on``. GPU (marked):
a budget above the count renders the exact call's image and gradients; below it, the farthest
Gaussians' tiles drop (coverage only falls) and the count needed is reported; a replayed view adds
the gradients an eager view adds; training with the graph keeps pace with eager training and
captures again after each densification.
"""
from __future__ import annotations

import pytest
import torch

import kernels
from stages.reconstruct.data import load_scene
from stages.reconstruct.gs.method import GaussianMethod, _Batch
from stages.reconstruct.train import train

from _gs_scenes import camera, gaussians
from test_gs_method import gs_params, splat_poses


@pytest.fixture
def cuda():
    if not torch.cuda.is_available() or not kernels.available():
        pytest.skip("needs a CUDA GPU with the kernels" if not torch.cuda.is_available()
                    else f"CUDA kernels cannot run here: {kernels.unavailable_reason()}")
    return torch.device("cuda")


# ---------------------------------------------------------------------------- CPU


def test_the_graph_is_off_where_the_kernels_do_not_run(tmp_path):
    scene = load_scene(splat_poses(tmp_path, views=4))
    m = GaussianMethod(gs_params(), scene.aabb, torch.device("cpu"), scene=scene)
    assert m.graphed is None and m.summary()["cuda_graph"] is None
    with pytest.raises(ValueError, match="reconstruct.gs.cuda_graph is 'on' but the rasterizer does not run "
                                         "CUDA kernels here"):
        GaussianMethod(gs_params({"gs": {"cuda_graph": "on"}}), scene.aabb, torch.device("cpu"), scene=scene)


def test_a_bare_on_or_off_in_yaml_reads_as_the_switch():
    assert gs_params({"gs": {"cuda_graph": False}}).gs.cuda_graph == "off"
    assert gs_params({"gs": {"cuda_graph": True}}).gs.cuda_graph == "on"


def test_a_budget_is_a_positive_int():
    means, quats, scales, opac, sh = gaussians(20, seed=0)
    views, Ks = camera(32, 24, 30.0, n=1, seed=0)
    with pytest.raises(ValueError, match="capacity must be an int >= 1, got 0"):
        kernels.rasterization(means, quats, scales, opac, sh, views, Ks, 32, 24, sh_degree=3, capacity=0)


def test_the_budget_follows_the_gaussians_when_densification_grows_them(tmp_path):
    """The counts that size the budget: the largest of the last views; scaled up with the Gaussian
    count when densification grows it, not scaled down when it prunes. (On the CPU the view stops
    after this bookkeeping: ``failed`` is set, so nothing is captured.)"""
    from stages.reconstruct.gs.densify import append_rows, remove_rows
    from stages.reconstruct.gs.graph import WINDOW, CapturedView

    scene = load_scene(splat_poses(tmp_path, views=4))
    m = GaussianMethod(gs_params(), scene.aabb, torch.device("cpu"), scene=scene)
    views = m.make_sampler(scene.train, torch.Generator().manual_seed(0))
    view = CapturedView(m)
    view.failed = "the CPU: bookkeeping only"
    args = (views.image(0), views.viewmats[:1], views.Ks[:1], None, 1)
    assert view(*args) is None and view._need is None
    for count in (1000, 1200, 900):
        view.observe(count)
    assert view._need == 1200 and view.max_count == 1200
    view(*args)  # the same Gaussians: the same counts
    assert view._need == 1200
    n = m.n
    append_rows(m.gaussians, m.optimizers, {k: p.detach().clone() for k, p in m.gaussians.items()})
    view(*args)  # twice as many Gaussians: twice the intersections expected
    assert m.n == 2 * n and view._need == 2400 and sorted(view._counts) == [1800, 2000, 2400]
    remove_rows(m.gaussians, m.optimizers, torch.arange(m.n) < n)
    view(*args)  # pruned: kept until the window's new counts come in
    assert view._need == 2400
    for _ in range(WINDOW):
        view.observe(500)
    assert view._need == 500


def test_a_dropped_method_frees_its_graph_step_without_the_cycle_collector(tmp_path):
    """The method owns its graph step and the step refers back to it weakly: dropping the method
    frees both at once (a reference cycle would keep a graph's memory pool until gc ran)."""
    import gc
    import weakref

    from stages.reconstruct.gs.graph import CapturedView

    scene = load_scene(splat_poses(tmp_path, views=4))
    m = GaussianMethod(gs_params(), scene.aabb, torch.device("cpu"), scene=scene)
    m.graphed = CapturedView(m)
    assert m.graphed.method.n == m.n  # the step still reads the method through its reference
    method_ref, step_ref = weakref.ref(m), weakref.ref(m.graphed)
    gc.disable()
    try:
        del m
        assert method_ref() is None and step_ref() is None
    finally:
        gc.enable()


# ---------------------------------------------------------------------------- GPU: the budget


def _scene(cuda, n=3000, seed=4, width=160, height=120):
    means, quats, scales, opac, sh = gaussians(n, seed=seed)
    views, Ks = camera(width, height, 0.9 * width, n=1, seed=seed, spread=0.25)
    params = [t.to(cuda) for t in (means, quats, scales, opac, sh)]
    return params, views.to(cuda), Ks.to(cuda), width, height


def _render(params, views, Ks, width, height, weights=None, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in params]
    img, alpha, meta = kernels.rasterization(*leaves, views, Ks, width, height, sh_degree=3,
                                             backgrounds=torch.ones(1, 3, device=views.device), **kw)
    if weights is not None:
        (img * weights).sum().backward()
    return img.detach(), alpha.detach(), meta, [t.grad for t in leaves]


@pytest.mark.gpu
def test_a_budget_above_the_count_renders_what_the_exact_call_does(cuda):
    params, views, Ks, width, height = _scene(cuda)
    weights = torch.randn(1, height, width, 3, generator=torch.Generator().manual_seed(1)).to(cuda)
    img, alpha, meta, grads = _render(params, views, Ks, width, height, weights)
    M = meta["n_intersections"]
    assert M > 1000
    got, got_alpha, got_meta, got_grads = _render(params, views, Ks, width, height, weights, capacity=M + 5000)
    assert int(got_meta["n_intersections"]) == M  # the count it needed, on the device
    # the padded keys sort after every real one: the same lists, so the same image to the bit
    assert torch.equal(got, img) and torch.equal(got_alpha, alpha)
    for name, a, b in zip(("means", "quats", "scales", "opacities", "sh"), got_grads, grads):
        # float atomics add the per-tile sums in a different order from run to run, exact call or not
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()), msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_past_the_budget_the_farthest_gaussians_drop_and_the_count_says_so(cuda):
    params, views, Ks, width, height = _scene(cuda)
    _, alpha, meta, _ = _render(params, views, Ks, width, height)
    M = meta["n_intersections"]
    got, got_alpha, got_meta, _ = _render(params, views, Ks, width, height, capacity=M // 2)
    assert int(got_meta["n_intersections"]) == M
    assert torch.isfinite(got).all()
    # fewer Gaussians in a pixel's list can only leave more light through
    assert (got_alpha <= alpha + 1e-6).all() and float(got_alpha.sum()) < float(alpha.sum())


# ---------------------------------------------------------------------------- GPU: the captured view


def _grads(m):
    return {k: m.gaussians[k].grad.detach().clone() for k in m.gaussians}


@pytest.mark.gpu
def test_a_replayed_view_adds_the_gradients_an_eager_view_adds(tmp_path, cuda):
    scene = load_scene(splat_poses(tmp_path))
    methods = {}
    for setting in ("on", "off"):
        torch.manual_seed(0)
        m = GaussianMethod(gs_params({"device": "cuda", "gs": {"cuda_graph": setting}}), scene.aabb, cuda,
                           scene=scene)
        views = m.make_sampler(m.place(scene.train), torch.Generator().manual_seed(0))
        m.step_pre_forward(0, torch.Generator().manual_seed(0))
        with torch.no_grad():  # the start is isotropic, where a rotation changes nothing: its gradient is
            # rounding noise (~1e-10, differing with the order of the atomic adds). Stretched, it is real.
            m.gaussians["scales"].add_(torch.tensor([0.4, 0.0, -0.4], device=cuda))
        methods[setting] = (m, views)
    m_on, views_on = methods["on"]
    m_off, views_off = methods["off"]
    assert m_on.graphed is not None and m_off.graphed is None
    g = torch.Generator(device="cpu")
    m_on.forward_backward(_Batch(views_on, [2]), g)  # eager: the count sizes the budget
    assert m_on.graphed.replays == 0 and m_on.graphed.max_count > 0
    for p in m_on.parameters():
        p.grad = None
    out_on = m_on.forward_backward(_Batch(views_on, [3]), g)
    assert m_on.graphed.replays == 1 and m_on.graphed.captures == 1
    out_off = m_off.forward_backward(_Batch(views_off, [3]), g)
    torch.testing.assert_close(out_on["loss"], out_off["loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(out_on["mse"], out_off["mse"], rtol=1e-5, atol=0)
    a, b = _grads(m_on), _grads(m_off)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6 * float(b[k].abs().max()), msg=lambda s: f"{k}: {s}")
    # the statistics densification reads came from the replay (accumulated before the next one)
    stats = m_on.densify.stats
    assert stats is not None and float(stats["count"].sum()) > 0


@pytest.mark.gpu
def test_training_with_the_graph_keeps_pace_with_eager_training(tmp_path, cuda):
    scene = load_scene(splat_poses(tmp_path))
    res = {}
    for setting in ("on", "off"):
        p = gs_params({"device": "cuda", "steps": 120, "gs": {"cuda_graph": setting}})
        res[setting] = train(p, scene, cuda, 0, progress=False)
    on, off = res["on"], res["off"]
    graph = on.method.summary()["cuda_graph"]
    # views over budget stay rare (under 5 %): the counts are scaled up when densification grows the set
    assert graph["failed"] is None and graph["replays"] >= 110 and graph["overflow_views"] <= 6
    assert graph["captures"] >= 1 + len(on.method.densify_log) // 2  # captured again after densification
    assert graph["capture_s"] > 0  # what the re-captures cost, in the summary
    assert on.rebinds >= 1 and off.rebinds >= 1 and on.skipped_steps == 0
    assert on.rows[-1]["loss"] < 0.75 * on.rows[0]["loss"]
    assert abs(on.rows[-1]["psnr"] - off.rows[-1]["psnr"]) < 1.0, (on.rows[-1], off.rows[-1])


@pytest.mark.gpu
def test_captures_again_and_again_hold_no_more_memory(tmp_path, cuda):
    """Each capture frees the graph before it; its warm-ups run on one side stream for the process.
    (With a new stream per capture, cuBLAS kept a 32 MiB workspace for every stream of PyTorch's
    pool: about 1 GiB after a few dozen captures.)"""
    scene = load_scene(splat_poses(tmp_path))
    m = GaussianMethod(gs_params({"device": "cuda", "gs": {"cuda_graph": "on"}}), scene.aabb, cuda, scene=scene)
    views = m.make_sampler(m.place(scene.train), torch.Generator().manual_seed(0))
    m.step_pre_forward(0, torch.Generator().manual_seed(0))
    g = torch.Generator(device="cpu")
    m.forward_backward(_Batch(views, [0]), g)  # eager: the count sizes the budget
    m.forward_backward(_Batch(views, [1]), g)  # the first capture
    step = m.graphed
    base_capacity = step.capacity
    torch.cuda.synchronize()
    after_first = torch.cuda.memory_allocated(cuda)
    for i in range(40):  # budgets that alternate, so every one is a new capture
        step._capture(base_capacity + (i % 2) * 16384)
    torch.cuda.synchronize()
    assert step.captures == 41
    grown = torch.cuda.memory_allocated(cuda) - after_first
    assert grown < 16 * 2**20, f"40 captures left {grown / 2**20:.0f} MiB more allocated"


def test_views_of_several_sizes_render_eagerly(tmp_path):
    """A graph holds one image size: with several the method drops it rather than capture again at
    almost every step (checked on the CPU by handing the method a stand-in graph)."""
    scene = load_scene(splat_poses(tmp_path, views=4))
    m = GaussianMethod(gs_params(), scene.aabb, torch.device("cpu"), scene=scene)
    m.graphed = object()
    m.make_sampler(scene.train, torch.Generator().manual_seed(0))
    assert m.graphed is not None  # one size: kept
    scene.train.cameras.width[1] += 16  # a second image size (only the cameras are read here)
    m.make_sampler(scene.train, torch.Generator().manual_seed(0))
    assert m.graphed is None
