"""Evaluate stage: render the held-out test views with the trained model and score them.

    python -m stages.evaluate --poses data/poses --model data/reconstruct \
        --out data/evaluate --metrics data/metrics/evaluate.json [--params params.yaml]

Reads the test views named in ``<poses>/split.json`` (each with its own camera from
``<poses>/transforms.json``, images beside it), renders each one with the model of
``<model>`` (``stages.reconstruct.api.load_trained``) and writes

* ``<out>/renders/<stem>.png``: the renders, RGB 8-bit;
* ``<out>/per_view.json``: ``[{"file", "psnr", "ssim", "render_time_s"}]``;
* ``<out>/metrics.json``: the scores in the shape nerfstudio's ``ns-eval`` writes
  (``experiment_name``, ``method_name``, ``checkpoint``, ``results`` with ``psnr``,
  ``psnr_std``, ``ssim``, ``ssim_std``, ``lpips``, ``lpips_std``, ``num_rays_per_sec``,
  ``num_rays_per_sec_std``, ``fps``, ``fps_std``; means and standard deviations over
  the test views), so tools that read ns-eval results read ours;
* ``<out>/orbit.webp`` (``.gif`` where Pillow lacks WebP): ``evaluate.orbit_frames``
  views of the model on a circle about the scene's up axis, at the cameras' mean
  height and distance from the centre of the scene box, looking at that centre, with
  the longest side ``evaluate.orbit_size`` pixels. When the cameras cover less than half
  a turn (a forward-facing capture), the orbit swings across the arc they cover instead;
* ``<metrics>``: the headline for ``dvc metrics`` / ``dvc exp show``: ``psnr``, ``ssim``,
  ``lpips`` (when computed) and ``fps``;
* ``<metrics stem>.full.json`` beside it (``stages.common.metrics_files``): everything, flat
  (``psnr``, ``psnr_std``, ``ssim``, ``ssim_std``, ``lpips``, ``fps``, ...), the training figures
  of ``<model>/summary.json``, ``model_size_bytes``, an ``orbit`` block and an ``environment``
  block (library versions, GPU and driver, code revision and whether the sources differ from
  it, a hash of the params that produced the numbers).

PSNR and SSIM (``stages.common.metrics``; SSIM as in the 3DGS evaluation) are computed
on the model's float render clamped to [0, 1] against the 8-bit ground truth / 255 (an RGBA
ground truth composited on the scene's known background colour, else white).
``fps`` is test views per second at the test resolution, timed after one untimed
warm-up render, render call to CPU tensor (so GPU work is included).

Fewer or smaller test views (``max_test_views``, ``resolution_scale``; the ground truth is
shrunk to the render's size by area averaging): both ``auto`` by default, which scores every
view at full size where the model renders on a GPU and, on a CPU, at most
:data:`CPU_TEST_VIEWS` views (evenly spread over the sorted test list) with the longest side
at most :data:`CPU_EVAL_SIDE` pixels. The expected time is logged after the warm-up render.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import math
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from stages.common import metrics as M
from stages.common.cameras import Intrinsics, read_transforms
from stages.common.entry import cli, run_stage
from stages.common.fingerprint import data_fingerprint, short
from stages.common.io import atomic_dir, atomic_write_bytes, atomic_write_json, check_outs, read_json, remove_outs
from stages.common.metrics_files import remove_metrics, write_metrics
from stages.common.plots import encode_animation
from stages.common.params import DEFAULT_PARAMS, check, load_section, read_yaml

log = logging.getLogger("evaluate")

LPIPS_NOTE = "not computed: no LPIPS weights configured"
MODEL_FILES = ("model.pt", "summary.json")
# copied from <model>/summary.json into the metrics, in this order
SUMMARY_KEYS = ("method", "steps", "train_time_s", "peak_gpu_memory_bytes", "num_params", "num_gaussians", "device",
                "gpu_name",
                "gpu_count", "world_size", "samples_per_s", "seed")
PARAMS_HASH_SECTIONS = ("seed", "reconstruct", "evaluate")
HEADLINE = ("psnr", "ssim", "lpips", "fps")  # what `dvc metrics show` tabulates; the rest is in <stem>.full.json
# distributions whose versions go into the environment block (None where not installed)
LIBRARIES = ("torch", "numpy", "pillow", "pyyaml", "cuda-python", "pycolmap", "dvc")
ORBIT_FRAME_MS = 80  # display time of one orbit frame
# the CPU profile of max_test_views / resolution_scale "auto": 80 photos at 800x600 on 2 cores
# must go from photos to report in 30 minutes (issue 18), and one 800x600 view took minutes
CPU_TEST_VIEWS = 8
CPU_EVAL_SIDE = 400
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class EvaluateParams:
    """Section ``evaluate`` of params.yaml."""

    chunk_rays: int = 8192  # rays per forward pass of the renderer (memory vs. speed)
    orbit_frames: int = 36  # frames of the orbit animation; 0 = none
    orbit_size: int = 80  # longest side of an orbit frame, pixels (the test camera's field of view)
    # LPIPS v0.1 only with weights the user supplies (stages/common/lpips.py); "" = not computed
    lpips_net: Literal["alex", "vgg"] = "alex"
    lpips_backbone: str = ""  # torchvision ImageNet state dict of lpips_net (alexnet-owt-*.pth / vgg16-*.pth)
    lpips_linear: str = ""  # LPIPS v0.1 linear layers for lpips_net (the lpips package's weights/v0.1/<net>.pth)
    # test views scored: 0 = all, N = at most N evenly spread over the sorted test list; "auto": all
    # where the model renders on a GPU, at most CPU_TEST_VIEWS on a CPU
    max_test_views: Literal["auto"] | int = "auto"
    # render and score at this fraction of each test view's size (1.0 = full); "auto": 1.0 on a GPU,
    # on a CPU the scale that brings the longest test-view side to CPU_EVAL_SIDE pixels
    resolution_scale: Literal["auto"] | float = "auto"

    def __post_init__(self) -> None:
        check(bool(self.lpips_backbone) == bool(self.lpips_linear), "lpips_backbone",
              "LPIPS needs both lpips_backbone and lpips_linear (or neither)", self.lpips_backbone)
        check(self.chunk_rays >= 256, "chunk_rays", "must be >= 256", self.chunk_rays)
        check(self.orbit_frames == 0 or 2 <= self.orbit_frames <= 720, "orbit_frames", "must be 0 (off) or 2..720",
              self.orbit_frames)
        check(8 <= self.orbit_size <= 4096, "orbit_size", "must be 8..4096", self.orbit_size)
        check(self.max_test_views == "auto" or self.max_test_views >= 0, "max_test_views",
              "must be 'auto', 0 (all) or >= 1", self.max_test_views)
        check(self.resolution_scale == "auto" or 0.01 <= self.resolution_scale <= 1.0, "resolution_scale",
              "must be 'auto' or in [0.01, 1]", self.resolution_scale)


@dataclass
class EvalView:
    name: str  # file name as in split.json, e.g. "view_000.png"
    path: Path  # the ground-truth image
    c2w: np.ndarray  # [4, 4] camera-to-world, OpenCV axes, normalized frame
    intr: Intrinsics  # the view's own camera (the ground truth's size)


# ---------------------------------------------------------------- inputs


def load_test_views(poses_dir: str | Path) -> list[EvalView]:
    """The test views of ``split.json``, each with its camera; raises ValueError when there are none."""
    poses_dir = Path(poses_dir)
    if not poses_dir.is_dir():
        raise ValueError(f"poses folder not found: {poses_dir}; run the poses stage first")
    split_path, tf_path = poses_dir / "split.json", poses_dir / "transforms.json"
    for p in (tf_path, split_path):
        if not p.is_file():
            raise ValueError(f"{p}: missing; the poses stage writes it (run `dvc repro poses`)")
    split = read_json(split_path)
    test = split.get("test") if isinstance(split, dict) else None
    if not isinstance(test, list) or not all(isinstance(n, str) for n in test):
        raise ValueError(f"{split_path}: expected a list of file names under \"test\", got {test!r}")
    if not test:
        raise ValueError(f"{split_path}: no test views (\"test\" is empty); nothing to evaluate "
                         "(poses.test_every picks every n-th image; a scene needs at least one)")
    intrs, files, c2w, _ = read_transforms(tf_path)
    by_name = {Path(f).name: (f, m, k) for f, m, k in zip(files, c2w, intrs)}
    views = []
    for name in test:
        if name not in by_name:
            raise ValueError(f"{split_path}: test view {name!r} has no camera in {tf_path}")
        f, m, k = by_name[name]
        views.append(EvalView(name, poses_dir / f, m, k))
    return views


def pick_views(views: list[EvalView], limit: int) -> list[EvalView]:
    """At most ``limit`` (0: all) of ``views``, evenly spread, first and last included."""
    if not limit or limit >= len(views):
        return views
    idx = sorted({round(i) for i in np.linspace(0, len(views) - 1, limit)})
    return [views[i] for i in idx]


def eval_profile(params: EvaluateParams, views: list[EvalView], on_gpu: bool) -> tuple[int, float, str]:
    """(max test views, resolution scale, how they were chosen) of ``params`` for a model that
    renders on a GPU (``on_gpu``) or not: ``auto`` resolves to the full set on a GPU and to the
    CPU profile (:data:`CPU_TEST_VIEWS`, :data:`CPU_EVAL_SIDE`) elsewhere."""
    longest = max(max(v.intr.width, v.intr.height) for v in views)
    auto_views, auto_scale = (0, 1.0) if on_gpu else (CPU_TEST_VIEWS, min(1.0, CPU_EVAL_SIDE / longest))
    limit = auto_views if params.max_test_views == "auto" else params.max_test_views
    scale = auto_scale if params.resolution_scale == "auto" else float(params.resolution_scale)
    auto = [k for k in ("max_test_views", "resolution_scale") if getattr(params, k) == "auto"]
    how = f"{' and '.join(auto)} auto ({'GPU' if on_gpu else 'CPU'} profile)" if auto else "as set"
    return limit, scale, how


def load_image(path: Path, intr: Intrinsics, size: Intrinsics | None = None,
               background: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> np.ndarray:
    """A ground-truth image as uint8 [H, W, 3]; its size must be the camera's ``intr``. ``size``:
    shrunk to that camera's size (area average). RGBA: composited on ``background``."""
    try:
        with Image.open(path) as im:
            rgba = im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info
            img = im.convert("RGBA" if rgba else "RGB")
            img.load()
    except OSError as exc:
        raise ValueError(f"cannot read ground-truth image {path}: {exc}") from None
    if (img.height, img.width) != (intr.height, intr.width):
        raise ValueError(f"{path}: ground-truth image is {img.width}x{img.height} but the camera in "
                         f"transforms.json is {intr.width}x{intr.height}")
    if size is not None and (size.width, size.height) != img.size:
        img = img.resize((size.width, size.height), Image.Resampling.BOX)
    if rgba:
        bg = Image.new("RGBA", img.size, tuple(round(255 * c) for c in background) + (255,))
        img = Image.alpha_composite(bg, img).convert("RGB")
    return np.array(img)  # writable, for torch.from_numpy


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
    summary = read_json(model_dir / "summary.json")
    if not isinstance(summary, dict):
        raise ValueError(f"{model_dir / 'summary.json'}: expected an object, got {type(summary).__name__}")
    return summary


