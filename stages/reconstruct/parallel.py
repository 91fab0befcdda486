"""How the ranks of a training run share the work: the parallel strategies.

:class:`Replicated` (``reconstruct.distributed.mode: replicated``) is data parallelism: every
rank holds the whole model, trains on its own rays or views, and the gradients are summed
over ranks before each optimizer step. Everything the training loop needs from the process
group goes through a strategy object, so a partitioned strategy (each rank owning a shard of
the Gaussians, issue 21) can sit beside it without touching the loop:

* :meth:`start`: identical replicas from the start (rank 0's initial model broadcast);
* :meth:`begin_step` / :meth:`last_backward_hook` / :meth:`reduce`: the gradient all-reduce;
* :meth:`sync_buffers`: state that is not trained (the occupancy grid) made equal;
* :meth:`reduce_stats`: statistics that must be global before a decision (densification);
* :meth:`rebind`: the parameter set changed (densification), the reducer is rebuilt;
* :meth:`check`: replicas compared by checksum;
* :attr:`saves`: whether this rank writes checkpoints and outs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .distributed import (
    DistContext, GradReducer, broadcast_tensors_, check_replicas, method_buffers, named_state,
)


class Replicated:
    """Data parallelism over ``ctx.world_size`` ranks (a no-op with one process)."""

    name = "replicated"

    def __init__(self, ctx: DistContext, dp):
        self.ctx, self.dp = ctx, dp
        self.reducer: GradReducer | None = None
        self.rebinds = 0

    @property
    def saves(self) -> bool:
        return self.ctx.is_main

    def _reducer(self, method) -> GradReducer:
        dp = self.dp
        wire = None if dp.grad_wire_dtype == "float32" else getattr(torch, dp.grad_wire_dtype)
        return GradReducer(method.parameters(), self.ctx, dp.grad_sync, overlap=dp.overlap_comm, wire_dtype=wire)

    def start(self, method, resumed: bool) -> None:
        """Build the gradient reducer; without a resume, make every replica rank 0's."""
        self.reducer = self._reducer(method)
        if not resumed and self.ctx.active:
            broadcast_tensors_(self.ctx, [p.data for p in method.parameters()]
                               + [t for _, t in method_buffers(method)])

    def rebind(self, method) -> None:
        """The method's parameter tensors were replaced (densification): a reducer for the new ones."""
        self.reducer.close()
        self.reducer = self._reducer(method)
        self.rebinds += 1

    def begin_step(self) -> None:
        self.reducer.attach()  # gradients accumulate straight into the all-reduce buffers

    def last_backward_hook(self):
        """Called before the step's last backward: buckets start their all-reduce as it completes them."""
        return self.reducer.arm

    def reduce(self, scale: float, extras: torch.Tensor) -> torch.Tensor:
        """Sum the gradients over ranks, times ``scale``; returns ``extras`` summed over ranks."""
        return self.reducer.reduce(scale, extras)

    def sync_buffers(self, method) -> None:
        if self.ctx.active:
            broadcast_tensors_(self.ctx, [t for _, t in method_buffers(method)])

    @torch.no_grad()
    def reduce_stats(self, tensors: list[torch.Tensor], ops: list[str]) -> None:
        """All-reduce each tensor in place (``"sum"`` or ``"max"``) so every rank decides alike."""
        if not self.ctx.active:
            return
        for t, op in zip(tensors, ops):
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)

    def check(self, method, step: int) -> None:
        if self.ctx.active:
            check_replicas(self.ctx, named_state(method), step)

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()


STRATEGIES = {"replicated": Replicated}


def make_strategy(ctx: DistContext, dp) -> Replicated:
    mode = getattr(dp, "mode", "replicated")
    if mode not in STRATEGIES:
        raise ValueError(f"reconstruct.distributed.mode: {mode!r} is not available; one of {', '.join(STRATEGIES)}")
    return STRATEGIES[mode](ctx, dp)
