"""COLMAP models: our own readers of ``cameras``, ``images`` and ``points3D`` as text and binary."""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..common import cameras as C
from .scene import (COLMAP_MODELS, SUPPORTED_MODELS, Camera, ImportedScene, _fail, _number, _side,
                    _quat_to_rotation, resolve_inside)


def camera_from_colmap(model: str, width: int, height: int, params: list[float], where: Any) -> Camera:
    """A :class:`Camera` from a COLMAP model name and its parameter list."""
    counts = {name: n for name, n in COLMAP_MODELS.values()}
    if model not in counts:
        raise _fail(where, f"unknown camera model {model!r}")
    if model not in SUPPORTED_MODELS:
        raise _fail(where, f"camera model {model} is not supported (supported: {', '.join(SUPPORTED_MODELS)})")
    if len(params) != counts[model]:
        raise _fail(where, f"camera model {model} takes {counts[model]} parameters, got {len(params)}")
    p = [_number(v, "camera parameter", where) for v in params]
    if model in ("SIMPLE_PINHOLE", "SIMPLE_RADIAL", "RADIAL"):
        f, cx, cy, *k = p
        fx = fy = f
        dist = (k + [0.0, 0.0])[:2] + [0.0, 0.0]
    else:
        fx, fy, cx, cy, *dist = p
        dist = dist or [0.0] * 4
    # focal lengths are checked per image (ImportedScene), so the error names the images that use it
    return Camera(width, height, fx, fy, cx, cy, tuple(float(d) for d in dist), fisheye=model == "OPENCV_FISHEYE")


def _tokens(text: str, where: Any) -> list[tuple[int, list[str]]]:
    if not isinstance(text, str):
        raise _fail(where, "expected text")
    return [(i + 1, line.split()) for i, line in enumerate(text.splitlines())]


def _floats(tokens: list[str], where: Any, what: str) -> list[float]:
    try:
        out = [float(t) for t in tokens]
    except ValueError:
        raise _fail(where, f"{what}: expected numbers, got {' '.join(tokens)[:80]!r}") from None
    if not all(math.isfinite(x) for x in out):
        raise _fail(where, f"{what}: non-finite number")
    return out


def _int(token: str, where: Any, what: str, lo: int = 0) -> int:
    try:
        v = int(token)
    except ValueError:
        raise _fail(where, f"{what} must be an integer, got {token!r}") from None
    if v < lo:
        raise _fail(where, f"{what} must be >= {lo}, got {v}")
    return v


def parse_cameras_txt(text: str, where: Any = "cameras.txt") -> dict[int, Camera]:
    """COLMAP ``cameras.txt``: ``CAMERA_ID MODEL WIDTH HEIGHT PARAMS...`` per line."""
    cams: dict[int, Camera] = {}
    for ln, tok in _tokens(text, where):
        if not tok or tok[0].startswith("#"):
            continue
        at = f"{where}, line {ln}"
        if len(tok) < 4:
            raise _fail(at, "expected CAMERA_ID MODEL WIDTH HEIGHT PARAMS...")
        cid = _int(tok[0], at, "camera id")
        if cid in cams:
            raise _fail(at, f"camera id {cid} appears twice")
        w = _side(_floats([tok[2]], at, "width")[0], "width", at)
        h = _side(_floats([tok[3]], at, "height")[0], "height", at)
        cams[cid] = camera_from_colmap(tok[1], w, h, _floats(tok[4:], at, "camera parameters"), at)
    return cams


def parse_images_txt(text: str, where: Any = "images.txt") -> list[tuple[int, np.ndarray, int, str]]:
    """COLMAP ``images.txt``: two lines per image, ``IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID
    NAME`` and its 2-D points (``X Y POINT3D_ID`` triples, checked and not kept).

    Returns ``[(image_id, world_to_camera [4, 4], camera_id, name)]``.
    """
    out, seen = [], set()
    lines = _tokens(text, where)
    i = 0
    while i < len(lines):
        ln, tok = lines[i]
        i += 1
        if not tok or tok[0].startswith("#"):
            continue
        at = f"{where}, line {ln}"
        if len(tok) < 10:
            raise _fail(at, "expected IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME")
        iid = _int(tok[0], at, "image id")
        if iid in seen:
            raise _fail(at, f"image id {iid} appears twice")
        seen.add(iid)
        v = _floats(tok[1:8], at, "pose")
        w2c = np.eye(4)
        w2c[:3, :3] = _quat_to_rotation(np.array(v[:4]), at)
        w2c[:3, 3] = v[4:]
        cid = _int(tok[8], at, "camera id")
        name = " ".join(tok[9:])
        if i < len(lines):  # the 2-D points line follows at once (it may be empty)
            pln, pts = lines[i]
            i += 1
            if len(pts) % 3:
                raise _fail(f"{where}, line {pln}", f"2-D points must be X Y POINT3D_ID triples, got {len(pts)} values")
            _floats(pts, f"{where}, line {pln}", "2-D points")
        out.append((iid, w2c, cid, name))
    return out


