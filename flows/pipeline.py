"""The reconstruction pipeline as a Prefect flow: the DVC stages as tasks, in order.

DVC stays the source of truth: the stages, their order and their params come from
``dvc.yaml`` and ``params.yaml``; each task is ``dvc repro --single-item <stage>``, so DVC
decides what is up to date and records what ran in ``dvc.lock``. The flow adds what
operations need: typed parameters written into ``params.yaml`` for the run (and restored
after), retries for transient faults, a concurrency limit on the GPU stages, the stages'
output in the run's logs, and the report and metrics as artifacts.

Run once locally (an ephemeral Prefect server unless ``PREFECT_API_URL`` is set)::

    python -m flows.pipeline --steps 500 --set reconstruct.batch_rays=2048

Scheduled deployments are in ``prefect.yaml``; see ``docs/prefect.md``.
"""
import argparse
import sys
from pathlib import Path
from typing import Any, Union

from prefect import flow

from flows.artifacts import publish_results
from flows.ephemeral import temporary_server
from flows.dvc_project import (
    OverrideError,
    check_overrides,
    load_params,
    parse_yaml,
    overridden_params,
    recover_params,
    repo_lock,
    stage_order,
)
from flows.gpu import GPU_LIMIT, ensure_gpu_limit, plan_gpus, visible_gpus
from flows.stage_task import run_logger, run_stage

PROJECT_ROOT = Path(__file__).resolve().parents[1]

#: Stages that run on GPUs: tagged ``gpu`` and held by the ``gpu`` concurrency limit.
GPU_STAGES = ("reconstruct", "evaluate")

#: Flow parameters that are params.yaml keys.
PARAM_KEYS = {"photos": "ingest.photos", "method": "reconstruct.method", "steps": "reconstruct.steps"}

Scalar = Union[str, int, float, bool]


def requested_overrides(photos: str | None, method: str | None, steps: int | None,
                        overrides: dict[str, Scalar] | None) -> dict[str, Scalar]:
    """The params.yaml values a run asks for: the named parameters plus ``overrides``.

    Raises:
        OverrideError: ``overrides`` sets a key that a named parameter also sets, differently.
    """
    wanted: dict[str, Scalar] = dict(overrides or {})
    for name, value in (("photos", photos), ("method", method), ("steps", steps)):
        if value is None:
            continue
        key = PARAM_KEYS[name]
        if key in wanted and wanted[key] != value:
            raise OverrideError(f"{key}: set to {value!r} by the parameter {name!r} and to {wanted[key]!r} in overrides")
        wanted[key] = value
    return wanted


@flow(name="reconstruction-pipeline", log_prints=True)
def reconstruction_pipeline(
    photos: str | None = None,
    method: str = "nerf",
    gpus: int | None = None,
    steps: int | None = None,
    overrides: dict[str, str | int | float | bool] | None = None,
    repo: str | None = None,
    retries: int = 2,
    retry_delay_s: float = 30.0,
) -> dict[str, str]:
    """Photos in, a measured reconstruction out: every stage of dvc.yaml, in order.

    Args:
        photos: a folder of photos, relative to the repository or absolute
            (params ``ingest.photos``); unset: the generated default scene.
        method: the reconstruction method (params ``reconstruct.method``).
        gpus: GPUs for the GPU stages (the first ones visible); unset: all of them.
        steps: training steps (params ``reconstruct.steps``); unset: params.yaml's value.
        overrides: any other params.yaml keys for this run, e.g. {"reconstruct.batch_rays": 2048}.
        repo: the DVC project to run; unset: the one this flow's code lives in.
        retries: retries of a stage after a transient fault (NCCL, lost worker, ...).
        retry_delay_s: seconds before each retry.

    Returns:
        Each stage's outcome: "ran", "skipped" (up to date) or "restored" (run cache).
    """
    logger = run_logger()
    root = Path(repo).expanduser().resolve() if repo else PROJECT_ROOT
    order = stage_order(root)
    wanted = requested_overrides(photos, method, steps, overrides)
    # Everything a user can get wrong is checked before the first stage starts.
    check_overrides(load_params(root), wanted)
    if photos is not None and not (root / photos).is_dir():
        raise FileNotFoundError(f"photos: {root / photos} is not a folder")
    gpu_stages = [s for s in order if s in GPU_STAGES]
    devices = visible_gpus()
    limit = ensure_gpu_limit(max(1, len(devices)), logger) if gpu_stages else None
    gpu_env, slots = plan_gpus(gpus, devices, limit)

    stage_task = run_stage.with_options(retries=retries, retry_delay_seconds=retry_delay_s)
    gpu_task = stage_task.with_options(tags={"gpu"})
    print(f"repo {root}; stages {' -> '.join(order)}; params for this run: {wanted or 'as in params.yaml'}")
    outcome: dict[str, str] = {}
    with repo_lock(root, logger):
        recover_params(root, logger)
        with overridden_params(root, wanted):
            for stage in order:
                if stage in gpu_stages:
                    outcome[stage] = gpu_task(stage, str(root), env=gpu_env,
                                              gpu_limit=None if limit is None else GPU_LIMIT, gpu_slots=slots)
                else:
                    outcome[stage] = stage_task(stage, str(root))
            summary = ", ".join(f"{s} {o}" for s, o in outcome.items())
            publish_results(str(root), description=f"Params: {wanted or 'as in params.yaml'}. Stages: {summary}.")
    print(f"stages: {summary}")
    return outcome


def _scalar(text: str) -> Scalar:
    value: Any = parse_yaml(text) if text.strip() else text
    if not isinstance(value, (str, int, float, bool)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a single value (string, number, true/false)")
    return value


def _key_value(text: str) -> tuple[str, Scalar]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. reconstruct.batch_rays=2048")
    return key.strip(), _scalar(value)


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.pipeline``: one run of the flow; exit status 1 when it fails."""
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", help="folder of photos (ingest.photos)")
    parser.add_argument("--method", default="nerf", help="reconstruct.method (default: nerf)")
    parser.add_argument("--gpus", type=int, help="GPUs for the GPU stages (default: all visible)")
    parser.add_argument("--steps", type=int, help="reconstruct.steps")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", type=_key_value, action="append",
                        default=[], help="any params.yaml key, repeatable: --set reconstruct.batch_rays=2048")
    parser.add_argument("--repo", help="DVC project to run (default: this checkout)")
    parser.add_argument("--retries", type=int, default=2, help="retries after a transient fault (default: 2)")
    parser.add_argument("--retry-delay", type=float, default=30.0, help="seconds before a retry (default: 30)")
    args = parser.parse_args(argv)
    with temporary_server():  # stopped even if this process is killed (flows/ephemeral.py)
        state = reconstruction_pipeline(
            photos=args.photos, method=args.method, gpus=args.gpus, steps=args.steps,
            overrides=dict(args.overrides), repo=args.repo, retries=args.retries,
            retry_delay_s=args.retry_delay, return_state=True,
        )
    if not state.is_completed():
        print(f"{state.name}: {state.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
