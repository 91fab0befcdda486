"""Camera imports (stages/importers/): COLMAP, transforms.json, Blender and LLFF files read back
from small synthetic fixtures, conventions checked on a known projection, hostile paths and
malformed files, fuzzing of the parsers, and the poses stage end to end for every source."""
from __future__ import annotations

import json
import logging
import math
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image  # before pycolmap (their bundled zlib copies clash the other way round)

from stages import importers as I
from stages import poses
from stages.common import cameras as C
from stages.common import params as P

QUIET = logging.getLogger("test.importers.quiet")
QUIET.setLevel(logging.WARNING)
FUZZ = settings(max_examples=150, deadline=1000, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- fixtures: cameras and writers


def look_at_c2w(eye, target, up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """OpenCV camera-to-world of a camera at ``eye`` looking at ``target``, built from its axes."""
    fwd = np.asarray(target, float) - eye
    fwd /= np.linalg.norm(fwd)
    right = np.cross(fwd, up)
    right /= np.linalg.norm(right)
    down = np.cross(fwd, right)
    T = np.eye(4)
    T[:3, 0], T[:3, 1], T[:3, 2], T[:3, 3] = right, down, fwd, eye
    return T


def ring_c2w(n: int = 6) -> np.ndarray:
    return np.stack([look_at_c2w(np.array([3 * math.cos(a), 3 * math.sin(a), 1.0 + 0.2 * k]), [0, 0, 0.2])
                     for k, a in enumerate(np.linspace(0, 2 * math.pi, n, endpoint=False))])


def write_colmap(folder: Path, names, c2w, cams: list[tuple[str, int, int, list[float]]], points=None,
                 text=False):
    """A COLMAP model written by pycolmap; ``cams[i]`` is image i's (model, w, h, params)."""
    import pycolmap

    rec = pycolmap.Reconstruction()
    for k, (model, w, h, params) in enumerate(cams):
        rec.add_camera_with_trivial_rig(pycolmap.Camera(camera_id=k + 1, model=model, width=w, height=h,
                                                        params=params))
    for k, (name, T) in enumerate(zip(names, c2w)):
        w2c = C.c2w_to_w2c(T)
        kp = np.arange(2.0 * max(2, len(points or []))).reshape(-1, 2)  # keypoint j observes point j
        rec.add_image_with_trivial_frame(pycolmap.Image(name=name, keypoints=kp, camera_id=k % len(cams) + 1,
                                                        image_id=k + 1),
                                         pycolmap.Rigid3d(pycolmap.Rotation3d(w2c[:3, :3]), w2c[:3, 3]))
    for j, (xyz, rgb) in enumerate(points or []):
        track = pycolmap.Track()
        track.add_element(1 + j % len(names), j)
        track.add_element(1 + (j + 1) % len(names), j)
        rec.add_point3D(np.asarray(xyz, float), track, np.asarray(rgb, np.uint8))
    folder.mkdir(parents=True, exist_ok=True)
    (rec.write_text if text else rec.write)(folder)
    return rec


def llff_rows(c2w: np.ndarray, h: int, w: int, f: float, near=1.0, far=10.0) -> np.ndarray:
    """poses_bounds.npy rows: [down, right, back | centre | (H, W, f)] flattened, near, far."""
    rows = []
    for T in c2w:
        m = np.stack([T[:3, 1], T[:3, 0], -T[:3, 2], T[:3, 3], [h, w, f]], axis=1)
        rows.append(np.r_[m.ravel(), near, far])
    return np.array(rows)


def write_png(path: Path, w=16, h=12, rgba=False, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 4 if rgba else 3), dtype=np.uint8)
    Image.fromarray(a, "RGBA" if rgba else "RGB").save(path)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("text", [False, True], ids=["bin", "txt"])
def test_colmap_round_trip_every_model(tmp_path, text):
    import pycolmap

    cams = [("SIMPLE_PINHOLE", 64, 48, [50.0, 32.0, 24.0]), ("PINHOLE", 64, 48, [50.0, 51.0, 31.5, 24.5]),
            ("SIMPLE_RADIAL", 64, 48, [50.0, 32.0, 24.0, 0.01]), ("RADIAL", 64, 48, [50.0, 32.0, 24.0, 0.01, -0.002]),
            ("OPENCV", 64, 48, [50.0, 51.0, 32.0, 24.0, 0.01, -0.002, 0.001, -0.0005]),
            ("FULL_OPENCV", 64, 48, [50.0, 51.0, 32.0, 24.0, 0.01, -0.002, 0.001, -0.0005, 0.003, 0.0, 0.0, 0.0])]
    c2w = ring_c2w(6)
    names = [f"sub/im_{k}.jpg" for k in range(6)]
    pts = [([0.1 * j, -0.2, 0.3 * j], [j, 2 * j, 255 - j]) for j in range(5)]
    rec = write_colmap(tmp_path / "sparse" / "0", names, c2w, cams, pts, text=text)
    scene = I.read_colmap(tmp_path)  # finds sparse/0
    assert scene.layout == f"colmap-{'txt' if text else 'bin'}" and scene.source == "colmap"
    assert scene.names == names
    np.testing.assert_allclose(scene.c2w, c2w, atol=1e-12)
    expected = {
        "SIMPLE_PINHOLE": (50, 50, 32, 24, (0, 0, 0, 0)), "PINHOLE": (50, 51, 31.5, 24.5, (0, 0, 0, 0)),
        "SIMPLE_RADIAL": (50, 50, 32, 24, (0.01, 0, 0, 0)), "RADIAL": (50, 50, 32, 24, (0.01, -0.002, 0, 0)),
        "OPENCV": (50, 51, 32, 24, (0.01, -0.002, 0.001, -0.0005)),
        "FULL_OPENCV": (50, 51, 32, 24, (0.01, -0.002, 0.001, -0.0005, 0.003, 0, 0, 0))}
    for cam, (model, *_rest) in zip(scene.cameras, cams):
        fx, fy, cx, cy, dist = expected[model]
        assert (cam.width, cam.height) == (64, 48)
        np.testing.assert_allclose([cam.fx, cam.fy, cam.cx, cam.cy, *cam.dist], [fx, fy, cx, cy, *dist])
    ids = sorted(rec.point3D_ids())
    np.testing.assert_allclose(scene.points_xyz, [rec.points3D[i].xyz for i in ids])
    np.testing.assert_array_equal(scene.points_rgb, [rec.points3D[i].color for i in ids])
    # and pycolmap reads back what our Camera writes
    for cam in scene.cameras:
        pc = pycolmap.Camera(camera_id=1, model=cam.model, width=cam.width, height=cam.height,
                             params=cam.colmap_params())
        assert pc.model_name == cam.model


def test_transforms_round_trip_with_the_projects_writer(tmp_path):
    c2w = ring_c2w(5)
    intr = C.Intrinsics(80, 60, 70.0, 71.0, 40.5, 29.5)
    files = [f"images/v{k}.png" for k in range(5)]
    C.write_transforms(tmp_path / "transforms.json", intr, files, c2w, extra={"aabb_scale": 2})
    scene = I.read_transforms(tmp_path)  # the folder finds transforms.json
    assert scene.layout == "nerfstudio"  # the writer adds camera_model
    assert scene.names == files and scene.aabb_scale == 2.0 and scene.split is None
    np.testing.assert_allclose(scene.c2w, c2w, atol=1e-12)
    assert {c.intrinsics() for c in scene.cameras} == {intr} and scene.cameras[0].model == "PINHOLE"


def test_instant_ngp_layout_camera_angle_and_image_size(tmp_path):
    """Only camera_angle_x and k1..p2 at the top, no w/h: the size comes from the image file."""
    write_png(tmp_path / "img" / "a.png", w=40, h=30)
    doc = {"camera_angle_x": 2 * math.atan(20 / 50.0), "k1": 0.1, "p2": 0.01, "aabb_scale": 8,
           "frames": [{"file_path": "img/a.png", "transform_matrix": C.opencv_to_opengl(np.eye(4)).tolist()}]}
    (tmp_path / "transforms.json").write_text(json.dumps(doc))
    scene = I.read_transforms(tmp_path / "transforms.json")
    cam = scene.cameras[0]
    assert scene.layout == "instant-ngp" and (cam.width, cam.height) == (40, 30)
    np.testing.assert_allclose([cam.fx, cam.fy, cam.cx, cam.cy], [50, 50, 20, 15])
    assert cam.dist == (0.1, 0.0, 0.0, 0.01) and cam.model == "OPENCV"


def test_nerfstudio_layout_per_frame_intrinsics_split_points(tmp_path):
    import open3d as o3d

    c2w = ring_c2w(4)
    frames = [{"file_path": f"images/f{k}.png", "transform_matrix": C.opencv_to_opengl(T).tolist(),
               "fl_x": 60.0 + k, "fl_y": 61.0, "cx": 30.0, "cy": 20.0, "w": 60, "h": 40}
              for k, T in enumerate(c2w)]
    pcd = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(np.arange(30.0).reshape(10, 3)))
    pcd.colors = o3d.utility.Vector3dVector(np.full((10, 3), 0.5))
    o3d.io.write_point_cloud(str(tmp_path / "sparse_pc.ply"), pcd)
    doc = {"camera_model": "OPENCV", "k1": 0.02, "frames": frames, "applied_transform": np.eye(4)[:3].tolist(),
           "ply_file_path": "sparse_pc.ply", "train_filenames": ["images/f1.png", "images/f2.png", "images/f3.png"],
           "test_filenames": ["images/f0.png"]}
    (tmp_path / "transforms.json").write_text(json.dumps(doc))
    scene = I.read_transforms(tmp_path / "transforms.json")
    assert scene.layout == "nerfstudio"
    assert [c.fx for c in scene.cameras] == [60.0, 61.0, 62.0, 63.0]
    assert all(c.dist[0] == 0.02 and (c.width, c.height) == (60, 40) for c in scene.cameras)
    assert scene.split == {"train": ["images/f1.png", "images/f2.png", "images/f3.png"], "test": ["images/f0.png"]}
    np.testing.assert_allclose(scene.points_xyz, np.arange(30.0).reshape(10, 3))
    assert (scene.points_rgb == 128).all()
    assert scene.extra["applied_transform"] == np.eye(4)[:3].tolist()


