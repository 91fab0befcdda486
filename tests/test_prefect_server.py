"""Integration: the flow served against a real Prefect server, on a tiny DVC project.

Starts ``prefect server start`` (own PREFECT_HOME, free port), serves the flow from a
subprocess (``flow.serve``), triggers deployment runs through the API and checks their
states, task runs, logs and artifacts; then deploys ``prefect.yaml`` to the same server.
The real stages are slow, so the runs go to a throwaway project of the same layout whose
stages are a few lines of Python. Every process started here is stopped by its PID in a
``finally`` (SIGTERM, then SIGKILL), whether the test passed or not.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _dvc_project import make_dvc_project

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
FLOW = "reconstruction-pipeline"
SERVER_START_S = 120  # 17-19 s measured on 2 shared cores; the margin is for a loaded machine
RUN_TIMEOUT_S = 150

# ---------------------------------------------------------------- the tiny project

STAGE_PY = """\
import json, os, sys, yaml
p = yaml.safe_load(open("params.yaml"))
name = sys.argv[1]
print(f"{name}: params {p.get(name)}", flush=True)
if name == "scene" and p["scene"]["n"] < 0:
    raise ValueError(f"scene.n: must be >= 0, got {p['scene']['n']}")
marker = p["evaluate"]["fail_once"]
if name == "evaluate" and marker and not os.path.exists(marker):
    open(marker, "w").close()
    print("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")
    sys.exit(1)
os.makedirs(f"data/{name}", exist_ok=True)
open(f"data/{name}/done.txt", "w").write(name)
if name in ("reconstruct", "evaluate"):
    os.makedirs("data/metrics", exist_ok=True)
    json.dump({"psnr": 20.0 + p["reconstruct"]["steps"], "per_view": {"n": 2}}, open(f"data/metrics/{name}.json", "w"))
if name == "report":
    os.makedirs("data/report", exist_ok=True)
    open("data/report/report.md", "w").write("# Tiny report\\n\\n| view | psnr |\\n| --- | --- |\\n| 0 | 23.0 |\\n")
"""

DVC_YAML = """\
stages:
  scene:
    cmd: python stage.py scene
    deps: [stage.py]
    params: [scene]
    outs: [data/scene]
  reconstruct:
    cmd: python stage.py reconstruct
    deps: [stage.py, data/scene]
    params: [reconstruct]
    outs: [data/reconstruct]
    metrics: [{data/metrics/reconstruct.json: {cache: false}}]
  evaluate:
    cmd: python stage.py evaluate
    deps: [stage.py, data/reconstruct]
    params: [evaluate]
    outs: [data/evaluate]
    metrics: [{data/metrics/evaluate.json: {cache: false}}]
  report:
    cmd: python stage.py report
    deps: [stage.py, data/evaluate, data/metrics/evaluate.json, data/metrics/reconstruct.json]
    outs: [data/report]
"""

PARAMS_YAML = """\
# the tiny project's knobs
seed: 0
scene:
  n: 3
ingest:
  photos: data/scene
reconstruct:
  method: nerf
  steps: 5
evaluate:
  fail_once: ""   # a path: the first evaluate fails with an NCCL error and leaves it
"""


def _make_project(root: Path) -> Path:
    return make_dvc_project(root, STAGE_PY, DVC_YAML, PARAMS_YAML)


# ---------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        # Its own session, so that what it starts (flow-run processes) can be found by its group id.
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process by its PID, SIGKILL it if it lingers, then the rest of its group."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
    try:  # children it left behind (a flow run in progress) share its process group id
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def _wait(what: str, ready, timeout_s: float, log: Path, proc: subprocess.Popen[bytes] | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited with {proc.returncode}\n{_tail(log)}")
        value = ready()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout_s} s\n{_tail(log)}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real Prefect server on a free port, and the settings that point a client at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("prefect")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp / "home"),
        PREFECT_API_URL=url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",  # avoided a "database is locked" error
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90",
        PREFECT_LOGGING_TO_API_BATCH_INTERVAL="0.3",
        PREFECT_RUNNER_POLL_FREQUENCY="2",  # serve picks new runs up in 2 s, not 10
        PYTHONUNBUFFERED="1",
    )
    log = tmp / "server.log"
    proc = _start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  log, env, tmp)
    try:
        _wait("prefect server /api/health", lambda: _healthy(url), SERVER_START_S, log, proc)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield {"url": url, "env": env, "tmp": tmp, "log": log}
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def served(server: dict[str, Any]) -> Iterator[str]:
    """The flow served as the deployment ``reconstruction-pipeline/it`` from a subprocess."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    script = server["tmp"] / "serve.py"
    script.write_text(  # the guard matters: flow runs start in processes that import __main__ again
        "from flows.pipeline import reconstruction_pipeline\n"
        "if __name__ == '__main__':\n"
        "    reconstruction_pipeline.serve(name='it', limit=4, print_starting_message=False)\n"
    )
    log = server["tmp"] / "serve.log"
    proc = _start([sys.executable, str(script)], log, server["env"], ROOT)

    def deployment_id() -> str | None:
        with get_client(sync_client=True) as client:
            try:
                return str(client.read_deployment_by_name(f"{FLOW}/it").id)
            except ObjectNotFound:
                return None

    try:
        yield _wait("flow.serve registers its deployment", deployment_id, 90, log, proc)
    finally:
        _stop(proc)  # measured: flow.serve stops cleanly on SIGTERM (not within 7 s of SIGINT)


