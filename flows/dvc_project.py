"""What the flow needs to know about a DVC project, read from its own files.

The stage order comes from ``dvc.yaml`` (deps matched against outs), the knobs from
``params.yaml``. Overrides are written into ``params.yaml`` for the length of one run and
the file is restored byte for byte afterwards, so ``dvc repro`` sees the new values, reruns
exactly the stages that read them and records them in ``dvc.lock``; the flow never hands a
value to a stage's command itself. One run at a time per repository: :func:`repo_lock`.
"""
from __future__ import annotations

import contextlib
import difflib
import fcntl
import io
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Union

Scalar = Union[str, int, float, bool]

PARAMS_FILE = "params.yaml"
LOCK_FILE = Path(".dvc") / "tmp" / "rayforge-flow.lock"
BACKUP_FILE = Path(".dvc") / "tmp" / "rayforge-flow.params.yaml"
CRASHED_FILE = Path(".dvc") / "tmp" / "rayforge-flow.params.crashed.yaml"

_INTERPOLATION = re.compile(r"\$\{\s*([\w.-]+)\s*\}")


class OverrideError(ValueError):
    """An override whose key is not in params.yaml or whose value has the wrong type."""


def parse_yaml(text: str | bytes) -> Any:
    """YAML as DVC reads it (ruamel, YAML 1.2: ``1e-3`` is a number, ``on`` a string)."""
    from ruamel.yaml import YAML  # a dependency of dvc

    return YAML(typ="safe", pure=True).load(text)


def read_yaml(path: Path) -> Any:
    return parse_yaml(path.read_text(encoding="utf-8"))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of every leaf: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def load_params(repo: Path) -> dict[str, Any]:
    path = repo / PARAMS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no params file; the flow needs a DVC project with one")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of keys at the top")
    return data


# ---------------------------------------------------------------- stage order


def _paths(entries: Any) -> list[str]:
    """Paths of a deps/outs/metrics/plots list (strings or ``{path: options}``)."""
    out: list[str] = []
    for entry in entries or []:
        if isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, Mapping):
            out.extend(str(k) for k in entry)
    return out


def _norm(path: str, values: Mapping[str, Any]) -> str:
    path = _INTERPOLATION.sub(lambda m: str(values.get(m.group(1), m.group(0))), path)
    return os.path.normpath(path)


def _inside(a: str, b: str) -> bool:
    """True when path ``a`` is ``b`` or lies under it."""
    return a == b or a.startswith(b.rstrip("/") + "/")


def stage_order(repo: Path) -> list[str]:
    """Stage names of ``repo/dvc.yaml`` in an order that runs every stage after its deps.

    A stage depends on another when one of its deps is, contains or lies inside one of the
    other's outs (metrics and plots count as outs). Among stages that are ready the one
    written first in ``dvc.yaml`` goes first, so a file already in order keeps its order.

    Raises:
        FileNotFoundError: no ``dvc.yaml``.
        ValueError: no stages, or a cycle.
    """
    path = repo / "dvc.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a DVC project (no dvc.yaml)")
    stages = (read_yaml(path) or {}).get("stages") or {}
    if not stages:
        raise ValueError(f"{path}: no stages")
    try:
        values = flatten(load_params(repo))
    except FileNotFoundError:
        values = {}
    outs = {
        name: [_norm(p, values) for key in ("outs", "metrics", "plots") for p in _paths(spec.get(key))]
        for name, spec in stages.items()
    }
    needs: dict[str, set[str]] = {}
    for name, spec in stages.items():
        deps = [_norm(p, values) for p in _paths(spec.get("deps"))]
        needs[name] = {
            other
            for other, other_outs in outs.items()
            if other != name and any(_inside(d, o) or _inside(o, d) for d in deps for o in other_outs)
        }
    order: list[str] = []
    pending = list(stages)
    while pending:
        ready = next((s for s in pending if needs[s] <= set(order)), None)
        if ready is None:
            raise ValueError(f"{path}: the stages {', '.join(pending)} depend on each other in a cycle")
        order.append(ready)
        pending.remove(ready)
    return order