def _blender_folder(root: Path, c2w: np.ndarray, n_train: int, w=24, h=24, angle=0.69) -> Path:
    for part, idx in (("train", range(n_train)), ("test", range(n_train, len(c2w)))):
        frames = []
        for k, i in enumerate(idx):
            write_png(root / part / f"r_{k}.png", w, h, rgba=True, seed=i)
            frames.append({"file_path": f"./{part}/r_{k}", "rotation": 0.01,
                           "transform_matrix": C.opencv_to_opengl(c2w[i]).tolist()})
        (root / f"transforms_{part}.json").write_text(json.dumps({"camera_angle_x": angle, "frames": frames}))
    return root


def test_blender_layout_keeps_the_split(tmp_path):
    c2w = ring_c2w(6)
    root = _blender_folder(tmp_path / "lego", c2w, 4)
    for path in (root, root / "transforms_train.json", root / "transforms_test.json"):
        scene = I.read_transforms(path)
        assert scene.layout == "blender" and scene.background == "white"
        assert scene.names == ["train/r_0.png", "train/r_1.png", "train/r_2.png", "train/r_3.png",
                               "test/r_0.png", "test/r_1.png"]
        assert scene.split == {"train": scene.names[:4], "test": scene.names[4:]}
        np.testing.assert_allclose(scene.c2w, c2w, atol=1e-12)
        assert scene.cameras[0].fx == pytest.approx(12 / math.tan(0.345))


def test_llff_round_trip_and_size_from_the_file(tmp_path):
    c2w = ring_c2w(5)
    np.save(tmp_path / "poses_bounds.npy", llff_rows(c2w, 300, 400, 350.0, near=0.5, far=7.0))
    for k in range(5):
        write_png(tmp_path / "images_4" / f"img{k}.png", 100, 75)
    scene = I.read_llff(tmp_path)
    assert scene.names == [f"images_4/img{k}.png" for k in range(5)]
    np.testing.assert_allclose(scene.c2w, c2w, atol=1e-12)
    assert scene.cameras[0] == I.Camera(400, 300, 350.0, 350.0, 200.0, 150.0)
    np.testing.assert_allclose(scene.near_far, [[0.5, 7.0]] * 5)
    with pytest.raises(ValueError, match="5 rows but there are 4 images"):
        I.read_llff(tmp_path / "poses_bounds.npy", names=["a", "b", "c", "d"])


# ---------------------------------------------------------------- conventions on a known projection


def _known_camera():
    """A camera looking at the origin from (3, -4, 2) and a point whose pixel is known from the
    construction: 4 ahead, 1 right and 0.5 down of the camera -> (cx + f/4, cy + f/8)."""
    eye = np.array([3.0, -4.0, 2.0])
    T = look_at_c2w(eye, [0.0, 0.0, 0.0])
    right, down, fwd = T[:3, 0], T[:3, 1], T[:3, 2]
    point = eye + 4 * fwd + 1.0 * right + 0.5 * down
    f, w, h = 100.0, 200, 160
    return T, point, f, w, h, np.array([w / 2 + f / 4, h / 2 + f / 8])


