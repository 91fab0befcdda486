"""What the methods' CUDA-graph training steps share (nerf/graph.py, gs/graph.py).

A captured step replays a method's forward and backward with fixed addresses and shapes. The one
size that moves from step to step (the NeRF's packed samples, 3DGS's tile intersections) gets a
fixed budget instead of a host read: each replay copies the count it needed to pinned host memory
asynchronously, and the count is read a step or two later, once the GPU is past it. The budget is
:data:`HEADROOM` above the counts seen; the step is captured again, larger, once they pass
:data:`GROW_ABOVE` of it and, smaller, once they fall under :data:`SHRINK_BELOW` of it. A replay
whose count outgrew its budget is counted in :attr:`GraphStep.overflow_steps`; what the method does
with the entries past the budget is its own (the NeRF drops samples, 3DGS the farthest Gaussians'
tiles).

The gradients the graph adds into are allocated once and bound to the parameters' ``.grad`` before
each replay (``_bind_grads``): the optimizers drop them after a step, and a data-parallel reducer
points them at its all-reduce buckets (those are kept when they are what the graph captured).
"""
from __future__ import annotations

import logging
import time
import weakref
from collections import deque

import torch

log = logging.getLogger(__name__)

HEADROOM = 1.3  # budget = HEADROOM x the observed count, rounded up to QUANTUM
QUANTUM = 1 << 14
GROW_ABOVE = 0.9  # capture again, larger, when the count passes this fraction of the budget
SHRINK_BELOW = 0.5  # ... smaller, when it falls under this fraction
MAX_AHEAD = 2  # replays the host may run ahead of the GPU before it waits for a count


