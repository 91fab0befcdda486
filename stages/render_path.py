"""Render a camera path of a trained model to MP4 videos: RGB, depth and opacity.

    python -m stages.render_path --model data/reconstruct --poses data/poses --out data/render \
        [--path orbit|spiral|views|camera_path.json] [--frames 120] [--fps 24] [--size 640] ...

Paths (``stages.common.camera_paths``), all in the normalized frame of ``<poses>/transforms.json``:

* ``orbit``: a circle about the cameras' up axis round the scene box's centre (a swing across the
  covered arc for a forward-facing capture), as the evaluate stage's orbit;
* ``spiral``: LLFF's forward-facing spiral about the mean camera, looking at the scene centre;
* ``views``: a smooth path through the training cameras named by ``--views`` (file names as in
  ``split.json``; default: up to 8 training views evenly spread in name order), spline positions and
  slerped orientations;
* a ``camera_path.json`` file (nerfstudio's format, e.g. from its viewer): its poses, fields of
  view, size and fps.

Outs in ``--out`` (each written to a temporary file and renamed into place when all are done;
other files there are left alone): ``rgb.mp4``, ``depth.mp4`` (expected ray distance, weights'
depth over opacity, near = bright yellow to far = dark blue through a fixed colour ramp, faded to
black where the opacity is low; the range is ``--depth-range`` or the 1st-99th percentile of the
depths of pixels with opacity > 0.5 over the whole path), ``opacity.mp4`` (accumulated alpha, white
= opaque), ``camera_path.json`` (the rendered path in nerfstudio's format, to edit and render again)
and ``render.json`` (size, frames, depth range, timings). H.264 in yuv420p, so frame sides are even.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stages.common import camera_paths as CP
from stages.common.cameras import Intrinsics, read_transforms
from stages.common.io import atomic_write_json, read_json
from stages.common.params import check

log = logging.getLogger("render_path")

PATHS = ("orbit", "spiral", "views")
OUTPUTS = ("rgb", "depth", "opacity")
MAX_KEYS = 8  # training views a default ``views`` path goes through
# depth colour ramp, near to far: bright yellow, green, teal, blue, dark blue-violet
RAMP = np.array([[0.99, 0.91, 0.15], [0.40, 0.80, 0.35], [0.13, 0.57, 0.55], [0.23, 0.32, 0.55], [0.20, 0.02, 0.33]])


@dataclass
class RenderPathParams:
    """What to render (command-line options of ``python -m stages.render_path``)."""

    path: str = "orbit"  # orbit | spiral | views | a camera_path.json file
    frames: int = 120  # frames of a generated path (a camera_path.json has its own)
    fps: float = 24.0  # of a generated path
    size: int = 0  # longest frame side in pixels; 0 = the training camera's (or the camera path's) size
    views: list[str] = field(default_factory=list)  # training views the ``views`` path goes through
    loop: bool = False  # ``views``: come back to the first view
    turns: float = 2.0  # ``spiral``: turns round the mean camera
    outputs: list[str] = field(default_factory=lambda: list(OUTPUTS))
    depth_range: list[float] = field(default_factory=list)  # [near, far]; empty = from the frames
    chunk_rays: int = 8192
    crf: int = 18  # H.264 constant rate factor: 0 lossless .. 51 worst; 18 looks lossless

    def __post_init__(self) -> None:
        check(self.path in PATHS or self.path.endswith(".json"), "path",
              f"must be one of {', '.join(PATHS)} or a camera_path.json file", self.path)
        check(2 <= self.frames <= 100_000, "frames", "must be in 2..100000", self.frames)
        check(0 < self.fps <= 240, "fps", "must be in (0, 240]", self.fps)
        check(self.size == 0 or 8 <= self.size <= 8192, "size", "must be 0 (camera size) or 8..8192", self.size)
        check(0 < self.turns <= 100, "turns", "must be in (0, 100]", self.turns)
        check(bool(self.outputs) and set(self.outputs) <= set(OUTPUTS), "outputs",
              f"must be a non-empty subset of {', '.join(OUTPUTS)}", self.outputs)
        check(not self.depth_range or (len(self.depth_range) == 2 and 0 <= self.depth_range[0] < self.depth_range[1]),
              "depth_range", "must be empty or [near, far] with 0 <= near < far", self.depth_range)
        check(self.chunk_rays >= 256, "chunk_rays", "must be >= 256", self.chunk_rays)
        check(0 <= self.crf <= 51, "crf", "must be in 0..51", self.crf)


# ---------------------------------------------------------------- the path


def even_size(intr: Intrinsics, size: int) -> Intrinsics:
    """``intr`` scaled so its longest side is ``size`` (0: as it is), both sides rounded to even numbers."""
    f = size / max(intr.width, intr.height) if size else 1.0
    w, h = max(2, 2 * round(intr.width * f / 2)), max(2, 2 * round(intr.height * f / 2))
    sx, sy = w / intr.width, h / intr.height
    return Intrinsics(w, h, intr.fx * sx, intr.fy * sy, intr.cx * sx, intr.cy * sy)


def key_views(names: list[str], files: list[str], c2w: np.ndarray, wanted: list[str]) -> np.ndarray:
    """Poses [K, 4, 4] of the views named ``wanted`` (file names), or of up to :data:`MAX_KEYS`
    training views ``names`` evenly spread in name order when ``wanted`` is empty."""
    by_name = {Path(f).name: m for f, m in zip(files, c2w)}
    if not wanted:
        ordered = sorted(names)
        step = max(1, -(-len(ordered) // MAX_KEYS))
        wanted = ordered[::step]
    missing = [v for v in wanted if v not in by_name]
    if missing:
        raise ValueError(f"views {missing} are not in transforms.json (it has e.g. {sorted(by_name)[:3]})")
    if len(wanted) < 2:
        raise ValueError(f"a path through views needs at least 2 of them, got {wanted}")
    return np.stack([by_name[v] for v in wanted])


def build_path(p: RenderPathParams, poses_dir: Path | None) -> tuple[CP.CameraPath, str]:
    """The camera path and a word for it."""
    if p.path.endswith(".json"):
        cam_path = CP.read_nerfstudio(p.path)
        cams = [even_size(c, p.size) for c in cam_path.cameras]
        return CP.CameraPath(cam_path.c2w, cams, cam_path.fps), f"camera path {p.path}"
    if poses_dir is None:
        raise ValueError(f"path {p.path!r} is made from the training cameras: give the poses folder")
    from stages.evaluate import scene_center

    intrs, files, c2w, doc = read_transforms(Path(poses_dir) / "transforms.json")
    split = read_json(Path(poses_dir) / "split.json")
    train = set(split.get("train", []))
    # the path's camera: the first training view's (a capture of several cameras renders at that one)
    intr = next((i for f, i in zip(files, intrs) if Path(f).name in train), intrs[0])
    train_c2w = np.stack([m for f, m in zip(files, c2w) if Path(f).name in train]) if train else c2w
    center = scene_center(doc, train_c2w)
    if p.path == "orbit":
        poses = CP.orbit(train_c2w, center, p.frames)
    elif p.path == "spiral":
        poses = CP.spiral(train_c2w, center, p.frames, p.turns)
    else:
        poses = CP.through(key_views(sorted(train), files, c2w, p.views), p.frames, p.loop)
    cam = even_size(intr, p.size)
    return CP.CameraPath(poses, [cam] * len(poses), p.fps), p.path


# ---------------------------------------------------------------- frames and videos


def depth_colors(depth: np.ndarray, alpha: np.ndarray, near: float, far: float) -> np.ndarray:
    """uint8 [H, W, 3]: :data:`RAMP` over ``depth`` in [near, far], times the opacity."""
    t = np.clip((depth - near) / max(far - near, 1e-9), 0.0, 1.0) * (len(RAMP) - 1)
    i = np.minimum(t.astype(np.int64), len(RAMP) - 2)
    f = (t - i)[..., None]
    rgb = RAMP[i] * (1 - f) + RAMP[i + 1] * f
    return np.round(rgb * np.clip(alpha, 0, 1)[..., None] * 255).astype(np.uint8)


def depth_range(depths: np.ndarray, alphas: np.ndarray) -> tuple[float, float]:
    """1st and 99th percentile of the depths with opacity > 0.5 (every 4th frame and pixel is plenty)."""
    d, a = depths[::4].reshape(-1)[::4].astype(np.float32), alphas[::4].reshape(-1)[::4].astype(np.float32)
    sure = d[a > 0.5]
    if sure.size < 16:
        sure = d[a > 1e-3]
    if sure.size == 0:
        return 0.0, 1.0
    lo, hi = np.percentile(sure, [1, 99])
    return float(lo), float(max(hi, lo + 1e-6))


class Video:
    """An MP4 written through imageio-ffmpeg to a temporary sibling, renamed by :meth:`commit`."""

    def __init__(self, path: Path, width: int, height: int, fps: float, crf: int):
        import imageio_ffmpeg

        self.path = path
        self.tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        self._writer = imageio_ffmpeg.write_frames(str(self.tmp), (width, height), fps=fps, codec="libx264",
                                                   quality=None, macro_block_size=2,
                                                   output_params=["-crf", str(crf), "-preset", "medium"])
        self._writer.send(None)  # start ffmpeg

    def add(self, frame: np.ndarray) -> None:
        self._writer.send(np.ascontiguousarray(frame, dtype=np.uint8))

    def close(self) -> None:
        with contextlib.suppress(StopIteration):
            self._writer.close()

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


def render_frames(model, cam_path: CP.CameraPath, p: RenderPathParams, out: Path, progress: bool = True) -> dict:
    """Render every frame of ``cam_path`` and write the videos to ``out``; returns render.json's facts."""
    from tqdm import tqdm

    from stages.evaluate import render_image

    want = set(p.outputs)
    extra = bool(want & {"depth", "opacity"})
    if extra and not model.has_outputs:
        raise ValueError(f"method {model.method!r} renders RGB only: ask for --outputs rgb")
    cam0 = cam_path.cameras[0]
    if any((c.width, c.height) != (cam0.width, cam0.height) for c in cam_path.cameras):
        raise ValueError("every frame of a camera path must have the same size")
    W, H, F = cam0.width, cam0.height, len(cam_path)
    out.mkdir(parents=True, exist_ok=True)
    videos = {k: Video(out / f"{k}.mp4", W, H, cam_path.fps, p.crf) for k in OUTPUTS if k in want and k != "depth"}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=out, prefix=".render-") as tmp:
            if "depth" in want:  # kept until the depth range of the whole path is known
                depths = np.lib.format.open_memmap(Path(tmp) / "depth.npy", "w+", np.float16, (F, H, W))
                alphas = np.lib.format.open_memmap(Path(tmp) / "alpha.npy", "w+", np.float16, (F, H, W))
            for k in tqdm(range(F), desc="render", unit="frame", disable=not progress):
                intr, c2w = cam_path.cameras[k], cam_path.c2w[k]
                if extra:
                    o = model.render_outputs(intr, c2w, chunk_rays=p.chunk_rays)
                    rgb, alpha = o["rgb"].clamp(0, 1).numpy(), o["alpha"].clamp(0, 1).numpy()
                    if "depth" in want:
                        depths[k] = np.where(alpha > 1e-3, o["depth"].numpy() / np.maximum(alpha, 1e-3), 0.0)
                        alphas[k] = alpha
                else:
                    rgb, alpha = render_image(model, intr, c2w, p.chunk_rays, f"frame {k}").numpy(), None
                if "rgb" in videos:
                    videos["rgb"].add(np.round(rgb * 255))
                if "opacity" in videos:
                    videos["opacity"].add(np.repeat(np.round(alpha * 255)[..., None], 3, axis=2))
            render_s = time.perf_counter() - t0
            near_far = None
            if "depth" in want:
                near_far = tuple(p.depth_range) if p.depth_range else depth_range(depths, alphas)
                videos["depth"] = Video(out / "depth.mp4", W, H, cam_path.fps, p.crf)
                for k in range(F):
                    videos["depth"].add(depth_colors(depths[k].astype(np.float32), alphas[k].astype(np.float32),
                                                     *near_far))
                del depths, alphas  # close the memory maps before their folder goes
        for v in videos.values():
            v.close()
        for v in videos.values():
            v.commit()
    except BaseException:
        for v in videos.values():
            v.discard()
        raise
    return {"frames": F, "width": W, "height": H, "fps": cam_path.fps,
            "outputs": {k: f"{k}.mp4" for k in OUTPUTS if k in want},
            "depth_range": None if near_far is None else [round(x, 6) for x in near_far],
            "render_s": round(render_s, 3), "frames_per_s": round(F / max(render_s, 1e-9), 3)}


