"""Which training data a model was trained on: a fingerprint of the poses stage's out.

``sha256`` over ``transforms.json``, ``split.json``, the sparse points (``points3D.ply``) and the
bytes of every image the frames name, each with its name and length. The reconstruct stage
stamps it into its checkpoints and ``summary.json``; a checkpoint of other data is not resumed,
and a model is not evaluated against another scene's poses. The images are read once more for
it (the stage reads them anyway): ~10 ms for the default scene's 48 PNGs, ~1 s per GB.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

POSES_FILES = ("transforms.json", "split.json", "points3D.ply")
_CHUNK = 1 << 20


def _feed(h, name: str, path: Path) -> None:
    h.update(name.encode() + b"\0")
    if not path.is_file():
        h.update(b"<absent>\0")
        return
    h.update(str(path.stat().st_size).encode() + b"\0")
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def data_fingerprint(poses_dir: str | Path) -> str:
    """``sha256:<hex>`` of the training data in ``poses_dir`` (see the module docstring)."""
    poses_dir = Path(poses_dir)
    h = hashlib.sha256()
    for name in POSES_FILES:
        _feed(h, name, poses_dir / name)
    try:
        frames = json.loads((poses_dir / "transforms.json").read_text()).get("frames") or []
    except (OSError, ValueError, AttributeError):  # the stage's own loader says what is wrong
        frames = []
    for frame in frames:
        name = frame.get("file_path") if isinstance(frame, dict) else None
        if isinstance(name, str):
            _feed(h, name, poses_dir / name)
    return "sha256:" + h.hexdigest()


def short(fingerprint: str | None) -> str:
    """The first 12 hex digits, for messages."""
    return "none recorded" if not fingerprint else fingerprint.split(":", 1)[-1][:12]