# ---------------------------------------------------------------- overrides


def _type_error(key: str, value: Any, current: Any) -> str | None:
    """Why ``value`` cannot replace ``current``, or None. Same rules as the stages' schemas:
    a bool is never taken for a number, an int is taken where a float is."""
    if current is None:
        return None
    if isinstance(current, bool):
        ok = isinstance(value, bool)
        want = "true or false"
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    elif isinstance(current, str):
        ok = isinstance(value, str)
        want = "a string"
    else:
        return f"{key}: is a {type(current).__name__} in {PARAMS_FILE}, not a single value; override its keys one by one"
    if ok:
        return None
    return f"{key}: expected {want} like the current value {current!r}, got {value!r}"


def check_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """Raise :class:`OverrideError` naming the first bad key: unknown, or a mismatched type.

    Only keys that exist in ``params.yaml`` can be overridden (a typo would otherwise be
    written as a new key that no stage reads, silently).
    """
    known = flatten(params)
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    for key, value in overrides.items():
        if key not in known:
            if key in sections:
                raise OverrideError(f"{key}: is a section of {PARAMS_FILE}, not a single value; override its keys one by one")
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise OverrideError(f"unknown params key {key!r}: not in {PARAMS_FILE}{hint}")
        problem = _type_error(key, value, known[key])
        if problem:
            raise OverrideError(problem)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _render_overrides(original: str, overrides: Mapping[str, Scalar]) -> str:
    """``original`` YAML text with ``overrides`` set, comments and order kept (ruamel)."""
    from ruamel.yaml import YAML  # a dependency of dvc

    rt = YAML()
    rt.preserve_quotes = True
    data = rt.load(original)
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    buf = io.StringIO()
    rt.dump(data, buf)
    return buf.getvalue()


def recover_params(repo: Path, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Put back params.yaml left overridden by a run that was killed before it could restore.

    The overridden file is kept beside the backup (``.dvc/tmp``) for a look. Call with the
    repository lock held, so no live run's backup is mistaken for a stale one.
    """
    backup = repo / BACKUP_FILE
    if not backup.exists():
        return
    params = repo / PARAMS_FILE
    if params.exists():
        os.replace(params, repo / CRASHED_FILE)
    os.replace(backup, params)
    logger.warning(
        "%s was left overridden by a run that did not finish; restored it (the overridden copy is in %s)",
        params, repo / CRASHED_FILE,
    )


@contextlib.contextmanager
def overridden_params(repo: Path, overrides: Mapping[str, Scalar]) -> Iterator[None]:
    """Write ``overrides`` into ``repo/params.yaml`` for the body, then restore it exactly.

    A copy of the original is kept in ``.dvc/tmp`` until it is restored, so a run killed
    with SIGKILL is repaired by the next one (:func:`recover_params`). Overrides equal to
    the current value are not written, and with none left the file is not touched.
    """
    path = repo / PARAMS_FILE
    original = path.read_bytes()
    current = flatten(parse_yaml(original) or {})
    changes = {k: v for k, v in overrides.items() if not (k in current and current[k] == v and type(current[k]) is type(v))}
    if not changes:
        yield
        return
    backup = repo / BACKUP_FILE
    backup.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(backup, original)
    try:
        _write_atomic(path, _render_overrides(original.decode("utf-8"), changes).encode("utf-8"))
        yield
    finally:
        _write_atomic(path, original)
        backup.unlink(missing_ok=True)


@contextlib.contextmanager
def repo_lock(repo: Path, logger: logging.Logger | logging.LoggerAdapter, poll_s: float = 2.0) -> Iterator[None]:
    """Hold an exclusive lock on ``repo`` for one pipeline run (waits for the holder).

    Two runs in one checkout would overwrite each other's params.yaml and outs; DVC's own
    lock covers one ``dvc`` command, not the gap between two stages.
    """
    path = repo / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    logger.info("another pipeline run holds %s; waiting for it to finish", path)
                    waited = True
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
