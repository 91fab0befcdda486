"""Reconstruct stage: train a scene representation from posed images.

``python -m stages.reconstruct --poses data/poses --out data/reconstruct`` trains the
method named by ``reconstruct.method`` (``nerf``: the hash-grid NeRF; ``3dgs``: 3D Gaussian
Splatting; see ``methods.py``) on the GPU when one is present, else the CPU.
With more than one process (``reconstruct.distributed``: several GPUs, several hosts,
or ``cpu_workers``) the command re-launches itself under torchrun, one worker per GPU;
see ``docs/distributed.md``.

Outs (``--out``, written by rank 0 alone): ``model.pt`` (weights + resolved config,
loadable with ``torch.load(weights_only=True)``), ``checkpoint.pt`` (model + the optimizers'
state by name + step), ``summary.json``; metrics (``--metrics``) and the training curve
(``--plots``). While training, checkpoints go to ``<out>.ckpt/`` beside the out (or
``--checkpoint-dir``); a rerun resumes from them, and success removes them. The metrics
file holds the headline (method, device, world size, steps, training time, rays/s); the
full record goes beside it (``<stem>.full.json``, ``stages.common.metrics_files``). TensorBoard
scalars (``reconstruct.tensorboard``) go to ``<out>.tb/<run name>/`` (the ``dvc exp`` name,
else start time and params hash: ``telemetry.tensorboard_run_dir``), which stays when the
run ends, so ``tensorboard --logdir <out>.tb`` compares runs; a copy goes into the out,
``<out>/tensorboard/<run name>/``.

While it runs, the stage holds ``<out>.lock`` (a second run on the same out fails at once,
naming this one's pid); the previous outs are removed when it starts (as ``dvc repro`` does),
so a failed run leaves none that look complete. Checkpoints and ``summary.json`` record a
fingerprint of the training data: another scene's checkpoint is not resumed, and the evaluate
stage refuses another scene's poses. A step with a non-finite loss or gradients is skipped
(``guards.py``).
"""
from __future__ import annotations

import contextlib
import logging
import platform
import shutil
from pathlib import Path

import torch

from stages.common.fingerprint import data_fingerprint
from stages.common.io import (
    OutLock, atomic_dir, atomic_write_json, atomic_write_text, check_outs, remove_outs, torch_save,
)
from stages.common.metrics_files import write_metrics
from stages.common.params import to_dict

from . import guards
from .checkpoint import CheckpointStore, default_dir
from .config import DistributedParams, ReconstructParams
from .data import load_scene, working_side
from .distributed import DistContext
from .methods import all_optimizer_state
from .train import train

log = logging.getLogger("stages.reconstruct")

MODEL_FORMAT = "rayforge-model-v1"
# summary.json's figures in the metrics' full record (<stem>.full.json), and its headline for `dvc metrics show`
METRICS_KEYS = ("method", "device", "gpu_name", "gpu_count", "world_size", "steps", "train_time_s", "samples_per_s",
                "rays_per_s", "num_params", "peak_gpu_memory_bytes", "final_train_psnr", "final_test_psnr_sampled",
                "global_batch_rays", "step_compute_s", "step_comm_s", "comm_fraction", "per_rank", "restarts",
                "num_gaussians", "nonfinite_steps_skipped", "partitioned")
METRICS_HEADLINE = ("method", "device", "world_size", "steps", "train_time_s", "rays_per_s")


def pick_device(setting: str) -> torch.device:
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("reconstruct.device is 'cuda' but no CUDA GPU is visible")
        return torch.device("cuda", torch.cuda.current_device())
    if setting == "auto" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stage_paths(poses_dir, out_dir, metrics_path=None, plots_path=None, checkpoint_dir=None) -> tuple[dict, dict]:
    """The stage's inputs and outs by option name, for :func:`stages.common.io.check_outs`."""
    out = Path(out_dir)
    outs = {"--out": out, "--metrics": metrics_path, "--plots": plots_path,
            "--checkpoint-dir": checkpoint_dir or default_dir(out), "<out>.tb": Path(str(out) + ".tb")}
    return {"--poses": poses_dir}, outs


@contextlib.contextmanager
def claim(poses_dir, out_dir, metrics_path=None, plots_path=None, checkpoint_dir=None):
    """Check the paths, lock the out (and a checkpoint folder elsewhere) and remove the previous outs.

    Yields the locks (``OutLock.fds`` keeps them held by a child). Under a launcher that already
    holds them (torchrun's workers), the locks are inherited and nothing is removed.
    """
    inputs, outs = stage_paths(poses_dir, out_dir, metrics_path, plots_path, checkpoint_dir)
    check_outs(inputs, outs)
    ckpt = Path(outs["--checkpoint-dir"])
    with contextlib.ExitStack() as stack:
        locks = [stack.enter_context(OutLock(out_dir))]
        if ckpt != default_dir(out_dir):
            locks.append(stack.enter_context(OutLock(ckpt)))
        if not locks[0].inherited:
            remove_outs({k: outs[k] for k in ("--out", "--metrics", "--plots")})
        yield locks


