"""The report stage on the outs of a fake evaluate run: Markdown + self-contained HTML."""
from __future__ import annotations

import base64
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stages import evaluate, report
from stages.common import plots
from stages.common.params import ParamsError, from_dict
from test_evaluate import H, W, FakeModel, make_model_dir, make_poses


def _write_train_csv(path: Path, steps: int = 200, eval_every: int = 50) -> None:
    lines = ["step,loss,psnr,test_psnr,lr,elapsed_s,samples_per_s"]
    for s in range(1, steps + 1):
        loss = 0.05 * math.exp(-s / 60) + 0.002
        test = f"{-10 * math.log10(loss) - 1.5:.4f}" if s % eval_every == 0 else ""
        lines.append(f"{s},{loss:.6f},{-10 * math.log10(loss):.4f},{test},0.01,{0.01 * s:.3f},120000")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture()
def pipeline(tmp_path):
    """poses + fake evaluate outs + metrics + train.csv, as the report stage finds them."""
    poses = tmp_path / "poses"
    make_poses(poses, n=9)  # test views: view_000, 002, 004, 006, 008
    model_dir = make_model_dir(tmp_path / "reconstruct")
    metrics = tmp_path / "metrics"
    evaluate.run(evaluate.EvaluateParams(chunk_rays=1024, orbit_frames=4, orbit_size=16), poses, model_dir,
                 tmp_path / "evaluate",
                 metrics / "evaluate.json", model=FakeModel(poses, shift=0.03), params_path=None)
    (metrics / "poses.json").write_text(json.dumps({  # the layout stages/poses.py writes
        "num_images": 9, "num_registered": 9, "registered_fraction": 1.0, "num_points": 1500,
        "mean_reprojection_error_px": 0.61, "center_error_mean": 0.0012, "center_error_max": 0.003,
        "rotation_error_mean_deg": 0.12, "rotation_error_max_deg": 0.31, "unregistered": [],
        "time_s": {"total": 3.2}}))
    (metrics / "reconstruct.json").write_text(json.dumps({"steps": 200, "train_time_s": 12.5, "device": "cpu"}))
    (tmp_path / "plots").mkdir()
    _write_train_csv(tmp_path / "plots" / "train.csv")
    return tmp_path


def _args(root: Path) -> list[str]:
    return ["--evaluate", str(root / "evaluate"), "--metrics-dir", str(root / "metrics"),
            "--plots", str(root / "plots" / "train.csv"), "--poses", str(root / "poses"),
            "--out", str(root / "report")]


def test_report_md_and_self_contained_html(pipeline):
    root = pipeline
    out = report.run(report.ReportParams(max_views=3), root / "evaluate", root / "metrics",
                     root / "plots" / "train.csv", root / "poses", root / "report", scene="unit", test_every=2)
    assert out["views"] == 3
    md = (root / "report" / "report.md").read_text()
    page = (root / "report" / "report.html").read_text()
    assert out["html"] == (root / "report" / "report.html").resolve()

    # markdown: tables, and every picture it names exists beside it
    assert "# Reconstruction report: unit, nerf" in md
    assert "| stage | metric | value |" in md and "| file | PSNR (dB) | SSIM | render time (s) |" in md
    pics = re.findall(r"!\[[^\]]*\]\((assets/[^)]+)\)", md)
    assert len(pics) == 5 and "assets/training_curve.png" in pics  # 3 view rows + the orbit + the curve
    orbit = next(p for p in pics if Path(p).stem == "orbit")
    assert f"]({orbit})" in md.replace(f"![orbit animation]({orbit})", "")  # linked as well as shown
    for p in pics:
        Image.open(root / "report" / p).verify()
    assert {p.name for p in (root / "report" / "assets").iterdir()} == {Path(p).name for p in pics}

    # html: opens offline: no external references, every image a PNG data URI
    assert not re.search(r"https?://", page, re.I)
    assert not re.search(r"<(script|link|iframe)\b", page, re.I)
    assert re.search(r"""\b(src|href)\s*=\s*["'](?!data:)""", page) is None
    srcs = re.findall(r"<img\b[^>]*\bsrc=\"([^\"]*)\"", page)
    assert len(srcs) == len(re.findall(r"<img\b", page)) == 5
    formats = []
    for src in srcs:
        m = re.match(r"data:image/(png|webp|gif);base64,", src)
        assert m, src[:40]
        im = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1], validate=True)))
        assert im.format == m.group(1).upper()
        im.load()
        formats.append(im.format)
    assert sorted(formats)[:4] == ["PNG"] * 4
    assert sum(getattr(Image.open(io.BytesIO(base64.b64decode(s_.split(",", 1)[1]))), "n_frames", 1) > 1
               for s_ in srcs) == 1  # one animation: the orbit
    for cls in ("summary", "per-view", "environment"):
        assert f'<table class="{cls}">' in page
    assert "No published numbers are recorded for scene 'unit'" in md
    assert "<h2>Reproduce</h2>" in page and "dvc repro" in md and "params_sha256" in md
    # the numbers a reader looks for
    ev = json.loads((root / "metrics" / "evaluate.full.json").read_text())  # the evaluate stage's full record
    assert f"{ev['psnr']:.2f} ± {ev['psnr_std']:.2f} dB" in page
    assert f"{ev['ssim']:.4f}" in page
    assert "every 2nd image in sorted-name order is a test view" in page
    assert "<td>registered images</td><td>9 / 9 (100%)</td>" in page
    assert "0.120 / 0.310 deg" in page and "0.61" in page
    assert "12.5 s" in page  # train time from reconstruct.json
    assert "not computed: no LPIPS weights configured" in page
    for view in ("view_000.png", "view_004.png", "view_008.png"):  # evenly spaced picks of 5
        assert f"row_{Path(view).stem}.png" in {p.name for p in out["assets"]}


