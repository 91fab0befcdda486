"""Shared test helpers: the GPU skip marker and the path to the shared data sets."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def import_or_skip_on_gpu_host(name: str, reason: str):
    """``import name``; where it is missing on a machine with a CUDA GPU (the lent GPU machine has
    a fixed package set without it) the test is skipped with ``reason``. On a CPU-only machine
    (CI) a missing package is an error, so a missing install step cannot hide behind a skip."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if not torch.cuda.is_available():
            raise
        pytest.skip(f"{name} is not installed here: {reason}", allow_module_level=True)


def generated_scene(root: Path, width: int, height: int, views: int, objects: int = 3) -> Path:
    """``root/scene``: the default scene generator's images and ground truth (stages/scene.py) at this
    size, one ring of cameras. The generator ray-casts with open3d, which the lent GPU machine lacks:
    with ``RAYFORGE_SCENE_CACHE=<dir>`` a scene generated here is also stored there, and where open3d
    is missing a stored one is copied instead (the cache travels to the GPU machine with the call)."""
    import os
    import shutil

    cache = os.environ.get("RAYFORGE_SCENE_CACHE")
    stored = Path(cache) / f"{width}x{height}x{views}o{objects}" if cache else None
    out = root / "scene"
    try:
        importlib.import_module("open3d")
    except ImportError:
        if stored is not None and (stored / "images").is_dir():
            shutil.copytree(stored, out)
            return out
    import_or_skip_on_gpu_host("open3d", "the synthetic scene (stages/scene.py) ray-casts with it")
    from stages.scene import SceneParams, run as scene_run

    scene_run(SceneParams(width=width, height=height, views=views, rings=1, objects=objects), out, 0)
    if stored is not None and not stored.exists():
        shutil.copytree(out, stored)
    return out

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (only beside the project's own checkout)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> tuple[Path, Path]:
    """(poses folder, model folder) of a tiny NeRF trained for a few CPU steps (tests/_tiny_model.py),
    shared by the tools' tests (viewer, videos, export)."""
    from _tiny_model import make_poses, train_tiny

    root = tmp_path_factory.mktemp("tiny_model")
    poses = make_poses(root)
    return poses, train_tiny(poses, root / "model")
