"""One Prefect task per DVC stage: ``dvc repro --single-item <stage>``, streamed into the run's logs.

Why ``--single-item``: the flow calls the stages in dependency order, so when a task starts
everything upstream is already reproduced; ``--single-item`` keeps the task to its own stage
(its logs, retries, GPU slots and failure belong to that stage) while DVC still skips it
when its deps, params and outs match ``dvc.lock`` ("Stage 'x' didn't change, skipping"), or
restores its outs from the run cache. ``dvc repro <stage>`` would re-walk every upstream
stage inside each task, so an upstream rerun would show up under the wrong stage's name.

Retries: only for faults that can pass on their own (a collective that timed out, a lost
worker, a reset connection, another ``dvc`` holding the repo lock). Anything that says bad
input (a ``ValueError`` and friends, an unknown params key, a missing file) is never
retried, and neither is running out of memory: with the same params on the same GPU it
fails the same way again.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.logging import get_logger, get_run_logger

from stages.common.process import tied

#: Markers of faults that may pass on a second try.
TRANSIENT = {
    "NCCL timeout": re.compile(r"NCCL.*(?:timeout|timed out|time out)|Watchdog caught collective operation timeout", re.I),
    "NCCL error": re.compile(r"NCCL error|nccl(?:System|Remote|Internal)Error"),
    "ChildFailedError": re.compile(r"ChildFailedError"),
    "connection reset": re.compile(r"Connection reset|ECONNRESET", re.I),
    "rendezvous": re.compile(r"Rendezvous(?:Timeout|Connection|Closed)Error"),
    "worker lost": re.compile(r"\bworkers? (?:was |were |has been |have been )?lost\b|\blost (?:a |the )?workers?\b", re.I),
    "DVC lock busy": re.compile(r"Unable to acquire lock"),
}

#: Markers of faults a retry cannot fix; they win over :data:`TRANSIENT` (a worker's
#: ``ValueError`` reaches torchrun's parent as a ``ChildFailedError``).
PERMANENT = {
    "bad input": re.compile(
        r"\b(?:ValueError|TypeError|KeyError|IndexError|ParamsError|FileNotFoundError|NotADirectoryError"
        r"|IsADirectoryError|ModuleNotFoundError|ImportError|SyntaxError|NameError|AttributeError"
        r"|AssertionError|NotImplementedError)(?::|$)"
    ),
    "unknown params key": re.compile(r"unknown params key", re.I),
    "missing input": re.compile(r"^ERROR:.*(?:missing data 'source'|does not exist|not found inside '[^']*dvc.yaml')"),
    "out of memory": re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED", re.I),
}

_EXCEPTION_LINE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Failure|Fault)\b:?.*")
_TAIL_LINES = 200


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero. The message names the stage and carries its own error."""

    def __init__(self, stage: str, returncode: int, error: str,
                 transient: tuple[str, ...] = (), permanent: tuple[str, ...] = ()) -> None:
        self.stage, self.returncode, self.error = stage, returncode, error
        self.transient, self.permanent = tuple(transient), tuple(permanent)
        super().__init__(f"stage {stage!r} failed: {error} (dvc repro exited with {returncode})")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its fields (Prefect may persist it)
        return (type(self), (self.stage, self.returncode, self.error, self.transient, self.permanent))

    @property
    def retryable(self) -> bool:
        """A transient marker was seen and no permanent one."""
        return bool(self.transient) and not self.permanent


