"""Interactive web viewer of a trained model, on viser: orbit and fly a camera round the scene.

    python -m stages.viewer data/reconstruct [--poses data/poses] [--port 8080] [--host 127.0.0.1]

then open http://127.0.0.1:8080 (viser serves its own page: no network needed). Drag to orbit,
right-drag or shift-drag to pan, scroll to zoom, WASD / QE keys to fly. The training cameras are
drawn as frustums and the poses stage's sparse points (``points3D.ply``) as a point cloud, both in
the normalized frame of ``transforms.json``, which is the model's.

Rendering is progressive and never blocks the page: each browser tab has a render thread that
takes the latest camera, renders a frame small enough for ``--frame-budget`` seconds at the
throughput measured so far (the whole canvas on a GPU, a few thousand pixels on a CPU), and, once
the camera has rested ``--rest`` seconds, renders again at twice the size, and again, up to the
canvas (at most ``--max-size`` pixels on its longest side), row strips at a time, showing the
finer rows over the coarser frame as they come and dropping the work as soon as the camera moves.

Live during training: :class:`LiveViewer` shows the model the training loop is updating;
``update(method, step)`` costs a length check when no browser is connected (see its docstring).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from stages.common.cameras import Intrinsics
from stages.common.params import check

log = logging.getLogger("viewer")

# a render function: (intrinsics, OpenCV camera-to-world [4, 4]) -> [H, W, 3] float in [0, 1]
RenderFn = Callable[[Intrinsics, np.ndarray], "np.ndarray"]


@dataclass
class ViewerParams:
    """Options of the viewer (command line of ``python -m stages.viewer``)."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_size: int = 1024  # longest side of a resting frame (capped at the browser's canvas)
    min_size: int = 48  # longest side of a frame while the camera moves, at the least
    frame_budget_s: float = 0.1  # seconds a frame may take while the camera moves
    rest_s: float = 0.3  # camera still this long: refine
    jpeg_quality: int = 85
    chunk_rays: int = 8192

    def __post_init__(self) -> None:
        check(0 < self.port < 65536, "port", "must be in 1..65535", self.port)
        check(16 <= self.min_size <= self.max_size <= 8192, "max_size", "must be in min_size..8192", self.max_size)
        check(self.min_size >= 16, "min_size", "must be >= 16", self.min_size)
        check(0.005 <= self.frame_budget_s <= 10, "frame_budget_s", "must be in [0.005, 10]", self.frame_budget_s)
        check(0 <= self.rest_s <= 10, "rest_s", "must be in [0, 10]", self.rest_s)
        check(10 <= self.jpeg_quality <= 100, "jpeg_quality", "must be in 10..100", self.jpeg_quality)


@dataclass(frozen=True)
class Camera:
    """A browser's camera: OpenCV camera-to-world, vertical field of view (radians), canvas pixels."""

    c2w: np.ndarray
    fov: float
    width: int
    height: int

    def intrinsics(self, longest: int) -> Intrinsics:
        """Square-pixel pinhole camera of the canvas's aspect with its longest side ``longest``."""
        scale = longest / max(self.width, self.height)
        w, h = max(1, round(self.width * scale)), max(1, round(self.height * scale))
        f = h / 2 / math.tan(self.fov / 2)
        return Intrinsics(w, h, f, f, w / 2, h / 2)


def camera_of(handle) -> Camera:
    """A :class:`Camera` from a viser camera handle (its wxyz/position follow OpenCV axes)."""
    from viser import transforms as vtf

    c2w = np.eye(4)
    c2w[:3, :3] = vtf.SO3(np.asarray(handle.wxyz)).as_matrix()
    c2w[:3, 3] = handle.position
    return Camera(c2w, float(handle.fov), max(1, int(handle.image_width)), max(1, int(handle.image_height)))


