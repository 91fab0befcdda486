"""The comparison page (stages/compare.py) from real `dvc exp run` experiments of a tiny pipeline.

A throwaway git + DVC repo holds a copy of the project's code, `dvc.yaml`, `.gitignore`
and a `params.yaml` shrunk to seconds (as in test_pipeline_e2e.py, smaller still). After
the baseline `dvc repro` and commit, two experiments each rerun only the tail of the
pipeline (reconstruct, evaluate, report): fewer steps, and two gloo workers instead of one
(a world-size change, so the page gets a scaling table). The workspace is reset to the
baseline between them so that each differs from the baseline in one param only.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from stages import compare
from _dvc_project import ROOT, TINY_PIPELINE, copy_pipeline, merge, optional_off, ran_stages, run

# the e2e test's tiny pipeline with fewer views and steps: the baseline repro takes ~15 s on 2 cores
SMALL = merge(TINY_PIPELINE, {"scene": {"views": 16},
                              "reconstruct": {"steps": 20, "eval_every": 10, "distributed": {"checkpoint_every": 0}},
                              "report": {"max_views": 1}})
EXPERIMENTS = {"fewer-steps": ["reconstruct.steps=10"], "two-workers": ["reconstruct.distributed.cpu_workers=2"]}


@pytest.fixture(scope="module")
def exp_repo(tmp_path_factory) -> Path:
    params = optional_off(merge(yaml.safe_load((ROOT / "params.yaml").read_text()), SMALL))
    repo = copy_pipeline(tmp_path_factory.mktemp("compare"), params, "code")  # the baseline's metrics name a revision
    run(["dvc", "repro"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline"], repo)
    for name, sets in EXPERIMENTS.items():
        out = run(["dvc", "exp", "run", "-n", name] + [a for s in sets for a in ("-S", s)], repo)
        assert ran_stages(out) == ["reconstruct", "evaluate", "report", "export"], out[-2000:]
        run(["git", "reset", "-q", "--hard"], repo)  # back to the baseline's params, lock and metrics
        run(["dvc", "checkout", "-q", "--force"], repo)
    return repo


@pytest.mark.integration
@pytest.mark.slow
def test_compare_real_experiments(exp_repo: Path):
    out = run(["python", "-m", "stages.compare", "--out", "data/compare"], exp_repo)
    assert out.strip().splitlines()[-1] == f"Comparison: {(exp_repo / 'data/compare/compare.html').resolve()}"
    doc = json.loads((exp_repo / "data/compare/compare.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    base = next(r for r in doc["rows"] if r["role"] == "baseline")  # the branch of the baseline commit
    # the workspace equals the baseline after the reset, so it is not a row of its own
    assert set(rows) == {base["name"], "fewer-steps", "two-workers"}
    assert base["changed"] == [] and not base["error"]
    assert doc["runs"][0]["metrics"]["evaluate"]["environment"]["code_revision"]
    assert rows["fewer-steps"]["changed"] == ["reconstruct.steps=10 (was 20)"]
    assert rows["two-workers"]["changed"] == ["reconstruct.distributed.cpu_workers=2 (was 1)"]
    runs = {r["name"]: r for r in doc["runs"]}
    for r in runs.values():  # every run kept its metrics (they are git-tracked, not git-ignored)
        assert {"poses", "reconstruct", "evaluate"} <= set(r["metrics"]), r["name"]
    assert runs["two-workers"]["metrics"]["evaluate"]["world_size"] == 2
    assert runs["fewer-steps"]["metrics"]["evaluate"]["steps"] == 10

    # the deltas are what `dvc metrics diff` says between the baseline commit and the experiment
    headers = [c.header for c in compare.COLUMNS]
    for name in EXPERIMENTS:
        diff = json.loads(run(["dvc", "metrics", "diff", "--json", base["name"], runs[name]["rev"]], exp_repo))
        d = diff["data/metrics/evaluate.json"]["psnr"]["diff"]
        cell = rows[name]["cells"][headers.index("PSNR (dB)")]
        assert cell["delta"] == f"{d:+.2f} dB"
        assert cell["value"] == f"{runs[name]['metrics']['evaluate']['psnr']:.2f}"
    assert rows["two-workers"]["cells"][headers.index("world size")]["value"] == "2"
    assert rows["fewer-steps"]["cells"][headers.index("registered images")]["value"] == "16 / 16"

    # the world-size change gives one scaling table: baseline (1 worker) and two-workers
    assert len(doc["scaling"]) == 1
    table = doc["scaling"][0]
    assert [(t["name"], t["gpus"]) for t in table] == [(base["name"], 1), ("two-workers", 2)]
    assert table[0]["speedup"] == pytest.approx(1.0)
    for t in table:
        assert {"speedup", "efficiency", "samples_per_s", "wall_s", "psnr"} <= set(t)

    page = (exp_repo / "data/compare/compare.html").read_text()
    md = (exp_repo / "data/compare/compare.md").read_text()
    for cls in ("experiments", "scaling", "environment"):
        assert f'<table class="{cls}">' in page
    assert page.count('<tr class="baseline">') == 1
    assert "reconstruct.steps=10 (was 20)" in page and "reconstruct.steps=10 (was 20)" in md
    assert not re.search(r"https?://", page) and not re.search(r"<(script|link|iframe)\b", page)
    assert re.findall(r'<img\b[^>]*src="([^"]{0,22})', page) == ["data:image/png;base64,"]
    assert f"**{base['name']}** (baseline)" in md and "## Scaling" in md
    assert (exp_repo / "data/compare/assets/psnr.png").is_file()


# ---------------------------------------------------------------- without DVC: the parsing rules


def _entry(rev: str, name: str | None, params: dict, metrics: dict | None, error=None) -> dict:
    m = {"data/metrics/evaluate.json": {"data": metrics}} if metrics is not None else {
        "data/metrics/evaluate.json": {"error": {"type": "FileNotFoundError", "msg": "missing"}}}
    return {"rev": rev, "name": name, "error": error,
            "data": {"rev": rev, "timestamp": "2026-01-01T00:00:00", "params": {"params.yaml": {"data": params}},
                     "metrics": m, "deps": {}, "outs": {}, "meta": {}}}


def test_parse_baselines_failed_runs_and_workspace():
    p0 = {"reconstruct": {"steps": 20, "distributed": {"gpus": "auto"}}}
    p1 = {"reconstruct": {"steps": 40, "distributed": {"gpus": "auto"}}}
    base = _entry("a" * 40, "main", p0, None)  # metrics not in git: no metrics at the commit
    rerun = _entry("b" * 40, "rerun", p0, {"psnr": 20.0, "world_size": 1})
    longer = _entry("c" * 40, "longer", p1, {"psnr": 21.5, "world_size": 1})
    broken = _entry("d" * 40, "broken", p1, None, error={"type": "ReproductionError", "msg": "stage failed"})
    base["experiments"] = [{"name": n, "executor": None, "revs": [e]} for n, e in
                           (("longer", longer), ("rerun", rerun), ("broken", broken))]
    ws = _entry("workspace", None, p1, {"psnr": 21.5, "world_size": 1})  # same as `longer`: dropped
    runs = compare.parse_exp_show([ws, base])
    assert [r.name for r in runs] == ["main", "longer", "rerun", "broken"]
    assert "no metrics" in runs[0].error and "stage failed" in runs[3].error
    bases = compare.choose_baselines(runs)
    assert bases["a" * 40].name == "rerun"  # an experiment with the commit's params stands in for it
    rows = {r["name"]: r for r in compare.table_rows(runs, bases)}
    assert [r["name"] for r in rows.values() if r["role"] == "baseline"] == ["rerun"]
    assert rows["main"]["role"] == "commit" and rows["main"]["baseline"] == "rerun"
    assert rows["longer"]["changed"] == ["reconstruct.steps=40 (was 20)"]
    assert rows["longer"]["cells"][0] == {"value": "21.50", "delta": "+1.50 dB"}
    assert rows["broken"]["cells"][0]["value"] == "n/a"
    assert compare.choose_baselines(runs, "longer")["a" * 40].name == "longer"
    with pytest.raises(ValueError, match="--baseline 'nope': no such experiment"):
        compare.choose_baselines(runs, "nope")
    with pytest.raises(ValueError, match="expected a list"):
        compare.parse_exp_show({"not": "a list"})


def test_main_from_saved_json(tmp_path, capsys):
    p = {"reconstruct": {"steps": 20}}
    base = _entry("a" * 40, "main", p, {"psnr": 20.0, "ssim": 0.8, "world_size": 1})
    base["experiments"] = [{"name": "b", "executor": None,
                            "revs": [_entry("b" * 40, "b", {"reconstruct": {"steps": 30}}, {"psnr": 19.0})]}]
    saved = tmp_path / "exps.json"
    saved.write_text(json.dumps([base]))
    assert compare.main(["--out", str(tmp_path / "out"), "--from-json", str(saved)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"Comparison: {(tmp_path / 'out' / 'compare.html').resolve()}")
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| **main** (baseline) | aaaaaaa | — | 20.00 |" in md
    assert "| b | bbbbbbb | reconstruct.steps=30 (was 20) | 19.00 (-1.00 dB) |" in md
    assert "## Scaling" not in md  # one world size only
    saved.write_text("[]")
    assert compare.main(["--out", str(tmp_path / "out"), "--from-json", str(saved)]) == 1
    assert "no commits or experiments" in capsys.readouterr().err