@pytest.mark.parametrize("fmt", ["transforms", "colmap-txt", "llff"])
def test_each_convention_projects_a_known_point_to_its_pixel(tmp_path, fmt):
    T, point, f, w, h, pixel = _known_camera()
    right, down, fwd, eye = T[:3, 0], T[:3, 1], T[:3, 2], T[:3, 3]
    if fmt == "transforms":  # OpenGL: x right, y up, z back, written by hand from the axes
        gl = np.eye(4)
        gl[:3, 0], gl[:3, 1], gl[:3, 2], gl[:3, 3] = right, -down, -fwd, eye
        (tmp_path / "transforms.json").write_text(json.dumps({
            "w": w, "h": h, "fl_x": f, "fl_y": f, "frames": [{"file_path": "a.png", "transform_matrix": gl.tolist()}]}))
        scene = I.read_transforms(tmp_path / "transforms.json")
    elif fmt == "colmap-txt":  # world-to-camera rows are the camera axes; quaternion from scipy-free math
        R = np.stack([right, down, fwd])
        t = -R @ eye
        qw = math.sqrt(max(0.0, 1 + np.trace(R))) / 2
        q = [qw, (R[2, 1] - R[1, 2]) / (4 * qw), (R[0, 2] - R[2, 0]) / (4 * qw), (R[1, 0] - R[0, 1]) / (4 * qw)]
        (tmp_path / "cameras.txt").write_text(f"# a comment\n1 SIMPLE_PINHOLE {w} {h} {f} {w / 2} {h / 2}\n")
        (tmp_path / "images.txt").write_text(f"1 {' '.join(repr(float(x)) for x in q)} {' '.join(repr(float(x)) for x in t)} 1 a.png\n\n")
        scene = I.read_colmap(tmp_path)
    else:
        np.save(tmp_path / "poses_bounds.npy", np.r_[np.stack([down, right, -fwd, eye, [h, w, f]], 1).ravel(), 1, 9][None])
        scene = I.read_llff(tmp_path / "poses_bounds.npy", names=["a.png"])
    cam = scene.cameras[0]
    uv = C.project(cam.intrinsics().K(), C.c2w_to_w2c(scene.c2w[0]), point[None])[0]
    np.testing.assert_allclose(uv, pixel, atol=1e-9)


# ---------------------------------------------------------------- hostile paths, malformed files


def _one_frame(path: str) -> dict:
    return {"w": 10, "h": 10, "fl_x": 10.0, "frames": [{"file_path": path, "transform_matrix": np.eye(4).tolist()}]}


def test_image_paths_may_not_leave_the_scene_folder(tmp_path):
    root = tmp_path / "scene"
    root.mkdir()
    outside = tmp_path / "secret.png"
    write_png(outside)
    (root / "link.png").symlink_to(outside)
    (root / "sub").mkdir()
    (root / "dirlink").symlink_to(tmp_path)
    for bad, why in (("../secret.png", "outside"), (str(outside), "outside"), ("sub/../../secret.png", "outside"),
                     ("link.png", "symlink"), ("dirlink/secret.png", "symlink"), ("", "non-empty")):
        (root / "transforms.json").write_text(json.dumps(_one_frame(bad)))
        with pytest.raises(ValueError, match=why) as exc:
            I.read_transforms(root / "transforms.json")
        assert "transforms.json" in str(exc.value)
    (root / "transforms.json").write_text(json.dumps(_one_frame(str(root / "sub" / "ok.png"))))
    assert I.read_transforms(root / "transforms.json").names == ["sub/ok.png"]  # absolute but inside
    (root / "transforms.json").write_text(json.dumps(_one_frame("sub\\win.png")))
    assert I.read_transforms(root / "transforms.json").names == ["sub/win.png"]
    model = root / "sparse" / "0"
    model.mkdir(parents=True)
    (model / "cameras.txt").write_text("1 PINHOLE 10 10 10 10 5 5\n")
    (model / "images.txt").write_text("1 1 0 0 0 0 0 0 1 ../../x.png\n\n")
    with pytest.raises(ValueError, match="images.txt, image 1: image path '../../x.png' leads outside"):
        I.read_colmap(root)


GOOD = {"w": 10, "h": 8, "fl_x": 9.0, "frames": [{"file_path": "a.png", "transform_matrix": np.eye(4).tolist()}]}


def _with(path: tuple, value) -> dict:
    doc = json.loads(json.dumps(GOOD))
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


SCALED = (np.eye(4) * [2, 2, 2, 1]).tolist()
MIRRORED = np.diag([1.0, 1, -1, 1]).tolist()


