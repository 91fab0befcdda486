"""Camera conventions, in one place.

Inside the project every pose is OpenCV-style (x right, y down, z forward) and stored
the way COLMAP stores it: ``world_to_camera`` 4x4 matrices. At the edges we read and
write the OpenGL / NeRF ``transform_matrix`` (camera-to-world, x right, y up, z back)
used by instant-ngp, nerfstudio and the Blender synthetic scenes.

Converting between the two flips the camera's y and z axes:
``c2w_gl = c2w_cv @ diag(1, -1, -1, 1)`` (the same matrix converts back).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

CV_TO_GL = np.diag([1.0, -1.0, -1.0, 1.0])


@dataclass(frozen=True)
class Intrinsics:
    """Pinhole intrinsics in pixels; the pixel (0, 0) centre is at (0.5, 0.5)."""

    width: int
    height: int
    fx: float
    fy: float
    cx: float
    cy: float

    def K(self) -> np.ndarray:
        return np.array([[self.fx, 0, self.cx], [0, self.fy, self.cy], [0, 0, 1.0]])

    def scaled(self, factor: float) -> "Intrinsics":
        """Intrinsics of the image resized by ``factor`` (e.g. 0.5 for half size)."""
        w, h = round(self.width * factor), round(self.height * factor)
        sx, sy = w / self.width, h / self.height
        return Intrinsics(w, h, self.fx * sx, self.fy * sy, self.cx * sx, self.cy * sy)

    def to_dict(self) -> dict:
        return asdict(self)


def invert_rigid(T: np.ndarray) -> np.ndarray:
    """Inverse of a 4x4 rigid (or similarity-free) transform [R t; 0 1]."""
    T = np.asarray(T, dtype=np.float64)
    R, t = T[..., :3, :3], T[..., :3, 3]
    out = np.zeros_like(T)
    Rt = np.swapaxes(R, -1, -2)
    out[..., :3, :3] = Rt
    out[..., :3, 3] = -(Rt @ t[..., None])[..., 0]
    out[..., 3, 3] = 1.0
    return out


def w2c_to_c2w(w2c: np.ndarray) -> np.ndarray:
    return invert_rigid(w2c)


def c2w_to_w2c(c2w: np.ndarray) -> np.ndarray:
    return invert_rigid(c2w)


def opencv_to_opengl(c2w_cv: np.ndarray) -> np.ndarray:
    """Camera-to-world, OpenCV axes -> OpenGL axes (NeRF ``transform_matrix``)."""
    return np.asarray(c2w_cv, dtype=np.float64) @ CV_TO_GL


def opengl_to_opencv(c2w_gl: np.ndarray) -> np.ndarray:
    """Camera-to-world, OpenGL axes -> OpenCV axes."""
    return np.asarray(c2w_gl, dtype=np.float64) @ CV_TO_GL


def project(K: np.ndarray, w2c: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Project world points [N, 3] to pixels [N, 2] with an OpenCV camera."""
    p = (w2c[:3, :3] @ np.asarray(points, dtype=np.float64).T + w2c[:3, 3:4]).T
    uv = (K @ p.T).T
    return uv[:, :2] / uv[:, 2:3]


def camera_centers(w2c: np.ndarray) -> np.ndarray:
    """Camera centres in world coordinates, [N, 3] from [N, 4, 4]."""
    return w2c_to_c2w(w2c)[..., :3, 3]


