"""End to end: the real `dvc repro` over every stage on a tiny version of the default scene.

Runs in a throwaway git + DVC repo holding a copy of the project's code, `dvc.yaml` and a
`params.yaml` shrunk to seconds (small images, few views, few training steps). Checks the
outs and metrics of every stage, that a second `dvc repro` does nothing, and that changing
a reconstruct param reruns exactly reconstruct, evaluate and report.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from _dvc_project import ROOT, TINY_PIPELINE, copy_pipeline, merge, ran_stages, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]



@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY_PIPELINE)
    return copy_pipeline(tmp_path_factory.mktemp("e2e"), params, "tiny")


def test_repro_runs_every_stage_and_writes_outs(repo: Path):
    out = run(["dvc", "repro"], repo)
    assert ran_stages(out) == ["scene", "ingest", "poses", "reconstruct", "evaluate", "report", "export"]
    poses = json.loads((repo / "data/metrics/poses.full.json").read_text())  # the full records
    assert poses["num_registered"] == poses["num_images"] == 24
    split = json.loads((repo / "data/poses/split.json").read_text())
    assert len(split["test"]) == 3 and len(split["train"]) == 21
    assert (repo / "data/reconstruct/model.pt").is_file()
    ev = json.loads((repo / "data/metrics/evaluate.full.json").read_text())
    assert ev["num_test_views"] == 3
    assert 5.0 < ev["psnr"] < 60.0  # 40 tiny steps: far from converged, but a real number
    for view in split["test"]:
        assert (repo / "data/evaluate/renders" / view).with_suffix(".png").is_file()
    assert ev["orbit"]["frames"] == 4 and (repo / "data/evaluate" / ev["orbit"]["file"]).is_file()
    ns = json.loads((repo / "data/evaluate/metrics.json").read_text())  # ns-eval's shape
    assert ns["results"]["psnr"] == ev["psnr"] and ns["method_name"] == "nerf"
    assert ev["environment"]["code_revision"] and len(ev["environment"]["params_sha256"]) == 64
    html = (repo / "data/report/report.html").read_text()
    assert "PSNR" in html and "data:image/png;base64," in html
    assert f"data:image/{ev['orbit']['file'].rsplit('.', 1)[1]};base64," in html  # the orbit, embedded
    md = (repo / "data/report/report.md").read_text()
    assert f"git checkout {ev['environment']['code_revision']}" in md
    exported = json.loads((repo / "data/export/export.json").read_text())  # 40 steps: a surface is not sure
    assert exported["method"] == "nerf" and exported["mesh"]["grid"][0] == 32 and exported["point_cloud"]["rays"] == 2000


def test_second_repro_does_nothing(repo: Path):
    out = run(["dvc", "repro"], repo)
    assert ran_stages(out) == []


def test_changing_a_reconstruct_param_reruns_only_downstream(repo: Path):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["reconstruct"]["steps"] = 30
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run(["dvc", "repro"], repo)
    assert ran_stages(out) == ["reconstruct", "evaluate", "report", "export"]
