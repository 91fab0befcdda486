"""The generated default scene (stages/scene.py) at a tiny size: files, ground truth, determinism, params."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
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


def test_float_with_exponent_that_yaml_1_1_reads_as_text_is_a_number():
    # PyYAML reads 5.5e1 and 1e-4 as strings (YAML 1.1 wants 5.5e+1); DVC's YAML 1.2 reads numbers
    section = yaml.safe_load("scene: {fov_deg: 5.5e1}")["scene"]
    assert section["fov_deg"] == "5.5e1"
    assert load_section(scene.SceneParams, "scene", data={"scene": section}).fov_deg == 55.0
    with pytest.raises(ParamsError, match=r"scene\.fov_deg: expected a number"):
        load_section(scene.SceneParams, "scene", data={"scene": {"fov_deg": "wide"}})
    with pytest.raises(ParamsError, match=r"scene\.views: expected an integer"):  # ints stay strict
        load_section(scene.SceneParams, "scene", data={"scene": {"views": "4e1"}})


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


# ---------------------------------------------------------------- the same bytes on every machine

# sha256 over TINY's PNGs (seed 0, in name order), as written on the 2-core CI machine. dvc.lock pins
# the default scene's hash the same way, so a machine that writes other bytes here would rerun every
# stage of a fresh clone: see the module docstring of stages/scene.py for what keeps them equal.
TINY_PNG_SHA256 = "9d05a4de740c2f1820db37cb48025065d0b3a3da7c2d6e426059049b624def5f"


def _png_digest(out) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, data in sorted(_files(out).items()):
        if name.endswith(".png"):
            h.update(data)
    return h.hexdigest()


def test_png_bytes_are_stored_blocks_that_decode_to_the_pixels():
    import struct
    import zlib

    rng = np.random.default_rng(3)
    for h, w in ((1, 1), (5, 7), (150, 200)):  # the last needs two deflate blocks (60300 + 300 bytes of rows)
        img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        data = scene.png_bytes(img)
        assert data == scene.png_bytes(img.copy())
        with Image.open(io.BytesIO(data)) as im:
            assert im.mode == "RGB" and not im.info
            np.testing.assert_array_equal(np.asarray(im), img)
        length = struct.unpack(">I", data[33:37])[0]
        assert data[37:41] == b"IDAT"
        stream = data[41:41 + length]
        assert stream[2] & 0b110 == 0  # BTYPE 00: stored, no compressor involved
        assert zlib.decompress(stream) == b"".join(b"\0" + img[r].tobytes() for r in range(h))


def test_scene_bytes_do_not_depend_on_threads_or_cpu_features(tiny_scene, tmp_path):
    """The scene stage in fresh processes: one thread for everything, and numpy's dispatch of
    AVX-512/AVX2 loops and OpenBLAS's kernels switched to older CPUs'. Same bytes as in-process."""
    import os
    import subprocess
    import sys

    import yaml

    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
        features = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
    except ImportError:  # another numpy layout: the thread variant alone
        features = ""
    out, _ = tiny_scene
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"seed": 0, "scene": TINY.__dict__}))
    variants = {"one-thread": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                "older-cpu": {"NPY_DISABLE_CPU_FEATURES": features, "OPENBLAS_CORETYPE": "Haswell"}}
    root = Path(scene.__file__).resolve().parents[1]
    for name, extra in variants.items():
        env = {**os.environ, "PYTHONPATH": str(root), **extra}
        p = subprocess.run([sys.executable, "-m", "stages.scene", "--out", str(tmp_path / name), "--params",
                            str(params)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert _files(tmp_path / name) == _files(out), name


def test_tiny_scene_has_the_recorded_bytes(tiny_scene):
    out, _ = tiny_scene
    assert _png_digest(out) == TINY_PNG_SHA256, (
        "the generated scene's PNGs differ from the bytes recorded on the CI machine: on this machine "
        "dvc.lock's hash of data/scene would not hold either (stages/scene.py says what keeps them equal)")
