"""Training interrupted the hard ways, and the reruns.

* The trainer SIGKILLed at a random step: the rerun resumes from the latest checkpoint, and the test
  PSNR of the result is within 0.3 dB of an uninterrupted run with the same seed (on the CPU it is
  the same model bit for bit, so the difference is 0).
* ``dvc repro`` interrupted mid-stage: Ctrl-C (SIGINT to the whole foreground group, as a terminal
  sends it; under bash, which execs the stage, and under dash, which forks) and SIGKILL of dvc
  alone (through ``/bin/sh -c``, which forks). Each time: one line from the stage, no traceback,
  no out left half-written or looking complete, no process left; another scene's poses are then
  refused through DVC too, and the final rerun completes from the checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reliability._faults import (
    ROOT, checkpoint_steps, descendants, env, kill_all, last_line, sigkill_root, spawn, stage, temporaries,
    wait_for, wait_gone, write_params,
)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process trees read from /proc")]
PSNR_TOLERANCE_DB = 0.3  # the bound; on one CPU the resumed run is bitwise the uninterrupted one


def _test_psnr(poses: Path, model: Path, tmp: Path) -> float:
    from stages.evaluate import EvaluateParams, run as evaluate

    m = evaluate(EvaluateParams(orbit_frames=0, chunk_rays=4096), poses, model, tmp / "ev", tmp / "ev.json",
                 params_path=None)
    return m["psnr"]


def test_sigkill_at_a_random_step_resumes_to_the_same_psnr(tiny_poses, tmp_path, reliability):
    from stages.common.params import load_section
    from stages.reconstruct import ReconstructParams, run

    every, steps = 5, 60
    kill_after = random.Random(20).randrange(1, steps // every - 2) * every  # seeded: the table is stable
    params = write_params(tmp_path / "p.yaml", {"steps": steps, "distributed": {"checkpoint_every": every}})
    p = load_section(ReconstructParams, "reconstruct", params)
    out, ckpt, log = tmp_path / "out", tmp_path / "out.ckpt", tmp_path / "run.log"
    proc = spawn(stage("stages.reconstruct", "--poses", tiny_poses, "--out", out, "--params", params), log)
    try:
        wait_for(lambda: kill_after in checkpoint_steps(ckpt), 120, f"the checkpoint of step {kill_after}", proc, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        kill_all([proc.pid])
    saved = checkpoint_steps(ckpt)
    assert not out.exists() and saved and max(saved) < steps, saved
    resumed = run(p, tiny_poses, out, progress=False)  # the rerun
    assert resumed["resumed_from_step"] == max(saved)
    ref = run(p, tiny_poses, tmp_path / "ref", checkpoint_dir=tmp_path / "ref.ckpt", progress=False)
    assert ref["resumed_from_step"] is None
    a, b = _test_psnr(tiny_poses, out, tmp_path / "a"), _test_psnr(tiny_poses, tmp_path / "ref", tmp_path / "b")
    assert abs(a - b) <= PSNR_TOLERANCE_DB, (a, b)
    reliability("fault: killed training", f"trainer SIGKILLed after the checkpoint of step {kill_after} "
                f"(seeded random step of {steps}), then rerun",
                f"resumes; test PSNR within {PSNR_TOLERANCE_DB} dB of an uninterrupted run",
                f"resumed from the newest checkpoint; test PSNR {a:.2f} vs {b:.2f} dB (difference "
                f"{abs(a - b):.2f} dB)")


# ---------------------------------------------------------------- dvc repro

DVC_YAML = """\
stages:
  reconstruct:
    cmd: python -m stages.reconstruct --poses poses --out data/reconstruct --metrics data/metrics/reconstruct.json --plots data/plots/train.csv
    deps: [poses, stages/reconstruct]
    params: [seed, reconstruct]
    outs: [data/reconstruct]
    metrics:
      - data/metrics/reconstruct.json:
          cache: false
    plots:
      - data/plots/train.csv:
          cache: false
