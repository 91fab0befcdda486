"""Outs that are complete or absent, that never destroy an input, and that one writer at a time owns.

* Atomic writes: a file is written to a temporary sibling and renamed into place; a folder of
  outs is built in a temporary sibling folder and swapped in when the stage succeeds, so a
  failed or interrupted stage never leaves files that look complete. Temporaries are named
  ``.<name>.tmp-<host>-<pid>-<random>``; those of a process that is gone (killed outright, so
  nothing could clean up) are removed the next time the same out is written.
* Inputs are never destroyed: :func:`check_outs`, called at the start of every stage, refuses an
  out that is an input, holds one (a folder above it) or sits inside one, and an out that is the
  working directory or a folder above it. It remembers the stage's inputs, and :func:`atomic_dir`
  and :func:`remove` check every path they replace against them too.
* One writer: :class:`OutLock` holds ``<out>.lock`` (``fcntl.flock``) while a stage writes an out;
  a second writer fails at once, naming the holder's pid. :func:`atomic_dir` takes it, and the
  reconstruct stage holds it for the whole training run.
* A full disk is an ``OSError`` (ENOSPC) that names the file being written.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator, Mapping

from .process import pid_alive

log = logging.getLogger("stages.io")

HOST = socket.gethostname().split(".")[0].replace("-", "_") or "host"
# Lock files this process's ancestors hold for it (torchrun workers of a launcher that locked the out).
HELD_ENV = "RAYFORGE_HELD_LOCKS"
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)

PathLike = str | os.PathLike


class OverlapError(ValueError):
    """An out path that would replace (and so delete) an input."""


class OutBusy(RuntimeError):
    """An out that another process is writing."""


def read_json(path: PathLike) -> Any:
    """Parse a JSON file; an unreadable or malformed file is a ValueError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None


# ---------------------------------------------------------------- inputs and outs


def _real(path: PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path))).resolve()


_inputs: dict[str, Path] = {}  # the running stage's inputs (check_outs), by the name the user knows them by


def _relation(out: Path, other: Path) -> str | None:
    if out == other:
        return "is"
    if out in other.parents:
        return "holds"
    if other in out.parents:
        return "is inside"
    return None


def _protected() -> list[tuple[str, Path]]:
    cwd = _real(os.getcwd())
    return [("the working directory", cwd), ("your home folder", _real(Path.home()))]


def _guard(out: Path, inputs: Mapping[str, Path], what: str) -> None:
    for label, place in _protected():
        if out == place or out in place.parents:
            raise OverlapError(f"{what} {out} is {label} or a folder above it; a stage replaces its outs "
                               "as a whole, so this would delete it: choose an out folder inside the project")
    for name, inp in inputs.items():
        rel = _relation(out, inp)
        if rel is None:
            continue
        why = {"is": "", "holds": " (a folder above it)", "is inside": ""}[rel]
        raise OverlapError(f"{what} {out} {rel} the input {name} {inp}{why}; a stage replaces its outs as a "
                           f"whole, so this would delete input data: choose an out apart from {inp} (not it, not a "
                           "folder above it, not inside it)")


def check_outs(inputs: Mapping[str, PathLike | None], outs: Mapping[str, PathLike | None]) -> None:
    """Refuse outs that would destroy an input; remember the inputs for :func:`atomic_dir` and :func:`remove`.

    Args:
        inputs: what the stage reads, by the name the user gave it (``{"--photos": path}``);
            None entries are skipped.
        outs: what the stage replaces, the same way.

    Raises:
        OverlapError: an out is an input, a folder above one or inside one (files and folders
            alike, after following symlinks), or the working directory / home folder or above.
    """
    ins = {k: _real(v) for k, v in inputs.items() if v is not None and str(v) != ""}
    _inputs.clear()
    _inputs.update(ins)
    for name, path in outs.items():
        if path is not None and str(path) != "":
            _guard(_real(path), ins, name)


def remove(path: PathLike) -> None:
    """Delete a file or folder of outs (a symlink itself, not its target); refuses inputs (see above)."""
    path = Path(path)
    _guard(_real(path.parent) / path.name, _inputs, "out")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_outs(outs: Mapping[str, PathLike | None]) -> None:
    """Remove a stage's previous outs before it runs, as ``dvc repro`` does (no ``persist``), so a
    failed run leaves none that look complete. Call after :func:`check_outs`."""
    for path in outs.values():
        if path is not None and str(path) != "":
            remove(path)


# ---------------------------------------------------------------- temporaries


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-{HOST}-"


def _tmp_path(path: Path) -> Path:
    return path.with_name(f"{_tmp_prefix(path)}{os.getpid()}-{secrets.token_hex(4)}")


def clean_stale_temporaries(path: PathLike) -> list[Path]:
    """Remove the temporaries of ``path`` left by processes of this host that are gone; returns them."""
    path = Path(path)
    prefix = _tmp_prefix(path)
    gone = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path.parent):
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                p = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                gone.append(p)
    if gone:
        log.info("removed %d temporary file(s) left by a killed run: %s", len(gone), ", ".join(map(str, gone)))
    return gone


