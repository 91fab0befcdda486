"""GPUs for the GPU stages: which ones they see, and the Prefect limit that shares them out.

The limit is a Prefect global concurrency limit (``gpu`` by default) with one slot per
GPU of the host; a GPU stage holds as many slots as GPUs it uses, so runs of several
deployments or checkouts never put more training jobs on the host than it has GPUs.
Slots are counted, not assigned: which GPUs a stage sees is ``CUDA_VISIBLE_DEVICES``.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess

GPU_LIMIT = "gpu"


def visible_gpus() -> list[str]:
    """Device ids the stages can use: ``CUDA_VISIBLE_DEVICES`` if set, else what
    ``nvidia-smi`` lists, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [d.strip() for d in env.split(",") if d.strip()]
        return [] if ids[:1] in (["-1"], ["NoDevFiles"]) else ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def server_configured() -> bool:
    """True when runs report to a Prefect server (``PREFECT_API_URL``), False for the
    ephemeral in-process one, where a limit would bind nothing beyond this run."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def ensure_gpu_limit(slots: int, logger: logging.Logger | logging.LoggerAdapter,
                     name: str = GPU_LIMIT) -> int | None:
    """Create the global concurrency limit ``name`` with ``slots`` slots unless it exists.

    An existing limit keeps the value an operator gave it. Returns the limit's size, or
    None with no server configured (nothing is created; the stages run unlimited).
    """
    if not server_configured():
        logger.info("no Prefect server configured (PREFECT_API_URL); GPU concurrency limit not used")
        return None
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
                logger.info("created the global concurrency limit %r with %d slot(s), one per GPU", name, slots)
                return slots
            except ObjectAlreadyExists:  # another run created it meanwhile
                limit = client.read_global_concurrency_limit_by_name(name)
    if not limit.active:
        logger.warning("the global concurrency limit %r is inactive; GPU stages are not limited", name)
    return limit.limit


def plan_gpus(gpus: int | None, devices: list[str], limit: int | None) -> tuple[dict[str, str], int]:
    """Environment and slot count for the GPU stages.

    Args:
        gpus: GPUs asked for, or None for every visible one.
        devices: the visible device ids (:func:`visible_gpus`).
        limit: the size of the concurrency limit, or None without one.

    Returns:
        (extra environment, slots to hold). With ``gpus`` set, the stages see the first
        ``gpus`` devices and hold that many slots; without, they see every device and hold
        one slot per device (at least one, so CPU hosts run one GPU stage at a time too),
        capped at the limit's size.

    Raises:
        ValueError: ``gpus`` below 1, above the visible GPUs or above the limit's size
            (Prefect refuses to hand out more slots than a limit has), or a limit of 0.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"the concurrency limit {GPU_LIMIT!r} has {limit} slots, so no GPU stage can run; "
                         f"raise it: prefect global-concurrency-limit update {GPU_LIMIT} --limit N")
    if gpus is None:
        slots = max(1, len(devices))
        return {}, slots if limit is None else min(slots, limit)
    if gpus < 1:
        raise ValueError(f"gpus: must be >= 1, got {gpus} (leave it unset to use every visible GPU)")
    if gpus > len(devices):
        raise ValueError(f"gpus: {gpus} asked for, but {len(devices)} GPU(s) visible ({','.join(devices) or 'none'})")
    if limit is not None and gpus > limit:
        raise ValueError(f"gpus: {gpus} asked for, but the concurrency limit {GPU_LIMIT!r} has {limit} slot(s)")
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[:gpus])}, gpus
