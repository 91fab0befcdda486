"""The NeRF's training forward and backward, captured once in a CUDA graph and replayed every step.

Why: at NeRF batch sizes a training step is bound by the host, not the GPU. With the packed
renderer a step is still ~110 kernel launches (hash encoding, MLPs, compositing and their
backward), each costing 20-30 us of Python, dispatcher and driver time, against a few ms of GPU
work on an H200 (``RAYFORGE_PROFILE``: the GPU was busy 18 % of an eager step with the dense
renderer). A replayed graph issues all of them in one call, and the host is free to prepare the
next step while the GPU runs (default scene, 8192 rays, 1000 steps: 6.4 s eager, 3.0 s graphed).

What a graph needs, and how it gets it here:

- Fixed addresses: the step's rays, colours and sample jitter are copied into static buffers;
  parameters, the occupancy grid and the gradients are updated in place, never replaced (the
  gradients the graph accumulates into are kept here and re-bound after the optimizer drops them,
  or are the all-reduce bucket views that ``GradReducer.attach`` re-binds itself).
- Fixed shapes: how many samples survive the occupancy grid changes every step, so the packed
  samples get a fixed budget (``kernels.march_rays(capacity=...)``) as instant-ngp's fixed sample
  budget; rows past the last sample are zeros that no ray composites.
- No host syncs: the uncut sample count of each step is copied to pinned host memory
  asynchronously and read a step or two later. The budget is 30 % above the count; the step is
  captured again, larger, once the count passes 90 % of the budget (it grows slowly while the
  field fills in: default scene, 8192 rays, 99k samples at step 66, 311k at step 1470) and,
  smaller, once it falls under half of it. A step whose count still outgrew the budget dropped
  its last samples (ray order is random, so random rays were cut short); they are counted in
  :attr:`CapturedStep.overflow_steps` and the summary's ``cuda_graph``.

Capturing costs three eager steps (two warm-ups and the capture); the runs measured captured
1-11 times in 2000-5000 steps (while the grid prunes early on, then as the field fills in).
"""
from __future__ import annotations

import logging
from collections import deque

import torch

log = logging.getLogger(__name__)

HEADROOM = 1.3  # budget = HEADROOM x the observed sample count, rounded up to QUANTUM
QUANTUM = 1 << 14
GROW_ABOVE = 0.9  # capture again, larger, when the count passes this fraction of the budget
SHRINK_BELOW = 0.5  # ... smaller, when it falls under this fraction
MAX_AHEAD = 2  # steps the host may run ahead of the GPU before it waits for a count


