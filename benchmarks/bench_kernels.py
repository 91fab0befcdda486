"""Benchmark the CUDA kernels: compile/load time and hash-encoding throughput against the reference.

Prints tables (not a test). Needs a CUDA GPU.

    python benchmarks/bench_kernels.py            # defaults: L=16, F=2, T=2^19, R 16..2048
    python benchmarks/bench_kernels.py --variants # also every layout / block / atomics variant
    python benchmarks/bench_kernels.py --json out.json

Compile time is measured in fresh subprocesses (a fresh temporary cache for the first use, then the
same cache again), so library loading (libnvrtc, the CUBIN read) is counted as a user sees it.
Throughput is in G level-lookups/s = N * L / time (one lookup = 8 corners of one level).
Kernel times use CUDA events around the launch, with a busy kernel queued first so Python's launch
overhead is hidden (it is reported separately); median of repeats after warm-up.

Measured on one H200 (torch 2.11+cu130, cuda-bindings 13.3.1, NVRTC 13.0), default build,
2026-11-30 (benchmarks/results/kernels_H200.json):

    N     table   fwd ms  fwd G/s  bwd ms  bwd/fwd
    2^18  fp32    0.151   27.8     0.311   2.06
    2^18  fp16    0.127   32.9     0.337   2.64
    2^21  fp32    1.095   30.6     2.142   1.96
    2^21  fp16    0.982   34.2     2.246   2.29
    compile on first use 0.117 s (both programs: hashgrid.cu, render.cu), cached load 0.055 s;
    host time of one call ~62 us
    PyTorch reference at 2^21: fwd 19.1 ms, bwd 7.7 ms (fp32)

The backward is bound by L2 atomic throughput (~90 G vector REDs/s; the scalar-atomics build is
2.5x slower), so it costs the same for both table dtypes (it accumulates in fp32) while the fp16
forward reads half the bytes. The coarse dense levels 0 and 1 are accumulated per block in shared
memory first (hash_encode_bwd_private): 2.21 vs 2.28 ms at 2^21 fp32 in an A/B of the same run;
run-to-run spread of the backward is about 3 %. Summing fp16 tables' gradients in fp16 (half2 /
f16x2 vector reductions) was slower still: 2.45 vs 2.25 ms at 2^21 (2026-11-29, 2xH200 host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import hashgrid  # noqa: E402

LEVELS, FEATURES, LOG2_T, BASE, FINEST = 16, 2, 19, 16, 2048
TARGET_FWD_GLOOKUPS = 25.0
TARGET_COMPILE_S, TARGET_LOAD_S = 2.0, 0.2

_COMPILE_PROBE = """
import json, sys, time, torch
sys.path.insert(0, {repo!r})
torch.zeros(1, device="cuda"); torch.cuda.synchronize()   # CUDA context: not ours to time
import kernels
from kernels import loader
t0 = time.perf_counter()
for prog in kernels.default_programs():
    prog.load(0)
t1 = time.perf_counter()
print(json.dumps({{"seconds": t1 - t0, "compiles": loader.stats.nvrtc_compiles,
                  "programs": len(kernels.default_programs())}}))
