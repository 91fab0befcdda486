"""The kernel runtime: NVRTC compile (no GPU needed), disk cache, errors, lazy import; GPU load/launch."""

from __future__ import annotations

import ctypes
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import kernels
from kernels import _driver, loader

try:
    from conftest import requires_gpu
except ImportError:  # conftest absent or changed: same marker, defined here
    requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[1]
ALL_SOURCES = sorted(loader.CSRC_DIR.glob("*.cu"))

TINY_CU = """\
#include "tiny.cuh"
template <int K> __global__ void add_k(float* x) { x[threadIdx.x] += K + TINY_OFFSET; }
"""
TINY_CUH = "#pragma once\n#define TINY_OFFSET 1\n"
TINY_NAME = "add_k<3>"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep every test's default cache away from ~/.cache (one folder for the whole session)."""
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "kernel-cache"))


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cu").write_text(TINY_CU)
    (src / "tiny.cuh").write_text(TINY_CUH)
    return src / "tiny.cu"


def _programs_for(source: Path) -> list[kernels.KernelProgram]:
    return [p for p in kernels.default_programs() if p.source.resolve() == source.resolve()]


# ---------------------------------------------------------------------------- compile, no GPU


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", ALL_SOURCES, ids=lambda p: p.name)
def test_every_source_compiles_without_a_gpu(source, arch, tmp_path):
    programs = _programs_for(source)
    assert programs, f"{source.name} is in no default program: register it in kernels.default_programs"
    for prog in programs:
        compiled = prog.compile(arch, cache_dir=tmp_path)
        assert compiled.image_kind == "cubin" and compiled.arch == arch
        assert compiled.image[:4] == b"\x7fELF"  # a CUBIN is an ELF file
        assert set(compiled.lowered_names) == set(prog.name_expressions)
        assert "warning" not in compiled.log, compiled.log


# kernels allowed a stack frame: adam_bump_steps' 48 bytes (its pointer table), one thread a launch
STACK_ALLOWED = {"adam_bump_steps"}


@pytest.mark.parametrize("source", ALL_SOURCES, ids=lambda p: p.name)
def test_no_kernel_keeps_arrays_in_local_memory(source):
    """ptxas reports a stack frame where an array is indexed by a runtime value (a loop to a runtime
    bound): it then lives in local memory, and every access goes through the cache. The SH kernels
    did that with their 16 basis values (64 and 256 bytes) until their loops were unrolled with a
    guard on the degree; this keeps every kernel at 0 bytes of stack and 0 bytes of spills on sm_90."""
    import re

    for prog in _programs_for(source):
        compiled = loader.compile_source(prog.source, "sm_90", name_expressions=prog.name_expressions,
                                         defines=prog.defines, options=prog.options + ("--ptxas-options=-v",),
                                         cache_dir=False)
        entry, seen = None, 0
        for line in compiled.log.splitlines():
            if m := re.search(r"Compiling entry function '(\w+)'", line):
                entry = m.group(1)
            elif entry and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)):
                seen += 1
                name = next((e for e in STACK_ALLOWED if e in entry), None)
                if name is None:
                    assert m.groups() == ("0", "0"), f"{source.name}: {entry}: {line.strip()}"
        assert seen >= len(prog.name_expressions), f"{source.name}: ptxas -v reported {seen} kernels"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_blending_program_with_another_alpha_clamp_compiles_without_a_gpu(arch, tmp_path):
    """kernels.rasterization(alpha_max=0.999): the blending unit built with its own RF_ALPHA_MAX."""
    from kernels import _gs_cuda

    prog = _gs_cuda.raster_program(3, 0.999)
    assert prog is not _gs_cuda.raster_program(3) and prog is _gs_cuda.raster_program(3, 0.999)
    assert prog.defines["RF_ALPHA_MAX"] == "(0.999f)"
    assert _gs_cuda.raster_program(3).defines["RF_ALPHA_MAX"] == "(0.99f)"
    compiled = prog.compile(arch, cache_dir=tmp_path)
    assert compiled.image[:4] == b"\x7fELF" and set(compiled.lowered_names) == set(prog.name_expressions)
    assert "warning" not in compiled.log, compiled.log