def budget_for(count: int) -> int:
    """Sample budget for an observed count: HEADROOM above it, a multiple of QUANTUM."""
    return max(QUANTUM, -(-int(count * HEADROOM) // QUANTUM) * QUANTUM)


class CapturedStep:
    """Forward + backward of one NeRF training micro-batch as a replayed CUDA graph.

    Args:
        method: the :class:`~stages.reconstruct.nerf.method.NerfMethod` (its field, grid, step
            size and march settings are what the graph renders with).

    Call it with a micro-batch's rays ``o``, ``d`` [R, 3], target ``rgb`` [R, 3], sample
    ``jitter`` [R] and optionally a ``background`` [R, 3] per ray (random backgrounds) and each ray's
    training ``image`` [R] (appearance codes): the gradients of the mean squared error are *added* to the parameters' ``.grad``
    (as ``loss.backward()`` would) and ``(mse, num_samples)`` come back as 0-d device tensors. It
    returns None while it has no sample count to size the budget from; the caller then runs the
    step eagerly and reports the count with :meth:`observe`.

    ``required``: a failed capture raises (``cuda_graph: on``); otherwise (``auto``) it is logged
    once, :attr:`failed` holds the reason, and every later call returns None (eager steps).
    """

    def __init__(self, method, required: bool = False):
        self.method = method
        self.device = method.device
        self.required = required
        self.failed: str | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capacity = 0
        self.rays = 0
        self.captures = 0
        self.overflow_steps = 0
        self.replays = 0
        self.events: list[tuple] = []  # the first captures and overflows: (kind, replay, count, budget)
        self.max_count = 0
        self._static: dict[str, torch.Tensor] = {}
        self._out: tuple[torch.Tensor, ...] | None = None
        self._grads: list[torch.Tensor] | None = None
        self._need: int | None = None  # the latest sample count seen on the host
        self._pending: deque = deque()  # (event, pinned count, budget it ran with)

    # ------------------------------------------------------------------ the captured body
    def _body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        st = self._static
        mse, out = self.method.packed_loss(st["o"], st["d"], st["rgb"], st["jitter"], capacity=self.capacity,
                                           background=st.get("bg"), image=st.get("image"))
        mse.backward()
        return mse.detach(), out["num_samples"], out["total_samples"]

    # ------------------------------------------------------------------ gradients
    def _bind_grads(self) -> None:
        """Point every parameter's ``.grad`` at the tensors the graph adds into (zeroed when the
        optimizer had dropped it, i.e. at the start of a step)."""
        params = self.method.parameters()
        if self._grads is None:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._grads = [p.grad for p in params]
            return
        fresh = []
        for p, g in zip(params, self._grads):
            if p.grad is None:
                p.grad = g
                fresh.append(g)
            elif p.grad.data_ptr() != g.data_ptr():  # replaced since the capture: carry it over
                g.copy_(p.grad)
                p.grad = g
        if fresh:
            torch._foreach_zero_(fresh)

    # ------------------------------------------------------------------ sample counts
    def observe(self, count: int) -> None:
        """The sample count of a step (sizes the next budget)."""
        self._need = int(count)
        self.max_count = max(self.max_count, self._need)

    def _collect(self) -> None:
        """Read the counts of finished steps; wait for the oldest when the host is too far ahead."""
        while self._pending:
            event, host, budget = self._pending[0]
            if len(self._pending) > MAX_AHEAD:
                event.synchronize()
            elif not event.query():
                break
            self._pending.popleft()
            count = int(host)
            if count > budget:
                self.overflow_steps += 1
                self._note("overflow", count, budget)
            self.observe(count)

    def flush(self) -> int | None:
        """Wait for every replayed step and return the latest sample count (a host sync: for the
        ray budget's revisions, every ``occ_update_every`` steps)."""
        for event, _, _ in self._pending:
            event.synchronize()
        self._collect()
        return self._need

    def _note(self, kind: str, count: int | None, budget: int) -> None:
        log.debug("cuda graph %s at replay %d: %s samples, budget %d", kind, self.replays, count, budget)
        if len(self.events) < 40:
            self.events.append((kind, self.replays, count, budget))

    def _give_up(self, reason: str) -> None:
        """Eager steps from now on (the failed capture has put the gradients back)."""
        self.graph, self._out, self.failed = None, None, reason
        log.warning("the training step could not be captured in a CUDA graph; training continues with eager "
                    "steps (reconstruct.nerf.cuda_graph: off silences this): %s", reason)

    # ------------------------------------------------------------------ capture and replay
    def _capture(self, capacity: int) -> None:
        self.graph, self._out = None, None  # frees the old graph's memory pool
        self.capacity = capacity
        self._bind_grads()
        saved = [g.clone() for g in self._grads]  # the warm-ups add into the gradients: put them back
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # first calls allocate workspaces and load kernels: not in the graph
                for _ in range(2):
                    self._body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._body()
        finally:
            torch._foreach_copy_(self._grads, saved)
        self.graph, self._out = graph, out
        self.captures += 1
        self._note("capture", self._need, capacity)

    def __call__(self, o: torch.Tensor, d: torch.Tensor, rgb: torch.Tensor, jitter: torch.Tensor,
                 background: torch.Tensor | None = None, image: torch.Tensor | None = None):
        R = o.shape[0]
        if (R != self.rays or (background is None) != ("bg" not in self._static)
                or (image is None) != ("image" not in self._static)):  # new buffers, new graph
            self.flush()  # counts of the old ray count first (a rare sync)
            if self._need is not None and self.rays:  # a new ray count (target_samples): samples follow it
                self._need = int(self._need * R / self.rays)
            self.graph, self._out, self.rays = None, None, R
            self._static = {"o": torch.zeros(R, 3, device=self.device), "d": torch.zeros(R, 3, device=self.device),
                            "rgb": torch.zeros(R, 3, device=self.device),
                            "jitter": torch.zeros(R, device=self.device)}
            if background is not None:
                self._static["bg"] = torch.zeros(R, 3, device=self.device)
            if image is not None:
                self._static["image"] = torch.zeros(R, dtype=torch.int64, device=self.device)
        if self.failed is not None:
            return None
        self._collect()
        if self._need is None:
            return None
        st = self._static
        for k, v in (("o", o), ("d", d), ("rgb", rgb), ("jitter", jitter), ("bg", background), ("image", image)):
            if v is not None:
                st[k].copy_(v)
        need = self._need
        if self.graph is None or need > GROW_ABOVE * self.capacity or need < SHRINK_BELOW * self.capacity:
            try:
                self._capture(budget_for(need))
            except RuntimeError as exc:  # an op that cannot be captured, out of memory, ...
                if self.required:
                    raise RuntimeError(f"reconstruct.nerf.cuda_graph is 'on' but capturing the training step "
                                       f"failed: {exc}") from exc
                self._give_up(f"{type(exc).__name__}: {exc}")
                return None
        self._bind_grads()
        self.graph.replay()
        self.replays += 1
        mse, num, total = self._out
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(total, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, self.capacity))
        return mse.clone(), num.clone()
