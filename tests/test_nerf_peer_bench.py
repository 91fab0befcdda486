"""benchmarks/bench_nerf_peer.py's CPU-side parts: reading the peer's printed numbers, the report rows,
and the in-memory changes its runner makes to nerfacc's example (against the example itself, where
``prepare_peer_ngp.sh`` has put it in .gpu/peer). The runs need a GPU and tiny-cuda-nn (the script's
docstring); their results are in benchmarks/results."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from stages.report import benchmark_rows, read_benchmark

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / ".gpu" / "peer" / "nerfacc-examples" / "examples" / "train_ngp_nerf_occ.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_nerf_peer", ROOT / "benchmarks" / "bench_nerf_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PRINTED = """peer runner: train_ngp_nerf_occ.py, max_steps 5000, images 400x400
elapsed_time=0.52s | step=0 | loss=0.08000 | psnr=10.97 | n_rendering_samples=1000 | num_rays=1024 | max_depth=1.0 |
elapsed_time=27.41s | step=5000 | loss=0.00021 | psnr=36.78 | n_rendering_samples=262000 | num_rays=9000 | max_depth=4.1 |
100%|##########| 25/25
evaluation: psnr_avg=32.8123, lpips_avg=0.0
"""


def test_reads_the_time_and_psnr_of_the_last_step():
    row = _bench().parse_peer(PRINTED, 5000)
    assert row == {"steps": 5000, "train_seconds": 27.41, "psnr": 32.8123, "train_batch_psnr": 36.78}


def test_a_run_that_did_not_reach_its_last_step_is_refused():
    with pytest.raises(ValueError, match="no time or PSNR"):
        _bench().parse_peer(PRINTED, 10000)
    with pytest.raises(ValueError, match="no time or PSNR"):
        _bench().parse_peer(PRINTED.replace("evaluation", "crashed"), 5000)


def test_report_rows_are_what_the_report_reads(tmp_path):
    bench = _bench()
    pairs = [{"steps": 5000, "train_seconds": 27.41, "psnr": 32.81}]
    ours_doc = {"rows": [{"scene": "lego", "steps": 6100, "impl": "rayforge nerf", "budget_s": 27.4,
                          "train_s": 27.43, "psnr": 33.02, "ssim": 0.97, "poses_md5": "4fe80dd4"}]}
    rows = bench.report_rows("lego", pairs, ours_doc)
    assert [r["impl"] for r in rows] == [bench.PEER, "rayforge nerf"]
    assert rows[1]["train_s"] == 27.43 and rows[1]["psnr"] == 33.02 and "poses_md5" not in rows[1]
    assert rows[0]["budget_s"] == rows[1]["budget_s"]  # so the report pairs them
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"environment": {"gpu": "x"}, "protocol": bench.PROTOCOL, "peer": bench.PEER,
                                "rows": rows}))
    doc = read_benchmark(path)
    assert doc["peer"] == bench.PEER and len(doc["rows"]) == 2
    assert benchmark_rows(doc["rows"], doc["peer"])[1][4] == f"+0.21 dB vs {bench.PEER}"
    table = bench.table([{**pairs[0], "ours_psnr": 33.02, "ours_steps": 6100}])
    assert "+0.21" in table and "27.4 s" in table


def test_patching_sets_the_steps_and_refuses_another_version():
    bench = _bench()
    src = "if a:\n    max_steps = 20000\nelse:\n    max_steps = 20000\nfor step in r:\n    if step % 10000 == 0:\n"
    out = bench.patch_example(src, 5000)
    assert out.count("max_steps = 5000") == 2 and "20000" not in out
    assert "if step % 10000 == 0 or step == max_steps:" in out
    with pytest.raises(ValueError, match="another version"):
        bench.patch_example(src.replace("max_steps = 20000", "max_steps = 30000"), 5000)


def test_edits_replace_a_text_that_is_there_once():
    bench = _bench()
    src = "max_steps = 20000\nfor step in r:\n    if step % 10000 == 0:\nkw = {}\nopt = Adam(eps=1e-15)\n"
    out = bench.patch_example(src, 100, [bench.parse_edit('kw = {}=>kw = {"color_bkgd_aug": "random"}')])
    assert 'kw = {"color_bkgd_aug": "random"}' in out and "max_steps = 100" in out
    with pytest.raises(ValueError, match="0 times"):
        bench.patch_example(src, 100, [("betas=(0.9, 0.999)", "betas=(0.9, 0.99)")])
    with pytest.raises(ValueError, match="2 times"):
        bench.patch_example(src + "kw = {}\n", 100, [("kw = {}", "kw = None")])
    with pytest.raises(ValueError, match="OLD=>NEW"):
        bench.parse_edit("no arrow")


@pytest.mark.skipif(not EXAMPLE.is_file(), reason="nerfacc's example is not in .gpu/peer (prepare_peer_ngp.sh)")
def test_the_example_as_packed_takes_the_patch():
    out = _bench().patch_example(EXAMPLE.read_text(), 5000)
    compile(out, str(EXAMPLE), "exec")
    assert "max_steps = 20000" not in out and "max_steps = 5000" in out
    bench = _bench()
    every = [bench.parse_edit(edit) for edit in bench.OURS_EDITS.values()]  # --ours: each there once
    compile(bench.patch_example(EXAMPLE.read_text(), 5000, every), str(EXAMPLE), "exec")
    assert "WIDTH, HEIGHT = 800, 800" in (EXAMPLE.parent / "datasets" / "nerf_synthetic.py").read_text()


def test_swap_bench_puts_a_tiny_cuda_nn_grid_in_our_field(monkeypatch):
    """bench_nerf_swap.py's tiny-cuda-nn grid is a drop-in for our HashGrid inside the field: the field
    builds with it, trains its flat parameters, and a snapshot reloads into a fresh field. tiny-cuda-nn
    has no CPU path, so a stand-in Encoding (our reference grid behind tinycudann's interface) plays it."""
    import sys
    import types

    import torch

    from kernels import grid_resolutions
    from kernels._reference import hash_encode_reference
    from stages.reconstruct.config import NerfParams
    import stages.reconstruct.nerf.field as field

    class Encoding(torch.nn.Module):  # tinycudann.Encoding's constructor and flat params
        def __init__(self, n_input_dims, cfg, seed=1337, dtype=torch.float32):
            super().__init__()
            levels, f, size = cfg["n_levels"], cfg["n_features_per_level"], 2 ** cfg["log2_hashmap_size"]
            finest = round(cfg["base_resolution"] * cfg["per_level_scale"] ** (levels - 1))
            self.res, self.shape = grid_resolutions(levels, cfg["base_resolution"], finest), (levels, size, f)
            self.params = torch.nn.Parameter(torch.empty(levels * size * f).uniform_(-1e-4, 1e-4))

        def forward(self, x):
            return hash_encode_reference(x, self.params.view(*self.shape), self.res)

    monkeypatch.setitem(sys.modules, "tinycudann", types.SimpleNamespace(Encoding=Encoding))
    spec = importlib.util.spec_from_file_location("bench_nerf_swap", ROOT / "benchmarks" / "bench_nerf_swap.py")
    swap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(swap)
    monkeypatch.setattr(field, "HashGrid", swap.tcnn_grid(torch.float32))
    cfg, box = NerfParams(max_resolution=64, log2_hashmap_size=12), torch.tensor([[-1.0] * 3, [1.0] * 3])
    f = field.NerfField(cfg, box)
    assert f.encoding.output_dim == 32 and f.encoding.resolutions.tolist()[-1] == 64
    x, d = torch.rand(50, 3) * 2 - 1, torch.nn.functional.normalize(torch.randn(50, 3), dim=-1)
    sigma, rgb = f(x, d)
    (sigma.sum() + rgb.sum()).backward()
    assert f.encoding.enc.params.grad.abs().sum() > 0
    g = field.NerfField(cfg, box)
    g.load_state_dict(f.state_dict())
    torch.testing.assert_close(g(x, d)[1], f(x, d)[1])
