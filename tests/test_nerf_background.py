"""A known background colour (images composited on white/black) is used as is, and saved with the model."""
from __future__ import annotations

import json

import pytest
import torch

from stages.reconstruct.config import ReconstructParams
from stages.reconstruct.data import load_scene
from stages.reconstruct.methods import build_method


def _poses(tmp_path, background=None):
    pytest.importorskip("open3d", reason="the scene generator renders with open3d")
    from stages.scene import SceneParams, poses_from_ground_truth, run as scene_run

    scene_run(SceneParams(width=32, height=24, views=4, rings=1, objects=2), tmp_path / "scene", 0)
    poses = poses_from_ground_truth(tmp_path / "scene" / "images", tmp_path / "poses")
    if background is not None:
        doc = json.loads((poses / "transforms.json").read_text())
        doc["background"] = background
        (poses / "transforms.json").write_text(json.dumps(doc))
    return poses


def test_known_background_is_fixed_and_saved(tmp_path):
    assert load_scene(_poses(tmp_path / "a")).background is None
    scene = load_scene(_poses(tmp_path / "b", "white"))
    assert scene.background == (1.0, 1.0, 1.0)
    params = ReconstructParams(device="cpu")
    method = build_method(params, scene.aabb, torch.device("cpu"), scene.background)
    assert torch.equal(method.field.background_rgb(), torch.ones(3))
    # A ray that misses the box shows exactly the background.
    o, d = torch.tensor([[10.0, 10.0, 10.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    assert torch.equal(method.render_rays(o, d), torch.ones(1, 3))
    # Saved with the model: a fresh method (learned background) loading the state renders white.
    fresh = build_method(params, scene.aabb, torch.device("cpu"))
    assert not torch.equal(fresh.field.background_rgb(), torch.ones(3))
    fresh.load_state_dict(method.state_dict())
    assert torch.equal(fresh.field.background_rgb(), torch.ones(3))
    # A model saved before the buffer existed loads with a learned background.
    old = method.state_dict()
    old["field"] = {k: v for k, v in old["field"].items() if k != "fixed_background"}
    fresh.load_state_dict(old)
    assert torch.equal(fresh.field.background_rgb(), torch.full((3,), 0.5))
