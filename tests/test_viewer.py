"""The web viewer (stages/viewer.py) in headless Chromium, offline, on a tiny trained NeRF.

Chromium opens the page viser serves (its own client build: every request must go to the viewer
or be a data:/blob: URL), the first frame is rendered and shown (the canvas takes the frame's
colour), a mouse drag on the canvas orbits the camera (viser's client sends the new camera), and
a new frame of the new camera arrives, coarse first and refined to full size once the camera
rests. The tiny NeRF renders a near-uniform grey, so a second viewer of a scene coloured by view
direction checks that the page shows the frame of each camera it sends; a third, the live viewer,
renders only inside the training loop's ``update`` calls. Screenshots go to tests/artifacts/. The live viewer's gate is tested with threads: renders
run only inside the training loop's ``update`` call, and ``update`` is a no-op with no browser.
"""
from __future__ import annotations

import argparse
import base64
import io
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import requires_gpu
from stages import viewer as V
from test_report_browser import ARTIFACTS, Browser, chromium  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration  # starts a server and a browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, cond, timeout: float = 60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def screenshot(browser: Browser, session: str) -> np.ndarray:
    shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")).astype(np.float64)


def settled(browser: Browser, session: str, timeout: float = 30.0) -> np.ndarray:
    """A screenshot once the page has stopped changing (viser fades its canvas in from white)."""
    last = screenshot(browser, session)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.4)
        shot = screenshot(browser, session)
        if np.abs(shot - last).mean() < 0.2:
            return shot
        last = shot
    raise AssertionError(f"the page kept changing for {timeout:.0f} s")


