"""Bad params and missing paths, through every stage's command: one line naming the key (or the line
of the file, or the path) and exit 1, no traceback, no out written. A params file without the
stage's section is an error, not the built-in defaults; a key given twice is an error."""
from __future__ import annotations

import importlib

import pytest

from reliability._faults import TINY, write_params

MAINS = {"scene": "stages.scene", "ingest": "stages.ingest", "poses": "stages.poses",
         "reconstruct": "stages.reconstruct.__main__", "evaluate": "stages.evaluate", "report": "stages.report"}


def _argv(stage: str, r, params) -> list[str]:
    p, o = str(params), str(r / "out")
    return {
        "scene": ["--out", o, "--params", p],
        "ingest": ["--photos", str(r / "photos"), "--out", o, "--params", p],
        "poses": ["--ingest", str(r / "ingest"), "--out", o, "--metrics", str(r / "m.json"), "--params", p],
        "reconstruct": ["--poses", str(r / "poses"), "--out", o, "--params", p],
        "evaluate": ["--poses", str(r / "poses"), "--model", str(r / "model"), "--out", o, "--metrics",
                     str(r / "e.json"), "--params", p],
        "report": ["--evaluate", str(r / "ev"), "--metrics-dir", str(r / "metrics"), "--plots", str(r / "t.csv"),
                   "--poses", str(r / "poses"), "--out", o, "--params", p],
    }[stage]


def _run(stage: str, argv: list[str], capsys) -> tuple[int, str]:
    rc = importlib.import_module(MAINS[stage]).main(argv)
    err = capsys.readouterr().err
    line = next((ln for ln in err.splitlines() if f"{stage}: error:" in ln), err.strip()[-400:])
    assert "Traceback" not in err, err[-3000:]
    return rc, line


BAD_PARAMS = [  # (case, stage, params text, what the message must name)
    ("wrong type: reconstruct.steps: many", "reconstruct",
     "seed: 0\nreconstruct:\n  steps: many\n", "reconstruct.steps: expected an integer, got 'many'"),
    ("wrong type: seed: 1.5", "reconstruct", "seed: 1.5\nreconstruct: {}\n", "seed: expected an integer"),
    ("wrong type: a list for ingest.max_size", "ingest", "ingest:\n  max_size: [1, 2]\n", "ingest.max_size"),
    ("unknown key: ingest.max_sise", "ingest", "ingest:\n  max_sise: 800\n", "unknown params key(s) ingest.max_sise"),
    ("unknown key: reconstruct.nerf.level", "reconstruct", "reconstruct:\n  nerf:\n    level: 8\n",
     "reconstruct.nerf.level"),
    ("out of range: reconstruct.batch_rays: 4", "reconstruct", "reconstruct:\n  batch_rays: 4\n",
     "reconstruct.batch_rays: must be >= 16"),
    ("out of range: poses.test_every: 0", "poses", "seed: 0\nposes:\n  test_every: 0\n", "poses.test_every"),
    ("out of range: evaluate.orbit_frames: 1", "evaluate", "evaluate:\n  orbit_frames: 1\n", "evaluate.orbit_frames"),
    ("bad choice: reconstruct.device: tpu", "reconstruct", "reconstruct:\n  device: tpu\n",
     "reconstruct.device: must be one of"),
    ("duplicate key: reconstruct.steps twice", "reconstruct",
     "seed: 0\nreconstruct:\n  steps: 10\n  batch_rays: 128\n  steps: 20000\n",
     "line 5: duplicate key 'steps' (first given on line 3)"),
    ("duplicate key: two reconstruct sections", "reconstruct",
     "reconstruct:\n  steps: 10\nseed: 0\nreconstruct:\n  steps: 20\n", "line 4: duplicate key 'reconstruct'"),
    ("duplicate key in a flow mapping: ingest {a, a}", "ingest", "ingest: {max_size: 1, max_size: 2}\n",
     "duplicate key 'max_size'"),
    ("not YAML", "scene", "scene: [unclosed\n", "not valid YAML"),
    ("not a mapping", "ingest", "- a\n- b\n", "expected a mapping of sections"),
] + [(f"missing section: {s}", s, "seed: 0\nother: {}\n", f"has no '{s}' section") for s in MAINS]


@pytest.mark.parametrize("case,stage,text,names", BAD_PARAMS, ids=[c[0] for c in BAD_PARAMS])
def test_bad_params_are_one_clear_line(case, stage, text, names, tmp_path, capsys, reliability):
    params = tmp_path / "params.yaml"
    params.write_text(text)
    rc, line = _run(stage, _argv(stage, tmp_path, params), capsys)
    assert rc == 1 and names in line, line
    assert not (tmp_path / "out").exists()
    reliability("bad input: params", f"{stage}: {case}", f"exit 1 naming {names!r}",
                f"exit 1: {line.split('error: ', 1)[-1]}")


def test_missing_section_no_longer_trains_on_defaults(tiny_poses, tmp_path, capsys, reliability):
    """The issue's case: a params file without ``reconstruct:`` trained 2500 default steps (~7 h on a CPU)."""
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\ningest: {}\n")
    rc, line = _run("reconstruct", ["--poses", str(tiny_poses), "--out", str(tmp_path / "out"), "--params",
                                    str(params)], capsys)
    assert rc == 1 and "has no 'reconstruct' section" in line and "reconstruct: {}" in line, line
    reliability("silently wrong", "params file without a reconstruct: section",
                "an error (was: 2500 default steps, ~7 h on a CPU)", f"exit 1: {line.split('error: ', 1)[-1]}")
    params.write_text("seed: 0\nreconstruct:\n  steps: 10\n  steps: 2500\n")
    rc, line = _run("reconstruct", ["--poses", str(tiny_poses), "--out", str(tmp_path / "out"), "--params",
                                    str(params)], capsys)
    assert rc == 1 and "duplicate key 'steps'" in line, line
    reliability("silently wrong", "duplicate YAML key (steps: 10, then steps: 2500)",
                "an error naming the key and line (was: the last value won)",
                f"exit 1: {line.split('error: ', 1)[-1]}")


MISSING = [("scene", "--params (no such file)", "params file not found"),
           ("ingest", "--photos", "photo folder not found"),
           ("poses", "--ingest", "manifest"),
           ("reconstruct", "--poses", "missing transforms.json"),
           ("evaluate", "--poses", "poses folder not found"),
           ("evaluate", "--model", "model folder not found"),
           ("report", "--evaluate", "evaluate.json")]


@pytest.mark.parametrize("stage,what,names", MISSING, ids=[f"{s} {w}" for s, w, _ in MISSING])
def test_missing_paths_are_one_clear_line(stage, what, names, tiny_poses, tmp_path, capsys, reliability):
    params = write_params(tmp_path / "params.yaml", TINY, scene={}, ingest={}, poses={}, evaluate={}, report={})
    if stage in ("evaluate",) and what == "--model":
        import shutil

        shutil.copytree(tiny_poses, tmp_path / "poses")
    argv = _argv(stage, tmp_path, params)
    if what.startswith("--params"):
        argv[argv.index("--params") + 1] = str(tmp_path / "nowhere.yaml")
    rc, line = _run(stage, argv, capsys)
    assert rc == 1 and names in line, line
    assert not (tmp_path / "out").exists()
    reliability("bad input: paths", f"{stage}: missing {what}", f"exit 1 naming it ({names!r})",
                f"exit 1: {line.split('error: ', 1)[-1]}")
