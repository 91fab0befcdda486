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
``--checkpoint-dir``); a rerun resumes from them, and success removes them. TensorBoard
scalars (``reconstruct.tensorboard``) go to ``<out>.tb/`` while training and end up in
``<out>/tensorboard/``.
"""
from __future__ import annotations

import logging
import platform
import shutil
from pathlib import Path

import torch

from stages.common.io import atomic_dir, atomic_write_json, atomic_write_text
from stages.common.params import to_dict

from .checkpoint import CheckpointStore, default_dir
from .config import DistributedParams, ReconstructParams
from .data import load_scene, working_side
from .distributed import DistContext
from .methods import all_optimizer_state
from .train import train

log = logging.getLogger("stages.reconstruct")

MODEL_FORMAT = "rayforge-model-v1"


def pick_device(setting: str) -> torch.device:
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("reconstruct.device is 'cuda' but no CUDA GPU is visible")
        return torch.device("cuda", torch.cuda.current_device())
    if setting == "auto" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    device = ctx.device
    scene = load_scene(poses_dir, max_side=working_side(device))  # the CPU profile's working resolution
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dp = params.distributed
    store = CheckpointStore(checkpoint_dir or default_dir(out_dir)) if dp.checkpoint_every > 0 else None
    metrics = None
    if ctx.is_main and dp.metrics_port:
        from .telemetry import MetricsServer

        metrics = MetricsServer(dp.metrics_port, dp.metrics_addr, ctx.world_size, ctx.restart_count, params.steps)
    tb = tb_dir = None
    if ctx.is_main and params.tensorboard:
        from .telemetry import TensorBoardLog

        tb_dir = Path(str(Path(out_dir)) + ".tb")
        tb = TensorBoardLog(tb_dir)
    try:
        result = train(params, scene, device, seed, progress=progress, ctx=ctx, checkpoints=store, metrics=metrics,
                       tensorboard=tb)
    finally:
        if metrics is not None:
            metrics.close()
        if tb is not None:
            tb.close()
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
        "skipped_steps": result.skipped_steps,
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
        **({"partitioned": result.parallel} if result.parallel else {}),  # parallel.Partitioned's figures
        "params": config,
    }
    if ctx.is_main:
        state = method.state_dict()
        model = {"format": MODEL_FORMAT, "method": params.method, "config": config, "aabb": scene.aabb,
                 "state": state}
        with atomic_dir(out_dir) as tmp:
            torch.save(model, tmp / "model.pt")
            torch.save(
                {**model, "method_version": method.VERSION, "optimizers": all_optimizer_state(method),
                 "step": params.steps},
                tmp / "checkpoint.pt",
            )
            atomic_write_json(tmp / "summary.json", summary)
            if tb_dir is not None and tb_dir.is_dir():
                shutil.copytree(tb_dir, tmp / "tensorboard")
        if plots_path:
            atomic_write_text(plots_path, result.csv_text())
        if metrics_path:
            atomic_write_json(metrics_path, {k: summary[k] for k in (
                "method", "device", "gpu_name", "world_size", "steps", "train_time_s", "samples_per_s", "rays_per_s",
                "num_params", "peak_gpu_memory_bytes", "final_train_psnr", "final_test_psnr_sampled",
                *(("partitioned",) if "partitioned" in summary else ()))})
        if store is not None:
            store.remove()  # the outs are complete: nothing left to resume
        if tb_dir is not None:
            shutil.rmtree(tb_dir, ignore_errors=True)  # its events now live in <out>/tensorboard
        log.info("wrote %s (%.1f s of training, %d parameters, %d process(es))", out_dir, result.train_time_s,
                 method.num_params, ctx.world_size)
    if ctx.active:
        import torch.distributed as dist

        dist.barrier()  # no rank reports success before rank 0 has written the outs
    return summary


__all__ = ["run", "ReconstructParams", "DistributedParams", "MODEL_FORMAT", "pick_device"]