"""


def _dvc_project(root: Path, poses: Path) -> Path:
    root.mkdir()
    for name in ("stages", "kernels"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(poses, root / "poses")
    (root / "dvc.yaml").write_text(DVC_YAML)
    write_params(root / "params.yaml", {"steps": 120, "distributed": {"checkpoint_every": 10}, "tensorboard": True})
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"],
                [sys.executable, "-m", "dvc", "config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True, env=env())
    return root


def _dvc(root: Path, log: Path, **extra: str) -> subprocess.Popen:
    return spawn([sys.executable, "-m", "dvc", "repro"], log, cwd=root, session=True, PYTHONPATH=str(root), **extra)


def _no_half_outs(root: Path) -> None:
    data = root / "data"
    assert not (data / "reconstruct").exists(), "the out must not be there (DVC removed it before the stage ran)"
    assert not (data / "metrics" / "reconstruct.json").exists()
    assert not (data / "reconstruct.tb").exists() and not (data / "reconstruct.lock").exists()
    assert temporaries(data) == [], temporaries(data)


def _ctrl_c(root: Path, log: Path, shell: str, after: int) -> tuple[str, int]:
    """``dvc repro`` under ``SHELL=shell``, Ctrl-C (SIGINT to its group) once a checkpoint newer than
    ``after`` is there; returns dvc's output and the newest checkpoint's step."""
    ckpt = root / "data" / "reconstruct.ckpt"
    proc = _dvc(root, log, SHELL=shell)
    try:
        wait_for(lambda: max(checkpoint_steps(ckpt), default=0) > after, 180, "a newer checkpoint", proc, log)
        tree = [proc.pid] + descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
        assert not wait_gone(tree, 20), "a process of the interrupted run is still there"
    finally:
        kill_all(descendants(proc.pid) + [proc.pid])
    text = log.read_text()
    line = last_line(text, "reconstruct: interrupted")
    assert rc != 0 and line and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.count("reconstruct: interrupted") == 1
    k = max(checkpoint_steps(ckpt))
    assert line.endswith(f"rerun to resume from the checkpoint of step {k}"), line
    _no_half_outs(root)
    return text, k


def test_dvc_repro_interrupted_by_ctrl_c_and_by_sigkill_then_rerun(tiny_poses, other_poses, tmp_path, reliability):
    root = _dvc_project(tmp_path / "repo", tiny_poses)
    ckpt = root / "data" / "reconstruct.ckpt"

    # Ctrl-C: SIGINT to the foreground group (dvc ignores it while its command runs; the stage does
    # not). DVC runs the command as `$SHELL -c`: bash replaces itself with the stage, so DVC sees the
    # stage's own status; dash forks, and the same SIGINT kills dash itself (-2) while the stage stops
    # cleanly below it, as it does in a terminal. CI has no SHELL (DVC then takes /bin/sh, dash), so
    # both shells are named here rather than taken from the environment.
    text, k = _ctrl_c(root, tmp_path / "int-bash.log", "/bin/bash", 0)
    assert "exited with 130" in text, text[-2000:]  # the stage's status, as DVC reports it
    line = last_line(text, "reconstruct: interrupted")
    said = re.sub(r"step \d+;", "step N;", line).replace(f"step {k}", "step K")  # K: the newest checkpoint
    text, k = _ctrl_c(root, tmp_path / "int-sh.log", "/bin/sh", k)
    assert "exited with -2" in text, text[-2000:]  # dash's own death by the same SIGINT
    reliability("fault: dvc repro interrupted", "Ctrl-C (SIGINT to the group) during `dvc repro` training",
                "one line, no traceback; no out looking complete; no process left",
                f"`{said}` (K = the newest checkpoint); the stage exited with 130 (SHELL=/bin/bash; under "
                "/bin/sh DVC reports dash's own death by the signal, -2, with the same line from the stage); "
                "data/reconstruct and its metrics absent; nothing left running")
    reliability("clean stop", "Ctrl-C while training (reconstruct under dvc repro)",
                "one line 'interrupted at step N; rerun to resume from the checkpoint of step K', no <out>.tb/, "
                "no temporaries", f"`{said}`; no data/reconstruct.tb, no temporary folder")

    # SIGKILL of dvc alone, the stage under `/bin/sh -c` (dash forks: the stage's parent is the shell)
    log = tmp_path / "kill.log"
    proc, tree = _dvc(root, log, SHELL="/bin/sh"), []
    try:
        wait_for(lambda: max(checkpoint_steps(ckpt), default=0) > k, 180, "a newer checkpoint", proc, log)
        tree, left = sigkill_root(proc, 30)
        assert not left, f"outlived the SIGKILLed dvc: {[(p, Path(f'/proc/{p}/cmdline').read_bytes()) for p in left]}"
    finally:
        kill_all(descendants(proc.pid) + [proc.pid] + tree)
    k2 = max(checkpoint_steps(ckpt))
    _no_half_outs(root)
    reliability("fault: dvc repro interrupted", "SIGKILL of `dvc repro` mid-training (stage under /bin/sh -c)",
                "the stage and its shell stop; no out looking complete",
                "shell and stage gone; the newer checkpoint kept, no out")
    reliability("orphans and locks", "`dvc repro` SIGKILLed while it trains", "no trainer left running",
                "stage process gone within seconds (parent watchdog)")

    # another scene's poses under the same out: refused through dvc too
    shutil.move(root / "poses", tmp_path / "poses_a")
    shutil.copytree(other_poses, root / "poses")
    p = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env(PYTHONPATH=str(root)),
                       capture_output=True, text=True, timeout=300)
    line = last_line(p.stdout + p.stderr, "reconstruct: error:")
    assert p.returncode != 0 and line and "trained on other data" in line, (p.stdout + p.stderr)[-3000:]
    assert max(checkpoint_steps(ckpt)) == k2
    reliability("wrong checkpoint", "`dvc repro` after the poses were replaced by another scene's",
                "refused, naming both", "dvc fails: " + re.sub(r"step_\d+", "step_<K>",
                                                              line[len("reconstruct: error: "):]))
    shutil.rmtree(root / "poses")
    shutil.move(tmp_path / "poses_a", root / "poses")

    p = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env(PYTHONPATH=str(root)),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    summary = json.loads((root / "data" / "reconstruct" / "summary.json").read_text())
    assert summary["resumed_from_step"] == k2 and not ckpt.exists()
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=env(), capture_output=True,
                            text=True)
    assert "up to date" in status.stdout, status.stdout
    reliability("fault: dvc repro interrupted", "`dvc repro` after both interruptions", "completes from the checkpoint",
                "exit 0, resumed from the newest checkpoint; dvc status: up to date")
