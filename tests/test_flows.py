"""Unit tests of the Prefect flow's pieces: stage order, overrides, retries, task bodies.

No Prefect server: task bodies run through ``.fn()``; the flow itself, served against a
real server, is tested in ``test_prefect_server.py``.
"""
from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
from _dvc_project import make_dvc_project
import yaml

pytest.importorskip("prefect", reason="the flows need Prefect (installed by make setup; absent on bare GPU hosts)")

from flows import artifacts, dvc_project, gpu, pipeline  # noqa: E402
from flows.dvc_project import OverrideError, check_overrides, overridden_params, stage_order  # noqa: E402
from flows.stage_task import StageFailed, classify, error_message, retry_on_transient_fault, run_stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- a tiny DVC project

STAGE_PY = """\
import os, sys, yaml
p = yaml.safe_load(open("params.yaml"))
name = sys.argv[1]
print(f"{name} says hello; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
if name == "bad":
    raise ValueError(f"bad.size: must be > 0, got {p['bad']['size']}")
if name == "flaky":
    print("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")
    print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    sys.exit(1)
os.makedirs(f"data/{name}", exist_ok=True)
open(f"data/{name}/out.txt", "w").write(str(p[name]))
"""

DVC_YAML = """\
stages:
  ok:
    cmd: python stage.py ok
    deps: [stage.py]
    params: [ok]
    outs: [data/ok]
  bad:
    cmd: python stage.py bad
    deps: [stage.py, data/ok]
    params: [bad]
    outs: [data/bad]
  flaky:
    cmd: python stage.py flaky
    deps: [stage.py, data/ok]
    outs: [data/flaky]
"""

PARAMS_YAML = """\
# a comment that must survive
ok:
  n: 3        # inline comment
  rate: 0.5
  name: x
  enabled: true
bad:
  size: -1
"""


def _make_project(root: Path) -> Path:
    return make_dvc_project(root, STAGE_PY, DVC_YAML, PARAMS_YAML)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_project(tmp_path_factory.mktemp("dvc") / "project")


# ---------------------------------------------------------------- stage order


def test_stage_order_of_the_project_follows_dvc_yaml() -> None:
    order = stage_order(ROOT)
    main = ["scene", "ingest", "poses", "reconstruct", "evaluate", "report"]
    assert [s for s in order if s in main] == main, order


def test_stage_order_puts_deps_first_and_keeps_file_order_otherwise(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("src:\n  dir: data/a\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  report: {cmd: x, deps: [data/metrics/b.json, data/b]}\n"       # needs b's metric and out
        "  lone: {cmd: x, outs: [data/lone]}\n"
        "  b: {cmd: x, deps: ['${src.dir}'], outs: [data/b], metrics: [{data/metrics/b.json: {cache: false}}]}\n"
        "  a: {cmd: x, outs: [data/a/images]}\n"                           # b's templated dep contains it
    )
    assert stage_order(tmp_path) == ["lone", "a", "b", "report"]


def test_stage_order_rejects_a_cycle_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="dvc.yaml"):
        stage_order(tmp_path)
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  a: {cmd: x, deps: [data/b], outs: [data/a]}\n  b: {cmd: x, deps: [data/a], outs: [data/b]}\n"
    )
    with pytest.raises(ValueError, match="cycle"):
        stage_order(tmp_path)


# ---------------------------------------------------------------- overrides


def test_check_overrides_accepts_known_keys_of_the_right_type() -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    check_overrides(params, {
        "reconstruct.steps": 10, "reconstruct.method": "nerf", "ingest.photos": "x",
        "reconstruct.nerf.lr": 1,  # an int where a float is: fine, as in the stages' schemas
        "poses.align_up": False,
    })


@pytest.mark.parametrize(("overrides", "message"), [
    ({"reconstruct.stpes": 10}, r"unknown params key 'reconstruct.stpes'.*did you mean reconstruct.steps"),
    ({"nosuch": 1}, r"unknown params key 'nosuch'"),
    ({"reconstruct.nerf": 1}, r"reconstruct.nerf: is a section"),
    ({"reconstruct.steps": "many"}, r"reconstruct.steps: expected an integer"),
    ({"reconstruct.steps": True}, r"reconstruct.steps: expected an integer"),
    ({"reconstruct.steps": 2.5}, r"reconstruct.steps: expected an integer"),
    ({"poses.align_up": 1}, r"poses.align_up: expected true or false"),
    ({"ingest.photos": 3}, r"ingest.photos: expected a string"),
])
def test_check_overrides_names_the_bad_key(overrides: dict, message: str) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    with pytest.raises(OverrideError, match=message):
        check_overrides(params, overrides)


def test_named_parameters_map_to_params_keys() -> None:
    assert pipeline.requested_overrides("p", "nerf", 5, {"seed": 1}) == {
        "seed": 1, "ingest.photos": "p", "reconstruct.method": "nerf", "reconstruct.steps": 5}
    assert pipeline.requested_overrides(None, None, None, None) == {}
    with pytest.raises(OverrideError, match="reconstruct.steps"):
        pipeline.requested_overrides(None, "nerf", 5, {"reconstruct.steps": 6})


