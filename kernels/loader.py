"""Compile CUDA C++ with NVRTC straight to a CUBIN, cached on disk. Needs no GPU and no driver.

This half of the runtime only turns a ``kernels/csrc/*.cu`` file into machine code for a named
architecture: it runs on a CPU-only machine (CI compiles every kernel for sm_80 and sm_90 this way).
Loading the code onto a device and launching it is :mod:`kernels._driver`'s job.

The cache key is a SHA-256 over everything that changes the machine code: the source, every project
header it includes (followed recursively, whatever preprocessor branch the include sits in), the
architecture, the options, the defines, the template instances asked for (name expressions), the NVRTC
version and the CUDA header folder. The cache folder is ``$RAYFORGE_KERNEL_CACHE`` or
``~/.cache/rayforge/kernels``; every write is a temporary file renamed into place, so concurrent
processes never read half a file.

Example:
    >>> from kernels import loader
    >>> prog = loader.compile_source(loader.CSRC_DIR / "hashgrid.cu", "sm_90",
    ...                              name_expressions=["hash_encode_fwd<float, 2, 4>"])
    >>> prog.image_kind, prog.lowered_names["hash_encode_fwd<float, 2, 4>"]
    ('cubin', '_Z15hash_encode_fwdIfLi2ELi4EEvPKfPKT_PKiPfjjj')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
CACHE_ENV = "RAYFORGE_KERNEL_CACHE"
DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17",)
# Bumped when the cache's layout or the meaning of a key changes.
_CACHE_FORMAT = 1
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class KernelCompileError(RuntimeError):
    """NVRTC rejected a source; ``log`` holds NVRTC's log (``file(line): error: ...``)."""

    def __init__(self, source: str, arch: str, log: str):
        self.source, self.arch, self.log = source, arch, log
        super().__init__(f"NVRTC failed to compile {source} for {arch}:\n{log.strip()}")


@dataclasses.dataclass
class CompileStats:
    """Counts NVRTC invocations in this process (tests check that a cache hit compiles nothing)."""

    nvrtc_compiles: int = 0
    cache_hits: int = 0


stats = CompileStats()
_stats_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """Machine code for one source and one architecture.

    Attributes:
        source: path of the ``.cu`` file.
        arch: ``"sm_90"`` style target (the CUBIN runs on that major version, minor >= this one).
        image: the CUBIN (or NUL-terminated PTX when NVRTC does not know the device's arch).
        image_kind: ``"cubin"`` or ``"ptx"``.
        lowered_names: name expression (``"f<float, 2>"``) -> mangled symbol for ``cuModuleGetFunction``.
        key: the cache key.
        from_cache: True when read from disk rather than compiled now.
        log: NVRTC's log (warnings), empty on a cache hit.
    """

    source: str
    arch: str
    image: bytes
    image_kind: str
    lowered_names: dict[str, str]
    key: str
    from_cache: bool
    log: str = ""


def default_cache_dir() -> Path:
    """``$RAYFORGE_KERNEL_CACHE`` if set, else ``~/.cache/rayforge/kernels`` (read at each call)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rayforge" / "kernels"


def normalize_arch(arch: str | int | tuple[int, int]) -> str:
    """``"sm_90"``, ``"90"``, ``90``, ``(9, 0)`` or ``"compute_90"`` -> ``"sm_90"``."""
    if isinstance(arch, tuple):
        if len(arch) != 2:
            raise ValueError(f"arch tuple must be (major, minor), got {arch!r}")
        return f"sm_{int(arch[0])}{int(arch[1])}"
    text = str(arch).strip().lower()
    for prefix in ("sm_", "compute_"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    if not re.fullmatch(r"\d{2,3}[af]?", text):
        raise ValueError(f"arch must look like 'sm_90' or (9, 0), got {arch!r}")
    return f"sm_{text}"


def _nvrtc():
    from cuda.bindings import nvrtc  # imported here: `import kernels` must not need it

    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); raises if the library cannot be loaded."""
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return int(major), int(minor)


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """Architectures this NVRTC can emit a CUBIN for, as integers (``90`` for sm_90)."""
    nvrtc = _nvrtc()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check_nvrtc(err, "nvrtcGetSupportedArchs")
    return tuple(int(a) for a in archs)