# ---------------------------------------------------------------- the tests


def _task_runs(client: Any, flow_run_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _logs(client: Any, flow_run_id: Any) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]


def test_deployment_runs_on_a_real_server(server: dict[str, Any], served: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    from flows.gpu import GPU_LIMIT, visible_gpus

    project = _make_project(tmp_path / "project")
    marker = tmp_path / "nccl-failed-once"
    runs = {  # all four at once; the flow's repo lock runs them one after another
        "ok": {"repo": str(project), "steps": 3},
        "bad_key": {"repo": str(project), "overrides": {"reconstruct.stpes": 3}},
        "bad_input": {"repo": str(project), "overrides": {"scene.n": -1}},
        "transient": {"repo": str(project), "overrides": {"evaluate.fail_once": str(marker)},
                      "retries": 1, "retry_delay_s": 0},
    }
    with get_client(sync_client=True) as client:
        ids = {name: client.create_flow_run_from_deployment(served, parameters=params).id
               for name, params in runs.items()}

        def finished() -> dict[str, Any] | None:
            states = {name: client.read_flow_run(i).state for name, i in ids.items()}
            return states if all(s is not None and s.is_final() for s in states.values()) else None

        states = _wait("the four flow runs finish", finished, RUN_TIMEOUT_S, server["tmp"] / "serve.log")
        messages = {name: f"{s.name}: {s.message}" for name, s in states.items()}

        # A good run: every stage as a task, the GPU stages tagged, output in the logs, artifacts.
        assert states["ok"].is_completed(), messages
        tasks = {t.name: t for t in _task_runs(client, ids["ok"])}
        assert {"scene", "reconstruct", "evaluate", "report"} <= set(tasks), sorted(tasks)
        assert "publish-results" in tasks
        assert "gpu" in tasks["reconstruct"].tags and "gpu" in tasks["evaluate"].tags
        assert "gpu" not in tasks["scene"].tags
        streamed = "[reconstruct] reconstruct: params {'method': 'nerf', 'steps': 3}"  # the stage's own print
        _wait("the stage's output in the run's logs", lambda: streamed in _logs(client, ids["ok"]), 30, server["log"])
        arts = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["reconstruction-report", "reconstruction-metrics"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[ids["ok"]])))}
        assert arts["reconstruction-report"].type == "markdown"
        assert arts["reconstruction-report"].data.startswith("# Tiny report")
        assert arts["reconstruction-metrics"].type == "table"
        table = arts["reconstruction-metrics"].data
        rows = json.loads(table) if isinstance(table, str) else table
        assert {"file": "reconstruct.json", "metric": "psnr", "value": 23.0} in rows
        limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        assert limit.limit == max(1, len(visible_gpus()))

        # An unknown params key stops the run before any stage starts, naming the key.
        assert states["bad_key"].is_failed(), messages
        assert "unknown params key 'reconstruct.stpes'" in states["bad_key"].message
        assert _task_runs(client, ids["bad_key"]) == []

        # Bad input fails its stage once (no retry) and the flow, naming the stage and its error.
        assert states["bad_input"].is_failed(), messages
        assert "stage 'scene' failed: ValueError: scene.n: must be >= 0, got -1" in states["bad_input"].message
        tasks = {t.name: t for t in _task_runs(client, ids["bad_input"])}
        assert set(tasks) == {"scene"}, sorted(tasks)
        assert tasks["scene"].state.is_failed() and tasks["scene"].run_count == 1

        # A transient fault (NCCL error) is retried and the run completes.
        assert states["transient"].is_completed(), messages
        tasks = {t.name: t for t in _task_runs(client, ids["transient"])}
        assert tasks["evaluate"].run_count == 2 and marker.exists()

    # The overrides were for the runs only.
    assert (project / "params.yaml").read_text() == PARAMS_YAML
    assert not (project / ".dvc/tmp/rayforge-flow.params.yaml").exists()


def test_prefect_yaml_deploys_with_its_schedules(server: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client

    def prefect(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=server["env"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    prefect("work-pool", "create", "rayforge-process", "--type", "process")
    prefect("--no-prompt", "deploy", "--all")
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name(f"{FLOW}/nightly-benchmark")
        weekly = client.read_deployment_by_name(f"{FLOW}/weekly-fern")
    for dep in (nightly, weekly):
        assert dep.work_pool_name == "rayforge-process"
        assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        assert [s.active for s in dep.schedules] == [True]
    assert (nightly.schedules[0].schedule.cron, nightly.schedules[0].schedule.timezone) == ("0 2 * * *", "UTC")
    assert weekly.schedules[0].schedule.timezone == "Europe/Berlin"
    assert weekly.parameters["photos"] == "../shared/data/fern/images_8"
