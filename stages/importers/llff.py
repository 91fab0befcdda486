"""LLFF ``poses_bounds.npy``: N x 17 rows of a 3x5 pose-and-intrinsics matrix and near/far bounds."""
from __future__ import annotations

import tokenize
from pathlib import Path
from typing import Any

import numpy as np

from .scene import IMAGE_EXTS, Camera, ImportedScene, _fail, _number, _side, rigid


def _llff_names(folder: Path) -> list[str]:
    for sub in ["images"] + sorted(p.name for p in folder.glob("images_*")):
        d = folder / sub
        if d.is_dir():
            names = sorted(p.name for p in d.iterdir() if p.suffix.lower() in IMAGE_EXTS)
            if names:
                return [f"{sub}/{n}" for n in names]
    raise _fail(folder, "no images/ (or images_N/) folder to match poses_bounds.npy rows with")


def parse_poses_bounds(arr: Any, where: Any, names: list[str]) -> ImportedScene:
    """LLFF ``poses_bounds.npy`` contents [N, 17] -> scene; row k belongs to ``names[k]``.

    Each row is a 3x5 matrix (row-major) [rotation columns down, right, back | centre |
    (H, W, focal)] in a camera-to-world sense, then near and far depth.
    """
    a = np.asarray(arr)
    if a.ndim != 2 or a.shape[1] != 17 or len(a) == 0 or a.dtype.kind not in "fiu":
        raise _fail(where, f"expected an N x 17 array of numbers, got shape {a.shape} of {a.dtype}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise _fail(where, "has non-finite values")
    if len(names) != len(a):
        raise _fail(where, f"has {len(a)} rows but there are {len(names)} images to match in sorted-name order")
    m = a[:, :15].reshape(-1, 3, 5)
    cameras, c2w = [], []
    for k, row in enumerate(m):
        at = f"{where}, row {k} ({names[k]})"
        T = np.eye(4)
        T[:3, 0], T[:3, 1], T[:3, 2] = row[:, 1], row[:, 0], -row[:, 2]  # (down, right, back) -> (right, down, forward)
        T[:3, 3] = row[:, 3]
        c2w.append(rigid(T, "pose", at))
        h, w = _side(row[0, 4], "H", at), _side(row[1, 4], "W", at)
        f = _number(row[2, 4], "focal", at, positive=True)
        cameras.append(Camera(w, h, f, f, w / 2, h / 2))
    near_far = a[:, 15:17]
    if (near_far[:, 0] <= 0).any() or (near_far[:, 1] <= near_far[:, 0]).any():
        raise _fail(where, "near/far bounds must satisfy 0 < near < far in every row")
    return ImportedScene("llff", "llff", Path(str(where)), list(names), cameras, np.stack(c2w), near_far=near_far)


def read_llff(path: str | Path, names: list[str] | None = None) -> ImportedScene:
    """``poses_bounds.npy`` (or a folder holding it). ``names``: the images in row order;
    by default the sorted images of ``images/`` (or the first ``images_N/``) beside it."""
    path = Path(path)
    if path.is_dir():
        path = path / "poses_bounds.npy"
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, SyntaxError, tokenize.TokenError) as exc:  # a mangled header: the last two
        raise _fail(path, f"cannot read as a .npy array ({exc})") from None
    return parse_poses_bounds(arr, path, names if names is not None else _llff_names(path.parent))
