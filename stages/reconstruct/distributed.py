"""The process group and the few collectives data-parallel training needs.

Every collective here returns early when ``world_size == 1`` (as gsplat's
``distributed.py``), so the single-process path pays nothing for them. Workers are
started by torchrun, which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT``; :func:`init_from_env` reads
them and joins the group: NCCL with one process per GPU, gloo on the CPU.

Gradients are synchronised by :class:`GradReducer` once per optimizer step (after the
last micro-batch), either as bucketed dense all-reduces or, for large row-sparse
gradients such as a hash table's, as an all-gather of the non-zero rows.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("stages.reconstruct.distributed")

# Dense gradients are flattened into buckets of about this size before the all-reduce
# (DDP's default bucket_cap_mb is 25).
BUCKET_BYTES = 25 * 2**20
# Gradients with at least this many elements (and >= 2 dims) may go the sparse way.
SPARSE_MIN_NUMEL = 2**16
# Spare elements at the end of each attached bucket buffer, for the step's statistics.
EXTRA_SLOTS = 8


@dataclass
class DistContext:
    """Who this process is in the worker group. ``backend`` None: no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """Whether collectives actually communicate."""
        return self.world_size > 1 and self.backend is not None


def under_torchrun(env: dict[str, str] | None = None) -> bool:
    """Whether this process is a worker started by torchrun (or an equivalent launcher)."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def init_from_env(device_setting: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the process group torchrun set up; picks this rank's device.

    Args:
        device_setting: ``reconstruct.device`` (``auto`` = the GPU of ``LOCAL_RANK`` when
            GPUs are visible, else the CPU).
        timeout_s: collective timeout; a hung peer fails the group after this long.
    """
    env = os.environ
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
    if use_cuda:
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"local rank {local_rank} has no GPU: {n} visible "
                             f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    ctx = DistContext(rank, world, local_rank, local_world, device, backend, restarts)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
        if use_cuda:
            kwargs["device_id"] = device
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts > 0:
            # torchrun's shared store still holds the last attempt's keys (pytorch/pytorch#135712):
            # on one host every worker agrees on the restart count, so it can key a fresh namespace.
            if world == local_world:
                store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                                      timeout=timedelta(seconds=timeout_s))
                kwargs.update(store=dist.PrefixStore(f"rayforge/attempt_{restarts}/", store), rank=rank,
                              world_size=world)
                log.info("restart %d: process-group keys under rayforge/attempt_%d/ of torchrun's store",
                         restarts, restarts)
            else:
                log.warning("restarted under torchrun's shared rendezvous store on several hosts: set "
                            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (the stage's launcher does)")
        dist.init_process_group(**kwargs)
    log.info("rank %d/%d (local %d/%d) on %s, backend %s%s", rank, world, local_rank, local_world, device,
             backend, f", restart {restarts}" if restarts else "")
    return ctx


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- small collectives


def all_gather_objects(ctx: DistContext, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (picklable objects; tensors come back on the CPU)."""
    if not ctx.active:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(ctx: DistContext, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not ctx.active:
        return obj
    box = [obj if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_tensor(ctx: DistContext, t: torch.Tensor) -> torch.Tensor:
    """[world_size, *t.shape]: every rank's ``t`` (same shape on every rank)."""
    if not ctx.active:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted so every backend can move it (bool -> uint8), sharing storage."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def broadcast_tensors_(ctx: DistContext, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` (in place, contiguous) on every rank with rank ``src``'s values."""
    if not ctx.active:
        return
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("broadcast_tensors_ needs contiguous tensors")
        dist.broadcast(_as_bytes_view(t.data), src=src)


def named_state(method) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``method.state_dict()`` with a dotted name, in a fixed order."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out.append((prefix, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", method.state_dict())
    return out


def method_buffers(method) -> list[tuple[str, torch.Tensor]]:
    """The method's state that is not a parameter (e.g. the occupancy grid), by name.

    Method-agnostic: every tensor of ``method.state_dict()`` whose storage is not one of
    ``method.parameters()``.
    """
    param_ptrs = {p.data_ptr() for p in method.parameters()}
    return [(n, t) for n, t in named_state(method) if t.data_ptr() not in param_ptrs]


# ---------------------------------------------------------------- replica check


class ReplicaDivergence(RuntimeError):
    """Ranks that should hold identical parameters do not."""


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the raw bits of ``t`` (0-d int64): any bit that differs
    between two copies changes it (short of an unlucky wrap-around)."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    bits = flat.view(view_dtype).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return (bits * weights).sum()


def check_replicas(ctx: DistContext, named: Sequence[tuple[str, torch.Tensor]], step: int) -> None:
    """Compare checksums of ``named`` tensors across ranks; raise if any rank differs.

    Raises:
        ReplicaDivergence: naming the step, the ranks that differ from rank 0 and the tensors.
    """
    if not ctx.active or not named:
        return
    local = torch.stack([tensor_checksum(t) for _, t in named])
    allsums = all_gather_tensor(ctx, local).cpu()  # [world, n]
    bad = (allsums != allsums[0]).any(dim=1).nonzero().flatten().tolist()
    if bad:
        detail = []
        for r in bad:
            diff = (allsums[r] != allsums[0]).nonzero().flatten().tolist()
            detail.append(f"rank {r}: {', '.join(named[i][0] for i in diff[:6])}")
        msg = (f"replicas diverged at step {step}: rank(s) {bad} hold different values from rank 0 "
               f"({'; '.join(detail)}); this rank is {ctx.rank}")
        log.error("%s", msg)
        raise ReplicaDivergence(msg)


# ---------------------------------------------------------------- gradient all-reduce


class GradReducer:
    """Average the gradients of ``params`` over all ranks (and micro-batches).

    ``mode`` ``dense``: the gradients are copied into flat buckets of about
    :data:`BUCKET_BYTES` and all-reduced (sum). ``sparse``: a gradient with at least
    :data:`SPARSE_MIN_NUMEL` elements is exchanged as the indices and values of its
    non-zero rows (all-gather), then summed rank by rank in the same order on every
    rank, so the result is identical everywhere; ``auto`` does that only when the
    gathered rows are fewer bytes than a ring all-reduce of the dense tensor moves.

    ``overlap``: buckets are filled in the order backward produces gradients (the
    reverse of the parameters' order, as in DDP) and each bucket's all-reduce starts,
    asynchronously, from a post-accumulate-grad hook as soon as its last gradient is
    in, so communication runs while backward computes the rest. Call :meth:`arm`
    before the backward of the last micro-batch; :meth:`reduce` launches whatever
    is left, waits and scales. The sums are the same as without overlap.

    ``wire_dtype`` (e.g. ``torch.bfloat16``): dense buckets travel in that type and
    are summed in it (half the bytes; the rounding of a bf16 gradient), then
    converted back.

    :meth:`attach` (once per step, before the first backward) makes every dense
    gradient a view into its bucket's flat buffer (DDP's ``gradient_as_bucket_view``):
    backward accumulates straight into the buffer, the all-reduce runs on it in place
    and one multiply scales it, with no copy in or out; the step's statistics
    (``extras``) ride in the first bucket's tail instead of an all-reduce of their own.
    Eager training steps are host-bound at NeRF batch sizes (~220 kernel launches a step),
    so the launches this saves (a cat per bucket, a copy and a multiply per parameter,
    one all-reduce) counted; with the CUDA-graph step (nerf/graph.py) the bucket views are
    also the fixed gradient tensors the replayed backward adds into. Without :meth:`attach` (or when a gradient was
    replaced), the buckets are gathered and scattered as before.

    A missing gradient (``None``) counts as zeros, so ranks whose rays missed a
    parameter still take part.
    """

    def __init__(self, params: Sequence[torch.Tensor], ctx: DistContext, mode: str = "dense",
                 bucket_bytes: int = BUCKET_BYTES, overlap: bool = False,
                 wire_dtype: torch.dtype | None = None):
        if mode not in ("dense", "sparse", "auto"):
            raise ValueError(f"grad_sync must be dense, sparse or auto, got {mode!r}")
        self.ctx, self.mode, self.wire_dtype = ctx, mode, wire_dtype
        self.params = list(params)
        self.sparse_idx = [i for i, p in enumerate(self.params)
                           if mode != "dense" and p.numel() >= SPARSE_MIN_NUMEL and p.dim() >= 2]
        sparse = set(self.sparse_idx)
        self.overlap = bool(overlap) and ctx.active
        order = range(len(self.params) - 1, -1, -1) if self.overlap else range(len(self.params))
        # A gradient of bucket_bytes or more gets a bucket of its own; the small ones are packed
        # together around it (a hash table between two small MLP tensors must not cut them apart:
        # every bucket is an all-reduce with a fixed cost, ~0.1 ms of host time on an H200 host).
        self.buckets: list[list[int]] = []
        cur: list[int] = []
        cur_bytes = 0
        for i in order:
            if i in sparse:
                continue
            p = self.params[i]
            nbytes = p.numel() * p.element_size()
            if nbytes >= bucket_bytes:
                self.buckets.append([i])
                continue
            if cur and (cur_bytes + nbytes > bucket_bytes or p.dtype != self.params[cur[0]].dtype):
                self.buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += nbytes
        if cur:
            self.buckets.append(cur)
        self.sparse_steps = 0  # how often a gradient went the sparse way (auto mode)
        self._flats: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # bucket -> (flat, views)
        self._armed = False
        self._pending: list[int] = []
        self._inflight: dict[int, tuple[torch.Tensor, Any]] = {}
        self._hooks = []
        if self.overlap:
            bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
            for i, p in enumerate(self.params):
                if i in bucket_of:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket_of[i])))

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def _hook(self, b: int):
        def fire(_p: torch.Tensor) -> None:
            if not self._armed:
                return
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._launch(b)
        return fire

    def arm(self) -> None:
        """The next backward is the step's last: start each bucket's all-reduce when it is complete."""
        if self.overlap:
            self._armed = True
            self._pending = [len(bucket) for bucket in self.buckets]
            self._inflight = {}

    @torch.no_grad()
    def attach(self) -> None:
        """Zero the bucket buffers and point every dense gradient at its slice (call before the
        step's first backward; a no-op with one process or a wire dtype)."""
        if not self.ctx.active or self.wire_dtype is not None:
            return
        for b, bucket in enumerate(self.buckets):
            if b not in self._flats:
                ps = [self.params[i] for i in bucket]
                n = sum(p.numel() for p in ps)
                flat = torch.zeros(n + EXTRA_SLOTS, dtype=ps[0].dtype, device=ps[0].device)
                views, off = [], 0
                for p in ps:
                    views.append(flat[off: off + p.numel()].view_as(p))
                    off += p.numel()
                self._flats[b] = (flat, views)
            else:
                self._flats[b][0].zero_()
            for i, v in zip(bucket, self._flats[b][1]):
                self.params[i].grad = v

    def _bucket_views(self, b: int) -> torch.Tensor | None:
        """The bucket's flat buffer when every gradient in it is still attached, else None."""
        if b not in self._flats:
            return None
        flat, views = self._flats[b]
        for i, v in zip(self.buckets[b], views):
            g = self.params[i].grad
            if g is None or g.data_ptr() != v.data_ptr():
                return None
        return flat

    @torch.no_grad()
    def _launch(self, b: int, extras: torch.Tensor | None = None) -> None:
        flat = self._bucket_views(b)
        if flat is not None:
            n = flat.numel() - EXTRA_SLOTS
            if extras is not None:
                flat[n: n + extras.numel()].copy_(extras)
            self._inflight[b] = (flat, dist.all_reduce(flat, async_op=True), True)
            return
        grads = [self._grad(self.params[i]) for i in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.wire_dtype is not None and flat.dtype != self.wire_dtype:
            flat = flat.to(self.wire_dtype)
        self._inflight[b] = (flat, dist.all_reduce(flat, async_op=True), False)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def reduce(self, scale: float, extras: torch.Tensor | None = None) -> torch.Tensor | None:
        """Sum every gradient over ranks, then multiply by ``scale`` (1 / (ranks x micro-batches)).

        Args:
            scale: factor applied after the sum.
            extras: [k] float32 statistics (loss, samples) summed over ranks alongside
                (in a bucket of their own, never in the wire dtype).

        Returns:
            the summed ``extras`` (unscaled), or None.
        """
        if not self.ctx.active:
            if scale != 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            return extras
        self._armed = False
        if not self.overlap:
            self._inflight = {}
        # the statistics ride in the tail of the first bucket launched here, when it is a float32
        # buffer with room (attached, not yet launched by a hook); else an all-reduce of their own
        ride = None
        if extras is not None and extras.numel() <= EXTRA_SLOTS:
            ride = next((b for b in range(len(self.buckets)) if b not in self._inflight), None)
            flat = None if ride is None else self._bucket_views(ride)
            if flat is None or flat.dtype != extras.dtype:
                ride = None
        for b in range(len(self.buckets)):
            if b not in self._inflight:  # not armed, or a parameter got no gradient this step
                self._launch(b, extras if b == ride else None)
        extras_work = None
        if extras is not None and ride is None:
            extras = extras.clone()
            extras_work = dist.all_reduce(extras, async_op=True)
        for b, bucket in enumerate(self.buckets):
            flat, work, in_place = self._inflight[b]
            work.wait()
            if in_place:  # the gradients are views of flat: scale them all at once
                n = flat.numel() - EXTRA_SLOTS
                if b == ride:
                    extras = flat[n: n + extras.numel()].clone()
                flat[:n].mul_(scale)
                continue
            off = 0
            for i in bucket:
                g = self.params[i].grad
                n = g.numel()
                g.copy_(flat[off: off + n].view_as(g)).mul_(scale)
                off += n
        self._inflight = {}
        if extras_work is not None:
            extras_work.wait()
        for i in self.sparse_idx:
            self._reduce_rows(self._grad(self.params[i]), scale)
        return extras

    def _reduce_rows(self, grad: torch.Tensor, scale: float) -> None:
        ctx = self.ctx
        rows = grad.reshape(-1, grad.shape[-1])
        idx = rows.ne(0).any(dim=1).nonzero().flatten().to(torch.int32)
        counts = all_gather_tensor(ctx, torch.tensor([idx.numel()], device=grad.device)).flatten().tolist()
        n_max = max(counts)
        if n_max == 0:  # no rank touched any row
            grad.zero_()
            return
        row_bytes = rows.shape[1] * rows.element_size()
        if self.mode == "auto":
            gathered = ctx.world_size * n_max * (4 + row_bytes)
            ring = 2 * rows.shape[0] * row_bytes  # a ring all-reduce sends ~2x the tensor
            if gathered >= ring:
                dist.all_reduce(grad)
                grad.mul_(scale)
                return
        self.sparse_steps += 1
        # One uint8 payload per rank: int32 row indices then the rows, padded to n_max.
        pad_idx = torch.zeros(n_max, dtype=torch.int32, device=grad.device)
        pad_idx[: idx.numel()] = idx
        vals = torch.zeros((n_max, rows.shape[1]), dtype=rows.dtype, device=grad.device)
        vals[: idx.numel()] = rows[idx.long()]
        payload = torch.cat([pad_idx.view(torch.uint8), vals.reshape(-1).view(torch.uint8)])
        parts = [torch.empty_like(payload) for _ in range(ctx.world_size)]
        dist.all_gather(parts, payload)
        out = torch.zeros_like(rows)
        for r, part in enumerate(parts):  # same order on every rank: identical sums
            k = counts[r]
            ri = part[: 4 * n_max].view(torch.int32)[:k].long()
            rv = part[4 * n_max:].view(rows.dtype).view(n_max, rows.shape[1])[:k]
            out.index_add_(0, ri, rv)  # indices are unique within a rank: no racing adds
        rows.copy_(out).mul_(scale)


def lr_scale(rule: str, world_size: int) -> float:
    """Learning-rate factor for a global batch ``world_size`` times the tuned one.

    ``sqrt``: Adam-family optimizers keep the update's noise scale when the learning
    rate grows with the square root of the batch (Malladi et al. 2022, "On the SDEs and
    Scaling Rules for Adaptive Gradient Algorithms"); gsplat's ``simple_trainer.py`` and
    Grendel-GS (Zhao et al. 2024, "On Scaling Up 3D Gaussian Splatting Training") scale
    by ``sqrt(batch_size * world_size)``. ``linear``: Goyal et al. 2017 (SGD).
    """
    if rule == "sqrt":
        return float(world_size) ** 0.5
    if rule == "linear":
        return float(world_size)
    if rule == "none":
        return 1.0
    raise ValueError(f"lr_scaling must be sqrt, linear or none, got {rule!r}")


def scale_learning_rates(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply every param group's learning rate (and the scheduler's base rates) by ``factor``."""
    if factor == 1.0:
        return
    for g in optimizer.param_groups:
        g["lr"] *= factor
        if "initial_lr" in g:
            g["initial_lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
