"""Helpers of the reliability suite: stage commands started the way users start them, signals, process trees."""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# The tiny NeRF of tests/test_distributed.py (~4.4k parameters, a few ms a step on 2 cores).
TINY = {
    "device": "cpu", "steps": 30, "batch_rays": 128, "eval_every": 10, "tensorboard": False,
    "nerf": {"levels": 2, "log2_hashmap_size": 10, "base_resolution": 4, "max_resolution": 16, "hidden_dim": 8,
             "geo_feat_dim": 3, "samples_per_ray": 16, "occ_resolution": 8, "occ_update_every": 8},
    "distributed": {"checkpoint_every": 10, "replica_check_every": 0, "max_restarts": 0},
}


def merge(base: dict, over: dict) -> dict:
    out = {**base}
    for k, v in over.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def write_params(path: Path, reconstruct: dict | None = None, **sections) -> Path:
    """A params file with ``seed``, the tiny ``reconstruct`` section (``reconstruct`` laid over it) and ``sections``."""
    doc = {"seed": 0, "reconstruct": merge(TINY, reconstruct or {}), **sections}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["DVC_NO_ANALYTICS"] = "1"
    e["OMP_NUM_THREADS"] = "1"  # tiny tensors: threads only contend on a shared 2-core machine
    e.pop("RAYFORGE_HELD_LOCKS", None)
    e.update(extra)
    return e


def restore_sigint() -> None:
    """``preexec_fn``: a background job of a non-interactive shell (CI) inherits SIGINT ignored; undo that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stage(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


def spawn(cmd: list[str], log: Path, cwd: Path = ROOT, session: bool = False, **extra: str) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``log``; ``session``: its own process group, as a terminal's job."""
    f = open(log, "w")
    try:
        return subprocess.Popen(cmd, cwd=cwd, env=env(**extra), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=restore_sigint, start_new_session=session)
    finally:
        f.close()


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def checkpoint_steps(folder: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in folder.glob("step_*.pt")) if folder.is_dir() else []


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            found.append(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def sigkill_root(proc: subprocess.Popen, timeout: float) -> tuple[list[int], list[int]]:
    """SIGKILL ``proc`` alone: (its descendants at that moment, those still alive ``timeout`` s later)."""
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return tree, wait_gone(tree, timeout)


def kill_all(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below ``folder`` (by relative path): an input's fingerprint before and after."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def temporaries(folder: Path) -> list[str]:
    """Temporary files and folders the stages leave beside their outs (``.<name>.tmp-...``)."""
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or p.name.endswith(".tmp"))


def last_line(text: str, prefix: str) -> str | None:
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip().startswith(prefix)]
    return lines[-1] if lines else None
