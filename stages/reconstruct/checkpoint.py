"""Training checkpoints, so that a killed run resumes instead of starting over.

Rank 0 writes ``step_<step>.pt`` into a checkpoint folder beside the stage's out (never
inside it: the out is DVC's and is replaced as a whole at the end), atomically
(temporary file, then rename), with a ``step_<step>.json`` beside it holding the
file's sha256; the latest two are kept. A checkpoint holds tensors and plain types
only (``torch.load(weights_only=True)``):

* ``format``, ``method``, ``method_version``, ``config`` (the resolved params), ``seed``, ``world_size``
* ``step``: optimizer steps done
* ``state`` (the method's ``state_dict()``), ``optimizers`` and ``schedulers`` (state dicts by
  name: one per parameter for 3DGS, one for the NeRF's field)
* ``rng``: one entry per rank (every generator the rank draws from, and torch's own)
* ``progress``: the training curve so far, samples and seconds, for the outs' figures
* ``data``: ``{"fingerprint", "poses"}``, the training data's fingerprint
  (:func:`stages.common.fingerprint.data_fingerprint`) and where it was read

A run resumes from the newest checkpoint that reads back intact; a corrupt newest one
is skipped with a warning. A checkpoint of another model, config or training data is an
error before training (:class:`CheckpointMismatch`), naming what differs and the folder
to remove. A state with NaN or Inf is never written. When the stage succeeds the folder
is removed.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from stages.common.fingerprint import short
from stages.common.io import atomic_write_bytes, atomic_write_json

from .config import ReconstructParams, migrate_config
from .guards import check_finite

log = logging.getLogger("stages.reconstruct.checkpoint")

CKPT_FORMAT = "rayforge-train-checkpoint-v2"
# v1 (before methods had several optimizers): one "optimizer" and one "scheduler", the NeRF's
OLD_FORMATS = ("rayforge-train-checkpoint-v1",)
REQUIRED_KEYS = ("format", "method", "config", "seed", "world_size", "step", "state", "optimizers", "rng")
KEEP = 2

# Params that may differ between a run and its resume without changing what is trained:
# operational knobs, and the ways of asking for a world size (the size itself is compared).
# Each method adds its own (kernel switches and the like: ``Method.OPERATIONAL_KEYS``).
OPERATIONAL_KEYS = frozenset({
    "eval_every",
    "tensorboard",
    "viewer_port",
    "distributed.gpus", "distributed.nodes", "distributed.cpu_workers",
    "distributed.rdzv_endpoint", "distributed.rdzv_timeout_s", "distributed.grad_sync",
    "distributed.checkpoint_every", "distributed.max_restarts", "distributed.replica_check_every",
    "distributed.metrics_port", "distributed.metrics_addr",
})

_NAME = re.compile(r"^step_(\d+)\.pt$")


class CorruptCheckpoint(Exception):
    """A checkpoint file that does not read back intact."""


class CheckpointMismatch(ValueError):
    """A readable checkpoint written by a run of another model or config."""


def default_dir(out_dir: str | Path) -> Path:
    """``<out>.ckpt`` beside the out folder: ``data/reconstruct`` -> ``data/reconstruct.ckpt``."""
    out = Path(out_dir)
    return out.with_name(out.name + ".ckpt")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: dict, current: dict, operational: frozenset[str] = frozenset()) -> list[str]:
    """``key: saved -> current`` for every params key that differs, except the operational ones
    (:data:`OPERATIONAL_KEYS` and ``operational``). A key the saved config lacks (it was written
    before the key existed) is no difference while the current value is the key's default: a new
    key's default is the behaviour from before it (e.g. ``nerf.grid_offset`` 0)."""
    a, b = _flatten(migrate_config(saved)), _flatten(migrate_config(current))
    defaults = _flatten(asdict(ReconstructParams()))
    skip = OPERATIONAL_KEYS | operational
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in skip:
            continue
        if key not in a and key in defaults and b.get(key) == defaults[key]:
            continue
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if isinstance(va, (list, tuple)) and isinstance(vb, (list, tuple)):
            va, vb = list(va), list(vb)
        if va != vb:
            diffs.append(f"reconstruct.{key}: {va!r} -> {vb!r}")
    return diffs


