"""The generated default scene (stages/scene.py) at a tiny size: files, ground truth, determinism, params."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from stages import scene
from stages.common.params import ParamsError, load_section

TINY = scene.SceneParams(width=64, height=48, views=6, rings=2, fov_deg=55.0, objects=3)


@pytest.fixture(scope="module")
def tiny_scene(tmp_path_factory):
    out = tmp_path_factory.mktemp("scene") / "scene"
    summary = scene.run(TINY, out, seed=0)
    return out, summary


def _files(out):
    return {p.name: p.read_bytes() for p in sorted((out / "images").iterdir())}


def test_writes_views_and_ground_truth(tiny_scene):
    out, summary = tiny_scene
    names = sorted(_files(out))
    assert names == ["ground_truth.json"] + [f"view_{i:03d}.png" for i in range(6)]
    assert summary["views"] == 6
    for i in range(6):
        with Image.open(out / "images" / f"view_{i:03d}.png") as im:
            assert (im.mode, im.size, im.format) == ("RGB", (64, 48), "PNG")
            assert not im.info  # no metadata chunks (timestamps, software) in the PNG


def test_ground_truth_matches_contract(tiny_scene):
    out, _ = tiny_scene
    gt = json.loads((out / "images" / "ground_truth.json").read_text())
    assert set(gt) == {"intrinsics", "frames", "scene"}
    k = gt["intrinsics"]
    assert (k["width"], k["height"], k["cx"], k["cy"]) == (64, 48, 32.0, 24.0)
    assert k["fx"] == pytest.approx(32.0 / np.tan(np.radians(55.0) / 2)) and k["fy"] == k["fx"]
    K = np.array([[k["fx"], 0, k["cx"]], [0, k["fy"], k["cy"]], [0, 0, 1]])
    center = np.array(gt["scene"]["center"], dtype=float)
    assert gt["scene"]["radius"] > 0
    assert [f["file"] for f in gt["frames"]] == [f"view_{i:03d}.png" for i in range(6)]
    heights = set()
    for f in gt["frames"]:
        w2c = np.array(f["world_to_camera"])
        assert w2c.shape == (4, 4)
        np.testing.assert_allclose(w2c[3], [0, 0, 0, 1])
        R = w2c[:3, :3]
        np.testing.assert_allclose(R @ R.T, np.eye(3), atol=1e-9)
        assert np.linalg.det(R) == pytest.approx(1.0)
        p_cam = R @ center + w2c[:3, 3]
        assert p_cam[2] > 0  # in front of the camera (OpenCV: +z forward)
        u, v, _ = K @ p_cam / p_cam[2]
        assert 0 <= u < k["width"] and 0 <= v < k["height"]
        # OpenCV y points down the image, so the world up (+z) is -y in the camera.
        assert (R @ [0, 0, 1.0])[1] < 0
        heights.add(round(float((-R.T @ w2c[:3, 3])[2]), 6))  # camera centre's height
        # The pixel at the scene centre's projection shows the scene, not the sky.
        with Image.open(out / "images" / f["file"]) as im:
            px = np.asarray(im)[int(v), int(u)] / 255.0
        assert np.abs(px - scene.SKY).max() > 0.02
    assert len(heights) == 2  # two rings at two elevations


def test_same_params_same_bytes_other_seed_differs(tiny_scene, tmp_path):
    out, _ = tiny_scene
    again = tmp_path / "again"
    scene.run(TINY, again, seed=0)
    assert _files(again) == _files(out)
    other = tmp_path / "other"
    scene.run(TINY, other, seed=1)
    a, b = _files(out), _files(other)
    assert all(a[n] != b[n] for n in a if n.endswith(".png"))


def test_textured_and_shaded(tiny_scene):
    """Not flat colours: plenty of local contrast, and no saturated white or pure black frames."""
    out, _ = tiny_scene
    with Image.open(out / "images" / "view_000.png") as im:
        img = np.asarray(im, dtype=float) / 255.0
    grad = np.abs(np.diff(img.mean(axis=2), axis=1))
    assert (grad > 0.03).mean() > 0.05
    assert 0.15 < img.mean() < 0.9


@pytest.mark.parametrize(
    "section, key",
    [
        ({"width": 8}, "scene.width"),
        ({"views": 2}, "scene.views"),
        ({"views": 4, "rings": 5}, "scene.rings"),
        ({"fov_deg": 170}, "scene.fov_deg"),
        ({"objects": 0}, "scene.objects"),
        ({"views": "many"}, "scene.views"),
        ({"colour": "red"}, "scene.colour"),
    ],
)
def test_bad_params_name_the_key(section, key):
    with pytest.raises(ParamsError, match=key.replace(".", r"\.")):
        load_section(scene.SceneParams, "scene", data={"scene": section})


def test_bad_seed_rejected():
    with pytest.raises(ParamsError, match="seed"):
        scene.load_seed(data={"seed": "zero"})
    with pytest.raises(ParamsError, match="seed"):
        scene.load_seed(data={"seed": True})


def test_main_ok_and_params_error(tmp_path, capsys):
    good = tmp_path / "params.yaml"
    good.write_text("seed: 3\nscene: {width: 32, height: 24, views: 3, rings: 1, fov_deg: 60, objects: 1}\n")
    assert scene.main(["--out", str(tmp_path / "s"), "--params", str(good)]) == 0
    assert len(list((tmp_path / "s" / "images").glob("view_*.png"))) == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nscene: {width: 32, height: 24, views: 3, rings: 4}\n")
    assert scene.main(["--out", str(tmp_path / "b"), "--params", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "scene.rings" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()