def test_view_row_and_curve_pictures(pipeline):
    root = pipeline
    gt = np.array(Image.open(root / "poses" / "images" / "view_002.png"))
    rd = np.array(Image.open(root / "evaluate" / "renders" / "view_002.png"))
    row = plots.view_row(gt, rd, "view_002.png", "PSNR 20 dB")
    h, w = gt.shape[:2]
    assert row.size[1] > h and row.size[0] > 3 * w
    cols = report.read_train_csv(root / "plots" / "train.csv")
    assert math.isnan(cols["test_psnr"][0]) and cols["test_psnr"][49] == pytest.approx(cols["psnr"][49] - 1.5, abs=1e-3)
    assert plots.training_curve(cols).size == (1120, 340)


def test_colormap_and_error_scale():
    lut = plots.colormap(np.array([0.0, 1.0, -1.0, 2.0]))
    assert lut.dtype == np.uint8 and lut.shape == (4, 3)
    np.testing.assert_array_equal(lut[0], [0, 0, 4])  # black at 0
    np.testing.assert_array_equal(lut[1], [252, 255, 164])  # pale yellow at the top
    np.testing.assert_array_equal(lut[2], lut[0])  # clipped
    np.testing.assert_array_equal(lut[3], lut[1])
    gt = np.zeros((2, 2, 3), np.uint8)
    rd = np.full((2, 2, 3), round(255 * plots.ERROR_MAX), np.uint8)  # error at the top of the scale
    np.testing.assert_array_equal(plots.error_image(rd, gt)[0, 0], [252, 255, 164])
    assert plots.nice_ticks(0, 0.25, 5)[0] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]


def test_encode_animation():
    frames = [np.full((6, 8, 3), 40 * k, np.uint8) for k in range(3)]
    data, ext = plots.encode_animation(frames, 50)
    im = Image.open(io.BytesIO(data))
    assert ext in ("webp", "gif") and im.format == ext.upper() and im.n_frames == 3 and im.size == (8, 6)
    with pytest.raises(ValueError, match="at least one frame"):
        plots.encode_animation([])
    with pytest.raises(ValueError, match="share one"):
        plots.encode_animation([frames[0], np.zeros((5, 8, 3), np.uint8)])