def test_overridden_params_writes_then_restores_the_exact_bytes(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS_YAML)
    with pytest.raises(RuntimeError, match="stage blew up"):
        with overridden_params(tmp_path, {"ok.n": 7, "ok.name": "y", "ok.enabled": False}):
            during = path.read_text()
            assert yaml.safe_load(during)["ok"] == {"n": 7, "rate": 0.5, "name": "y", "enabled": False}
            assert "# a comment that must survive" in during and "# inline comment" in during
            assert (tmp_path / dvc_project.BACKUP_FILE).read_text() == PARAMS_YAML
            raise RuntimeError("stage blew up")
    assert path.read_text() == PARAMS_YAML
    assert not (tmp_path / dvc_project.BACKUP_FILE).exists()


def test_overridden_params_leaves_the_file_alone_without_changes(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS_YAML)
    before = path.stat().st_mtime_ns
    with overridden_params(tmp_path, {"ok.n": 3}):
        assert not (tmp_path / dvc_project.BACKUP_FILE).exists()
    assert path.stat().st_mtime_ns == before


def test_recover_params_restores_what_a_killed_run_left(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("ok:\n  n: 99\n")
    (tmp_path / dvc_project.BACKUP_FILE).parent.mkdir(parents=True)
    (tmp_path / dvc_project.BACKUP_FILE).write_text(PARAMS_YAML)
    dvc_project.recover_params(tmp_path, logging.getLogger("test"))
    assert (tmp_path / "params.yaml").read_text() == PARAMS_YAML
    assert (tmp_path / dvc_project.CRASHED_FILE).read_text() == "ok:\n  n: 99\n"


# ---------------------------------------------------------------- retries


NCCL_TIMEOUT = """\
[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600030 milliseconds before timing out.
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
ERROR: failed to reproduce 'reconstruct': failed to run: python -m stages.reconstruct, exited with 1"""
CHILD_VALUE_ERROR = """\
[rank0]: ValueError: reconstruct.steps: must be > 0, got 0
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"""
CUDA_OOM = """\
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"""


@pytest.mark.parametrize(("output", "retry"), [
    (NCCL_TIMEOUT, True),
    ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited", True),
    ("[E ProcessGroupNCCL.cpp:1182] NCCL communicator was aborted: operation timed out after 600 s", True),
    ("ConnectionResetError: [Errno 104] Connection reset by peer", True),
    ("cache folder does not exist, creating it\n" + "step ...\n" * 500 + "NCCL error: unhandled system error", True),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError:", True),
    ("ray: worker lost while running", True),
    ("ERROR: Unable to acquire lock. Most likely another DVC process is running", True),
    (CHILD_VALUE_ERROR, False),   # a worker's bad input wrapped by torchrun: not transient
    (CUDA_OOM, False),            # same params, same GPU: out of memory again
    ("ValueError: ingest.min_images: must be >= 3, got 1", False),
    ("stages.common.params.ParamsError: unknown params key(s) poses.fooo", False),
    ("ERROR: failed to reproduce 'ingest': missing data 'source': /x/photos", False),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'data/scene'", False),
    ("Traceback ...\nRuntimeError: something odd", False),  # unknown faults are not retried
])
def test_retry_condition_retries_only_transient_faults(output: str, retry: bool) -> None:
    from prefect.states import Failed

    transient, permanent = classify(output.splitlines())
    exc = StageFailed("reconstruct", 1, error_message(output.splitlines()), transient, permanent)
    assert exc.retryable is retry
    assert retry_on_transient_fault(None, None, Failed(data=exc)) is retry


def test_retry_condition_never_retries_other_exceptions() -> None:
    from prefect.states import Failed

    assert retry_on_transient_fault(None, None, Failed(data=ValueError("NCCL error"))) is False
    assert retry_on_transient_fault(None, None, Failed(data=OverrideError("x"))) is False


def test_error_message_is_the_stages_own() -> None:
    assert error_message(NCCL_TIMEOUT.splitlines()) == "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    assert error_message(["Traceback (most recent call last):", '  File "x.py"', "ValueError: bad", "ERROR: failed"]) == "ValueError: bad"
    assert error_message(["ERROR: failed to reproduce 'x': dependency 'y' does not exist"]) == "failed to reproduce 'x': dependency 'y' does not exist"
    assert error_message([]) == "no output"


def test_stage_failed_survives_pickling() -> None:
    exc = pickle.loads(pickle.dumps(StageFailed("poses", 255, "ValueError: x", ("NCCL error",), ())))
    assert (exc.stage, exc.returncode, exc.error, exc.retryable) == ("poses", 255, "ValueError: x", True)
    assert str(exc) == "stage 'poses' failed: ValueError: x (dvc repro exited with 255)"


def test_stage_tasks_retry_only_through_the_condition() -> None:
    assert run_stage.retry_condition_fn is retry_on_transient_fault
    assert run_stage.retries >= 1


# ---------------------------------------------------------------- task bodies (.fn)


def test_run_stage_runs_then_skips_and_streams_the_output(project: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefect.rayforge.flows")
    assert run_stage.fn("ok", str(project), env={"CUDA_VISIBLE_DEVICES": "7"}) == "ran"
    assert "[ok] ok says hello; CUDA_VISIBLE_DEVICES=7" in caplog.messages
    assert (project / "data/ok/out.txt").read_text() == str({"n": 3, "rate": 0.5, "name": "x", "enabled": True})
    assert run_stage.fn("ok", str(project)) == "skipped"  # DVC: deps, params and outs match dvc.lock


def test_run_stage_failure_names_the_stage_and_its_error(project: Path) -> None:
    run_stage.fn("ok", str(project))
    with pytest.raises(StageFailed) as bad:
        run_stage.fn("bad", str(project))
    assert bad.value.stage == "bad" and not bad.value.retryable
    assert "stage 'bad' failed: ValueError: bad.size: must be > 0, got -1" in str(bad.value)
    with pytest.raises(StageFailed) as flaky:
        run_stage.fn("flaky", str(project))
    assert flaky.value.retryable and "NCCL error" in flaky.value.transient
    with pytest.raises(StageFailed, match="stage 'nosuch' failed: Stage 'nosuch' not found") as unknown:
        run_stage.fn("nosuch", str(project))
    assert not unknown.value.retryable


def test_metrics_rows_flatten_every_json(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text('{"psnr": 25.5, "per_view": {"mean": 1, "all": [1, 2]}}')
    (tmp_path / "a.json").write_text('{"fps": 30}')
    assert artifacts.metrics_rows(tmp_path) == [
        {"file": "a.json", "metric": "fps", "value": 30},
        {"file": "b.json", "metric": "psnr", "value": 25.5},
        {"file": "b.json", "metric": "per_view.mean", "value": 1},
        {"file": "b.json", "metric": "per_view.all", "value": "[1, 2]"},
    ]


# ---------------------------------------------------------------- GPUs


def test_plan_gpus() -> None:
    assert gpu.plan_gpus(None, [], None) == ({}, 1)              # CPU host: one slot, one stage at a time
    assert gpu.plan_gpus(None, ["0", "1", "2", "3"], None) == ({}, 4)
    assert gpu.plan_gpus(None, ["0", "1", "2", "3"], 2) == ({}, 2)
    assert gpu.plan_gpus(2, ["4", "5", "6"], 3) == ({"CUDA_VISIBLE_DEVICES": "4,5"}, 2)
    with pytest.raises(ValueError, match="gpus: 3 asked for, but 2 GPU"):
        gpu.plan_gpus(3, ["0", "1"], None)
    with pytest.raises(ValueError, match="concurrency limit 'gpu' has 1 slot"):
        gpu.plan_gpus(2, ["0", "1"], 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        gpu.plan_gpus(0, ["0"], None)
    with pytest.raises(ValueError, match="has 0 slots"):
        gpu.plan_gpus(None, ["0"], 0)


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert gpu.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpu.visible_gpus() == []


def test_no_gpu_limit_without_a_server() -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert gpu.ensure_gpu_limit(2, logging.getLogger("test")) is None


# ---------------------------------------------------------------- entry points


def test_cli_parses_overrides_into_typed_values() -> None:
    assert pipeline._key_value("reconstruct.steps=50") == ("reconstruct.steps", 50)
    assert pipeline._key_value("poses.align_up=false") == ("poses.align_up", False)
    assert pipeline._key_value("reconstruct.nerf.lr=1e-3") == ("reconstruct.nerf.lr", 1e-3)
    assert pipeline._key_value("ingest.photos=a=b") == ("ingest.photos", "a=b")
    with pytest.raises(Exception, match="KEY=VALUE"):
        pipeline._key_value("reconstruct.steps")
    with pytest.raises(SystemExit):
        pipeline.main(["--set", "reconstruct.nerf={a: 1}"])


def test_prefect_yaml_deployments_load_and_validate() -> None:
    from prefect.flows import load_flow_from_entrypoint

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())

    def nulls(node: object) -> bool:
        if isinstance(node, dict):
            return any(v is None or nulls(v) for v in node.values())
        return isinstance(node, list) and any(nulls(v) for v in node)

    assert not nulls(config), "prefect.yaml has null entries"
    deployments = config["deployments"]
    assert {d["name"] for d in deployments} >= {"nightly-benchmark", "weekly-fern"}
    for dep in deployments:
        assert dep["schedules"] and all(s.get("cron") and s.get("timezone") for s in dep["schedules"])
        assert dep["work_pool"]["name"]
        flow = load_flow_from_entrypoint(str(ROOT / dep["entrypoint"]))
        assert flow.name == pipeline.reconstruction_pipeline.name
        flow.validate_parameters(dep.get("parameters", {}))
        check_overrides(yaml.safe_load((ROOT / "params.yaml").read_text()),
                        pipeline.requested_overrides(dep["parameters"].get("photos"), dep["parameters"].get("method"),
                                                     dep["parameters"].get("steps"), dep["parameters"].get("overrides")))