def parse_points3d_txt(text: str, where: Any = "points3D.txt") -> tuple[np.ndarray, np.ndarray]:
    """COLMAP ``points3D.txt``: ``POINT3D_ID X Y Z R G B ERROR TRACK...``; returns
    (xyz [P, 3] float64, rgb [P, 3] uint8)."""
    xyz, rgb, seen = [], [], {}
    for ln, tok in _tokens(text, where):
        if not tok or tok[0].startswith("#"):
            continue
        at = f"{where}, line {ln}"
        if len(tok) < 8 or (len(tok) - 8) % 2:
            raise _fail(at, "expected POINT3D_ID X Y Z R G B ERROR then (IMAGE_ID POINT2D_IDX) pairs")
        pid = _int(tok[0], at, "point id")
        if pid in seen:
            raise _fail(at, f"point id {pid} appears twice")
        seen[pid] = len(seen)
        xyz.append(_floats(tok[1:4], at, "point position"))
        colour = [_int(t, at, "colour") for t in tok[4:7]]
        if max(colour) > 255:
            raise _fail(at, f"colour must be 0..255, got {colour}")
        rgb.append(colour)
        _floats(tok[7:8], at, "error")
        for t in tok[8:]:
            _int(t, at, "track entry")
    order = [seen[k] for k in sorted(seen)]  # by point id, as the SfM path writes its PLY
    return (np.array(xyz, dtype=np.float64).reshape(-1, 3)[order],
            np.array(rgb, dtype=np.uint8).reshape(-1, 3)[order])


class _Bytes:
    """Little-endian reads from a COLMAP binary file; short data is a ValueError."""

    def __init__(self, data: bytes, where: Any):
        self.data, self.pos, self.where = data, 0, where

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise _fail(self.where, f"file ends early (at byte {self.pos}, {len(self.data)} bytes in all)")
        vals = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return vals

    def count(self, min_item: int, what: str) -> int:
        (n,) = self.take("Q")
        if n * min_item > len(self.data) - self.pos:
            raise _fail(self.where, f"says {n} {what}, more than its {len(self.data)} bytes can hold")
        return n

    def string(self) -> str:
        end = self.data.find(b"\x00", self.pos)
        if end < 0:
            raise _fail(self.where, "an image name is not terminated")
        raw, self.pos = self.data[self.pos:end], end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(self.where, f"image name {raw[:40]!r} is not UTF-8") from None

    def done(self) -> None:
        if self.pos != len(self.data):
            raise _fail(self.where, f"{len(self.data) - self.pos} unexpected bytes at the end")


def parse_cameras_bin(data: bytes, where: Any = "cameras.bin") -> dict[int, Camera]:
    r, cams = _Bytes(data, where), {}
    for _ in range(r.count(24, "cameras")):
        cid, model_id, w, h = r.take("iiQQ")
        if model_id not in COLMAP_MODELS:
            raise _fail(where, f"camera {cid}: unknown camera model id {model_id}")
        name, n = COLMAP_MODELS[model_id]
        params = list(r.take(f"{n}d"))
        if cid in cams:
            raise _fail(where, f"camera id {cid} appears twice")
        at = f"{where}, camera {cid}"
        cams[cid] = camera_from_colmap(name, _side(w, "width", at), _side(h, "height", at), params, at)
    r.done()
    return cams


def parse_images_bin(data: bytes, where: Any = "images.bin") -> list[tuple[int, np.ndarray, int, str]]:
    r, out, seen = _Bytes(data, where), [], set()
    for _ in range(r.count(73, "images")):
        iid, qw, qx, qy, qz, tx, ty, tz, cid = r.take("I7dI")
        at = f"{where}, image {iid}"
        if iid in seen:
            raise _fail(at, "image id appears twice")
        seen.add(iid)
        name = r.string()
        n2d = r.count(24, "2-D points")
        r.pos += 24 * n2d  # X Y POINT3D_ID, not needed (count() checked they fit)
        v = [qw, qx, qy, qz, tx, ty, tz]
        if not all(math.isfinite(x) for x in v):
            raise _fail(at, "non-finite pose")
        w2c = np.eye(4)
        w2c[:3, :3] = _quat_to_rotation(np.array(v[:4]), at)
        w2c[:3, 3] = v[4:]
        out.append((iid, w2c, cid, name))
    r.done()
    return out


