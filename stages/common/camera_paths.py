"""Camera paths for videos of a trained model: orbit, spiral, a smooth path through chosen cameras,
and nerfstudio's ``camera_path.json``.

Every path is a list of camera-to-world poses [F, 4, 4] in OpenCV axes in the normalized scene
frame of ``transforms.json`` (the frame the model was trained in), with one pinhole camera per frame.

* :func:`orbit`: a circle about the cameras' up axis at their mean height and distance
  (``stages.evaluate.orbit_poses``, which swings across the covered arc for a forward-facing capture);
* :func:`spiral`: the forward-facing spiral of LLFF / NeRF renders: positions on an ellipse in the
  mean camera's image plane with a depth oscillation, every frame looking at the focus point;
* :func:`through`: a smooth path through key poses: Catmull-Rom splines through the positions and
  spherical linear interpolation (slerp) of the orientations between consecutive keys;
* :func:`read_nerfstudio` / :func:`write_nerfstudio`: nerfstudio's camera path file (what its viewer
  exports and ``ns-render camera-path`` reads): ``camera_path`` entries with ``camera_to_world`` (a
  row-major 4x4, OpenGL axes), ``fov`` (vertical, degrees, three.js convention) and ``aspect``, plus
  ``render_width``, ``render_height``, ``seconds`` and ``fps``. As in nerfstudio, every frame is
  rendered at ``render_width`` x ``render_height`` with the principal point at the centre; the
  per-frame ``aspect`` is not used.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cameras import Intrinsics, opencv_to_opengl, opengl_to_opencv


@dataclass
class CameraPath:
    """Poses [F, 4, 4] (OpenCV camera-to-world), one camera per frame, and the playback rate."""

    c2w: np.ndarray
    cameras: list[Intrinsics]
    fps: float

    def __len__(self) -> int:
        return len(self.c2w)


# ---------------------------------------------------------------- rotations


def quat_from_matrix(R: np.ndarray) -> np.ndarray:
    """Unit quaternion (w, x, y, z), w >= 0, of a rotation matrix [3, 3] (Shepperd's method)."""
    R = np.asarray(R, np.float64)
    tr = np.trace(R)
    if tr > max(R[0, 0], R[1, 1], R[2, 2]):
        w = math.sqrt(1.0 + tr) / 2
        q = [w, (R[2, 1] - R[1, 2]) / (4 * w), (R[0, 2] - R[2, 0]) / (4 * w), (R[1, 0] - R[0, 1]) / (4 * w)]
    else:
        i = int(np.argmax(np.diag(R)))
        j, k = (i + 1) % 3, (i + 2) % 3
        s = math.sqrt(max(1.0 + R[i, i] - R[j, j] - R[k, k], 1e-12)) * 2
        q = [0.0] * 4
        q[0] = (R[k, j] - R[j, k]) / s
        q[1 + i] = s / 4
        q[1 + j] = (R[j, i] + R[i, j]) / s
        q[1 + k] = (R[k, i] + R[i, k]) / s
    q = np.asarray(q) / np.linalg.norm(q)
    return q if q[0] >= 0 else -q


def matrix_from_quat(q: np.ndarray) -> np.ndarray:
    """Rotation matrix [3, 3] of a quaternion (w, x, y, z) (normalised first)."""
    w, x, y, z = np.asarray(q, np.float64) / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def slerp(q0: np.ndarray, q1: np.ndarray, t: float) -> np.ndarray:
    """Spherical linear interpolation of unit quaternions along the shorter arc (Shoemake 1985)."""
    q0, q1 = np.asarray(q0, np.float64), np.asarray(q1, np.float64)
    dot = float(q0 @ q1)
    if dot < 0:  # q and -q are the same rotation: take the shorter way round
        q1, dot = -q1, -dot
    if dot > 0.9995:  # nearly the same: linear interpolation is exact enough and stays finite
        q = q0 + t * (q1 - q0)
        return q / np.linalg.norm(q)
    theta = math.acos(dot)
    return (math.sin((1 - t) * theta) * q0 + math.sin(t * theta) * q1) / math.sin(theta)


def catmull_rom(p0: np.ndarray, p1: np.ndarray, p2: np.ndarray, p3: np.ndarray, t: float) -> np.ndarray:
    """The uniform Catmull-Rom spline between ``p1`` (t = 0) and ``p2`` (t = 1)."""
    t2, t3 = t * t, t * t * t
    return 0.5 * (2 * p1 + (p2 - p0) * t + (2 * p0 - 5 * p1 + 4 * p2 - p3) * t2 + (3 * p1 - p0 - 3 * p2 + p3) * t3)


# ---------------------------------------------------------------- paths


def look_at(eye: np.ndarray, target: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Camera-to-world [4, 4], OpenCV axes, at ``eye`` facing ``target`` with ``up`` up."""
    from stages.evaluate import look_at as _look_at

    return _look_at(eye, target, up)


def orbit(c2w: np.ndarray, center: np.ndarray, frames: int) -> np.ndarray:
    """[frames, 4, 4]: a circle round ``center`` (a swing for a forward-facing capture); see
    :func:`stages.evaluate.orbit_poses`."""
    from stages.evaluate import orbit_poses

    return orbit_poses(c2w, center, frames)[0]


def mean_pose(c2w: np.ndarray) -> np.ndarray:
    """The cameras' average pose: mean centre, mean viewing direction and up, re-orthonormalised."""
    c2w = np.asarray(c2w, np.float64)
    z = c2w[:, :3, 2].mean(0)
    y = c2w[:, :3, 1].mean(0)
    z /= np.linalg.norm(z)
    x = np.cross(y, z)
    x /= np.linalg.norm(x)
    out = np.eye(4)
    out[:3, 0], out[:3, 1], out[:3, 2], out[:3, 3] = x, np.cross(z, x), z, c2w[:, :3, 3].mean(0)
    return out


def spiral(c2w: np.ndarray, center: np.ndarray, frames: int, turns: float = 2.0,
           radius_scale: float = 1.0) -> np.ndarray:
    """[frames, 4, 4]: the forward-facing spiral about the mean camera (LLFF's render path).

    Positions go ``turns`` times round an ellipse in the mean camera's image plane whose half
    axes are the 90th percentile of the cameras' offsets from their mean along its x and y
    axes (times ``radius_scale``), with a depth oscillation of half that along its z axis at
    half the rate; every frame looks at ``center`` with the mean camera's up.
    """
    base = mean_pose(c2w)
    offs = (np.asarray(c2w)[:, :3, 3] - base[:3, 3]) @ base[:3, :3]  # in the mean camera's axes
    rad = np.percentile(np.abs(offs), 90, axis=0) * radius_scale
    rad = np.maximum(rad, 0.05 * np.linalg.norm(base[:3, 3] - center))  # cameras in a line still get a spiral
    up = -base[:3, 1]
    poses = []
    for a in 2 * np.pi * turns * np.arange(frames) / frames:
        local = np.array([math.cos(a) * rad[0], -math.sin(a) * rad[1], -math.sin(a / 2) * rad[2] * 0.5])
        poses.append(look_at(base[:3, 3] + base[:3, :3] @ local, center, up))
    return np.stack(poses)


def through(keys: np.ndarray, frames: int, loop: bool = False) -> np.ndarray:
    """[frames, 4, 4]: a smooth path through key poses [K, 4, 4] (K >= 2), keys in order.

    Frames are spread evenly in the spline parameter, so each segment between two keys gets the
    same number; the first frame is the first key, and the last is the last key (or, with
    ``loop``, the frame before the first key again).
    """
    keys = np.asarray(keys, np.float64)
    if keys.ndim != 3 or keys.shape[1:] != (4, 4) or len(keys) < 2:
        raise ValueError(f"a path through cameras needs at least 2 poses [K, 4, 4], got shape {keys.shape}")
    pos = keys[:, :3, 3]
    quats = [quat_from_matrix(k[:3, :3]) for k in keys]
    n = len(keys)
    segments = n if loop else n - 1
    u = np.arange(frames) * segments / (frames if loop else max(frames - 1, 1))

    def p(i: int) -> np.ndarray:  # neighbours past the ends mirror the end segment (a natural end)
        if loop:
            return pos[i % n]
        if i < 0:
            return 2 * pos[0] - pos[1]
        if i >= n:
            return 2 * pos[-1] - pos[-2]
        return pos[i]

    out = []
    for s in u:
        i = min(int(s), segments - 1)
        t = s - i
        c = np.eye(4)
        c[:3, 3] = catmull_rom(p(i - 1), p(i), p(i + 1), p(i + 2), t)
        c[:3, :3] = matrix_from_quat(slerp(quats[i % n], quats[(i + 1) % n], t))
        out.append(c)
    return np.stack(out)


# ---------------------------------------------------------------- nerfstudio camera_path.json


def fov_deg(intr: Intrinsics) -> float:
    """Vertical field of view in degrees (three.js: height / 2 = fy * tan(fov / 2))."""
    return math.degrees(2 * math.atan(intr.height / (2 * intr.fy)))


def intrinsics_from_fov(fov: float, width: int, height: int) -> Intrinsics:
    """Centred pinhole camera of ``width`` x ``height`` with vertical field of view ``fov`` degrees."""
    f = height / 2 / math.tan(math.radians(fov) / 2)
    return Intrinsics(width, height, f, f, width / 2, height / 2)


def read_nerfstudio(path: str | Path) -> CameraPath:
    """A nerfstudio ``camera_path.json`` (its frame must be this project's normalized frame).

    Raises:
        ValueError: unreadable file, missing or malformed keys (named), a non-rigid pose.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read camera path: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object with 'camera_path'")
    if doc.get("camera_type", "perspective") != "perspective":
        raise ValueError(f"{path}: camera_type {doc['camera_type']!r}: only 'perspective' paths can be rendered")
    try:
        width, height = int(doc["render_width"]), int(doc["render_height"])
        entries = doc["camera_path"]
        mats = np.array([np.asarray(e["camera_to_world"], np.float64).reshape(4, 4) for e in entries])
        fovs = [float(e["fov"]) for e in entries]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed camera path ({type(exc).__name__}: {exc}); each entry needs "
                         "camera_to_world (16 numbers) and fov, the file render_width and render_height") from None
    if not entries:
        raise ValueError(f"{path}: camera_path is empty")
    if width < 1 or height < 1:
        raise ValueError(f"{path}: render size must be positive, got {width}x{height}")
    bad = [k for k, f in enumerate(fovs) if not 0 < f < 180]
    if bad:
        raise ValueError(f"{path}: fov of frame {bad[0]} is {fovs[bad[0]]}, must be in (0, 180) degrees")
    R = mats[:, :3, :3]
    err = np.abs(np.swapaxes(R, 1, 2) @ R - np.eye(3)).max(axis=(1, 2))
    if not np.isfinite(mats).all() or (err > 1e-3).any():
        k = int(np.argmax(np.where(np.isfinite(err), err, np.inf)))
        raise ValueError(f"{path}: camera_to_world of frame {k} is not a rigid transform (rotation error {err[k]:.3g})")
    fps = doc.get("fps")
    if fps is None and doc.get("seconds"):
        fps = len(entries) / float(doc["seconds"])
    fps = float(fps or 24.0)
    if not 0 < fps <= 240:
        raise ValueError(f"{path}: fps must be in (0, 240], got {fps}")
    return CameraPath(opengl_to_opencv(mats), [intrinsics_from_fov(f, width, height) for f in fovs], fps)


def write_nerfstudio(path: str | Path, cam_path: CameraPath) -> dict:
    """Write ``cam_path`` as a nerfstudio ``camera_path.json`` (atomically); returns the document."""
    from .io import atomic_write_json

    first = cam_path.cameras[0]
    doc = {
        "camera_type": "perspective",
        "render_width": first.width,
        "render_height": first.height,
        "fps": cam_path.fps,
        "seconds": len(cam_path) / cam_path.fps,
        "camera_path": [{"camera_to_world": opencv_to_opengl(m).reshape(-1).tolist(), "fov": fov_deg(c),
                         "aspect": c.width / c.height} for m, c in zip(cam_path.c2w, cam_path.cameras)],
    }
    atomic_write_json(path, doc)
    return doc