@pytest.mark.parametrize("doc, match", [
    ([1, 2], "JSON object"),
    (_with(("frames",), KeyError), "non-empty 'frames'"),
    (_with(("frames",), {"a": 1}), "non-empty 'frames'"),
    (_with(("frames", 0), "a.png"), r"frames\[0\]: must be an object"),
    (_with(("frames", 0, "file_path"), KeyError), "needs file_path and transform_matrix"),
    (_with(("frames", 0, "file_path"), 7), "non-empty string"),
    (_with(("frames", 0, "transform_matrix"), np.eye(3).tolist()), r"shape \(4, 4\) or \(3, 4\)"),
    (_with(("frames", 0, "transform_matrix"), [[1, 0, 0, "0"]] * 4), "matrix of numbers"),
    (_with(("frames", 0, "transform_matrix"), [[True, 0, 0, 0]] * 4), "matrix of numbers"),
    (_with(("frames", 0, "transform_matrix"), [[float("nan")] * 4] * 4), "non-finite"),
    (_with(("frames", 0, "transform_matrix"), SCALED), "not a rigid transform"),
    (_with(("frames", 0, "transform_matrix"), MIRRORED), "not a rigid transform"),
    (_with(("fl_x",), KeyError), "needs a focal length"),
    (_with(("fl_x",), -3), "fl_x must be > 0"),
    (_with(("fl_x",), "9"), "fl_x must be a number"),
    (_with(("h",), KeyError), "both w and h"),
    (_with(("w",), 10.5), "whole number of pixels"),
    (_with(("w",), True), "w must be a number"),
    (_with(("camera_model",), "EQUIRECTANGULAR"), "not supported"),
    (_with(("k4",), 0.1), "set camera_model: OPENCV_FISHEYE"),
    (_with(("camera_model",), "OPENCV_FISHEYE") | {"p1": 0.1}, "OPENCV_FISHEYE has no p1, p2"),
    (_with(("aabb_scale",), float("inf")), "aabb_scale must be finite"),
    (_with(("applied_transform",), [1, 2]), "applied_transform must have shape"),
    (_with(("train_filenames",), ["b.png"]) | {"test_filenames": []}, "without a frame"),
])
def test_malformed_transforms_are_clear_errors(tmp_path, doc, match):
    (tmp_path / "transforms.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match) as exc:
        I.read_transforms(tmp_path / "transforms.json")
    assert str(tmp_path / "transforms.json") in str(exc.value)


def test_unreadable_json_and_missing_files(tmp_path):
    (tmp_path / "transforms.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read JSON"):
        I.read_transforms(tmp_path / "transforms.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither transforms.json nor transforms_train.json"):
        I.read_transforms(tmp_path / "empty")
    with pytest.raises(ValueError, match="camera file not found"):
        I.read_transforms(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no COLMAP model"):
        I.read_colmap(tmp_path)
    with pytest.raises(ValueError, match="cannot read as a .npy"):
        I.read_llff(tmp_path / "poses_bounds.npy", names=["a"])


@pytest.mark.parametrize("name, text, match", [
    ("cameras", "1 FOV 10 10 1 1 1 1 0.5\n", "FOV is not supported"),
    ("cameras", "1 THIS_MODEL 10 10 1 1 1\n", "unknown camera model"),
    ("cameras", "1 PINHOLE 10 10 1 1 1\n", "takes 4 parameters, got 3"),
    ("cameras", "1 PINHOLE 10 -10 1 1 1 1\n", "height must be > 0"),
    ("cameras", "1 PINHOLE 10 10 nan 1 1 1\n", "non-finite"),
    ("cameras", "1 PINHOLE 10 10 0 1 1 1\n", r"image 1 \(a.png\) uses camera 1, whose focal lengths must be > 0"),
    ("cameras", "1 SIMPLE_PINHOLE 10 10 -4 1 1\n", r"image 1 \(a.png\) uses camera 1, whose focal lengths"),
    ("cameras", "1 PINHOLE 10 10 1 1 1 1\n1 PINHOLE 10 10 1 1 1 1\n", "camera id 1 appears twice"),
    ("cameras", "x PINHOLE 10 10 1 1 1 1\n", "camera id must be an integer"),
    ("images", "1 1 0 0 0 0 0 0 1\n\n", "expected IMAGE_ID"),
    ("images", "1 0 0 0 0 0 0 0 1 a.png\n\n", "no direction"),
    ("images", "1 1 0 0 0 0 0 inf 1 a.png\n\n", "non-finite"),
    ("images", "1 1 0 0 0 0 0 0 1 a.png\n1 2\n", "triples"),
    ("images", "1 1 0 0 0 0 0 0 1 a.png\n\n1 1 0 0 0 0 0 0 1 b.png\n\n", "image id 1 appears twice"),
    ("images", "1 1 0 0 0 0 0 0 9 a.png\n\n", r"image 1 \(a.png\) uses camera 9, which cameras.txt lacks"),
    ("points3D", "1 0 0 0 255 0 0 0.5 1\n", "IMAGE_ID POINT2D_IDX"),
    ("points3D", "1 0 0 0 256 0 0 0.5\n", "colour must be 0..255"),
    ("points3D", "1 0 0 0 1 2 3 0.5 1 -2\n", "track entry must be >= 0"),
])
def test_malformed_colmap_text_is_a_clear_error(tmp_path, name, text, match):
    files = {"cameras": "1 PINHOLE 10 10 5 5 5 5\n", "images": "1 1 0 0 0 0 0 0 1 a.png\n\n", "points3D": ""}
    files[name] = text
    for k, v in files.items():
        (tmp_path / f"{k}.txt").write_text(v)
    with pytest.raises(ValueError, match=match) as exc:
        I.read_colmap(tmp_path)
    assert str(tmp_path) in str(exc.value) and ".txt" in str(exc.value)


def test_truncated_or_padded_colmap_binary_is_a_clear_error(tmp_path):
    write_colmap(tmp_path / "m", ["a.png", "b.png"], ring_c2w(2), [("PINHOLE", 8, 8, [5.0, 5, 4, 4])],
                 [([0, 0, 1], [1, 2, 3])])
    for f in ("cameras.bin", "images.bin", "points3D.bin"):
        good = (tmp_path / "m" / f).read_bytes()
        for bad, match in ((good[:-3], "ends early|bytes can hold"), (good + b"\0", "unexpected bytes"),
                           (struct.pack("<Q", 2**60) + good[8:], "more than its")):
            shutil.copytree(tmp_path / "m", tmp_path / "x", dirs_exist_ok=True)
            (tmp_path / "x" / f).write_bytes(bad)
            with pytest.raises(ValueError, match=match) as exc:
                I.read_colmap(tmp_path / "x")
            assert f in str(exc.value)


@pytest.mark.parametrize("arr, match", [
    (np.zeros((3, 16)), "N x 17"),
    (np.zeros((0, 17)), "N x 17"),
    (np.array([["a"] * 17]), "N x 17"),
    (np.full((1, 17), np.nan), "non-finite"),
    (np.r_[(np.eye(3, 5) * 2).ravel(), 1, 2][None], "not a rigid transform"),
])
def test_malformed_llff_is_a_clear_error(tmp_path, arr, match):
    np.save(tmp_path / "poses_bounds.npy", arr)
    with pytest.raises(ValueError, match=match) as exc:
        I.read_llff(tmp_path / "poses_bounds.npy", names=["a"] * len(arr))
    assert "poses_bounds.npy" in str(exc.value)


def test_llff_bounds_and_sizes_checked(tmp_path):
    rows = llff_rows(ring_c2w(1), 30, 40, 30.0)
    for (index, value), match in ((((0, 16), 0.5), "0 < near < far"), (((0, 4), 0.0), "H must be > 0"),
                                  (((0, 9), 40.5), "whole number")):
        a = rows.copy()
        a[index] = value
        np.save(tmp_path / "poses_bounds.npy", a)
        with pytest.raises(ValueError, match=match):
            I.read_llff(tmp_path / "poses_bounds.npy", names=["a"])


# ---------------------------------------------------------------- fuzzing

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
                    max_leaves=20)
KEYS = st.sampled_from(list(I.CAMERA_KEYS) + ["frames", "file_path", "transform_matrix", "aabb_scale",
                                              "applied_transform", "train_filenames", "test_filenames"])
FUZZ_ROOT = Path(tempfile.gettempdir()) / "rayforge-fuzz-no-such-folder"  # images never exist there


def _parses_or_value_error(fn, *args):
    try:
        fn(*args)
    except ValueError:
        pass


@FUZZ
@given(doc=JSON)
def test_fuzz_transforms_arbitrary_json(doc):
    _parses_or_value_error(I.parse_transforms, doc, "fuzz.json", FUZZ_ROOT)


@FUZZ
@given(edits=st.lists(st.tuples(st.booleans(), KEYS, JSON), min_size=1, max_size=4),
       matrix=st.lists(st.lists(st.floats(), min_size=0, max_size=5), max_size=5))
def test_fuzz_transforms_mutated_document(edits, matrix):
    doc = json.loads(json.dumps(GOOD))
    frame = doc["frames"][0]
    if edits[0][0]:
        frame["transform_matrix"] = matrix
    for in_frame, key, value in edits:
        (frame if in_frame else doc)[key] = value
    _parses_or_value_error(I.parse_transforms, doc, "fuzz.json", FUZZ_ROOT)


VALID_TXT = {
    I.parse_cameras_txt: "# c\n1 SIMPLE_RADIAL 64 48 50 32 24 0.01\n2 OPENCV 64 48 50 51 32 24 0.01 0 0 0\n",
    I.parse_images_txt: "# i\n1 1 0 0 0 0 0 0 1 a b.png\n5 6 -1 3 4 5 1 2 2 c.png\n1 2 -1 3.5 4 7\n",
    I.parse_points3d_txt: "# p\n1 0.5 1 2 10 20 30 0.7 1 0 5 1\n7 1 1 1 0 0 255 -1\n",
}
TOKEN = st.sampled_from(["", "0", "-1", "1e308", "1e999", "nan", "inf", "x", "#", "255", "256", "PINHOLE",
                         "FOV", "3.5", "\t", "\n", "  ", "0x1", "1_0", "٣"])


@pytest.mark.parametrize("parser", list(VALID_TXT), ids=lambda f: f.__name__)
@FUZZ
@given(text=st.text(max_size=200))
def test_fuzz_colmap_text_arbitrary(parser, text):
    _parses_or_value_error(parser, text, "fuzz.txt")


@pytest.mark.parametrize("parser", list(VALID_TXT), ids=lambda f: f.__name__)
@FUZZ
@given(data=st.data())
def test_fuzz_colmap_text_mutated(parser, data):
    tokens = VALID_TXT[parser].replace("\n", " \n ").split(" ")
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(tokens) - 1))
        op = data.draw(st.sampled_from(["replace", "delete", "insert"]))
        if op == "delete":
            tokens.pop(i)
        elif op == "insert":
            tokens.insert(i, data.draw(TOKEN))
        else:
            tokens[i] = data.draw(TOKEN)
        if not tokens:
            tokens = [""]
    _parses_or_value_error(parser, " ".join(tokens), "fuzz.txt")


