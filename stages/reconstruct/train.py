"""The training loop, method-agnostic: draw a batch, step the method, synchronise, log, checkpoint.

It writes the per-step training curve (``train.csv``: step, loss, psnr, test_psnr, lr,
elapsed_s, samples_per_s) and returns a summary; the caller writes the outs. The method
(``methods.py``: the hash-grid NeRF, 3DGS) is used only through the :class:`methods.Method`
members, and the process group only through the parallel strategy (``parallel.py``).

A step, in phases (:class:`Trainer`): the method refreshes shared state (the occupancy grid)
from a generator every rank shares; each micro-batch is drawn and trained
(``forward_backward``); the strategy sums the gradients over ranks; a step whose loss or
gradients are not finite is skipped and counted (the optimizers leave every tensor as it
was); the optimizers step; ``after_step`` may change the parameter set (densification),
and then the strategy rebinds its gradient buffers. Then the phases every method shares:
replica check, log row (with a cheap held-out PSNR every ``eval_every`` steps), checkpoint.

Data parallel over ``ctx.world_size`` processes (one per GPU, or gloo processes on the CPU):

* Each rank trains on ``method.batch_size()`` units (rays, views) per step in
  ``micro_batches`` micro-batches. Micro-batch ``m`` of rank ``r`` is shard
  ``r * micro_batches + m`` of the global batch and draws from a generator seeded from
  ``seed`` and that shard index; so one process with two micro-batches draws exactly what
  two processes with one draw, and a world of one draws what the single-process loop always
  drew (shard 0 = rank 0).
* Autograd sums the micro-batches' gradients; the strategy sums them over ranks; then they
  are divided by ranks x micro-batches (the gradient of the global batch's mean loss).
* State that is not parameters (the occupancy grid) is refreshed from a generator that
  is the same on every rank, then broadcast from rank 0, so it cannot drift.
* Every learning rate is multiplied by :func:`distributed.lr_scale` of the world size.
* Every ``replica_check_every`` steps, before every checkpoint and at the end, the
  ranks compare checksums of the method's state and fail naming the step and rank.
* Every ``checkpoint_every`` steps rank 0 writes a checkpoint (with every rank's RNG
  state and the optimizers by name); a restarted run resumes from it and continues exactly
  as an uninterrupted one.
"""
from __future__ import annotations

import csv
import io
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from stages.common.params import to_dict

from .checkpoint import CKPT_FORMAT, CheckpointMismatch, CheckpointStore, Expectation
from .config import ReconstructParams
from .data import Scene, sizes_text
from .distributed import DistContext, all_gather_objects, all_gather_tensor, broadcast_object, lr_scale, scale_learning_rates
from .guards import StepGuard
from .methods import all_optimizer_state, all_scheduler_state, build_method, expectation, load_optimizer_state
from .parallel import make_strategy
from .telemetry import ExpectedTime, MetricsServer, StepTimer, TensorBoardLog

log = logging.getLogger("stages.reconstruct.train")

CSV_FIELDS = ["step", "loss", "psnr", "test_psnr", "lr", "elapsed_s", "samples_per_s"]
LOG_EVERY = 25
# Seeds of one `seed` come in blocks of 1_000_003 streams: shard k uses index k, the
# stream every rank shares (occupancy-grid updates) the block's last index.
_STREAMS = 1_000_003
_SHARED = _STREAMS - 1


def mse_to_psnr(mse: float) -> float:
    return -10.0 * math.log10(max(mse, 1e-10))


@dataclass
class TrainResult:
    method: object  # a methods.Method
    rows: list[dict] = field(default_factory=list)
    train_time_s: float = 0.0
    samples_per_s: float = 0.0
    rays_per_s: float = 0.0
    final_psnr: float = float("nan")
    final_test_psnr: float | None = None
    world_size: int = 1
    lr_scale: float = 1.0
    resumed_from_step: int | None = None
    step_compute_s: float | None = None  # mean over the run, this rank
    step_comm_s: float | None = None
    per_rank: list[list[float]] = field(default_factory=list)  # last [samples/s, units/s, compute, comm, peak GB]
    skipped_steps: int = 0  # steps whose loss or gradients were not finite (no update)
    rebinds: int = 0  # times the parameter set changed (densification) and the reducer was rebuilt
    parallel: dict | None = None  # the strategy's figures (partitioned: per-rank render time, bytes, shards)

    def csv_text(self) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in self.rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in CSV_FIELDS})
        return buf.getvalue()