def check_same_data(summary: dict, model_dir: Path, poses_dir: Path) -> None:
    """Refuse a model trained on other data than ``poses_dir`` (the fingerprints in its summary.json
    and of the poses differ): its cameras live in another frame, and the scores would mean nothing."""
    trained = summary.get("data_fingerprint")
    if not trained:
        log.warning("%s records no data fingerprint (a model from before they were kept): cannot check that "
                    "it was trained on %s", model_dir, poses_dir)
        return
    here = data_fingerprint(poses_dir)
    if here != trained:
        raise ValueError(f"the model in {model_dir} was trained on other data (fingerprint {short(trained)}) than "
                         f"the poses in {poses_dir} ({short(here)}): evaluate it with the poses it was trained on, "
                         "or retrain it on these (the fingerprint covers transforms.json, split.json, points3D.ply "
                         "and the images)")


# ---------------------------------------------------------------- environment


def _git(*args: str, strip: bool = True) -> str | None:
    try:
        res = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO_ROOT), *args],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() if strip else res.stdout


def pipeline_outputs(root: Path = REPO_ROOT) -> set[str]:
    """Paths (relative to ``root``) that ``dvc repro`` itself writes and git may track.

    ``dvc.lock`` and every out, metric and plot of ``root/dvc.yaml``'s stages (the uncached
    ones are git-tracked on purpose), and the ``.gitignore`` that DVC keeps beside a cached
    out. By the time this stage runs, DVC has rewritten them for the stages before it.
    """
    paths = {"dvc.lock"}
    try:
        doc = read_yaml(root / "dvc.yaml")
    except ValueError:
        return paths
    stages = doc.get("stages") if isinstance(doc.get("stages"), dict) else {}
    for stage in stages.values():
        for key in ("outs", "metrics", "plots"):
            entries = stage.get(key) if isinstance(stage, dict) else None
            for entry in entries if isinstance(entries, list) else []:
                path, opts = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
                if not isinstance(path, str) or "${" in path:
                    continue
                path = path.strip("/")
                paths.add(path)
                if (opts or {}).get("cache", True):
                    paths.add(f"{Path(path).parent.as_posix()}/.gitignore".removeprefix("./"))
    return paths