@dataclass
class Expectation:
    """What a checkpoint must match to be resumed by this run."""

    method: str
    config: dict
    seed: int
    world_size: int | None  # None: any (a partitioned run re-splits its shards)
    operational: frozenset[str] = frozenset()  # the method's OPERATIONAL_KEYS
    version: int | None = None  # the method's VERSION (None: not compared)
    data: dict | None = None  # {"fingerprint", "poses"} of this run's training data; None: not compared

    def check(self, blob: dict, path: Path, folder: Path) -> None:
        other_data = None
        if self.data is not None:
            saved = blob.get("data") or {}
            if saved.get("fingerprint") != self.data["fingerprint"]:
                other_data = (f"{saved.get('poses', 'unknown poses')} (data fingerprint "
                              f"{short(saved.get('fingerprint'))}), this run trains on {self.data['poses']} "
                              f"({short(self.data['fingerprint'])})")
        diffs = []
        if blob["method"] != self.method:
            diffs.append(f"method: {blob['method']!r} -> {self.method!r}")
        elif self.version is not None and blob.get("method_version", 1) != self.version:
            diffs.append(f"{self.method} version: {blob.get('method_version', 1)} -> {self.version}")
        if blob["seed"] != self.seed:
            diffs.append(f"seed: {blob['seed']!r} -> {self.seed!r}")
        if self.world_size is not None and blob["world_size"] != self.world_size:
            diffs.append(f"world size: {blob['world_size']} -> {self.world_size} processes")
        diffs += config_differences(blob["config"], self.config, self.operational)
        if diffs:
            also = f"; and it was trained on {other_data}" if other_data else ""
            raise CheckpointMismatch(
                f"checkpoint {path} was written by another model or config ({'; '.join(diffs)}){also}; "
                f"restore those params to resume it, or remove {folder} to start over")
        if other_data:
            raise CheckpointMismatch(
                f"checkpoint {path} was trained on other data: {other_data}; point the stage back at the poses it "
                f"was trained on to resume it, or remove {folder} to start over on these")


def _upgrade(blob: dict) -> dict:
    """A v1 checkpoint (the NeRF's one optimizer and scheduler) in the v2 layout."""
    blob = dict(blob)
    blob["optimizers"] = {"field": blob.pop("optimizer", None)}
    sched = blob.pop("scheduler", None)
    blob["schedulers"] = {"field": sched} if sched is not None else {}
    blob.setdefault("method_version", 1)
    blob["format"] = CKPT_FORMAT
    return blob


class CheckpointStore:
    """The checkpoint folder of one training run."""

    def __init__(self, folder: str | Path, keep: int = KEEP, data: dict | None = None):
        """``data``: ``{"fingerprint", "poses"}`` of the training data, stamped into every checkpoint
        saved and compared with every checkpoint resumed (None: neither)."""
        self.folder = Path(folder)
        self.keep = keep
        self.data = data

    def candidates(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file, newest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def save(self, blob: dict) -> Path:
        """Write ``blob`` as the checkpoint of ``blob['step']``; keep the newest ``keep``."""
        step = int(blob["step"])
        check_finite({"state": blob.get("state"), "optimizers": blob.get("optimizers")},
                     f"checkpoint of step {step}")
        if self.data is not None and "data" not in blob:
            blob = {**blob, "data": self.data}
        buf = io.BytesIO()
        torch.save(blob, buf)
        data = buf.getvalue()
        path = self.folder / f"step_{step:08d}.pt"
        atomic_write_bytes(path, data)  # what atomic_torch_save does, keeping the bytes to hash
        atomic_write_json(path.with_suffix(".json"), {
            "step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        for _, old in self.candidates()[self.keep:]:
            old.unlink(missing_ok=True)
            old.with_suffix(".json").unlink(missing_ok=True)
        return path

    def load(self, path: str | Path) -> dict:
        """Read one checkpoint, checking its digest and layout.

        Raises:
            CorruptCheckpoint: unreadable, truncated, digest mismatch, or not a checkpoint.
        """
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptCheckpoint(f"cannot read {path}: {exc}") from None
        side = path.with_suffix(".json")
        if side.is_file():  # absent when the writer died between the two renames: the .pt is whole
            try:
                meta = json.loads(side.read_text())
                want = meta["sha256"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CorruptCheckpoint(f"{side}: unreadable digest ({exc})") from None
            if hashlib.sha256(data).hexdigest() != want:
                raise CorruptCheckpoint(f"{path}: sha256 does not match {side.name}")
        try:
            blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a damaged zip or pickle
            raise CorruptCheckpoint(f"{path}: not a readable checkpoint ({type(exc).__name__}: {exc})") from None
        if isinstance(blob, dict) and blob.get("format") in OLD_FORMATS:
            blob = _upgrade(blob)
        if not isinstance(blob, dict) or blob.get("format") != CKPT_FORMAT:
            raise CorruptCheckpoint(f"{path}: not a {CKPT_FORMAT} file")
        missing = [k for k in REQUIRED_KEYS if k not in blob]
        if missing:
            raise CorruptCheckpoint(f"{path}: missing {', '.join(missing)}")
        return blob

    def load_latest(self, expect: Expectation | None = None) -> dict | None:
        """The newest intact checkpoint (checked against ``expect``), or None to start fresh.

        A corrupt newest checkpoint falls back to the previous one with a warning.

        Raises:
            CheckpointMismatch: the newest intact checkpoint belongs to another model/config.
        """
        if expect is not None and expect.data is None and self.data is not None:
            expect = replace(expect, data=self.data)
        found = self.candidates()
        for i, (step, path) in enumerate(found):
            try:
                blob = self.load(path)
            except CorruptCheckpoint as exc:
                nxt = f"falling back to step {found[i + 1][0]}" if i + 1 < len(found) else "no older one left"
                log.warning("checkpoint of step %d is corrupt (%s); %s", step, exc, nxt)
                continue
            if expect is not None:
                expect.check(blob, path, self.folder)
            blob["_path"] = str(path)
            return blob
        if found:
            log.warning("no intact checkpoint in %s: training starts from step 0", self.folder)
        return None

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