def run(params: RenderPathParams, model_dir: str | Path, poses_dir: str | Path | None, out_dir: str | Path,
        progress: bool = True) -> dict:
    """Render ``params.path`` of the model in ``model_dir`` into ``out_dir``; returns render.json."""
    from stages.reconstruct.api import load_trained

    out = Path(out_dir)
    cam_path, what = build_path(params, Path(poses_dir) if poses_dir else None)
    model = load_trained(model_dir)
    cam0 = cam_path.cameras[0]
    log.info("rendering %d frames of %s at %dx%d (%s) with %s", len(cam_path), what, cam0.width, cam0.height,
             ", ".join(params.outputs), model.method)
    facts = render_frames(model, cam_path, params, out, progress)
    CP.write_nerfstudio(out / "camera_path.json", cam_path)
    summary = {"path": what, "method": model.method, "model": str(model_dir), **facts}
    atomic_write_json(out / "render.json", summary)
    log.info("wrote %s (%.1f s, %.2f frames/s)", ", ".join(str(out / f) for f in facts["outputs"].values()),
             facts["render_s"], facts["frames_per_s"])
    return summary


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of this command (shared with ``rayforge render``)."""
    d = RenderPathParams()
    ap.add_argument("--model", type=Path, default=Path("data/reconstruct"),
                    help="the reconstruct stage's out folder (default: data/reconstruct)")
    ap.add_argument("--poses", type=Path, default=Path("data/poses"),
                    help="the poses stage's out folder, for the training cameras (default: data/poses)")
    ap.add_argument("--out", type=Path, default=Path("data/render"), help="folder for the videos (default: data/render)")
    ap.add_argument("--path", default=d.path, help="orbit | spiral | views | a nerfstudio camera_path.json (default: orbit)")
    ap.add_argument("--frames", type=int, default=d.frames, help=f"frames of a generated path (default: {d.frames})")
    ap.add_argument("--fps", type=float, default=d.fps, help=f"frames per second of a generated path (default: {d.fps:g})")
    ap.add_argument("--size", type=int, default=d.size, help="longest frame side in pixels (default: the camera's)")
    ap.add_argument("--views", default="", help="--path views: comma-separated training view file names to pass "
                    f"through, in order (default: up to {MAX_KEYS} training views in name order)")
    ap.add_argument("--loop", action="store_true", help="--path views: return to the first view")
    ap.add_argument("--turns", type=float, default=d.turns, help=f"--path spiral: turns (default: {d.turns:g})")
    ap.add_argument("--outputs", default=",".join(OUTPUTS), help="comma-separated videos: rgb,depth,opacity (default: all)")
    ap.add_argument("--depth-range", type=float, nargs=2, metavar=("NEAR", "FAR"),
                    help="depth mapped to the colour ramp (default: 1st-99th percentile of the path's depths)")
    ap.add_argument("--chunk-rays", type=int, default=d.chunk_rays, help=f"rays per render pass (default: {d.chunk_rays})")
    ap.add_argument("--crf", type=int, default=d.crf, help=f"H.264 quality, 0 (lossless) .. 51 (default: {d.crf})")


def params_from_args(args: argparse.Namespace) -> RenderPathParams:
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    from stages.common.params import from_dict

    return from_dict(RenderPathParams, {
        "path": args.path, "frames": args.frames, "fps": args.fps, "size": args.size, "views": split(args.views),
        "loop": args.loop, "turns": args.turns, "outputs": split(args.outputs),
        "depth_range": list(args.depth_range or []), "chunk_rays": args.chunk_rays, "crf": args.crf}, "render")


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.render_path", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    setup("render_path")
    try:
        summary = run(params_from_args(args), args.model, args.poses, args.out)
    except ValueError as exc:
        print(f"render: error: {exc}", file=sys.stderr)
        return 1
    print(f"{summary['frames']} frames at {summary['width']}x{summary['height']} -> "
          + ", ".join(str(args.out / f) for f in summary["outputs"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
