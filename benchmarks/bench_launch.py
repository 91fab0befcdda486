"""Host time of one launch of the project's NVRTC kernels, taken apart, beside a PyTorch op.

    python benchmarks/bench_launch.py [--json out.json]

Eager 3DGS and NeRF calls are host bound at small sizes (a trained lego's forward: 1.11 ms of
kernels in a 2.07 ms call), and every one of our kernels goes through
``kernels._driver.KernelProgram.launch``. This times, per launch, in microseconds of host wall
time (``time.perf_counter`` over --repeats launches, the GPU synchronised before and after, the
kernels doing no work: ``projection_fwd`` with C * N = 0, 20 arguments, and ``tile_offsets`` with
M = 0, 6 arguments):

* ``launch``: the whole ``KernelProgram.launch`` as the ops call it;
* ``device_context``: entering and leaving ``kernels._driver.device_context`` alone;
* ``raw_stream``: PyTorch's current stream as an integer;
* ``cuLaunchKernel, tuple args``: the driver call with the (values, types) tuples cuda-python packs
  on every call, the context already current;
* ``cuLaunchKernel, packed args``: the same with the arguments packed once
  (``kernels._driver.ArgPacker``, the buffer ``launch`` now fills on every call) and handed over as
  its address;
* ``torch add_``: ``x.add_(1)`` on a one-element CUDA tensor, for scale.

Prints a table; needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import _driver, _gs_cuda  # noqa: E402
from kernels._driver import f32, i32, i64  # noqa: E402


def per_call_us(fn, repeats: int) -> float:
    for _ in range(min(100, repeats)):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5000)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_launch: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    buf = torch.zeros(16, device=dev)
    p = buf.data_ptr()
    ptr = _driver.ptr
    kernels = {
        "projection_fwd (20 args)": (_gs_cuda.program("project"), "projection_fwd",
                                     [(p, ptr)] * 6 + [(0, i32), (0, i32), (16, i32), (16, i32), (0.3, f32)]
                                     + [(0.01, f32), (1e10, f32), (0.0, f32), (0, i32)] + [(p, ptr)] * 5),
        "tile_offsets (6 args)": (_gs_cuda.program("tiles"), "tile_offsets",
                                  [(0, i64), (p, ptr), (13, i32), (8160, i32), (8160, i64), (p, ptr)]),
    }
    driver = _driver._driver()
    rows = {}
    for label, (prog, name, kargs) in kernels.items():
        prog.launch(name, (1,), (256,), kargs, device=dev)  # compile and load
        function = prog.load(0)[name]
        stream = _driver._current_raw_stream(0)
        values, types = tuple(a[0] for a in kargs), tuple(a[1] for a in kargs)
        packer = _driver.ArgPacker(types)  # what launch() packs into, filled once here
        address = packer.pack(values)
        cu_stream = driver.CUstream(stream)

        def tuple_launch():
            driver.cuLaunchKernel(function, 1, 1, 1, 256, 1, 1, 0, cu_stream, (values, types), 0)

        def packed_launch():
            driver.cuLaunchKernel(function, 1, 1, 1, 256, 1, 1, 0, cu_stream, address, 0)

        with _driver.device_context(0):
            rows[label] = {
                "launch": per_call_us(lambda: prog.launch(name, (1,), (256,), kargs, device=dev), args.repeats),
                "cuLaunchKernel, tuple args": per_call_us(tuple_launch, args.repeats),
                "cuLaunchKernel, packed args": per_call_us(packed_launch, args.repeats),
            }

    def context():
        with _driver.device_context(0):
            pass

    common = {"device_context": per_call_us(context, args.repeats),
              "raw_stream": per_call_us(lambda: _driver._current_raw_stream(0), args.repeats),
              "torch add_": per_call_us(lambda: buf[:1].add_(1), args.repeats)}
    print(f"host us per call, {args.repeats} calls, {torch.cuda.get_device_name(dev)}")
    print(f"| {'':28s} | " + " | ".join(f"{k:>26s}" for k in kernels) + " |")
    for what in next(iter(rows.values())):
        print(f"| {what:28s} | " + " | ".join(f"{rows[k][what]:26.2f}" for k in kernels) + " |")
    for what, us in common.items():
        print(f"| {what:28s} | {us:26.2f} |")
    if args.json:
        doc = {"environment": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                               "python": platform.python_version()},
               "repeats": args.repeats, "per_kernel_us": rows, "common_us": common}
        tmp = args.json.with_suffix(".part")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
