"""The ``rayforge`` console script (stages/cli.py, ``[project.scripts]`` in pyproject.toml).

Every subcommand's ``--help`` (summary, what it runs, the params it reads, examples); the
commands' default folders are dvc.yaml's (parsed from its ``cmd`` lines, so the two cannot drift);
``-S`` changes a param for one run without writing the params file; and ``rayforge process``,
``train`` and ``eval`` on a tiny scene, end to end through the script pip installed
(``<venv>/bin/rayforge``; ``pip install -e .``, which scripts/setup.sh runs, puts it there).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages import cli
from stages.common.metrics_files import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "rayforge"


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_every_subcommand_help_reads_well(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    c = next(c for c in cli.COMMANDS if c.name == command)
    assert text.startswith(f"usage: rayforge {command}")
    assert c.summary in text and "Runs: python -m stages." in text and "examples:\n  rayforge " + command in text
    assert ("Reads params: " + ", ".join(c.sections)) in text if c.sections else "Reads no params.yaml section" in text
    assert max(len(line) for line in text.splitlines() if not line.startswith("  rayforge")) <= 100


def test_top_level_help_lists_every_subcommand(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for c in cli.COMMANDS:
        assert f"    {c.name:10s}" in text
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--bogus"])  # only train passes unknown options on, to its stage
    assert exit_.value.code == 2


def test_defaults_are_dvc_yamls_commands() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    expect = {"process": ["ingest", "poses"], "train": ["reconstruct"], "eval": ["evaluate"], "export": ["export"],
              "report": ["report"]}
    for command, names in expect.items():
        c = next(c for c in cli.COMMANDS if c.name == command)
        args, rest = cli.build_parser().parse_known_args([command])
        got = c.steps(args, "params.yaml", rest)
        want = []
        for name in names:
            words = shlex.split(stages[name]["cmd"].replace("${ingest.photos}", "PHOTOS"))
            assert words[:2] == ["python", "-m"]
            want.append((words[2], words[3:]))
        for (module, argv), (want_module, want_argv) in zip(got, want, strict=True):
            assert module == want_module
            argv = argv[: argv.index("--params")] + argv[argv.index("--params") + 2:]
            if want_module == "stages.ingest":  # dvc.yaml names the photos; the command reads ingest.photos
                want_argv = want_argv[2:]
            assert argv == want_argv, (command, argv, want_argv)


def test_records_follow_an_out_given_elsewhere(tmp_path: Path) -> None:
    """With --out elsewhere, the metrics JSON and training curve go beside it, not onto dvc.yaml's tracked
    data/metrics and data/plots files (a side run must not change the pipeline's records); an explicit
    --metrics / --plots wins, and dvc.yaml's --out (however spelled) keeps dvc.yaml's paths."""
    def argv(*words: str) -> dict[str, str]:
        c = next(c for c in cli.COMMANDS if c.name == words[0])
        args, rest = cli.build_parser().parse_known_args(list(words))
        flat = [w for _, a in c.steps(args, "params.yaml", rest) for w in a]
        return {flag: flat[flat.index(flag) + 1] for flag in ("--metrics", "--plots") if flag in flat}

    run = tmp_path / "run1"
    assert argv("train", "--out", str(run)) == {"--metrics": f"{run}.metrics.json", "--plots": f"{run}.train.csv"}
    assert argv("train", "--out", str(run), "--metrics", "m.json") == {"--metrics": "m.json", "--plots": f"{run}.train.csv"}
    assert argv("train", "--out", "./data/reconstruct/") == {"--metrics": "data/metrics/reconstruct.json",
                                                              "--plots": "data/plots/train.csv"}
    assert argv("eval", "--out", str(run)) == {"--metrics": f"{run}.metrics.json"}
    assert argv("process", "--out", str(run)) == {"--metrics": f"{run}.metrics.json"}


def test_set_writes_a_temporary_params_file_and_never_params_yaml(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("# mine\nreconstruct:\n  steps: 10\n")
    before = params.read_bytes()
    with cli.params_file(params, ["reconstruct.steps=20", "reconstruct.nerf.lr=1e-3", "seed=3"],
                         ("seed", "reconstruct")) as path:
        assert Path(path).parent == tmp_path and path != str(params)
        data = yaml.safe_load(Path(path).read_text())
        assert data == {"reconstruct": {"steps": 20, "nerf": {"lr": 1e-3}}, "seed": 3}
    assert not Path(path).exists() and params.read_bytes() == before
    with cli.params_file(params, [], ("reconstruct",)) as path:
        assert path == str(params)  # no override: the file itself
    for bad, message in (("reconstruct.steps", "section.key=value"), ("ingest.photos=x", "would change nothing"),
                         ("reconstruct.steps.x=1", "not a section")):
        with pytest.raises(ValueError, match=message):
            with cli.params_file(params, [bad], ("reconstruct",)):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def tiny_project(root: Path) -> Path:
    """A folder with photos of a tiny generated scene, the cameras it was rendered with as a
    transforms.json to import (no SfM: CI time), and a params.yaml of a tiny NeRF."""
    from stages.scene import SceneParams, poses_from_ground_truth, run as scene_run
    from _tiny_model import TRAIN

    scene_run(SceneParams(width=64, height=48, views=8, rings=1, objects=3), root / "scene", 0)
    poses_from_ground_truth(root / "scene" / "images", root / "cameras")
    params = {"seed": 0, "ingest": {"photos": "scene/images"},
              "poses": {"source": "transforms", "camera_file": "cameras/transforms.json"},
              "reconstruct": {**TRAIN, "steps": 5}, "evaluate": {"chunk_rays": 4096, "orbit_frames": 0}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


@pytest.mark.integration
def test_process_train_eval_through_the_installed_script(tmp_path: Path) -> None:
    if not SCRIPT.is_file():
        pytest.skip(f"no {SCRIPT}: `pip install -e .` installs the console script (scripts/setup.sh runs it)")
    project = tiny_project(tmp_path)
    params_bytes = (project / "params.yaml").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's stages, whatever the venv points at

    def rayforge(*args: str) -> str:
        p = subprocess.run([str(SCRIPT), *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"rayforge {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}"
        return p.stdout + p.stderr

    rayforge("process")
    poses = json.loads((project / "data/metrics/poses.json").read_text())
    assert poses["num_registered"] == 8 and (project / "data/poses/transforms.json").is_file()
    rayforge("train", "-S", "reconstruct.steps=12")
    summary = json.loads((project / "data/reconstruct/summary.json").read_text())
    assert summary["steps"] == 12 and (project / "data/reconstruct/model.pt").is_file()  # the -S value was used
    out = rayforge("eval")
    ev = read_metrics(project / "data/metrics/evaluate.json")  # the full record beside the headline
    assert ev["num_test_views"] == 1 and 3.0 < ev["psnr"] < 60.0 and "PSNR" in out
    assert (project / "params.yaml").read_bytes() == params_bytes  # -S never wrote it
    assert not [p.name for p in project.iterdir() if p.name.startswith(".params")]  # its temporary copy is gone
    bad = subprocess.run([str(SCRIPT), "train", "-S", "reconstruct.stepz=3"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "reconstruct.stepz" in bad.stderr


@pytest.mark.integration
def test_sigterm_stops_train_cleanly_and_removes_the_params_copy(tmp_path: Path) -> None:
    """SIGTERM (a scheduler's stop, `timeout`, `kill`) to `rayforge train -S ...` in the middle of training:
    the stage's clean stop (exit 143, "interrupted"), no model out, and no temporary params copy left beside
    params.yaml (before the console script went through entry.cli, the default SIGTERM left it behind)."""
    if not SCRIPT.is_file():
        pytest.skip(f"no {SCRIPT}: `pip install -e .` installs the console script (scripts/setup.sh runs it)")
    project = tiny_project(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([str(SCRIPT), "process"], cwd=project, env=env, capture_output=True, timeout=300, check=True)
    p = subprocess.Popen([str(SCRIPT), "train", "-S", "reconstruct.steps=100000"],
                         cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:  # the training loop has started (its first log line) with the copy in place
            seen.append(line)
            if "training nerf" in line:
                break
        assert [q.name for q in project.iterdir() if q.name.startswith(".params")], "".join(seen)
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = "".join(seen) + rest
    assert p.returncode == 143 and "interrupted" in text, text[-3000:]
    assert not [q.name for q in project.iterdir() if q.name.startswith(".params")]
    assert not (project / "data/reconstruct/model.pt").exists()