def changed_files() -> list[str] | None:
    """Tracked files that differ from HEAD (index or work tree), relative to :data:`REPO_ROOT`;
    None when git cannot tell."""
    status = _git("status", "--porcelain", "-z", "--untracked-files=no", strip=False)
    prefix = _git("rev-parse", "--show-prefix")
    if status is None or prefix is None:
        return None
    entries = status.split("\0")
    files, i = [], 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        if entry[0] in "RC":  # a rename or copy: the next entry is the source path
            i += 1
        files.append(entry[3:])
    return sorted(f.removeprefix(prefix) for f in files if f.startswith(prefix))


def code_revision() -> dict:
    """``{"commit", "dirty", "dirty_files", "params_modified"}`` of the code that made the numbers.

    ``dirty``: tracked source files differ from the commit, not counting what the pipeline
    writes itself (:func:`pipeline_outputs`: ``dvc.lock``, metrics, plots) nor ``params.yaml``,
    whose change (``dvc exp run -S``) ``params_modified`` reports and ``params_sha256`` pins.
    ``dirty_files``: those sources (the first 20). None where git cannot tell.
    """
    commit = _git("rev-parse", "--verify", "HEAD")
    files = changed_files() if commit else None
    if files is None:
        return {"commit": commit, "dirty": None, "dirty_files": None, "params_modified": None}
    ours = pipeline_outputs()
    sources = [f for f in files if f != str(DEFAULT_PARAMS)
               and not any(f == o or f.startswith(o + "/") for o in ours)]
    return {"commit": commit, "dirty": bool(sources), "dirty_files": sources[:20],
            "params_modified": str(DEFAULT_PARAMS) in files}


