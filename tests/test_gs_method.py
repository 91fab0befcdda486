"""3DGS as the pipeline's second method, on the CPU through the rasterizer's PyTorch twins:
a tiny scene trains and its loss falls; densification changes the parameter set and the loop
rebinds; a resumed run continues bit-identically; a step with a non-finite gradient is skipped
and counted; two gloo processes densify identically; checkpoints and models of the other method
are refused."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stages.common.params import from_dict
from stages.reconstruct.checkpoint import CheckpointMismatch, CheckpointStore
from stages.reconstruct.config import ReconstructParams
from stages.reconstruct.data import load_scene
from stages.reconstruct.train import train

from _dvc_project import merge
from test_distributed import make_poses, run_stage, stage_cmd, write_params

# 48 views of 64x48, a few hundred Gaussians: a step takes some 10 ms on two cores
GS_TINY = {
    "method": "3dgs", "device": "cpu", "steps": 60, "eval_every": 30, "tensorboard": False,
    "gs": {"init_random": 400, "sh_degree": 1, "sh_degree_every": 20,
           "densify": {"refine_start": 10, "refine_every": 10, "refine_stop": 50, "reset_every": 1000,
                       "grow_grad2d": 2e-5}},
    "distributed": {"checkpoint_every": 0, "replica_check_every": 10, "max_restarts": 0},
}


def gs_params(over: dict | None = None) -> ReconstructParams:
    return from_dict(ReconstructParams, merge(GS_TINY, over or {}), "reconstruct")


@pytest.fixture(scope="module")
def poses(tmp_path_factory) -> Path:
    return make_poses(tmp_path_factory.mktemp("gs"), views=10)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _state(method) -> dict[str, torch.Tensor]:
    st = method.state_dict()
    out = {k: v.detach().clone() for k, v in st["params"].items()}
    if "background_logit" in st:
        out["background_logit"] = st["background_logit"].clone()
    return out


def test_tiny_scene_trains_and_its_loss_falls(poses, one_thread):
    res = train(gs_params({"steps": 120}), load_scene(poses), torch.device("cpu"), 0, progress=False)
    first, last = res.rows[0]["loss"], res.rows[-1]["loss"]
    assert last < 0.75 * first, f"loss {first} -> {last}"  # measured 0.340 -> 0.215 at step 100
    assert res.rows[-1]["psnr"] > res.rows[0]["psnr"] + 2.0
    assert res.rebinds >= 1 and res.method.n != 400  # densification changed the set, the loop rebound
    assert all(torch.isfinite(v).all() for v in _state(res.method).values())


def test_a_resumed_run_continues_bit_identically(poses, tmp_path, one_thread):
    scene = load_scene(poses)
    straight = train(gs_params(), scene, torch.device("cpu"), 0, progress=False)
    store = CheckpointStore(tmp_path / "ck")
    p = gs_params({"distributed": {"checkpoint_every": 25}})
    train(p, scene, torch.device("cpu"), 0, progress=False, checkpoints=store)  # leaves steps 25 and 50
    for path in (store.folder / "step_00000050.pt", store.folder / "step_00000050.json"):
        path.unlink()  # as if killed before step 50: resume at 25, densify at 30, 40, 50 again
    resumed = train(p, scene, torch.device("cpu"), 0, progress=False, checkpoints=store)
    assert resumed.resumed_from_step == 25
    a, b = _state(straight.method), _state(resumed.method)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_plain_sky_is_learned_as_the_background_not_painted(poses, one_thread):
    """The generated scene's sky is one constant colour (stages.scene.SKY) behind everything: the
    learned background goes to it, a model read back renders onto it, and with
    ``learn_background: off`` the views render onto black as before."""
    from stages.scene import SKY

    scene = load_scene(poses)
    assert scene.train.channels == 3 and scene.background is None
    res = train(gs_params({"steps": 120, "gs": {"background_lr": 0.05}}), scene, torch.device("cpu"), 0,
                progress=False)
    m = res.method
    learned = m.background_rgb()
    # from grey (0.36-0.45 away) to within 0.1 of the sky (measured: 0.06; the colour sits a little above
    # the sky while the random initial Gaussians still dim the sky pixels)
    assert (learned - torch.tensor(SKY, dtype=torch.float32)).abs().max() < 0.1, learned
    assert m.summary()["learned_background"] == [round(float(v), 4) for v in learned]
    state = m.state_dict()
    assert torch.equal(state["background"], learned)
    # a model read back (evaluate, viewer, export) renders onto the learned colour, fixed
    fresh = type(m)(m.params, m.aabb, torch.device("cpu"))
    fresh.load_state_dict(state)
    assert fresh.bg_logit is None and torch.equal(fresh.background_rgb(), learned)
    intr, c2w = scene.test.intr(0), scene.test.c2w[0].float()
    assert torch.equal(fresh.render_image(intr, c2w), m.render_image(intr, c2w))

    off = train(gs_params({"steps": 10, "gs": {"learn_background": "off"}}), scene, torch.device("cpu"), 0,
                progress=False)
    assert off.method.bg_logit is None and "background" not in off.method.optimizers
    assert float(off.method.state_dict()["background"].min()) == -1.0  # none: black
    assert torch.equal(off.method.background_rgb(), torch.zeros(3))


def test_a_non_finite_step_is_skipped_and_counted(poses, one_thread, monkeypatch):
    from stages.reconstruct.gs.method import GaussianMethod

    real = GaussianMethod.forward_backward
    calls = {"n": 0}

    def poisoned(self, batch, generator, before_backward=None):
        calls["n"] += 1
        if calls["n"] != 7:
            return real(self, batch, generator, before_backward)
        hook = self.gaussians["means"].register_hook(lambda g: torch.full_like(g, math.nan))  # this step only
        try:
            return real(self, batch, generator, before_backward)
        finally:
            hook.remove()

    monkeypatch.setattr(GaussianMethod, "forward_backward", poisoned)
    res = train(gs_params({"steps": 12}), load_scene(poses), torch.device("cpu"), 0, progress=False)
    assert res.skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in _state(res.method).values())


def test_a_nerf_checkpoint_is_refused_by_a_3dgs_run(poses, tmp_path, one_thread):
    store = CheckpointStore(tmp_path / "ck")
    nerf = gs_params({"method": "nerf", "steps": 12, "batch_rays": 64, "distributed": {"checkpoint_every": 10}})
    nerf.nerf.levels, nerf.nerf.log2_hashmap_size, nerf.nerf.max_resolution = 2, 10, 16
    train(nerf, load_scene(poses), torch.device("cpu"), 0, progress=False, checkpoints=store)
    with pytest.raises(CheckpointMismatch, match="method: 'nerf' -> '3dgs'"):
        train(gs_params({"distributed": {"checkpoint_every": 10}}), load_scene(poses), torch.device("cpu"), 0,
              progress=False, checkpoints=store)


@pytest.mark.integration
def test_two_gloo_processes_densify_identically(poses, tmp_path):
    """torchrun with two gloo workers: each renders its own views, densification decides from the
    all-reduced statistics, and the replica check (every 10 steps and at the end) passes."""
    params = write_params(tmp_path / "p.yaml", merge(GS_TINY, {"distributed": {"cpu_workers": 2}}))
    run_stage(stage_cmd(poses, tmp_path / "out", params), timeout=300, OMP_NUM_THREADS="1")
    blob = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert blob["method"] == "3dgs" and blob["state"]["params"]["means"].shape[0] != 400
    import json

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_gaussians"] == blob["state"]["params"]["means"].shape[0]


def splat_poses(root: Path, views: int = 12, width: int = 64, height: int = 48) -> Path:
    """A poses folder whose images are renders of 300 random Gaussians (the rasterizer's CPU twin),
    seen from a ring of cameras: a scene made without open3d, which GPU hosts may lack."""
    import json

    import numpy as np
    from PIL import Image

    import kernels
    from stages.common.cameras import Intrinsics, write_transforms

    g = torch.Generator().manual_seed(3)
    n = 300
    means = (torch.rand(n, 3, generator=g) * 2 - 1) * 0.6
    quats, scales = torch.randn(n, 4, generator=g), torch.exp(torch.randn(n, 3, generator=g) * 0.3 - 2.5)
    opac, rgb = torch.sigmoid(torch.randn(n, generator=g) + 1.0), torch.rand(n, 3, generator=g)
    intr = Intrinsics(width, height, 60.0, 60.0, width / 2, height / 2)
    K = torch.tensor(intr.K(), dtype=torch.float32)
    (root / "images").mkdir(parents=True, exist_ok=True)
    files, c2ws = [], []
    for k in range(views):
        a = 2 * math.pi * k / views
        eye = torch.tensor([3 * math.cos(a), 3 * math.sin(a), 0.8])
        z = -eye / eye.norm()
        x = torch.linalg.cross(z, torch.tensor([0.0, 0.0, 1.0]))
        x = x / x.norm()
        c2w = torch.eye(4)
        c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = x, torch.linalg.cross(z, x), z, eye
        img, _, _ = kernels.rasterization(means, quats, scales, opac, rgb, torch.linalg.inv(c2w)[None].contiguous(), K[None],
                                          width, height, backgrounds=torch.zeros(1, 3))
        name = f"view_{k:03d}.png"
        Image.fromarray((img[0].clamp(0, 1) * 255).round().byte().numpy()).save(root / "images" / name)
        files.append(name)
        c2ws.append(c2w.numpy())
    write_transforms(root / "transforms.json", intr, [f"images/{f}" for f in files], np.stack(c2ws),
                     {"aabb": [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]})
    (root / "split.json").write_text(json.dumps({"train": [f for i, f in enumerate(files) if i % 4],
                                                 "test": [f for i, f in enumerate(files) if i % 4 == 0]}))
    return root


def test_splat_scene_trains_on_the_cpu(tmp_path, one_thread):
    """The splat scene itself is learnable (so the GPU test below, which uses it, can fail only on the GPU)."""
    res = train(gs_params({"steps": 100}), load_scene(splat_poses(tmp_path)), torch.device("cpu"), 0,
                progress=False)
    assert res.rows[-1]["loss"] < 0.75 * res.rows[0]["loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_training_through_the_kernels_trains(tmp_path):
    """The CUDA path end to end: rasterizer kernels, fused SSIM, the one-launch Adam, no value checks."""
    import kernels

    if not kernels.available():
        pytest.skip(f"CUDA kernels unavailable: {kernels.unavailable_reason()}")
    p = gs_params({"device": "cuda", "steps": 120})
    res = train(p, load_scene(splat_poses(tmp_path)), torch.device("cuda"), 0, progress=False)
    assert res.method.use_kernels and res.rows[-1]["loss"] < 0.75 * res.rows[0]["loss"]
    assert res.rebinds >= 1 and res.skipped_steps == 0
    steps = {float(o.state[o.param_groups[0]["params"][0]]["step"]) for o in res.method.optimizers.values()}
    assert steps == {120.0}


def test_cameras_at_one_point_are_refused(poses, one_thread):
    scene = load_scene(poses)
    scene.train.c2w[:, :3, 3] = 0.25  # every camera at the same spot
    with pytest.raises(ValueError, match="degenerate scene: all 8 cameras sit at one point"):
        train(gs_params({"steps": 2}), scene, torch.device("cpu"), 0, progress=False)


def test_init_extent_draws_the_random_start_in_a_cube_around_the_box(poses):
    """gs.init_extent > 0 (0.3 by default): the Gaussians of a scene without sparse points start
    uniform in a cube of half-side init_extent x the scene extent around the box's centre (3.0 is
    gsplat's simple_trainer start), and 0 keeps them in the box; a negative value is refused by name."""
    from stages.common.params import ParamsError
    from stages.reconstruct.gs.method import GaussianMethod
    from stages.reconstruct.gs.model import scene_extent

    scene = load_scene(poses)
    scene.points, scene.point_rgb = None, None
    cpu = torch.device("cpu")
    p = gs_params({"gs": {"init_extent": 0.0}})
    inside = GaussianMethod(p, scene.aabb, cpu, scene=scene).gaussians["means"].detach()
    assert bool(((inside >= scene.aabb[0]) & (inside <= scene.aabb[1])).all())
    assert gs_params().gs.init_extent == 0.3
    for extent, p in ((3.0, gs_params({"gs": {"init_extent": 3.0}})), (0.3, gs_params())):
        means = GaussianMethod(p, scene.aabb, cpu, scene=scene).gaussians["means"].detach()
        half = extent * scene_extent(scene.train.c2w)
        offset = (means - scene.aabb.mean(0)).abs()
        assert 0.9 * half < float(offset.max()) <= half, extent  # fills the cube, no further
    assert 3.0 * scene_extent(scene.train.c2w) > float((scene.aabb[1] - scene.aabb[0]).max())  # larger than the box
    with pytest.raises(ParamsError, match="init_extent"):
        gs_params({"gs": {"init_extent": -1.0}})


def test_render_image_is_an_inference_call(poses):
    """The viewer, evaluation and FPS figures call render_image while the parameters require grad:
    it records no autograd graph (which would hold the rasterizer's saved tensors and time)."""
    from stages.reconstruct.gs.method import GaussianMethod

    scene = load_scene(poses)
    m = GaussianMethod(gs_params(), scene.aabb, torch.device("cpu"), scene=scene)
    assert m.gaussians["means"].requires_grad
    img = m.render_image(scene.test.intr(0), scene.test.c2w[0])
    assert img.grad_fn is None and not img.requires_grad
    assert img.shape == (scene.test.intr(0).height, scene.test.intr(0).width, 3)