def run(
    params: ReconstructParams,
    poses_dir: str | Path,
    out_dir: str | Path,
    metrics_path: str | Path | None = None,
    plots_path: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    *,
    ctx: DistContext | None = None,
    checkpoint_dir: str | Path | None = None,
) -> dict:
    """Train on ``poses_dir`` and write the outs (rank 0); returns the summary dict.

    Args:
        ctx: this worker's place in the group (``distributed.init_from_env``); None trains
            in this process alone.
        checkpoint_dir: training checkpoints (default ``<out_dir>.ckpt``); resumed from
            when present, removed on success. ``reconstruct.distributed.checkpoint_every: 0``
            turns checkpoints off.
    """
    ctx = ctx or DistContext(device=pick_device(params.device))
    if not ctx.is_main:
        check_outs(*stage_paths(poses_dir, out_dir, metrics_path, plots_path, checkpoint_dir))
        return _run(params, poses_dir, out_dir, metrics_path, plots_path, seed, progress, ctx, checkpoint_dir)
    with claim(poses_dir, out_dir, metrics_path, plots_path, checkpoint_dir):
        return _run(params, poses_dir, out_dir, metrics_path, plots_path, seed, progress, ctx, checkpoint_dir)


def _run(params, poses_dir, out_dir, metrics_path, plots_path, seed, progress, ctx, checkpoint_dir) -> dict:
    device = ctx.device
    scene = load_scene(poses_dir, max_side=working_side(device))  # the CPU profile's working resolution
    data = {"fingerprint": data_fingerprint(poses_dir), "poses": str(poses_dir)} if ctx.is_main else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dp = params.distributed
    store = CheckpointStore(checkpoint_dir or default_dir(out_dir), data=data) if dp.checkpoint_every > 0 else None
    metrics = None
    if ctx.is_main and dp.metrics_port:
        from .telemetry import MetricsServer

        metrics = MetricsServer(dp.metrics_port, dp.metrics_addr, ctx.world_size, ctx.restart_count, params.steps)
    tb = tb_dir = None
    if ctx.is_main and params.tensorboard:
        from .telemetry import TensorBoardLog, tensorboard_run_dir

        tb_dir = tensorboard_run_dir(out_dir, to_dict(params))
        tb = TensorBoardLog(tb_dir)
    live = None
    if ctx.is_main and params.viewer_port:
        from stages.viewer import LiveViewer, ViewerParams

        live = LiveViewer(poses_dir, ViewerParams(port=params.viewer_port))
        log.info("live viewer of the training: http://127.0.0.1:%d", params.viewer_port)
    ok = False
    try:
        result = train(params, scene, device, seed, progress=progress, ctx=ctx, checkpoints=store, metrics=metrics,
                       tensorboard=tb, live=live)
        ok = True
    finally:
        for closing in (metrics, tb, live):
            if closing is not None:
                closing.close()
        if tb is not None and not ok:  # failed or interrupted: not this run's folder; a rerun writes from its checkpoint on
            shutil.rmtree(tb_dir, ignore_errors=True)
            try:
                tb_dir.parent.rmdir()  # <out>.tb itself when no other run's folder is in it
            except OSError:
                pass
    method = result.method
    config = to_dict(params)
    comm = result.step_comm_s
    summary = {
        "method": params.method,
        "device": device.type,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_count": ctx.world_size if device.type == "cuda" else 0,
        "world_size": ctx.world_size,
        "steps": params.steps,
        "train_time_s": round(result.train_time_s, 3),
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "num_params": method.num_params,
        "samples_per_s": round(result.samples_per_s),
        "rays_per_s": round(result.rays_per_s),
        "final_train_psnr": result.final_psnr,
        "final_test_psnr_sampled": result.final_test_psnr,
        **method.summary(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "seed": seed,
        "global_batch_rays": params.batch_rays * ctx.world_size,
        "lr_scale": result.lr_scale,
        "step_compute_s": None if result.step_compute_s is None else round(result.step_compute_s, 6),
        "step_comm_s": None if comm is None else round(comm, 6),
        "comm_fraction": None if comm is None else round(comm / max(comm + result.step_compute_s, 1e-12), 4),
        "per_rank": [{"rank": r, "samples_per_s": round(v[0]), "step_compute_s": round(v[2], 6),
                      "step_comm_s": round(v[3], 6)} for r, v in enumerate(result.per_rank)],
        "resumed_from_step": result.resumed_from_step,
        "restarts": ctx.restart_count,
        "data_fingerprint": None if data is None else data["fingerprint"],
        **(guards.current().summary() if guards.current() is not None else {}),
        **({"partitioned": result.parallel} if result.parallel else {}),  # parallel.Partitioned's figures
        "params": config,
    }
    if ctx.is_main:
        state = method.state_dict()
        guards.check_finite(state, "model")
        model = {"format": MODEL_FORMAT, "method": params.method, "config": config, "aabb": scene.aabb,
                 "state": state}
        with atomic_dir(out_dir) as tmp:
            torch_save(model, tmp / "model.pt")
            torch_save({**model, "method_version": method.VERSION, "optimizers": all_optimizer_state(method),
                        "step": params.steps}, tmp / "checkpoint.pt")
            atomic_write_json(tmp / "summary.json", summary)
            if tb_dir is not None and tb_dir.is_dir():
                shutil.copytree(tb_dir, tmp / "tensorboard" / tb_dir.name)
        if plots_path:
            atomic_write_text(plots_path, result.csv_text())
        if metrics_path:
            # num_gaussians: 3DGS only (method.summary())
            write_metrics(metrics_path, {k: summary.get(k) for k in METRICS_KEYS if k in summary}, METRICS_HEADLINE)
        if store is not None:
            store.remove()  # the outs are complete: nothing left to resume
        log.info("wrote %s (%.1f s of training, %d parameters, %d process(es))", out_dir, result.train_time_s,
                 method.num_params, ctx.world_size)
    if ctx.active:
        import torch.distributed as dist

        dist.barrier()  # no rank reports success before rank 0 has written the outs
    return summary


__all__ = ["run", "ReconstructParams", "DistributedParams", "MODEL_FORMAT", "pick_device"]