@pytest.fixture(scope="module")
def colmap_bin(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("bin")
    write_colmap(root, ["a.png", "b.png"], ring_c2w(2), [("OPENCV", 8, 8, [5.0, 5, 4, 4, 0.1, 0, 0, 0])],
                 [([0, 0, 1], [1, 2, 3]), ([1, 0, 1], [4, 5, 6])])
    return {f: (root / f).read_bytes() for f in ("cameras.bin", "images.bin", "points3D.bin")}


@settings(max_examples=100, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_colmap_binary_mutated(colmap_bin, data):
    f = data.draw(st.sampled_from(sorted(colmap_bin)))
    raw = bytearray(colmap_bin[f])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))]
    parser = {"cameras.bin": I.parse_cameras_bin, "images.bin": I.parse_images_bin,
              "points3D.bin": I.parse_points3d_bin}[f]
    _parses_or_value_error(parser, bytes(raw), f)


# ---------------------------------------------------------------- params


def test_params_accept_the_import_sources_with_a_camera_file():
    p = P.load_section(poses.PosesParams, "poses", data={"poses": {"source": "llff", "camera_file": "x.npy"}})
    assert p.source == "llff" and p.camera_file == "x.npy"
    for source in ("colmap", "llff"):  # transforms may take the Blender folder the ingest recognised
        with pytest.raises(P.ParamsError, match=r"poses\.camera_file: must name the camera file"):
            P.load_section(poses.PosesParams, "poses", data={"poses": {"source": source}})
    default = P.load_section(poses.PosesParams, "poses", Path(__file__).resolve().parents[1] / "params.yaml")
    assert default.camera_file == ""


