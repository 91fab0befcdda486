"""The report and comparison pages in a real browser: headless Chromium opens them from disk.

From the rendered page (not the HTML text) it checks that every image finished loading with a
real size, that the tables are there, and that the page asked for nothing but itself and
``data:`` URIs; it keeps a full-page screenshot in pytest's tmp dir and in ``tests/artifacts/``
(git-ignored) for a person to look at.

The browser is Debian's ``chromium`` (``scripts/setup.sh`` installs it where it can); the
tests skip with a reason when there is none. Chromium is driven over the DevTools protocol on
a pipe (``--remote-debugging-pipe``: commands on fd 3, replies on fd 4, NUL-separated JSON),
so no driver package is needed.
"""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image

from stages import compare, report
from test_report import pipeline  # noqa: F401  (a fixture: poses, fake evaluate outs, metrics, train.csv)

pytestmark = pytest.mark.integration  # starts a browser

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# flags that work as root in a container without a display, GPU or /dev/shm of any size
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-extensions", "--disable-sync", "--disable-default-apps", "--disable-component-update",
         "--no-first-run", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
         "--window-size=1400,1000", "--remote-debugging-pipe"]
TIMEOUT_S = 60.0


def find_chromium() -> str | None:
    env = os.environ.get("CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class Browser:
    """A headless Chromium and a minimal DevTools-protocol client over its debugging pipe."""

    def __init__(self, exe: str, profile: Path):
        to_browser_r, self._w = os.pipe()  # we write commands, chromium reads them on fd 3
        self._r, from_browser_w = os.pipe()  # chromium writes replies on fd 4

        def fds() -> None:  # in the child, before exec (subprocess closes other fds after this)
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        profile.mkdir(parents=True, exist_ok=True)
        self.log = profile.with_name(profile.name + ".log")
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         pass_fds=(to_browser_r, from_browser_w, 3, 4), preexec_fn=fds)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise TimeoutError(f"no reply from chromium (exit code {self.proc.poll()}); "
                                   f"its log: {self.log.read_text(errors='replace')[-2000:]}")
            ready, _, _ = select.select([self._r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise ConnectionError(f"chromium closed the pipe; log: {self.log.read_text(errors='replace')[-2000:]}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, session: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for k, e in enumerate(self.events):
                if e.get("method") == method and e.get("sessionId") == session:
                    return self.events.pop(k)
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except Exception:  # already gone: the wait below reaps it
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


# what the page looks like once loaded; waits for every image to decode (or fail)
PAGE_STATE = """(async () => {
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  return {
    title: document.title,
    images: imgs.map(i => ({src: i.currentSrc.slice(0, 30), complete: i.complete,
                            width: i.naturalWidth, height: i.naturalHeight, shown: i.getBoundingClientRect().width})),
    tables: Array.from(document.querySelectorAll('table')).map(t => ({cls: t.className, rows: t.rows.length})),
    resources: performance.getEntriesByType('resource').map(e => e.name.slice(0, 60)),
  };
})()"""


def open_page(exe: str, page: Path, profile: Path, screenshot: Path, expression: str = PAGE_STATE) -> dict:
    """Load ``page`` from disk; return its state (``expression``'s object, default ``PAGE_STATE``)
    and the URLs it requested."""
    browser = Browser(exe, profile)
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        browser.send("Network.enable", session=session)
        browser.send("Page.enable", session=session)
        browser.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        browser.wait_event("Page.loadEventFired", session)
        res = browser.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=session)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        state = res["result"]["value"]
        size = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = browser.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}, session=session)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        state["requests"] = [e["params"]["request"]["url"] for e in browser.events
                             if e.get("method") == "Network.requestWillBeSent"]
        state["failed"] = [e["params"] for e in browser.events if e.get("method") == "Network.loadingFailed"]
        state["size"] = size
        return state
    finally:
        browser.close()