class Gate:
    """When a render may touch the model. Standalone: always. Live: only inside the training loop's
    :meth:`window` (see :class:`LiveViewer`), so training and rendering never run at once."""

    def __init__(self, always_open: bool = True):
        self._cv = threading.Condition()
        self._always = always_open
        self._open = always_open
        self._waiting = 0
        self._active = 0

    @contextlib.contextmanager
    def hold(self):
        """Renderer side: wait for the gate, render inside the ``with`` block."""
        if self._always:
            yield
            return
        with self._cv:
            self._waiting += 1
            self._cv.notify_all()
            while not self._open:
                self._cv.wait()
            self._waiting -= 1
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def open_for_good(self) -> None:
        """Let every render through from now on (training is over: the weights no longer change)."""
        with self._cv:
            self._always = self._open = True
            self._cv.notify_all()

    def window(self, budget_s: float) -> float:
        """Training side: let waiting renders run for up to ``budget_s`` (a render that started
        finishes); returns the seconds spent, 0.0 at once when no render waits."""
        with self._cv:
            if not self._waiting:
                return 0.0
            t0 = time.perf_counter()
            self._open = True
            self._cv.notify_all()
            while (self._waiting or self._active) and time.perf_counter() - t0 < budget_s:
                self._cv.wait(max(1e-4, budget_s - (time.perf_counter() - t0)))
            self._open = False
            while self._active:
                self._cv.wait()
            return time.perf_counter() - t0