# ---------------------------------------------------------------- the poses stage, end to end


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A tiny ingest folder of ray-cast views with ground-truth cameras (tests/_synthetic.py)."""
    import _synthetic

    root = tmp_path_factory.mktemp("import_scene")
    gt = _synthetic.make_ingest(root / "ingest", views=9, rings=1, width=96, height=72)
    w2c = np.stack([np.array(f["world_to_camera"]) for f in gt["frames"]])
    return root / "ingest", gt, C.w2c_to_c2w(w2c), [f["file"] for f in gt["frames"]]


OUTS = ["images", "points3D.ply", "sparse", "split.json", "transforms.json"]


def _run(tmp_path, ingest, source, camera_file, **kw):
    p = poses.PosesParams(source=source, camera_file=str(camera_file), **kw)
    return poses.run(p, ingest, tmp_path / "poses", tmp_path / "metrics" / "poses.json")


def _check_outs(out: Path, m: dict, gt: dict, names: list[str]):
    import open3d as o3d
    import pycolmap

    assert sorted(p.name for p in out.iterdir()) == OUTS
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(names)
    rec = pycolmap.Reconstruction(out / "sparse" / "0")
    assert rec.num_reg_images() == len(names)
    assert {c.model_name for c in rec.cameras.values()} == {"PINHOLE"}
    intrs, files, c2w, doc = C.read_transforms(out / "transforms.json")
    assert files == [f"images/{n}" for n in sorted(names)] and doc["camera_model"] == "PINHOLE"
    for f, intr in zip(files, intrs):  # every image has its camera's size
        with Image.open(out / f) as im:
            assert im.size == (intr.width, intr.height)
    assert doc["ply_file_path"] == "points3D.ply" and np.allclose(doc["applied_transform"], doc["normalization"][:3])
    np.testing.assert_allclose(c2w[:, :3, 3].mean(0), 0, atol=1e-9)
    assert np.linalg.norm(c2w[:, :3, 3], axis=1).max() == pytest.approx(1.0)
    aabb = np.array(doc["aabb"])
    assert aabb.shape == (2, 3) and (aabb[1] > aabb[0]).all()
    pcd = o3d.io.read_point_cloud(str(out / "points3D.ply"))
    assert len(pcd.points) == m["num_points"]
    split = json.loads((out / "split.json").read_text())
    assert sorted(split["train"] + split["test"]) == sorted(names)
    # nerfstudio's split keys say the same (it evaluates on "val" while training: the test views)
    assert doc["train_filenames"] == [f"images/{n}" for n in split["train"]]
    assert doc["val_filenames"] == doc["test_filenames"] == [f"images/{n}" for n in split["test"]]
    assert [f["colmap_im_id"] for f in doc["frames"]] == list(range(1, len(names) + 1))
    assert m["num_train"] == len(split["train"]) and m["num_test"] == len(split["test"])
    if m.get("center_error_max") is not None:  # cameras straight from the ground truth: exact
        assert m["center_error_max"] < 1e-6 and m["rotation_error_max_deg"] < 1e-4, m
    # the scene (its centre) lies inside the box
    centre = C.apply_similarity_to_points(np.array(doc["normalization"]), np.array(gt["scene"]["center"])[None])[0]
    assert ((centre > aabb[0]) & (centre < aabb[1])).all(), (centre, aabb)
    return doc, split


@pytest.mark.parametrize("text", [False, True], ids=["bin", "txt"])
def test_stage_imports_colmap(synth, tmp_path, text):
    ingest, gt, c2w, names = synth
    k = gt["intrinsics"]
    # the model was made at twice the ingested size: intrinsics are rescaled on import
    cams = [("PINHOLE", 2 * k["width"], 2 * k["height"], [2 * k["fx"], 2 * k["fy"], 2 * k["cx"], 2 * k["cy"]])]
    pts = [(p, [200, 100, 50]) for p in np.random.default_rng(0).uniform(-0.5, 0.5, (20, 3)) + [0, 0, 0.3]]
    write_colmap(tmp_path / "scene" / "sparse" / "0", names, c2w, cams, pts, text=text)
    m = _run(tmp_path, ingest, "colmap", tmp_path / "scene")
    assert m["source"] == "colmap" and m["num_registered"] == 9 and m["num_points"] == 20
    assert m["aabb_rule"] == "sparse points" and m["split"] == "every 8th" and m["undistorted"] is False
    doc, split = _check_outs(tmp_path / "poses", m, gt, names)
    assert (doc["w"], doc["h"], doc["fl_x"]) == (k["width"], k["height"], pytest.approx(k["fx"]))
    assert split["test"] == ["view_000.png", "view_008.png"]
    metrics_file = json.loads((tmp_path / "metrics" / "poses.full.json").read_text())  # the full record
    assert metrics_file["source"] == "colmap" and metrics_file["num_images"] == 9
    headline = json.loads((tmp_path / "metrics" / "poses.json").read_text())  # what `dvc metrics show` shows
    assert set(headline) == {"num_registered", "center_error_mean", "rotation_error_mean_deg"}  # no reprojection here


def test_stage_imports_distorted_transforms_and_lists_images_without_camera(synth, tmp_path):
    ingest, gt, c2w, names = synth
    k = gt["intrinsics"]
    frames = [{"file_path": f"images/{n}", "transform_matrix": C.opencv_to_opengl(T).tolist()}
              for n, T in zip(names, c2w)][:-1]  # the last view has no camera
    (tmp_path / "cams").mkdir()
    (tmp_path / "cams" / "transforms.json").write_text(json.dumps({
        "w": k["width"], "h": k["height"], "fl_x": k["fx"], "fl_y": k["fy"], "cx": k["cx"], "cy": k["cy"],
        "k1": -0.05, "k2": 0.01, "p1": 0.001, "p2": 0.0, "aabb_scale": 1, "frames": frames}))
    m = _run(tmp_path, ingest, "transforms", tmp_path / "cams" / "transforms.json")
    assert m["num_registered"] == 8 and m["registered_fraction"] == pytest.approx(8 / 9)
    assert m["unregistered"] == [{"file": names[-1], "reason": "no camera in transforms.json"}]
    assert m["undistorted"] and m["source_camera_model"] == "OPENCV" and m["num_points"] == 0
    assert m["aabb_rule"] == "camera focus"
    doc, _ = _check_outs(tmp_path / "poses", m, gt, names[:-1])
    assert doc["source_layout"] == "instant-ngp" and doc["aabb_scale"] == 1
    with pytest.raises(ValueError, match="cameras for 8 of 9 ingested images"):
        _run(tmp_path, ingest, "transforms", tmp_path / "cams" / "transforms.json", min_registered_fraction=0.95)
    assert not (tmp_path / "poses").exists() and not (tmp_path / "metrics" / "poses.json").exists()
    assert not (tmp_path / "metrics" / "poses.full.json").exists()


def test_stage_imports_llff_in_sorted_order(synth, tmp_path):
    ingest, gt, c2w, names = synth
    k = gt["intrinsics"]
    np.save(tmp_path / "poses_bounds.npy", llff_rows(c2w, 4 * k["height"], 4 * k["width"], 4 * k["fx"], 2.0, 4.5))
    m = _run(tmp_path, ingest, "llff", tmp_path / "poses_bounds.npy")
    assert m["num_registered"] == 9 and m["aabb_rule"] == "near/far frusta"
    doc, _ = _check_outs(tmp_path / "poses", m, gt, names)
    assert doc["fl_x"] == pytest.approx(k["fx"])
    np.save(tmp_path / "poses_bounds.npy", llff_rows(c2w[:5], k["height"], k["width"], k["fx"]))
    with pytest.raises(ValueError, match="5 rows but there are 9 images"):
        _run(tmp_path, ingest, "llff", tmp_path / "poses_bounds.npy")


def test_stage_imports_blender_layout_through_recursive_ingest(synth, tmp_path):
    """RGBA train/test views -> ingest (recursive, alpha on white) -> the given split is kept."""
    from stages import ingest as ingest_stage

    src, gt, c2w, names = synth
    k = gt["intrinsics"]
    photos = tmp_path / "lego"
    for part, idx in (("train", range(6)), ("test", range(6, 9))):
        frames = []
        for i in idx:
            rgb = np.asarray(Image.open(src / "images" / names[i]))
            alpha = np.full(rgb.shape[:2], 255, np.uint8)
            alpha[:, :10] = 0  # a transparent strip: white after ingest
            (photos / part).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(photos / part / f"r_{i}.png")
            frames.append({"file_path": f"./{part}/r_{i}", "transform_matrix": C.opencv_to_opengl(c2w[i]).tolist()})
        angle = 2 * math.atan(k["width"] / (2 * k["fx"]))
        (photos / f"transforms_{part}.json").write_text(json.dumps({"camera_angle_x": angle, "frames": frames}))
    ingest_stage.run(ingest_stage.IngestParams(recursive=True, alpha="white"), photos, tmp_path / "ingest", log=QUIET)
    m = _run(tmp_path, tmp_path / "ingest", "transforms", photos)
    assert m["split"] == "given" and m["background"] == "white" and m["layout"] == "blender"
    out_names = [f"train_r_{i}.png" for i in range(6)] + [f"test_r_{i}.png" for i in range(6, 9)]
    doc, split = _check_outs(tmp_path / "poses", m, gt, out_names)
    assert split == {"train": sorted(out_names[:6]), "test": sorted(out_names[6:])}
    assert doc["background"] == "white"
    px = np.asarray(Image.open(tmp_path / "poses" / "images" / "train_r_0.png"))
    assert (px[:, :10] == 255).all()
    np.testing.assert_allclose(C.read_transforms(tmp_path / "poses" / "transforms.json")[0][0].fx, k["fx"], rtol=1e-6)


def test_flat_ingest_of_a_blender_layout_is_ambiguous(tmp_path):
    root = _blender_folder(tmp_path / "lego", ring_c2w(6), 4)
    ing = tmp_path / "ingest"
    (ing / "images").mkdir(parents=True)
    entries = []
    for k in range(4):
        shutil.copy(root / "train" / f"r_{k}.png", ing / "images" / f"r_{k}.png")
        entries.append({"file": f"images/r_{k}.png", "source": f"r_{k}.png", "width": 24, "height": 24})
    (ing / "manifest.json").write_text(json.dumps({"images": entries, "skipped": []}))
    with pytest.raises(ValueError, match="matches 2 images .*ingest.recursive: true"):
        _run(tmp_path, ing, "transforms", root)


# ---------------------------------------------------------------- the shared data sets


def _ingest(tmp_path: Path, photos: Path, **kw) -> Path:
    from stages import ingest as ingest_stage

    ingest_stage.run(ingest_stage.IngestParams(**kw), photos, tmp_path / "ingest", log=QUIET)
    return tmp_path / "ingest"


def test_shared_fox_transforms(shared_data, tmp_path):
    ing = _ingest(tmp_path, shared_data / "fox" / "images", max_size=96)
    m = _run(tmp_path, ing, "transforms", shared_data / "fox" / "transforms.json")
    assert m["num_images"] == m["num_registered"] == 50 and m["undistorted"] and m["layout"] == "instant-ngp"
    assert (m["num_train"], m["num_test"]) == (43, 7)
    doc = json.loads((tmp_path / "poses" / "transforms.json").read_text())
    assert doc["aabb_scale"] == 4 and doc["h"] > doc["w"]  # portrait


def test_shared_lego_blender(shared_data, tmp_path):
    ing = _ingest(tmp_path, shared_data / "lego", max_size=50, recursive=True, alpha="white")
    m = _run(tmp_path, ing, "transforms", shared_data / "lego")
    assert m["num_registered"] == 125 and (m["num_train"], m["num_test"]) == (100, 25)
    assert m["split"] == "given" and m["background"] == "white"
    doc = json.loads((tmp_path / "poses" / "transforms.json").read_text())
    assert doc["fl_x"] == pytest.approx(0.5 * 50 / math.tan(0.5 * 0.6911112070083618))
    # the object (at the Blender world origin) is inside the box
    origin = np.array(doc["normalization"])[:3, 3]
    assert (np.abs(origin) < np.abs(np.array(doc["aabb"])).max()).all()


def test_shared_fern_llff_and_its_colmap_model_agree(shared_data, tmp_path):
    fern = shared_data / "fern"
    ing = _ingest(tmp_path / "a", fern / "images_8")
    m = _run(tmp_path / "a", ing, "llff", fern / "poses_bounds.npy")
    assert m["num_registered"] == 20 and (m["num_train"], m["num_test"]) == (17, 3)
    # the COLMAP model names IMG_4026.JPG ...: the k-th image is image{k:03d}.png (fern/SOURCE.md)
    photos = tmp_path / "photos"
    photos.mkdir()
    for k in range(20):
        shutil.copy(fern / "images_8" / f"image{k:03d}.png", photos / f"IMG_{4026 + k}.JPG")
    ing_b = _ingest(tmp_path / "b", photos)
    mb = _run(tmp_path / "b", ing_b, "colmap", fern)
    assert mb["num_registered"] == 20 and mb["num_points"] == 10091 and mb["undistorted"]
    assert mb["source_camera_model"] == "OPENCV"  # SIMPLE_RADIAL, in its OPENCV form
    a = C.read_transforms(tmp_path / "a" / "poses" / "transforms.json")
    b = C.read_transforms(tmp_path / "b" / "poses" / "transforms.json")
    np.testing.assert_allclose(a[2], b[2], atol=1e-9)  # same poses, same normalization
    assert a[0][0].fx == pytest.approx(3260.526 / 8, rel=1e-5)
    assert abs(b[0][0].fx - a[0][0].fx) / a[0][0].fx < 0.02  # undistorted: nearly the same focal length


# ---------------------------------------------------------------- one camera per image


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Portrait and landscape views, each with its own camera (tests/_synthetic.py), and a COLMAP
    model of them with one PINHOLE camera per image, as COLMAP writes unless told otherwise."""
    import _synthetic

    root = tmp_path_factory.mktemp("mixed")
    frames = _synthetic.make_mixed_ingest(root / "ingest", views=8)
    cams = [("PINHOLE", f["width"], f["height"], [f["K"][0, 0], f["K"][1, 1], f["K"][0, 2], f["K"][1, 2]])
            for f in frames]
    pts = [(p, [200, 100, 50]) for p in np.random.default_rng(0).uniform(-0.5, 0.5, (12, 3)) + [0, 0, 0.3]]
    write_colmap(root / "model" / "sparse" / "0", [f["file"] for f in frames],
                 np.stack([C.w2c_to_c2w(f["w2c"]) for f in frames]), cams, pts)
    return root, frames


