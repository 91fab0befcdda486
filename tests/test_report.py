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
from stages.common.params import ParamsError, from_dict
from test_evaluate import FakeModel, make_model_dir, make_poses


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
    evaluate.run(evaluate.EvaluateParams(chunk_rays=1024), poses, model_dir, tmp_path / "evaluate",
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
    assert len(pics) == 4 and "assets/training_curve.png" in pics  # 3 view rows + the curve
    for p in pics:
        Image.open(root / "report" / p).verify()
    assert {p.name for p in (root / "report" / "assets").iterdir()} == {Path(p).name for p in pics}

    # html: opens offline: no external references, every image a PNG data URI
    assert not re.search(r"https?://", page, re.I)
    assert not re.search(r"<(script|link|iframe)\b", page, re.I)
    assert re.search(r"""\b(src|href)\s*=\s*["'](?!data:)""", page) is None
    srcs = re.findall(r"<img\b[^>]*\bsrc=\"([^\"]*)\"", page)
    assert len(srcs) == len(re.findall(r"<img\b", page)) == 4
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        im = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1], validate=True)))
        assert im.format == "PNG"
        im.load()
    for cls in ("summary", "per-view", "environment"):
        assert f'<table class="{cls}">' in page
    # the numbers a reader looks for
    ev = json.loads((root / "metrics" / "evaluate.json").read_text())
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
    row = report.view_row(gt, rd, "view_002.png", "PSNR 20 dB")
    h, w = gt.shape[:2]
    assert row.size[1] > h and row.size[0] > 3 * w
    cols = report.read_train_csv(root / "plots" / "train.csv")
    assert math.isnan(cols["test_psnr"][0]) and cols["test_psnr"][49] == pytest.approx(cols["psnr"][49] - 1.5, abs=1e-3)
    assert report.training_curve(cols).size == (1120, 340)


def test_colormap_and_error_scale():
    lut = report.colormap(np.array([0.0, 1.0, -1.0, 2.0]))
    assert lut.dtype == np.uint8 and lut.shape == (4, 3)
    np.testing.assert_array_equal(lut[0], [0, 0, 4])  # black at 0
    np.testing.assert_array_equal(lut[1], [252, 255, 164])  # pale yellow at the top
    np.testing.assert_array_equal(lut[2], lut[0])  # clipped
    np.testing.assert_array_equal(lut[3], lut[1])
    gt = np.zeros((2, 2, 3), np.uint8)
    rd = np.full((2, 2, 3), round(255 * report.ERROR_MAX), np.uint8)  # error at the top of the scale
    np.testing.assert_array_equal(report.error_image(rd, gt)[0, 0], [252, 255, 164])
    assert report.nice_ticks(0, 0.25, 5)[0] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]


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
    assert len(re.findall(r"<img\b", page)) == 2  # one view + the curve


def test_missing_optional_inputs_and_errors(pipeline, capsys):
    root = pipeline
    (root / "plots" / "train.csv").unlink()
    (root / "metrics" / "poses.json").unlink()
    out = report.run(report.ReportParams(max_views=1), root / "evaluate", root / "metrics",
                     root / "plots" / "train.csv", root / "poses", root / "report")
    page = out["html"].read_text()
    assert "train.csv not found" in page and "poses.json missing" in page
    (root / "metrics" / "evaluate.json").unlink()
    params = root / "params.yaml"
    params.write_text("report:\n  max_views: 2\n")
    assert report.main(_args(root) + ["--params", str(params)]) == 1
    assert "evaluate.json: missing" in capsys.readouterr().err
    with pytest.raises(ParamsError, match="report.max_views: must be >= 1"):
        from_dict(report.ReportParams, {"max_views": 0}, "report")