def test_main_prints_report_path_last(pipeline, capsys):
    root = pipeline
    params = root / "params.yaml"
    params.write_text("ingest:\n  photos: ../shared/data/fern/images_8\nposes:\n  test_every: 2\n"
                      "report:\n  max_views: 1\n")
    assert report.main(_args(root) + ["--params", str(params)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"Report: {(root / 'report' / 'report.html').resolve()}"
    page = (root / "report" / "report.html").read_text()
    assert "Reconstruction report: fern, nerf" in page
    assert len(re.findall(r"<img\b", page)) == 3  # one view + the orbit + the curve
    assert "25.17" in page and "PUBLISHED" in page  # fern's published numbers


def test_missing_optional_inputs_and_errors(pipeline, capsys):
    root = pipeline
    (root / "plots" / "train.csv").unlink()
    (root / "metrics" / "poses.json").unlink()
    out = report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                     root / "plots" / "train.csv", root / "poses", root / "report")
    page = out["html"].read_text()
    assert "train.csv not found" in page and "poses.json missing" in page
    (root / "metrics" / "evaluate.json").unlink()
    (root / "metrics" / "evaluate.full.json").unlink()
    params = root / "params.yaml"
    params.write_text("report:\n  max_views: 2\n")
    assert report.main(_args(root) + ["--params", str(params)]) == 1
    assert "evaluate.json: missing" in capsys.readouterr().err
    with pytest.raises(ParamsError, match="report.max_views: must be >= 1"):
        from_dict(report.ReportParams, {"max_views": 0}, "report")


# ---------------------------------------------------------------- published numbers, scaling, reproduce


def test_published_numbers_for_lego_flag_protocol_differences(pipeline):
    root = pipeline
    out = report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                     root / "plots" / "train.csv", root / "poses", root / "report", scene="lego")
    assert out["published"] == 3
    page, md = out["html"].read_text(), out["md"].read_text()
    assert '<table class="published">' in page and '<table class="ours">' in page
    assert "PUBLISHED figures" in md and "Published (not this run)" in md
    for text in ("32.54", "36.39", "35.78", "NVIDIA V100", "RTX 3090", "A6000", "Mildenhall", "Müller", "Kerbl"):
        assert text in md, text
    # our test views are 32x24: the papers' 800x800 is flagged, as is the number of test views
    assert f"resolution: ours {W}x{H}, published 800x800" in md
    assert "test views: ours 5, published 200" in md


def test_published_numbers_lookup_and_fox_has_none(pipeline):
    refs = report.load_references()
    assert refs["lego"]["name"] == "lego" and refs["blender/lego"]["name"] == "lego"
    assert refs["fern"]["results"][0]["psnr"] == 25.17 and refs["fox"]["results"] == []
    for entry in refs.values():
        for r in entry["results"]:
            assert r["source"] and r["gpu"] and r["method"]
    root = pipeline
    out = report.run(report.ReportParams(max_views=1, scene="fox"), root / "evaluate", root / "metrics",
                     root / "plots" / "train.csv", root / "poses", root / "report", scene="ignored")
    page = out["html"].read_text()
    assert out["published"] == 0 and "no published numbers" in page and "Reconstruction report: fox" in page


def test_scene_names():
    assert report._scene_name("../shared/data/fern/images_8") == "fern"
    assert report._scene_name("../shared/data/lego/train") == "lego"
    assert report._scene_name("../shared/data/fox/images") == "fox"
    assert report._scene_name("/photos/my_garden") == "my_garden"
    assert report._scene_name("data/scene/images") == "default scene (generated)"