def rotation_between(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The 3x3 rotation that turns unit vector ``a`` onto unit vector ``b``."""
    a = a / np.linalg.norm(a)
    b = b / np.linalg.norm(b)
    v = np.cross(a, b)
    c = float(np.dot(a, b))
    if c < -1 + 1e-9:  # opposite: rotate pi about any axis orthogonal to a
        axis = np.cross(a, [1.0, 0, 0])
        if np.linalg.norm(axis) < 1e-6:
            axis = np.cross(a, [0, 1.0, 0])
        axis /= np.linalg.norm(axis)
        return 2 * np.outer(axis, axis) - np.eye(3)
    vx = np.array([[0, -v[2], v[1]], [v[2], 0, -v[0]], [-v[1], v[0], 0]])
    return np.eye(3) + vx + vx @ vx / (1 + c)


def normalization_transform(c2w_cv: np.ndarray, align_up: bool = True) -> np.ndarray:
    """A 4x4 similarity that centres the cameras at the origin, scales the farthest
    camera to distance 1 and (optionally) turns the mean camera "up" to +z.

    Returns ``S`` such that a world point ``x`` maps to ``S @ [x, 1]``.
    """
    c2w_cv = np.asarray(c2w_cv, dtype=np.float64)
    centers = c2w_cv[:, :3, 3]
    R = np.eye(3)
    if align_up:
        up = -c2w_cv[:, :3, 1].mean(axis=0)  # OpenCV y points down in the image
        if np.linalg.norm(up) > 1e-6:
            R = rotation_between(up, np.array([0.0, 0.0, 1.0]))
    center = centers.mean(axis=0)
    radius = np.linalg.norm((centers - center) @ R.T, axis=1).max()
    scale = 1.0 / radius if radius > 1e-9 else 1.0
    S = np.eye(4)
    S[:3, :3] = scale * R
    S[:3, 3] = -scale * (R @ center)
    return S


def apply_similarity_to_c2w(S: np.ndarray, c2w: np.ndarray) -> np.ndarray:
    """Map camera-to-world poses [N, 4, 4] through similarity ``S``; rotations stay orthonormal."""
    scale = np.cbrt(np.linalg.det(S[:3, :3]))
    R = S[:3, :3] / scale
    out = np.array(c2w, dtype=np.float64, copy=True)
    out[..., :3, :3] = R @ out[..., :3, :3]
    out[..., :3, 3] = (S[:3, :3] @ out[..., :3, 3, None])[..., 0] + S[:3, 3]
    return out


def apply_similarity_to_points(S: np.ndarray, points: np.ndarray) -> np.ndarray:
    return np.asarray(points, dtype=np.float64) @ S[:3, :3].T + S[:3, 3]


# ---------------------------------------------------------------- transforms.json

FRAME_CAMERA_KEYS = ("fl_x", "fl_y", "cx", "cy", "w", "h")  # nerfstudio's per-frame intrinsics


def _camera_keys(intr: Intrinsics) -> dict[str, Any]:
    return {"w": intr.width, "h": intr.height, "fl_x": intr.fx, "fl_y": intr.fy, "cx": intr.cx, "cy": intr.cy}


def write_transforms(
    path: str | Path,
    intr: Intrinsics | Sequence[Intrinsics],
    files: list[str],
    c2w_cv: np.ndarray,
    extra: dict[str, Any] | None = None,
    frame_extra: Sequence[dict[str, Any]] | None = None,
) -> dict:
    """Write a nerfstudio / instant-ngp ``transforms.json`` (OpenGL ``transform_matrix``);
    ``extra``: more top-level keys, ``frame_extra``: more keys for each frame.

    ``intr``: one camera for every frame, or one per frame. Cameras that all agree are written
    once at the top level (``w h fl_x fl_y cx cy``); otherwise every frame carries its own
    ``fl_x fl_y cx cy w h`` and the top level none, as nerfstudio's ``colmap_to_json`` writes a
    model with several cameras (so a reader that knows only the top-level keys fails instead of
    using the wrong camera).
    """
    from .io import atomic_write_json

    cams = [intr] * len(files) if isinstance(intr, Intrinsics) else list(intr)
    if len(cams) != len(files):
        raise ValueError(f"write_transforms: {len(cams)} cameras for {len(files)} frames")
    shared = len(set(cams)) == 1
    doc: dict[str, Any] = {"camera_model": "OPENCV"}
    if shared:
        doc.update(_camera_keys(cams[0]))
    doc.update({"k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0})
    doc.update(extra or {})
    frames = []
    for k, (f, m, cam) in enumerate(zip(files, c2w_cv, cams)):
        frame: dict[str, Any] = {"file_path": f, "transform_matrix": opencv_to_opengl(m).tolist()}
        frame.update(frame_extra[k] if frame_extra else {})
        if not shared:
            frame.update({key: _camera_keys(cam)[key] for key in FRAME_CAMERA_KEYS})
        frames.append(frame)
    doc["frames"] = frames
    atomic_write_json(path, doc)
    return doc


def split_keys(split: dict[str, list[str]], folder: str = "images") -> dict[str, list[str]]:
    """nerfstudio's split keys for ``split.json``'s split: ``train_filenames``, ``val_filenames``
    and ``test_filenames`` (the test views for both: nerfstudio evaluates on "val" while it trains),
    paths as the frames' ``file_path``."""
    test = [f"{folder}/{n}" for n in split["test"]]
    return {"train_filenames": [f"{folder}/{n}" for n in split["train"]], "val_filenames": test,
            "test_filenames": list(test)}


def frame_intrinsics(doc: dict, frame: dict, where: str) -> Intrinsics:
    """The camera of one frame of a ``transforms.json``: its own keys, else the top-level ones.

    Raises ValueError naming ``where`` (the frame's image) for a missing or malformed key, a size
    that is not a positive whole number or a focal length that is not > 0."""
    def get(key: str, default: Any = None) -> Any:
        v = frame.get(key, doc.get(key, default))
        if v is None:
            raise ValueError(f"{where}: no {key!r} in the frame or at the top level of transforms.json")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise ValueError(f"{where}: {key} must be a finite number, got {v!r}")
        return v

    w, h = get("w"), get("h")
    if w != int(w) or h != int(h) or w < 1 or h < 1:
        raise ValueError(f"{where}: image size must be whole positive pixels, got w={w!r} h={h!r}")
    fx = float(get("fl_x"))
    fy = float(get("fl_y", fx))
    if fx <= 0 or fy <= 0:
        raise ValueError(f"{where}: focal length must be > 0, got fl_x={fx:g} fl_y={fy:g}")
    return Intrinsics(int(w), int(h), fx, fy, float(get("cx", w / 2)), float(get("cy", h / 2)))


def read_transforms(path: str | Path) -> tuple[list[Intrinsics], list[str], np.ndarray, dict]:
    """Read a ``transforms.json``; returns the cameras (one per frame: the frame's own
    ``fl_x fl_y cx cy w h``, else the top-level ones), the file paths, OpenCV camera-to-world
    poses [N, 4, 4] and the document."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read transforms: {exc}") from None
    try:
        frames = doc["frames"]
        files = [str(f["file_path"]) for f in frames]
        mats = np.array([f["transform_matrix"] for f in frames], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed transforms.json ({exc!r})") from None
    if not files:
        raise ValueError(f"{path}: malformed transforms.json (no frames)")
    if mats.ndim != 3 or mats.shape[1:] != (4, 4):
        raise ValueError(f"{path}: transform_matrix must be 4x4, got shape {mats.shape[1:]}")
    cams = [frame_intrinsics(doc, fr, f"{path}, frame {f}") for f, fr in zip(files, frames)]
    return cams, files, opengl_to_opencv(mats), doc


# ---------------------------------------------------------------- alignment, pose errors


def umeyama(src: np.ndarray, dst: np.ndarray, with_scale: bool = True) -> tuple[float, np.ndarray, np.ndarray]:
    """Least-squares similarity taking points ``src`` [N, 3] onto ``dst`` [N, 3].

    Returns ``(scale, R, t)`` minimising ``sum |dst_i - (scale * R @ src_i + t)|^2`` with ``R`` a
    proper rotation (det +1). Umeyama, "Least-squares estimation of transformation parameters
    between two point patterns", TPAMI 1991.

    Example: ``umeyama(x, 2 * x @ R.T + [1, 0, 0])`` returns ``(2.0, R, [1, 0, 0])``.
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 3:
        raise ValueError(f"umeyama: need two [N, 3] arrays of the same shape, got {src.shape} and {dst.shape}")
    if len(src) < 3:
        raise ValueError(f"umeyama: need at least 3 point pairs, got {len(src)}")
    mu_s, mu_d = src.mean(axis=0), dst.mean(axis=0)
    xs, xd = src - mu_s, dst - mu_d
    var_s = float((xs**2).sum(axis=1).mean())
    if var_s < 1e-18:
        raise ValueError("umeyama: the source points all coincide")
    cov = xd.T @ xs / len(src)
    U, D, Vt = np.linalg.svd(cov)
    S = np.eye(3)
    if np.linalg.det(U) * np.linalg.det(Vt) < 0:
        S[2, 2] = -1.0
    R = U @ S @ Vt
    scale = float(np.trace(np.diag(D) @ S) / var_s) if with_scale else 1.0
    t = mu_d - scale * R @ mu_s
    return scale, R, t


def similarity_matrix(scale: float, R: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The 4x4 matrix of ``x -> scale * R @ x + t``."""
    S = np.eye(4)
    S[:3, :3] = scale * np.asarray(R, dtype=np.float64)
    S[:3, 3] = t
    return S


def rotation_angle_deg(R_a: np.ndarray, R_b: np.ndarray) -> np.ndarray:
    """Angle in degrees of the relative rotation ``R_a^T R_b``, for [..., 3, 3] stacks."""
    rel = np.swapaxes(np.asarray(R_a, dtype=np.float64), -1, -2) @ np.asarray(R_b, dtype=np.float64)
    cos = (np.trace(rel, axis1=-2, axis2=-1) - 1.0) / 2.0
    # sin from the skew part: atan2 stays accurate near 0 and 180 degrees, where arccos is not
    skew = np.stack([rel[..., 2, 1] - rel[..., 1, 2], rel[..., 0, 2] - rel[..., 2, 0],
                     rel[..., 1, 0] - rel[..., 0, 1]], -1)
    sin = np.linalg.norm(skew, axis=-1) / 2.0
    return np.degrees(np.arctan2(sin, cos))


def pose_errors(c2w_est: np.ndarray, c2w_ref: np.ndarray, ref_scale: float = 1.0) -> dict[str, Any]:
    """Compare estimated camera-to-world poses [N, 4, 4] with reference ones in another frame.

    The estimated camera centres are aligned to the reference centres with :func:`umeyama`
    (a similarity: SfM has no absolute scale or frame); the same similarity turns the
    estimated orientations. Centre errors are divided by ``ref_scale`` (e.g. the scene
    radius); rotation errors are in degrees. Both conventions (OpenCV / OpenGL) work as long
    as the two stacks use the same one.
    """
    c2w_est = np.asarray(c2w_est, dtype=np.float64)
    c2w_ref = np.asarray(c2w_ref, dtype=np.float64)
    scale, R, t = umeyama(c2w_est[:, :3, 3], c2w_ref[:, :3, 3])
    aligned = apply_similarity_to_c2w(similarity_matrix(scale, R, t), c2w_est)
    center_err = np.linalg.norm(aligned[:, :3, 3] - c2w_ref[:, :3, 3], axis=1) / ref_scale
    rot_err = rotation_angle_deg(aligned[:, :3, :3], c2w_ref[:, :3, :3])
    return {
        "center_error_mean": float(center_err.mean()),
        "center_error_max": float(center_err.max()),
        "rotation_error_mean_deg": float(rot_err.mean()),
        "rotation_error_max_deg": float(rot_err.max()),
        "alignment": similarity_matrix(scale, R, t),
        "center_errors": center_err,
        "rotation_errors_deg": rot_err,
    }