def parse_points3d_bin(data: bytes, where: Any = "points3D.bin") -> tuple[np.ndarray, np.ndarray]:
    r = _Bytes(data, where)
    n = r.count(51, "points")
    xyz, rgb, ids = np.empty((n, 3)), np.empty((n, 3), np.uint8), np.empty(n, np.uint64)
    for k in range(n):
        vals = r.take("Q3d3Bd")
        ids[k], xyz[k], rgb[k] = vals[0], vals[1:4], vals[4:7]
        n_track = r.count(8, "track entries")
        r.pos += 8 * n_track  # (IMAGE_ID, POINT2D_IDX) pairs, not needed
    r.done()
    if not np.isfinite(xyz).all():
        raise _fail(where, "non-finite point position")
    if len(np.unique(ids)) != n:
        raise _fail(where, "a point id appears twice")
    order = np.argsort(ids, kind="stable")  # by point id, as the SfM path writes its PLY
    return xyz[order], rgb[order]


def find_colmap_model(path: Path) -> Path:
    """The model folder: ``path`` itself when it holds ``cameras.bin|txt``, else
    ``path/sparse/0`` or ``path/sparse``."""
    for cand in (path, path / "sparse" / "0", path / "sparse"):
        if any((cand / f"cameras.{ext}").is_file() for ext in ("bin", "txt")):
            return cand
    raise _fail(path, "no COLMAP model here (looked for cameras.bin or cameras.txt in it, sparse/0 and sparse)")


def read_colmap(path: str | Path, image_root: str | Path | None = None) -> ImportedScene:
    """Read a COLMAP model (binary preferred when both are there).

    Args:
        path: the model folder, or a folder holding ``sparse/0``.
        image_root: the folder image names are relative to; default ``images/`` beside the
            ``sparse/`` folder (COLMAP's own layout), else beside the model folder.
    """
    model = find_colmap_model(Path(path))
    ext = "bin" if all((model / f"{s}.bin").is_file() for s in ("cameras", "images")) else "txt"
    files = {s: model / f"{s}.{ext}" for s in ("cameras", "images", "points3D")}
    if not files["images"].is_file():
        raise _fail(model, f"has cameras.{ext} but no images.{ext}")
    if image_root is None:
        base = model.parent.parent if model.parent.name == "sparse" else model.parent
        image_root = base / "images"
    image_root = Path(image_root)

    def load(key: str):
        p = files[key]
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise _fail(p, f"cannot read ({exc.strerror or exc})") from None
        if ext == "bin":
            return {"cameras": parse_cameras_bin, "images": parse_images_bin, "points3D": parse_points3d_bin}[key](raw, p)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(p, "not UTF-8 text") from None
        return {"cameras": parse_cameras_txt, "images": parse_images_txt, "points3D": parse_points3d_txt}[key](text, p)

    cams, images = load("cameras"), load("images")
    xyz, rgb = load("points3D") if files["points3D"].is_file() else (np.zeros((0, 3)), np.zeros((0, 3), np.uint8))
    images.sort(key=lambda r: r[0])
    names, cameras, c2w = [], [], []
    for iid, w2c, cid, name in images:
        if cid not in cams:
            raise _fail(files["images"], f"image {iid} ({name}) uses camera {cid}, which cameras.{ext} lacks")
        if not (cams[cid].fx > 0 and cams[cid].fy > 0):
            raise _fail(files["images"], f"image {iid} ({name}) uses camera {cid}, whose focal lengths must be > 0 "
                                         f"(cameras.{ext}: fx {cams[cid].fx:g}, fy {cams[cid].fy:g})")
        names.append(resolve_inside(image_root, name, f"{files['images']}, image {iid}"))
        cameras.append(cams[cid])
        c2w.append(C.w2c_to_c2w(w2c))
    if not names:
        raise _fail(files["images"], "has no images")
    return ImportedScene("colmap", f"colmap-{ext}", model, names, cameras, np.stack(c2w), xyz, rgb)