_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream a device's warm-ups run on, for every capture of every graph step.

    cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run on, for the life of the
    process; a new ``torch.cuda.Stream`` per capture cycles through PyTorch's pool of 32 streams and
    so left up to 1 GiB of workspaces behind after a few dozen re-captures (measured: 31 blocks of
    32 MiB live after a lego run of 80 captures, twice gsplat's whole peak)."""
    device = torch.device(device)
    if device.index is None:  # "cuda" and "cuda:0" are one device: one stream
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


def budget_for(count: int) -> int:
    """Budget for an observed count: HEADROOM above it, a multiple of QUANTUM."""
    return max(QUANTUM, -(-int(count * HEADROOM) // QUANTUM) * QUANTUM)


class GraphStep:
    """The budget, gradient and capture bookkeeping of a captured training step.

    A subclass keeps its input buffers in ``self._static`` and defines :meth:`_body` (the forward
    and backward on them, returning a tuple whose third item is the count the budget is for; it
    reads ``self.capacity``); its call hands the step's inputs to :meth:`_run`. ``SETTING``
    names the params key that turns the graph off (for the messages).
    """

    SETTING = "cuda_graph"
    WARMUPS = 2  # eager runs of the body on a side stream before a capture
    MAX_BUDGET: int | None = None  # the largest budget the body accepts (None: no limit)

    def __init__(self, method, required: bool = False):
        # held weakly: the method owns its graph step, and a strong reference back would make a
        # cycle that keeps the graph and its memory pool allocated after the method is dropped,
        # until the cycle collector happens to run
        self.method = weakref.proxy(method)
        self.device = method.device
        self.required = required
        self.failed: str | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capacity = 0
        self.captures = 0
        self.capture_s = 0.0  # wall time spent capturing (warm-ups included), the cost of each re-capture
        self.overflow_steps = 0
        self.replays = 0
        self.events: list[tuple] = []  # the first captures and overflows: (kind, replay, count, budget)
        self.max_count = 0
        self._out: tuple | None = None
        self._grads: list[torch.Tensor] | None = None
        self._need: int | None = None  # the count the next budget is sized from
        self._pending: deque = deque()  # (event, pinned count, budget it ran with)
        self._static: dict[str, torch.Tensor] = {}  # the body's inputs, at fixed addresses

    def _body(self) -> tuple:
        raise NotImplementedError

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

    # ------------------------------------------------------------------ counts
    def observe(self, count: int) -> None:
        """The count a step needed (sizes the next budget)."""
        self._need = int(count)
        self.max_count = max(self.max_count, self._need)

    def _collect(self) -> None:
        """Read the counts of finished replays; wait for the oldest when the host is too far ahead."""
        self.overflow_steps += self._drain(self._pending, self.observe, "overflow")

    def _drain(self, pending: deque, observe, kind: str) -> int:
        """Hand the counts of ``pending`` (event, pinned count, budget) whose replays have finished to
        ``observe``, oldest first, waiting for the oldest while more than MAX_AHEAD are pending;
        returns how many of them had outgrown their budget (each noted as ``kind``)."""
        over = 0
        while pending:
            event, host, budget = pending[0]
            if len(pending) > MAX_AHEAD:
                event.synchronize()
            elif not event.query():
                break
            pending.popleft()
            count = int(host)
            if count > budget:
                over += 1
                self._note(kind, count, budget)
            observe(count)
        return over

    @staticmethod
    def _push(pending: deque, count: torch.Tensor, budget: int) -> None:
        """Queue a replay's ``count`` (a 0-d device tensor) for :meth:`_drain`: copied to pinned host
        memory behind the replay, with an event that says when it has arrived."""
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(count.reshape(()), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        pending.append((event, host, budget))

    def flush(self) -> int | None:
        """Wait for every replay and return the latest count (a host sync)."""
        for event, _, _ in self._pending:
            event.synchronize()
        self._collect()
        return self._need

    def _note(self, kind: str, count: int | None, budget: int) -> None:
        log.debug("cuda graph %s at replay %d: count %s, budget %d", kind, self.replays, count, budget)
        if len(self.events) < 40:
            self.events.append((kind, self.replays, count, budget))

    def _give_up(self, reason: str) -> None:
        """Eager steps from now on (the failed capture has put the gradients back)."""
        self.graph, self._out, self.failed = None, None, reason
        log.warning("the training step could not be captured in a CUDA graph; training continues with eager "
                    "steps (%s: off silences this): %s", self.SETTING, reason)

    # ------------------------------------------------------------------ capture and replay
    def _capture(self, capacity: int) -> None:
        self.graph, self._out = None, None  # frees the old graph's memory pool
        # capturing synchronises anyway (torch.cuda.graph drains the queue): drain it first, so that
        # capture_s counts the capture and its warm-ups, not the steps queued before
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.capacity = capacity
        self._bind_grads()
        saved = [g.clone() for g in self._grads]  # the warm-ups add into the gradients: put them back
        try:
            side = warmup_stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # first calls allocate workspaces and load kernels: not in the graph
                for _ in range(self.WARMUPS):
                    self._body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._body()
        finally:
            torch._foreach_copy_(self._grads, saved)
        self.graph, self._out = graph, out
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        self._note("capture", self._need, capacity)

    def _ensure_captured(self) -> bool:
        """Capture when there is no graph or the budget no longer fits the counts; False when the
        capture failed (eager steps from now on, unless the graph is required)."""
        need = self._need
        if self.graph is not None and SHRINK_BELOW * self.capacity <= need <= GROW_ABOVE * self.capacity:
            return True
        budget = budget_for(need)
        if self.MAX_BUDGET is not None:
            budget = min(budget, self.MAX_BUDGET)
        try:
            self._capture(budget)
        except RuntimeError as exc:  # an op that cannot be captured, out of memory, ...
            if self.required:
                raise RuntimeError(f"{self.SETTING} is 'on' but capturing the training step failed: {exc}") from exc
            self._give_up(f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _run(self, inputs: dict[str, torch.Tensor | None]) -> tuple | None:
        """Copy ``inputs`` into the static buffers of the same names (None: not used), capture
        if the budget calls for it, replay; the body's outputs, or None where the caller must run
        the step eagerly (no count seen yet, or no graph)."""
        if self.failed is not None:
            return None
        self._collect()
        if self._need is None:
            return None
        for name, value in inputs.items():
            if value is not None:
                self._static[name].copy_(value, non_blocking=True)
        if not self._ensure_captured():
            return None
        self._replay(self._out[2])
        return self._out

    def _replay(self, count: torch.Tensor) -> None:
        """Replay the graph; ``count`` (one of its outputs) is read back later (:meth:`_collect`)."""
        self._bind_grads()
        self.graph.replay()
        self.replays += 1
        self._push(self._pending, count, self.capacity)
