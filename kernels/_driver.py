"""Load compiled kernels onto a GPU and launch them on PyTorch's current stream (CUDA driver API).

Nothing here runs at import: the driver is initialised on the first launch, so ``import kernels``
works on a machine without a GPU, a driver or a toolkit. :func:`available` is the one question to ask
before dispatching to a kernel.

Contexts: PyTorch works in each device's *primary* context, but only makes it current on threads that
went through its runtime calls; ``cuModuleLoadData`` then fails with CUDA_ERROR_INVALID_CONTEXT (seen
on an H200). So around every load and launch we make that device's primary context (retained once
per process) current on the calling thread, and put the previous one back (:func:`device_context`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from . import loader

DISABLE_ENV = "RAYFORGE_DISABLE_KERNELS"

# Python value and its C type for one kernel argument, as cuLaunchKernel's tuple form takes them.
KernelArg = tuple[int | float, type]
ptr = ctypes.c_void_p
u32 = ctypes.c_uint32
i32 = ctypes.c_int32
f32 = ctypes.c_float
i64 = ctypes.c_int64


# struct codes of the argument types the packed launch handles; each argument takes an 8-byte slot
_PACK_CODES = {ptr: "Q", u32: "I", i32: "i", f32: "f", i64: "q", ctypes.c_uint64: "Q", ctypes.c_double: "d"}


class ArgPacker:
    """Kernel arguments of one signature packed into a reused buffer, for cuLaunchKernel's void**.

    cuda-python packs a ``(values, types)`` tuple anew on every launch (9.0 of the 16.5 us a
    20-argument launch took on an H200; with the arguments packed beforehand the driver call took
    4.3 us, ``benchmarks/bench_launch.py``). Here the slots (8 bytes each, little-endian, a 4-byte
    value in the first half) and the array of pointers to them are made once per signature; a
    launch writes the values with one ``struct.pack_into`` and passes the array's address. The
    driver copies the arguments before cuLaunchKernel returns (a CUDA graph capture too), so the
    buffer can be reused at once; it must not be shared between threads (see :func:`packed_args`).
    """

    __slots__ = ("layout", "slots", "pointers", "address")

    def __init__(self, types: Sequence[type]):
        self.layout = struct.Struct("<" + "".join(_PACK_CODES[t] + ("4x" if ctypes.sizeof(t) == 4 else "")
                                                  for t in types))
        n = max(len(types), 1)
        self.slots = ctypes.create_string_buffer(8 * n)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.address = ctypes.addressof(self.pointers)

    def pack(self, values: Sequence[int | float]) -> int:
        """Write ``values`` into the slots; the void** address for cuLaunchKernel."""
        self.layout.pack_into(self.slots, 0, *values)
        return self.address


_packers = threading.local()


def packed_args(args: Sequence[KernelArg]):
    """cuLaunchKernel's kernelParams for ``args``: the address of this thread's packed buffer for
    their signature, or cuda-python's ``(values, types)`` tuple where packing does not apply (a type
    without a struct code, a value out of its type's range or None: the tuple form casts those
    as ctypes does, so the launch behaves as before)."""
    if not args:
        return 0
    values, types = zip(*args)
    cache = getattr(_packers, "by_types", None)
    if cache is None:
        cache = _packers.by_types = {}
    packer = cache.get(types)
    if packer is None:
        if not all(t in _PACK_CODES for t in types):
            return values, types
        packer = cache[types] = ArgPacker(types)
    try:
        return packer.pack(values)
    except (struct.error, OverflowError):  # OverflowError: a float past float32's range
        return values, types


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


_driver_module = None


def _driver():
    global _driver_module
    if _driver_module is None:
        from cuda.bindings import driver  # imported here: `import kernels` must not need it

        _driver_module = driver
    return _driver_module


def _check(result, what: str):
    """Unpack a cuda-python result tuple, raising CudaDriverError on a CUresult other than success."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise CudaDriverError(f"{what} failed: {name} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def _init_driver() -> None:
    """cuInit once; raises when there is no driver (DynamicLibNotFoundError/RuntimeError/OSError)."""
    _check(_driver().cuInit(0), "cuInit")


def _probe() -> tuple[bool, str]:
    """(can kernels run here, why not). Uncached; :func:`available` caches it."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False, f"{DISABLE_ENV} is set"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    try:
        _init_driver()
        loader.nvrtc_version()
    # cuda.pathfinder raises DynamicLibNotFoundError (a RuntimeError) when libcuda or libnvrtc is
    # missing; older cuda-bindings raise RuntimeError("Failed to dlopen ...") or OSError.
    except (ImportError, OSError, RuntimeError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    if loader.cuda_include_dir() is None:
        return False, "CUDA headers (cuda_fp16.h) not found: install nvidia-cuda-runtime"
    return True, ""


@functools.cache
def _probe_cached() -> tuple[bool, str]:
    return _probe()


def available() -> bool:
    """True when CUDA kernels can run: a GPU PyTorch sees, a driver, NVRTC and the CUDA headers."""
    return _probe_cached()[0]


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return _probe_cached()[1]


_ctx_lock = threading.Lock()
_primary_contexts: dict[int, object] = {}


def _primary_context(device_index: int):
    """``device_index``'s primary context (the one PyTorch uses), retained once per process."""
    ctx = _primary_contexts.get(device_index)
    if ctx is None:
        _init_driver()
        with _ctx_lock:
            ctx = _primary_contexts.get(device_index)
            if ctx is None:
                driver = _driver()
                dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
                ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _primary_contexts[device_index] = ctx
    return ctx


