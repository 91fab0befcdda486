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