def check_page(state: dict, page: Path, screenshot: Path, n_images: int, tables: set[str]) -> None:
    assert state["images"], "no images on the page"
    for img in state["images"]:  # every image decoded, with real pixels, and laid out
        assert img["complete"] and img["width"] > 0 and img["height"] > 0 and img["shown"] > 0, img
    assert len(state["images"]) == n_images
    have = {t["cls"] for t in state["tables"]}
    assert tables <= have, f"tables {sorted(tables - have)} missing; the page has {sorted(have)}"
    assert all(t["rows"] >= 2 for t in state["tables"] if t["cls"] in tables)  # a header and a row at least
    url = page.resolve().as_uri()
    # offline: the page itself, data: URIs, nothing else (no fonts, scripts or pictures from a network)
    assert all(u == url or u.startswith("data:") for u in state["requests"]), state["requests"]
    assert not state["failed"], state["failed"]
    assert all(r.startswith("data:") for r in state["resources"]), state["resources"]
    with Image.open(screenshot) as im:  # the screenshot is the whole page, and not blank
        assert im.size[0] >= 1000 and im.size[1] >= min(state["size"]["height"], 16000) - 1
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 100
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(screenshot, ARTIFACTS / screenshot.name)


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = find_chromium()
    if exe is None:
        pytest.skip("no Chromium binary (Debian: apt-get install chromium; scripts/setup.sh does it as root or "
                    "with sudo); set CHROMIUM=/path/to/chrome to use another")
    return exe


def test_report_page_in_chromium(pipeline, chromium, tmp_path):  # noqa: F811
    root = pipeline
    scaling = root / "scaling.json"
    scaling.write_text(json.dumps({"scene": "unit", "method": "nerf", "runs": [
        {"gpus": 1, "wall_s": 40.0, "samples_per_s": 1.0e6, "psnr": 27.2},
        {"gpus": 2, "wall_s": 22.0, "samples_per_s": 1.8e6, "psnr": 27.1}]}))
    out = report.run(report.ReportParams(max_views=3), root / "evaluate", root / "metrics",
                     root / "plots" / "train.csv", root / "poses", root / "report", scene="unit", test_every=2,
                     scaling=scaling)
    n_img = out["html"].read_text().count("<img")
    state = open_page(chromium, out["html"], tmp_path / "profile", tmp_path / "report.png")
    assert state["title"]
    check_page(state, out["html"], tmp_path / "report.png", n_img, {"summary", "per-view", "scaling", "environment"})
    assert n_img >= 4  # 3 view rows + the training curve


def test_compare_page_in_chromium(chromium, tmp_path):
    def entry(rev: str, name: str, steps: int, workers: int, psnr: float, sps: float) -> dict:
        metrics = {
            "data/metrics/evaluate.json": {"data": {"psnr": psnr, "ssim": 0.8, "fps": 2.0, "train_time_s": 60.0 / workers,
                                                    "steps": steps, "world_size": workers}},
            "data/metrics/reconstruct.json": {"data": {"samples_per_s": sps, "train_time_s": 60.0 / workers,
                                                       "world_size": workers, "device": "cuda"}},
            "data/metrics/poses.json": {"data": {"num_registered": 48, "num_images": 48}},
        }
        params = {"reconstruct": {"steps": steps, "distributed": {"gpus": workers}}}
        return {"rev": rev, "name": name, "error": None, "data": {
            "rev": rev, "timestamp": "2026-01-01T00:00:00", "params": {"params.yaml": {"data": params}},
            "metrics": metrics, "deps": {}, "outs": {}, "meta": {}}}

    base = entry("a" * 40, "main", 1000, 1, 23.1, 1.0e6)
    base["experiments"] = [{"name": n, "executor": None, "revs": [e]} for n, e in (
        ("gpus-2", entry("b" * 40, "gpus-2", 1000, 2, 23.0, 1.7e6)),
        ("steps-5k", entry("c" * 40, "steps-5k", 5000, 1, 27.2, 1.0e6)))]
    runs = compare.parse_exp_show([base])
    out = compare.write(runs, compare.choose_baselines(runs), tmp_path / "compare")
    assert out["scaling_tables"] == 1
    state = open_page(chromium, out["html"], tmp_path / "profile", tmp_path / "compare.png")
    check_page(state, out["html"], tmp_path / "compare.png", 1, {"experiments", "scaling", "environment"})
    rows = {t["cls"]: t["rows"] for t in state["tables"]}
    assert rows["experiments"] == 4 and rows["scaling"] == 3  # header + 3 runs; header + 2 world sizes
