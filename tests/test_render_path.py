"""Camera paths (stages/common/camera_paths.py) and their videos (stages/render_path.py).

The path maths is checked against its definitions (keys hit, unit quaternions, rigid poses, every
frame facing the scene centre), nerfstudio's camera_path.json round trip, and the videos by decoding
them again and comparing each frame with the model's own render of that camera.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.common import camera_paths as CP
from stages.common.cameras import read_transforms
from stages import render_path as RP


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    q = rng.normal(size=4)
    return CP.matrix_from_quat(q)


def test_quaternion_round_trip_and_slerp_ends() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        R = random_rotation(rng)
        q = CP.quat_from_matrix(R)
        np.testing.assert_allclose(CP.matrix_from_quat(q), R, atol=1e-12)  # float64 round trip
        q2 = CP.quat_from_matrix(random_rotation(rng))
        np.testing.assert_allclose(CP.slerp(q, q2, 0.0), q, atol=1e-12)
        assert min(np.abs(CP.slerp(q, q2, 1.0) - q2).max(), np.abs(CP.slerp(q, q2, 1.0) + q2).max()) < 1e-12
        mid = CP.slerp(q, q2, 0.5)
        assert abs(np.linalg.norm(mid) - 1) < 1e-12
        # the midpoint is equally far (in angle) from both ends
        a = abs(float(mid @ q)), abs(float(mid @ q2))
        assert abs(a[0] - a[1]) < 1e-9


def test_path_through_keys_hits_them_and_moves_smoothly() -> None:
    rng = np.random.default_rng(1)
    keys = np.stack([np.eye(4) for _ in range(4)])
    for k in range(4):
        keys[k, :3, :3] = random_rotation(rng)
        keys[k, :3, 3] = [math.cos(k), math.sin(k), 0.1 * k]
    frames = 31  # 10 per segment + the last key
    path = CP.through(keys, frames)
    for k in range(4):
        np.testing.assert_allclose(path[10 * k], keys[k], atol=1e-9)
    R = path[:, :3, :3]
    np.testing.assert_allclose(np.swapaxes(R, 1, 2) @ R, np.broadcast_to(np.eye(3), R.shape), atol=1e-9)
    assert np.allclose(np.linalg.det(R), 1.0)
    steps = np.linalg.norm(np.diff(path[:, :3, 3], axis=0), axis=1)
    chords = np.linalg.norm(np.diff(keys[:, :3, 3], axis=0), axis=1)
    assert steps.max() < 0.25 * chords.max()  # no jumps: ~1/10 of a segment per frame
    looped = CP.through(keys, 40, loop=True)
    np.testing.assert_allclose(looped[30], keys[3], atol=1e-9)
    assert np.linalg.norm(looped[-1, :3, 3] - keys[0, :3, 3]) < 0.25 * chords.max()  # heading back to the start
    with pytest.raises(ValueError, match="at least 2 poses"):
        CP.through(keys[:1], 5)


def test_orbit_and_spiral_face_the_centre() -> None:
    center = np.array([0.1, -0.2, 0.05])
    ring = np.stack([CP.look_at(center + [2 * math.cos(a), 2 * math.sin(a), 0.8], center, np.array([0.0, 0, 1]))
                     for a in np.linspace(0, 2 * math.pi, 12, endpoint=False)])
    front = np.stack([CP.look_at(center + [0.3 * x, -3.0, 0.2 * y], center, np.array([0.0, 0, 1]))
                      for x in (-1, 0, 1) for y in (-1, 1)])
    for poses in (CP.orbit(ring, center, 16), CP.spiral(front, center, 16)):
        to_c = center - poses[:, :3, 3]
        to_c /= np.linalg.norm(to_c, axis=1, keepdims=True)
        np.testing.assert_allclose(np.einsum("fi,fi->f", poses[:, :3, 2], to_c), 1.0, atol=1e-9)
        assert poses[:, 2, 1].max() < 0  # image "down" (+y) points down the world's z: upright frames
    spiral = CP.spiral(front, center, 16, turns=1.0)
    assert len({tuple(np.round(p[:3, 3], 6)) for p in spiral}) == 16  # it moves, and one turn never repeats


def test_nerfstudio_camera_path_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    c2w = np.stack([np.eye(4)] * 3)
    for k in range(3):
        c2w[k, :3, :3] = random_rotation(rng)
        c2w[k, :3, 3] = rng.normal(size=3)
    cams = [CP.intrinsics_from_fov(f, 64, 48) for f in (40.0, 50.0, 60.0)]
    doc = CP.write_nerfstudio(tmp_path / "camera_path.json", CP.CameraPath(c2w, cams, 12.0))
    assert doc["render_width"] == 64 and doc["render_height"] == 48 and doc["seconds"] == 0.25
    assert len(doc["camera_path"][0]["camera_to_world"]) == 16
    back = CP.read_nerfstudio(tmp_path / "camera_path.json")
    np.testing.assert_allclose(back.c2w, c2w, atol=1e-12)
    assert back.fps == 12.0
    for a, b in zip(back.cameras, cams):
        assert (a.width, a.height) == (64, 48)
        assert math.isclose(a.fy, b.fy) and math.isclose(a.fx, b.fx) and a.cx == 32 and a.cy == 24
    assert math.isclose(CP.fov_deg(back.cameras[1]), 50.0)
    # nerfstudio's viewer writes OpenGL axes: an identity camera_to_world looks down -z
    doc["camera_path"][0]["camera_to_world"] = np.eye(4).reshape(-1).tolist()
    (tmp_path / "gl.json").write_text(json.dumps(doc))
    np.testing.assert_allclose(CP.read_nerfstudio(tmp_path / "gl.json").c2w[0][:3, 2], [0, 0, -1])


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("render_width"), "render_width"),
    (lambda d: d["camera_path"][0].pop("fov"), "fov"),
    (lambda d: d["camera_path"][1].update(fov=190), "fov of frame 1"),
    (lambda d: d["camera_path"][2].update(camera_to_world=[2.0] + [0.0] * 15), "frame 2 is not a rigid"),
    (lambda d: d.update(camera_type="fisheye"), "perspective"),
    (lambda d: d.update(camera_path=[]), "empty"),
])
def test_bad_camera_path_names_the_problem(tmp_path: Path, change, message: str) -> None:
    cams = [CP.intrinsics_from_fov(50, 32, 32)] * 3
    doc = CP.write_nerfstudio(tmp_path / "p.json", CP.CameraPath(np.stack([np.eye(4)] * 3), cams, 24.0))
    change(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        CP.read_nerfstudio(tmp_path / "p.json")


# ---------------------------------------------------------------- videos of a trained model


@pytest.fixture
def trained(tiny_model) -> tuple[Path, Path]:
    return tiny_model


def decode(path: Path) -> np.ndarray:
    import imageio_ffmpeg

    gen = imageio_ffmpeg.read_frames(str(path))
    meta = next(gen)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in gen])


# H.264 (yuv420p, crf 18) of small frames: mean absolute error per frame within 6 of 255 levels
# (measured 1.1-1.9 on these renders); the chroma is subsampled, so single pixels may be further off.
CODEC_MAE = 6.0


def test_videos_match_the_models_renders(trained, tmp_path: Path) -> None:
    from stages.reconstruct.api import load_trained

    poses, model_dir = trained
    p = RP.RenderPathParams(path="views", frames=5, size=32, fps=10.0)
    summary = RP.run(p, model_dir, poses, tmp_path / "out", progress=False)
    assert summary["frames"] == 5 and (summary["width"], summary["height"]) == (32, 24)
    videos = {k: decode(tmp_path / "out" / f"{k}.mp4") for k in RP.OUTPUTS}
    assert all(v.shape == (5, 24, 32, 3) for v in videos.values())
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left
    model = load_trained(model_dir)
    cam_path = CP.read_nerfstudio(tmp_path / "out" / "camera_path.json")
    near, far = summary["depth_range"]
    assert 0 <= near < far
    for k in (0, 2, 4):
        ref = model.render_outputs(cam_path.cameras[k], cam_path.c2w[k])
        assert torch.equal(ref["rgb"], model.render(cam_path.cameras[k], cam_path.c2w[k]))  # same renderer
        alpha = ref["alpha"].numpy()
        depth = np.where(alpha > 1e-3, ref["depth"].numpy() / np.maximum(alpha, 1e-3), 0)
        expect = {"rgb": np.round(ref["rgb"].numpy() * 255), "opacity": np.repeat(np.round(alpha * 255)[..., None], 3, 2),
                  "depth": RP.depth_colors(depth, alpha, near, far).astype(np.float64)}
        for name, want in expect.items():
            mae = np.abs(videos[name][k].astype(np.float64) - want).mean()
            assert mae < CODEC_MAE, (name, k, mae)
    # the first frame of a path through training views is the first key view's camera
    _, files, c2w, _ = read_transforms(poses / "transforms.json")
    train = sorted(json.loads((poses / "split.json").read_text())["train"])
    first = {Path(f).name: m for f, m in zip(files, c2w)}[train[0]]
    np.testing.assert_allclose(cam_path.c2w[0], first, atol=1e-6)
    # the written camera path renders again to the same frames
    again = RP.run(RP.RenderPathParams(path=str(tmp_path / "out" / "camera_path.json"), outputs=["rgb"]), model_dir,
                   None, tmp_path / "again", progress=False)
    assert again["frames"] == 5 and again["fps"] == 10.0
    assert np.array_equal(decode(tmp_path / "again" / "rgb.mp4"), videos["rgb"])


def test_bad_render_requests_are_refused(trained, tmp_path: Path) -> None:
    poses, model_dir = trained
    with pytest.raises(ValueError, match="nope.png"):
        RP.run(RP.RenderPathParams(path="views", views=["nope.png", "x.png"]), model_dir, poses, tmp_path)
    with pytest.raises(ValueError, match="render.path"):
        RP.params_from_args(argparse_namespace(path="circle"))
    with pytest.raises(ValueError, match="render.outputs"):
        RP.params_from_args(argparse_namespace(outputs="rgb,normals"))
    assert RP.main(["--model", str(model_dir), "--poses", str(poses), "--out", str(tmp_path / "o"),
                    "--path", "views", "--views", "a.png"]) == 1
    assert not (tmp_path / "o").exists()


def argparse_namespace(**over):
    import argparse

    ap = argparse.ArgumentParser()
    RP.add_arguments(ap)
    args = ap.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args
