"""The evaluate stage on a tiny fake poses folder with a fake model (no reconstruct needed)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stages import evaluate
from stages.common.cameras import Intrinsics, write_transforms
from stages.common.metrics import psnr, ssim
from stages.common.params import ParamsError, from_dict

W, H = 32, 24


def make_poses(root: Path, n: int = 4, test: list[str] | None = None, seed: int = 0) -> tuple[Intrinsics, dict]:
    """``root/{images/, transforms.json, split.json}`` with ``n`` random-texture views.

    Returns the intrinsics and ``{file name: uint8 image}``.
    """
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    intr = Intrinsics(W, H, 30.0, 30.0, W / 2, H / 2)
    names = [f"view_{i:03d}.png" for i in range(n)]
    images, poses = {}, []
    for i, name in enumerate(names):
        # smooth-ish texture so a blur gives an SSIM clearly between 0 and 1
        base = rng.random((H // 4, W // 4, 3))
        img = np.clip(np.kron(base, np.ones((4, 4, 1))) * 255 + rng.normal(0, 8, (H, W, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root / "images" / name)
        images[name] = img
        c2w = np.eye(4)
        c2w[:3, 3] = [np.cos(i), np.sin(i), 0.3]  # distinct camera centres identify the views
        poses.append(c2w)
    write_transforms(root / "transforms.json", intr, [f"images/{n_}" for n_ in names], np.stack(poses))
    if test is None:
        test = names[::2]
    split = {"train": [n_ for n_ in names if n_ not in test], "test": test}
    (root / "split.json").write_text(json.dumps(split))
    return intr, images


def make_model_dir(root: Path, weights: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    summary = {"method": "nerf", "device": "cpu", "gpu_name": None, "gpu_count": 0, "world_size": 1,
               "steps": 10, "train_time_s": 1.5, "peak_gpu_memory_bytes": None, "num_params": 1234,
               "samples_per_s": 1e5, "torch_version": torch.__version__, "params": {"method": "nerf"}}
    (root / "summary.json").write_text(json.dumps(summary))
    if weights:
        (root / "model.pt").write_bytes(b"not read by these tests")
    return root


class FakeModel:
    """The ``TrainedModel`` interface: renders a 3x3 box blur of the GT image seen from the camera."""

    method = "nerf"
    num_params = 1234
    device = torch.device("cpu")

    def __init__(self, poses_dir: Path, shift: float = 0.0):
        from stages.common.cameras import read_transforms

        _, files, c2w, _ = read_transforms(poses_dir / "transforms.json")
        self.views = [(m, np.array(Image.open(poses_dir / f).convert("RGB"))) for f, m in zip(files, c2w)]
        self.shift = shift
        self.calls = 0

    def expected(self, img_u8: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(img_u8).float().permute(2, 0, 1)[None] / 255.0
        x = torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        return (x[0].permute(1, 2, 0) + self.shift).clamp(0, 1)

    def render(self, intr: Intrinsics, c2w_cv: np.ndarray, chunk_rays: int) -> torch.Tensor:
        assert chunk_rays >= 256 and c2w_cv.shape == (4, 4)
        self.calls += 1
        img = min(self.views, key=lambda v: np.abs(v[0] - c2w_cv).sum())[1]
        out = self.expected(img)
        if out.shape[:2] != (intr.height, intr.width):  # an orbit frame: the nearest view, resized
            out = torch.nn.functional.interpolate(out.permute(2, 0, 1)[None], size=(intr.height, intr.width),
                                                  mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
        return out


@pytest.fixture()
def setup(tmp_path):
    poses = tmp_path / "poses"
    _, images = make_poses(poses)
    model_dir = make_model_dir(tmp_path / "reconstruct")
    params_yaml = tmp_path / "params.yaml"
    params_yaml.write_text("reconstruct:\n  steps: 10\nevaluate:\n  chunk_rays: 1024\nreport:\n  max_views: 2\n")
    return tmp_path, poses, model_dir, images, params_yaml


ORBIT = {"orbit_frames": 6, "orbit_size": 16}


def _run(tmp_path, poses, model_dir, model, params_yaml=None, **kw):
    return evaluate.run(evaluate.EvaluateParams(chunk_rays=1024, **ORBIT), poses, model_dir, tmp_path / "evaluate",
                        tmp_path / "metrics" / "evaluate.json", model=model, params_path=params_yaml, **kw)


def test_evaluate_scores_renders_and_writes_outs(setup):
    tmp_path, poses, model_dir, images, params_yaml = setup
    model = FakeModel(poses)
    m = _run(tmp_path, poses, model_dir, model, params_yaml)

    out = tmp_path / "evaluate"
    per_view = json.loads((out / "per_view.json").read_text())
    assert [r["file"] for r in per_view] == ["view_000.png", "view_002.png"]
    assert model.calls == 3 + ORBIT["orbit_frames"]  # one warm-up + one per test view + the orbit
    for row in per_view:
        gt = torch.from_numpy(images[row["file"]]).float() / 255
        pred = model.expected(images[row["file"]])
        assert row["psnr"] == pytest.approx(psnr(pred, gt), abs=1e-9)
        assert row["ssim"] == pytest.approx(ssim(pred, gt), abs=1e-9)
        assert 10 < row["psnr"] < 40 and 0.1 < row["ssim"] < 0.99 and row["render_time_s"] >= 0
        png = Image.open(out / "renders" / row["file"])
        assert png.mode == "RGB" and png.size == (W, H)
        # 8-bit render within half a level of the float render
        assert np.abs(np.asarray(png) / 255.0 - pred.numpy()).max() <= 0.5 / 255 + 1e-6

    written = json.loads((tmp_path / "metrics" / "evaluate.full.json").read_text())  # the full record
    assert written == json.loads(json.dumps(m))
    headline = json.loads((tmp_path / "metrics" / "evaluate.json").read_text())  # what `dvc metrics show` shows
    assert headline == {k: m[k] for k in ("psnr", "ssim", "fps")}  # LPIPS is None here: no empty column
    for key in ("psnr", "psnr_std", "ssim", "ssim_std", "lpips", "lpips_note", "fps", "num_test_views", "width",
                "height", "train_time_s", "peak_gpu_memory_bytes", "num_params", "method", "device", "gpu_name",
                "gpu_count", "world_size", "environment"):
        assert key in m, key
    assert m["psnr"] == pytest.approx(np.mean([r["psnr"] for r in per_view]))
    assert m["psnr_std"] == pytest.approx(np.std([r["psnr"] for r in per_view], ddof=1))
    assert m["ssim"] == pytest.approx(np.mean([r["ssim"] for r in per_view]))
    assert m["lpips"] is None and m["lpips_note"] == "not computed: no LPIPS weights configured"
    assert m["fps"] > 0 and (m["num_test_views"], m["width"], m["height"]) == (2, W, H)
    assert (m["num_params"], m["method"], m["train_time_s"], m["world_size"]) == (1234, "nerf", 1.5, 1)
    env = m["environment"]
    for key in ("torch_version", "python_version", "platform", "code_revision", "code_dirty", "params_sha256",
                "libraries", "cuda_version", "gpu_driver", "eval_gpu_name"):
        assert key in env, key
    assert env["torch_version"] == torch.__version__ and env["libraries"]["torch"]
    assert len(env["params_sha256"]) == 64
    assert m["model_size_bytes"] == (model_dir / "model.pt").stat().st_size

    # the orbit: an animation of orbit_frames frames, the longest side orbit_size
    orbit = m["orbit"]
    assert orbit["frames"] == ORBIT["orbit_frames"] and max(orbit["width"], orbit["height"]) == ORBIT["orbit_size"]
    anim = Image.open(out / orbit["file"])
    assert anim.size == (orbit["width"], orbit["height"]) and anim.n_frames > 1
    total_ms = 0  # the encoder may merge identical neighbouring frames, adding up their durations
    for k in range(anim.n_frames):
        anim.seek(k)
        anim.load()  # the frame's duration is known once it is decoded
        total_ms += anim.info["duration"]
    assert total_ms == ORBIT["orbit_frames"] * orbit["frame_ms"]

    # metrics.json in ns-eval's shape
    ns = json.loads((out / "metrics.json").read_text())
    assert set(ns) == {"experiment_name", "method_name", "checkpoint", "results"}
    assert set(ns["results"]) == {"psnr", "psnr_std", "ssim", "ssim_std", "lpips", "lpips_std", "num_rays_per_sec",
                                  "num_rays_per_sec_std", "fps", "fps_std"}
    assert ns["results"]["psnr"] == m["psnr"] and ns["method_name"] == "nerf"
    fps = [1 / r["render_time_s"] for r in per_view]
    assert ns["results"]["fps"] == pytest.approx(np.mean(fps))
    assert ns["results"]["num_rays_per_sec"] == pytest.approx(np.mean(fps) * W * H)
    assert ns["experiment_name"] == "rayforge-" + env["params_sha256"][:12]


def test_no_orbit(setup):
    tmp_path, poses, model_dir, _, _ = setup
    model = FakeModel(poses)
    m = evaluate.run(evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=0), poses, model_dir, tmp_path / "ev",
                     tmp_path / "m.json", model=model, params_path=None)
    assert m["orbit"] is None and model.calls == 3
    assert not list((tmp_path / "ev").glob("orbit.*"))


def _ring(n: int, radius: float, height: float, center: np.ndarray, arc: float = 2 * np.pi) -> np.ndarray:
    """Cameras (OpenCV c2w) on a circle about +z around ``center``, looking at it."""
    return np.stack([evaluate.look_at(center + [radius * np.cos(a), radius * np.sin(a), height], center,
                                      np.array([0.0, 0.0, 1.0])) for a in np.linspace(0, arc, n, endpoint=False)])


def test_look_at_is_opencv():
    c2w = evaluate.look_at(np.array([0.0, -2.0, 0.0]), np.zeros(3), np.array([0.0, 0.0, 1.0]))
    np.testing.assert_allclose(c2w[:3, 2], [0, 1, 0], atol=1e-12)  # z forward: towards the target
    np.testing.assert_allclose(c2w[:3, 1], [0, 0, -1], atol=1e-12)  # y down
    np.testing.assert_allclose(c2w[:3, 0], [1, 0, 0], atol=1e-12)  # x right
    np.testing.assert_allclose(c2w[:3, :3] @ c2w[:3, :3].T, np.eye(3), atol=1e-12)
    # the pixel at the image centre looks at the target through stages.reconstruct.data's rays
    from stages.reconstruct.data import pixel_rays

    intr = Intrinsics(8, 6, 10.0, 10.0, 4.0, 3.0)
    o, d = pixel_rays(intr, torch.tensor(c2w, dtype=torch.float32), torch.tensor([3.5]), torch.tensor([2.5]))
    np.testing.assert_allclose((o + 2.0 * d)[0].numpy(), [0, 0, 0], atol=1e-6)


def test_orbit_circles_the_scene_at_the_cameras_height_and_distance():
    center = np.array([0.1, -0.2, 0.3])
    cams = _ring(12, radius=1.5, height=0.6, center=center)
    poses, kind = evaluate.orbit_poses(cams, center, 8)
    assert kind == "circle" and poses.shape == (8, 4, 4)
    offs = poses[:, :3, 3] - center
    np.testing.assert_allclose(offs[:, 2], 0.6, atol=1e-9)  # the cameras' height above the centre
    np.testing.assert_allclose(np.linalg.norm(offs[:, :2], axis=1), 1.5, atol=1e-9)  # their distance
    for p in poses:  # every frame looks at the centre, upright (y down = -z world)
        np.testing.assert_allclose(np.cross(p[:3, 2], center - p[:3, 3]), 0, atol=1e-9)
        assert p[:3, 1] @ np.array([0, 0, 1.0]) < 0
    bearings = np.unwrap(np.arctan2(offs[:, 1], offs[:, 0]))
    assert np.allclose(np.diff(bearings), 2 * np.pi / 8)  # even steps, one way round


def test_orbit_swings_across_a_forward_facing_capture():
    center = np.zeros(3)
    cams = _ring(6, radius=2.0, height=0.2, center=center, arc=np.radians(40))
    poses, kind = evaluate.orbit_poses(cams, center, 16)
    assert kind == "swing"
    bearing = np.degrees(np.arctan2(poses[:, 1, 3], poses[:, 0, 3]))
    assert bearing.min() >= -1e-6 and bearing.max() <= 40 * 5 / 6 + 1e-6  # within the cameras' arc
    assert bearing.max() - bearing.min() > 25


def test_scene_center_from_aabb_or_camera_axes():
    assert np.allclose(evaluate.scene_center({"aabb": [[-1, -1, 0], [1, 3, 2]]}, np.eye(4)[None]), [0, 1, 1])
    center = np.array([0.5, 0.0, -0.2])
    assert np.allclose(evaluate.scene_center({}, _ring(5, 2.0, 1.0, center)), center, atol=1e-9)


def test_params_hash_covers_seed_reconstruct_and_evaluate_only(tmp_path):
    a, b, c, d = (tmp_path / f"{n}.yaml" for n in "abcd")
    a.write_text("seed: 0\nreconstruct: {steps: 10}\nevaluate: {chunk_rays: 1024}\nreport: {max_views: 2}\n")
    b.write_text("report: {max_views: 5}\nevaluate: {chunk_rays: 1024}\nreconstruct: {steps: 10}\nseed: 0\n")
    c.write_text("seed: 0\nreconstruct: {steps: 11}\nevaluate: {chunk_rays: 1024}\n")
    d.write_text("seed: 1\nreconstruct: {steps: 10}\nevaluate: {chunk_rays: 1024}\n")
    assert evaluate.params_sha256(a) == evaluate.params_sha256(b)
    assert len({evaluate.params_sha256(x) for x in (a, c, d)}) == 3
    assert evaluate.params_sha256(tmp_path / "absent.yaml") is None


def test_params_schema():
    assert from_dict(evaluate.EvaluateParams, {}, "evaluate").chunk_rays == 8192
    with pytest.raises(ParamsError, match="evaluate.chunk_rays: must be >= 256"):
        from_dict(evaluate.EvaluateParams, {"chunk_rays": 16}, "evaluate")
    with pytest.raises(ParamsError, match="evaluate.chunk_ray"):
        from_dict(evaluate.EvaluateParams, {"chunk_ray": 1024}, "evaluate")
    with pytest.raises(ParamsError, match="evaluate.orbit_frames: must be 0 \\(off\\) or 2..720"):
        from_dict(evaluate.EvaluateParams, {"orbit_frames": 1}, "evaluate")
    with pytest.raises(ParamsError, match="evaluate.orbit_size"):
        from_dict(evaluate.EvaluateParams, {"orbit_size": 4}, "evaluate")


def test_missing_split(setup):
    tmp_path, poses, model_dir, _, _ = setup
    (poses / "split.json").unlink()
    with pytest.raises(ValueError, match="split.json: missing"):
        _run(tmp_path, poses, model_dir, FakeModel(poses))


def test_empty_test_split(setup):
    tmp_path, poses, model_dir, _, _ = setup
    (poses / "split.json").write_text(json.dumps({"train": ["view_000.png"], "test": []}))
    with pytest.raises(ValueError, match="no test views"):
        _run(tmp_path, poses, model_dir, FakeModel(poses))


def test_unknown_test_view(setup):
    tmp_path, poses, model_dir, _, _ = setup
    (poses / "split.json").write_text(json.dumps({"train": [], "test": ["nope.png"]}))
    with pytest.raises(ValueError, match="'nope.png' has no camera"):
        _run(tmp_path, poses, model_dir, FakeModel(poses))


def test_wrong_image_size(setup):
    tmp_path, poses, model_dir, _, _ = setup
    model = FakeModel(poses)
    Image.new("RGB", (W + 2, H)).save(poses / "images" / "view_002.png")
    with pytest.raises(ValueError, match=rf"view_002.png: ground-truth image is {W + 2}x{H} but the camera"):
        _run(tmp_path, poses, model_dir, model)
    assert model.calls == 0  # checked before any render
    assert not (tmp_path / "evaluate").exists()


@pytest.mark.parametrize("what", ["folder", "model.pt", "summary.json"])
def test_missing_model(setup, what):
    tmp_path, poses, model_dir, _, _ = setup
    if what == "folder":
        model_dir = tmp_path / "absent"
        match = "model folder not found"
    else:
        (model_dir / what).unlink()
        match = f"missing model file\\(s\\) {what}"
    with pytest.raises(ValueError, match=match):
        _run(tmp_path, poses, model_dir, None)  # model=None: loads from model_dir, which is checked first


def test_unreadable_checkpoint(setup):
    tmp_path, poses, model_dir, _, _ = setup  # model.pt holds a few bytes of text
    with pytest.raises(ValueError, match=r"model.pt: not a readable model file"):
        _run(tmp_path, poses, model_dir, None)
    assert not (tmp_path / "evaluate").exists()


def test_bad_render_shape(setup):
    tmp_path, poses, model_dir, _, _ = setup

    class Wrong(FakeModel):
        def render(self, intr, c2w_cv, chunk_rays):
            return torch.zeros(intr.height, intr.width, 4)

    with pytest.raises(ValueError, match=r"model rendered \(\d+, \d+, 4\) for view_000.png, expected \(\d+, \d+, 3\)"):
        _run(tmp_path, poses, model_dir, Wrong(poses))


def test_main_reports_errors_and_exit_code(setup, capsys):
    tmp_path, poses, model_dir, _, params_yaml = setup
    (poses / "split.json").unlink()
    rc = evaluate.main(["--poses", str(poses), "--model", str(model_dir), "--out", str(tmp_path / "ev"),
                        "--metrics", str(tmp_path / "m.json"), "--params", str(params_yaml)])
    assert rc == 1
    assert "evaluate: error:" in capsys.readouterr().err
    params_yaml.write_text("evaluate:\n  chunk_rays: 1024\n  typo: 1\n")
    rc = evaluate.main(["--poses", str(poses), "--model", str(model_dir), "--out", str(tmp_path / "ev"),
                        "--metrics", str(tmp_path / "m.json"), "--params", str(params_yaml)])
    assert rc == 1 and "evaluate.typo" in capsys.readouterr().err


def test_lpips_with_user_weights(setup):
    from test_lpips import _weights

    tmp_path, poses, model_dir, _, _ = setup
    backbone, linear = _weights(tmp_path, "vgg")  # VGG: the test views are too small for AlexNet
    params = evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=0, lpips_net="vgg", lpips_backbone=str(backbone),
                                     lpips_linear=str(linear))
    m = evaluate.run(params, poses, model_dir, tmp_path / "ev", tmp_path / "m.json", model=FakeModel(poses, shift=0.1),
                     params_path=None)
    per_view = json.loads((tmp_path / "ev" / "per_view.json").read_text())
    assert all(r["lpips"] > 0 for r in per_view)
    assert m["lpips"] == pytest.approx(sum(r["lpips"] for r in per_view) / len(per_view))
    assert "vgg" in m["lpips_note"]
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["results"]["lpips"] == m["lpips"]
    # Without weights: not computed, and said so.
    m = evaluate.run(evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=0), poses, model_dir, tmp_path / "ev2",
                     tmp_path / "m2.json", model=FakeModel(poses), params_path=None)
    assert m["lpips"] is None and "not computed" in m["lpips_note"]


def test_fewer_and_smaller_test_views(setup, caplog):
    """max_test_views picks evenly spread views; resolution_scale renders each view's camera
    scaled and scores it against the ground truth shrunk alike (area average), which is written
    beside the render for the report."""
    tmp_path, poses, model_dir, images, _ = setup
    (poses / "split.json").write_text(json.dumps({"train": [], "test": sorted(images)}))
    model = FakeModel(poses)
    params = evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=0, max_test_views=3, resolution_scale=0.5)
    with caplog.at_level(logging.INFO, logger="evaluate"):
        m = evaluate.run(params, poses, model_dir, tmp_path / "ev", tmp_path / "m.json", model=model, params_path=None)
    assert "expected: about" in caplog.text
    per_view = json.loads((tmp_path / "ev" / "per_view.json").read_text())
    assert [r["file"] for r in per_view] == ["view_000.png", "view_002.png", "view_003.png"]  # of 4: 0, 1.5, 3
    assert (m["num_test_views"], m["num_test_views_in_split"], m["resolution_scale"]) == (3, 4, 0.5)
    assert m["eval_profile"] == "as set" and (m["width"], m["height"]) == (W // 2, H // 2)
    for r in per_view:
        gt = np.asarray(Image.open(tmp_path / "ev" / "ground_truth" / r["file"]))
        box = np.asarray(Image.fromarray(images[r["file"]]).resize((W // 2, H // 2), Image.Resampling.BOX))
        np.testing.assert_array_equal(gt, box)
        pred = torch.from_numpy(np.asarray(Image.open(tmp_path / "ev" / "renders" / r["file"]))).float() / 255
        # the score is of the float render; the 8-bit PNG is within half a level of it
        assert r["psnr"] == pytest.approx(psnr(pred, torch.from_numpy(gt).float() / 255), abs=0.2)
    ns = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    fps = [1 / r["render_time_s"] for r in per_view]
    assert ns["results"]["num_rays_per_sec"] == pytest.approx(np.mean(fps) * (W // 2) * (H // 2))


def test_auto_is_everything_on_a_gpu_and_the_cpu_profile_elsewhere():
    intr = Intrinsics(800, 600, 700.0, 700.0, 400.0, 300.0)
    views = [evaluate.EvalView(f"v{k}.png", Path("x"), np.eye(4), intr) for k in range(10)]
    auto = evaluate.EvaluateParams()
    assert evaluate.eval_profile(auto, views, on_gpu=True) == (0, 1.0, "max_test_views and resolution_scale auto "
                                                                      "(GPU profile)")
    limit, scale, how = evaluate.eval_profile(auto, views, on_gpu=False)
    assert (limit, scale) == (evaluate.CPU_TEST_VIEWS, evaluate.CPU_EVAL_SIDE / 800) and "CPU profile" in how
    assert intr.scaled(scale) == Intrinsics(400, 300, 350.0, 350.0, 200.0, 150.0)
    assert evaluate.eval_profile(evaluate.EvaluateParams(max_test_views=0, resolution_scale=1.0), views, False) == \
        (0, 1.0, "as set")
    picked = evaluate.pick_views(views, 8)
    assert [v.name for v in picked] == ["v0.png", "v1.png", "v3.png", "v4.png", "v5.png", "v6.png", "v8.png",
                                        "v9.png"]
    assert evaluate.pick_views(views, 0) == views == evaluate.pick_views(views, 12)
    with pytest.raises(ParamsError, match="evaluate.resolution_scale"):
        from_dict(evaluate.EvaluateParams, {"resolution_scale": 0.0}, "evaluate")
    with pytest.raises(ParamsError, match="evaluate.max_test_views"):
        from_dict(evaluate.EvaluateParams, {"max_test_views": -1}, "evaluate")


def test_each_test_view_is_rendered_with_its_own_camera(tmp_path):
    """A portrait and a landscape test view: each render has its camera's size, and an RGBA
    ground truth is scored composited on the scene's background colour."""
    poses = tmp_path / "poses"
    (poses / "images").mkdir(parents=True)
    cams = [Intrinsics(W, H, 30.0, 30.0, W / 2, H / 2), Intrinsics(H, W, 30.0, 30.0, H / 2, W / 2)]
    rng = np.random.default_rng(0)
    for k, c in enumerate(cams):
        img = rng.integers(0, 256, (c.height, c.width, 4 if k else 3), dtype=np.uint8)
        Image.fromarray(img).save(poses / "images" / f"view_{k:03d}.png")
    c2w = np.stack([np.eye(4), np.eye(4)])
    c2w[1, :3, 3] = [1.0, 0.0, 0.0]
    write_transforms(poses / "transforms.json", cams, ["images/view_000.png", "images/view_001.png"], c2w,
                     extra={"background": "black"})
    (poses / "split.json").write_text(json.dumps({"train": [], "test": ["view_000.png", "view_001.png"]}))
    sizes = []

    class Recorder(FakeModel):
        def render(self, intr, c2w_cv, chunk_rays):
            sizes.append((intr.width, intr.height))
            return torch.zeros(intr.height, intr.width, 3)

    evaluate.run(evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=0), poses, make_model_dir(tmp_path / "m"),
                 tmp_path / "ev", tmp_path / "m.json", model=Recorder(poses), params_path=None)
    assert sizes[1:] == [(W, H), (H, W)]  # after the warm-up, each view at its own size
    rgba = np.asarray(Image.open(poses / "images" / "view_001.png")).astype(float)
    on_black = np.round(rgba[..., :3] * rgba[..., 3:] / 255)
    gt = np.asarray(Image.open(tmp_path / "ev" / "ground_truth" / "view_001.png")).astype(float)
    assert gt.shape == (W, H, 3) and np.abs(gt - on_black).max() <= 1  # Pillow's rounding of the blend
