"""The training loop, method-agnostic: draw rays, step the method, synchronise, log, checkpoint.

It writes the per-step training curve (``train.csv``: step, loss, psnr, test_psnr, lr,
elapsed_s, samples_per_s) and returns a summary; the caller writes the outs.

Data parallel over ``ctx.world_size`` processes (one per GPU, or gloo processes on the CPU):

* Each rank draws ``batch_rays`` rays per step in ``micro_batches`` micro-batches.
  Micro-batch ``m`` of rank ``r`` is shard ``r * micro_batches + m`` of the global batch
  and draws its rays (and their jitter) from a generator seeded from ``seed`` and that
  shard index; so one process with two micro-batches draws exactly the rays two
  processes with one draw, and a world of one draws what the single-process loop always
  drew (shard 0 = rank 0).
* Autograd sums the micro-batches' gradients; one :class:`GradReducer` call after the
  last sums them over ranks; then they are divided by ranks x micro-batches (the
  gradient of the global batch's mean loss).
* State that is not parameters (the occupancy grid) is refreshed from a generator that
  is the same on every rank, then broadcast from rank 0, so it cannot drift.
* The learning rate is multiplied by :func:`distributed.lr_scale` of the world size.
* Every ``replica_check_every`` steps, before every checkpoint and at the end, the
  ranks compare checksums of the method's state and fail naming the step and rank.
* Every ``checkpoint_every`` steps rank 0 writes a checkpoint (with every rank's RNG
  state); a restarted run resumes from it and continues exactly as an uninterrupted one.

The method is used only through: ``parameters()``, ``state_dict()``,
``load_state_dict()``, ``optimizer``, ``scheduler`` (optional), ``step_pre_forward(step,
generator)`` (returns None when it left its state alone), ``loss(o, d, rgb,
generator)``, ``optimizer_step()``, ``render_rays()``, ``num_params``, ``use_kernels``.
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
from .data import RaySampler, Scene
from .distributed import (
    DistContext, GradReducer, all_gather_objects, all_gather_tensor, broadcast_object, broadcast_tensors_,
    check_replicas, lr_scale, method_buffers, named_state, scale_learning_rates,
)
from .guards import StepGuard
from .nerf.method import NerfMethod
from .telemetry import MetricsServer, StepTimer, TensorBoardLog

log = logging.getLogger("stages.reconstruct.train")

CSV_FIELDS = ["step", "loss", "psnr", "test_psnr", "lr", "elapsed_s", "samples_per_s"]
LOG_EVERY = 25
# Seeds of one `seed` come in blocks of 1_000_003 streams: shard k uses index k, the
# stream every rank shares (occupancy-grid updates) the block's last index.
_STREAMS = 1_000_003
_SHARED = _STREAMS - 1


def build_method(params: ReconstructParams, aabb: torch.Tensor, device: torch.device,
                 background: tuple[float, float, float] | None = None) -> NerfMethod:
    if params.method == "nerf":
        return NerfMethod(params, aabb, device, background)
    raise ValueError(f"reconstruct.method: unknown method {params.method!r}")


def mse_to_psnr(mse: float) -> float:
    return -10.0 * math.log10(max(mse, 1e-10))


@dataclass
class TrainResult:
    method: NerfMethod
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
    per_rank: list[list[float]] = field(default_factory=list)  # last [samples/s, rays/s, compute, comm, peak GB]

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


@torch.no_grad()
def held_out_psnr(method: NerfMethod, scene: Scene, generator: torch.Generator, n_rays: int = 4096) -> float | None:
    """PSNR on random rays of the test views (a cheap point on the training curve)."""
    if len(scene.test) == 0:
        return None
    sampler = RaySampler(scene.test, generator)
    o, d, rgb = sampler.sample(n_rays)
    pred = method.render_rays(o, d)
    return mse_to_psnr(float(torch.mean((pred - rgb) ** 2)))


class _Rng:
    """Every generator one rank draws from, and how to save and restore them."""

    def __init__(self, seed: int, ctx: DistContext, micro_batches: int, device: torch.device):
        self.device = device
        self.shards = [seeded_generator(seed, ctx.rank * micro_batches + m, device) for m in range(micro_batches)]
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

    def __init__(self, rank: int, device: torch.device):
        self.folder = os.environ.get("RAYFORGE_PROFILE")
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
) -> TrainResult:
    """Train ``params.method`` on ``scene``; see the module docstring for the distributed part.

    Args:
        ctx: this process's place in the worker group (None: a single process).
        checkpoints: where to write and resume checkpoints (None: neither).
        metrics: rank 0's Prometheus gauges (None: off).
        tensorboard: rank 0's TensorBoard scalars (None: off).
    """
    ctx = ctx or DistContext(device=device)
    dp = params.distributed
    M, world = dp.micro_batches, ctx.world_size
    if params.batch_rays % M:
        raise ValueError(f"reconstruct.batch_rays ({params.batch_rays}) must be a multiple of "
                         f"reconstruct.distributed.micro_batches ({M})")
    micro_rays = params.batch_rays // M
    torch.manual_seed(seed * _STREAMS)  # every rank initialises as rank 0 would (and rank 0's copy is broadcast)
    method = build_method(params, scene.aabb, device, scene.background)
    scheduler = getattr(method, "scheduler", None)
    factor = lr_scale(dp.lr_scaling, world)
    scale_learning_rates(method.optimizer, scheduler, factor)
    torch.manual_seed(seed * _STREAMS + ctx.rank)
    rng = _Rng(seed, ctx, M, device if device.type == "cuda" else torch.device("cpu"))
    train_views = scene.train.to(device)
    test_views = scene.test.to(device)
    scene_dev = Scene(train_views, test_views, scene.aabb, scene.background)
    samplers = [RaySampler(train_views, g) for g in rng.shards]
    reducer = GradReducer(method.parameters(), ctx, dp.grad_sync, overlap=dp.overlap_comm,
                          wire_dtype=None if dp.grad_wire_dtype == "float32" else getattr(torch, dp.grad_wire_dtype))

    res = TrainResult(method, world_size=world, lr_scale=factor)
    start, prior_elapsed, prior_samples = 0, 0.0, 0.0
    blob = None
    if checkpoints is not None:
        expect = Expectation(params.method, to_dict(params), seed, world)
        blob = _resume(checkpoints, expect, ctx)
    if blob is not None:
        method.load_state_dict(blob["state"])
        method.optimizer.load_state_dict(blob["optimizer"])
        if scheduler is not None and blob.get("scheduler") is not None:
            scheduler.load_state_dict(blob["scheduler"])
        rng.restore(blob["rng"][ctx.rank])
        start = int(blob["step"])
        prog = blob.get("progress") or {}
        res.rows = list(prog.get("rows", []))
        prior_elapsed, prior_samples = float(prog.get("elapsed_s", 0.0)), float(prog.get("samples", 0.0))
        res.resumed_from_step = start
        if ctx.is_main:
            log.info("resumed from %s: step %d of %d", blob.get("_path"), start, params.steps)
        del blob
    elif ctx.active:  # identical replicas from the start, whatever each rank's RNG did
        broadcast_tensors_(ctx, [p.data for p in method.parameters()] + [t for _, t in method_buffers(method)])

    if ctx.is_main:
        log.info(
            "training %s on %s for %d steps: %d train / %d test views at %dx%d, %d parameters, kernels %s; "
            "%d process(es) x %d rays (%d micro-batch(es)) = %d rays per step, lr x %.3g (%s)",
            params.method, device, params.steps, len(train_views), len(test_views), scene.train.intr.width,
            scene.train.intr.height, method.num_params, "on" if method.use_kernels else "off", world,
            params.batch_rays, M, params.batch_rays * world, factor, dp.lr_scaling,
        )
    timer = StepTimer(device)
    sums = torch.zeros(2, device=device)  # [loss, samples] summed over ranks and steps of this session
    local_acc = torch.zeros((), dtype=torch.float64, device=device)  # this rank's samples, summed on the device
    run_compute = run_comm = 0.0
    run_steps = 0
    mark_t, mark_samples, mark_step = time.perf_counter(), 0, start
    t0 = time.perf_counter()
    bar = tqdm(range(start, params.steps), desc="reconstruct", unit="step", initial=start, total=params.steps,
               disable=not (progress and ctx.is_main), mininterval=2.0)
    prof = StepProfiler(ctx.rank, device)
    guard = StepGuard()  # skips (and counts) a step whose loss or gradients are not finite
    for step in bar:
        done = step + 1
        prof.at(step)
        timer.begin_step()
        if method.step_pre_forward(step, rng.grid) is not None and ctx.active:
            timer.comm_begin()
            broadcast_tensors_(ctx, [t for _, t in method_buffers(method)])
            timer.comm_end()
        reducer.attach()  # gradients accumulate straight into the all-reduce buffers
        loss_acc = samples_acc = None
        for m in range(M):
            o, d, rgb = samplers[m].sample(micro_rays)
            # on the last micro-batch, gradient buckets start their all-reduce as backward completes them
            info = method.forward_backward(o, d, rgb, rng.shards[m], reducer.arm if m == M - 1 else None)
            mse = info["mse"].float().reshape(())
            ns = torch.as_tensor(info["num_samples"], device=mse.device).float().reshape(())
            loss_acc = mse if loss_acc is None else loss_acc + mse
            samples_acc = ns if samples_acc is None else samples_acc + ns  # stays on the device: no sync
        extras = torch.stack([loss_acc, samples_acc])
        timer.comm_begin()
        extras = reducer.reduce(1.0 / (M * world), extras)
        timer.comm_end()
        if guard.check(step, extras, method.parameters()):
            method.optimizer_step()
        timer.end_step()
        sums += extras.to(sums.device)
        local_acc += samples_acc

        last = done == params.steps
        ckpt_now = (checkpoints is not None and dp.checkpoint_every > 0 and done % dp.checkpoint_every == 0
                    and not last)
        if ctx.active and (ckpt_now or last or (dp.replica_check_every and done % dp.replica_check_every == 0)):
            check_replicas(ctx, named_state(method), done)

        if step % LOG_EVERY == 0 or last or done % params.eval_every == 0:
            loss_now = float(extras[0]) / (M * world)
            elapsed = prior_elapsed + time.perf_counter() - t0
            row = {
                "step": done,
                "loss": round(loss_now, 6),
                "psnr": round(mse_to_psnr(loss_now), 3),
                "test_psnr": None,
                "lr": method.optimizer.param_groups[0]["lr"],
                "elapsed_s": round(elapsed, 2),
                "samples_per_s": round((prior_samples + float(sums[1])) / max(elapsed, 1e-9)),
            }
            # per-rank throughput and the compute / communication split since the last row
            comp, comm, n = timer.flush()
            run_compute, run_comm, run_steps = run_compute + comp, run_comm + comm, run_steps + n
            wall = max(time.perf_counter() - mark_t, 1e-9)
            local_samples = float(local_acc)
            peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
            mine = torch.tensor([(local_samples - mark_samples) / wall, (done - mark_step) * params.batch_rays / wall,
                                 comp / max(n, 1), comm / max(n, 1), peak_gb], dtype=torch.float64,
                                device=ctx.device if ctx.backend == "nccl" else "cpu")
            res.per_rank = all_gather_tensor(ctx, mine).cpu().tolist()
            mark_t, mark_samples, mark_step = time.perf_counter(), local_samples, done
            if ctx.is_main and ((done % params.eval_every == 0) or last):
                tp = held_out_psnr(method, scene_dev, rng.eval)
                row["test_psnr"] = None if tp is None else round(tp, 3)
                log.info("step %d/%d loss %.5f train psnr %.2f test psnr %s (%.1f s)", done, params.steps,
                         loss_now, row["psnr"], "n/a" if tp is None else f"{tp:.2f}", elapsed)
                if world > 1:
                    log.info("per rank: %s", "; ".join(
                        f"rank {r}: {sps:,.0f} samples/s, step {1e3 * (c + cm):.1f} ms = {1e3 * c:.1f} compute + "
                        f"{1e3 * cm:.1f} comm" for r, (sps, _, c, cm, *_) in enumerate(res.per_rank)))
            res.rows.append(row)
            if metrics is not None:
                metrics.update(done, loss_now, row["psnr"], row["test_psnr"], res.per_rank)
            if tensorboard is not None:
                tensorboard.update(row, res.per_rank)
            bar.set_postfix(loss=f"{loss_now:.4f}", psnr=f"{row['psnr']:.2f}")

        if ckpt_now:
            rngs = all_gather_objects(ctx, rng.state())
            if ctx.is_main:
                checkpoints.save({
                    "format": CKPT_FORMAT, "method": params.method, "config": to_dict(params), "seed": seed,
                    "world_size": world, "step": done, "lr_scale": factor,
                    "state": method.state_dict(), "optimizer": method.optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "rng": rngs,
                    "progress": {"rows": res.rows, "elapsed_s": prior_elapsed + time.perf_counter() - t0,
                                 "samples": prior_samples + float(sums[1])},
                })
                log.debug("checkpoint of step %d written to %s", done, checkpoints.folder)
    bar.close()
    prof.at(params.steps)
    reducer.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    comp, comm, n = timer.flush()
    run_compute, run_comm, run_steps = run_compute + comp, run_comm + comm, run_steps + n
    res.train_time_s = prior_elapsed + time.perf_counter() - t0
    res.samples_per_s = (prior_samples + float(sums[1])) / max(res.train_time_s, 1e-9)
    res.rays_per_s = params.steps * params.batch_rays * world / max(res.train_time_s, 1e-9)
    if run_steps:
        res.step_compute_s, res.step_comm_s = run_compute / run_steps, run_comm / run_steps
    res.final_psnr = res.rows[-1]["psnr"]
    res.final_test_psnr = res.rows[-1]["test_psnr"]
    return res
