"""benchmarks/bench_nerf_quality.py on the CPU with tiny budgets (``--allow-cpu``): the wall-clock
snapshots, their evaluation and the JSON; the GPU run is the lead's (see the script's docstring)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from test_nerf_background import _poses

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_nerf_quality", ROOT / "benchmarks" / "bench_nerf_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_budgets_snapshot_one_run_and_evaluate_each(tmp_path, capsys):
    poses = _poses(tmp_path)
    bench = _bench()
    tiny = ["nerf.levels=2", "nerf.log2_hashmap_size=10", "nerf.max_resolution=32", "nerf.hidden_dim=16",
            "nerf.samples_per_ray=32", "nerf.occ_resolution=16", "nerf.target_samples=2048", "batch_rays=64",
            "nerf.occ_warmup_steps=0"]
    out = tmp_path / "bench.json"
    args = ["--allow-cpu", "--poses", f"tiny={poses}", "--budgets", "0.5,1.5", "--json", str(out),
            "--method", "3dgs", "--set-3dgs", "steps=2", "--render-side", "32", *[a for kv in tiny for a in ("--set", kv)]]
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    nerf = next(r for r in doc["results"] if r["method"] == "nerf")
    rows = nerf["rows"]
    assert [r["budget"] for r in rows] == [0.5, 1.5] and nerf["stopped"] == "budget"
    assert rows[0]["time_s"] >= 0.5 and rows[1]["time_s"] >= 1.5 and rows[1]["steps"] >= rows[0]["steps"] >= 1
    for r in rows:
        assert 0 < r["psnr"] < 60 and 0 < r["ssim"] <= 1 and r["samples_per_s"] > 0 and r["units_per_s"] > 0
        assert 0 < r["train_psnr"] < 60  # training views scored beside the test views (the fit / predict gap)
        occ = r["occlusion"]  # the step's samples behind opaque surfaces
        assert occ["samples"] > 0 and 0 <= occ["occluded_share"] <= 1 and 0 < occ["kept_per_ray"] <= occ["samples_per_ray"]
    assert nerf["render_800"]["size"] == "32x24" and nerf["render_800"]["seconds"] > 0
    # a capture without alpha: the real-capture profile (contraction, a 25k-step exponential decay), and the
    # distortion loss exactly when its cameras go around the scene (this ring of 4 views does)
    assert nerf["nerf"]["target_samples"] == 2048 and nerf["nerf"]["lr_schedule"] == "exp"
    assert nerf["nerf"]["scene_contraction"] == "mipnerf360" and nerf["params"]["steps"] == 25_000
    # tiny-cuda-nn's layers everywhere; no culling on real captures (it cost fox and fern on the GPU)
    assert nerf["nerf"]["mlp_init"] == "tcnn" and nerf["nerf"]["cull_occluded"] is False
    from stages.reconstruct.data import load_scene
    from stages.reconstruct.nerf.method import viewing_spread_deg

    spread = viewing_spread_deg(load_scene(poses).train.c2w)
    assert nerf["nerf"]["distortion_loss"] == (1e-3 if spread >= 45 else 0.0), spread
    gs = next(r for r in doc["results"] if r["method"] == "3dgs")
    assert "rows" in gs or "error" in gs  # trained side by side, or skipped with the reason
    if "rows" in gs:  # a row for every budget: where its 2 steps ended first, its final model, said so
        rows = gs["rows"]
        assert [r["budget"] for r in rows] == [0.5, 1.5] and all(1 <= r["steps"] <= 2 for r in rows)
        for r in rows:
            assert (r["steps"] == 2 and r["time_s"] < r["budget"]) if r.get("finished") else r["time_s"] >= r["budget"], [(r["steps"], r["time_s"]) for r in rows]
        # (on an idle machine the 2 steps end well before 1.5 s, so the last row is the finished model;
        # on a loaded one they may outlast it, and the row is then an ordinary budget snapshot)
    text = capsys.readouterr().out
    assert "Targets (issue 17)" in text and "tiny: no drop > 0.2 dB" in text


def _doc(gpu: str, scene: str, psnrs: list[float]) -> dict:
    rows = [{"budget": b, "time_s": b, "steps": 10 * i + 10, "psnr": p, "ssim": 0.9, "worst_view_psnr": p - 3,
             "samples_per_s": 1e6, "units_per_s": 1e4} for i, (b, p) in enumerate(zip((30.0, 60.0, 120.0), psnrs))]
    return {"gpu": gpu, "torch": "2.11.0+cu130", "budgets": [30.0, 60.0, 120.0],
            "results": [{"scene": scene, "method": "nerf", "rows": rows, "peak_memory_bytes": 2e9, "render_800": None}]}


def test_merge_joins_runs_of_one_gpu_and_keeps_variants_out_of_the_targets(tmp_path, capsys):
    """--merge: one JSON from per-scene runs (the targets judged over all of them); a labelled
    variant is named in its rows and judged by no target; runs from two GPU kinds are refused."""
    bench = _bench()
    files = {}
    for name, gpu, scene, psnrs in (("fox", "H100", "fox", [30.0, 31.0, 31.5]), ("fern", "H100", "fern", [27.0, 26.5, 27.0]),
                                    ("fox_cull", "H100", "fox", [29.0, 20.0, 21.0]), ("other", "H200", "fox", [1, 2, 3])):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(_doc(gpu, scene, psnrs)))
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", str(files["fox"]), str(files["fern"]), f"{files['fox_cull']}=cull", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "H100" and doc["torch"] == "2.11.0+cu130" and doc["merged_from"] == ["fox.json", "fern.json", "fox_cull.json=cull"]
    assert doc["targets"]["fox: no drop > 0.2 dB between budgets"].startswith("PASS")  # the variant's 9 dB drop is not judged
    assert doc["targets"]["fern: no drop > 0.2 dB between budgets"].startswith("FAIL (largest drop 0.50 dB)")
    impls = [r["impl"] for r in doc["rows"]]
    assert impls.count("rayforge nerf") == 6 and impls.count("rayforge nerf (cull)") == 3
    assert "nerf (cull)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="different GPUs"):
        bench.main(["--merge", str(files["fox"]), str(files["other"]), "--json", str(out)])


def test_nerf_and_3dgs_on_different_poses_are_not_judged_against_each_other():
    """The fox / fern target compares NeRF with 3DGS at 120 s only where both trained on the same poses
    out (its md5): merged runs of another SfM are n/a, not a pass or a fail."""
    bench = _bench()

    def run(method, md5, psnr):
        return {**_doc("H100", "fox", [psnr - 1, psnr - 0.5, psnr])["results"][0], "method": method, "poses_md5": md5}

    same = dict(bench.targets([run("nerf", "a" * 32, 31.0), run("3dgs", "a" * 32, 31.5)]))
    assert same["fox within 1 dB of 3DGS at 120 s"] == "PASS (NeRF 31.00 dB, 3DGS 31.50 dB)"
    far = dict(bench.targets([run("nerf", "a" * 32, 29.0), run("3dgs", "a" * 32, 31.5)]))
    assert far["fox within 1 dB of 3DGS at 120 s"].startswith("FAIL")
    apart = dict(bench.targets([run("nerf", "a" * 32, 31.0), run("3dgs", "b" * 32, 31.5)]))
    assert apart["fox within 1 dB of 3DGS at 120 s"] == "n/a (NeRF 31.00 dB, 3DGS 31.50 dB, on different poses)"


def test_object_captures_cull_and_march_finer_than_real_ones():
    """The GPU profile per capture kind: an object with alpha (lego) is not contracted, culls occluded samples
    and marches 1400 steps across its box; a real capture is contracted, marches 512 and does not cull; --set wins."""
    import types

    import torch

    bench = _bench()

    def scene(channels, background):
        ring = torch.eye(4).repeat(4, 1, 1)
        return types.SimpleNamespace(background=background, train=types.SimpleNamespace(channels=channels, c2w=ring))

    obj = bench.make_params("nerf", scene(4, None), "auto", [], torch.device("cpu")).nerf
    assert (obj.cull_occluded, obj.samples_per_ray, obj.mlp_init, obj.scene_contraction) == (True, 1400, "tcnn", "none")
    real = bench.make_params("nerf", scene(3, None), "auto", [], torch.device("cpu")).nerf
    assert (real.cull_occluded, real.samples_per_ray, real.mlp_init, real.scene_contraction) == (False, 512, "tcnn", "mipnerf360")
    forced = bench.make_params("nerf", scene(3, None), "auto", ["nerf.cull_occluded=true"], torch.device("cpu")).nerf
    assert forced.cull_occluded is True


def test_printed_profile_is_what_the_bench_trains(tmp_path, capsys):
    """--print-sets gives the GPU profile as -S flags: laid on params.yaml the way `rayforge train -S` lays
    them, they read back as the bench's own NeRF params (its eval/TensorBoard/one-GPU settings aside), --set
    included; a bad --set is refused with the key named."""
    import dataclasses

    import torch

    from stages.cli import params_file
    from stages.common.params import load_section
    from stages.reconstruct.config import ReconstructParams
    from stages.reconstruct.data import load_scene

    bench = _bench()
    poses = _poses(tmp_path)  # a real capture (no alpha): the contracted profile
    assert bench.main(["--poses", f"tiny={poses}", "--print-sets", "--set", "nerf.ema_decay=0.9"]) == 0
    words = capsys.readouterr().out.split()
    assert words[0::2] == ["-S"] * (len(words) // 2)
    sets = words[1::2]
    assert "reconstruct.nerf.scene_contraction=mipnerf360" in sets and "reconstruct.nerf.ema_decay=0.9" in sets
    with params_file(ROOT / "params.yaml", sets, ("reconstruct",)) as path:
        ours = load_section(ReconstructParams, "reconstruct", path)
    want = bench.make_params("nerf", load_scene(poses), "auto", ["nerf.ema_decay=0.9"], torch.device("cpu"))
    assert ours.nerf == want.nerf and (ours.method, ours.steps, ours.batch_rays) == (want.method, want.steps, want.batch_rays)
    bench_only = {"device", "eval_every", "tensorboard", "distributed"}
    differ = {f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(want, f.name)}
    assert differ <= bench_only, differ
    with pytest.raises(SystemExit, match="nerf.seed_x"):
        bench.main(["--poses", f"tiny={poses}", "--print-sets", "--set", "nerf.seed_x=1"])
