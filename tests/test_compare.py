"""The comparison page (stages/compare.py) from real `dvc exp run` experiments of a tiny pipeline.

A throwaway git + DVC repo holds a copy of the project's code, `dvc.yaml`, `.gitignore`
and a `params.yaml` shrunk to seconds (as in test_pipeline_e2e.py, smaller still). After
the baseline `dvc repro` and commit, two experiments each rerun only the tail of the
pipeline (reconstruct, evaluate, report): fewer steps, and two gloo workers instead of one
(a world-size change, so the page gets a scaling table). The workspace is reset to the
baseline between them so that each differs from the baseline in one param only.

The same experiments show what a user sees of them through DVC (narrow `dvc metrics show` and
`dvc exp show --only-changed` tables, an offline `dvc plots show` page), that their evaluate
records call the tree clean (only the pipeline's own outs and params.yaml changed), and that
TensorBoard keeps one folder per run.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from PIL import Image

from stages import compare
from _dvc_project import ROOT, TINY_PIPELINE, copy_pipeline, merge, optional_off, ran_stages, run
from test_report_browser import find_chromium, open_page

# the e2e test's tiny pipeline with fewer views and steps: the baseline repro takes ~15 s on 2 cores
SMALL = merge(TINY_PIPELINE, {"scene": {"views": 16},
                              "reconstruct": {"steps": 20, "eval_every": 10, "distributed": {"checkpoint_every": 0}},
                              "report": {"max_views": 1}})
EXPERIMENTS = {"fewer-steps": ["reconstruct.steps=10"], "two-workers": ["reconstruct.distributed.cpu_workers=2"]}


@pytest.fixture(scope="module")
def exp_repo(tmp_path_factory) -> Path:
    params = optional_off(merge(yaml.safe_load((ROOT / "params.yaml").read_text()), SMALL))
    params["reconstruct"]["tensorboard"] = True  # one TensorBoard folder per run (test_tensorboard_...)
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


def _columns(table: str) -> list[str]:
    """The header cells of a table DVC printed (columns are separated by two or more spaces)."""
    return re.split(r"\s{2,}", table.strip().splitlines()[0].strip())


@pytest.mark.integration
@pytest.mark.slow
def test_dvc_tables_are_narrow(exp_repo: Path):
    """`dvc metrics show` tabulates the headline metrics only (it had 90 columns): the full records
    (<name>.full.json) are not metrics."""
    cols = _columns(run(["dvc", "metrics", "show"], exp_repo))
    assert cols[0] == "Path" and len(cols) <= 15, cols
    assert {"psnr", "ssim", "fps", "train_time_s", "steps", "method", "num_registered"} <= set(cols), cols
    assert not [c for c in cols if c.startswith(("environment", "orbit", "per_rank"))]
    # the README's `dvc exp show --only-changed --drop data/`: the params and metrics that vary (the
    # data hashes dropped), beside DVC's own columns
    header = run(["dvc", "exp", "show", "--only-changed", "--drop", "data/", "--csv"],
                 exp_repo).strip().splitlines()[0].split(",")
    cols = [c for c in header if c not in ("Experiment", "rev", "typ", "Created", "parent", "State", "Executor")]
    assert len(cols) <= 12 and {"psnr", "reconstruct.steps", "reconstruct.distributed.cpu_workers"} <= set(cols), cols


@pytest.mark.integration
@pytest.mark.slow
def test_experiments_record_a_clean_tree(exp_repo: Path, tmp_path: Path):
    """`dvc exp run` rewrites dvc.lock, data/metrics and data/plots (git-tracked) before evaluate looks
    at git, and params.yaml holds the experiment's params: none of that is a dirty tree."""
    compare.run(tmp_path / "compare", repo=exp_repo)
    runs = {r["name"]: r for r in json.loads((tmp_path / "compare" / "compare.json").read_text())["runs"]}
    assert set(EXPERIMENTS) < set(runs)
    for name, r in runs.items():
        env = r["metrics"]["evaluate"]["environment"]  # from the run's evaluate.full.json in git
        assert (env["code_dirty"], env["code_dirty_files"]) == (False, []), (name, env)
        assert env["params_modified"] is (name in EXPERIMENTS), (name, env)
    # the check as evaluate runs it, in that repository: the pipeline's own tracked outs rewritten
    # (as `dvc repro` does) are not dirty; an edited source file is, and is named
    check = ["python", "-c", "import json; from stages.evaluate import code_revision; print(json.dumps(code_revision()))"]
    try:
        for name in ("dvc.lock", "data/metrics/poses.full.json", "data/plots/train.csv"):
            (exp_repo / name).write_text((exp_repo / name).read_text() + "\n")
        rev = json.loads(run(check, exp_repo).strip().splitlines()[-1])
        assert (rev["dirty"], rev["dirty_files"], rev["params_modified"]) == (False, [], False), rev
        source = exp_repo / "stages" / "compare.py"
        source.write_text(source.read_text() + "\n# an edit\n")
        rev = json.loads(run(check, exp_repo).strip().splitlines()[-1])
        assert (rev["dirty"], rev["dirty_files"]) == (True, ["stages/compare.py"]), rev
    finally:
        run(["git", "checkout", "-q", "--", "."], exp_repo)
        run(["dvc", "checkout", "-q", "--force"], exp_repo)