@functools.cache
def cuda_include_dir() -> str | None:
    """The folder holding ``cuda_fp16.h``: the nvidia-cuda-runtime wheel's, found with cuda.pathfinder.

    Falls back to ``nvidia/cu13/include`` (or ``cu12``) in site-packages, then ``$CUDA_HOME/include``
    or ``$CUDA_PATH/include``. None when no folder holds ``cuda_fp16.h``.
    """
    candidates: list[str] = []
    try:
        import cuda.pathfinder as pathfinder

        find = getattr(pathfinder, "find_nvidia_header_directory", None)
        if find is not None:
            found = find("cudart")
            if found:
                candidates.append(found)
    except (ImportError, RuntimeError, OSError):
        pass  # older cuda-pathfinder without header lookup, or no wheel: try the paths below
    for site in sys.path:
        for cu in ("cu13", "cu12"):
            candidates.append(os.path.join(site, "nvidia", cu, "include"))
        candidates.append(os.path.join(site, "nvidia", "cuda_runtime", "include"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for cand in candidates:
        if cand and os.path.isfile(os.path.join(cand, "cuda_fp16.h")):
            return os.path.abspath(cand)
    return None


def _check_nvrtc(err, what: str) -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise RuntimeError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")


def _resolve_headers(source: Path, include_dirs: Sequence[Path]) -> list[Path]:
    """Project headers that ``source`` includes, recursively, in first-seen order.

    Every ``#include`` is followed whatever preprocessor branch it is in (a superset is safe for a
    cache key). Quoted includes are looked up beside the including file first, then in
    ``include_dirs``; angle includes only in ``include_dirs``. Anything not found there is a CUDA
    header, covered by the NVRTC version in the key.
    """
    seen: dict[Path, None] = {}
    stack = [source]
    while stack:
        current = stack.pop()
        text = current.read_text(encoding="utf-8", errors="replace")
        for kind, name in _INCLUDE_RE.findall(text):
            dirs = ([current.parent] if kind == '"' else []) + list(include_dirs)
            for d in dirs:
                cand = (d / name).resolve()
                if cand.is_file():
                    if cand not in seen and cand != source:
                        seen[cand] = None
                        stack.append(cand)
                    break
    return list(seen)


def _build_options(arch: str, kind: str, defines: Mapping[str, object], options: Sequence[str],
                   include_dirs: Sequence[Path], cuda_inc: str | None) -> list[str]:
    target = arch if kind == "cubin" else arch.replace("sm_", "compute_")
    opts = [f"--gpu-architecture={target}", *DEFAULT_OPTIONS, *options]
    for name, value in sorted(defines.items()):
        if not _IDENT_RE.match(name):
            raise ValueError(f"define name must be a C identifier, got {name!r}")
        opts.append(f"-D{name}" if value is None else f"-D{name}={value}")
    opts += [f"-I{d}" for d in include_dirs]
    if cuda_inc:
        opts.append(f"-I{cuda_inc}")
    return opts


def _pick_target(arch: str) -> tuple[str, str]:
    """(arch, kind): a CUBIN when NVRTC knows the arch, else PTX for the newest arch it knows below it.

    PTX is JIT-compiled by the driver at load; it lets a GPU newer than this NVRTC still run.
    """
    num = int(re.sub(r"\D", "", arch))
    known = supported_archs()
    if num in known:
        return arch, "cubin"
    older = [a for a in known if a <= num]
    if not older:
        raise ValueError(f"NVRTC {nvrtc_version()} cannot target {arch} (supports {known})")
    return f"sm_{max(older)}", "ptx"


def cache_key(source: Path, arch: str, kind: str, options: Sequence[str],
              name_expressions: Sequence[str], include_dirs: Sequence[Path]) -> str:
    """SHA-256 over source, project headers, arch, options (defines included), names and NVRTC."""
    h = hashlib.sha256()

    def feed(tag: str, data: bytes) -> None:
        h.update(tag.encode() + len(data).to_bytes(8, "little") + data)

    feed("format", str(_CACHE_FORMAT).encode())
    feed("nvrtc", repr(nvrtc_version()).encode())
    feed("source", source.read_bytes())
    for header in _resolve_headers(source, include_dirs):
        feed("header-name", header.name.encode())
        feed("header", header.read_bytes())
    feed("arch", f"{arch}:{kind}".encode())
    # Include folders are machine-specific paths; the headers' contents are hashed above instead.
    for opt in options:
        if not opt.startswith("-I"):
            feed("option", opt.encode())
    feed("cuda-include", str(cuda_include_dir()).encode())
    for expr in sorted(name_expressions):
        feed("name", expr.encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_cache(stem: Path, key: str) -> tuple[bytes, dict] | None:
    meta_path, image_path = stem.with_suffix(".json"), stem.with_suffix(".bin")
    try:
        meta = json.loads(meta_path.read_text())
        image = image_path.read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or meta.get("sha256") != hashlib.sha256(image).hexdigest():
        return None  # stale or torn: compile again and overwrite
    return image, meta


def _write_cache(stem: Path, image: bytes, meta: dict) -> None:
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        # Image first, metadata second: a reader that finds the metadata finds its image too.
        _atomic_write(stem.with_suffix(".bin"), image)
        _atomic_write(stem.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    except OSError as exc:
        warnings.warn(f"kernel cache {stem.parent} is not writable ({exc}); compiling every run",
                      RuntimeWarning, stacklevel=3)


def _run_nvrtc(source: Path, arch: str, kind: str, opts: Sequence[str],
               name_expressions: Sequence[str]) -> tuple[bytes, dict[str, str], str]:
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.read_bytes(), str(source).encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            _check_nvrtc(err, f"nvrtcAddNameExpression({expr!r})")
        encoded = [o.encode() for o in opts]
        with _stats_lock:
            stats.nvrtc_compiles += 1
        (compile_err,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check_nvrtc(err, "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer: it must be a fresh mutable one. ``b" " * size`` is not: for a
        # size of 0 or 1 it is CPython's shared empty / one-byte object, and writing the log's NUL
        # into it corrupted every b" " of the process (torch.save's zip records among them).
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\x00").decode(errors="replace")
        if compile_err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(str(source), arch, log)
        if kind == "cubin":
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _check_nvrtc(err, "nvrtcGetCUBINSize")
            image = bytearray(size)
            (err,) = nvrtc.nvrtcGetCUBIN(prog, image)
            _check_nvrtc(err, "nvrtcGetCUBIN")
        else:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            _check_nvrtc(err, "nvrtcGetPTXSize")
            image = bytearray(size)
            (err,) = nvrtc.nvrtcGetPTX(prog, image)  # NUL-terminated, as cuModuleLoadData wants
            _check_nvrtc(err, "nvrtcGetPTX")
        lowered = {}
        for expr in name_expressions:
            err, name = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check_nvrtc(err, f"nvrtcGetLoweredName({expr!r})")
            lowered[expr] = name.decode() if isinstance(name, bytes) else str(name)
        return bytes(image), lowered, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_source(
    source: str | os.PathLike,
    arch: str | int | tuple[int, int],
    *,
    name_expressions: Sequence[str] = (),
    defines: Mapping[str, object] | None = None,
    options: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike] = (),
    cache_dir: str | os.PathLike | None | bool = None,
) -> CompiledProgram:
    """Compile one ``.cu`` file for ``arch`` with NVRTC, or read it from the disk cache.

    Needs no GPU and no driver, only the NVRTC library and the CUDA headers.

    Args:
        source: path of the ``.cu`` file.
        arch: target, e.g. ``"sm_90"`` or ``(9, 0)``.
        name_expressions: template instances / functions to keep, e.g. ``"f<float, 2>"``; their
            mangled names come back in ``lowered_names``.
        defines: ``{"NAME": value}`` -> ``-DNAME=value`` (``None`` -> ``-DNAME``).
        options: extra NVRTC options (``-lineinfo``, ``--use_fast_math``; NVRTC rejects ``-O3``).
        include_dirs: extra project include folders; the source's folder is always searched.
        cache_dir: folder for the cache; None -> :func:`default_cache_dir`, False -> no cache.

    Returns:
        The :class:`CompiledProgram`.

    Raises:
        KernelCompileError: NVRTC failed; the message carries NVRTC's log with file and line.
        FileNotFoundError: ``source`` does not exist.
    """
    src = Path(source).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"kernel source {src} does not exist")
    arch = normalize_arch(arch)
    target_arch, kind = _pick_target(arch)
    incs = [src.parent, *(Path(d).resolve() for d in include_dirs)]
    opts = _build_options(target_arch, kind, dict(defines or {}), list(options), incs,
                          cuda_include_dir())
    names = list(dict.fromkeys(name_expressions))
    key = cache_key(src, target_arch, kind, opts, names, incs)
    stem = None
    if cache_dir is not False:
        folder = default_cache_dir() if cache_dir in (None, True) else Path(cache_dir)
        stem = folder / f"{src.stem}-{target_arch}-{key[:24]}"
        hit = _read_cache(stem, key)
        if hit is not None:
            image, meta = hit
            with _stats_lock:
                stats.cache_hits += 1
            return CompiledProgram(str(src), target_arch, image, meta["kind"],
                                   dict(meta["lowered_names"]), key, True)
    image, lowered, log = _run_nvrtc(src, target_arch, kind, opts, names)
    if stem is not None:
        meta = {"key": key, "source": str(src), "arch": target_arch, "kind": kind,
                "nvrtc": list(nvrtc_version()), "options": [o for o in opts if not o.startswith("-I")],
                "lowered_names": lowered, "sha256": hashlib.sha256(image).hexdigest()}
        _write_cache(stem, image, meta)
    return CompiledProgram(str(src), target_arch, image, kind, lowered, key, False, log)
