"""Evaluate stage: render the held-out test views with the trained model and score them.

    python -m stages.evaluate --poses data/poses --model data/reconstruct \
        --out data/evaluate --metrics data/metrics/evaluate.json [--params params.yaml]

Reads the test views named in ``<poses>/split.json`` (cameras from
``<poses>/transforms.json``, images beside it), renders each one with the model of
``<model>`` (``stages.reconstruct.api.load_trained``) and writes

* ``<out>/renders/<stem>.png``: the renders, RGB 8-bit;
* ``<out>/per_view.json``: ``[{"file", "psnr", "ssim", "render_time_s"}]``;
* ``<metrics>``: the summary in the flat layout of nerfstudio's ``ns-eval`` results
  (``psnr``, ``psnr_std``, ``ssim``, ``ssim_std``, ``lpips``, ``fps``, ...) plus the
  training figures of ``<model>/summary.json`` and an ``environment`` block (library
  versions, code revision, a hash of the params that produced the numbers).

PSNR and SSIM (``stages.common.metrics``; SSIM as in the 3DGS evaluation) are computed
on the model's float render clamped to [0, 1] against the 8-bit ground truth / 255.
``fps`` is test views per second at the test resolution, timed after one untimed
warm-up render, render call to CPU tensor (so GPU work is included).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from stages.common import metrics as M
from stages.common.cameras import Intrinsics, read_transforms
from stages.common.io import atomic_dir, atomic_write_json, remove
from stages.common.params import DEFAULT_PARAMS, check, load_section, read_yaml

log = logging.getLogger("evaluate")

LPIPS_NOTE = "not computed: no LPIPS weights configured"
MODEL_FILES = ("model.pt", "summary.json")
# copied from <model>/summary.json into the metrics, in this order
SUMMARY_KEYS = ("method", "steps", "train_time_s", "peak_gpu_memory_bytes", "num_params", "device", "gpu_name",
                "gpu_count", "world_size")
PARAMS_HASH_SECTIONS = ("reconstruct", "evaluate")
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class EvaluateParams:
    """Section ``evaluate`` of params.yaml."""

    chunk_rays: int = 8192  # rays per forward pass of the renderer (memory vs. speed)

    def __post_init__(self) -> None:
        check(self.chunk_rays >= 256, "chunk_rays", "must be >= 256", self.chunk_rays)


@dataclass
class EvalView:
    name: str  # file name as in split.json, e.g. "view_000.png"
    path: Path  # the ground-truth image
    c2w: np.ndarray  # [4, 4] camera-to-world, OpenCV axes, normalized frame


# ---------------------------------------------------------------- inputs


def load_test_views(poses_dir: str | Path) -> tuple[Intrinsics, list[EvalView]]:
    """The test views of ``split.json`` with their cameras; raises ValueError when there are none."""
    poses_dir = Path(poses_dir)
    if not poses_dir.is_dir():
        raise ValueError(f"poses folder not found: {poses_dir}; run the poses stage first")
    split_path, tf_path = poses_dir / "split.json", poses_dir / "transforms.json"
    for p in (tf_path, split_path):
        if not p.is_file():
            raise ValueError(f"{p}: missing; the poses stage writes it (run `dvc repro poses`)")
    try:
        split = json.loads(split_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{split_path}: not valid JSON: {exc}") from None
    test = split.get("test") if isinstance(split, dict) else None
    if not isinstance(test, list) or not all(isinstance(n, str) for n in test):
        raise ValueError(f"{split_path}: expected a list of file names under \"test\", got {test!r}")
    if not test:
        raise ValueError(f"{split_path}: no test views (\"test\" is empty); nothing to evaluate "
                         "(poses.test_every picks every n-th image; a scene needs at least one)")
    intr, files, c2w, _ = read_transforms(tf_path)
    by_name = {Path(f).name: (f, m) for f, m in zip(files, c2w)}
    views = []
    for name in test:
        if name not in by_name:
            raise ValueError(f"{split_path}: test view {name!r} has no camera in {tf_path}")
        f, m = by_name[name]
        views.append(EvalView(name, poses_dir / f, m))
    return intr, views


def load_image(path: Path, intr: Intrinsics) -> np.ndarray:
    """A ground-truth image as uint8 [H, W, 3]; its size must be the camera's."""
    try:
        with Image.open(path) as im:
            img = np.array(im.convert("RGB"))  # writable, for torch.from_numpy
    except OSError as exc:
        raise ValueError(f"cannot read ground-truth image {path}: {exc}") from None
    if img.shape[:2] != (intr.height, intr.width):
        raise ValueError(f"{path}: ground-truth image is {img.shape[1]}x{img.shape[0]} but the camera in "
                         f"transforms.json is {intr.width}x{intr.height}")
    return img