@pytest.mark.integration
@pytest.mark.slow
def test_tensorboard_keeps_one_folder_per_run(exp_repo: Path):
    """`tensorboard --logdir data/reconstruct.tb`: the baseline (start time + params hash) and each
    experiment (its `dvc exp` name) side by side; each out carries its own run's events."""
    root = exp_repo / "data" / "reconstruct.tb"
    names = sorted(p.name for p in root.iterdir())
    base = [n for n in names if n not in EXPERIMENTS]
    assert set(EXPERIMENTS) <= set(names) and len(base) == 1, names
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", base[0]), base
    for name in names:
        events = list((root / name).glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 100, name
    assert [p.name for p in (exp_repo / "data/reconstruct/tensorboard").iterdir()] == base  # the workspace's out


@pytest.mark.integration
@pytest.mark.slow
def test_dvc_plots_page_is_offline_with_psnr_and_loss_apart(exp_repo: Path, tmp_path: Path):
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], exp_repo)
    page = tmp_path / "plots" / "index.html"
    text = page.read_text()
    tags = re.sub(r"<script>.*?</script>", "", text, flags=re.S)  # the inlined libraries aside
    assert "<script>" in text and not re.search(r"<\w+\b[^>]*\b(src|href)\s*=", tags, re.I)  # nothing to fetch
    assert "cdn.jsdelivr" not in text
    specs = [json.loads(m) for m in re.findall(r"var spec = (\{.*?\});\n", text, re.S)]
    assert len(specs) == 2  # psnr and loss, and not train.csv a second time with default axes
    by_title = {s["title"]["text"].split()[0]: s for s in specs}
    assert sorted(by_title) == ["PSNR", "Training"]
    assert {row.get("field") for row in by_title["PSNR"]["data"]["values"]} == {"psnr", "test_psnr"}
    assert all(row.get("field", "loss") == "loss" for row in by_title["Training"]["data"]["values"])
    exe = find_chromium()
    if exe is None:
        pytest.skip("no Chromium: the page's text was checked, not its rendering")
    state = open_page(exe, page, tmp_path / "profile", tmp_path / "plots.png", PLOTS_STATE)
    assert len(state["views"]) == 2 and all(w > 200 and h > 100 for w, h in state["views"]), state
    assert state["requests"] == [page.resolve().as_uri()], state["requests"]  # nothing from a network
    with Image.open(tmp_path / "plots.png") as im:
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 100  # drawn, not blank


# waits (up to 20 s) for vega-embed to draw both plots; returns their sizes
PLOTS_STATE = """(async () => {
  const t0 = Date.now(), sel = '.vega-embed canvas.marks, .vega-embed svg.marks';
  while (document.querySelectorAll(sel).length < 2 && Date.now() - t0 < 20000) await new Promise(r => setTimeout(r, 100));
  return {views: Array.from(document.querySelectorAll(sel)).map(v => [v.getBoundingClientRect().width,
                                                                     v.getBoundingClientRect().height])};
})()"""


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
