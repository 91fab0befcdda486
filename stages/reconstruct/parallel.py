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
* :attr:`saves`: whether this rank writes checkpoints and outs;
* :attr:`sharded`, :attr:`sampler_rank`, :attr:`batch_ranks`: what the loop asks of a strategy
  whose ranks do not each hold the model (checkpoints, the shared view stream, the learning rate).

:class:`Partitioned` (``mode: partitioned``, 3DGS only) shards the Gaussians and splits every
image's tiles over the ranks (``gs/partition.py``, ``gs/shards.py``; docs/distributed.md).
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from .checkpoint import CheckpointMismatch, CorruptCheckpoint
from .distributed import (
    DistContext, GradReducer, all_gather_objects, broadcast_object, broadcast_tensors_, check_replicas,
    method_buffers, named_state,
)

log = logging.getLogger("stages.reconstruct.parallel")


class Replicated:
    """Data parallelism over ``ctx.world_size`` ranks (a no-op with one process)."""

    name = "replicated"
    sharded = False  # every rank holds the whole model: rank 0's checkpoint is the run's

    def __init__(self, ctx: DistContext, dp):
        self.ctx, self.dp = ctx, dp
        self.reducer: GradReducer | None = None
        self.rebinds = 0

    @property
    def saves(self) -> bool:
        return self.ctx.is_main

    @property
    def sampler_rank(self) -> int:
        """Whose shard of the data this rank draws: its own."""
        return self.ctx.rank

    @property
    def batch_ranks(self) -> int:
        """Ranks whose batches make up the global batch (the learning-rate rule's world size)."""
        return self.ctx.world_size

    def summary(self) -> dict | None:
        return None

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


# Gaussian shards are re-split (rows moved with their Adam state) when the largest holds this much
# more than an even split would give it; checked after every densification
SHARD_SLACK = 0.05
IMBALANCE_POINTS = 24  # points of the imbalance series in summary.json