def read_summary(model_dir: str | Path, need_weights: bool = True) -> dict:
    """``<model_dir>/summary.json``, after checking the model files are there."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model folder not found: {model_dir}; run the reconstruct stage first")
    needed = MODEL_FILES if need_weights else ("summary.json",)
    missing = [n for n in needed if not (model_dir / n).is_file()]
    if missing:
        raise ValueError(f"{model_dir}: missing model file(s) {', '.join(missing)}; "
                         "the reconstruct stage writes them (run `dvc repro reconstruct`)")
    try:
        summary = json.loads((model_dir / "summary.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{model_dir / 'summary.json'}: not valid JSON: {exc}") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{model_dir / 'summary.json'}: expected an object, got {type(summary).__name__}")
    return summary


# ---------------------------------------------------------------- environment


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO_ROOT), *args],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def code_revision() -> dict:
    """``{"commit": sha or None, "dirty": bool or None}``; dirty = tracked files differ from HEAD."""
    commit = _git("rev-parse", "--verify", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def params_sha256(params_path: str | Path | None) -> str | None:
    """sha256 of the canonical JSON (sorted keys) of params.yaml's reconstruct and evaluate sections."""
    if params_path is None or not Path(params_path).is_file():
        return None
    data = read_yaml(params_path)
    doc = {s: data.get(s) for s in PARAMS_HASH_SECTIONS}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def environment(params_path: str | Path | None) -> dict:
    rev = code_revision()
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "code_revision": rev["commit"],
        "code_dirty": rev["dirty"],
        "params_sha256": params_sha256(params_path),
        "params_sha256_of": "canonical JSON of params.yaml sections " + "+".join(PARAMS_HASH_SECTIONS),
    }


# ---------------------------------------------------------------- rendering


def render_view(model: Any, intr: Intrinsics, view: EvalView, chunk_rays: int) -> torch.Tensor:
    """The model's render of one view as float32 [H, W, 3] in [0, 1] on the CPU."""
    with torch.no_grad():
        out = model.render(intr, view.c2w, chunk_rays=chunk_rays)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (intr.height, intr.width, 3):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model rendered {shape} for {view.name}, expected ({intr.height}, {intr.width}, 3)")
    out = out.detach().to("cpu", torch.float32)
    if not torch.isfinite(out).all():
        raise ValueError(f"model rendered non-finite values for {view.name}")
    return out.clamp_(0.0, 1.0)