def drag(browser: Browser, session: str, x0: int, y0: int, dx: int, steps: int = 8) -> None:
    """A left-button drag on the page, as a person's mouse makes it."""
    def mouse(kind: str, x: int, buttons: int) -> None:
        browser.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y0, "button": "left",
                                                  "buttons": buttons, "clickCount": 1}, session=session)
    mouse("mouseMoved", x0, 0)
    mouse("mousePressed", x0, 1)
    for k in range(1, steps + 1):
        mouse("mouseMoved", x0 + dx * k // steps, 1)
        time.sleep(0.03)
    mouse("mouseReleased", x0 + dx, 0)


def full_frames(viewer: V.Viewer, since: int = 0) -> list[V.Frame]:
    return [f for f in list(viewer.frames)[since:] if max(f.width, f.height) == viewer.params.max_size]


def open_tab(browser: Browser) -> str:
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.send("Network.enable", session=session)
    browser.send("Page.enable", session=session)
    return session


def navigate(browser: Browser, session: str, url: str) -> None:
    browser.send("Page.navigate", {"url": url}, session=session)
    browser.wait_event("Page.loadEventFired", session)


def the_camera(viewer: V.Viewer) -> V.Camera:
    return next(iter(viewer._renderers.values()))._camera


def canvas_centre(shot: np.ndarray) -> np.ndarray:
    """Mean colour of a patch left of the side panel and clear of viser's notifications."""
    h, w = shot.shape[:2]
    return shot[h // 3: 2 * h // 3, w // 4: w // 2].reshape(-1, 3).mean(0)


def sky(intr, c2w: np.ndarray) -> np.ndarray:
    """An environment of colours by world direction, 0.5 + 0.5 * d: a scene whose look changes with
    every turn of the camera (the tiny NeRF's renders are a near-uniform grey)."""
    v, u = np.mgrid[0:intr.height, 0:intr.width] + 0.5
    d = np.stack([(u - intr.cx) / intr.fx, (v - intr.cy) / intr.fy, np.ones_like(u)], -1) @ c2w[:3, :3].T
    return 0.5 + 0.5 * d / np.linalg.norm(d, axis=-1, keepdims=True)


def sky_centre(viewer: V.Viewer) -> np.ndarray:
    """What canvas_centre should show for the viewer's current camera, in 0..255."""
    cam = the_camera(viewer)
    img = sky(cam.intrinsics(max(cam.width, cam.height) // 4), cam.c2w)
    h, w = img.shape[:2]
    return img[h // 3: 2 * h // 3, w // 4: w // 2].reshape(-1, 3).mean(0) * 255


# JPEG (quality 85) and the browser's scaling of a 96-pixel frame to the canvas: means within 12 levels
SHOWN = 12.0


def showing(browser: Browser, session: str, want, timeout: float = 30.0) -> tuple[np.ndarray, np.ndarray]:
    """A settled screenshot whose canvas centre is within SHOWN of ``want()`` (asked once the page has
    settled, as the camera may still be moving before), and that colour. On a loaded machine the page can
    settle on viser's white canvas before the frame has reached it, so it is asked again until then."""
    t0 = time.monotonic()
    while True:
        shot = settled(browser, session)
        colour = want()
        if np.abs(canvas_centre(shot) - colour).max() < SHOWN or time.monotonic() - t0 > timeout:
            break
        time.sleep(0.5)
    assert np.abs(canvas_centre(shot) - colour).max() < SHOWN, (canvas_centre(shot), colour)
    return shot, colour


def test_viewer_page_shows_frames_and_follows_a_drag(tiny_model, chromium, tmp_path: Path) -> None:
    poses, model_dir = tiny_model
    args = argparse.Namespace(model=model_dir, poses=poses, host="127.0.0.1", port=free_port(), max_size=96,
                              frame_budget=0.02, rest=0.2)
    viewer = V.open_viewer(args)
    browser = Browser(chromium, tmp_path / "profile")
    try:
        # the trained model: the page loads, its first frame is shown, a drag orbits the camera
        assert len(viewer.frustums) == 8 and viewer.points is not None  # every camera, the sparse points
        session = open_tab(browser)
        navigate(browser, session, viewer.url)
        first = wait_for("a full-size first frame", lambda: full_frames(viewer))[0]
        Image.fromarray(settled(browser, session).astype(np.uint8)).save(tmp_path / "viewer_scene.png")
        viewer._set_visible(viewer.frustums + [viewer.points], False)  # the canvas shows the frame alone
        before, _ = showing(browser, session, lambda: np.array(first.mean_rgb))  # not viser's white canvas
        h, w = before.shape[:2]
        cam0, n0 = the_camera(viewer), len(viewer.frames)
        drag(browser, session, x0=w // 3, y0=h // 2, dx=w // 5)
        full = viewer.params.max_size

        def coarse_then_full():  # a frame below full size while the camera moved, a full one after it
            sizes = [max(f.width, f.height) for f in list(viewer.frames)[n0:]]
            coarse = [i for i, s in enumerate(sizes) if s < full]
            return sizes if coarse and full in sizes[coarse[-1] + 1:] else None

        # The coarse sizes follow the measured render rate (moving_size), so on a loaded machine
        # they can shrink from one frame to the next, and a frame or two of the view at rest
        # may still arrive after the drag began: only "coarse while moving, full at rest" is asserted.
        try:
            wait_for("coarse frames while the camera moves, then a full-size one", coarse_then_full)
        except AssertionError as exc:  # what arrived instead (a rare failure on CI's 2 cores, 2026-12-07)
            turned = not np.allclose(cam0.c2w, the_camera(viewer).c2w)
            sizes = [max(f.width, f.height) for f in list(viewer.frames)[n0:]]
            raise AssertionError(f"{exc}: frame sizes since the drag {sizes[-40:]} (full {full}, "
                                 f"{len(sizes)} frames), camera {'moved' if turned else 'did not move'}") from None
        rel = cam0.c2w[:3, :3].T @ the_camera(viewer).c2w[:3, :3]
        assert np.degrees(np.arccos(np.clip((np.trace(rel) - 1) / 2, -1, 1))) > 5  # viser's orbit turned it
        requests = [e["params"]["request"]["url"] for e in browser.events
                    if e.get("method") == "Network.requestWillBeSent"]
        assert requests and all(u.startswith((viewer.url, "data:", "blob:")) for u in requests), \
            [u[:80] for u in requests]  # offline: the viewer's own page, scripts and websocket only
        assert not [e for e in browser.events if e.get("method") == "Network.loadingFailed"]
        viewer.close()

        # a scene that looks different from every side: the page shows each camera's frame
        viewer = V.Viewer(sky, None, V.ViewerParams(port=free_port(), max_size=96, frame_budget_s=0.02, rest_s=0.2))
        navigate(browser, session, viewer.url)  # the same tab: a background tab draws nothing
        wait_for("a full-size sky frame", lambda: full_frames(viewer))
        _, want_before = showing(browser, session, lambda: sky_centre(viewer))
        n0 = len(viewer.frames)
        drag(browser, session, x0=w // 3, y0=h // 2, dx=w // 4)
        wait_for("a full-size sky frame after the drag", lambda: full_frames(viewer, n0))
        after, want_after = showing(browser, session, lambda: sky_centre(viewer))
        assert np.abs(want_after - want_before).max() > 3 * SHOWN  # the drag turned the view a good way
        Image.fromarray(after.astype(np.uint8)).save(tmp_path / "viewer_sky_after_drag.png")
        viewer.close()

        # live during training: frames are rendered only inside the loop's update() calls
        from stages.reconstruct.api import load_trained

        method = load_trained(model_dir).module
        live = V.LiveViewer(poses, V.ViewerParams(port=free_port(), max_size=96, rest_s=0.2))
        viewer = live.viewer
        navigate(browser, session, viewer.url)
        wait_for("the page to connect", lambda: viewer.clients)
        time.sleep(1.0)
        assert not viewer.frames  # no training step yet: nothing may touch the model
        step = 0
        while not full_frames(viewer) and step < 20_000:  # a stand-in loop: steps of 10 ms, then update()
            time.sleep(0.01)
            live.update(method, step)
            step += 1
        assert full_frames(viewer), f"no full-size frame after {step} updates"
        n0 = len(viewer.frames)
        time.sleep(1.0)
        assert len(viewer.frames) == n0  # between updates the renders wait
    finally:
        browser.close()
        viewer.close()
    ARTIFACTS.mkdir(exist_ok=True)
    for name in ("viewer_scene.png", "viewer_sky_after_drag.png"):
        (ARTIFACTS / name).write_bytes((tmp_path / name).read_bytes())


def test_live_gate_renders_only_between_training_steps() -> None:
    gate = V.Gate(always_open=False)
    training = threading.Event()
    seen = []

    def render() -> None:
        with gate.hold():
            seen.append(training.is_set())
            time.sleep(0.02)

    t = threading.Thread(target=render)
    t.start()
    training.set()
    time.sleep(0.2)
    assert not seen  # a step is running: the render waits
    training.clear()
    spent = gate.window(1.0)  # update() between two steps
    t.join(timeout=5)
    assert seen == [False] and 0.02 <= spent < 1.0
    assert gate.window(1.0) == 0.0  # nothing waiting: returns at once


def test_live_update_without_a_browser_is_cheap() -> None:
    live = V.LiveViewer(None, V.ViewerParams(port=free_port()))
    try:
        t0 = time.perf_counter()
        for step in range(10_000):
            live.update(object(), step)
        per_call = (time.perf_counter() - t0) / 10_000
        assert per_call < 20e-6, per_call  # a length check and a clock read (measured ~1 us)
    finally:
        live.close()


@pytest.mark.gpu
@requires_gpu
def test_gpu_frames_fill_the_canvas_at_interactive_rates(tiny_model) -> None:
    """On a GPU a moving camera gets frames of the whole canvas (or most of it) within the budget."""
    from stages.reconstruct.api import load_trained

    poses, model_dir = tiny_model
    model = load_trained(model_dir, device="cuda")
    viewer = V.Viewer(V.model_render_fn(model, 1 << 16), None, V.ViewerParams(port=free_port()))
    try:
        cam = V.Camera(np.eye(4), 1.0, 1280, 720)
        intr = cam.intrinsics(640)
        viewer.render_fn(intr, cam.c2w)  # kernels compiled, caches warm
        for _ in range(3):
            t0 = time.perf_counter()
            viewer.render_fn(intr, cam.c2w)
            viewer.measured(intr.width * intr.height, time.perf_counter() - t0)
        side = viewer.moving_size(cam, 1280)
        assert side >= 640, (side, viewer.rays_per_s)  # a 640x360 frame in 0.1 s: 10 frames/s at least
    finally:
        viewer.close()
