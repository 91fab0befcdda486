"""How every stage's command ends: an exit status and one line a person can act on, no traceback.

:func:`run_stage` runs a stage's body and turns what a user can act on into one line on stderr:

* a ``ValueError`` (bad input or params, an out that would destroy an input, another model's
  checkpoint, ...) -> ``<stage>: error: <message>``, exit 1;
* a full disk (``OSError`` ENOSPC / EDQUOT) -> the file being written and the disk it is on (mount
  point, free and total space), exit 1;
* another process writing the same out (:class:`~stages.common.io.OutBusy`) -> its pid, exit 1;
* out of GPU memory -> the params to lower (``oom_advice``), exit 1;
* Ctrl-C (SIGINT) or SIGTERM -> ``<stage>: interrupted...`` (``interrupted`` may say where and
  how to resume), exit 130 / 143. Temporaries are removed on the way out (``atomic_dir``), and
  no out is left half-written, so a rerun starts clean.

:func:`cli` is every stage's ``if __name__ == "__main__":``: it ties the process to its parent
(:mod:`stages.common.process`: killing ``dvc repro`` stops the stage too), turns SIGTERM into the
same clean stop as Ctrl-C, and exits with the status ``main()`` returns.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

from .io import FULL_DISK, OutBusy
from .process import die_with_parent


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum: int, _frame) -> None:
    raise Interrupted(signum)


def say(line: str) -> None:
    """One line on stderr; a closed stderr (the terminal is gone) is not an error."""
    try:
        if sys.stderr.isatty():
            sys.stderr.write("\n")  # past a progress bar's unfinished line
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem ``path`` is (or would be) on."""
    p = Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    p = p.resolve()
    while not os.path.ismount(p):
        p = p.parent
    return p


def _fs_type(mount: Path) -> str | None:
    """The filesystem type of ``mount`` from /proc/mounts (the last mount there wins), or None."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    found = [f[2] for f in (ln.split() for ln in lines) if len(f) > 2 and f[1] == str(mount)]
    return found[-1] if found else None


def disk_full_message(exc: OSError) -> str:
    """What a full disk stopped, and which disk: ``no space left on the disk mounted at ...``."""
    path = exc.filename or "an out"
    try:
        mount = mount_point(path if exc.filename else os.getcwd())
        usage = shutil.disk_usage(mount)
        fs = _fs_type(mount)
        disk = (f"the disk mounted at {mount}{f' ({fs})' if fs else ''}: {_human(usage.free)} free of "
                f"{_human(usage.total)}")
    except OSError:
        disk = "its disk"
    what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "no space left"
    return (f"{what} on {disk}, while writing {path}; nothing half-written is left and earlier checkpoints are "
            "kept: free space there (or write the outs to another disk) and rerun")


OOM_MARKERS = ("CUDA out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "CUBLAS_STATUS_ALLOC_FAILED",
               "DefaultCPUAllocator: can't allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """A GPU (``torch.OutOfMemoryError``, a CUDA/cuBLAS allocation error) or CPU allocation failure."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in OOM_MARKERS)


def out_of_memory_message(exc: BaseException, advice: str | None) -> str:
    """``out of GPU memory (<what PyTorch said, shortened>); <advice>`` (``out of memory`` on the CPU)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    where = "memory" if "CPUAllocator" in text else "GPU memory"
    text = text[text.index("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in text else text
    short = text if len(text) <= 160 else text[:157] + "..."
    return f"out of {where} ({short})" + (f"; {advice}" if advice else "")


def run_stage(stage: str, body: Callable[[], int | None], *, interrupted: Callable[[], str] | None = None,
              oom_advice: Callable[[], str | None] | None = None, quiet_interrupt: bool = False,
              reraise: tuple[type[BaseException], ...] = ()) -> int:
    """Run ``body`` (a stage's work) and return its exit status; see the module docstring.

    Args:
        stage: the stage's name, the first word of every line said.
        body: the work; its return value (None = 0) is the exit status.
        interrupted: the rest of the interrupt line after ``<stage>: interrupted`` (where the
            stage was, how a rerun goes on), or None for the plain line.
        oom_advice: which params to lower when the GPU runs out of memory.
        quiet_interrupt: say nothing when interrupted (a worker whose group's rank 0 speaks).
        reraise: exceptions to let through (a torchrun worker's errors, which torchrun reports).
    """
    try:
        rc = body()
        return 0 if rc is None else rc
    except reraise:
        raise
    except KeyboardInterrupt as exc:
        rest = "; no out was left half-written, rerun the stage to start again"
        if interrupted is not None:
            try:
                rest = interrupted()
            except Exception:  # noqa: BLE001 - the plain line is better than a traceback here
                pass
        if not quiet_interrupt:
            say(f"{stage}: interrupted{rest}")
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except OutBusy as exc:
        say(f"{stage}: error: {exc}")
        return 1
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        say(f"{stage}: error: {disk_full_message(exc)}")
        return 1
    except ValueError as exc:
        say(f"{stage}: error: {exc}")
        return 1
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        say(f"{stage}: error: {out_of_memory_message(exc, oom_advice() if oom_advice else None)}")
        return 1


def cli(main: Callable[[], int]) -> None:
    """``if __name__ == "__main__": cli(main)``: see the module docstring."""
    die_with_parent()
    signal.signal(signal.SIGTERM, _raise_interrupted)
    rc = main()
    # The work is over and its status decided: a second Ctrl-C (the terminal's and a launcher's
    # forwarded copy of the first) landing while the interpreter shuts down must not turn exit 130
    # into a death by SIGINT, which DVC and shells report as another failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(rc)
