"""A 3DGS training view's forward and backward captured in a CUDA graph and replayed.

Why: a 3DGS step on an H200 is bound by the host. Measured with ``RAYFORGE_PROFILE`` on lego at
step 2000 (84k Gaussians, 400x400): 1.2 ms of GPU work in a step of about 6 ms. The step is ~150
launches of ATen ops and the rasterizer's kernels, each 15-30 us of Python, dispatcher and driver
time, and the binning read the intersection count back to size its buffers, so the host could
never run ahead. A replayed graph issues the whole view (projection, SH, binning, sort, blending,
loss, SSIM and all their backward) in one call.

What a graph needs, and how it gets it here:

- No host reads: the binning gets a fixed budget of tile intersections (``kernels.rasterization(
  capacity=...)``), sized from the counts of earlier views (:mod:`stages.reconstruct.cuda_graph`:
  the largest of the last :data:`WINDOW` views, 30 % above; scaled up with the Gaussian count when
  densification grows it). A view that needs more than the budget leaves out the farthest
  Gaussians' tiles; such views are counted in ``overflow_steps``.
- Fixed addresses: the view's image, camera and background colour are copied into static
  buffers; the Gaussians are updated in place by the optimizers. Densification replaces them, so
  the graph is keyed by their addresses and count and captured again after each refinement (every
  ``refine_every`` steps until ``refine_stop``), as it is when the SH degree rises or the image
  size changes.
- The densification statistics read the rasterizer's view-space gradients, which the graph
  writes in place: the method accumulates them right after each replay, before the next one.

The optimizer step stays outside (its learning rates change every step).
"""
from __future__ import annotations

from collections import deque

import torch

from kernels.gaussians import MAX_INTERSECTIONS

from ..cuda_graph import GraphStep

WINDOW = 64  # views whose intersection counts size the budget


class CapturedView(GraphStep):
    """Forward + backward of one training view of :class:`~stages.reconstruct.gs.method.GaussianMethod`.

    Call it with the view's uint8 ``image`` [H, W, C], ``viewmat`` [1, 4, 4], ``K`` [1, 3, 3], its
    background colour ``bg`` [3] (a random one; None: the method's own, learned or fixed) and the
    views per step ``n`` (the loss is divided by it): the gradients of the loss are added to the
    parameters' ``.grad`` and ``(loss, mse, meta)`` come back, ``meta`` holding the static
    ``means2d`` (with its ``.grad`` / ``.absgrad``) and ``radii`` the densification statistics read.
    It returns None while no intersection count has been seen (the caller renders eagerly and
    reports the count with :meth:`observe`) and after a failed capture under ``auto``.
    """

    SETTING = "reconstruct.gs.cuda_graph"
    WARMUPS = 1  # the kernels are loaded by the eager view before the first capture
    MAX_BUDGET = MAX_INTERSECTIONS  # the int32 index of flatten_ids

    def __init__(self, method, required: bool = False):
        super().__init__(method, required)
        self.key: tuple | None = None
        self._counts: deque = deque(maxlen=WINDOW)
        self._size = (0, 0, 1)
        self._n = 0  # Gaussians when the key last changed

    def observe(self, count) -> None:
        self._counts.append(int(count))
        self._need = max(self._counts)
        self.max_count = max(self.max_count, self._need)

    def _body(self) -> tuple:
        st, m = self._static, self.method
        width, height, n = self._size
        loss, mse, meta = m._view_loss(st["image"], st["viewmat"], st["K"], width, height, st.get("bg"), n,
                                       capacity=self.capacity)
        loss.backward()
        small = {k: meta[k] for k in ("means2d", "radii", "width", "height", "n_cameras")}
        return loss.detach(), mse, meta["n_intersections"], small

    def __call__(self, image: torch.Tensor, viewmat: torch.Tensor, K: torch.Tensor, bg: torch.Tensor | None,
                 n: int):
        m = self.method
        height, width = image.shape[:2]
        params = m.parameters()
        key = (tuple(image.shape), image.dtype, bg is None, n, m.sh_degree(m._step), m.n,
               tuple(p.data_ptr() for p in params))
        if key != self.key:  # new Gaussians, SH degree or image size: a new graph (the counts carry over)
            if self.key is not None and m.n > self._n and self._counts:
                # grown by densification: intersections grow about as the Gaussians do (clones cover the
                # same tiles), so the counts seen so far are scaled up rather than overflow until new ones come
                grow = m.n / max(self._n, 1)
                self._counts = deque((int(c * grow) for c in self._counts), maxlen=WINDOW)
                self._need = max(self._counts)
            self._n = m.n
            self.graph, self._out, self._grads, self.key = None, None, None, key
            if tuple(self._static.get("image", torch.empty(0)).shape) != tuple(image.shape) or (
                    bg is None) != ("bg" not in self._static):
                self._static = {"image": torch.zeros(image.shape, dtype=image.dtype, device=self.device),
                                "viewmat": torch.zeros(1, 4, 4, device=self.device),
                                "K": torch.zeros(1, 3, 3, device=self.device)}
                if bg is not None:
                    self._static["bg"] = torch.zeros(3, device=self.device)
            self._size = (width, height, n)
        out = self._run({"image": image, "viewmat": viewmat, "K": K, "bg": bg})
        if out is None:
            return None
        loss, mse, _, meta = out
        return loss.clone(), mse.clone(), meta

    def summary(self) -> dict:
        return {"captures": self.captures, "capture_s": round(self.capture_s, 3), "replays": self.replays,
                "overflow_views": self.overflow_steps,
                "budget": self.capacity, "max_intersections": self.max_count, "failed": self.failed}