def test_scaling_rows_speedup_and_efficiency():
    runs = [{"gpus": 4, "wall_s": 40.0, "samples_per_s": 3.6e6, "psnr": 26.9, "host": "a"},
            {"gpus": 1, "wall_s": 100.0, "samples_per_s": 1.0e6, "psnr": 27.0},
            {"gpus": 2, "wall_s": 60.0, "samples_per_s": 1.9e6, "psnr": None}]
    rows = report.scaling_rows(runs)
    assert [r["gpus"] for r in rows] == [1, 2, 4]
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.9, 3.6])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.95, 0.9])
    assert rows[0]["delta_psnr"] == 0.0 and rows[1]["delta_psnr"] is None
    assert rows[2]["delta_psnr"] == pytest.approx(-0.1) and rows[2]["host"] == "a"
    assert {r["speedup_basis"] for r in rows} == {"samples_per_s"}
    assert runs[0].get("speedup") is None  # inputs untouched

    # smallest count 2: counted from one GPU with the 2-GPU run taken as perfectly efficient
    rows = report.scaling_rows([{"gpus": 2, "wall_s": 50.0, "samples_per_s": 2e6},
                                {"gpus": 8, "wall_s": 20.0, "samples_per_s": 6e6}])
    assert [r["speedup"] for r in rows] == pytest.approx([2.0, 6.0])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.75])

    # samples/s everywhere: no wall time needed
    rows = report.scaling_rows([{"gpus": 1, "wall_s": None, "samples_per_s": 1.0}, {"gpus": 2, "samples_per_s": 1.5}])
    assert rows[1]["speedup"] == pytest.approx(1.5)
    # without samples/s everywhere: 1 / wall time
    rows = report.scaling_rows([{"gpus": 1, "wall_s": 100.0}, {"gpus": 2, "wall_s": 50.0, "samples_per_s": 1.0}])
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[1]["speedup_basis"] == "wall_s"
    # training rays/s first: samples per ray differ between runs (occupancy grid at another state)
    rows = report.scaling_rows([{"gpus": 1, "wall_s": 15.7, "rays_per_s": 1.04e6, "samples_per_s": 29.4e6},
                                {"gpus": 2, "wall_s": 9.1, "rays_per_s": 1.80e6, "samples_per_s": 29.9e6}])
    assert rows[1]["speedup_basis"] == "rays_per_s" and rows[1]["speedup"] == pytest.approx(1.80 / 1.04)


@pytest.mark.parametrize("runs, match", [
    ([], "non-empty list"),
    ([{"gpus": 0, "wall_s": 1.0}], "scaling run 0: 'gpus' must be an integer >= 1, got 0"),
    ([{"gpus": 1, "wall_s": 1.0}, {"gpus": True, "wall_s": 1.0}], "scaling run 1: 'gpus'"),
    ([{"gpus": 1}], "scaling run 0: 'wall_s' is missing"),
    ([{"gpus": 1, "samples_per_s": 1.0}, {"gpus": 2, "wall_s": 1.0}], "scaling run 0: 'wall_s' is missing"),
    ([{"gpus": 1, "wall_s": -2}], "'wall_s' must be > 0"),
    ([{"gpus": 1, "wall_s": 1.0, "samples_per_s": "fast"}], "'samples_per_s' must be a finite number"),
    ([{"gpus": 1, "wall_s": 1.0, "psnr": float("nan")}], "'psnr' must be a finite number"),
])
def test_scaling_rows_rejects_bad_runs(runs, match):
    with pytest.raises(ValueError, match=match):
        report.scaling_rows(runs)


