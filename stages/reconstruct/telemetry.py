"""What a training run reports while it runs: step time split into compute and
communication, per-rank throughput, and (rank 0) a Prometheus endpoint.

The endpoint binds to 127.0.0.1 unless ``reconstruct.distributed.metrics_addr`` says
otherwise; ``metrics_port: 0`` turns it off. Metrics (all gauges):

* ``rayforge_reconstruct_step``, ``_steps_total``, ``_world_size``, ``_restarts``
* ``rayforge_reconstruct_loss``, ``_train_psnr``, ``_test_psnr``
* ``rayforge_reconstruct_samples_per_second{rank}``, ``_rays_per_second{rank}``
* ``rayforge_reconstruct_step_compute_seconds{rank}``, ``_step_comm_seconds{rank}`` (mean per step)
* ``rayforge_reconstruct_gpu_memory_peak_bytes{rank}``

:class:`TensorBoardLog` writes the same numbers as TensorBoard scalars, one folder per run
(:func:`tensorboard_run_dir`) under one root, so ``tensorboard --logdir <root>`` lays the runs
of several experiments side by side.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from datetime import datetime
from pathlib import Path

import torch

log = logging.getLogger("stages.reconstruct.telemetry")


class ExpectedTime:
    """Logs, once, how long the run is expected to take: after the first ``probe`` steps of this
    session (one occupancy-grid refresh period of the NeRF), their mean wall time x the steps
    left. The first steps are the slowest (lazy set-up, nothing pruned yet), so it errs long."""

    def __init__(self, start: int, steps: int, device: torch.device, enabled: bool = True, probe: int = 16):
        self.start, self.steps, self.device = start, steps, device
        self.probe = probe if enabled and steps - start > 2 * probe else 0
        self.t0 = time.perf_counter()

    def after(self, done: int) -> None:
        if not self.probe or done != self.start + self.probe:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the one sync: the probe's steps really finished
        per_step = (time.perf_counter() - self.t0) / self.probe
        left = per_step * (self.steps - done)
        log.info("expected: about %.0f s (%.1f min) more for the %d steps left (%.3f s per step over steps "
                 "%d..%d)", left, left / 60, self.steps - done, per_step, self.start + 1, done)


class StepTimer:
    """Accumulates each step's wall time, split into communication (between
    :meth:`comm_begin` and :meth:`comm_end`) and the rest (compute).

    On a GPU it records CUDA events and reads them only in :meth:`flush`, so timing
    adds no synchronisation between flushes.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple] = []  # cuda: (start, [(c0, c1), ...], end) per step
        self._t0 = 0.0
        self._comm = 0.0
        self._c0 = 0.0
        self._regions: list = []
        self.compute_s = 0.0
        self.comm_s = 0.0
        self.steps = 0

    def _event(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def begin_step(self) -> None:
        if self.cuda:
            self._start, self._regions = self._event(), []
        else:
            self._t0, self._comm = time.perf_counter(), 0.0

    def comm_begin(self) -> None:
        if self.cuda:
            self._regions.append([self._event(), None])
        else:
            self._c0 = time.perf_counter()

    def comm_end(self) -> None:
        if self.cuda:
            self._regions[-1][1] = self._event()
        else:
            self._comm += time.perf_counter() - self._c0

    def end_step(self) -> None:
        if self.cuda:
            self._events.append((self._start, self._regions, self._event()))
        else:
            total = time.perf_counter() - self._t0
            self.comm_s += self._comm
            self.compute_s += total - self._comm
        self.steps += 1

    def flush(self) -> tuple[float, float, int]:
        """(compute seconds, comm seconds, steps) since the last flush."""
        if self.cuda and self._events:
            self._events[-1][2].synchronize()
            for start, regions, end in self._events:
                total = start.elapsed_time(end) / 1e3
                comm = sum(a.elapsed_time(b) / 1e3 for a, b in regions)
                self.comm_s += comm
                self.compute_s += total - comm
            self._events = []
        out = (self.compute_s, self.comm_s, self.steps)
        self.compute_s = self.comm_s = 0.0
        self.steps = 0
        return out


class MetricsServer:
    """Prometheus gauges served over HTTP by rank 0 (prometheus-client)."""

    def __init__(self, port: int, addr: str = "127.0.0.1", world_size: int = 1, restarts: int = 0,
                 steps_total: int = 0):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        reg = self.registry = CollectorRegistry()
        p = "rayforge_reconstruct_"
        self.step = Gauge(p + "step", "optimizer steps done", registry=reg)
        Gauge(p + "steps_total", "optimizer steps the run will take", registry=reg).set(steps_total)
        Gauge(p + "world_size", "training processes", registry=reg).set(world_size)
        Gauge(p + "restarts", "torchrun restarts of the worker group so far", registry=reg).set(restarts)
        self.loss = Gauge(p + "loss", "training MSE, averaged over ranks", registry=reg)
        self.psnr = Gauge(p + "train_psnr", "training PSNR (dB)", registry=reg)
        self.test_psnr = Gauge(p + "test_psnr", "held-out PSNR on sampled rays (dB)", registry=reg)
        self.samples = Gauge(p + "samples_per_second", "network samples per second", ["rank"], registry=reg)
        self.rays = Gauge(p + "rays_per_second", "training rays per second", ["rank"], registry=reg)
        self.compute = Gauge(p + "step_compute_seconds", "mean compute time per step", ["rank"], registry=reg)
        self.comm = Gauge(p + "step_comm_seconds", "mean communication time per step", ["rank"], registry=reg)
        self.mem = Gauge(p + "gpu_memory_peak_bytes", "peak GPU memory allocated by torch", ["rank"], registry=reg)
        try:
            self.server, self._thread = start_http_server(port, addr=addr, registry=reg)
        except OSError as exc:
            raise ValueError(f"reconstruct.distributed.metrics_port: cannot serve metrics on {addr}:{port} "
                             f"({exc}); pick a free port or 0 to turn it off") from None
        log.info("Prometheus metrics on http://%s:%d/metrics", addr, port)

    def update(self, step: int, loss: float, psnr: float, test_psnr: float | None,
               per_rank: list[list[float]]) -> None:
        """``per_rank``: [samples/s, rays/s, compute s/step, comm s/step, peak GPU GB] for each rank."""
        self.step.set(step)
        self.loss.set(loss)
        self.psnr.set(psnr)
        if test_psnr is not None:
            self.test_psnr.set(test_psnr)
        for r, (sps, rps, comp, comm, *rest) in enumerate(per_rank):
            if rest and rest[0] > 0:
                self.mem.labels(rank=str(r)).set(rest[0] * 1e9)
            self.samples.labels(rank=str(r)).set(sps)
            self.rays.labels(rank=str(r)).set(rps)
            self.compute.labels(rank=str(r)).set(comp)
            self.comm.labels(rank=str(r)).set(comm)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_name(config: dict, now: datetime | None = None) -> str:
    """A TensorBoard run's name: the experiment's (``dvc exp run`` sets ``DVC_EXP_NAME``), else
    the local start time and the first 8 hex digits of the sha256 of ``config`` (the resolved
    reconstruct params), e.g. ``20261201-093012-3fa2c1d0``."""
    name = os.environ.get("DVC_EXP_NAME", "").strip().replace("/", "_")
    if name:
        return name
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}-{digest}"