def params_sha256(params_path: str | Path | None) -> str | None:
    """sha256 of the canonical JSON (sorted keys) of params.yaml's ``seed``, ``reconstruct`` and ``evaluate``."""
    if params_path is None or not Path(params_path).is_file():
        return None
    data = read_yaml(params_path)
    doc = {s: data.get(s) for s in PARAMS_HASH_SECTIONS}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_driver() -> str | None:
    """The NVIDIA driver version of this host (``nvidia-smi``, else ``/proc``); None without a GPU."""
    if not torch.cuda.is_available():
        return None
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        words = Path("/proc/driver/nvidia/version").read_text().split()
        return next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), None)
    except OSError:
        return None


def environment(params_path: str | Path | None) -> dict:
    """Where the numbers were made: code, params, libraries and this host's GPU (the evaluating host)."""
    rev = code_revision()
    cuda = torch.cuda.is_available()
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "code_revision": rev["commit"],
        "code_dirty": rev["dirty"],
        "code_dirty_files": rev["dirty_files"],
        "params_modified": rev["params_modified"],
        "params_sha256": params_sha256(params_path),
        "params_sha256_of": "canonical JSON of params.yaml sections " + "+".join(PARAMS_HASH_SECTIONS),
        "libraries": library_versions(),
        "cuda_version": torch.version.cuda,
        "eval_gpu_name": torch.cuda.get_device_name() if cuda else None,
        "eval_gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpu_driver": gpu_driver(),
    }


# ---------------------------------------------------------------- orbit


