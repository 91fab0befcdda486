"""Processes that die with the one that started them, and liveness of a process id.

A stage is started by ``dvc repro`` (through ``$SHELL -c``), by a Prefect task, by torchrun or by
a person. When that parent is killed outright (SIGKILL, an OOM kill), nothing tells the stage,
and a trainer left running keeps writing into folders that the rerun then uses too. So:

* :func:`die_with_parent` asks Linux to send this process SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), and starts a watchdog thread for what that signal cannot see:
  a parent that is a ``sh -c`` wrapper (dash forks the command instead of replacing itself, so
  the stage's parent is the shell, which outlives a killed ``dvc``), and systems without prctl;
* :func:`tied` wraps a command so that the child is armed the same way before it runs (a shim
  arms the signal, then ``exec``s the command, which keeps it);
* :func:`reap_children_when_gone` starts a reaper for children another library starts;
* ``RAYFORGE_DETACH=1`` turns both off, for a run meant to outlive its shell (``nohup``).

The signal is SIGTERM, not SIGKILL: the stages turn it into a clean stop (temporary folders
removed, one line said), and torchrun stops its workers on it. A parent killed before the child's
interpreter reached :func:`die_with_parent` (its start-up and imports, under a second) goes unseen.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "mksh", "busybox"})
WATCH_INTERVAL_S = 0.5
REAP_INTERVAL_S = 0.5
GRACE_S = 30.0  # after the SIGTERM, how long the watchdog waits before SIGKILL
DETACH_ENV = "RAYFORGE_DETACH"


def _load_prctl():
    """libc's ``prctl``, resolved once at import (None where there is none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _prctl_pdeathsig(sig: int) -> bool:
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return _state(pid) != "Z"


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (index 0 = state), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _state(pid: int) -> str | None:
    f = _stat_fields(pid)
    return f[0] if f else None


def parent_of(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[1]) if f else None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def _is_shell_wrapper(pid: int) -> bool:
    """``pid`` runs a shell's ``-c`` (``sh -c 'python -m stages.x ...'``)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and os.path.basename(argv[0].decode(errors="replace")) in SHELLS and b"-c" in argv[1:]


class ParentWatchdog(threading.Thread):
    """Sends this process SIGTERM (then SIGKILL after :data:`GRACE_S`) when its parent goes,
    or, when the parent is a ``sh -c`` wrapper, when the wrapper's own parent goes."""

    def __init__(self) -> None:
        super().__init__(name="rayforge-parent-watchdog", daemon=True)
        self.parent = os.getppid()
        self.grandparent = parent_of(self.parent) if _is_shell_wrapper(self.parent) else None

    def orphaned(self) -> bool:
        if os.getppid() != self.parent:
            return True
        return self.grandparent is not None and parent_of(self.parent) not in (self.grandparent, None)

    def run(self) -> None:
        while not self.orphaned():
            time.sleep(WATCH_INTERVAL_S)
        with contextlib.suppress(OSError):
            os.write(2, f"the process that started this one (pid {os.getpid()}, parent {self.parent}) is gone: "
                        "stopping\n".encode())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)


_watchdog: ParentWatchdog | None = None


def die_with_parent() -> None:
    """Tie this process's life to its parent's (see the module docstring); once per process."""
    global _watchdog
    if os.environ.get(DETACH_ENV) == "1" or _watchdog is not None:
        return
    parent = os.getppid()
    _prctl_pdeathsig(signal.SIGTERM)
    _watchdog = ParentWatchdog()
    if os.getppid() != parent:  # it died while the signal was being armed
        os.kill(os.getpid(), signal.SIGTERM)
    _watchdog.start()


def tied(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when this process (the thread that starts it) dies.

    The child arms PR_SET_PDEATHSIG in a small Python shim and then ``exec``s ``cmd``, which
    keeps the setting; no ``preexec_fn`` runs in a forked copy of this multi-threaded process.
    Start it from the main thread: a worker thread's end would count as the parent's death.
    """
    if os.environ.get(DETACH_ENV) == "1":
        return list(cmd)
    return [sys.executable, os.path.abspath(__file__), "--exec-tied", str(os.getpid()), *cmd]


def _exec_tied(parent: int, cmd: list[str]) -> None:
    _prctl_pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(1)
    os.execvp(cmd[0], cmd)


# ---------------------------------------------------------------- a reaper for children we cannot arm


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (``/proc/<pid>/task/*/children``, else a scan of /proc)."""
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if tasks:
        found = []
        for t in tasks:
            with contextlib.suppress(OSError):
                found += [int(c) for c in t.read_text().split()]
        return found
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and parent_of(int(e.name)) == pid]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def reap_children_when_gone(marker: str) -> subprocess.Popen:
    """Start a small process that, when this one dies, stops its children whose command line holds ``marker``.

    For children another library starts (no ``preexec_fn`` of ours can arm them), such as Prefect's
    temporary server. Start it before they are, and ``terminate()`` it once they are stopped.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--reap-children", str(os.getpid()), marker]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True)


def _reap(parent: int, marker: str) -> None:
    seen: dict[int, int | None] = {}  # child pid -> its start time (a reused pid is not ours)

    def stop(*_: object) -> None:
        mine = [p for p, st in seen.items() if pid_alive(p) and start_time(p) == st]
        for p in mine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(pid_alive(p) for p in mine):
            time.sleep(0.1)
        for p in mine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, stop)
    _prctl_pdeathsig(signal.SIGTERM)
    while os.getppid() == parent:
        for c in children_of(parent):
            if c not in seen and c != os.getpid() and marker.encode() in _cmdline(c):  # not this reaper itself
                seen[c] = start_time(c)
        time.sleep(REAP_INTERVAL_S)
    stop()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--reap-children":
        _reap(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 3 and sys.argv[1] == "--exec-tied":
        _exec_tied(int(sys.argv[2]), sys.argv[3:])
