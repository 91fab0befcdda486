"""``nerf.max_resolution: auto``: the finest hash-grid level from the training views' pixel footprint."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.common.params import ParamsError, from_dict
from stages.reconstruct.config import NerfParams
from stages.reconstruct.data import Cameras
from stages.reconstruct.nerf.method import CONTRACTED_FINEST, LOADED_FINEST, finest_resolution

BOX = torch.tensor([[-0.5, -0.25, -0.25], [0.5, 0.25, 0.25]])  # longest side 1


def _scene(distances, focal: float):
    """Views on the x axis at ``distances`` from the box centre (only positions and focal lengths count)."""
    c2w = torch.eye(4).repeat(len(distances), 1, 1)
    c2w[:, 0, 3] = torch.tensor(distances)
    n = len(distances)
    cams = Cameras(torch.full((n,), focal), torch.full((n,), focal), torch.full((n,), 32.0), torch.full((n,), 24.0),
                   torch.full((n,), 64), torch.full((n,), 48))
    return SimpleNamespace(train=SimpleNamespace(c2w=c2w, cameras=cams))


def test_auto_puts_one_finest_cell_in_a_pixel_footprint_at_the_box_centre():
    cfg = NerfParams(max_resolution="auto")
    # at distance 2 a pixel of a 100 px focal length spans 0.02: the box's side of 1 holds 50 of them
    assert finest_resolution(cfg, _scene([2.0, 2.0, 2.0], 100.0), BOX) == 50
    assert finest_resolution(cfg, _scene([2.0, 2.0, 2.0], 400.0), BOX) == 200  # finer pixels, finer grid
    assert finest_resolution(cfg, _scene([1.0, 4.0, 4.0], 400.0), BOX) == 100  # the median view's distance
    assert finest_resolution(cfg, _scene([2.0], 100.0), BOX * 3) == 150  # a bigger box, more cells
    assert finest_resolution(cfg, _scene([2.0], 10.0), BOX) == cfg.base_resolution  # never below the coarsest
    assert finest_resolution(cfg, _scene([2.0], 1e6), BOX) == 8192  # nor past 8192


def test_explicit_contracted_and_loaded_finest():
    scene = _scene([2.0], 100.0)
    assert finest_resolution(NerfParams(max_resolution=300), scene, BOX) == 300
    contracted = NerfParams(max_resolution="auto", scene_contraction="mipnerf360")
    assert finest_resolution(contracted, scene, BOX) == CONTRACTED_FINEST
    # no scene (a model loaded to render): a stand-in, until the state brings the trained levels
    assert finest_resolution(NerfParams(max_resolution="auto"), None, BOX) == LOADED_FINEST


def test_max_resolution_accepts_auto_or_a_resolution_only():
    assert from_dict(NerfParams, {"max_resolution": "auto"}, "reconstruct.nerf").max_resolution == "auto"
    for bad in ("fine", 8):  # 8 < base_resolution 16
        with pytest.raises(ParamsError, match=r"reconstruct\.nerf\.max_resolution"):
            from_dict(NerfParams, {"max_resolution": bad}, "reconstruct.nerf")


def test_a_model_trained_with_auto_renders_with_its_own_levels_when_loaded(tmp_path):
    """The config keeps ``auto``; the state carries the resolved levels, so a model loaded without its
    scene (to render, export, evaluate) rebuilds the grid it was trained with, not the stand-in."""
    import json

    from _tiny_model import make_poses, train_tiny
    from stages.reconstruct.api import load_trained, read_model
    from stages.reconstruct.data import load_scene

    poses = make_poses(tmp_path)
    out = train_tiny(poses, tmp_path / "model", nerf={"max_resolution": "auto"})
    blob = read_model(out)
    assert blob["config"]["nerf"]["max_resolution"] == "auto"
    trained = blob["state"]["field"]["encoding.resolutions"].tolist()
    scene = load_scene(poses)
    want = finest_resolution(from_dict(NerfParams, blob["config"]["nerf"], "nerf"), scene, blob["aabb"])
    assert trained[-1] == want != 2048
    assert json.loads((out / "summary.json").read_text())["finest_resolution"] == want
    model = load_trained(out, device="cpu")
    enc = model.module.field.encoding
    assert enc._resolutions_host == trained and enc.resolutions.tolist() == trained
    # the restored levels are what renders: the stand-in's would give another image
    intr = scene.test.cameras.intrinsics(0)
    a = model.module.render_image(intr, scene.test.c2w[0])
    enc._resolutions_host = [int(r) for r in torch.linspace(4, 2048, len(trained)).tolist()]
    assert not torch.equal(a, model.module.render_image(intr, scene.test.c2w[0]))
