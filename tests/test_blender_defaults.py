"""A Blender / nerf_synthetic folder needs only ``ingest.photos``: ingest reads its train/ and test/
views composited on white, and the poses stage imports its cameras (the ``auto`` defaults)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from stages import ingest, poses
from stages.common import params as P
from _dvc_project import ROOT, copy_pipeline, ran_stages, run
from test_importers import _blender_folder, ring_c2w, write_png


@pytest.fixture
def lego(tmp_path) -> Path:
    """Six train and two test RGBA views with their transforms_*.json, and a val/ view with no cameras."""
    root = _blender_folder(tmp_path / "lego", ring_c2w(8), 6)
    write_png(root / "val" / "r_0.png", 24, 24, rgba=True, seed=99)
    return root


def test_defaults_ingest_and_import_a_blender_folder(lego, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    m = ingest.run(ingest.IngestParams(photos=str(lego)), lego, tmp_path / "ingest")
    assert sorted(e["source"] for e in m["images"]) == [f"test/r_{k}.png" for k in range(2)] + [
        f"train/r_{k}.png" for k in range(6)]
    assert all("alpha composited on white" in e["notes"] for e in m["images"])
    assert [s["source"] for s in m["skipped"] if s["source"].startswith("val/")] == ["val/r_0.png"]
    assert m["layout"]["kind"] == "blender" and m["layout"]["folder"] == lego.as_posix()
    assert set(m["layout"]["camera_files_sha256"]) == {"transforms_train.json", "transforms_test.json"}
    assert "Blender / nerf_synthetic folder" in caplog.text and "recursive: true, alpha: white" in caplog.text

    metrics = poses.run(poses.PosesParams(), tmp_path / "ingest", tmp_path / "poses", tmp_path / "poses.json")
    assert (metrics["source"], metrics["layout"], metrics["camera_file"]) == ("transforms", "blender", lego.as_posix())
    assert metrics["split"] == "given" and (metrics["num_train"], metrics["num_test"]) == (6, 2)
    assert metrics["background"] == "white"
    assert "poses.source: auto -> transforms" in caplog.text


def test_auto_elsewhere_keeps_the_plain_behaviour(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    photos = tmp_path / "photos"
    for k in range(3):
        write_png(photos / f"p{k}.png", 24, 24, rgba=True, seed=k)
    (photos / "sub").mkdir()
    m = ingest.run(ingest.IngestParams(photos=str(photos)), photos, tmp_path / "ingest")
    assert m["layout"] is None and [s["source"] for s in m["skipped"]] == ["sub"]  # not recursive
    assert all("alpha channel dropped" in e["notes"] for e in m["images"])
    resolved = poses.resolve_source(poses.PosesParams(), tmp_path / "ingest")
    assert resolved.source == "sfm" and "poses.source: auto -> sfm" in caplog.text
    with pytest.raises(P.ParamsError, match="poses.camera_file: must name the camera file .*no Blender"):
        poses.resolve_source(poses.PosesParams(source="transforms"), tmp_path / "ingest")
    explicit = poses.PosesParams(source="transforms", camera_file="x/transforms.json")
    assert poses.resolve_source(explicit, tmp_path / "ingest") is explicit


def test_params_yaml_defaults_are_auto():
    data = P.read_yaml(ROOT / "params.yaml")
    assert (data["ingest"]["recursive"], data["ingest"]["alpha"], data["poses"]["source"]) == ("auto", "auto", "auto")
    assert P.load_section(ingest.IngestParams, "ingest", data={"ingest": {"recursive": True}}).recursive is True
    with pytest.raises(P.ParamsError, match="ingest.recursive: expected"):
        P.load_section(ingest.IngestParams, "ingest", data={"ingest": {"recursive": "yes"}})


@pytest.mark.integration
@pytest.mark.slow
def test_dvc_exp_run_with_only_the_photo_folder(lego, tmp_path):
    """`dvc exp run -S ingest.photos=<folder> poses` in a copy of the project: one -S, cameras imported."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    repo = copy_pipeline(tmp_path / "repo", params, "code")
    out = run(["dvc", "exp", "run", "-S", f"ingest.photos={lego}", "poses"], repo)
    assert ran_stages(out) == ["ingest", "poses"], out[-2000:]
    m = json.loads((repo / "data/metrics/poses.full.json").read_text())
    assert (m["source"], m["split"], m["num_registered"]) == ("transforms", "given", 8)