class ClientRenderer:
    """The render thread of one browser tab: coarse frames while its camera moves, finer at rest."""

    def __init__(self, viewer: "Viewer", client):
        self.viewer, self.client = viewer, client
        self._cv = threading.Condition()
        self._camera: Camera | None = None
        self._version = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"viewer-render-{client.client_id}", daemon=True)
        self._thread.start()

    def camera_moved(self, camera: Camera) -> None:
        with self._cv:
            self._camera, self._version = camera, self._version + 1
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _next(self, seen: int, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for a camera newer than ``seen``; True when one came (or stop)."""
        with self._cv:
            self._cv.wait_for(lambda: self._stop or self._version != seen, timeout)
            return self._stop or self._version != seen

    def _loop(self) -> None:
        seen = 0
        while True:
            self._next(seen, None)
            with self._cv:
                if self._stop:
                    return
                camera, seen = self._camera, self._version
            try:
                self._render_until_moved(camera, seen)
            except Exception:  # a failed render must not kill the tab's thread; say why and go on
                log.exception("viewer: render failed")

    def _render_until_moved(self, camera: Camera, version: int) -> None:
        v = self.viewer
        full = min(v.params.max_size, max(camera.width, camera.height))
        size = v.moving_size(camera, full)
        frame = self._render(camera, size, version, None)
        if frame is None:
            return
        while size < full:
            if self._next(version, v.params.rest_s):
                return  # moved again: start over, coarse
            size = min(full, size * 2)
            frame = self._render(camera, size, version, frame)
            if frame is None:
                return

    def _render(self, camera: Camera, longest: int, version: int, coarse: np.ndarray | None) -> np.ndarray | None:
        """Render ``camera`` at ``longest`` in row strips; show progress over ``coarse``; None when
        the camera moved before the frame was done."""
        v = self.viewer
        intr = camera.intrinsics(longest)
        W, H = intr.width, intr.height
        canvas = upsample(coarse, H, W) if coarse is not None else np.zeros((H, W, 3), np.uint8)
        rows = max(1, min(H, int(v.rays_per_s * v.params.frame_budget_s / W)))
        t0 = last_shown = time.perf_counter()
        for r0 in range(0, H, rows):
            if self._version != version or self._stop:
                return None
            r1 = min(H, r0 + rows)
            strip = Intrinsics(W, r1 - r0, intr.fx, intr.fy, intr.cx, intr.cy - r0)
            t1 = time.perf_counter()
            with v.gate.hold():
                if self._version != version:
                    return None
                img = v.render_fn(strip, camera.c2w)
            v.measured(W * (r1 - r0), time.perf_counter() - t1)
            canvas[r0:r1] = to_uint8(img)
            if r1 < H and coarse is not None and time.perf_counter() - last_shown > 0.5:
                self._show(canvas)  # the finer rows so far over the coarser frame
                last_shown = time.perf_counter()
        self._show(canvas)
        v.record(self.client.client_id, W, H, time.perf_counter() - t0, canvas)
        return canvas

    def _show(self, img: np.ndarray) -> None:
        self.client.scene.set_background_image(img, format="jpeg", jpeg_quality=self.viewer.params.jpeg_quality)


def to_uint8(img) -> np.ndarray:
    a = img.detach().cpu().float().numpy() if hasattr(img, "detach") else np.asarray(img, np.float32)
    return (np.clip(a, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def upsample(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """Nearest-neighbour resize of [h0, w0, 3] to [h, w, 3]."""
    ys = np.minimum((np.arange(h) * img.shape[0]) // h, img.shape[0] - 1)
    xs = np.minimum((np.arange(w) * img.shape[1]) // w, img.shape[1] - 1)
    return img[ys][:, xs]


@dataclass(frozen=True)
class Frame:
    """One finished frame, for the status line and tests."""

    client: int
    width: int
    height: int
    seconds: float
    time: float
    mean_rgb: tuple[float, float, float]


class Viewer:
    """A viser server showing renders of ``render_fn`` and, when given, the poses stage's cameras
    and sparse points.

    Args:
        render_fn: (intrinsics, OpenCV camera-to-world) -> [H, W, 3] in [0, 1] (torch or numpy).
        poses_dir: the poses stage's out folder (frustums, points, the first camera), or None.
        params: the viewer's options.
        title: what the side panel says about the model.
        gate: when renders may run (:class:`Gate`; the live viewer's closes it during training steps).
    """

    def __init__(self, render_fn: RenderFn, poses_dir: str | Path | None = None,
                 params: ViewerParams | None = None, title: str = "", gate: Gate | None = None):
        import viser

        self.params = params or ViewerParams()
        self.render_fn = render_fn
        self.gate = gate or Gate()
        self.rays_per_s = 20_000.0  # a CPU's order of magnitude until the first frame says better
        self.frames: deque[Frame] = deque(maxlen=256)
        self._lock = threading.Lock()
        self._renderers: dict[int, ClientRenderer] = {}
        self.server = viser.ViserServer(host=self.params.host, port=self.params.port, verbose=False)
        self.server.scene.set_up_direction("+z")  # the normalized frame's up (poses.align_up)
        self.status = self.server.gui.add_markdown(title or "rayforge viewer")
        self.stats = self.server.gui.add_markdown("no frame yet")
        self.max_size = self.server.gui.add_slider("Max resolution", 64, 4096, 16,
                                                    min(4096, max(64, self.params.max_size)))
        self.max_size.on_update(lambda _: self._set_max_size(int(self.max_size.value)))
        self.frustums: list = []
        self.points = None
        if poses_dir is not None:
            self._add_poses(Path(poses_dir))
            cams = self.server.gui.add_checkbox("Training cameras", True)
            cams.on_update(lambda _: self._set_visible(self.frustums, cams.value))
            if self.points is not None:
                pts = self.server.gui.add_checkbox("Sparse points", True)
                pts.on_update(lambda _: self._set_visible([self.points], pts.value))
        self.server.on_client_connect(self._connect)
        self.server.on_client_disconnect(self._disconnect)

    # ---------------------------------------------------------------- scene

    def _add_poses(self, poses_dir: Path) -> None:
        from viser import transforms as vtf

        from stages.common.cameras import read_transforms

        intrs, files, c2w, _ = read_transforms(poses_dir / "transforms.json")
        extent = float(np.ptp(c2w[:, :3, 3], axis=0).max()) or 1.0
        fovs = [2 * math.atan(i.height / (2 * i.fy)) for i in intrs]  # one camera per image
        fov = fovs[0]
        for k, (f, m, intr) in enumerate(zip(files, c2w, intrs)):
            self.frustums.append(self.server.scene.add_camera_frustum(
                f"/cameras/{k:04d}", fov=fovs[k], aspect=intr.width / intr.height, scale=0.05 * extent,
                color=(230, 120, 30), wxyz=vtf.SO3.from_matrix(m[:3, :3]).wxyz, position=m[:3, 3]))
        ply = poses_dir / "points3D.ply"
        if ply.is_file():
            pts, rgb = read_points(ply)
            if len(pts):
                self.points = self.server.scene.add_point_cloud("/points", pts, rgb, point_size=0.006 * extent)
        # open the page at the first camera, looking at the point it faces at the scene's distance
        first = c2w[0]
        self.server.initial_camera.position = first[:3, 3]
        self.server.initial_camera.look_at = first[:3, 3] + first[:3, 2] * np.linalg.norm(first[:3, 3])
        self.server.initial_camera.fov = fov

    @staticmethod
    def _set_visible(handles: list, visible: bool) -> None:
        for h in handles:
            h.visible = visible

    def _set_max_size(self, size: int) -> None:
        self.params.max_size = max(self.params.min_size, size)
        for r in list(self._renderers.values()):  # re-render every tab at the new size
            if r._camera is not None:
                r.camera_moved(r._camera)

    # ---------------------------------------------------------------- clients

    def _connect(self, client) -> None:
        renderer = ClientRenderer(self, client)
        with self._lock:
            self._renderers[client.client_id] = renderer
        client.camera.on_update(lambda handle: renderer.camera_moved(camera_of(handle)))
        renderer.camera_moved(camera_of(client.camera))

    def _disconnect(self, client) -> None:
        with self._lock:
            renderer = self._renderers.pop(client.client_id, None)
        if renderer is not None:
            renderer.stop()

    @property
    def clients(self) -> int:
        return len(self._renderers)

    # ---------------------------------------------------------------- speed and records

    def moving_size(self, camera: Camera, full: int) -> int:
        """Longest side of a frame that renders in ``frame_budget_s`` at the measured throughput."""
        pixels = self.rays_per_s * self.params.frame_budget_s
        aspect = max(camera.width, camera.height) / min(camera.width, camera.height)
        side = int(math.sqrt(pixels * aspect))
        return max(min(self.params.min_size, full), min(full, side))

    def measured(self, rays: int, seconds: float) -> None:
        rate = rays / max(seconds, 1e-6)
        self.rays_per_s = 0.7 * self.rays_per_s + 0.3 * rate

    def record(self, client: int, w: int, h: int, seconds: float, img: np.ndarray) -> None:
        mean = tuple(float(x) for x in img.reshape(-1, 3).mean(0))
        self.frames.append(Frame(client, w, h, seconds, time.time(), mean))
        self.stats.content = f"{w}x{h} in {seconds:.2f} s ({self.rays_per_s / 1e3:.0f}k rays/s)"

    @property
    def url(self) -> str:
        return f"http://{self.params.host}:{self.server.get_port()}"

    def close(self) -> None:
        with self._lock:
            renderers = list(self._renderers.values())
            self._renderers.clear()
        for r in renderers:
            r.stop()
        self.server.stop()


def read_points(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(xyz [P, 3] float32, rgb [P, 3] uint8) of a point-cloud PLY such as poses' ``points3D.ply``."""
    import trimesh

    cloud = trimesh.load(path, process=False)
    xyz = np.asarray(getattr(cloud, "vertices", np.zeros((0, 3))), np.float32)
    colors = getattr(getattr(cloud, "visual", None), "vertex_colors", None)
    if colors is None or len(colors) != len(xyz):
        colors = np.full((len(xyz), 3), 200, np.uint8)
    return xyz, np.asarray(colors, np.uint8)[:, :3]


# ---------------------------------------------------------------- a trained model, or one in training


def model_render_fn(model, chunk_rays: int) -> RenderFn:
    """Render through ``stages.reconstruct.api.TrainedModel.render`` (every method has it)."""
    def render(intr: Intrinsics, c2w: np.ndarray):
        return model.render(intr, c2w, chunk_rays=chunk_rays)
    return render


class LiveViewer:
    """The viewer of a model while it trains.

    The training loop (rank 0 only) creates one and calls :meth:`update` after each optimizer
    step; renders then run only inside that call, between two steps, so they never see
    half-updated weights. Each call lets waiting renders use at most ``render_share`` of the
    wall time on average (a budget of ``render_share / (1 - render_share)`` times the training
    time since the previous call, carried over while a strip overruns it). With no browser
    connected, ``update`` returns after a length check::

        live = LiveViewer(poses_dir, ViewerParams(port=8080)) if ctx.is_main and viewer_port else None
        for step in range(start, steps):
            ...                                  # forward, backward, optimizer step
            if live is not None:
                live.update(method, step)
        if live is not None:
            live.close()

    ``method`` is anything with ``render_image(intr, c2w_tensor)`` (``NerfMethod``; 3DGS the same).
    """

    def __init__(self, poses_dir: str | Path | None = None, params: ViewerParams | None = None,
                 render_share: float = 0.2):
        check(0 < render_share < 1, "render_share", "must be in (0, 1)", render_share)
        self._share = render_share
        self._method = None
        self._step = 0
        self._credit = 0.0
        self._last = time.perf_counter()
        p = params or ViewerParams()
        p = dataclasses.replace(p, frame_budget_s=min(p.frame_budget_s, 0.05))  # strips that slip between steps
        self.viewer = Viewer(self._render, poses_dir, p, title="training: waiting for the first step",
                             gate=Gate(always_open=False))

    def _render(self, intr: Intrinsics, c2w: np.ndarray):
        import torch

        return self._method.render_image(intr, torch.as_tensor(c2w, dtype=torch.float32)).float().cpu()

    def update(self, method, step: int) -> None:
        """Called by the training loop between steps: let waiting renders draw ``method`` now."""
        if not self.viewer._renderers:  # nobody watching: nothing to do
            self._last = time.perf_counter()
            return
        now = time.perf_counter()
        self._method, self._step = method, step
        self._credit = min(self._credit + (now - self._last) * self._share / (1 - self._share), 1.0)
        if self._credit > 0:
            self._credit -= self.viewer.gate.window(self._credit)
        if step % 50 == 0:
            self.viewer.status.content = f"training: step {step}"
        self._last = time.perf_counter()

    def close(self) -> None:
        self.viewer.gate.open_for_good()  # renders waiting for a step that will not come may finish
        self.viewer.close()


# ---------------------------------------------------------------- command line


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """This command's options (shared with ``rayforge view``)."""
    d = ViewerParams()
    ap.add_argument("model", type=Path, nargs="?", default=Path("data/reconstruct"),
                    help="the reconstruct stage's out folder, with model.pt (default: data/reconstruct)")
    ap.add_argument("--poses", type=Path, default=Path("data/poses"),
                    help="the poses stage's out folder, for the cameras and sparse points (default: data/poses; "
                         "skipped when absent)")
    ap.add_argument("--host", default=d.host, help=f"address to serve on (default: {d.host}; 0.0.0.0 for every one)")
    ap.add_argument("--port", type=int, default=d.port, help=f"port (default: {d.port})")
    ap.add_argument("--max-size", type=int, default=d.max_size, help=f"longest side of a resting frame (default: {d.max_size})")
    ap.add_argument("--frame-budget", type=float, default=d.frame_budget_s,
                    help=f"seconds a frame may take while the camera moves (default: {d.frame_budget_s:g})")
    ap.add_argument("--rest", type=float, default=d.rest_s,
                    help=f"seconds of a still camera before frames are refined (default: {d.rest_s:g})")


def open_viewer(args: argparse.Namespace) -> Viewer:
    """A :class:`Viewer` of ``args.model`` as the command line asks."""
    from stages.reconstruct.api import load_trained

    params = ViewerParams(host=args.host, port=args.port, max_size=args.max_size, frame_budget_s=args.frame_budget,
                          rest_s=args.rest)
    model = load_trained(args.model)
    poses = args.poses if (args.poses / "transforms.json").is_file() else None
    if poses is None:
        log.info("no %s/transforms.json: showing the model without cameras or points", args.poses)
    title = f"**{model.method}** model `{args.model}`, {model.num_params:,} parameters, on {model.device}"
    return Viewer(model_render_fn(model, params.chunk_rays), poses, params, title)


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.viewer", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    setup("viewer")
    try:
        viewer = open_viewer(args)
    except (ValueError, OSError) as exc:
        print(f"view: error: {exc}", file=sys.stderr)
        return 1
    print(f"viewer at {viewer.url}  (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        viewer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