def tensorboard_run_dir(out_dir: str | Path, config: dict) -> Path:
    """``<out>.tb/<run name>``: a new folder for this run's event files (``-2``, ``-3``... when the
    name was taken), kept after training. Under ``dvc exp run --temp`` / ``--queue`` (``DVC_ROOT``
    names the repository the experiment came from) the root is that repository's, not the
    temporary copy's, so queued experiments land beside the others."""
    out = Path(out_dir)
    root_repo = os.environ.get("DVC_ROOT")
    if root_repo and not out.is_absolute() and Path(root_repo).resolve() != Path.cwd().resolve():
        out = Path(root_repo) / out
    root = Path(str(out) + ".tb")
    name = run_name(config)
    folder, k = root / name, 1
    while folder.exists():
        k += 1
        folder = root / f"{name}-{k}"
    return folder


class TensorBoardLog:
    """Rank 0's training scalars as TensorBoard event files (``tensorboard --logdir <folder>``).

    Tags: ``train/loss``, ``train/psnr``, ``train/lr``, ``test/psnr`` (sampled held-out rays),
    ``throughput/samples_per_s`` and ``throughput/rays_per_s`` (all ranks together),
    ``rank<r>/samples_per_s``, ``rank<r>/step_compute_ms``, ``rank<r>/step_comm_ms`` and, on a
    GPU, ``rank<r>/gpu_mem_peak_gb``. When the ``tensorboard`` package is missing the log is
    off with a warning (the training itself does not need it).
    """

    def __init__(self, folder):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard not installed (e.g. a bare GPU host)
            log.warning("TensorBoard scalars are off: %s (pip install tensorboard)", exc)
            return
        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder), flush_secs=10)
        log.info("TensorBoard scalars in %s (tensorboard --logdir %s)", folder, folder)

    def update(self, row: dict, per_rank: list[list[float]]) -> None:
        """``row``: a train.csv row; ``per_rank``: [samples/s, rays/s, compute s, comm s, peak GB] per rank."""
        if self.writer is None:
            return
        w, step = self.writer, int(row["step"])
        w.add_scalar("train/loss", row["loss"], step)
        w.add_scalar("train/psnr", row["psnr"], step)
        w.add_scalar("train/lr", row["lr"], step)
        if row.get("test_psnr") is not None:
            w.add_scalar("test/psnr", row["test_psnr"], step)
        if per_rank:
            w.add_scalar("throughput/samples_per_s", sum(v[0] for v in per_rank), step)
            w.add_scalar("throughput/rays_per_s", sum(v[1] for v in per_rank), step)
        for r, v in enumerate(per_rank):
            w.add_scalar(f"rank{r}/samples_per_s", v[0], step)
            w.add_scalar(f"rank{r}/step_compute_ms", 1e3 * v[2], step)
            w.add_scalar(f"rank{r}/step_comm_ms", 1e3 * v[3], step)
            if len(v) > 4 and v[4] > 0:
                w.add_scalar(f"rank{r}/gpu_mem_peak_gb", v[4], step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
