"""Running out of memory: one line naming the params that bound memory (batch_rays, the image resolution,
the Gaussian budget), exit 1, no traceback. On a GPU through a per-process memory fraction; on the CPU
through the same code path with an address-space limit, so the allocation really fails."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from reliability._faults import ROOT, env, stage, write_params

AREA = "fault: out of memory"
ADVICE = ("reconstruct.batch_rays", "ingest.max_size", "reconstruct.gs.max_gaussians")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's")
def test_out_of_memory_names_the_params_to_lower_cpu(tiny_poses, tmp_path, reliability):
    import resource

    def limit() -> None:  # 6 GiB of address space: torch fits, a batch of 2^30 rays (8 GiB of indices) does not
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    params = write_params(tmp_path / "p.yaml", {"batch_rays": 1 << 30}, ingest={"max_size": 0})
    p = subprocess.run(stage("stages.reconstruct", "--poses", tiny_poses, "--out", tmp_path / "out", "--params",
                             params), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    line = next((ln for ln in p.stderr.splitlines() if ln.startswith("reconstruct: error:")), "")
    assert p.returncode == 1 and "out of memory" in line and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert all(k in line for k in ADVICE) and "(now 1073741824)" in line, line
    reliability(AREA, "CPU: batch_rays 2^30 under a 6 GiB address-space limit (the message's code path)",
                "exit 1, one line naming batch_rays, ingest.max_size, reconstruct.gs.max_gaussians",
                f"exit 1: {line[len('reconstruct: error: '):]}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.reliability(AREA, "CUDA: 256 MiB memory fraction, 2^22 rays a step",
                         "exit 1, one line naming batch_rays, ingest.max_size, reconstruct.gs.max_gaussians")
def test_cuda_out_of_memory_names_the_params_to_lower(tiny_poses, tmp_path, capsys, reliability):
    from stages.reconstruct.__main__ import main

    total = torch.cuda.get_device_properties(0).total_memory
    params = write_params(tmp_path / "p.yaml", {"device": "cuda", "batch_rays": 1 << 22, "steps": 5,
                                                "distributed": {"gpus": 1, "checkpoint_every": 0}},
                          ingest={"max_size": 0})
    torch.cuda.empty_cache()  # what earlier tests left cached would count against the fraction
    torch.cuda.set_per_process_memory_fraction((256 << 20) / total, 0)
    try:
        rc = main(["--poses", str(tiny_poses), "--out", str(tmp_path / "out"), "--params", str(params)])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    err = capsys.readouterr().err
    line = next((ln for ln in err.splitlines() if ln.startswith("reconstruct: error:")), err[-1000:])
    assert rc == 1 and "out of GPU memory" in line and all(k in line for k in ADVICE), line
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    reliability(AREA, "CUDA: 256 MiB memory fraction, 2^22 rays a step",
                "exit 1, one line naming batch_rays, ingest.max_size, reconstruct.gs.max_gaussians",
                f"exit 1: {line[len('reconstruct: error: '):]}")
