"""Portrait and landscape photos with one camera each, by every route: imported cameras ->
reconstruct (a few steps) -> evaluate with every test view's own camera, and structure from
motion with the default ``camera_mode: auto``."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from PIL import Image  # before pycolmap (their bundled zlib copies clash the other way round)

from _dvc_project import TINY_NERF
from stages import evaluate, poses
from stages.common import cameras as C
from stages.common.params import from_dict
from stages.reconstruct import ReconstructParams
from stages.reconstruct import run as reconstruct

QUIET = logging.getLogger("test.mixed.quiet")
QUIET.setLevel(logging.WARNING)


def _transforms_json(frames: list[dict], path) -> None:
    """A nerfstudio transforms.json of ``frames`` (tests/_synthetic.py): per-frame intrinsics."""
    out = [{"file_path": f"images/{f['file']}", "transform_matrix": C.opencv_to_opengl(C.w2c_to_c2w(f["w2c"])).tolist(),
            "w": f["width"], "h": f["height"], "fl_x": f["K"][0, 0], "fl_y": f["K"][1, 1], "cx": f["K"][0, 2],
            "cy": f["K"][1, 2]} for f in frames]
    path.write_text(json.dumps({"camera_model": "OPENCV", "frames": out}))


def test_portrait_and_landscape_import_reconstruct_and_evaluate(tmp_path):
    import _synthetic

    frames = _synthetic.make_mixed_ingest(tmp_path / "ingest", views=8)
    _transforms_json(frames, tmp_path / "ingest" / "transforms.json")
    m = poses.run(poses.PosesParams(source="transforms", camera_file=str(tmp_path / "ingest" / "transforms.json"),
                                    test_every=3), tmp_path / "ingest", tmp_path / "poses", tmp_path / "poses.json")
    assert m["num_registered"] == 8 and m["num_cameras"] == 8 and m["num_test"] == 3

    params = from_dict(ReconstructParams, {"device": "cpu", "steps": 4, "batch_rays": 256, "eval_every": 2,
                                           "tensorboard": False, "nerf": TINY_NERF,
                                           "distributed": {"checkpoint_every": 0}}, "reconstruct")
    summary = reconstruct(params, tmp_path / "poses", tmp_path / "model", progress=False)
    assert summary["steps"] == 4 and summary["final_test_psnr_sampled"] is not None

    ev = evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=2, orbit_size=16)  # auto: the CPU profile
    em = evaluate.run(ev, tmp_path / "poses", tmp_path / "model", tmp_path / "evaluate", tmp_path / "evaluate.json",
                      params_path=None)
    per_view = json.loads((tmp_path / "evaluate" / "per_view.json").read_text())
    # every 3rd view is a test view, view 3 in portrait: each rendered at its own camera's size (the
    # CPU profile's 400 px longest side leaves these 96 px views as they are)
    assert [r["file"] for r in per_view] == ["view_000.png", "view_003.png", "view_006.png"]
    assert em["resolution_scale"] == 1.0 and em["eval_profile"].endswith("(CPU profile)")
    assert em["test_view_sizes"] == ["96x72", "72x96"]
    for r in per_view:
        f = next(f for f in frames if f["file"] == r["file"])
        with Image.open(tmp_path / "evaluate" / "renders" / r["file"]) as im:
            assert im.size == (f["width"], f["height"]) == (r["width"], r["height"])
        assert np.isfinite(r["psnr"]) and 0 < r["ssim"] < 1


def _portrait_ingest(root, views: int = 16):
    """A 2-ring capture at 200x150 with every odd view taken in portrait (150x200)."""
    import _synthetic

    return _synthetic.make_mixed_ingest(root, views=views, rings=2, size=(200, 150), focal_spread=0.0)


@pytest.mark.slow
def test_sfm_auto_gives_portrait_and_landscape_their_own_cameras(tmp_path):
    frames = _portrait_ingest(tmp_path / "ingest")
    m = poses.run(poses.PosesParams(max_features=4096), tmp_path / "ingest", tmp_path / "poses",
                  tmp_path / "poses.json")  # camera_mode: auto, the default
    assert m["camera_mode"] == "auto" and m["num_cameras"] == 2 and m["num_registered"] == 16
    assert not m["geometry"]["degenerate"], m["geometry"]
    intrs, files, c2w, doc = C.read_transforms(tmp_path / "poses" / "transforms.json")
    assert "fl_x" not in doc
    for f, intr in zip(frames, intrs):
        assert (intr.width, intr.height) == (f["width"], f["height"])
        # one lens: both cameras find its focal length (the SfM estimate, within 3 %)
        assert intr.fx == pytest.approx(f["K"][0, 0], rel=0.03)
    gt_c2w = np.stack([C.w2c_to_c2w(f["w2c"]) for f in frames])
    err = C.pose_errors(c2w, gt_c2w, ref_scale=1.5)  # aligned by a similarity; the scene's radius (_synthetic.py)
    assert err["center_error_max"] < 0.03 and err["rotation_error_max_deg"] < 1.0, err
