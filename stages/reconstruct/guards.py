"""Guards of a training run, for any method: non-finite steps, non-finite saves, running out of memory.

* :class:`StepGuard` keeps the record of the steps the training loop skipped. The loop decides
  on the device whether a step's loss or any gradient (after the all-reduce, so every rank
  alike) is NaN or infinite, and then no optimizer changes any tensor (``train._nonfinite``,
  fused Adam's ``found_inf``); the guard receives that flag for every step. On a CPU it reads it
  at once; on a GPU it reads the flags of a batch of steps at the training curve's log rows
  (one host read per row, none per step). Each skip is logged and counted; after
  :data:`MAX_CONSECUTIVE` skipped steps in a row training stops (:class:`NonFiniteTraining`):
  the run has diverged, and rerunning the same steps would only skip them again. On a GPU the
  stop comes at the first log row after the 20th (the steps in between are skipped as well).
* :func:`check_finite` refuses to save a state with non-finite tensors (checkpoints, the model).
* :func:`oom_advice` names the params that bound GPU memory.

The training loop calls ``guard = StepGuard(lazy=...)``, ``guard.record(step, bad, bad_loss)`` after
each step's check and ``guard.flush()`` at its log rows; the stage reads :func:`current` for its
summary and its interrupt line.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

log = logging.getLogger("stages.reconstruct.guards")

MAX_CONSECUTIVE = 20  # skipped steps in a row that mean divergence, not a glitch


class NonFiniteTraining(ValueError):
    """Training produced non-finite values that cannot be skipped past (or would be saved)."""


class StepGuard:
    """The record of skipped (non-finite) training steps (module docstring)."""

    def __init__(self, max_consecutive: int = MAX_CONSECUTIVE, lazy: bool = False):
        global _current
        self.max_consecutive = max_consecutive
        self.lazy = lazy  # GPU: read the flags at flush() only
        self.step: int | None = None  # the last step recorded (0-based), for the interrupt line
        self.skipped: list[int] = []  # step numbers (1-based, as the training curve counts them)
        self._run = 0
        self._pending: list[tuple[int, torch.Tensor]] = []
        _current = self

    def record(self, step: int, bad: torch.Tensor, bad_loss: torch.Tensor) -> None:
        """``bad``: the step was skipped (its loss or a gradient not finite); ``bad_loss``: the loss
        was (0-d device tensors)."""
        self.step = step
        self._pending.append((step, torch.stack([bad.reshape(()), bad_loss.reshape(())])))
        if not self.lazy:
            self.flush()

    def flush(self) -> None:
        """Read the recorded flags (one host read), log and count the skips, stop on a diverged run."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flags = torch.stack([f for _, f in pending]).cpu().tolist()
        for (step, _), (bad, bad_loss) in zip(pending, flags):
            if not bad:
                self._run = 0
                continue
            self.skipped.append(step + 1)
            self._run += 1
            what = "loss" if bad_loss else "gradients"
            log.warning("step %d: non-finite %s; step skipped, the model is unchanged (%d skipped so far)",
                        step + 1, what, len(self.skipped))
            if self._run >= self.max_consecutive:
                raise NonFiniteTraining(
                    f"training diverged: {self._run} steps in a row (up to step {step + 1}) had a non-finite loss "
                    "or gradients and were skipped; the model and checkpoints hold only finite values. Lower the "
                    "learning rate (reconstruct.nerf.lr, reconstruct.gs.*_lr) or check the input data")

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {"nonfinite_steps_skipped": len(self.skipped), "nonfinite_steps": self.skipped[:100]}


_current: StepGuard | None = None


def current() -> StepGuard | None:
    """The guard of this process's latest training run (None before one started)."""
    return _current


def nonfinite_entries(tree: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in a nested dict/list that hold NaN or Inf."""
    bad: list[str] = []
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not bool(torch.isfinite(tree).all()):
            bad.append(prefix or "tensor")
    elif isinstance(tree, dict):
        for k, v in tree.items():
            bad += nonfinite_entries(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            bad += nonfinite_entries(v, f"{prefix}[{i}]")
    return bad


def check_finite(tree: Any, what: str) -> None:
    """Raise :class:`NonFiniteTraining` naming the entries of ``tree`` that hold NaN or Inf."""
    bad = nonfinite_entries(tree)
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise NonFiniteTraining(f"{what} not written: non-finite values in {', '.join(bad[:5])}{more}; the previous "
                                "checkpoint is kept")


def oom_advice(params: dict) -> str:
    """Which params bound GPU memory, with their values in ``params`` (the whole params.yaml)."""
    rec = params.get("reconstruct") if isinstance(params.get("reconstruct"), dict) else {}
    ing = params.get("ingest") if isinstance(params.get("ingest"), dict) else {}
    gs = rec.get("gs") if isinstance(rec.get("gs"), dict) else {}

    def now(v: Any) -> str:
        return "" if v is None else f" (now {v})"

    size = ing.get("max_size")
    shown = "" if size is None else ", now 0: the photos' size" if size == 0 else f", now {size}"
    return (f"lower reconstruct.batch_rays{now(rec.get('batch_rays'))}, the image resolution (ingest.max_size{shown}) "
            f"or, for 3DGS, the Gaussian budget reconstruct.gs.max_gaussians{now(gs.get('max_gaussians'))}; or train "
            "on a GPU with more memory")