"""


def compile_times() -> dict:
    """First use (empty cache) and cached load of every default program, each in a new process."""
    with tempfile.TemporaryDirectory(prefix="rayforge-kernel-cache-") as cache:
        env = {**os.environ, "RAYFORGE_KERNEL_CACHE": cache}
        out = {}
        for phase in ("first_use", "cached"):
            proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE.format(repo=str(REPO))],
                                  capture_output=True, text=True, env=env, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"compile probe failed:\n{proc.stderr}")
            out[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out


def gpu_time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median device time of fn() in ms (CUDA events; a queued busy kernel hides host overhead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU work so the launch below is queued in time
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_overhead_us(points, table, res, calls: int = 200) -> float:
    """Host time of one public hash_encode call (validation + launch), GPU not waited for."""
    for _ in range(10):
        kernels.hash_encode(points, table, res)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        kernels.hash_encode(points, table, res)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def make_inputs(n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    points = torch.rand(n, 3, device="cuda", generator=g)
    table = ((torch.rand(LEVELS, 2**LOG2_T, FEATURES, device="cuda", generator=g) * 2 - 1) * 1e-2
             ).to(dtype)
    res = torch.tensor(kernels.grid_resolutions(LEVELS, BASE, FINEST), dtype=torch.int32,
                       device="cuda")
    grad_out = torch.randn(n, LEVELS * FEATURES, device="cuda", generator=g)
    return points, table, res, grad_out


def bench_hash_encoding(sizes, variants, reference: bool) -> list[dict]:
    rows = []
    for n in sizes:
        for dtype in (torch.float32, torch.float16):
            points, table, res, grad_out = make_inputs(n, dtype)
            lookups = n * LEVELS
            ref_out = kernels.hash_encode(points, table, res, use_kernels=False)
            host = tuple(res.tolist())
            for name, group, block, defines, *private in variants:
                fwd = gpu_time_ms(lambda: hashgrid._forward_cuda(points, table, res, group,
                                                                 block, defines))
                saved = {k: getattr(hashgrid, k) for k in (private[0] if private else {})}
                for k, v in (private[0] if private else {}).items():
                    setattr(hashgrid, k, v)
                bwd = gpu_time_ms(lambda: hashgrid._backward_cuda(
                    points, grad_out, res, table.shape, table.dtype, group, block, defines, host))
                for k, v in saved.items():
                    setattr(hashgrid, k, v)
                out = hashgrid._forward_cuda(points, table, res, group, block, defines)
                err = (out - ref_out).abs().max().item()
                rows.append(dict(n=n, dtype=str(dtype).split(".")[-1], impl=name, fwd_ms=fwd,
                                 bwd_ms=bwd, fwd_g=lookups / fwd / 1e6, bwd_g=lookups / bwd / 1e6,
                                 max_err=err))
            if reference:
                tref = table.clone().requires_grad_()

                def ref_fwd():
                    with torch.no_grad():
                        kernels.hash_encode(points, tref, res, use_kernels=False)

                out = kernels.hash_encode(points, tref, res, use_kernels=False)
                fwd = gpu_time_ms(ref_fwd, warmup=1, reps=5)
                bwd = gpu_time_ms(lambda: torch.autograd.grad(out, tref, grad_out,
                                                              retain_graph=True),
                                  warmup=1, reps=5)
                rows.append(dict(n=n, dtype=str(dtype).split(".")[-1], impl="pytorch reference",
                                 fwd_ms=fwd, bwd_ms=bwd, fwd_g=lookups / fwd / 1e6,
                                 bwd_g=lookups / bwd / 1e6, max_err=0.0))
                del out
            del points, table, grad_out
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'N':>8} {'table':>7} {'implementation':<30} {'fwd ms':>8} {'fwd G/s':>8} "
              f"{'bwd ms':>8} {'bwd G/s':>8} {'bwd/fwd':>7} {'max|err|':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{'2^%d' % (r['n'].bit_length() - 1):>8} {r['dtype']:>7} {r['impl']:<30} "
              f"{r['fwd_ms']:8.3f} {r['fwd_g']:8.2f} {r['bwd_ms']:8.3f} {r['bwd_g']:8.2f} "
              f"{r['bwd_ms'] / r['fwd_ms']:7.2f} {r['max_err']:9.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**18, 2**21])
    parser.add_argument("--variants", action="store_true",
                        help="time every thread layout, block size and the scalar-atomics build")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not kernels.available():
        print(f"no CUDA kernels here: {kernels.unavailable_reason()}")
        return 1
    from cuda import bindings, pathfinder

    from kernels import loader

    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), "
          f"torch {torch.__version__}, cuda-bindings {bindings.__version__}, "
          f"cuda-pathfinder {pathfinder.__version__}, NVRTC {loader.nvrtc_version()}")
    print(f"hash grid: L={LEVELS} F={FEATURES} T=2^{LOG2_T} resolutions {BASE}..{FINEST}; "
          f"defaults: levels per block row {hashgrid.levels_per_block(FEATURES)}, "
          f"block {hashgrid.BLOCK_SIZE}")

    ct = compile_times()
    first, cached = ct["first_use"], ct["cached"]
    print(f"\ncompile, all {first['programs']} default program(s): first use {first['seconds']:.3f} s "
          f"({first['compiles']} NVRTC compiles; target < {TARGET_COMPILE_S} s), cached load "
          f"{cached['seconds']:.3f} s ({cached['compiles']} compiles; target < {TARGET_LOAD_S} s)")

    default = ("kernel (default)", None, None, None)
    variants = [default]
    if args.variants:
        variants += [(f"kernel G={g} block={b}", g, b, None)
                     for g, b in [(0, 256), (1, 256), (2, 256), (8, 256), (4, 128), (4, 512)]]
        variants += [(f"kernel {name}", None, None, {define: 1}) for name, define in
                     [("no pair merge", "RF_NO_PAIR_MERGE"), ("no streaming", "RF_NO_STREAMING"),
                      ("scalar atomics", "RF_SCALAR_ATOMICS")]]
        variants += [("kernel G=0 neither", 0, None, {"RF_NO_PAIR_MERGE": 1, "RF_NO_STREAMING": 1})]
        # block-private backward of the dense levels: off, and capped at 1 / 2 slabs per level
        variants += [(f"kernel private slabs<={k}" if k else "kernel no private bwd", None, None, None,
                      {"PRIVATE_MAX_SLABS": k} if k else {"PRIVATE_SMEM_BYTES": 0}) for k in (0, 1, 2, 8)]
        variants += [("kernel private min hits 64", None, None, None, {"PRIVATE_MIN_HITS": 64})]
    rows = bench_hash_encoding(args.sizes, variants, reference=not args.no_reference)
    print()
    print_table(rows)

    points, table, res, _ = make_inputs(1024, torch.float32)
    overhead = host_overhead_us(points, table, res)
    print(f"\nhost time of one hash_encode call (N=1024, checks + launch): {overhead:.1f} us")

    big = [r for r in rows if r["n"] == max(args.sizes) and r["impl"] == "kernel (default)"]
    for r in big:
        ok_fwd = r["fwd_g"] >= TARGET_FWD_GLOOKUPS
        ok_bwd = r["bwd_ms"] <= 2 * r["fwd_ms"]
        print(f"targets at N=2^{max(args.sizes).bit_length() - 1}, {r['dtype']}: forward "
              f"{r['fwd_g']:.1f} G/s (>= {TARGET_FWD_GLOOKUPS}: {'met' if ok_fwd else 'MISSED'}), "
              f"backward {r['bwd_ms'] / r['fwd_ms']:.2f}x forward (<= 2x: "
              f"{'met' if ok_bwd else 'MISSED'})")
    if args.json:
        args.json.write_text(json.dumps({"compile": ct, "hash_encoding": rows,
                                         "host_overhead_us": overhead}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