def classify(lines: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the transient and permanent markers found in ``lines``, in table order."""
    transient: set[str] = set()
    permanent: set[str] = set()
    for line in lines:
        transient.update(name for name, rx in TRANSIENT.items() if rx.search(line))
        permanent.update(name for name, rx in PERMANENT.items() if rx.search(line))
    return tuple(n for n in TRANSIENT if n in transient), tuple(n for n in PERMANENT if n in permanent)


def error_message(lines: list[str]) -> str:
    """The stage's own error from its output: the last exception line, else DVC's ERROR
    line, else the last line."""
    stripped = [ln.strip() for ln in lines if ln.strip()]
    for ln in reversed(stripped):
        if _EXCEPTION_LINE.match(ln) and not ln.startswith("ERROR:"):
            return ln
    for ln in reversed(stripped):
        if ln.startswith("ERROR:"):
            return ln[len("ERROR:"):].strip()
    return stripped[-1] if stripped else "no output"


def _exception_of(state: Any) -> BaseException | None:
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        result = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result is simply not a transient fault
        return None
    return result if isinstance(result, BaseException) else None


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The run's logger inside a flow or task run, a plain one elsewhere (``.fn()`` in tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return get_logger("rayforge.flows")


def retry_on_transient_fault(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` for stage tasks: True only for a :class:`StageFailed` whose
    output shows a transient fault and no sign of bad input or lack of memory."""
    exc = _exception_of(state)
    if not isinstance(exc, StageFailed):
        return False
    if exc.retryable:
        run_logger().warning("stage %r: transient fault (%s); retrying", exc.stage, ", ".join(exc.transient))
        return True
    why = ", ".join(exc.permanent) or "no transient fault in its output"
    run_logger().info("stage %r: not retried (%s)", exc.stage, why)
    return False


def _stage_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # The stages' `python` and `dvc` are this interpreter's, even from a worker started
    # without activating the virtualenv.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log as they are printed
    env.setdefault("TQDM_MININTERVAL", "10")  # progress bars: a log line every 10 s, not 10 a second
    env.update(extra or {})
    return env


@task(
    task_run_name="{stage}",
    cache_policy=NO_CACHE,  # DVC decides what is up to date, not Prefect
    retries=2,
    retry_delay_seconds=30,
    retry_condition_fn=retry_on_transient_fault,
)
def run_stage(stage: str, repo: str, env: dict[str, str] | None = None,
              gpu_limit: str | None = None, gpu_slots: int = 0) -> str:
    """Reproduce one DVC stage, its output streamed line by line into the run's logs.

    Args:
        stage: the stage's name in ``dvc.yaml``.
        repo: the DVC project's root.
        env: extra environment for the stage (``CUDA_VISIBLE_DEVICES``).
        gpu_limit: name of the Prefect global concurrency limit to hold while the stage
            runs, or None for none.
        gpu_slots: slots of ``gpu_limit`` to hold (the GPUs the stage uses).

    Returns:
        "ran", "skipped" (DVC found it up to date) or "restored" (outs from the run cache).

    Raises:
        StageFailed: the stage exited non-zero; the message names it and ends with its own
            error line.
    """
    logger = run_logger()
    if gpu_limit and gpu_slots > 0:
        from prefect.concurrency.sync import concurrency

        logger.info("waiting for %d slot(s) of the concurrency limit %r", gpu_slots, gpu_limit)
        with concurrency(gpu_limit, occupy=gpu_slots):
            return _repro(stage, Path(repo), env, logger)
    return _repro(stage, Path(repo), env, logger)


def _repro(stage: str, repo: Path, env: Mapping[str, str] | None,
           logger: logging.Logger | logging.LoggerAdapter) -> str:
    # tied: dvc gets SIGTERM if this flow process is killed outright, and the stage stops with it
    cmd = tied([sys.executable, "-m", "dvc", "repro", "--single-item", stage])
    logger.info("$ dvc repro --single-item %s   (in %s)", stage, repo)
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)  # for the error message
    transient: set[str] = set()  # markers from the whole output: a fault may scroll far up
    permanent: set[str] = set()
    status = "ran"
    proc = subprocess.Popen(
        cmd, cwd=repo, env=_stage_env(env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
        start_new_session=True,  # its own process group: a cancelled run stops torchrun's workers too
    )
    try:
        for line in proc.stdout or ():
            line = line.rstrip("\n")
            tail.append(line)
            logger.info("[%s] %s", stage, line)
            found = classify((line,))
            transient.update(found[0])
            permanent.update(found[1])
            if "didn't change, skipping" in line:
                status = "skipped"
            elif "is cached - skipping run" in line:
                status = "restored"
        returncode = proc.wait()
    finally:
        if proc.poll() is None:  # the run was cancelled or crashed while the stage ran
            _stop_group(proc)
    if returncode != 0:
        raise StageFailed(stage, returncode, error_message(list(tail)),
                          tuple(n for n in TRANSIENT if n in transient), tuple(n for n in PERMANENT if n in permanent))
    logger.info("stage %r: %s", stage, status)
    return status


def _stop_group(proc: subprocess.Popen[str], grace_s: float = 20.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