class Partitioned:
    """3DGS with every rank owning a shard of the Gaussians and a range of every image's tiles.

    Every rank renders the same views (samplers from rank 0's streams) through
    :class:`.gs.partition.PartitionedRenderer`, which the strategy installs as the method's
    renderer; each Gaussian's gradient arrives once, at its owner, so there is no gradient
    all-reduce: :meth:`reduce` only undoes the loop's division by the world size, makes a
    non-finite step skipped everywhere and all-reduces the step's figures with the ranks' render
    times of the previous step (the load balancer's input). Checkpoints are one shard per rank and
    a manifest (:meth:`save_checkpoint`); a run resumes with any world size. At the end rank 0
    gathers the shards (:meth:`close`), so the outs hold one model.
    """

    name = "partitioned"
    sharded = True
    sampler_rank = 0  # every rank draws rank 0's views and backgrounds: all render the same view
    batch_ranks = 1  # the global batch is one rank's: the world does not scale the learning rate

    def __init__(self, ctx: DistContext, dp):
        from .gs.partition import PartitionedRenderer

        self.ctx, self.dp = ctx, dp
        self.renderer = PartitionedRenderer(ctx.rank, ctx.world_size, ctx.active, ctx.device)
        self.method = None
        self.rebinds = self.shard_moves = 0
        self.start_step, self.calls, self.step = 0, 0, 0
        self._prev: list = []  # the last step's training renders, whose times the next reduce all-reduces
        self._pending = None  # (all-reduced vector, records) of the last reduce, read at the next step
        self.render_s: list[list[float]] = []  # per step: every rank's rasterization seconds
        self.steps_of_times: list[int] = []
        self.modelled: list[float] = []  # per step: gs.partition.comm_model's bytes for its renders
        self.visible: list[float] = []  # per step: Gaussians visible in its renders
        self.bytes = {"fwd": 0, "bwd": 0, "image": 0, "other": 0, "steps": 0, "renders": 0}
        self._summary: dict | None = None

    @property
    def saves(self) -> bool:
        return self.ctx.is_main

    # ------------------------------------------------------------ start, rows

    def start(self, method, resumed: bool) -> None:
        """Keep this rank's rows of the initial Gaussians (every rank built the same ones) and route
        the method's renders through the partitioned renderer."""
        from .gs.densify import update_rows
        from .gs.partition import even_bounds

        if not hasattr(method, "renderer") or not hasattr(method, "gaussians"):
            raise ValueError("reconstruct.distributed.mode: partitioned shards 3D Gaussians; "
                             f"the {getattr(method, 'name', '?')} method has none (use method: 3dgs)")
        self.method = method
        if not resumed:
            b = even_bounds(method.n, self.ctx.world_size)
            keep = torch.arange(b[self.ctx.rank], b[self.ctx.rank + 1], device=method.gaussians["means"].device)
            update_rows(method.gaussians, method.optimizers, keep, None)
        method.renderer = self.renderer
        if self.ctx.is_main:
            log.info("partitioned: %d rank(s), %d Gaussians on rank 0, tiles split per view (re-split above "
                     "%.0f %% imbalance)", self.ctx.world_size, method.n, 100 * self.renderer.balancer.threshold)

    def _refined(self, step: int) -> bool:
        """Whether densification may have changed the rows at ``step`` (DensifyStrategy.step's schedule)."""
        d = self.method.cfg.densify
        return step > d.refine_start and step % d.refine_every == 0 and step < d.refine_stop

    def _rebalance_rows(self) -> None:
        """Re-split the Gaussians evenly by count when a shard holds too many (rows move with their Adam
        moments and statistics; the global order is kept)."""
        from .gs.partition import even_bounds
        from .gs.shards import exchange_counts, install, layout, move, pack

        m, ctx = self.method, self.ctx
        counts = exchange_counts(ctx, m.n)
        b = even_bounds(sum(counts), ctx.world_size)
        even = [b[r + 1] - b[r] for r in range(ctx.world_size)]
        if max(counts) <= (1 + SHARD_SLACK) * max(even) and (min(counts) > 0 or min(even) == 0):
            return
        lay = layout(m)
        install(m, move(ctx, pack(m, lay), counts, even), lay)
        self.shard_moves += 1
        if ctx.is_main:
            log.debug("partitioned: Gaussians re-split %s -> %s", counts, even)

    # ------------------------------------------------------------ the step

    def begin_step(self) -> None:
        self.step = step = self.start_step + self.calls
        self.calls += 1
        self._settle()
        if self.ctx.active and (self.calls == 1 or self._refined(step - 1)):
            self._rebalance_rows()

    def last_backward_hook(self):
        return None

    def _seconds(self, rec) -> float:
        clock, (a, b, c, d) = self.renderer.clock, rec.marks
        if clock.cuda:
            for e in (b, d):
                if e is not None:
                    e.synchronize()  # the last step's events: long done
        return clock.seconds(a, b) + clock.seconds(c, d)

    def reduce(self, scale: float, extras: torch.Tensor) -> torch.Tensor:
        """Scale the gradients (each Gaussian's is whole already: no all-reduce) by 1 / micro-batches,
        skip the step everywhere when any rank's gradients are not finite, and return the step's
        [loss, mse, work] as the loop expects them: summed over ranks."""
        m, ctx = self.method, self.ctx
        world = ctx.world_size
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        bg = m.bg_logit
        if ctx.active and bg is not None and bg.grad is not None:
            # the learned background is replicated: each rank's gradient is its own tiles' part of it
            dist.all_reduce(bg.grad)
        for g in grads:
            g.mul_(scale * world)  # the loop divides by micro-batches x ranks; ranks hold no copies
        prev, self._prev = self._prev, self.renderer.records
        self.renderer.records = []
        for rec in self._prev:
            rec.step = self.step
        # [loss, mse, work, non-finite, last step's renders: visible Gaussians, their spans, every rank's times]
        R = len(prev)
        vec = torch.zeros(4 + (2 + world) * R, dtype=torch.float64, device=extras.device)
        vec[:3] = extras
        if grads:
            vec[3] = torch.stack([~torch.isfinite(g).all() for g in grads]).any()
        if prev:
            vec[4:4 + R] = torch.stack([r.visible for r in prev]).to(vec.device)
            vec[4 + R:4 + 2 * R] = torch.stack([r.span for r in prev]).to(vec.device)
            mine = torch.tensor([self._seconds(r) for r in prev], dtype=torch.float64)
            at = 4 + (2 + ctx.rank) * R
            vec[at:at + R] = mine.to(vec.device)
        if ctx.active:
            dist.all_reduce(vec)
        self._pending = (vec, prev)
        sent = self.renderer.counters.take()
        for k in ("fwd", "bwd", "image", "other", "renders"):
            self.bytes[k] += sent[k]
        self.bytes["other"] += int(8 * vec.numel() * 2 * (world - 1) / world)
        self.bytes["steps"] += 1
        loss = torch.where(vec[3] > 0, torch.full_like(vec[0], math.nan), vec[0])
        return torch.stack([loss, vec[1], vec[2] / world]).float()

    def _settle(self) -> None:
        """Read the last reduce's render times (one host read) and re-split the views that were uneven."""
        if self._pending is None:
            return
        (vec, recs), self._pending = self._pending, None
        if not recs:
            return
        from .gs.partition import comm_model

        world, R = self.ctx.world_size, len(recs)
        figures = vec[4:].view(2 + world, R).tolist()
        visible, spans, times = figures[0], figures[1], figures[2:]
        self.render_s.append([sum(row) for row in times])
        self.steps_of_times.append(recs[0].step)
        self.modelled.append(sum(
            comm_model(world, v, s / max(v, 1.0), n, tile_size=ts, colours=d, absgrad=a)["total"]
            for v, s, (n, ts, d, a) in zip(visible, spans, (r.model_args for r in recs))))
        self.visible.append(sum(visible))
        for i, rec in enumerate(recs):
            self.renderer.balancer.update(rec.key, rec.bounds, [times[r][i] for r in range(world)])

    def rebind(self, method) -> None:
        """Densification replaced this shard's parameters; nothing holds them but the method."""
        self.rebinds += 1

    def sync_buffers(self, method) -> None:
        """3DGS has no state besides its parameters."""

    def reduce_stats(self, tensors: list[torch.Tensor], ops: list[str]) -> None:
        """Densification statistics need no reduction: each Gaussian's arrives whole at its owner."""

    def check(self, method, step: int) -> None:
        """The state every rank must agree on (scene extent, background, learning rates, Adam steps)."""
        if not self.ctx.active:
            return
        dev = method.gaussians["means"].device
        named = [("extent", torch.tensor(float(method.extent), dtype=torch.float64, device=dev))]
        if method.background is not None:
            named.append(("background", method.background))
        if method.bg_logit is not None:
            named.append(("background_logit", method.bg_logit.detach()))
        for n, opt in method.optimizers.items():
            named.append((f"lr.{n}", torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64, device=dev)))
            st = opt.state.get(opt.param_groups[0]["params"][0], {}).get("step")
            if isinstance(st, torch.Tensor):
                named.append((f"adam_step.{n}", st.to(dev)))
        check_replicas(self.ctx, named, step)

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, store, head: dict, progress: dict, method, rng_state: dict) -> None:
        """Every rank writes its shard; then rank 0 the manifest (``step_<step>.pt``, a checkpoint of
        the store's format naming every shard and its sha256), and removes the shards of older sets."""
        from .gs.shards import remove_stale_shards, save_shard, shard_contents
        from .methods import all_scheduler_state

        ctx, step = self.ctx, int(head["step"])
        rngs = all_gather_objects(ctx, rng_state)
        info = save_shard(store.folder, shard_contents(method, step, ctx.rank, ctx.world_size))
        shards = all_gather_objects(ctx, info)  # also: every shard is on disk before the manifest
        if not ctx.is_main:
            return
        optimizers = {}
        for n, opt in method.optimizers.items():
            p = opt.param_groups[0]["params"][0]
            # a Gaussian parameter's moments are rows of its shards; a replicated one's (the learned
            # background) are kept whole here
            scalars = {k: v for k, v in opt.state.get(p, {}).items()
                       if n not in method.gaussians or not (isinstance(v, torch.Tensor) and v.shape == p.shape)}
            optimizers[n] = {"param_groups": opt.state_dict()["param_groups"], "scalars": scalars}
        state = {k: v for k, v in method.state_dict().items() if k != "params"}
        store.save({**head, "state": state, "optimizers": optimizers, "schedulers": all_scheduler_state(method),
                    "rng": rngs, "local": None, "progress": progress, "shards": shards,
                    "partitioned": {"balancer": self.renderer.balancer.state_dict()}})
        keep = {s["file"] for s in shards}
        for other, path in store.candidates():
            if other != step:
                try:
                    keep |= {s["file"] for s in store.load(path).get("shards") or []}
                except CorruptCheckpoint:
                    pass  # a corrupt manifest names nothing worth keeping
        remove_stale_shards(store.folder, keep)

    def _newest_whole(self, store, expect):
        """Rank 0: the newest manifest that matches ``expect`` and whose shards all read back intact."""
        from .gs.shards import verify_shards

        found = store.candidates()
        for i, (step, path) in enumerate(found):
            try:
                blob = store.load(path)
                expect.check(blob, path, store.folder)
                if not isinstance(blob.get("shards"), list):
                    raise CheckpointMismatch(f"checkpoint {path} is not a partitioned run's manifest; remove "
                                             f"{store.folder} to start over")
                verify_shards(store.folder, blob["shards"])
                return str(path)
            except CorruptCheckpoint as exc:
                nxt = f"falling back to step {found[i + 1][0]}" if i + 1 < len(found) else "no older one left"
                log.warning("checkpoint set of step %d is not whole (%s); %s", step, exc, nxt)
        if found:
            log.warning("no whole checkpoint set in %s: training starts from step 0", store.folder)
        return None

    def load_checkpoint(self, store, expect) -> dict | None:
        """The newest whole checkpoint set, as this rank's part in the loop's checkpoint layout (its
        rows re-split evenly when the set was written by another world size), or None."""
        from .gs.partition import even_bounds
        from .gs.shards import read_rows

        ctx = self.ctx
        chosen = error = None
        if ctx.is_main:
            try:
                chosen = self._newest_whole(store, expect)
            except CheckpointMismatch as exc:
                error = str(exc)
        chosen, error = broadcast_object(ctx, (chosen, error))
        if error:
            raise CheckpointMismatch(error)
        if chosen is None:
            return None
        manifest = store.load(chosen)
        shards, world = manifest["shards"], ctx.world_size
        same = int(manifest["world_size"]) == world
        if same:
            lo = sum(int(s["rows"]) for s in shards[:ctx.rank])
            hi = lo + int(shards[ctx.rank]["rows"])
        else:
            b = even_bounds(sum(int(s["rows"]) for s in shards), world)
            lo, hi = b[ctx.rank], b[ctx.rank + 1]
        rows = read_rows(store.folder, shards, lo, hi)
        optimizers = {}
        for n, saved in manifest["optimizers"].items():
            st = {**saved["scalars"], **rows["moments"].get(n, {})}
            optimizers[n] = {"state": {0: st} if st else {}, "param_groups": saved["param_groups"]}
        rngs = manifest["rng"]
        local = {"densify": {"stats": rows["stats"], "budget_reached": rows["budget_reached"]}}
        if same:
            self.renderer.balancer.load_state_dict(manifest["partitioned"]["balancer"])
        self.start_step = int(manifest["step"])
        if ctx.is_main:
            log.info("partitioned: resuming %d Gaussians written by %d rank(s) on %d", sum(int(s["rows"])
                     for s in shards), int(manifest["world_size"]), world)
        return {**manifest, "state": {**manifest["state"], "params": rows["params"]}, "optimizers": optimizers,
                "rng": [rngs[r] if same else rngs[0] for r in range(world)], "local": [local] * world}

    # ------------------------------------------------------------ the end

    def summary(self) -> dict | None:
        return self._summary

    def _build_summary(self) -> dict:
        """Figures for summary.json (collective: every rank's counts and bytes)."""
        m, world = self.method, self.ctx.world_size
        steps = max(self.bytes["steps"], 1)
        mine = {"gaussians": m.n, **{k: self.bytes[k] / steps for k in ("fwd", "bwd", "image", "other")}}
        ranks = all_gather_objects(self.ctx, mine)
        times = self.render_s
        per_rank_s = [sum(t[r] for t in times) / max(len(times), 1) for r in range(world)]
        series = []
        if times:
            k = max(1, -(-len(times) // IMBALANCE_POINTS))
            bal = self.renderer.balancer
            for i in range(0, len(times), k):
                chunk = times[i:i + k]
                series.append({"step": self.steps_of_times[i] + 1,
                               "imbalance": round(sum(bal.imbalance(t) for t in chunk) / len(chunk), 4)})
        total = {k: sum(r[k] for r in ranks) for k in ("fwd", "bwd", "image", "other")}
        return {"world_size": world,
                "gaussians_per_rank": [r["gaussians"] for r in ranks],
                "render_ms_per_rank": [round(1e3 * s, 3) for s in per_rank_s],
                "imbalance": series,
                "mean_imbalance": round(sum(self.renderer.balancer.imbalance(t) for t in times) / len(times), 4)
                if times else None,
                "tile_resplits": self.renderer.balancer.resplits, "shard_moves": self.shard_moves,
                "comm_bytes_per_step": {**{k: round(v) for k, v in total.items()}, "total": round(sum(total.values()))},
                "comm_bytes_per_step_per_rank": [round(sum(r[k] for k in ("fwd", "bwd", "image", "other")))
                                                 for r in ranks],
                "renders_per_step": self.bytes["renders"] / steps,
                "comm_model_bytes_per_step": round(sum(self.modelled) / len(self.modelled)) if self.modelled else None,
                "visible_per_step": round(sum(self.visible) / len(self.visible)) if self.visible else None}

    def close(self) -> None:
        """Summarise, then gather every shard on rank 0 (its method then holds the whole model, its
        Adam moments in CPU memory) and give the method its single-process renderer back."""
        from .gs.shards import exchange_counts, gather_to_main, install, layout, pack

        m = self.method
        if m is None:
            return
        self._settle()
        self._summary = self._build_summary()
        if self.ctx.active:
            lay = layout(m)
            full = gather_to_main(self.ctx, pack(m, lay), exchange_counts(self.ctx, m.n))
            if full is not None:
                install(m, full.to(m.gaussians["means"].device), lay, moments_device=torch.device("cpu"))
        m.renderer = None
        self.method = None


STRATEGIES = {"replicated": Replicated, "partitioned": Partitioned}


def make_strategy(ctx: DistContext, dp, method: str | None = None) -> Replicated | Partitioned:
    mode = getattr(dp, "mode", "replicated")
    if mode not in STRATEGIES:
        raise ValueError(f"reconstruct.distributed.mode: {mode!r} is not available; one of {', '.join(STRATEGIES)}")
    if mode == "partitioned" and method not in (None, "3dgs"):
        raise ValueError(f"reconstruct.distributed.mode: partitioned shards 3D Gaussians; method {method!r} "
                         "trains replicated only (use method: 3dgs, or mode: replicated)")
    return STRATEGIES[mode](ctx, dp)