def test_a_compile_leaves_pythons_shared_bytes_alone():
    # NVRTC writes its log (an empty one: one NUL byte) into the buffer it is given; a buffer made as
    # b" " * 1 is CPython's shared one-byte object, and writing into it broke every later b" " of
    # the process: torch.load then refused each checkpoint torch.save wrote. In a child process so
    # that a regression cannot spoil the rest of this session.
    code = textwrap.dedent(f"""
        import io, torch
        from kernels import loader
        loader.compile_source(loader.CSRC_DIR / "ssim.cu", "sm_80", cache_dir=False)
        buf = io.BytesIO()
        torch.save({{"x": torch.arange(32.0), "empty": torch.zeros(0, dtype=torch.uint8)}}, buf)
        back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        assert back["x"].tolist() == list(range(32)) and back["empty"].numel() == 0
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_cache_hits_and_misses(tiny, tmp_path):
    cache = tmp_path / "cache"

    def build(**kw):
        before = loader.stats.nvrtc_compiles
        kw.setdefault("arch", "sm_80")
        kw.setdefault("name_expressions", [TINY_NAME])
        prog = loader.compile_source(tiny, cache_dir=cache, **kw)
        return prog, loader.stats.nvrtc_compiles - before

    first, n = build()
    assert (n, first.from_cache) == (1, False)
    again, n = build()
    assert (n, again.from_cache) == (0, True)
    assert again.image == first.image and again.lowered_names == first.lowered_names
    assert build(arch="sm_90")[1] == 1, "a new arch must miss"
    assert build(options=["-lineinfo"])[1] == 1, "a new option must miss"
    assert build(defines={"UNUSED": 2})[1] == 1, "a new define must miss"
    assert build(name_expressions=[TINY_NAME, "add_k<4>"])[1] == 1, "a new instance must miss"
    assert build()[1] == 0, "the first configuration is still cached"

    (tiny.parent / "tiny.cuh").write_text(TINY_CUH + "// edited\n")
    assert build()[1] == 1, "an edited project header must miss"
    assert build()[1] == 0
    tiny.write_text(TINY_CU + "// edited\n")
    assert build()[1] == 1, "an edited source must miss"
    assert build()[1] == 0
    leftovers = [p.name for p in cache.iterdir() if p.suffix not in (".bin", ".json")]
    assert not leftovers, f"temporary files left in the cache: {leftovers}"


def test_cache_invalidated_by_a_header_of_the_real_sources(tmp_path):
    """The real kernels, copied: editing common.cuh recompiles hashgrid.cu."""
    src = tmp_path / "csrc"
    shutil.copytree(loader.CSRC_DIR, src)
    names = kernels.default_programs()[0].name_expressions
    cache = tmp_path / "cache"
    before = loader.stats.nvrtc_compiles
    loader.compile_source(src / "hashgrid.cu", "sm_90", name_expressions=names, cache_dir=cache)
    assert loader.compile_source(src / "hashgrid.cu", "sm_90", name_expressions=names,
                                 cache_dir=cache).from_cache
    with open(src / "common.cuh", "a") as f:
        f.write("\n// touched\n")
    again = loader.compile_source(src / "hashgrid.cu", "sm_90", name_expressions=names,
                                  cache_dir=cache)
    assert not again.from_cache
    assert loader.stats.nvrtc_compiles - before == 2


def test_default_cache_dir_follows_env(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "from-env"))
    assert loader.default_cache_dir() == tmp_path / "from-env"
    loader.compile_source(tiny, "sm_80", name_expressions=[TINY_NAME])
    assert list((tmp_path / "from-env").glob("tiny-sm_80-*.bin"))
    monkeypatch.delenv(loader.CACHE_ENV)
    assert loader.default_cache_dir() == Path.home() / ".cache" / "rayforge" / "kernels"


def test_torn_cache_entry_is_recompiled(tiny, tmp_path):
    cache = tmp_path / "cache"
    first = loader.compile_source(tiny, "sm_80", name_expressions=[TINY_NAME], cache_dir=cache)
    (image,) = cache.glob("*.bin")
    image.write_bytes(image.read_bytes()[:100])  # as if a writer died half-way
    again = loader.compile_source(tiny, "sm_80", name_expressions=[TINY_NAME], cache_dir=cache)
    assert not again.from_cache and again.image == first.image


def test_unwritable_cache_warns_and_still_compiles(tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="not writable"):
        prog = loader.compile_source(tiny, "sm_80", name_expressions=[TINY_NAME],
                                     cache_dir=blocker / "cache")
    assert prog.image


def test_compile_error_shows_file_and_line(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text("// line 1\n__global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n")
    with pytest.raises(kernels.KernelCompileError) as info:
        loader.compile_source(bad, "sm_80", cache_dir=False)
    message = str(info.value)
    assert "bad.cu(3)" in message and "error" in message and "undefined_name" in message
    assert info.value.log and info.value.arch == "sm_80"


def test_compile_error_in_a_header_names_the_header(tmp_path):
    (tmp_path / "broken.cuh").write_text("#pragma once\nthis is not C++;\n")
    (tmp_path / "user.cu").write_text('#include "broken.cuh"\n__global__ void k() {}\n')
    with pytest.raises(kernels.KernelCompileError, match=r"broken\.cuh\(2\)"):
        loader.compile_source(tmp_path / "user.cu", "sm_90", cache_dir=False)


def test_defines_reach_nvrtc(tmp_path):
    src = tmp_path / "needs_define.cu"
    src.write_text("#ifndef WIDTH\n#error WIDTH must be defined\n#endif\n"
                   "__global__ void k(float* x) { x[threadIdx.x] = WIDTH; }\n")
    with pytest.raises(kernels.KernelCompileError, match="WIDTH must be defined"):
        loader.compile_source(src, "sm_80", cache_dir=False)
    assert loader.compile_source(src, "sm_80", defines={"WIDTH": 4}, cache_dir=False).image
    with pytest.raises(ValueError, match="C identifier"):
        loader.compile_source(src, "sm_80", defines={"bad name": 1}, cache_dir=False)


def test_unknown_arch_falls_back_to_ptx(tiny):
    newest = max(loader.supported_archs())
    prog = loader.compile_source(tiny, f"sm_{newest + 500}", name_expressions=[TINY_NAME],
                                 cache_dir=False)
    assert prog.image_kind == "ptx" and prog.arch == f"sm_{newest}"
    assert prog.image.endswith(b"\x00") and b".entry" in prog.image


@pytest.mark.parametrize("arch, expected", [("sm_90", "sm_90"), ((8, 6), "sm_86"), (80, "sm_80"),
                                            ("compute_89", "sm_89"), ("90a", "sm_90a")])
def test_normalize_arch(arch, expected):
    assert loader.normalize_arch(arch) == expected


@pytest.mark.parametrize("arch", ["gpu", (9,), "sm_9"])
def test_normalize_arch_rejects(arch):
    with pytest.raises(ValueError, match="arch"):
        loader.normalize_arch(arch)


def test_cuda_headers_found():
    inc = loader.cuda_include_dir()
    assert inc is not None and (Path(inc) / "cuda_fp16.h").is_file()


# ---------------------------------------------------------------------------- import, probe, pickle


def test_import_needs_no_gpu_driver_or_nvrtc():
    """`import kernels` and a CPU call work even when cuda-python's modules cannot be imported."""
    code = textwrap.dedent("""
        import sys, importlib.abc, torch
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "cuda" and name not in sys.modules:
                    raise ImportError("blocked for this test: " + name)
        sys.meta_path.insert(0, Block())
        import kernels
        out = kernels.hash_encode(torch.rand(4, 3), torch.zeros(2, 64, 2), [2, 8])
        assert out.shape == (4, 4)
        assert kernels.loader.stats.nvrtc_compiles == 0
        assert "cuda.bindings.nvrtc" not in sys.modules
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_available_is_false_without_gpu():
    assert kernels.available() is False
    assert kernels.unavailable_reason()


def test_probe_reports_a_missing_driver(monkeypatch):
    from cuda.pathfinder import DynamicLibNotFoundError

    def no_driver():
        raise DynamicLibNotFoundError("libcuda.so.1 not found")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_driver, "_init_driver", no_driver)
    ok, why = _driver._probe()
    assert not ok and "DynamicLibNotFoundError" in why


def test_probe_honours_disable_env(monkeypatch):
    monkeypatch.setenv(_driver.DISABLE_ENV, "1")
    assert _driver._probe() == (False, f"{_driver.DISABLE_ENV} is set")


def test_program_pickles_without_native_handles(tmp_path):
    prog = kernels.default_programs()[0]
    clone = pickle.loads(pickle.dumps(prog))
    assert clone._loaded == {} and clone.name_expressions == prog.name_expressions
    fake = kernels.KernelProgram("hashgrid.cu", prog.name_expressions)
    fake._loaded[0] = (threading.Lock(), {})  # stands for a CUmodule: not picklable
    restored = pickle.loads(pickle.dumps(fake))
    assert restored._loaded == {}
    assert restored.compile("sm_90", cache_dir=tmp_path).lowered_names


# ---------------------------------------------------------------------------- packed launch arguments


def _read_back(address: int, types) -> list:
    """The values a void** at ``address`` points at, read as ``types`` (what the driver reads)."""
    pointers = (ctypes.c_void_p * len(types)).from_address(address)
    return [ctypes.cast(pointers[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]


def test_packed_args_hold_every_value_at_its_pointer():
    from kernels._driver import f32, i32, i64, packed_args, ptr, u32

    args = [(0x7F00_1234_5678, ptr), (-3, i32), (2**40 + 5, i64), (0.3, f32), (4_000_000_000, u32), (0, ptr),
            (True, i32)]
    address = packed_args(args)
    assert isinstance(address, int) and address != 0
    got = _read_back(address, [t for _, t in args])
    assert got[:3] == [0x7F00_1234_5678, -3, 2**40 + 5] and got[4:6] == [4_000_000_000, None] and got[6] == 1
    assert got[3] == ctypes.c_float(0.3).value  # float32, as the kernel sees it


def test_packed_args_reuse_one_buffer_per_signature_and_thread():
    from kernels._driver import i32, packed_args, ptr

    first = packed_args([(1, i32), (2, ptr)])
    second = packed_args([(7, i32), (9, ptr)])
    assert first == second and _read_back(second, [i32, ptr]) == [7, 9]
    assert packed_args([(1, ptr), (2, i32)]) != first  # another signature, another buffer
    seen = []
    thread = threading.Thread(target=lambda: seen.append(packed_args([(5, i32), (6, ptr)])))
    thread.start()
    thread.join()
    assert seen[0] != first, "threads must not share a buffer (one could overwrite the other's arguments)"
    assert _read_back(first, [i32, ptr]) == [7, 9]


def test_packed_args_fall_back_to_the_tuple_form():
    """Values struct refuses (out of range, None) and types without a code keep cuda-python's tuple
    form, which casts them as ctypes does: the launch behaves as it did before packing."""
    from kernels._driver import f32, i32, packed_args, ptr

    assert packed_args([(2**31, i32), (0, ptr)]) == ((2**31, 0), (i32, ptr))
    assert packed_args([(None, ptr)]) == ((None,), (ptr,))
    assert packed_args([(1e39, f32)]) == ((1e39,), (f32,))
    assert packed_args([(1, ctypes.c_int16)]) == ((1,), (ctypes.c_int16,))
    assert packed_args([]) == 0


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@requires_gpu
def test_available_on_gpu():
    assert kernels.available(), kernels.unavailable_reason()


@pytest.mark.gpu
@requires_gpu
def test_first_launch_compiles_then_loads_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    names = kernels.default_programs()[0].name_expressions
    fresh = kernels.KernelProgram("hashgrid.cu", names)
    before = loader.stats.nvrtc_compiles
    fresh.load(0)
    assert loader.stats.nvrtc_compiles - before == 1
    other = kernels.KernelProgram("hashgrid.cu", names)  # a new process would look like this
    other.load(0)
    assert loader.stats.nvrtc_compiles - before == 1, "second load must come from the disk cache"


def _encode_inputs(device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(3)
    points = torch.rand(1000, 3, generator=g).to(device)
    table = (torch.rand(4, 2**12, 2, generator=g) * 2 - 1).to(device)
    return points, table, [4, 11, 30, 81]


@pytest.mark.gpu
@requires_gpu
def test_launch_from_a_new_thread():
    """A fresh thread has no current context: the launch makes PyTorch's current, then restores."""
    from cuda.bindings import driver

    null = driver.CUcontext(0)

    points, table, res = _encode_inputs()
    expected = kernels.hash_encode(points, table, res, use_kernels=False)
    result = {}

    def worker():
        try:
            driver.cuCtxSetCurrent(null)  # as a thread that never touched CUDA
            with _driver.device_context(0) as ctx:
                result["inside"] = int(driver.cuCtxGetCurrent()[1]) == int(ctx) != 0
            result["after"] = int(driver.cuCtxGetCurrent()[1])
            fresh = kernels.KernelProgram("hashgrid.cu", ["hash_encode_bwd<1, true>"])
            result["loaded"] = fresh.load(0)  # cuModuleLoadData from a thread with no context
            driver.cuCtxSetCurrent(null)
            result["out"] = kernels.hash_encode(points, table, res, use_kernels=True)
            torch.cuda.synchronize()
        except Exception as exc:  # re-raised in the main thread below
            result["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    assert result["inside"], "device_context must make the primary context current"
    assert result["after"] == 0, "the thread's previous (null) context must be restored"
    assert set(result["loaded"]) == {"hash_encode_bwd<1, true>"}
    # Same cells and weights as the reference (see test_hashgrid.py); 8-term sums reordered.
    torch.testing.assert_close(result["out"], expected, rtol=1e-5, atol=1e-6)


def _launch_forward(prog, points, table, res_t, out):
    from kernels import hashgrid
    from kernels._driver import f32, ptr, u32

    n, levels, size = points.shape[0], table.shape[0], table.shape[1]
    group = hashgrid.levels_per_block(2)
    prog.launch(hashgrid._fwd_name(torch.float32, 2, group),
                hashgrid._launch_grid(n, levels, group, 256), (256,),
                [(points.data_ptr(), ptr), (table.data_ptr(), ptr), (res_t.data_ptr(), ptr),
                 (out.data_ptr(), ptr), (n, u32), (levels, u32), (size, u32), (0.0, f32)],  # grid offset 0
                device=0)


@pytest.mark.gpu
@requires_gpu
def test_launch_runs_on_the_current_stream():
    """Queued behind a long sleep on a side stream, the kernel must not have run yet when the
    (idle) default stream reads its output; after the side stream finishes, it has."""
    from kernels import hashgrid

    points, table, res = _encode_inputs()
    res_t = torch.tensor(res, dtype=torch.int32, device="cuda")
    expected = kernels.hash_encode(points, table, res, use_kernels=False)
    out = torch.full((1000, 8), float("nan"), device="cuda")
    prog = hashgrid.program(2)
    prog.load(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz
        _launch_forward(prog, points, table, res_t, out)
    early = out.cpu()  # on the default stream, which does not wait for `side`
    side.synchronize()
    assert torch.isnan(early).all(), "the kernel ran before its stream's earlier work finished"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # as in the thread test


@pytest.mark.gpu
@requires_gpu
def test_unpickled_program_reloads_lazily():
    from kernels import hashgrid

    points, table, res = _encode_inputs()
    res_t = torch.tensor(res, dtype=torch.int32, device="cuda")
    prog = hashgrid.program(2)
    prog.load(0)
    clone = pickle.loads(pickle.dumps(prog))
    assert clone._loaded == {}
    out = torch.full((1000, 8), float("nan"), device="cuda")
    _launch_forward(clone, points, table, res_t, out)
    expected = kernels.hash_encode(points, table, res, use_kernels=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # as in the thread test
