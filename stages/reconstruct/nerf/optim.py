"""How the NeRF is optimised: the hash table's Adam, the learning-rate schedules, the weight average.

instant-ngp trains with tiny-cuda-nn's optimisers, which differ from ``torch.optim.Adam`` in two
ways that matter for a hash table (tiny-cuda-nn ``optimizers/adam.h``, ``optimizers/ema.h``):

* A table entry whose gradient is exactly zero in a step is not stepped at all: its moments do
  not decay and its bias correction counts only the steps it was trained in. ``torch.optim.Adam``
  steps every entry every step, so an entry that a ray touched once keeps moving on its momentum
  for ~20 steps (with eps 1e-15 each of those is ~lr, whatever the gradient's size: about 10 lr in
  all, against 1 lr in tiny-cuda-nn). The fine levels, whose entries most rays miss, are the ones
  that wander. :class:`TableAdam` is tiny-cuda-nn's rule (``nerf.table_optimizer: sparse``).
* The weights rendered are an exponential moving average of the trained ones (decay 0.95 in
  instant-ngp's NeRF config), which averages out the last ~20 steps' noise: :class:`WeightAverage`
  (``nerf.ema_decay``).

The schedules (:func:`lr_factor`): ``exp`` decays from ``lr`` to ``lr_final`` over the run (this
project's first one); ``ngp`` is instant-ngp's: constant after the warm-up, then times
``lr_decay_base`` every ``lr_decay_every`` steps from ``lr_decay_start`` on (20000, 10000, 0.33 in
instant-ngp), so it does not depend on how many steps the run has (a wall-clock budget).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch

import kernels

from ..config import NerfParams


class TableAdam(torch.optim.Optimizer):
    """Adam for a hash table, as tiny-cuda-nn steps its non-matrix parameters: entries whose
    gradient is exactly 0 are left alone (no step, no moment decay), and each entry's bias
    correction counts its own steps (:func:`kernels.sparse_adam_step`: one CUDA launch on a GPU).

    Like torch's fused Adam it reads a ``found_inf`` attribute (a one-element float tensor on the device,
    set by :func:`stages.reconstruct.methods.step_optimizers`): when it is non-zero nothing moves,
    without a host sync. No weight decay (instant-ngp puts none on the table).
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-15,
                 use_kernels: bool | None = None):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        # "fused": the flag methods.step_optimizers looks for to hand over found_inf on the device
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "fused": True})
        self.use_kernels = use_kernels

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TableAdam takes no closure")
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    st["steps"] = torch.zeros_like(p, dtype=torch.int32)
                kernels.sparse_adam_step(p.data, p.grad.float().contiguous(), st["exp_avg"], st["exp_avg_sq"],
                                         st["steps"], group["lr"], group["betas"], group["eps"], found_inf,
                                         use_kernels=self.use_kernels)


def lr_factor(cfg: NerfParams, steps: int) -> Callable[[int], float]:
    """The learning rate at a step as a factor of ``cfg.lr`` (a ``LambdaLR`` lambda).

    ``exp``: a linear warm-up over the first min(100, steps / 10) steps, then exponential decay to
    ``lr_final`` at the last step. ``ngp`` (tiny-cuda-nn's ``ExponentialDecay``, no warm-up): 1
    before ``lr_decay_start``, then ``lr_decay_base`` to the power of the decay points passed
    (one at the start, one every ``lr_decay_every`` steps after it)."""
    if cfg.lr_schedule == "ngp":
        start, every, base = cfg.lr_decay_start, cfg.lr_decay_every, cfg.lr_decay_base
        return lambda step: 1.0 if step < start else base ** ((step - start) // every + 1)
    warmup = min(100, max(1, steps // 10))
    decay = math.log(cfg.lr_final / cfg.lr)

    def exp(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return math.exp(decay * min(1.0, (step - warmup) / max(1, steps - warmup)))

    return exp


class WeightAverage:
    """Exponential moving average of parameters (tiny-cuda-nn's ``Ema`` optimiser wrapper):
    ``avg_t = decay avg_{t-1} + (1 - decay) w_t``, read debiased (divided by 1 - decay^t).

    Args:
        params: the trained tensors, in a fixed order.
        decay: 0.95 in instant-ngp's NeRF config (an average over the last ~20 steps).
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params = params
        self.decay = decay
        self.avg = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.count = torch.zeros((), dtype=torch.float64, device=params[0].device)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in (one fused op; no host sync)."""
        torch._foreach_mul_(self.avg, self.decay)
        torch._foreach_add_(self.avg, [p.float() for p in self.params], alpha=1.0 - self.decay)
        self.count += 1

    @torch.no_grad()
    def debiased(self) -> list[torch.Tensor]:
        """The averaged weights (the trained ones while nothing has been averaged yet)."""
        if float(self.count) == 0:
            return [p.detach() for p in self.params]
        norm = 1.0 - self.decay ** float(self.count)
        return [(a / norm).to(p.dtype) for a, p in zip(self.avg, self.params)]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the parameters for the block (rendering), the trained ones after."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for p, a in zip(self.params, self.debiased()):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)

    def state_dict(self) -> dict:
        return {"avg": list(self.avg), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if len(state["avg"]) != len(self.avg):
            raise ValueError(f"weight average of {len(state['avg'])} tensors, the model has {len(self.avg)}")
        for a, s in zip(self.avg, state["avg"]):
            a.copy_(s)
        self.count.copy_(state["count"])
