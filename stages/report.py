"""Report stage: one Markdown and one self-contained HTML page with the run's numbers and pictures.

    python -m stages.report --evaluate data/evaluate --metrics-dir data/metrics \
        --plots data/plots/train.csv --poses data/poses --out data/report [--params params.yaml]

Writes ``<out>/report.md`` with its pictures in ``<out>/assets/*.png``, and
``<out>/report.html`` with the same pictures embedded as ``data:`` URIs and inline CSS,
so that page opens offline and can be mailed or attached as a CI/Prefect artifact on its
own. Contents: a summary table (poses, reconstruct, evaluate), the protocol (split,
resolution, metric definitions), per-view scores, for up to ``report.max_views`` test
views a row ground truth | render | error heatmap, the training curves of
``train.csv``, the environment, and every scalar of the metrics files.

Pictures are drawn with numpy and PIL only (no matplotlib). The last line printed by
``main`` is ``Report: <absolute path of report.html>``.
"""
from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import json
import logging
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from stages.common.io import atomic_dir, atomic_write_bytes, atomic_write_text
from stages.common.params import DEFAULT_PARAMS, check, from_dict, read_yaml

log = logging.getLogger("report")

ERROR_MAX = 0.25  # error heatmap scale: |render - gt| (mean over RGB) from 0 to this
SMOOTH_ABOVE = 200  # a curve of more points is drawn pale with its running mean on top
PANEL_MAX = 400  # longest side of a GT / render / error panel in the report, pixels: larger images shrink
PANEL_MIN = 240  # ... and smaller ones grow by a whole factor to at least this
# inferno (matplotlib), sampled at 9 evenly spaced points; linear in between
_INFERNO = np.array([[0, 0, 4], [31, 12, 72], [85, 15, 109], [136, 34, 106], [186, 54, 85], [227, 89, 51],
                     [249, 140, 10], [249, 201, 50], [252, 255, 164]], dtype=np.float64)


@dataclass
class ReportParams:
    """Section ``report`` of params.yaml."""

    max_views: int = 6  # test views shown as GT | render | error rows

    def __post_init__(self) -> None:
        check(self.max_views >= 1, "max_views", "must be >= 1", self.max_views)


# ---------------------------------------------------------------- pictures


def colormap(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] [...] -> RGB uint8 [..., 3] (inferno: black, purple, orange, pale yellow)."""
    t = np.clip(np.nan_to_num(x), 0.0, 1.0) * (len(_INFERNO) - 1)
    i = np.minimum(np.floor(t).astype(int), len(_INFERNO) - 2)
    f = (t - i)[..., None]
    return np.round(_INFERNO[i] * (1 - f) + _INFERNO[i + 1] * f).astype(np.uint8)


def error_image(render: np.ndarray, gt: np.ndarray, vmax: float = ERROR_MAX) -> np.ndarray:
    """|render - gt| averaged over RGB, colour-mapped on the fixed scale [0, vmax]; uint8 [H, W, 3]."""
    err = np.abs(render.astype(np.float64) - gt.astype(np.float64)).mean(axis=-1) / 255.0
    return colormap(err / vmax)


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _fmt_tick(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    return f"{v:.{decimals}f}" if abs(v) < 1e6 else f"{v:.2g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], float]:
    """About ``n`` round tick values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo], 1.0
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]
    return [round(t, 12) for t in ticks], step