def test_stage_imports_one_colmap_camera_per_image_in_both_orientations(mixed, tmp_path):
    import pycolmap

    root, frames = mixed
    m = _run(tmp_path, root / "ingest", "colmap", root / "model")
    assert m["num_registered"] == 8 and m["num_cameras"] == 8 and m["undistorted"] is False
    intrs, files, c2w, doc = C.read_transforms(tmp_path / "poses" / "transforms.json")
    assert files == [f"images/{f['file']}" for f in frames]
    assert "fl_x" not in doc and all("fl_x" in fr for fr in doc["frames"])  # nerfstudio's per-frame layout
    for f, intr in zip(frames, intrs):
        assert (intr.width, intr.height) == (f["width"], f["height"])
        np.testing.assert_allclose([intr.fx, intr.fy, intr.cx, intr.cy],
                                   [f["K"][0, 0], f["K"][1, 1], f["K"][0, 2], f["K"][1, 2]], rtol=1e-12)
        with Image.open(tmp_path / "poses" / "images" / f["file"]) as im:
            assert im.size == (intr.width, intr.height)
    rec = pycolmap.Reconstruction(tmp_path / "poses" / "sparse" / "0")
    assert rec.num_cameras() == 8
    # the poses are the ground truth, normalized: every camera projects its scene point where it did
    S = np.array(doc["normalization"])
    x = np.array([0.1, -0.2, 0.4])
    for f, intr, T in zip(frames, intrs, c2w):
        np.testing.assert_allclose(C.project(intr.K(), C.c2w_to_w2c(T), C.apply_similarity_to_points(S, x[None])),
                                   C.project(f["K"], f["w2c"], x[None]), atol=1e-8)


def test_imported_outs_import_again_to_the_same_cameras(mixed, tmp_path):
    """Round trips: the poses out's transforms.json and its sparse/0 read back by the importers
    give the cameras and (normalized again, so up to that similarity) the poses the out holds."""
    root, _ = mixed
    _run(tmp_path / "a", root / "ingest", "colmap", root / "model")
    out = tmp_path / "a" / "poses"
    intrs, _, c2w, _ = C.read_transforms(out / "transforms.json")
    via_json = I.read_transforms(out / "transforms.json")
    assert via_json.layout == "nerfstudio" and [c.intrinsics() for c in via_json.cameras] == intrs
    np.testing.assert_allclose(via_json.c2w, c2w, atol=1e-12)
    via_colmap = I.read_colmap(out)  # sparse/0 (the source's world frame), images/ beside it
    assert [c.intrinsics() for c in via_colmap.cameras] == intrs
    # ply_file_path's points are the model's, mapped by applied_transform (nerfstudio's meaning)
    A = np.array(json.loads((out / "transforms.json").read_text())["applied_transform"])
    assert len(via_json.points_xyz) == len(via_colmap.points_xyz) == 12
    np.testing.assert_allclose(via_json.points_xyz, via_colmap.points_xyz @ A[:, :3].T + A[:, 3], atol=1e-9)
    for source, folder in (("transforms", out / "transforms.json"), ("colmap", out)):
        m = _run(tmp_path / source, root / "ingest", source, folder)
        again, _, c2w2, _ = C.read_transforms(tmp_path / source / "poses" / "transforms.json")
        assert m["num_cameras"] == 8 and again == intrs
        np.testing.assert_allclose(c2w2, c2w, atol=1e-9)  # normalizing a normalized frame changes nothing