def test_read_scaling_takes_one_scene_or_bench_scalings_several(tmp_path):
    runs = [{"gpus": 1, "wall_s": 20.0}, {"gpus": 2, "wall_s": 10.5}]
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"scene": "lego", "method": "nerf", "runs": runs}))
    several = tmp_path / "several.json"
    several.write_text(json.dumps({"scenes": [{"scene": "a", "method": "nerf", "runs": runs},
                                              {"scene": "b", "method": "nerf", "runs": runs[:1]}]}))
    assert [t["scene"] for t in report.read_scaling(one)] == ["lego"]
    tables = report.read_scaling(several)
    assert [t["scene"] for t in tables] == ["a", "b"] and len(tables[1]["rows"]) == 1
    assert tables[0]["rows"][1]["speedup"] == pytest.approx(20.0 / 10.5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scenes": [{"scene": "a", "runs": runs}, {"scene": "b", "runs": [{"gpus": 1}]}]}))
    with pytest.raises(ValueError, match=r"bad.json \(scene 'b'\): scaling run 0: 'wall_s' is missing"):
        report.read_scaling(bad)
    bad.write_text(json.dumps({"scenes": []}))
    with pytest.raises(ValueError, match="expected"):
        report.read_scaling(bad)


def test_scaling_table_from_the_command_line(pipeline, capsys):
    root = pipeline
    scaling = root / "scaling.json"
    scaling.write_text(json.dumps({"scene": "unit", "method": "nerf", "runs": [
        {"gpus": 1, "wall_s": 300.0, "samples_per_s": 2.0e7, "psnr": 27.3},
        {"gpus": 2, "wall_s": 310.0, "samples_per_s": 3.8e7, "psnr": 27.1}]}))
    params = root / "params.yaml"
    params.write_text("report:\n  max_views: 1\n  scene: unit\n")
    assert report.main(_args(root) + ["--params", str(params), "--scaling", str(scaling)]) == 0
    page = (root / "report" / "report.html").read_text()
    assert '<table class="scaling">' in page
    assert "<td>2</td><td>310.0</td><td>n/a</td><td>38,000,000</td><td>1.90x</td><td>95%</td><td>27.10</td><td>-0.20</td>" in page
    md = (root / "report" / "report.md").read_text()
    assert "| GPUs | wall time (s) | rays/s | samples/s | speedup | efficiency | PSNR (dB) | ΔPSNR (dB) |" in md
    # two files (weak and strong scaling, as bench_scaling.py writes them): one titled table each
    strong = root / "strong.json"
    strong.write_text(json.dumps({"scene": "unit", "method": "nerf", "mode": "strong", "global_batch_rays": 16384,
                                  "runs": [{"gpus": 1, "wall_s": 10.0, "rays_per_s": 1.6e6, "psnr": 20.0},
                                           {"gpus": 2, "wall_s": 6.0, "rays_per_s": 2.7e6, "psnr": 20.0}]}))
    assert report.main(_args(root) + ["--params", str(params), "--scaling", str(scaling), "--scaling", str(strong)]) == 0
    md = (root / "report" / "report.md").read_text()
    assert md.count("## Scaling") == 1 and "### unit, nerf, strong (16384 rays per step)" in md
    assert "same steps with the same global batch (16384 rays per step" in md
    assert "| 2 | 6.0 | 2,700,000 | n/a | 1.69x | 84% | 20.00 | +0.00 |" in md
    # files named in params.yaml (report.scaling) come first, with where and on what they were measured
    strong_doc = json.loads(strong.read_text())
    for r in strong_doc["runs"]:
        r["gpu_name"] = "NVIDIA H200"
    strong.write_text(json.dumps(strong_doc))
    params.write_text(f"report:\n  max_views: 1\n  scene: unit\n  scaling: [{strong}]\n")
    assert report.main(_args(root) + ["--params", str(params), "--scaling", str(scaling)]) == 0
    md = (root / "report" / "report.md").read_text()
    assert md.index("### unit, nerf, strong") < md.index("### unit, nerf, scaling")
    assert f"Measured on NVIDIA H200 GPUs by benchmarks/bench_scaling.py: {strong.as_posix()}." in md
    params.write_text(f"report:\n  max_views: 1\n  scene: unit\n  scaling: [{root / 'gone.json'}]\n")
    assert report.main(_args(root) + ["--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert "scaling file not found" in err and "gone.json" in err
    params.write_text("report:\n  max_views: 1\n  scene: unit\n")
    # a bad file: a clear error naming it, exit code 1
    scaling.write_text(json.dumps({"runs": [{"gpus": 1}]}))
    assert report.main(_args(root) + ["--params", str(params), "--scaling", str(scaling)]) == 1
    err = capsys.readouterr().err
    assert "scaling.json: scaling run 0: 'wall_s' is missing" in err
    assert report.main(_args(root) + ["--params", str(params), "--scaling", str(root / "absent.json")]) == 1
    assert "scaling file not found" in capsys.readouterr().err


def test_other_scenes_scaling_only_in_an_appendix(pipeline):
    """params.yaml's report.scaling (the committed 2xH200 runs of default, lego and fox): a report of
    the default scene shows the default scene's tables under "Scaling" and the others only in the
    closing appendix, which names their scene and GPUs; a scene with no runs has no "Scaling"."""
    root = pipeline
    results = Path(report.__file__).resolve().parents[1] / "benchmarks" / "results"
    files = [results / f"scaling_{n}_2xH200.json" for n in ("weak", "strong", "lego_weak32k")]
    args = (report.ReportParams(max_views=1), root / "evaluate", root / "metrics", root / "plots" / "train.csv",
            root / "poses", root / "report")
    md = report.run(*args, scene="default scene (generated)", scaling=files)["md"].read_text()
    body, appendix = md.split("\n## Appendix: scaling measured on other scenes\n")
    ours = body[body.index("\n## Scaling\n"):body.index("\n## Environment\n")]
    assert ours.count("\n### default, nerf, ") == 2 and "lego" not in ours and "fox" not in ours
    assert "not this run" in ours.lower() and "Measured on NVIDIA H200 GPUs" in ours
    assert appendix.count("\n### lego, nerf, ") == 2 and appendix.count("\n### fox, nerf, ") == 1
    assert "default, nerf" not in appendix and "Measured on NVIDIA H200 GPUs" in appendix
    assert "Not this report's scene ('default scene (generated)') and not this run" in appendix
    md = report.run(*args, scene="fern", scaling=files)["md"].read_text()
    assert "\n## Scaling\n" not in md and md.count("\n### default, nerf, ") == 2  # all in the appendix
    assert md.index("## Appendix: scaling measured on other scenes") > md.index("## All metrics")


def test_reproduce_block_names_revision_seed_and_hash():
    ev = {"seed": 3, "device": "cuda", "gpu_name": "NVIDIA H200", "gpu_count": 2, "world_size": 2}
    env = {"code_revision": "abc123", "code_dirty": True, "params_sha256": "f" * 64,
           "params_sha256_of": "canonical JSON of params.yaml sections seed+reconstruct+evaluate",
           "libraries": {"torch": "2.5.0", "numpy": "2.1.0", "kornia": None}, "python_version": "3.11.7",
           "gpu_driver": "550.54.15", "cuda_version": "12.4"}
    text, notes = report.reproduce_block(ev, env, "../shared/data/fern/images_8")
    assert text.splitlines()[0] == "git checkout abc123" and "dvc repro" in text
    joined = " ".join(notes)
    for fact in ("UNCOMMITTED", "f" * 64, "seed 3", "outside the repository", "torch 2.5.0", "numpy 2.1.0",
                 "NVIDIA H200 x2", "550.54.15", "CUDA 12.4"):
        assert fact in joined, fact
    assert "kornia" not in joined


# ---------------------------------------------------------------- bad input


def test_missing_render_is_named(pipeline):
    root = pipeline
    (root / "evaluate" / "renders" / "view_006.png").unlink()  # not among the views shown with max_views=1
    with pytest.raises(ValueError, match=r"view_006.png: missing render of test view view_006.png"):
        report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                   root / "plots" / "train.csv", root / "poses", root / "report")
    assert not (root / "report").exists()


def test_render_of_the_wrong_size_is_named(pipeline):
    root = pipeline
    Image.new("RGB", (10, 10)).save(root / "evaluate" / "renders" / "view_002.png")
    with pytest.raises(ValueError, match=r"view_002.png is 10x10 but its ground truth .*view_002.png is 32x24"):
        report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                   root / "plots" / "train.csv", root / "poses", root / "report")


def test_empty_test_split_is_named(pipeline):
    root = pipeline
    (root / "evaluate" / "per_view.json").write_text("[]")
    with pytest.raises(ValueError, match=r"per_view.json: lists no test views"):
        report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                   root / "plots" / "train.csv", root / "poses", root / "report")