def look_at(eye: np.ndarray, target: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Camera-to-world [4, 4], OpenCV axes (x right, y down, z forward), at ``eye`` facing ``target``."""
    z = np.asarray(target, np.float64) - np.asarray(eye, np.float64)
    z /= np.linalg.norm(z)
    x = np.cross(z, up)
    if np.linalg.norm(x) < 1e-6:  # looking straight along the up axis: any right vector will do
        x = np.cross(z, [1.0, 0.0, 0.0] if abs(z[0]) < 0.9 else [0.0, 1.0, 0.0])
    x /= np.linalg.norm(x)
    c2w = np.eye(4)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = x, np.cross(z, x), z, eye
    return c2w


def orbit_poses(c2w: np.ndarray, center: np.ndarray, frames: int) -> tuple[np.ndarray, str]:
    """Camera-to-world poses [frames, 4, 4] (OpenCV axes) circling ``center`` about the cameras' up axis.

    The up axis is the cameras' mean "up" (-y in OpenCV axes); the circle lies at the cameras'
    mean height above ``center`` and their mean horizontal distance from it, and starts at the
    first camera's bearing. When the cameras' bearings cover less than half a turn, the path
    swings to and fro across that arc instead of going round (a forward-facing capture has
    nothing behind it to show).

    Args:
        c2w: [N, 4, 4] the captured cameras (OpenCV axes).
        center: [3] the point looked at (the scene box's centre).
        frames: number of poses.

    Returns:
        The poses and ``"circle"`` or ``"swing"``.
    """
    c2w = np.asarray(c2w, np.float64)
    center = np.asarray(center, np.float64)
    up = -c2w[:, :3, 1].mean(axis=0)
    up = up / np.linalg.norm(up) if np.linalg.norm(up) > 1e-9 else np.array([0.0, 0.0, 1.0])
    offs = c2w[:, :3, 3] - center
    height = offs @ up
    horiz = offs - height[:, None] * up
    dist = np.linalg.norm(horiz, axis=1)
    radius = float(dist.mean())
    if radius < 1e-6:  # cameras straight above the centre: orbit at their distance instead
        radius = max(float(np.linalg.norm(offs, axis=1).mean()), 1e-3)
    ref = horiz[int(np.argmax(dist))] if dist.max() > 1e-9 else np.cross(up, [1.0, 0.0, 0.0])
    if np.linalg.norm(ref) < 1e-9:
        ref = np.cross(up, [0.0, 1.0, 0.0])
    e1 = ref / np.linalg.norm(ref)
    e2 = np.cross(up, e1)
    bearing = np.sort(np.arctan2(horiz @ e2, horiz @ e1))
    gaps = np.diff(np.concatenate([bearing, bearing[:1] + 2 * np.pi]))
    widest = int(np.argmax(gaps))
    covered = 2 * np.pi - float(gaps[widest])
    t = np.arange(frames) / frames
    if covered >= np.pi or len(bearing) < 2:
        angles, kind = 2 * np.pi * t, "circle"
    else:  # the covered arc runs from just after the widest gap round to just before it
        start = float(bearing[(widest + 1) % len(bearing)])
        mid = start + covered / 2
        angles, kind = mid + covered / 2 * np.sin(2 * np.pi * t), "swing"
    h = float(height.mean())
    poses = [look_at(center + h * up + radius * (np.cos(a) * e1 + np.sin(a) * e2), center, up) for a in angles]
    return np.stack(poses), kind


def scene_center(doc: dict, c2w: np.ndarray) -> np.ndarray:
    """The centre of transforms.json's ``aabb``; without one, the point nearest all the cameras' optical axes."""
    aabb = doc.get("aabb") if isinstance(doc, dict) else None
    if aabb is not None:
        box = np.asarray(aabb, np.float64)
        if box.shape == (2, 3) and np.isfinite(box).all():
            return box.mean(axis=0)
    o, d = c2w[:, :3, 3], c2w[:, :3, 2]
    P = np.eye(3)[None] - d[:, :, None] * d[:, None, :]  # projectors orthogonal to each axis
    A, b = P.sum(axis=0), (P @ o[:, :, None]).sum(axis=0)[:, 0]
    try:
        return np.linalg.solve(A, b)
    except np.linalg.LinAlgError:  # parallel axes (a forward-facing rig): in front of the mean camera
        return o.mean(axis=0) + d.mean(axis=0)


def render_orbit(model: Any, intr: Intrinsics, poses_dir: Path, params: EvaluateParams) -> tuple[bytes, str, dict]:
    """The orbit animation: (encoded bytes, file extension, facts for the metrics)."""
    _, _, c2w, doc = read_transforms(poses_dir / "transforms.json")
    center = scene_center(doc, c2w)
    poses, kind = orbit_poses(c2w, center, params.orbit_frames)
    small = intr.scaled(min(1.0, params.orbit_size / max(intr.width, intr.height)))
    log.info("orbit: %d frames at %dx%d (%s about the scene's up axis)", len(poses), small.width, small.height, kind)
    frames, t0 = [], time.perf_counter()
    every = max(1, len(poses) // 6)
    for k, pose in enumerate(poses, start=1):
        img = render_image(model, small, pose, params.chunk_rays, f"orbit frame {k}")
        frames.append((img * 255.0).round().to(torch.uint8).numpy())
        if k % every == 0 or k == len(poses):
            el = time.perf_counter() - t0
            log.info("orbit: %d/%d frames, %.1f s, about %.0f s left", k, len(poses), el, el / k * (len(poses) - k))
    seconds = time.perf_counter() - t0
    data, ext = encode_animation(frames, ORBIT_FRAME_MS)
    info = {"file": f"orbit.{ext}", "frames": len(frames), "width": small.width, "height": small.height,
            "path": kind, "frame_ms": ORBIT_FRAME_MS, "render_s": round(seconds, 3), "center": center.tolist()}
    return data, ext, info


# ---------------------------------------------------------------- rendering


def render_image(model: Any, intr: Intrinsics, c2w: np.ndarray, chunk_rays: int, what: str) -> torch.Tensor:
    """The model's render of one camera as float32 [H, W, 3] in [0, 1] on the CPU; ``what`` names it in errors."""
    with torch.no_grad():
        out = model.render(intr, c2w, chunk_rays=chunk_rays)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (intr.height, intr.width, 3):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model rendered {shape} for {what}, expected ({intr.height}, {intr.width}, 3)")
    out = out.detach().to("cpu", torch.float32)
    if not torch.isfinite(out).all():
        raise ValueError(f"model rendered non-finite values for {what}")
    return out.clamp_(0.0, 1.0)


def render_view(model: Any, intr: Intrinsics, view: EvalView, chunk_rays: int) -> torch.Tensor:
    """The model's render of one test view with camera ``intr`` (the view's own, possibly
    scaled) as float32 [H, W, 3] in [0, 1] on the CPU."""
    return render_image(model, intr, view.c2w, chunk_rays, view.name)


def known_background(poses_dir: Path) -> tuple[float, float, float]:
    """transforms.json's ``background`` colour (white or black), else white."""
    doc = read_json(poses_dir / "transforms.json")
    return (0.0, 0.0, 0.0) if isinstance(doc, dict) and doc.get("background") == "black" else (1.0, 1.0, 1.0)


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
        metrics_path: the headline metrics JSON; the full record goes beside it (``.full.json``).
        model: an object with the ``TrainedModel`` interface (``render``, ``method``,
            ``num_params``, ``device``); loaded from ``model_dir`` when None. With a model
            given, only ``summary.json`` is needed in ``model_dir``.
        params_path: the params.yaml whose reconstruct+evaluate sections are hashed into
            the environment block (None: no hash).
    """
    poses_dir, model_dir, out_dir, metrics_path = map(Path, (poses_dir, model_dir, out_dir, metrics_path))
    outs = {"--out": out_dir, "--metrics": metrics_path}
    check_outs({"--poses": poses_dir, "--model": model_dir, "--params": params_path,
                "evaluate.lpips_backbone": params.lpips_backbone or None,
                "evaluate.lpips_linear": params.lpips_linear or None}, outs)
    remove_outs(outs)  # as dvc repro does: a failed run leaves no stale renders or metrics
    remove_metrics(metrics_path)  # and the full record beside the headline file
    views = load_test_views(poses_dir)
    summary = read_summary(model_dir, need_weights=model is None)
    check_same_data(summary, model_dir, poses_dir)
    on_gpu = torch.cuda.is_available() if model is None else str(getattr(model, "device", "cpu")).startswith("cuda")
    limit, scale, how = eval_profile(params, views, on_gpu)
    in_split = len(views)
    views = pick_views(views, limit)
    cams = [v.intr if scale == 1.0 else v.intr.scaled(scale) for v in views]
    background = known_background(poses_dir)
    gts = [load_image(v.path, v.intr, c, background) for v, c in zip(views, cams)]  # all checked before any render

    lpips = None
    if params.lpips_backbone:  # loaded (and checked) before any render
        from stages.common.lpips import LPIPS

        lpips = LPIPS(params.lpips_net, params.lpips_backbone, params.lpips_linear)
    if model is None:
        from stages.reconstruct.api import load_trained

        model = load_trained(model_dir, device="auto")
    log.info("evaluating %s (%s on %s) on %d of %d test views at %s (scale %.3g; %s)", model_dir,
             getattr(model, "method", "?"), getattr(model, "device", "?"), len(views), in_split,
             ", ".join(dict.fromkeys(f"{c.width}x{c.height}" for c in cams)), scale, how)

    # warm-up (lazy compiles, caches, allocator); off the GPU at a quarter of the first view's width and
    # height (a sixteenth of its cost), which is enough to time the renders by
    warm = cams[0] if on_gpu else cams[0].scaled(min(1.0, max(0.25, 8 / min(cams[0].width, cams[0].height))))
    t0 = time.perf_counter()
    render_view(model, warm, views[0], params.chunk_rays)
    per_px = (time.perf_counter() - t0) / (warm.width * warm.height)
    log_expected_time(per_px, cams, views[0].intr, params, warm)
    per_view = []
    orbit: dict[str, Any] | None = None
    with atomic_dir(out_dir) as tmp:
        (tmp / "renders").mkdir()
        (tmp / "ground_truth").mkdir()
        for k, (view, cam, gt_u8) in enumerate(zip(views, cams, gts), start=1):
            t0 = time.perf_counter()
            pred = render_view(model, cam, view, params.chunk_rays)
            dt = time.perf_counter() - t0
            gt = torch.from_numpy(gt_u8).float() / 255.0
            row = {"file": view.name, "psnr": M.psnr(pred, gt), "ssim": M.ssim(pred, gt), "render_time_s": dt,
                   "width": cam.width, "height": cam.height}
            if lpips is not None:
                pair = [t.permute(2, 0, 1)[None].cpu() for t in (pred, gt)]
                row["lpips"] = float(lpips(*pair)[0])
            per_view.append(row)
            img = (pred * 255.0).round().to(torch.uint8).numpy()
            Image.fromarray(img).save(tmp / "renders" / f"{Path(view.name).stem}.png")
            Image.fromarray(gt_u8).save(tmp / "ground_truth" / f"{Path(view.name).stem}.png")
            log.info("%s (%d/%d, %dx%d): PSNR %.2f dB, SSIM %.4f, %.3f s", view.name, k, len(views), cam.width,
                     cam.height, row["psnr"], row["ssim"], dt)
        atomic_write_json(tmp / "per_view.json", per_view)
        if params.orbit_frames:
            data, ext, orbit = render_orbit(model, views[0].intr, poses_dir, params)
            atomic_write_bytes(tmp / orbit["file"], data)
        env = environment(params_path)
        metrics = summarize(per_view, summary, model, model_dir, env, orbit,
                            None if lpips is None else f"v0.1 {params.lpips_net}")
        metrics.update({"num_test_views_in_split": in_split, "resolution_scale": scale, "eval_profile": how})
        atomic_write_json(tmp / "metrics.json", ns_eval_results(per_view, metrics, model_dir))
    write_metrics(metrics_path, metrics, HEADLINE)
    return metrics


def log_expected_time(per_px: float, cams: list[Intrinsics], orbit_cam: Intrinsics, params: EvaluateParams,
                      warm: Intrinsics) -> None:
    """The expected rendering time of the test views ``cams`` and the orbit (of ``orbit_cam``
    shrunk to ``orbit_size``) from the warm-up's seconds per pixel."""
    views_px = sum(c.width * c.height for c in cams)
    orbit_px = 0
    if params.orbit_frames:
        small = orbit_cam.scaled(min(1.0, params.orbit_size / max(orbit_cam.width, orbit_cam.height)))
        orbit_px = params.orbit_frames * small.width * small.height
    log.info("expected: about %.0f s for %d test views and %d orbit frames (the warm-up took %.3g ms per "
             "1000 pixels at %dx%d)", per_px * (views_px + orbit_px), len(cams), params.orbit_frames,
             1e6 * per_px, warm.width, warm.height)


def summarize(per_view: list[dict], summary: dict, model: Any, model_dir: Path, env: dict,
              orbit: dict | None, lpips_net: str | None = None) -> dict[str, Any]:
    """The flat metrics of ``<metrics>`` (see the module docstring)."""
    psnrs = [r["psnr"] for r in per_view]
    lp = [r["lpips"] for r in per_view if "lpips" in r]
    ssims = [r["ssim"] for r in per_view]
    total_s = sum(r["render_time_s"] for r in per_view)
    metrics: dict[str, Any] = {
        "psnr": float(np.mean(psnrs)),
        "psnr_std": _std(psnrs),
        "ssim": float(np.mean(ssims)),
        "ssim_std": _std(ssims),
        "lpips": float(np.mean(lp)) if lp else None,
        "lpips_std": _std(lp) if lp else None,
        "lpips_note": f"LPIPS {lpips_net} (user-supplied weights)" if lp else LPIPS_NOTE,
        "fps": len(per_view) / total_s if total_s > 0 else math.inf,
        "num_test_views": len(per_view),
        "width": per_view[0]["width"],  # the first view's; test_view_sizes lists them all
        "height": per_view[0]["height"],
        "test_view_sizes": list(dict.fromkeys(f"{r['width']}x{r['height']}" for r in per_view)),
    }
    for key in SUMMARY_KEYS:
        metrics[key] = summary.get(key)
    if metrics["num_params"] is None:
        metrics["num_params"] = getattr(model, "num_params", None)
    if metrics["method"] is None:
        metrics["method"] = getattr(model, "method", None)
    metrics["method_settings"] = method_settings(summary.get("params"))
    weights = model_dir / "model.pt"
    metrics["model_size_bytes"] = weights.stat().st_size if weights.is_file() else None
    metrics["eval_device"] = str(getattr(model, "device", "unknown"))
    metrics["ssim_convention"] = M.SSIM_CONVENTION
    metrics["orbit"] = orbit
    metrics["environment"] = env
    return metrics


# the hyperparameters the report names beside the method (reconstruct section keys, dotted)
METHOD_SETTINGS = {
    "nerf": ("steps", "batch_rays", "nerf.levels", "nerf.log2_hashmap_size", "nerf.max_resolution",
             "nerf.samples_per_ray", "nerf.lr", "nerf.occ_warmup_steps"),
    "3dgs": ("steps", "gs.batch_views", "gs.sh_degree", "gs.ssim_lambda", "gs.means_lr", "gs.densify.refine_start",
             "gs.densify.refine_stop", "gs.densify.refine_every", "gs.densify.grow_grad2d",
             "gs.densify.reset_every", "gs.densify.max_gaussians", "gs.random_background"),
}


def method_settings(config: Any) -> dict | None:
    """The method's main hyperparameters from summary.json's resolved params (None without them)."""
    if not isinstance(config, dict):
        return None
    out = {"method": config.get("method")}
    for key in METHOD_SETTINGS.get(config.get("method"), ()):
        v: Any = config
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        out[key] = v
    return out


def ns_eval_results(per_view: list[dict], metrics: dict, model_dir: Path) -> dict:
    """``metrics.json`` as nerfstudio's ``ns-eval`` writes it: means and sample standard deviations
    over the test views (fps and rays/s per view, from each view's render time)."""
    times = [r["render_time_s"] for r in per_view]
    fps = [1.0 / t if t > 0 else math.inf for t in times]
    rays = [r["width"] * r["height"] * f for r, f in zip(per_view, fps)]
    sha = (metrics.get("environment") or {}).get("params_sha256")
    return {
        "experiment_name": f"rayforge-{sha[:12]}" if sha else "rayforge",
        "method_name": metrics.get("method"),
        "checkpoint": str(model_dir / "model.pt"),
        "results": {
            "psnr": metrics["psnr"], "psnr_std": metrics["psnr_std"],
            "ssim": metrics["ssim"], "ssim_std": metrics["ssim_std"],
            "lpips": metrics.get("lpips"), "lpips_std": metrics.get("lpips_std"),
            "num_rays_per_sec": float(np.mean(rays)), "num_rays_per_sec_std": _std(rays),
            "fps": float(np.mean(fps)), "fps_std": _std(fps),
        },
    }


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
    seen: dict = {}

    def body() -> int:
        params = seen["params"] = load_section(EvaluateParams, "evaluate", args.params)
        m = run(params, args.poses, args.model, args.out, args.metrics, params_path=args.params)
        orbit = f", orbit {args.out / m['orbit']['file']}" if m.get("orbit") else ""
        print(f"PSNR {m['psnr']:.2f} dB  SSIM {m['ssim']:.4f}  {m['fps']:.2f} views/s  "
              f"({m['num_test_views']} test views, {m['width']}x{m['height']}) -> {args.metrics}{orbit}")
        return 0

    return run_stage("evaluate", body, oom_advice=lambda: "lower evaluate.chunk_rays" + (
        f" (now {seen['params'].chunk_rays})" if "params" in seen else ""))


if __name__ == "__main__":
    cli(main)
