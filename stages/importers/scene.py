"""The structure every camera reader fills (:class:`Camera`, :class:`ImportedScene`) and the
checks they share: numbers, matrices, rigid poses and image paths that must stay inside a folder."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..common import cameras as C

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp"}
# COLMAP camera model id -> (name, number of parameters); ids as in colmap/sensor/models.h
COLMAP_MODELS = {0: ("SIMPLE_PINHOLE", 3), 1: ("PINHOLE", 4), 2: ("SIMPLE_RADIAL", 4), 3: ("RADIAL", 5),
                 4: ("OPENCV", 8), 5: ("OPENCV_FISHEYE", 8), 6: ("FULL_OPENCV", 12), 7: ("FOV", 5),
                 8: ("SIMPLE_RADIAL_FISHEYE", 4), 9: ("RADIAL_FISHEYE", 5), 10: ("THIN_PRISM_FISHEYE", 12),
                 11: ("RAD_TAN_THIN_PRISM_FISHEYE", 16)}
SUPPORTED_MODELS = ("SIMPLE_PINHOLE", "PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV", "FULL_OPENCV",
                    "OPENCV_FISHEYE")
ROTATION_TOL = 1e-4  # max |R^T R - I| of a rotation read from a file (float32 files are ~1e-7 off)
MAX_SIDE = 100_000  # pixels; a larger image side is taken as a corrupt file


def _fail(where: Any, problem: str) -> ValueError:
    return ValueError(f"{where}: {problem}")


# ---------------------------------------------------------------- the common structure


@dataclass(frozen=True)
class Camera(C.Intrinsics):
    """Intrinsics of one image in COLMAP's OPENCV / FULL_OPENCV / OPENCV_FISHEYE
    parameterisation: the pinhole :class:`stages.common.cameras.Intrinsics` plus lens distortion.

    ``fx, fy, cx, cy`` in pixels (the first pixel's centre at (0.5, 0.5)); ``dist`` is
    ``(k1, k2, p1, p2)`` or ``(k1, k2, p1, p2, k3, k4, k5, k6)`` (OpenCV's rational model),
    all zero for a pinhole camera; with ``fisheye`` it is OpenCV's fisheye ``(k1, k2, k3, k4)``.
    SIMPLE_RADIAL and RADIAL are OPENCV with the missing coefficients zero, so every supported
    model has one exact form here.
    """

    dist: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    fisheye: bool = False

    @property
    def model(self) -> str:
        if self.fisheye:
            return "OPENCV_FISHEYE"
        if not any(self.dist):
            return "PINHOLE"
        return "FULL_OPENCV" if any(self.dist[4:]) else "OPENCV"

    def colmap_params(self) -> list[float]:
        base = [self.fx, self.fy, self.cx, self.cy]
        if self.model == "PINHOLE":
            return base
        return base + list(self.dist[:4] if self.model in ("OPENCV", "OPENCV_FISHEYE") else self.dist)

    def resized(self, width: int, height: int) -> "Camera":
        """The camera of the same view resampled to ``width`` x ``height`` pixels (distortion
        coefficients act on normalized coordinates and do not change)."""
        sx, sy = width / self.width, height / self.height
        return replace(self, width=width, height=height, fx=self.fx * sx, fy=self.fy * sy,
                       cx=self.cx * sx, cy=self.cy * sy)

    def scaled(self, factor: float) -> "Camera":
        """As ``Intrinsics.scaled``, keeping the distortion."""
        return self.resized(round(self.width * factor), round(self.height * factor))

    def intrinsics(self) -> C.Intrinsics:
        """The pinhole part alone (what the images are after undistortion)."""
        return C.Intrinsics(self.width, self.height, self.fx, self.fy, self.cx, self.cy)


@dataclass
class ImportedScene:
    """Cameras read from another tool's files, in the project's conventions.

    Attributes:
        source: ``colmap``, ``transforms`` or ``llff``.
        layout: what was read: ``colmap-bin``, ``colmap-txt``, ``instant-ngp``, ``nerfstudio``,
            ``blender`` or ``llff``.
        path: the file or model folder read.
        names: [N] image paths relative to the folder the camera file names them from, POSIX.
        cameras: [N] intrinsics, one per image.
        c2w: [N, 4, 4] camera-to-world, OpenCV axes (x right, y down, z forward).
        points_xyz: [P, 3] sparse points (P may be 0), same world frame.
        points_rgb: [P, 3] uint8 colours.
        split: the given ``{"train": [...], "test": [...]}`` by name, or None.
        aabb_scale: instant-ngp's scene-size hint, or None.
        near_far: [N, 2] depth bounds (LLFF), or None.
        background: ``"white"`` where the layout's convention composites RGBA images on white.
        extra: anything else worth recording (e.g. nerfstudio's ``applied_transform``).
    """

    source: str
    layout: str
    path: Path
    names: list[str]
    cameras: list[Camera]
    c2w: np.ndarray
    points_xyz: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    points_rgb: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.uint8))
    split: dict[str, list[str]] | None = None
    aabb_scale: float | None = None
    near_far: np.ndarray | None = None
    background: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0:
            raise _fail(self.path, "names no images")
        if len(self.cameras) != n or self.c2w.shape != (n, 4, 4):
            raise _fail(self.path, f"{n} names but {len(self.cameras)} cameras and poses {self.c2w.shape}")
        dup = sorted({x for x in self.names if self.names.count(x) > 1}) if len(set(self.names)) != n else []
        if dup:
            raise _fail(self.path, f"image(s) named more than once: {dup[:5]}")
        if self.points_xyz.shape != (len(self.points_rgb), 3) or self.points_rgb.shape[1:] != (3,):
            raise _fail(self.path, f"points {self.points_xyz.shape} and colours {self.points_rgb.shape} disagree")


# ---------------------------------------------------------------- value checks


def _number(v: Any, what: str, where: Any, lo: float | None = None, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(where, f"{what} must be a number, got {v!r}")
    x = float(v)
    if not math.isfinite(x):
        raise _fail(where, f"{what} must be finite, got {v!r}")
    if positive and x <= 0:
        raise _fail(where, f"{what} must be > 0, got {v!r}")
    if lo is not None and x < lo:
        raise _fail(where, f"{what} must be >= {lo}, got {v!r}")
    return x


def _side(v: Any, what: str, where: Any) -> int:
    x = _number(v, what, where, positive=True)
    if x != round(x) or x > MAX_SIDE:
        raise _fail(where, f"{what} must be a whole number of pixels in 1..{MAX_SIDE}, got {v!r}")
    return int(x)


def _is_numbers(v: Any, depth: int = 0) -> bool:
    """True for a number or nested lists of numbers (no strings, no true/false)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float, np.floating, np.integer)):
        return True
    return isinstance(v, (list, tuple, np.ndarray)) and depth < 3 and all(_is_numbers(x, depth + 1) for x in v)


def _matrix(v: Any, what: str, where: Any, shapes: tuple[tuple[int, int], ...]) -> np.ndarray:
    if not _is_numbers(v):
        raise _fail(where, f"{what} must be a matrix of numbers, got {str(v)[:80]}")
    try:
        m = np.array(v, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise _fail(where, f"{what} must be a matrix of numbers, got {str(v)[:80]}") from None
    if m.shape not in shapes:
        raise _fail(where, f"{what} must have shape {' or '.join(map(str, shapes))}, got {m.shape}")
    if not np.isfinite(m).all():
        raise _fail(where, f"{what} has non-finite values")
    return m


def rigid(m: np.ndarray, what: str, where: Any) -> np.ndarray:
    """A checked 4x4 rigid transform from a [3, 4] or [4, 4] array: the rotation must be
    orthonormal with determinant +1 (within :data:`ROTATION_TOL`); it is re-orthonormalized."""
    m = np.asarray(m, dtype=np.float64)
    if m.shape == (3, 4):
        m = np.vstack([m, [0.0, 0.0, 0.0, 1.0]])
    if m.shape != (4, 4) or not np.isfinite(m).all():
        raise _fail(where, f"{what} must be a finite 3x4 or 4x4 matrix")
    if np.abs(m[3] - [0.0, 0.0, 0.0, 1.0]).max() > 1e-6:
        raise _fail(where, f"{what} last row must be [0, 0, 0, 1], got {m[3].tolist()}")
    R = m[:3, :3]
    off = np.abs(R.T @ R - np.eye(3)).max()
    if off > ROTATION_TOL or np.linalg.det(R) <= 0:
        raise _fail(where, f"{what} is not a rigid transform (rotation part off orthonormal by {off:.2g}, "
                           f"determinant {np.linalg.det(R):.3g}; scaled or mirrored poses are not accepted)")
    U, _, Vt = np.linalg.svd(R)
    out = m.copy()
    out[:3, :3] = U @ Vt
    return out


def _quat_to_rotation(q: np.ndarray, where: Any) -> np.ndarray:
    """COLMAP's (w, x, y, z) quaternion -> 3x3 rotation; normalized like COLMAP does."""
    big = float(np.abs(q).max())
    if not math.isfinite(big) or big < 1e-9:
        raise _fail(where, f"quaternion {q.tolist()} has no direction")
    q = q / big  # then the norm cannot overflow
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def resolve_inside(root: Path, name: Any, where: Any) -> str:
    """``name`` (relative to ``root``, or absolute) as a POSIX path relative to ``root``.

    Raises ValueError when it is not a usable path or leads outside ``root``, lexically
    (``..``, an absolute path elsewhere) or through a symlink. Backslashes count as folder
    separators (files written on Windows).
    """
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise _fail(where, f"image path must be a non-empty string, got {name!r}")
    text = name.replace("\\", "/")
    root_abs = Path(os.path.abspath(root))
    candidate = Path(text) if Path(text).is_absolute() else root_abs / text
    lexical = Path(os.path.normpath(candidate))
    try:
        rel = lexical.relative_to(root_abs)
    except ValueError:
        raise _fail(where, f"image path {name!r} leads outside {root_abs}") from None
    if rel == Path("."):
        raise _fail(where, f"image path {name!r} names the folder itself, not an image")
    try:
        real, real_root = candidate.resolve(), root_abs.resolve()
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise _fail(where, f"image path {name!r} cannot be resolved ({exc})") from None
    if real != real_root and real_root not in real.parents:
        raise _fail(where, f"image path {name!r} is a symlink (or inside one) leading outside {root_abs} (to {real})")
    return rel.as_posix()
