"""Nothing a killed run made is left for good: an ingest SIGKILLed while it writes leaves a temporary
folder named after its pid, which the next run removes (a live process's is kept); a Prefect flow
SIGKILLed while it runs a stage takes its temporary Prefect server, dvc and the stage with it."""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from reliability._faults import children, descendants, kill_all, sigkill_root, spawn, stage, temporaries, wait_for

AREA = "leftovers"


def test_killed_ingest_leaves_no_temporary_folder_for_good(tmp_path, reliability, caplog):
    import logging

    from stages import ingest
    from stages.common.io import HOST

    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(80):
        Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(photos / f"p{i:02d}.png",
                                                                                   compress_level=1)
    (tmp_path / "params.yaml").write_text("ingest: {}\n")
    out = tmp_path / "data" / "ingest"
    out.parent.mkdir()
    log = tmp_path / "ingest.log"
    proc = spawn(stage("stages.ingest", "--photos", photos, "--out", out, "--params", tmp_path / "params.yaml"), log)
    try:
        def half_written():
            tmps = [p for p in out.parent.iterdir() if ".tmp-" in p.name]
            return tmps if tmps and len(list((tmps[0] / "images").glob("*.png"))) >= 5 else None
        tmps = wait_for(half_written, 120, "ingest to be half-way", proc, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        kill_all([proc.pid])
    assert len(tmps) == 1 and re.fullmatch(rf"\.ingest\.tmp-{HOST}-{proc.pid}-[0-9a-f]+", tmps[0].name), tmps
    assert not out.exists()
    alive = out.parent / f".ingest.tmp-{HOST}-{os.getpid()}-cafe"  # a temporary of a live process: kept
    alive.mkdir()
    with caplog.at_level(logging.INFO, logger="stages.io"):
        manifest = ingest.run(ingest.IngestParams(), photos, out)
    assert len(manifest["images"]) == 80 and "left by a killed run" in caplog.text
    assert temporaries(out.parent) == [alive.name]
    reliability(AREA, "ingest SIGKILLed half-way through 80 photos, then run again",
                "the next run removes the dead process's temporary folder",
                ".ingest.tmp-<host>-<its pid>-<random> left by the kill, removed by the rerun (logged); a live "
                "process's temporary kept")


PIPE_PARAMS = "seed: 0\nreconstruct:\n  method: nerf\n"
NAP_PY = """\
import pathlib, time
from stages.common.entry import cli  # what every stage's __main__ runs; this stage only sleeps
cli(lambda: (pathlib.Path("armed").touch(), time.sleep(300)))
"""  # "armed": tied to its parent (a kill before Python got that far is a window no process can close)
NAP_DVC = """\
stages:
  nap:
    cmd: python nap_stage.py
    outs: [data/nap]
"""


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process trees read from /proc")
def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_killed_prefect_flow_stops_its_temporary_server_and_its_stage(tmp_path, reliability):
    pytest.importorskip("prefect", reason="needs Prefect")
    from _dvc_project import make_dvc_project

    repo = make_dvc_project(tmp_path / "repo", NAP_PY, NAP_DVC, PIPE_PARAMS)
    (repo / "stage.py").rename(repo / "nap_stage.py")
    log = tmp_path / "flow.log"
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": "",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
               "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")}
    proc = spawn([sys.executable, "-m", "flows.pipeline", "--repo", str(repo), "--retries", "0"], log, **env)
    server = None
    try:
        def server_pid():
            return next((c for c in children(proc.pid)  # uvicorn serving Prefect's app (not the reaper beside it)
                         if b"uvicorn\0" in Path(f"/proc/{c}/cmdline").read_bytes()), None)
        server = wait_for(server_pid, 240, "the temporary server to start", proc, log)
        wait_for(lambda: (repo / "armed").exists(), 240, "the flow to run its stage", proc, log)
        nap = [p for p in descendants(proc.pid) if b"nap_stage.py" in _cmdline(p)]
        tree, left = sigkill_root(proc, 30)
        assert not left, f"outlived the SIGKILLed flow: {[(p, _cmdline(p)) for p in left]} (server {server})"
        assert server in tree and nap[0] in tree
    finally:
        kill_all(descendants(proc.pid) + [proc.pid] + ([server] if server else []))
    reliability(AREA, "`python -m flows.pipeline` SIGKILLed while it runs a stage",
                "its temporary Prefect server, dvc and the stage stop too",
                "server (uvicorn), dvc repro and the stage gone within seconds")
