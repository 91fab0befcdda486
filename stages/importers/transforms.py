"""``transforms.json``: the instant-ngp and nerfstudio layouts and the Blender / nerf_synthetic folder."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..common import cameras as C
from .scene import IMAGE_EXTS, Camera, ImportedScene, _fail, _matrix, _number, _side, resolve_inside, rigid


CAMERA_KEYS = ("w", "h", "fl_x", "fl_y", "cx", "cy", "camera_angle_x", "camera_angle_y",
               "k1", "k2", "k3", "k4", "p1", "p2", "camera_model")
PERSPECTIVE_MODELS = ("OPENCV", "PINHOLE", "SIMPLE_PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV_FISHEYE")


def image_name(root: Path, file_path: Any, where: Any) -> str:
    """A frame's ``file_path`` as a checked name under ``root``; ``.png`` is appended when it
    has no image extension (the Blender layout writes ``./train/r_0``)."""
    name = resolve_inside(root, file_path, where)
    return name if Path(name).suffix.lower() in IMAGE_EXTS else name + ".png"


def _image_size(root: Path, name: str, where: Any) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    path = root / name
    try:
        with Image.open(path) as im:
            return im.size
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise _fail(where, f"no w/h given and the image {path} cannot be read for its size ({exc})") from None


def camera_from_keys(keys: dict, where: Any, size: Callable[[], tuple[int, int]]) -> Camera:
    """Intrinsics from instant-ngp / nerfstudio keys; ``size()`` gives (w, h) when absent."""
    model = keys.get("camera_model", "OPENCV")
    if model not in PERSPECTIVE_MODELS:
        raise _fail(where, f"camera_model {model!r} is not supported (perspective models: {', '.join(PERSPECTIVE_MODELS)})")
    if "w" in keys or "h" in keys:
        if "w" not in keys or "h" not in keys:
            raise _fail(where, "needs both w and h, or neither")
        w, h = _side(keys["w"], "w", where), _side(keys["h"], "h", where)
    else:
        w, h = size()

    def focal(fl: str, angle: str, side: int) -> float | None:
        if fl in keys:
            return _number(keys[fl], fl, where, positive=True)
        if angle in keys:
            a = _number(keys[angle], angle, where, positive=True)
            if a >= math.pi:
                raise _fail(where, f"{angle} must be below pi (radians), got {a}")
            return 0.5 * side / math.tan(0.5 * a)
        return None

    fx = focal("fl_x", "camera_angle_x", w)
    fy = focal("fl_y", "camera_angle_y", h)
    if fx is None and fy is None:
        raise _fail(where, "needs a focal length: fl_x or camera_angle_x")
    fx, fy = fx or fy, fy or fx
    cx = _number(keys.get("cx", w / 2), "cx", where)
    cy = _number(keys.get("cy", h / 2), "cy", where)
    k = {n: _number(keys.get(n, 0.0), n, where) for n in ("k1", "k2", "k3", "k4", "p1", "p2")}
    if model == "OPENCV_FISHEYE":  # nerfstudio's fisheye: k1..k4 of OpenCV's fisheye model
        if k["p1"] or k["p2"]:
            raise _fail(where, f"camera_model OPENCV_FISHEYE has no p1, p2; got {k['p1']}, {k['p2']}")
        return Camera(w, h, fx, fy, cx, cy, (k["k1"], k["k2"], k["k3"], k["k4"]), fisheye=True)
    if k["k4"]:
        raise _fail(where, "k4 is a fisheye coefficient; set camera_model: OPENCV_FISHEYE for a fisheye camera")
    if model in ("PINHOLE", "SIMPLE_PINHOLE") and any(k.values()):
        raise _fail(where, f"camera_model {model} but non-zero distortion coefficients {k}")
    dist = (k["k1"], k["k2"], k["p1"], k["p2"]) + ((k["k3"], 0.0, 0.0, 0.0) if k["k3"] else ())
    return Camera(w, h, fx, fy, cx, cy, dist)


def parse_transforms(doc: Any, where: Any, root: Path) -> ImportedScene:
    """One parsed ``transforms.json`` document (instant-ngp or nerfstudio layout); image names
    are relative to ``root``, the file's folder."""
    if not isinstance(doc, dict):
        raise _fail(where, f"expected a JSON object at the top level, got {type(doc).__name__}")
    frames = doc.get("frames")
    if not isinstance(frames, list) or not frames:
        raise _fail(where, "needs a non-empty 'frames' list")
    top = {k: doc[k] for k in CAMERA_KEYS if k in doc}
    per_frame = False
    names, cameras, c2w = [], [], []
    for i, fr in enumerate(frames):
        at = f"{where}, frames[{i}]"
        if not isinstance(fr, dict):
            raise _fail(at, "must be an object")
        if "file_path" not in fr or "transform_matrix" not in fr:
            raise _fail(at, "needs file_path and transform_matrix")
        name = image_name(root, fr["file_path"], at)
        at = f"{at} ({name})"
        own = {k: fr[k] for k in CAMERA_KEYS if k in fr}
        per_frame |= bool(own)
        cameras.append(camera_from_keys({**top, **own}, at, lambda: _image_size(root, name, at)))
        m = _matrix(fr["transform_matrix"], "transform_matrix", at, ((4, 4), (3, 4)))
        c2w.append(C.opengl_to_opencv(rigid(m, "transform_matrix", at)))
        names.append(name)
    extra: dict[str, Any] = {}
    if "applied_transform" in doc:
        extra["applied_transform"] = _matrix(doc["applied_transform"], "applied_transform", where,
                                             ((3, 4), (4, 4))).tolist()
    aabb_scale = None
    if "aabb_scale" in doc:
        aabb_scale = _number(doc["aabb_scale"], "aabb_scale", where, positive=True)
    split = None
    test_key = "test_filenames" if "test_filenames" in doc else "val_filenames"
    if "train_filenames" in doc and test_key in doc:
        split = {}
        for part, key in (("train", "train_filenames"), ("test", test_key)):
            listed = doc[key]
            if not isinstance(listed, list):
                raise _fail(where, f"{key} must be a list")
            split[part] = [image_name(root, n, f"{where}, {key}") for n in listed]
            missing = sorted(set(split[part]) - set(names))
            if missing:
                raise _fail(where, f"{key} names images without a frame: {missing[:5]}")
    xyz, rgb = np.zeros((0, 3)), np.zeros((0, 3), np.uint8)
    if "ply_file_path" in doc:
        xyz, rgb = _read_points_ply(root, doc["ply_file_path"], where)
    nerfstudio = per_frame or any(k in doc for k in ("camera_model", "applied_transform", "ply_file_path"))
    return ImportedScene("transforms", "nerfstudio" if nerfstudio else "instant-ngp", Path(str(where)), names,
                         cameras, np.stack(c2w), xyz, rgb, split=split, aabb_scale=aabb_scale, extra=extra)