def _name_the_file(exc: OSError, path: Path) -> OSError:
    """A full-disk error with the file it was writing (``write()`` raises it without one)."""
    if exc.errno in FULL_DISK and not exc.filename:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _name_the_file(exc, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_torch_save(path: PathLike, obj: Any) -> None:
    """``torch.save`` through a temporary file and a rename."""
    import io as _io

    import torch

    buf = _io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def torch_save(obj: Any, path: PathLike) -> None:
    """``torch.save(obj, path)`` (a file inside an :func:`atomic_dir` folder), with a full disk raised
    as ``OSError(ENOSPC)`` naming the file: PyTorch's zip writer reports it as a RuntimeError about
    positions or a failed write. (Saving to a path, not through memory, keeps the archive's inner
    folder named after the file, so the bytes are those ``torch.save(obj, path)`` always wrote.)"""
    import io as _io

    import torch

    path = Path(path)
    try:
        torch.save(obj, path)
    except RuntimeError:
        need = _io.BytesIO()
        torch.save(obj, need)
        written = path.stat().st_size if path.exists() else 0
        if shutil.disk_usage(path.parent).free < need.tell() - written + (64 << 10):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise


# ---------------------------------------------------------------- one writer


_held: dict[Path, "OutLock"] = {}


def _held_by_ancestor(lockfile: Path) -> bool:
    return str(lockfile) in os.environ.get(HELD_ENV, "").split(os.pathsep)


class OutLock:
    """An exclusive lock on an out (``<out>.lock`` beside it), re-entrant within a process.

    Children started while it is held inherit the right to write the out (``RAYFORGE_HELD_LOCKS``):
    torchrun's workers write what their launcher locked. ``fds`` is what to pass on to a child
    (``Popen(pass_fds=...)``) that should keep the out locked after this process dies.
    """

    def __init__(self, out: PathLike):
        self.out = Path(out)
        self.lockfile = _real(self.out.parent) / f"{self.out.name}.lock"
        self.fd: int | None = None
        self.depth = 0
        self.inherited = False
        self._owner: OutLock | None = None  # this process's earlier lock of the same out

    @property
    def fds(self) -> tuple[int, ...]:
        if self._owner is not None:
            return self._owner.fds
        return () if self.fd is None else (self.fd,)

    def acquire(self) -> "OutLock":
        owner = _held.get(self.lockfile)
        if owner is not None and owner is not self:
            self._owner = owner.acquire()
            return self
        self.depth += 1
        if self.depth > 1:
            return self
        if _held_by_ancestor(self.lockfile):
            self.inherited = True
            _held[self.lockfile] = self
            return self
        self.lockfile.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lockfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                self.depth -= 1
                raise OutBusy(f"{self.out} is being written by {holder} (lock {self.lockfile}); wait for that run "
                              "to end or stop it, then rerun") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lockfile).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a lock file its previous holder removed while we opened it
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        _held[self.lockfile] = self
        os.environ[HELD_ENV] = os.pathsep.join(
            [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p] + [str(self.lockfile)])
        return self

    def release(self) -> None:
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner.release()
            return
        self.depth -= 1
        if self.depth > 0:
            return
        _held.pop(self.lockfile, None)
        if self.inherited:
            return
        held = [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p and p != str(self.lockfile)]
        if held:
            os.environ[HELD_ENV] = os.pathsep.join(held)
        else:
            os.environ.pop(HELD_ENV, None)
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lockfile)  # while still locked: the next writer makes a fresh one
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------- folders of outs


@contextlib.contextmanager
def atomic_dir(path: PathLike, inputs: Mapping[str, PathLike | None] | None = None) -> Iterator[Path]:
    """Build a folder of outs in a temporary sibling; swap it in only on success.

    Any previous content of ``path`` is removed first, so a failure leaves no outs
    at all (DVC then sees the stage as not run), never a stale or partial folder. The
    folder is locked (:class:`OutLock`) while it is built.

    Raises:
        OverlapError: ``path`` would destroy one of ``inputs`` or of the running stage's
            inputs (:func:`check_outs`).
        OutBusy: another process is writing ``path``.
    """
    path = Path(path)
    real = _real(path.parent) / path.name
    _guard(real, _inputs, "out")
    if inputs:
        _guard(real, {k: _real(v) for k, v in inputs.items() if v is not None and str(v) != ""}, "out")
    path.parent.mkdir(parents=True, exist_ok=True)
    with OutLock(path):
        clean_stale_temporaries(path)
        remove(path)
        tmp = _tmp_path(path)
        tmp.mkdir()
        try:
            yield tmp
            os.replace(tmp, path)
        except OSError as exc:  # a full disk while the outs were written: say which out
            shutil.rmtree(tmp, ignore_errors=True)
            raise _name_the_file(exc, path) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