def test_missing_orbit_is_named(pipeline):
    root = pipeline
    ev = json.loads((root / "metrics" / "evaluate.full.json").read_text())
    (root / "evaluate" / ev["orbit"]["file"]).unlink()
    with pytest.raises(ValueError, match=rf"{ev['orbit']['file']}: missing; evaluate.json names it"):
        report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                   root / "plots" / "train.csv", root / "poses", root / "report")


def test_method_benchmarks_read_and_compare_to_their_peer(tmp_path):
    from stages.report import benchmark_rows, read_benchmark

    path = tmp_path / "bench.json"
    rows = [{"scene": "lego", "steps": 7000, "impl": "rayforge", "train_s": 30.0, "psnr": 31.7, "ssim": 0.97,
             "gaussians": 116197, "peak_gb": 0.36, "fps": 381},
            {"scene": "lego", "steps": 7000, "impl": "gsplat", "train_s": 40.0, "psnr": 24.5, "ssim": 0.90,
             "gaussians": 256223, "peak_gb": 0.54, "fps": 347}]
    path.write_text(json.dumps({"environment": {"gpu": "NVIDIA H200"}, "rows": rows}))
    doc = read_benchmark(path)
    table = benchmark_rows(doc["rows"])
    assert table[0][:5] == ["lego", "7,000", "rayforge", "30.0", "0.75x gsplat's"]
    assert table[1][4] == "1.33x rayforge's" and table[1][5] == "24.50"
    assert table[0][-1] == "381"  # FPS without decimals...
    slow = dict(rows[0], fps=0.061)
    assert benchmark_rows([slow])[0][-1] == "0.06"  # ...unless that would print a CPU's 0.06 views/s as 0
    assert doc["protocol"] is None and doc["peer"] is None  # the report then uses the side-by-side wording
    # a named peer: every other row is timed against it, the peer row itself against nothing
    eager = dict(rows[0], impl="rayforge-eager", train_s=60.0)
    named = benchmark_rows([rows[0], eager, rows[1]], peer="gsplat")
    assert [r[4] for r in named] == ["0.75x gsplat's", "1.50x gsplat's", ""]
    assert benchmark_rows([rows[0], eager, rows[1]])[0][4] == "0.50x rayforge-eager's"
    path.write_text(json.dumps({"environment": {}, "rows": rows, "protocol": "snapshots at wall-clock budgets"}))
    assert read_benchmark(path)["protocol"] == "snapshots at wall-clock budgets"
    path.write_text(json.dumps({"rows": [{"scene": "lego"}]}))
    with pytest.raises(ValueError, match="expected"):
        read_benchmark(path)