def _read_points_ply(root: Path, rel: Any, where: Any) -> tuple[np.ndarray, np.ndarray]:
    import open3d as o3d

    path = root / resolve_inside(root, rel, f"{where}, ply_file_path")
    if not path.is_file():
        raise _fail(where, f"ply_file_path {rel!r}: {path} does not exist")
    with open(path, "rb") as fh:
        header = fh.read(4096)
    if b"\nelement vertex 0\n" in header.split(b"end_header")[0]:  # a point cloud without points (ours)
        return np.zeros((0, 3)), np.zeros((0, 3), np.uint8)
    pcd = o3d.io.read_point_cloud(str(path))
    xyz = np.asarray(pcd.points, dtype=np.float64).reshape(-1, 3)
    if not len(xyz):
        raise _fail(where, f"ply_file_path {rel!r}: no points could be read from {path}")
    rgb = (np.round(np.asarray(pcd.colors) * 255).astype(np.uint8) if pcd.has_colors()
           else np.full((len(xyz), 3), 128, np.uint8))
    return xyz, rgb


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _fail(path, f"cannot read JSON ({exc})") from None


def read_transforms(path: str | Path) -> ImportedScene:
    """A ``transforms.json`` file, or a folder holding one or a Blender layout
    (``transforms_train.json`` + ``transforms_test.json``: the split is kept, val is not used)."""
    path = Path(path)
    if path.is_dir():
        if (path / "transforms.json").is_file():
            path = path / "transforms.json"
        elif (path / "transforms_train.json").is_file():
            return read_blender(path)
        else:
            raise _fail(path, "holds neither transforms.json nor transforms_train.json")
    if path.name in ("transforms_train.json", "transforms_test.json", "transforms_val.json"):
        return read_blender(path.parent)
    if not path.is_file():
        raise _fail(path, "camera file not found")
    return parse_transforms(_load_json(path), path, path.parent)


def read_blender(folder: str | Path) -> ImportedScene:
    """The Blender / nerf_synthetic layout: ``transforms_train.json`` and (optionally)
    ``transforms_test.json`` in ``folder``; RGBA images, composited on white by convention."""
    folder = Path(folder)
    parts = {}
    for part in ("train", "test"):
        p = folder / f"transforms_{part}.json"
        if p.is_file():
            parts[part] = parse_transforms(_load_json(p), p, folder)
        elif part == "train":
            raise _fail(folder, "Blender layout needs transforms_train.json")
    names = [n for s in parts.values() for n in s.names]
    both = sorted(set(parts["train"].names) & set(parts["test"].names)) if "test" in parts else []
    if both:
        raise _fail(folder, f"images in both transforms_train.json and transforms_test.json: {both[:5]}")
    split = {"train": parts["train"].names, "test": parts["test"].names if "test" in parts else []}
    return ImportedScene(
        "transforms", "blender", folder / "transforms_train.json", names,
        [c for s in parts.values() for c in s.cameras], np.concatenate([s.c2w for s in parts.values()]),
        split=split, aabb_scale=parts["train"].aabb_scale, background="white")