def seeded_generator(seed: int, rank: int, device: torch.device) -> torch.Generator:
    """Every rank (shard) draws its own rays: the stream is seeded from ``seed`` and the shard."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * _STREAMS + rank)
    return g


def shared_generator(seed: int, device: torch.device) -> torch.Generator:
    """The stream every rank draws identically (occupancy-grid refreshes)."""
    return seeded_generator(seed, _SHARED, device)


class _Rng:
    """Every generator one rank draws from, and how to save and restore them."""

    def __init__(self, seed: int, ctx: DistContext, micro_batches: int, device: torch.device,
                 shard_rank: int | None = None):
        self.device = device
        rank = ctx.rank if shard_rank is None else shard_rank  # whose shard streams (parallel strategy)
        self.shards = [seeded_generator(seed, rank * micro_batches + m, device) for m in range(micro_batches)]
        self.grid = shared_generator(seed, device)
        self.eval = seeded_generator(seed + 7, 0, device)

    def state(self) -> dict:
        return {
            "shards": [g.get_state() for g in self.shards],
            "grid": self.grid.get_state(),
            "eval": self.eval.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }

    def restore(self, st: dict) -> None:
        if len(st["shards"]) != len(self.shards):
            raise ValueError(f"checkpoint has {len(st['shards'])} micro-batch streams per rank, this run "
                             f"{len(self.shards)}")
        for g, s in zip(self.shards, st["shards"]):
            g.set_state(s)
        self.grid.set_state(st["grid"])
        self.eval.set_state(st["eval"])
        torch.set_rng_state(st["torch"])
        if self.device.type == "cuda" and st.get("cuda") is not None:
            torch.cuda.set_rng_state(st["cuda"], self.device)


def _resume(checkpoints: CheckpointStore, expect: Expectation, ctx: DistContext) -> dict | None:
    """Rank 0 picks the newest intact, matching checkpoint; every rank loads that one."""
    chosen, error = None, None
    if ctx.is_main:
        try:
            blob = checkpoints.load_latest(expect)
            chosen = None if blob is None else blob["_path"]
        except CheckpointMismatch as exc:
            error = str(exc)
    chosen, error = broadcast_object(ctx, (chosen, error))
    if error:
        raise CheckpointMismatch(error)  # on every rank, before training
    if chosen is None:
        return None
    if ctx.is_main:
        return blob
    try:
        return checkpoints.load(chosen)
    except Exception as exc:
        raise ValueError(f"rank {ctx.rank} cannot read checkpoint {chosen} that rank 0 resumes from ({exc}); "
                         "the checkpoint folder must be on a filesystem every host sees (--checkpoint-dir)") from None


class StepProfiler:
    """``RAYFORGE_PROFILE=<folder>`` profiles the steps ``RAYFORGE_PROFILE_STEPS`` (``a:b``,
    default ``20:40``) with torch.profiler and writes, per rank, the op tables (by GPU and by
    CPU time) to ``<folder>/rank<r>.txt`` and, with ``RAYFORGE_PROFILE_TRACE=1``, a Chrome trace to
    ``<folder>/trace_rank<r>.json``."""

    def __init__(self, rank: int, device: torch.device, subfolder: str = ""):
        """``subfolder``: the tables go to ``<folder>/<subfolder>`` (a second loop profiled in the
        same process, as bench_3dgs.py does for gsplat's)."""
        folder = os.environ.get("RAYFORGE_PROFILE")
        self.folder = os.path.join(folder, subfolder) if folder and subfolder else folder
        a, _, b = os.environ.get("RAYFORGE_PROFILE_STEPS", "20:40").partition(":")
        self.first, self.last = int(a), int(b)
        self.rank, self.device, self.prof = rank, device, None

    def at(self, step: int) -> None:
        if not self.folder:
            return
        from torch.profiler import ProfilerActivity, profile

        if step == self.first and self.prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        elif self.prof is not None and step >= self.last:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.prof.__exit__(None, None, None)
            from pathlib import Path

            out = Path(self.folder)
            out.mkdir(parents=True, exist_ok=True)
            ka = self.prof.key_averages()
            n = step - self.first
            text = [f"rank {self.rank}: steps {self.first}..{step} ({n} steps)"]
            if self.device.type == "cuda":
                text.append(ka.table(sort_by="self_cuda_time_total", row_limit=35))
            text.append(ka.table(sort_by="self_cpu_time_total", row_limit=35))
            (out / f"rank{self.rank}.txt").write_text("\n\n".join(text))
            if os.environ.get("RAYFORGE_PROFILE_TRACE"):
                self.prof.export_chrome_trace(str(out / f"trace_rank{self.rank}.json"))
            self.prof = None
            self.folder = None
            log.info("profile of steps %d..%d written to %s", self.first, step, out)


@torch.no_grad()
def _nonfinite(loss: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, loss): 0-d float32 flags on the device, 1 when the step's loss or any gradient (any) or
    the loss alone holds a NaN or an Inf. One fused check per dtype (GradScaler's, with a scale of
    1, which leaves the gradients as they are) and no host sync, so a GPU step is not held up."""
    bad_loss = (~torch.isfinite(loss)).any().float().reshape(())
    found = bad_loss.clone()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    one = torch.ones((), device=loss.device)
    for grads in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return found, bad_loss


class Trainer:
    """One training run of ``params.method`` on ``scene``; :meth:`run` is the loop (see the module docstring)."""

    def __init__(self, params: ReconstructParams, scene: Scene, device: torch.device, seed: int, progress: bool,
                 ctx: DistContext, checkpoints: CheckpointStore | None, metrics: MetricsServer | None,
                 tensorboard: TensorBoardLog | None, live=None):
        self.params, self.device, self.seed, self.ctx = params, device, seed, ctx
        self.checkpoints, self.metrics, self.tensorboard, self.live = checkpoints, metrics, tensorboard, live
        dp = params.distributed
        self.M, self.world = dp.micro_batches, ctx.world_size
        self.strategy = make_strategy(ctx, dp, params.method)
        torch.manual_seed(seed * _STREAMS)  # every rank initialises as rank 0 would (and rank 0's copy is broadcast)
        self.method = method = build_method(params, scene.aabb, device, scene.background, scene)
        batch = method.batch_size()
        if batch % self.M:
            raise ValueError(f"the batch ({batch} per process) must be a multiple of "
                             f"reconstruct.distributed.micro_batches ({self.M})")
        self.micro = batch // self.M
        self.factor = lr_scale(dp.lr_scaling, self.strategy.batch_ranks)
        for name, opt in method.optimizers.items():
            scale_learning_rates(opt, method.schedulers.get(name), self.factor)
        torch.manual_seed(seed * _STREAMS + ctx.rank)
        self.rng = _Rng(seed, ctx, self.M, device if device.type == "cuda" else torch.device("cpu"),
                        self.strategy.sampler_rank)
        self.train_views = method.place(scene.train)
        self.test_views = scene.test.to(device)
        self.samplers = [method.make_sampler(self.train_views, g) for g in self.rng.shards]
        self.res = TrainResult(method, world_size=self.world, lr_scale=self.factor)
        self.start, self.prior_elapsed, self.prior_samples = 0, 0.0, 0.0
        resumed = self._resume()
        if resumed:
            for s in self.samplers:
                if hasattr(s, "seek"):  # samplers whose position is not in their generator's state
                    s.seek(self.start * self.micro)
        self.strategy.start(method, resumed)
        self.guard = StepGuard(lazy=device.type == "cuda")  # logs the skips; stops a diverged run

    # ------------------------------------------------------------ checkpoints

    def _resume(self) -> bool:
        if self.checkpoints is None:
            return False
        expect = expectation(self.params, self.seed, self.world)
        blob = (self.strategy.load_checkpoint(self.checkpoints, expect) if self.strategy.sharded
                else _resume(self.checkpoints, expect, self.ctx))
        if blob is None:
            return False
        m = self.method
        m.load_state_dict(blob["state"])
        load_optimizer_state(m, blob["optimizers"], blob.get("schedulers"))
        self.rng.restore(blob["rng"][self.ctx.rank])
        if blob.get("local"):
            m.load_local_state(blob["local"][self.ctx.rank])
        self.start = int(blob["step"])
        prog = blob.get("progress") or {}
        self.res.rows = list(prog.get("rows", []))
        self.prior_elapsed, self.prior_samples = float(prog.get("elapsed_s", 0.0)), float(prog.get("samples", 0.0))
        self.res.resumed_from_step = self.start
        self.res.skipped_steps = int(prog.get("skipped_steps", 0))
        if self.ctx.is_main:
            log.info("resumed from %s: step %d of %d", blob.get("_path"), self.start, self.params.steps)
        return True

    def _save_checkpoint(self, done: int, elapsed: float, samples: float) -> None:
        m, p = self.method, self.params
        head = {"format": CKPT_FORMAT, "method": p.method, "method_version": m.VERSION, "config": to_dict(p),
                "seed": self.seed, "world_size": self.world, "step": done, "lr_scale": self.factor}
        progress = {"rows": self.res.rows, "elapsed_s": elapsed, "samples": samples,
                    "skipped_steps": self.res.skipped_steps + len(self.guard.skipped)}
        if self.strategy.sharded:  # a shard per rank and a manifest (parallel.Partitioned)
            self.strategy.save_checkpoint(self.checkpoints, head, progress, m, self.rng.state())
            return
        rngs = all_gather_objects(self.ctx, self.rng.state())
        local = all_gather_objects(self.ctx, self.method.local_state())
        if not self.strategy.saves:
            return
        self.checkpoints.save({
            **head, "state": m.state_dict(), "optimizers": all_optimizer_state(m),
            "schedulers": all_scheduler_state(m), "rng": rngs, "local": local, "progress": progress,
        })
        log.debug("checkpoint of step %d written to %s", done, self.checkpoints.folder)

    # ------------------------------------------------------------ one step

    def step(self, step: int, timer: StepTimer) -> tuple[torch.Tensor, torch.Tensor]:
        """Train one step; returns [loss, mse, work] summed over micro-batches and ranks, and this
        rank's work alone (device tensors)."""
        m, strategy = self.method, self.strategy
        timer.begin_step()
        if m.step_pre_forward(step, self.rng.grid) is not None and self.ctx.active:
            timer.comm_begin()
            strategy.sync_buffers(m)
            timer.comm_end()
        strategy.begin_step()
        acc = None
        for k in range(self.M):
            batch = self.samplers[k].sample(self.micro)
            info = m.forward_backward(batch, self.rng.shards[k],
                                      strategy.last_backward_hook() if k == self.M - 1 else None)
            row = torch.stack([info["loss"].float().reshape(()), info["mse"].float().reshape(()),
                               torch.as_tensor(info["num_samples"], device=info["mse"].device).float().reshape(())])
            acc = row if acc is None else acc + row  # stays on the device: no sync
        timer.comm_begin()
        extras = strategy.reduce(1.0 / (self.M * self.world), acc)
        timer.comm_end()
        bad, bad_loss = _nonfinite(extras[:2], m.parameters())
        self.guard.record(step, bad, bad_loss)
        m.optimizer_step(step, bad)
        if m.after_step(step, strategy):
            strategy.rebind(m)
            self.res.rebinds += 1
        timer.end_step()
        return extras, acc[2]

    # ------------------------------------------------------------ the loop

    def run(self, progress: bool) -> TrainResult:
        p, ctx, m, res = self.params, self.ctx, self.method, self.res
        dp = p.distributed
        if ctx.is_main:
            log.info(
                "training %s on %s for %d steps: %d train / %d test views at %s, %d parameters, kernels %s; "
                "%d process(es) x %d %s (%d micro-batch(es)) per step, lr x %.3g (%s)",
                p.method, self.device, p.steps, len(self.train_views), len(self.test_views),
                sizes_text(self.train_views), m.num_params,
                "on" if m.use_kernels else "off", self.world, m.batch_size(), m.UNIT, self.M, self.factor,
                dp.lr_scaling,
            )
        timer = StepTimer(self.device)
        sums = torch.zeros(3, device=self.device)  # [loss, mse, work] summed over ranks and steps of this session
        local_acc = torch.zeros((), dtype=torch.float64, device=self.device)  # this rank's work, on the device
        run_compute = run_comm = 0.0
        run_steps = 0
        mark_t, mark_samples, mark_step = time.perf_counter(), 0, self.start
        t0 = time.perf_counter()
        bar = tqdm(range(self.start, p.steps), desc="reconstruct", unit="step", initial=self.start, total=p.steps,
                   disable=not (progress and ctx.is_main), mininterval=2.0)
        prof = StepProfiler(ctx.rank, self.device)
        expected = ExpectedTime(self.start, p.steps, self.device, enabled=ctx.is_main)
        scale = self.M * self.world
        for step in bar:
            done = step + 1
            prof.at(step)
            extras, mine = self.step(step, timer)
            expected.after(done)
            if self.live is not None:  # a browser's waiting renders run here, between two steps
                self.live.update(m, done)
            sums += extras.to(sums.device)
            local_acc += mine

            last = done == p.steps
            ckpt_now = (self.checkpoints is not None and dp.checkpoint_every > 0 and done % dp.checkpoint_every == 0
                        and not last)
            if ckpt_now or last or (dp.replica_check_every and done % dp.replica_check_every == 0):
                self.strategy.check(m, done)

            if step % LOG_EVERY == 0 or last or done % p.eval_every == 0:
                loss_now = float(extras[0]) / scale
                mse_now = float(extras[1]) / scale
                elapsed = self.prior_elapsed + time.perf_counter() - t0
                row = {
                    "step": done,
                    "loss": round(loss_now, 6),
                    "psnr": round(mse_to_psnr(mse_now), 3),
                    "test_psnr": None,
                    "lr": next(iter(m.optimizers.values())).param_groups[0]["lr"],
                    "elapsed_s": round(elapsed, 2),
                    "samples_per_s": round((self.prior_samples + float(sums[2])) / max(elapsed, 1e-9)),
                }
                # per-rank throughput and the compute / communication split since the last row
                comp, comm, n = timer.flush()
                run_compute, run_comm, run_steps = run_compute + comp, run_comm + comm, run_steps + n
                wall = max(time.perf_counter() - mark_t, 1e-9)
                local_samples = float(local_acc)
                peak_gb = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else 0.0
                mine = torch.tensor([(local_samples - mark_samples) / wall,
                                     (done - mark_step) * m.batch_size() / wall,
                                     comp / max(n, 1), comm / max(n, 1), peak_gb], dtype=torch.float64,
                                    device=ctx.device if ctx.backend == "nccl" else "cpu")
                res.per_rank = all_gather_tensor(ctx, mine).cpu().tolist()
                mark_t, mark_samples, mark_step = time.perf_counter(), local_samples, done
                # a sharded model renders on every rank together (the same view: same eval generator)
                if (ctx.is_main or self.strategy.sharded) and ((done % p.eval_every == 0) or last):
                    tp = m.quick_test_psnr(self.test_views, self.rng.eval)
                    row["test_psnr"] = None if tp is None else round(tp, 3)
                if ctx.is_main and ((done % p.eval_every == 0) or last):
                    log.info("step %d/%d loss %.5f train psnr %.2f test psnr %s (%.1f s)", done, p.steps,
                             loss_now, row["psnr"], "n/a" if tp is None else f"{tp:.2f}", elapsed)
                    if self.world > 1:
                        log.info("per rank: %s", "; ".join(
                            f"rank {r}: {sps:,.0f} samples/s, step {1e3 * (c + cm):.1f} ms = {1e3 * c:.1f} compute "
                            f"+ {1e3 * cm:.1f} comm" for r, (sps, _, c, cm, *_) in enumerate(res.per_rank)))
                self.guard.flush()  # on a GPU the skipped steps of this row are logged (and counted) here
                res.rows.append(row)
                if self.metrics is not None:
                    self.metrics.update(done, loss_now, row["psnr"], row["test_psnr"], res.per_rank)
                if self.tensorboard is not None:
                    self.tensorboard.update(row, res.per_rank)
                bar.set_postfix(loss=f"{loss_now:.4f}", psnr=f"{row['psnr']:.2f}")

            if ckpt_now:
                self._save_checkpoint(done, self.prior_elapsed + time.perf_counter() - t0,
                                      self.prior_samples + float(sums[2]))
        bar.close()
        self.guard.flush()
        prof.at(p.steps)
        self.strategy.close()
        res.parallel = self.strategy.summary()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        comp, comm, n = timer.flush()
        run_compute, run_comm, run_steps = run_compute + comp, run_comm + comm, run_steps + n
        res.train_time_s = self.prior_elapsed + time.perf_counter() - t0
        res.samples_per_s = (self.prior_samples + float(sums[2])) / max(res.train_time_s, 1e-9)
        res.rays_per_s = p.steps * m.batch_size() * self.strategy.batch_ranks / max(res.train_time_s, 1e-9)
        res.skipped_steps += len(self.guard.skipped)
        if run_steps:
            res.step_compute_s, res.step_comm_s = run_compute / run_steps, run_comm / run_steps
        res.final_psnr = res.rows[-1]["psnr"]
        res.final_test_psnr = res.rows[-1]["test_psnr"]
        return res


def train(
    params: ReconstructParams,
    scene: Scene,
    device: torch.device,
    seed: int,
    progress: bool = True,
    *,
    ctx: DistContext | None = None,
    checkpoints: CheckpointStore | None = None,
    metrics: MetricsServer | None = None,
    tensorboard: TensorBoardLog | None = None,
    live=None,
) -> TrainResult:
    """Train ``params.method`` on ``scene``; see the module docstring for the distributed part.

    Args:
        ctx: this process's place in the worker group (None: a single process).
        checkpoints: where to write and resume checkpoints (None: neither).
        metrics: rank 0's Prometheus gauges (None: off).
        tensorboard: rank 0's TensorBoard scalars (None: off).
        live: rank 0's ``stages.viewer.LiveViewer`` (None: off), updated after every step.
    """
    ctx = ctx or DistContext(device=device)
    return Trainer(params, scene, device, seed, progress, ctx, checkpoints, metrics, tensorboard, live).run(progress)
