"""Guards of a training run, for any method: non-finite steps, non-finite saves, running out of memory.

* :class:`StepGuard` sits between the backward and the optimizer step. When the loss or any
  gradient is NaN or infinite, the step is skipped: the gradients are dropped, the optimizer and
  its schedule are not stepped, and the skip is counted and logged, so the model is never
  updated with a non-finite value. The decision reads the gradients after the all-reduce, so
  every rank makes the same one. It costs one host sync per step (a few scalars). After
  :data:`MAX_CONSECUTIVE` skipped steps in a row training stops (:class:`NonFiniteTraining`):
  the run has diverged, and rerunning the same steps would only skip them again.
* :func:`check_finite` refuses to save a state with non-finite tensors (checkpoints, the model).
* :func:`oom_advice` names the params that bound GPU memory.

The training loop calls only ``guard = StepGuard()`` and ``if guard.check(step, loss, params):``
around its optimizer step; the stage reads :func:`current` for its summary and its interrupt line.
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
    """Skips and counts training steps whose loss or gradients are not finite (module docstring)."""

    def __init__(self, max_consecutive: int = MAX_CONSECUTIVE):
        global _current
        self.max_consecutive = max_consecutive
        self.step: int | None = None  # the last step checked (0-based), for the interrupt line
        self.skipped: list[int] = []  # step numbers (1-based, as the training curve counts them)
        self._run = 0
        _current = self

    def check(self, step: int, loss: torch.Tensor, params: Iterable[torch.Tensor]) -> bool:
        """True when ``loss`` and every gradient of ``params`` are finite (take the optimizer step).

        Otherwise drops the gradients (``grad = None``, as ``zero_grad`` does), logs and counts
        the step, and returns False: the caller skips its optimizer step.

        Args:
            step: the step index (0-based, as the loop counts).
            loss: the step's loss statistics (any shape; the all-reduced ones in a group).
            params: every trained parameter (their ``.grad`` after the gradient reduction).
        """
        self.step = step
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        probes = [loss.detach().float().reshape(-1)]  # NaN propagates into min and max, +-Inf shows in one
        probes += [torch.stack(torch.aminmax(g)).float() for g in grads if g.numel()]  # one pass per gradient
        finite = torch.isfinite(torch.cat([t.to(probes[0].device) for t in probes]))
        if bool(finite.all()):  # the host sync
            self._run = 0
            return True
        bad_loss = not bool(finite[:probes[0].numel()].all())
        bad = sum(1 for t in probes[1:] if not bool(torch.isfinite(t).all()))
        for p in params:
            p.grad = None
        self.skipped.append(step + 1)
        self._run += 1
        what = ", ".join(x for x in ((f"loss {probes[0].tolist()}" if bad_loss else ""),
                                     (f"gradients of {bad} of {len(grads)} parameter tensors" if bad else "")) if x)
        log.warning("step %d: non-finite %s; step skipped, the model is unchanged (%d skipped so far)",
                    step + 1, what, len(self.skipped))
        if self._run >= self.max_consecutive:
            raise NonFiniteTraining(
                f"training diverged: {self._run} steps in a row (up to step {step + 1}) had a non-finite loss or "
                "gradients and were skipped; the model and checkpoints hold only finite values. Lower the learning "
                "rate (reconstruct.nerf.lr) or check the input data")
        return False

    def summary(self) -> dict[str, Any]:
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
