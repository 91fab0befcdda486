"""Metrics files in two parts: the headline that DVC tabulates, and the full record beside it.

A stage given ``--metrics <dir>/<name>.json`` writes there only the few headline keys it
names (PSNR, SSIM, FPS, training time, registration, ...: a dozen columns across the
pipeline, so ``dvc metrics show`` and ``dvc exp show`` stay readable), and writes every figure
it measured, headline included (environment, orbit, per-rank timings, lists of files, ...),
to ``<dir>/<name>.full.json``. ``dvc.yaml`` declares the first as ``metrics`` and the second as
a plain uncached out, so both are tracked by git and kept with every experiment; readers that
want more than the headline (the report, the comparison page) read the full record.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .io import atomic_write_json, read_json, remove

FULL_SUFFIX = ".full.json"


def full_path(metrics_path: str | Path) -> Path:
    """``<dir>/<name>.full.json`` for the headline file ``<dir>/<name>.json``."""
    p = Path(metrics_path)
    return p.with_name(p.stem + FULL_SUFFIX)


def headline(record: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The ``keys`` of ``record`` that it has with a value (None is left out: no empty column)."""
    return {k: record[k] for k in keys if record.get(k) is not None}


def write_metrics(metrics_path: str | Path, record: dict[str, Any], keys: Sequence[str]) -> None:
    """Write the full ``record`` beside ``metrics_path``, then its headline ``keys`` there."""
    atomic_write_json(full_path(metrics_path), record)
    atomic_write_json(metrics_path, headline(record, keys))


def remove_metrics(metrics_path: str | Path) -> None:
    """Remove both files (a failed run must not leave the previous run's numbers behind)."""
    remove(metrics_path)
    remove(full_path(metrics_path))


def read_metrics(metrics_path: str | Path) -> Any:
    """The full record of ``metrics_path``; the headline file alone for a run from before the
    split. ValueError naming the file when neither is there or one is malformed."""
    full = full_path(metrics_path)
    if full.is_file():
        return read_json(full)
    if Path(metrics_path).is_file():
        return read_json(metrics_path)
    raise ValueError(f"{metrics_path}: missing (and no {full.name} beside it)")
