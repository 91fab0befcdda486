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

from collections import deque

import torch

from ..cuda_graph import GROW_ABOVE, HEADROOM, MAX_AHEAD, QUANTUM, SHRINK_BELOW, GraphStep, budget_for

__all__ = ["CapturedStep", "budget_for", "QUANTUM", "HEADROOM", "GROW_ABOVE", "SHRINK_BELOW", "MAX_AHEAD"]


class CapturedStep(GraphStep):
    """Forward + backward of one NeRF training micro-batch as a replayed CUDA graph.

    Args:
        method: the :class:`~stages.reconstruct.nerf.method.NerfMethod` (its field, grid, step
            size and march settings are what the graph renders with).

    Call it with a micro-batch's rays ``o``, ``d`` [R, 3], target ``rgb`` [R, 3], sample
    ``jitter`` [R] and optionally a ``background`` [R, 3] per ray (random backgrounds) and each ray's
    training ``image`` [R] (appearance codes): the gradients of the training loss (the colour loss,
    plus the distortion term with ``nerf.distortion_loss`` > 0) are *added* to the parameters'
    ``.grad`` (as ``loss.backward()`` would) and ``(loss, mse, num_samples, distortion)`` come back as
    0-d device tensors (``distortion`` None when the term is off). It
    returns None while it has no sample count to size the budget from; the caller then runs the
    step eagerly and reports the count with :meth:`observe`.

    ``required``: a failed capture raises (``cuda_graph: on``); otherwise (``auto``) it is logged
    once, :attr:`failed` holds the reason, and every later call returns None (eager steps).
    The budget, gradient and capture bookkeeping is :class:`~stages.reconstruct.cuda_graph.GraphStep`'s.
    """

    SETTING = "reconstruct.nerf.cuda_graph"

    def __init__(self, method, required: bool = False):
        super().__init__(method, required)
        self.rays = 0
        # nerf.cull_occluded: the march gets a budget of its own (``capacity`` is then the kept
        # samples'), sized and re-sized from the march's counts as the base class does its count
        self.cull = bool(method.cfg.cull_occluded)
        self.march_capacity = 0
        self.march_overflow_steps = 0
        self._need_march: int | None = None
        self._march_pending: deque = deque()  # (event, pinned march count, march budget it ran with)

    # ------------------------------------------------------------------ the captured body
    def _body(self) -> tuple:
        st = self._static
        loss, info, out = self.method.packed_loss(st["o"], st["d"], st["rgb"], st["jitter"],
                                                  capacity=self.capacity, background=st.get("bg"),
                                                  image=st.get("image"),
                                                  march_capacity=self.march_capacity if self.cull else None)
        loss.backward()
        return (info["mse"], out["num_samples"], out["total_samples"], info.get("distortion"), out.get("march_total"),
                loss.detach())

    # ------------------------------------------------------------------ the march's budget (culling)
    def observe_march(self, count: int) -> None:
        """The samples a step's march needed (sizes the next march budget; culling only)."""
        self._need_march = int(count)

    def _collect_march(self) -> None:
        self.march_overflow_steps += self._drain(self._march_pending, self.observe_march, "march overflow")

    def flush(self) -> int | None:
        """The base class's flush, and the march counts' too (culling)."""
        for event, _, _ in self._march_pending:
            event.synchronize()
        self._collect_march()
        return super().flush()

    def _ensure_captured(self) -> bool:
        if self.cull:
            self._collect_march()
            need, cap = self._need_march, self.march_capacity
            if need is not None and not (SHRINK_BELOW * cap <= need <= GROW_ABOVE * cap):
                self.march_capacity = budget_for(need)
                self.graph, self._out = None, None  # captured anew below, with both budgets
        return super()._ensure_captured()

    def _replay(self, count: torch.Tensor) -> None:
        super()._replay(count)
        if self.cull:
            self._push(self._march_pending, self._out[4], self.march_capacity)

    # ------------------------------------------------------------------ replay
    def __call__(self, o: torch.Tensor, d: torch.Tensor, rgb: torch.Tensor, jitter: torch.Tensor,
                 background: torch.Tensor | None = None, image: torch.Tensor | None = None):
        R = o.shape[0]
        if (R != self.rays or (background is None) != ("bg" not in self._static)
                or (image is None) != ("image" not in self._static)):  # new buffers, new graph
            self.flush()  # counts of the old ray count first (a rare sync)
            if self._need is not None and self.rays:  # a new ray count (target_samples): samples follow it
                self._need = int(self._need * R / self.rays)
                if self._need_march is not None:
                    self._need_march = int(self._need_march * R / self.rays)
            self.graph, self._out, self.rays = None, None, R
            self._static = {"o": torch.zeros(R, 3, device=self.device), "d": torch.zeros(R, 3, device=self.device),
                            "rgb": torch.zeros(R, 3, device=self.device),
                            "jitter": torch.zeros(R, device=self.device)}
            if background is not None:
                self._static["bg"] = torch.zeros(R, 3, device=self.device)
            if image is not None:
                self._static["image"] = torch.zeros(R, dtype=torch.int64, device=self.device)
        out = self._run({"o": o, "d": d, "rgb": rgb, "jitter": jitter, "bg": background, "image": image})
        if out is None:
            return None
        mse, num, _, dist, _, loss = out
        return loss.clone(), mse.clone(), num.clone(), None if dist is None else dist.clone()