def _std(x: list[float]) -> float:
    # sample standard deviation, as ns-eval's torch.std; 0 for a single view
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def run(
    params: EvaluateParams,
    poses_dir: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    metrics_path: str | Path,
    model: Any = None,
    params_path: str | Path | None = DEFAULT_PARAMS,
) -> dict:
    """Render and score every test view; returns the metrics written to ``metrics_path``.

    Args:
        params: the ``evaluate`` section.
        poses_dir: the poses stage's out (``transforms.json``, ``split.json``, ``images/``).
        model_dir: the reconstruct stage's out (``model.pt``, ``summary.json``).
        out_dir: this stage's out folder (replaced atomically).
        metrics_path: the metrics JSON.
        model: an object with the ``TrainedModel`` interface (``render``, ``method``,
            ``num_params``, ``device``); loaded from ``model_dir`` when None. With a model
            given, only ``summary.json`` is needed in ``model_dir``.
        params_path: the params.yaml whose reconstruct+evaluate sections are hashed into
            the environment block (None: no hash).
    """
    poses_dir, model_dir, out_dir, metrics_path = map(Path, (poses_dir, model_dir, out_dir, metrics_path))
    intr, views = load_test_views(poses_dir)
    summary = read_summary(model_dir, need_weights=model is None)
    gts = [load_image(v.path, intr) for v in views]  # all checked before any render

    if model is None:
        from stages.reconstruct.api import load_trained

        model = load_trained(model_dir, device="auto")
    log.info("evaluating %s (%s on %s) on %d test views at %dx%d", model_dir, getattr(model, "method", "?"),
             getattr(model, "device", "?"), len(views), intr.width, intr.height)

    remove(metrics_path)  # a failed run leaves no stale metrics beside a missing out folder
    render_view(model, intr, views[0], params.chunk_rays)  # warm-up: lazy compiles, caches, allocator
    per_view = []
    with atomic_dir(out_dir) as tmp:
        (tmp / "renders").mkdir()
        for view, gt_u8 in zip(views, gts):
            t0 = time.perf_counter()
            pred = render_view(model, intr, view, params.chunk_rays)
            dt = time.perf_counter() - t0
            gt = torch.from_numpy(gt_u8).float() / 255.0
            row = {"file": view.name, "psnr": M.psnr(pred, gt), "ssim": M.ssim(pred, gt), "render_time_s": dt}
            per_view.append(row)
            img = (pred * 255.0).round().to(torch.uint8).numpy()
            Image.fromarray(img).save(tmp / "renders" / f"{Path(view.name).stem}.png")
            log.info("%s: PSNR %.2f dB, SSIM %.4f, %.3f s", view.name, row["psnr"], row["ssim"], dt)
        atomic_write_json(tmp / "per_view.json", per_view)

    psnrs = [r["psnr"] for r in per_view]
    ssims = [r["ssim"] for r in per_view]
    total_s = sum(r["render_time_s"] for r in per_view)
    metrics: dict[str, Any] = {
        "psnr": float(np.mean(psnrs)),
        "psnr_std": _std(psnrs),
        "ssim": float(np.mean(ssims)),
        "ssim_std": _std(ssims),
        "lpips": None,
        "lpips_note": LPIPS_NOTE,
        "fps": len(views) / total_s if total_s > 0 else math.inf,
        "num_test_views": len(views),
        "width": intr.width,
        "height": intr.height,
    }
    for key in SUMMARY_KEYS:
        metrics[key] = summary.get(key)
    if metrics["num_params"] is None:
        metrics["num_params"] = getattr(model, "num_params", None)
    if metrics["method"] is None:
        metrics["method"] = getattr(model, "method", None)
    metrics["eval_device"] = str(getattr(model, "device", "unknown"))
    metrics["ssim_convention"] = M.SSIM_CONVENTION
    metrics["environment"] = environment(params_path)
    atomic_write_json(metrics_path, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--poses", type=Path, required=True, help="the poses stage's out folder")
    ap.add_argument("--model", type=Path, required=True, help="the reconstruct stage's out folder")
    ap.add_argument("--out", type=Path, required=True, help="this stage's out folder")
    ap.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    ap.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    setup("evaluate")
    try:
        params = load_section(EvaluateParams, "evaluate", args.params)
        m = run(params, args.poses, args.model, args.out, args.metrics, params_path=args.params)
    except ValueError as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 1
    print(f"PSNR {m['psnr']:.2f} dB  SSIM {m['ssim']:.4f}  {m['fps']:.2f} views/s  "
          f"({m['num_test_views']} test views, {m['width']}x{m['height']}) -> {args.metrics}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