def test_an_image_larger_than_its_camera_is_an_error_naming_it(mixed, tmp_path):
    root, frames = mixed
    small = [("PINHOLE", f["width"] // 2, f["height"] // 2, [f["K"][0, 0] / 2, f["K"][1, 1] / 2, f["K"][0, 2] / 2,
                                                             f["K"][1, 2] / 2]) for f in frames]
    small[3] = ("PINHOLE", frames[3]["width"], frames[3]["height"], [80.0, 80.0, 36.0, 48.0])
    write_colmap(tmp_path / "small" / "sparse" / "0", [f["file"] for f in frames],
                 np.stack([C.w2c_to_c2w(f["w2c"]) for f in frames]), small)
    with pytest.raises(ValueError, match=r"image view_000.png \(ingested from view_000.png as 96x72\) is larger "
                                         r"than its camera, 48x36"):
        _run(tmp_path, root / "ingest", "colmap", tmp_path / "small")
    assert not (tmp_path / "poses").exists()


def test_distorted_per_image_models_are_undistorted_image_by_image(tmp_path):
    """Four images, four lens models: a dot drawn where each distorted camera sees a point lands,
    after the import's undistortion, where that image's own pinhole camera projects it; the RGBA
    image keeps its alpha channel (ingest.alpha: keep), warped the same way."""
    import pycolmap

    models = [("SIMPLE_RADIAL", [60.0, 40.0, 30.0, -0.12]), ("RADIAL", [62.0, 40.0, 30.0, -0.1, 0.02]),
              ("OPENCV", [61.0, 59.0, 40.5, 29.5, -0.1, 0.01, 0.002, -0.001]),
              ("OPENCV_FISHEYE", [45.0, 45.0, 40.0, 30.0, 0.05, -0.01, 0.0, 0.0])]
    points_cam = np.array([[0.35, 0.25, 1.0], [-0.3, 0.2, 1.0], [0.0, 0.0, 1.0], [0.3, -0.28, 1.0]])
    c2w = ring_c2w(4)
    ing = tmp_path / "ingest"
    (ing / "images").mkdir(parents=True)
    entries, names = [], [f"d{k}.png" for k in range(4)]
    for k, (model, params) in enumerate(models):
        cam = pycolmap.Camera(camera_id=1, model=model, width=80, height=60, params=params)
        img = np.zeros((60, 80, 4 if k == 2 else 3), np.uint8)
        if k == 2:
            img[..., 3] = 255
            img[:, :20, 3] = 0  # a transparent strip on the left
        for uv in cam.img_from_cam(points_cam):
            c, r = int(uv[0]), int(uv[1])  # the pixel the point falls in (its centre at +0.5)
            img[r - 1:r + 2, c - 1:c + 2, :3] = 255
        Image.fromarray(img).save(ing / "images" / names[k])
        entries.append({"file": f"images/{names[k]}", "source": names[k], "width": 80, "height": 60,
                        "notes": ["alpha kept"] if k == 2 else []})
    (ing / "manifest.json").write_text(json.dumps({"images": entries, "skipped": []}))
    write_colmap(tmp_path / "model", names, c2w, [(m, 80, 60, p) for m, p in models])
    m = _run(tmp_path, ing, "colmap", tmp_path / "model")
    assert m["undistorted"] and m["num_cameras"] == 4 and m["background"] == "alpha kept"
    assert m["source_camera_model"] == "OPENCV, OPENCV_FISHEYE"  # SIMPLE_RADIAL, RADIAL: OPENCV forms
    intrs, files, _, doc = C.read_transforms(tmp_path / "poses" / "transforms.json")
    assert doc["camera_model"] == "PINHOLE" and len(set(intrs)) == 4
    rec = pycolmap.Reconstruction(tmp_path / "poses" / "sparse" / "0")
    assert {c.model_name for c in rec.cameras.values()} == {"PINHOLE"}
    for k, (intr, f) in enumerate(zip(intrs, files)):
        img = np.asarray(Image.open(tmp_path / "poses" / f))
        assert img.shape[:2] == (intr.height, intr.width) and img.shape[2] == (4 if k == 2 else 3)
        lum = img[..., :3].astype(float).mean(-1)
        expected = (intr.K() @ points_cam.T).T
        for uv in expected[:, :2] / expected[:, 2:]:
            c, r = int(uv[0]), int(uv[1])
            win = lum[max(r - 4, 0):r + 5, max(c - 4, 0):c + 5]
            rr, cc = np.mgrid[max(r - 4, 0):r + 5, max(c - 4, 0):c + 5]
            got = np.array([(cc * win).sum(), (rr * win).sum()]) / win.sum() + 0.5  # blob centroid, pixel centres
            # the dot was drawn at the integer pixel of the distorted projection: within a pixel of
            # the pinhole projection, plus what bilinear resampling moves a 3x3 blob's centroid
            assert np.abs(got - uv).max() < 1.0, (models[k][0], got, uv)
        if k == 2:  # the alpha strip is warped with the colours: transparent on the left, opaque elsewhere
            assert img[:, :5, 3].max() == 0 and img[intr.height // 2, intr.width // 2, 3] == 255


def test_every_reader_takes_one_camera_per_image_and_names_the_image_with_a_bad_focal(tmp_path):
    # LLFF: each row has its own (H, W, focal): a portrait and a landscape row
    rows = np.concatenate([llff_rows(ring_c2w(2)[:1], 30, 40, 35.0), llff_rows(ring_c2w(2)[1:], 40, 30, 36.0)])
    scene = I.parse_poses_bounds(rows, "poses_bounds.npy", ["a.png", "b.png"])
    assert [(c.width, c.height, c.fx) for c in scene.cameras] == [(40, 30, 35.0), (30, 40, 36.0)]
    rows[1, 14] = 0.0  # b's focal
    with pytest.raises(ValueError, match=r"row 1 \(b.png\): focal must be > 0"):
        I.parse_poses_bounds(rows, "poses_bounds.npy", ["a.png", "b.png"])
    # transforms.json: per-frame cameras override the top level; a bad one names its image
    doc = {"w": 40, "h": 30, "fl_x": 35.0, "frames": [
        {"file_path": "a.png", "transform_matrix": np.eye(4).tolist()},
        {"file_path": "b.png", "transform_matrix": np.eye(4).tolist(), "w": 30, "h": 40, "fl_x": 36.0}]}
    (tmp_path / "transforms.json").write_text(json.dumps(doc))
    scene = I.read_transforms(tmp_path / "transforms.json")
    assert scene.layout == "nerfstudio" and [(c.width, c.height, c.fx) for c in scene.cameras] == \
        [(40, 30, 35.0), (30, 40, 36.0)]
    doc["frames"][1]["fl_x"] = -36.0
    (tmp_path / "transforms.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"frames\[1\] \(b.png\): fl_x must be > 0"):
        I.read_transforms(tmp_path / "transforms.json")
