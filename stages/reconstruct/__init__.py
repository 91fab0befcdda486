"""Reconstruct stage: train a scene representation from posed images.

``python -m stages.reconstruct --poses data/poses --out data/reconstruct`` trains the
method named by ``reconstruct.method`` (the hash-grid NeRF today; 3DGS has a place
beside it in ``train.build_method``) on the GPU when one is present, else the CPU.

Outs (``--out``): ``model.pt`` (weights + resolved config, loadable with
``torch.load(weights_only=True)``), ``checkpoint.pt`` (model + optimizer state + step),
``summary.json``; metrics (``--metrics``) and the training curve (``--plots``).
"""
from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

import torch

from stages.common.io import atomic_dir, atomic_torch_save, atomic_write_json, atomic_write_text
from stages.common.params import to_dict

from .config import ReconstructParams
from .data import load_scene
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
) -> dict:
    """Train on ``poses_dir`` and write the outs; returns the summary dict."""
    device = pick_device(params.device)
    scene = load_scene(poses_dir)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = train(params, scene, device, seed, progress=progress)
    method = result.method
    config = to_dict(params)
    summary = {
        "method": params.method,
        "device": device.type,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_count": 1 if device.type == "cuda" else 0,
        "world_size": 1,
        "steps": params.steps,
        "train_time_s": round(result.train_time_s, 3),
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "num_params": method.num_params,
        "samples_per_s": round(result.samples_per_s),
        "rays_per_s": round(result.rays_per_s),
        "final_train_psnr": result.final_psnr,
        "final_test_psnr_sampled": result.final_test_psnr,
        "kernels": method.use_kernels,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "seed": seed,
        "params": config,
    }
    state = method.state_dict()
    model = {"format": MODEL_FORMAT, "method": params.method, "config": config, "aabb": scene.aabb, "state": state}
    with atomic_dir(out_dir) as tmp:
        torch.save(model, tmp / "model.pt")
        torch.save(
            {**model, "optimizer": method.optimizer.state_dict(), "step": params.steps},
            tmp / "checkpoint.pt",
        )
        atomic_write_json(tmp / "summary.json", summary)
    if plots_path:
        atomic_write_text(plots_path, result.csv_text())
    if metrics_path:
        atomic_write_json(metrics_path, {k: summary[k] for k in (
            "method", "device", "gpu_name", "steps", "train_time_s", "samples_per_s", "rays_per_s",
            "num_params", "peak_gpu_memory_bytes", "final_train_psnr", "final_test_psnr_sampled")})
    log.info("wrote %s (%.1f s of training, %d parameters)", out_dir, result.train_time_s, method.num_params)
    return summary


__all__ = ["run", "ReconstructParams", "MODEL_FORMAT", "pick_device", "atomic_torch_save"]
