"""A full disk while training: the checkpoints and then the outs on small tmpfs mounts that fill up.

The stage stops with one line naming the file and the disk (its mount point, free and total space),
exit 1, no traceback; the earlier checkpoint stays loadable and a rerun resumes from it; an out that
did not fit leaves nothing half-written. Mounting needs root (or CAP_SYS_ADMIN): skipped otherwise.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

import pytest

from reliability._faults import checkpoint_steps, spawn, stage, temporaries, wait_for, write_params

AREA = "fault: full disk"


@contextlib.contextmanager
def tmpfs(path, size: str):
    path.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or 'mount failed'}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk, leave: int) -> None:
    """Fill ``disk`` until about ``leave`` bytes are free."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(0, free - leave))


@pytest.mark.skipif(shutil.which("mount") is None or os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_disk_under_checkpoints_and_outs(tiny_poses, tmp_path, reliability, capsys):
    from stages.reconstruct.__main__ import main
    from stages.reconstruct.checkpoint import CheckpointStore

    params = write_params(tmp_path / "p.yaml", {"steps": 60, "distributed": {"checkpoint_every": 10}})
    with tmpfs(tmp_path / "ckdisk", "2m") as ckdisk, tmpfs(tmp_path / "outdisk", "2m") as outdisk:
        ckpt = ckdisk / "ckpt"
        log = tmp_path / "run1.log"
        args = ["--poses", tiny_poses, "--params", params, "--checkpoint-dir", ckpt]
        proc = spawn(stage("stages.reconstruct", "--out", tmp_path / "out", *args), log)
        try:
            wait_for(lambda: checkpoint_steps(ckpt), 120, "the first checkpoint", proc, log)
            fill(ckdisk, 8 << 10)  # the next checkpoint no longer fits
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        text = log.read_text()
        line = next((ln for ln in text.splitlines() if ln.startswith("reconstruct: error:")), "")
        assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
        assert "no space left on the disk mounted at" in line and str(ckdisk) in line and "(tmpfs)" in line, line
        good = CheckpointStore(ckpt).load_latest()
        assert good is not None and not temporaries(ckpt)
        reliability(AREA, "checkpoint folder's disk fills up during training",
                    "exit 1, one line naming the disk; the earlier checkpoint loads",
                    "the newest checkpoint loads, no temporary left; exit 1: "
                    + re.sub(r"step_\d+|[\d.]+ [KM]iB", "…", line[len("reconstruct: error: "):]))

        os.unlink(ckdisk / "filler")
        fill(outdisk, 24 << 10)  # room for a few KB: not for model.pt and checkpoint.pt
        out = outdisk / "rec"
        rc = main(["--out", str(out), *map(str, args)])
        err = capsys.readouterr().err
        line = next((ln for ln in err.splitlines() if ln.startswith("reconstruct: error:")), err[-500:])
        assert rc == 1 and str(outdisk) in line and "no space left" in line, err[-3000:]
        assert not out.exists() and temporaries(outdisk) == [], os.listdir(outdisk)
        assert checkpoint_steps(ckpt), "the checkpoints stay until the outs are written"
        reliability(AREA, "out folder's disk full when model.pt is written",
                    "exit 1 naming the disk; no half-written out; checkpoints kept",
                    "exit 1 naming <tmp>/outdisk (tmpfs); out absent, no temporary; checkpoints kept")

        os.unlink(outdisk / "filler")
        assert main(["--out", str(out), *map(str, args)]) == 0, capsys.readouterr().err[-3000:]
        assert (out / "model.pt").is_file() and not ckpt.exists()
        reliability(AREA, "rerun after space was freed", "resumes and completes",
                    "exit 0; outs written, checkpoints removed")