@contextlib.contextmanager
def device_context(device_index: int):
    """Make ``device_index``'s primary context current on this thread for the block.

    The previous context is put back afterwards when it differs (a fresh thread has none; another
    device's when PyTorch works on several): the runtime API infers the current device from the
    current context, so leaving ours current would move PyTorch's work to our device.
    """
    ctx = _primary_context(device_index)
    driver = _driver()
    previous = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    switch = int(previous) != int(ctx)
    if switch:
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    try:
        yield ctx
    finally:
        if switch:
            _check(driver.cuCtxSetCurrent(previous), "cuCtxSetCurrent(previous)")


def device_arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


class KernelProgram:
    """One ``.cu`` file with the template instances to keep: compiled and loaded lazily per device.

    Picklable: the loaded modules and functions (native handles) are dropped by ``__getstate__`` and
    rebuilt on the first launch after unpickling.

    Args:
        source: file name under ``kernels/csrc`` or a path.
        name_expressions: functions to keep, e.g. ``["hash_encode_fwd<float, 2, true>"]``.
        defines: ``-D`` macros.
        options: extra NVRTC options.
    """

    def __init__(self, source: str | os.PathLike, name_expressions: Sequence[str],
                 defines: Mapping[str, object] | None = None, options: Sequence[str] = ()):
        path = Path(source)
        self.source = path if path.is_absolute() else loader.CSRC_DIR / path
        self.name_expressions = tuple(dict.fromkeys(name_expressions))
        self.defines = dict(defines or {})
        self.options = tuple(options)
        self._lock = threading.Lock()
        self._loaded: dict[int, tuple[object, dict[str, object]]] = {}
        self._smem_optin: dict[tuple[int, str], int] = {}

    def __repr__(self) -> str:
        return (f"KernelProgram({self.source.name!r}, {list(self.name_expressions)!r}, "
                f"defines={self.defines!r})")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_loaded"] = {}
        state["_smem_optin"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def compile(self, arch: str | int | tuple[int, int],
                cache_dir: str | os.PathLike | None | bool = None) -> loader.CompiledProgram:
        """Compile (or fetch from the disk cache) for ``arch``; needs no GPU."""
        return loader.compile_source(self.source, arch, name_expressions=self.name_expressions,
                                     defines=self.defines, options=self.options,
                                     cache_dir=cache_dir)

    def load(self, device: torch.device | int | None = None) -> dict[str, object]:
        """Compile for the device's arch if needed, load the module; return {expression: CUfunction}."""
        index = _device_index(device)
        entry = self._loaded.get(index)
        if entry is not None:
            return entry[1]
        with self._lock:
            entry = self._loaded.get(index)
            if entry is None:
                compiled = self.compile(device_arch(index))
                driver = _driver()
                with device_context(index):
                    module = _check(driver.cuModuleLoadData(compiled.image),
                                    f"cuModuleLoadData({self.source.name}, {compiled.arch})")
                    functions = {
                        expr: _check(driver.cuModuleGetFunction(module, lowered.encode()),
                                     f"cuModuleGetFunction({expr})")
                        for expr, lowered in compiled.lowered_names.items()
                    }
                entry = (module, functions)
                self._loaded[index] = entry
        return entry[1]

    def set_max_dynamic_shared(self, name_expression: str, nbytes: int,
                               device: torch.device | int | None = None) -> None:
        """Allow ``name_expression`` launches with up to ``nbytes`` of dynamic shared memory
        (above 48 KiB a kernel must opt in; once per device and size is enough)."""
        index = _device_index(device)
        key = (index, name_expression)
        if self._smem_optin.get(key, -1) >= nbytes:
            return
        entry = self._loaded.get(index)
        function = (entry[1] if entry is not None else self.load(index))[name_expression]
        driver = _driver()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        with device_context(index):
            _check(driver.cuFuncSetAttribute(function, attr, int(nbytes)),
                   f"cuFuncSetAttribute({name_expression}, max dynamic shared {nbytes})")
        self._smem_optin[key] = nbytes

    def launch(self, name_expression: str, grid: Sequence[int], block: Sequence[int],
               args: Sequence[KernelArg], device: torch.device | int | None = None,
               shared_mem: int = 0) -> None:
        """Launch one kernel on PyTorch's current stream of ``device``.

        Args:
            name_expression: one of ``name_expressions``.
            grid, block: up to 3 dimensions each.
            args: ``(value, ctypes type)`` per kernel parameter, pointers as ``(t.data_ptr(), ptr)``.
            device: the CUDA device the tensors live on.
            shared_mem: dynamic shared memory in bytes.
        """
        index = _device_index(device)
        entry = self._loaded.get(index)
        function = (entry[1] if entry is not None else self.load(index))[name_expression]
        g = (*grid, 1, 1, 1)[:3]
        b = (*block, 1, 1, 1)[:3]
        stream = _current_raw_stream(index)
        params = packed_args(args)  # this thread's buffer: used up before cuLaunchKernel returns
        driver = _driver()
        with device_context(index):
            _check(driver.cuLaunchKernel(function, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                         driver.CUstream(stream), params, 0),
                   f"cuLaunchKernel({name_expression})")


def _current_raw_stream(index: int) -> int:
    """PyTorch's current stream on device ``index`` as an integer handle."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~2 us less
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


def _device_index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernels launch on CUDA devices, got device={device}")
    return device.index if device.index is not None else torch.cuda.current_device()