def view_row(gt: np.ndarray, render: np.ndarray, title: str, caption: str) -> Image.Image:
    """One report row: ground truth | render | error heatmap, two label lines each, and a colour bar.

    Args:
        gt: ground truth uint8 [H, W, 3].
        render: the render uint8 [H, W, 3].
        title: the view's name, under "ground truth".
        caption: the view's scores, under "render".
    """
    h, w = gt.shape[:2]
    if max(h, w) > PANEL_MAX:  # shrink large photos smoothly
        scale, resample = PANEL_MAX / max(h, w), Image.Resampling.LANCZOS
    else:  # blow small images up by a whole factor, pixels kept sharp, so labels and colour bar fit
        scale, resample = float(math.ceil(PANEL_MIN / max(h, w))), Image.Resampling.NEAREST
    pw, ph = max(1, round(w * scale)), max(1, round(h * scale))
    panels = [Image.fromarray(a) if scale == 1 else Image.fromarray(a).resize((pw, ph), resample)
              for a in (gt, render, error_image(render, gt))]
    gap, band, bar_w, bottom = 8, 36, 70, 8
    font = _font(13)
    row = Image.new("RGB", (3 * pw + 3 * gap + bar_w, band + ph + bottom), "white")
    draw = ImageDraw.Draw(row)
    labels = [("ground truth", title), ("render", caption), ("|error|, mean over RGB", f"scale 0 to {ERROR_MAX:g}")]
    for k, (panel, (head, sub)) in enumerate(zip(panels, labels)):
        x = k * (pw + gap)
        row.paste(panel, (x, band))
        label = Image.new("RGB", (pw, band), "white")  # drawn on its own strip: clipped, never overlapping
        ld = ImageDraw.Draw(label)
        ld.text((1, 2), head, fill=(20, 20, 20), font=font)
        ld.text((1, 18), sub, fill=(90, 90, 90), font=font)
        row.paste(label, (x, 0))
    # colour bar: top = ERROR_MAX, bottom = 0
    x0, y0, bh = 3 * (pw + gap), band, ph
    ramp = colormap(np.linspace(1.0, 0.0, bh))[:, None, :].repeat(14, axis=1)
    row.paste(Image.fromarray(ramp), (x0, y0))
    draw.rectangle([x0, y0, x0 + 13, y0 + bh - 1], outline=(60, 60, 60))
    ticks, step = nice_ticks(0.0, ERROR_MAX, 5)
    for t in ticks:
        y = y0 + round((1 - t / ERROR_MAX) * (bh - 1))
        draw.line([x0 + 14, y, x0 + 18, y], fill=(60, 60, 60))
        draw.text((x0 + 21, y - 7), _fmt_tick(t, step), fill=(30, 30, 30), font=font)
    return row


@dataclass
class Series:
    x: list[float]
    y: list[float]
    color: tuple[int, int, int]
    label: str
    markers: bool = False


