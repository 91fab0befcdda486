"""Figures for the report, drawn with numpy and PIL only (no matplotlib, no fonts to install).

* :func:`view_row`: ground truth | render | error heatmap of one test view, with a colour bar;
* :func:`training_curve`: PSNR and loss against step, two panels;
* :func:`encode_animation`: frames -> an animated WebP (GIF where Pillow lacks WebP);
* the pieces they share: :func:`colormap` (inferno), :func:`error_image`, :func:`nice_ticks`.

Lines are drawn at twice the final size and downsampled, which smooths them without an
anti-aliasing rasterizer.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont, features

ERROR_MAX = 0.25  # error heatmap scale: |render - gt| (mean over RGB) from 0 to this
SMOOTH_ABOVE = 200  # a curve of more points is drawn pale with its running mean on top
PANEL_MAX = 400  # longest side of a GT / render / error panel in the report, pixels: larger images shrink
PANEL_MIN = 240  # ... and smaller ones grow by a whole factor to at least this
# inferno (matplotlib), sampled at 9 evenly spaced points; linear in between
_INFERNO = np.array([[0, 0, 4], [31, 12, 72], [85, 15, 109], [136, 34, 106], [186, 54, 85], [227, 89, 51],
                     [249, 140, 10], [249, 201, 50], [252, 255, 164]], dtype=np.float64)


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


def encode_animation(frames: list[np.ndarray], frame_ms: int = 80) -> tuple[bytes, str]:
    """Frames (uint8 [H, W, 3], all one size) as a looping animation.

    Returns:
        ``(data, extension)``: an animated WebP (``"webp"``, lossy, quality 85) when Pillow
        was built with WebP, else a GIF (``"gif"``, 256 colours per frame).
    """
    if not frames:
        raise ValueError("an animation needs at least one frame")
    shapes = {f.shape for f in frames}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[2] != 3:
        raise ValueError(f"animation frames must share one [H, W, 3] shape, got {sorted(shapes)}")
    images = [Image.fromarray(np.ascontiguousarray(f, dtype=np.uint8)) for f in frames]
    buf = io.BytesIO()
    if features.check("webp"):
        images[0].save(buf, format="WEBP", save_all=True, append_images=images[1:], duration=frame_ms, loop=0,
                       quality=85, method=4)
        return buf.getvalue(), "webp"
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=frame_ms, loop=0,
                   optimize=True)
    return buf.getvalue(), "gif"


MIME = {"png": "image/png", "webp": "image/webp", "gif": "image/gif"}
