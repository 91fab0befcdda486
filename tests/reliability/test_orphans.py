"""A trainer never outlives what started it, and never shares its out with a second writer.

The stage is started the two ways ``dvc repro`` starts it: ``$SHELL -c`` with a shell that replaces
itself (bash: the stage's parent is then the killed process, and PR_SET_PDEATHSIG fires) and with
one that forks (dash, /bin/sh here: the parent is the shell, which outlives a killed dvc, and the
watchdog sees the shell's parent go). The parent is then SIGKILLed; and a launcher with two gloo
workers under torchrun is SIGKILLed, which must take torchrun and both workers with it.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reliability._faults import descendants, kill_all, sigkill_root, spawn, stage, wait_for, wait_gone, write_params

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process trees read from /proc")

PARENT = """\
import subprocess, sys, time
cmd = sys.argv[2:]
if sys.argv[1] == "sh":
    subprocess.Popen(["/bin/sh", "-c", " ".join(cmd)])  # dash forks: the stage's parent is the shell
else:
    subprocess.Popen(cmd)  # bash -c execs: the stage's parent is this process
time.sleep(600)
"""


def _holder(lock: Path) -> int | None:
    try:
        m = re.match(r"pid (\d+)", lock.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
def test_killed_parent_takes_the_trainer_with_it_and_the_lock_stops_a_second_writer(
        tiny_poses, tmp_path, reliability, capsys):
    params = write_params(tmp_path / "p.yaml", {"steps": 100000, "distributed": {"checkpoint_every": 0}})
    (tmp_path / "parent.py").write_text(PARENT)
    parents, trainers = {}, {}
    for how in ("sh", "exec"):
        out = tmp_path / f"out_{how}"
        cmd = stage("stages.reconstruct", "--poses", tiny_poses, "--out", out, "--params", params)
        parents[how] = spawn([sys.executable, str(tmp_path / "parent.py"), how, *cmd], tmp_path / f"{how}.log")
    try:
        for how in parents:
            lock = tmp_path / f"out_{how}.lock"
            trainers[how] = wait_for(lambda: _holder(lock), 90, f"{how}: the trainer's lock", parents[how],
                                     tmp_path / f"{how}.log")

        # a second writer on the same out fails at once, naming the holder
        from stages.reconstruct.__main__ import main

        t = time.monotonic()
        rc = main(["--poses", str(tiny_poses), "--out", str(tmp_path / "out_exec"), "--params", str(params)])
        took = time.monotonic() - t
        err = capsys.readouterr().err
        assert rc == 1 and f"is being written by pid {trainers['exec']}" in err and took < 10, (took, err[-1500:])
        reliability("orphans and locks", "a second `python -m stages.reconstruct` on an out being trained",
                    "fails at once naming the holder's pid", "exit 1 at once (under 10 s): "
                    + re.sub(r"pid \d+ on \S+", "pid <trainer's> on <host>",
                             err.strip().splitlines()[-1].split("error: ")[-1]))

        for how, proc in parents.items():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for how, pid in trainers.items():
            left = wait_gone([pid], 20)
            assert not left, f"{how}: trainer {pid} outlived its SIGKILLed parent\n" + \
                (tmp_path / f"{how}.log").read_text()[-2000:]
            assert not (tmp_path / f"out_{how}.lock").exists() or _holder(tmp_path / f"out_{how}.lock") != pid
        log = (tmp_path / "sh.log").read_text()
        assert "reconstruct: interrupted" in log and "Traceback" not in log, log[-2000:]
    finally:
        kill_all([d for p in parents.values() for d in descendants(p.pid)] + [p.pid for p in parents.values()]
                 + list(trainers.values()))
    reliability("orphans and locks", "parent of `sh -c 'python -m stages.reconstruct ...'` SIGKILLed (dash forks)",
                "the trainer stops (watchdog on the shell's parent)", "trainer gone; it said it was interrupted")
    reliability("orphans and locks", "parent of the trainer SIGKILLed (bash -c execs)",
                "the trainer stops (PR_SET_PDEATHSIG)", "trainer gone")


def test_killed_launcher_takes_torchrun_and_its_workers_with_it(tiny_poses, tmp_path, reliability):
    params = write_params(tmp_path / "p.yaml", {"steps": 100000, "distributed": {
        "cpu_workers": 2, "checkpoint_every": 0, "max_restarts": 2}})
    log = tmp_path / "launcher.log"
    proc = spawn(stage("stages.reconstruct", "--poses", tiny_poses, "--out", tmp_path / "out", "--params", params),
                 log)
    tree: list[int] = []
    try:
        wait_for(lambda: "training nerf" in log.read_text(), 120, "training to start", proc, log)
        tree, left = sigkill_root(proc, 40)
        assert len(tree) >= 3, tree  # torchrun and its two workers
        assert not left, f"still running after the launcher was SIGKILLed: {left}"
    finally:
        kill_all(descendants(proc.pid) + [proc.pid] + tree)
    reliability("orphans and locks", "launcher of torchrun + 2 gloo workers SIGKILLed mid-training",
                "torchrun and both workers stop (no restart)", "torchrun and both workers gone")