def _plot_panel(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], series: list[Series], title: str,
                xlabel: str, log_y: bool, s: int) -> None:
    """One line chart inside ``box`` (x0, y0, x1, y1) of an image drawn at ``s`` times its final size."""
    font, small = _font(15 * s), _font(12 * s)
    x0, y0, x1, y1 = box
    ax0, ay0, ax1, ay1 = x0 + 62 * s, y0 + 32 * s, x1 - 26 * s, y1 - 44 * s  # the plotting area
    draw.text((ax0, y0 + 8 * s), title, fill=(20, 20, 20), font=font)
    pts = [(x, y) for se in series for x, y in zip(se.x, se.y) if math.isfinite(y) and (y > 0 or not log_y)]
    if not pts:
        draw.text((ax0 + 10 * s, (ay0 + ay1) // 2), "no data", fill=(120, 120, 120), font=font)
        return
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xlo, xhi = min(p[0] for p in pts), max(p[0] for p in pts)
    ylo, yhi = min(fy(p[1]) for p in pts), max(fy(p[1]) for p in pts)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    if 0 <= xlo <= 0.05 * (xhi - xlo):  # steps from 1: start the axis at 0
        xlo = 0.0
    pad = 0.05 * (yhi - ylo) if yhi > ylo else (0.5 if log_y else max(abs(yhi) * 0.05, 0.5))
    ylo, yhi = ylo - pad, yhi + pad

    def px(x: float) -> float:
        return ax0 + (x - xlo) / (xhi - xlo) * (ax1 - ax0)

    def py(v: float) -> float:  # v already in axis units (log10 for a log axis)
        return ay1 - (v - ylo) / (yhi - ylo) * (ay1 - ay0)

    grid, ink = (225, 225, 225), (60, 60, 60)
    xt, xstep = nice_ticks(xlo, xhi, 6)
    for t in xt:
        draw.line([px(t), ay0, px(t), ay1], fill=grid, width=s)
        label = _fmt_tick(t, xstep)
        tw = draw.textlength(label, font=small)
        draw.text((px(t) - tw / 2, ay1 + 5 * s), label, fill=ink, font=small)
    if log_y:
        lo, hi = 10**ylo, 10**yhi
        yt = [m * 10.0**k for k in range(math.floor(ylo) - 1, math.ceil(yhi) + 1) for m in (1, 2, 5)
              if lo <= m * 10.0**k <= hi]
        if len(yt) < 2:
            yt, _ = nice_ticks(lo, hi, 4)
        ylabels = [f"{t:.3g}" for t in yt]
        ypos = [py(math.log10(t)) for t in yt if t > 0]
    else:
        yt, ystep = nice_ticks(ylo, yhi, 5)
        ylabels = [_fmt_tick(t, ystep) for t in yt]
        ypos = [py(t) for t in yt]
    for y, label in zip(ypos, ylabels):
        draw.line([ax0, y, ax1, y], fill=grid, width=s)
        tw = draw.textlength(label, font=small)
        draw.text((ax0 - tw - 6 * s, y - 7 * s), label, fill=ink, font=small)
    draw.rectangle([ax0, ay0, ax1, ay1], outline=ink, width=s)
    xw = draw.textlength(xlabel, font=font)
    draw.text(((ax0 + ax1) / 2 - xw / 2, ay1 + 22 * s), xlabel, fill=ink, font=font)
    legend_x = ax1  # legend entries right-aligned in the header band, right to left
    for se in reversed(series):
        lw = draw.textlength(se.label, font=small)
        ly = y0 + 10 * s
        draw.text((legend_x - lw, ly), se.label, fill=ink, font=small)
        draw.line([legend_x - lw - 26 * s, ly + 7 * s, legend_x - lw - 6 * s, ly + 7 * s], fill=se.color,
                  width=3 * s)
        legend_x -= lw + 42 * s
    for se in series:
        xy = [(px(x), py(fy(y))) for x, y in zip(se.x, se.y) if math.isfinite(y) and (y > 0 or not log_y)]
        if not xy:
            continue
        if len(xy) > SMOOTH_ABOVE and not se.markers:
            # noisy per-batch values: the raw line pale, a running mean (in axis units) on top
            pale = tuple(round(c + 0.65 * (255 - c)) for c in se.color)
            draw.line(xy, fill=pale, width=s)
            k = max(2, len(xy) // 50)
            ys = np.convolve([p[1] for p in xy], np.ones(k) / k, mode="valid")
            xy = list(zip([p[0] for p in xy][k // 2:k // 2 + len(ys)], ys.tolist()))
        if len(xy) > 1:
            draw.line(xy, fill=se.color, width=2 * s, joint="curve")
        if se.markers or len(xy) == 1:
            r = 3 * s
            for x, y in xy:
                draw.ellipse([x - r, y - r, x + r, y + r], fill=se.color)


def read_train_csv(path: Path) -> dict[str, list[float]]:
    """Columns of ``train.csv`` as floats; empty cells (test_psnr on most rows) become NaN."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols: dict[str, list[float]] = {name: [] for name in (reader.fieldnames or [])}
        for n, row in enumerate(reader, start=2):
            for name in cols:
                cell = (row.get(name) or "").strip()
                try:
                    cols[name].append(float(cell) if cell else math.nan)
                except ValueError:
                    raise ValueError(f"{path}:{n}: column {name!r} is not a number: {cell!r}") from None
    return cols


def training_curve(cols: dict[str, list[float]]) -> Image.Image:
    """PSNR (train and held-out) and loss against step, two panels side by side."""
    s, pw, ph = 2, 560, 340  # drawn at s x size, then downsampled: smooth lines without anti-aliasing
    img = Image.new("RGB", (2 * pw * s, ph * s), "white")
    draw = ImageDraw.Draw(img)
    step = cols.get("step", [])
    smooth = " (pale: raw, dark: running mean)" if len(step) > SMOOTH_ABOVE else ""
    psnr_series = [Series(step, cols.get("psnr", []), (31, 119, 180), "train batches")]
    if any(math.isfinite(v) for v in cols.get("test_psnr", [])):
        psnr_series.append(Series(step, cols["test_psnr"], (230, 97, 1), "test views", markers=True))
    loss_series = [Series(step, cols.get("loss", []), (44, 160, 44), "loss")]
    _plot_panel(draw, (0, 0, pw * s, ph * s), psnr_series, "PSNR (dB)", "step" + smooth, False, s)
    _plot_panel(draw, (pw * s, 0, 2 * pw * s, ph * s), loss_series, "Training loss (log scale)", "step" + smooth,
                True, s)
    return img.resize((2 * pw, ph), Image.Resampling.LANCZOS)


# ---------------------------------------------------------------- numbers and text


def _read_json(path: Path, required: bool) -> Any:
    if not path.is_file():
        if required:
            raise ValueError(f"{path}: missing; run the evaluate stage first (`dvc repro evaluate`)")
        log.warning("%s: missing; its section of the report is left out", path)
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) and abs(v) < 1e6 else f"{v:.4g}"
    return str(v)


def fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def flatten(doc: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Scalar leaves of a JSON document as (dotted key, value)."""
    if isinstance(doc, dict):
        return [kv for k, v in doc.items() for kv in flatten(v, f"{prefix}{k}.")]
    if isinstance(doc, list):
        return [(prefix[:-1], f"[{len(doc)} items]")]
    return [(prefix[:-1], doc)]


def _pick(docs: list[dict | None], key: str) -> Any:
    for d in docs:
        if isinstance(d, dict) and d.get(key) is not None:
            return d[key]
    return None


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def describe_split(train: list[str], test: list[str], test_every: int | None) -> str:
    names = sorted(set(train) | set(test))
    idx = [i for i, n in enumerate(names) if n in set(test)]
    k = test_every or (idx[1] - idx[0] if len(idx) > 1 else None)
    if k and idx == list(range(0, len(names), k)):
        return (f"every {_ordinal(k)} image in sorted-name order is a test view (index 0, {k}, {2 * k}, ...; the "
                f"llffhold={k} convention): {len(train)} training views, {len(test)} test views")
    return f"test views as listed in split.json: {len(train)} training views, {len(test)} test views"


def poses_summary(m: dict | None) -> list[tuple[str, str]]:
    """The headline rows of the poses metrics (registration, reprojection, pose error if present)."""
    if not isinstance(m, dict):
        return [("metrics", "n/a (poses.json missing)")]
    rows = []
    if m.get("num_registered") is not None:
        total = f" / {m['num_images']}" if m.get("num_images") is not None else ""
        frac = f" ({m['registered_fraction']:.0%})" if isinstance(m.get("registered_fraction"), float) else ""
        rows.append(("registered images", f"{m['num_registered']}{total}{frac}"))
    if m.get("num_points") is not None:
        rows.append(("sparse points", fmt(m["num_points"])))
    if m.get("mean_reprojection_error_px") is not None:
        rows.append(("mean reprojection error", f"{fmt(m['mean_reprojection_error_px'], 3)} px"))
    if m.get("center_error_mean") is not None:
        rows.append(("pose error, camera centre (mean / max)",
                     f"{fmt(m['center_error_mean'], 4)} / {fmt(m.get('center_error_max'), 4)} of the scene radius"))
    if m.get("rotation_error_mean_deg") is not None:
        rows.append(("pose error, rotation (mean / max)",
                     f"{fmt(m['rotation_error_mean_deg'], 3)} / {fmt(m.get('rotation_error_max_deg'), 3)} deg"))
    if m.get("focal_error_rel") is not None:
        rows.append(("focal length error", f"{100 * m['focal_error_rel']:.2f} %"))
    if not rows:  # another layout: whatever looks like registration or error
        rows = [(k, fmt(v)) for k, v in flatten(m) if ("regist" in k.lower() or "err" in k.lower())
                and not isinstance(v, str)]
    return rows or [("metrics", "no registration or pose error keys")]


def _select(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)``."""
    return list(range(n)) if n <= k else sorted({round(i) for i in np.linspace(0, n - 1, k)})


# ---------------------------------------------------------------- the documents


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in esc]) + "\n"


def _html_table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>\n" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>\n'


_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;max-width:1360px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}th,td{border:1px solid #d0d0d0;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}
figure{margin:.8em 0}figcaption{font-size:.88em;color:#555}img{max-width:100%;height:auto;display:block}
code,pre{font-family:SFMono-Regular,Consolas,monospace;font-size:.88em}pre{background:#f6f6f6;padding:.7em;
overflow-x:auto}.sub{color:#666}details{margin:.5em 0}
"""


def run(
    params: ReportParams,
    evaluate_dir: str | Path,
    metrics_dir: str | Path,
    plots_csv: str | Path,
    poses_dir: str | Path,
    out_dir: str | Path,
    scene: str | None = None,
    test_every: int | None = None,
) -> dict:
    """Write ``report.md`` (+ ``assets/``) and ``report.html`` into ``out_dir``.

    Args:
        params: the ``report`` section.
        evaluate_dir: the evaluate stage's out (``renders/``, ``per_view.json``).
        metrics_dir: holds ``evaluate.json`` (required), ``poses.json`` and ``reconstruct.json``.
        plots_csv: the training curve ``train.csv`` (optional: a note replaces the chart).
        poses_dir: the poses stage's out (ground-truth images, ``split.json``).
        out_dir: this stage's out folder (replaced atomically).
        scene: a name for the title (default: "scene").
        test_every: ``poses.test_every``, to state the split rule (inferred from split.json when None).

    Returns:
        ``{"html", "md", "assets", "views"}``: the final paths and the number of views shown.
    """
    evaluate_dir, metrics_dir, plots_csv, poses_dir, out_dir = map(
        Path, (evaluate_dir, metrics_dir, plots_csv, poses_dir, out_dir))
    ev = _read_json(metrics_dir / "evaluate.json", required=True)
    poses_m = _read_json(metrics_dir / "poses.json", required=False)
    rec_m = _read_json(metrics_dir / "reconstruct.json", required=False)
    per_view = _read_json(evaluate_dir / "per_view.json", required=True)
    split = _read_json(poses_dir / "split.json", required=False) or {}
    env = ev.get("environment") or {}
    method = ev.get("method") or "?"
    scene = scene or "scene"

    # ---- pictures
    gt_files = {}
    if (poses_dir / "transforms.json").is_file():
        from stages.common.cameras import read_transforms

        _, files, _, _ = read_transforms(poses_dir / "transforms.json")
        gt_files = {Path(f).name: poses_dir / f for f in files}
    assets: dict[str, bytes] = {}
    views = []
    for i in _select(len(per_view), params.max_views):
        row = per_view[i]
        name = row["file"]
        render_path = evaluate_dir / "renders" / f"{Path(name).stem}.png"
        gt_path = gt_files.get(name, poses_dir / "images" / name)
        for p in (render_path, gt_path):
            if not p.is_file():
                raise ValueError(f"{p}: missing; the report shows it for test view {name}")
        with Image.open(gt_path) as a, Image.open(render_path) as b:
            gt, rd = np.array(a.convert("RGB")), np.array(b.convert("RGB"))
        if gt.shape != rd.shape:
            raise ValueError(f"{render_path} is {rd.shape[1]}x{rd.shape[0]} but {gt_path} is "
                             f"{gt.shape[1]}x{gt.shape[0]}")
        caption = f"PSNR {row['psnr']:.2f} dB, SSIM {row['ssim']:.4f}"
        asset = f"row_{Path(name).stem}.png"
        assets[asset] = png_bytes(view_row(gt, rd, name, caption))
        views.append((asset, name, caption))
    curve_note = None
    if plots_csv.is_file():
        cols = read_train_csv(plots_csv)
        if cols.get("step"):
            assets["training_curve.png"] = png_bytes(training_curve(cols))
        else:
            curve_note = f"{plots_csv} has no rows"
    else:
        curve_note = f"{plots_csv} not found"

    # ---- tables
    summary: list[list[str]] = [["poses", k, v] for k, v in poses_summary(poses_m)]
    steps = _pick([rec_m, ev], "steps")
    train_time = _pick([rec_m, ev], "train_time_s")
    summary += [
        ["reconstruct", "method", fmt(method)],
        ["reconstruct", "steps", fmt(steps)],
        ["reconstruct", "train time", "n/a" if train_time is None else f"{fmt(float(train_time), 1)} s"
         + (f" ({float(train_time) / 60:.1f} min)" if float(train_time) >= 120 else "")],
        ["reconstruct", "device", f"{fmt(ev.get('device'))}" + (f" ({ev['gpu_name']} x{ev.get('gpu_count')})"
                                                                if ev.get("gpu_name") else "")],
        ["reconstruct", "world size", fmt(ev.get("world_size"))],
        ["reconstruct", "peak GPU memory", fmt_bytes(ev.get("peak_gpu_memory_bytes"))],
        ["reconstruct", "parameters", fmt(ev.get("num_params"))],
    ]
    if isinstance(rec_m, dict) and rec_m.get("rays_per_s") is not None:
        summary.append(["reconstruct", "training throughput", f"{fmt(rec_m['rays_per_s'])} rays/s"
                        + (f", {fmt(rec_m['samples_per_s'])} samples/s" if rec_m.get("samples_per_s") else "")])
    if isinstance(rec_m, dict) and rec_m.get("final_train_psnr") is not None:
        summary.append(["reconstruct", "final training-batch PSNR", f"{fmt(rec_m['final_train_psnr'], 2)} dB"])
    summary += [
        ["evaluate", "PSNR", f"{fmt(ev.get('psnr'), 2)} ± {fmt(ev.get('psnr_std'), 2)} dB"],
        ["evaluate", "SSIM", f"{fmt(ev.get('ssim'), 4)} ± {fmt(ev.get('ssim_std'), 4)}"],
        ["evaluate", "LPIPS", fmt(ev.get("lpips")) + (f" ({ev['lpips_note']})" if ev.get("lpips_note") else "")],
        ["evaluate", "render speed", f"{fmt(ev.get('fps'), 2)} views/s"],
        ["evaluate", "test views", f"{fmt(ev.get('num_test_views'))} at {ev.get('width')}x{ev.get('height')}"],
    ]
    split_rule = (describe_split(split.get("train", []), split.get("test", []), test_every)
                  if split.get("test") else "split.json not available")
    protocol = [
        f"Split: {split_rule}. Test views are never used for training.",
        f"Resolution: test views rendered and scored at {ev.get('width')}x{ev.get('height')} (the poses "
        "stage's images, no further downscale).",
        "PSNR: 10·log10(1/MSE), data range 1, over all pixels and RGB channels of a view; the table gives the "
        "mean over test views ± their sample standard deviation.",
        f"{ev.get('ssim_convention') or 'SSIM: see stages/common/metrics.py'}.",
        "Scores use the model's float render clamped to [0, 1] against the 8-bit ground truth / 255.",
        "LPIPS: " + (fmt(ev.get("lpips")) if ev.get("lpips") is not None else ev.get("lpips_note", "n/a")) + ".",
        "Render speed: test views per second at test resolution (render call to image on the CPU), after one "
        f"untimed warm-up render, on {ev.get('eval_device', 'n/a')}.",
        f"Error heatmaps: |render - ground truth| averaged over RGB on a fixed scale 0 (black) to {ERROR_MAX:g} "
        "(pale yellow), computed from the 8-bit render.",
    ]
    per_view_rows = [[r["file"], f"{r['psnr']:.2f}", f"{r['ssim']:.4f}", f"{r['render_time_s']:.3f}"]
                     for r in per_view]
    env_rows = [
        ["code revision", fmt(env.get("code_revision")) + (" (dirty)" if env.get("code_dirty") else "")],
        ["params sha256", fmt(env.get("params_sha256")) + (f" ({env['params_sha256_of']})"
                                                            if env.get("params_sha256_of") else "")],
        ["torch", fmt(env.get("torch_version"))],
        ["python", fmt(env.get("python_version"))],
        ["platform", fmt(env.get("platform"))],
        ["train device", fmt(ev.get("device"))],
        ["GPU", f"{ev['gpu_name']} x{fmt(ev.get('gpu_count'))}" if ev.get("gpu_name") else "none"],
        ["world size", fmt(ev.get("world_size"))],
        ["evaluation device", fmt(ev.get("eval_device"))],
    ]
    all_metrics = [(name, [[k, fmt(v, 6)] for k, v in flatten(doc)])
                   for name, doc in (("poses.json", poses_m), ("reconstruct.json", rec_m), ("evaluate.json", ev))
                   if isinstance(doc, dict)]
    title = f"Reconstruction report: {scene}, {method}"
    views_note = (f"{len(views)} of {len(per_view)} test views (evenly spaced); each row: ground truth | render | "
                  f"error heatmap (0 to {ERROR_MAX:g}).")

    # ---- markdown
    md = [f"# {title}\n", "## Summary\n", _md_table(["stage", "metric", "value"], summary),
          "## Protocol\n", "".join(f"- {p}\n" for p in protocol),
          "## Test views\n", _md_table(["file", "PSNR (dB)", "SSIM", "render time (s)"], per_view_rows),
          views_note + "\n"]
    md += [f"\n![{n}: ground truth | render | error]({'assets/' + a})\n" for a, n, _ in views]
    md.append("\n## Training curve\n")
    md.append(f"\n_{curve_note}_\n" if curve_note else "\n![training curve](assets/training_curve.png)\n")
    md += ["\n## Environment\n", _md_table(["", "value"], env_rows), "\n## All metrics\n"]
    md += [f"\n### {name}\n\n" + _md_table(["key", "value"], rows) for name, rows in all_metrics]

    # ---- html
    def img(asset: str, alt: str) -> str:
        data = base64.b64encode(assets[asset]).decode("ascii")
        return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'

    h = ['<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
         f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
         f"<h1>{html.escape(title)}</h1>",
         f'<p class="sub">code revision {html.escape(fmt(env.get("code_revision")))}'
         f' · {html.escape(fmt(env.get("platform")))}</p>',
         "<h2>Summary</h2>", _html_table(["stage", "metric", "value"], summary, "summary"),
         "<h2>Protocol</h2><ul>", "".join(f"<li>{html.escape(p)}</li>" for p in protocol), "</ul>",
         "<h2>Test views</h2>",
         _html_table(["file", "PSNR (dB)", "SSIM", "render time (s)"], per_view_rows, "per-view"),
         f"<p>{html.escape(views_note)}</p>"]
    h += [f"<figure>{img(a, n)}<figcaption>{html.escape(n)}: {html.escape(c)}</figcaption></figure>"
          for a, n, c in views]
    h.append("<h2>Training curve</h2>")
    h.append(f"<p><em>{html.escape(curve_note)}</em></p>" if curve_note
             else f"<figure>{img('training_curve.png', 'training curve')}</figure>")
    h += ["<h2>Environment</h2>", _html_table(["", "value"], env_rows, "environment"), "<h2>All metrics</h2>"]
    h += [f"<details><summary>{html.escape(name)}</summary>{_html_table(['key', 'value'], rows, 'all')}</details>"
          for name, rows in all_metrics]
    h.append("</body></html>\n")

    with atomic_dir(out_dir) as tmp:
        for name, data in assets.items():
            atomic_write_bytes(tmp / "assets" / name, data)
        atomic_write_text(tmp / "report.md", re.sub(r"\n{3,}", "\n\n", "\n".join(md)))
        atomic_write_text(tmp / "report.html", "\n".join(h))
    out = out_dir.resolve()
    return {"html": out / "report.html", "md": out / "report.md",
            "assets": sorted(out / "assets" / a for a in assets), "views": len(views)}


def _scene_name(photos: Any) -> str | None:
    """A readable scene name from ``ingest.photos`` (``data/scene/images`` is the generated default)."""
    if not isinstance(photos, str) or not photos:
        return None
    p = Path(photos)
    if p.as_posix().rstrip("/") == "data/scene/images":
        return "default scene (generated)"
    return p.parent.name if p.name.startswith("images") and p.parent.name else p.name


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--evaluate", type=Path, required=True, help="the evaluate stage's out folder")
    ap.add_argument("--metrics-dir", type=Path, required=True, help="folder of poses/reconstruct/evaluate .json")
    ap.add_argument("--plots", type=Path, required=True, help="the training curve train.csv")
    ap.add_argument("--poses", type=Path, required=True, help="the poses stage's out folder")
    ap.add_argument("--out", type=Path, required=True, help="this stage's out folder")
    ap.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    setup("report")
    try:
        data = read_yaml(args.params)
        params = from_dict(ReportParams, data.get("report", {}), "report")
        ingest, poses = data.get("ingest") or {}, data.get("poses") or {}
        test_every = poses.get("test_every") if isinstance(poses, dict) else None
        out = run(params, args.evaluate, args.metrics_dir, args.plots, args.poses, args.out,
                  scene=_scene_name(ingest.get("photos") if isinstance(ingest, dict) else None),
                  test_every=test_every if isinstance(test_every, int) and test_every > 0 else None)
    except ValueError as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 1
    print(f"Report: {out['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