def test_snapshots_at_budgets_compare_psnr_at_the_same_time():
    """Rows that all carry a wall-clock budget pair up by budget (and poses), and the column gives the
    PSNR difference to the peer at that budget, not a ratio of (equal) times."""
    from stages.report import benchmark_rows, vs_header

    rows = [{"scene": "fox", "steps": 9000, "impl": "rayforge nerf", "budget_s": 60.0, "train_s": 60.1, "psnr": 31.3},
            {"scene": "fox", "steps": 5000, "impl": "rayforge 3dgs", "budget_s": 60.0, "train_s": 60.2, "psnr": 32.1},
            {"scene": "fox", "steps": 9100, "impl": "rayforge nerf (seed 1)", "budget_s": 60.0, "train_s": 60.0,
             "psnr": 31.5, "poses_md5": "other"},
            {"scene": "fox", "steps": 18000, "impl": "rayforge nerf", "budget_s": 120.0, "train_s": 120.0, "psnr": 31.7}]
    table = benchmark_rows(rows, peer="rayforge 3dgs")
    assert vs_header(rows) == "PSNR vs peer, same time"
    assert table[0][4] == "-0.80 dB vs rayforge 3dgs"
    assert table[1][4] == ""  # the peer itself
    assert table[2][4] == ""  # trained on other poses: no pair
    assert table[3][4] == ""  # no peer row at 120 s
    assert vs_header([{k: v for k, v in r.items() if k != "budget_s"} for r in rows]) == "time vs peer"


def test_method_benchmarks_show_seeds_and_other_runs(tmp_path):
    """A benchmark's seeds summary and its other_runs blocks with rows of the table's shape are
    read for the appendix; blocks without such rows are left out."""
    from stages.report import read_benchmark, seed_summary_rows

    row = {"scene": "lego", "steps": 7000, "impl": "rayforge", "train_s": 16.0, "psnr": 32.9}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({
        "rows": [row, dict(row, impl="gsplat", train_s=34.0)],
        "seeds": {"note": "seeds 1 and 2", "rows": [dict(row, seed=1)],
                  "summary": {"lego": {"rayforge": [32.78, 3], "gsplat": [32.92, 3]}, "fox": {"gsplat": [31.75, 3]}}},
        "other_runs": {"no_reset": {"note": "reset off", "rows": [dict(row, impl="rayforge, reset off")]},
                       "memory": {"note": "no rows of the table's shape", "rows": [{"peak_gb": 0.4}]},
                       "text": "a string"}}))
    doc = read_benchmark(path)
    assert [(b["name"], b["note"], len(b["rows"])) for b in doc["extra"]] == [("seeds", "seeds 1 and 2", 1),
                                                                              ("no_reset", "reset off", 1)]
    header, rows = seed_summary_rows(doc["seed_summary"])
    assert header == ["scene", "rayforge", "gsplat"]
    assert rows == [["lego", "32.78 dB (3)", "32.92 dB (3)"], ["fox", "", "31.75 dB (3)"]]
    path.write_text(json.dumps({"rows": [row]}))
    assert read_benchmark(path)["extra"] == [] and read_benchmark(path)["seed_summary"] is None
