"""Report stage: one Markdown and one self-contained HTML page with the run's numbers and pictures.

    python -m stages.report --evaluate data/evaluate --metrics-dir data/metrics \
        --plots data/plots/train.csv --poses data/poses --out data/report \
        [--params params.yaml] [--scaling runs.json [--scaling more.json]]

Writes ``<out>/report.md`` with its pictures in ``<out>/assets/``, and ``<out>/report.html``
with the same pictures embedded as ``data:`` URIs and inline CSS, so that page opens
offline and can be mailed or attached as a CI/Prefect artifact on its own. Contents:

* a summary table (poses, reconstruct, evaluate);
* published reference numbers for the scene (``stages/reference_numbers.yaml``), in a
  table of their own, with the ways our protocol differs from the papers';
* the protocol (split, resolution, metric definitions) and the per-view scores;
* for up to ``report.max_views`` test views a row ground truth | render | error heatmap;
* the orbit animation of the evaluate stage, the training curves of ``train.csv``;
* with ``report.scaling`` files (params.yaml) and ``--scaling`` ones (repeatable: e.g. weak and
  strong scaling), a scaling table over runs at several GPU counts per file (:func:`scaling_rows`):
  those of this report's scene in a "Scaling" section, each saying where it was measured, and
  those of other scenes only in a closing appendix that names their scene and GPUs;
* the environment, how to reproduce the run exactly, and every scalar of the metrics (the full
  records, ``<name>.full.json``: ``stages.common.metrics_files``).

The pictures are drawn by ``stages.common.plots``. The last line printed by ``main`` is
``Report: <absolute path of report.html>``.
"""
from __future__ import annotations

import argparse
import base64
import csv
import html
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from stages.common.entry import cli, run_stage
from stages.common.io import atomic_dir, atomic_write_bytes, atomic_write_text, check_outs, read_json
from stages.common.metrics_files import full_path, read_metrics
from stages.common.params import DEFAULT_PARAMS, check, from_dict, load_section, read_yaml
from stages.common.plots import ERROR_MAX, MIME, png_bytes, training_curve, view_row

log = logging.getLogger("report")

REFERENCES = Path(__file__).resolve().with_name("reference_numbers.yaml")


@dataclass
class ReportParams:
    """Section ``report`` of params.yaml."""

    max_views: int = 6  # test views shown as GT | render | error rows
    scene: str = ""  # scene name for the title and the published numbers; "" = from ingest.photos
    # bench_scaling.py JSON files (measured on GPU hosts, kept in benchmarks/results/) shown as
    # scaling tables, before any given with --scaling; relative to the params file's folder
    scaling: list[str] = field(default_factory=list)
    # method benchmarks beside a peer (benchmarks/bench_3dgs.py: ours and gsplat in one run) shown
    # as tables in an appendix; relative to the params file's folder
    benchmarks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check(self.max_views >= 1, "max_views", "must be >= 1", self.max_views)


# ---------------------------------------------------------------- scaling


def _number(run: dict, key: str, where: str, required: bool, positive: bool) -> float | None:
    v = run.get(key)
    if v is None:
        if required:
            raise ValueError(f"{where}: {key!r} is missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}: {key!r} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise ValueError(f"{where}: {key!r} must be > 0, got {v!r}")
    return float(v)


def scaling_rows(runs: list[dict]) -> list[dict]:
    """Speedup and parallel efficiency of one workload run at several GPU counts.

    The baseline is the run with the fewest GPUs (the first of them in input order). The
    throughput compared is ``rays_per_s`` (training rays, the work unit of a NeRF run) when every
    run has it, else ``samples_per_s`` when every run has that, else ``1 / wall_s`` (the same
    work in every run). Rays come first because network samples per ray depend on the state of
    the occupancy grid, which differs between runs of different step counts (bench_scaling's
    default protocol): samples/s would credit a run for marching more points per ray. The
    speedup is counted from one GPU, taking the baseline as
    perfectly efficient: ``speedup = throughput / (baseline throughput / baseline gpus)``,
    so a baseline of 1 GPU has speedup 1 and one of 2 GPUs has speedup 2;
    ``efficiency = speedup / gpus``.

    Args:
        runs: ``[{"gpus": int >= 1, "wall_s": float > 0 | None, "rays_per_s": float > 0 | None,
            "samples_per_s": float > 0 | None, "psnr": float | None, ...}]``, any order; other keys
            are kept. ``wall_s`` may be None only where every run has a throughput.

    Returns:
        New dicts sorted by ``gpus`` (ties in input order), each the run plus ``speedup``,
        ``efficiency``, ``delta_psnr`` (PSNR minus the baseline's; None where either is
        missing) and ``speedup_basis`` (``"rays_per_s"``, ``"samples_per_s"`` or ``"wall_s"``).

    Raises:
        ValueError: no runs, or a run whose ``gpus``, ``wall_s``, ``samples_per_s`` or
            ``psnr`` is malformed, or that lacks what the comparison needs (the message
            names the run's index and key).

    Example:
        >>> rows = scaling_rows([{"gpus": 1, "wall_s": 100.0, "samples_per_s": 1e6},
        ...                      {"gpus": 4, "wall_s": 30.0, "samples_per_s": 3.6e6}])
        >>> rows[1]["speedup"], rows[1]["efficiency"]
        (3.6, 0.9)
    """
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"scaling: expected a non-empty list of runs, got {runs!r}")
    checked = []
    for i, run in enumerate(runs):
        where = f"scaling run {i}"
        if not isinstance(run, dict):
            raise ValueError(f"{where}: expected an object, got {run!r}")
        gpus = run.get("gpus")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"{where}: 'gpus' must be an integer >= 1, got {gpus!r}")
        wall = _number(run, "wall_s", where, required=False, positive=True)
        rps = _number(run, "rays_per_s", where, required=False, positive=True)
        sps = _number(run, "samples_per_s", where, required=False, positive=True)
        psnr = _number(run, "psnr", where, required=False, positive=False)
        checked.append((gpus, i, run, wall, {"rays_per_s": rps, "samples_per_s": sps}, psnr))
    basis = next((k for k in ("rays_per_s", "samples_per_s") if all(c[4][k] is not None for c in checked)),
                 "wall_s")
    if basis == "wall_s":  # compared by wall time: every run needs one
        for c in checked:
            if c[3] is None:
                raise ValueError(f"scaling run {c[1]}: 'wall_s' is missing (needed since not every run has "
                                 "'rays_per_s' or 'samples_per_s')")
    checked.sort(key=lambda c: (c[0], c[1]))

    def throughput(c: tuple) -> float:
        return 1.0 / c[3] if basis == "wall_s" else c[4][basis]

    base = checked[0]
    per_gpu = throughput(base) / base[0]
    rows = []
    for c in checked:
        speedup = throughput(c) / per_gpu
        delta = None if c[5] is None or base[5] is None else c[5] - base[5]
        rows.append({**c[2], "speedup": round(speedup, 6), "efficiency": round(speedup / c[0], 6),
                     "delta_psnr": delta, "speedup_basis": basis})
    return rows


def read_scaling(path: str | Path) -> list[dict]:
    """The scaling tables of a file: ``{"scene": str, "method": str, "runs": [...]}`` (see
    :func:`scaling_rows`), or ``{"scenes": [...]}`` of those (``bench_scaling.py`` with several
    ``--poses``); one table per scene."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"scaling file not found: {path}")
    doc = read_json(path)
    shape = '{"scene", "method", "runs": [...]} or {"scenes": [...]}'
    if isinstance(doc, dict) and isinstance(doc.get("scenes"), list) and "runs" not in doc:
        entries = doc["scenes"]
    else:
        entries = [doc]
    if not entries or not all(isinstance(e, dict) and isinstance(e.get("runs"), list) for e in entries):
        raise ValueError(f"{path}: expected {shape}")
    out = []
    for e in entries:
        try:
            rows = scaling_rows(e["runs"])
        except ValueError as exc:
            name = f" (scene {e.get('scene')!r})" if len(entries) > 1 else ""
            raise ValueError(f"{path}{name}: {exc}") from None
        gpus = sorted({str(r["gpu_name"]) for r in e["runs"] if isinstance(r, dict) and r.get("gpu_name")})
        out.append({"scene": e.get("scene"), "method": e.get("method"), "rows": rows, "mode": e.get("mode"),
                    "batch_rays_per_gpu": e.get("batch_rays_per_gpu"),
                    "global_batch_rays": e.get("global_batch_rays"), "source": path.as_posix(),
                    "gpu_names": gpus})
    return out


# ---------------------------------------------------------------- method benchmarks

# columns of a method-benchmark table: (header, row key, decimals)
BENCH_COLUMNS = (("scene", "scene", None), ("steps", "steps", None), ("implementation", "impl", None),
                 ("train s", "train_s", 1), ("PSNR (dB)", "psnr", 2), ("SSIM", "ssim", 4),
                 ("Gaussians", "gaussians", None), ("peak GB", "peak_gb", 2), ("render FPS", "fps", 0))


_BENCH_NEED = ("scene", "steps", "impl", "train_s", "psnr")


def _bench_rows_ok(rows) -> bool:
    return isinstance(rows, list) and bool(rows) and all(
        isinstance(r, dict) and all(k in r for k in _BENCH_NEED) for r in rows)


def read_benchmark(path: str | Path) -> dict:
    """A method benchmark beside its peer (``bench_3dgs.py --json``): ``{"environment": {...},
    "rows": [{"scene", "steps", "impl", "train_s", "psnr", ...}]}``.

    Optional blocks the report shows under the main table: ``seeds`` (``{"note", "rows",
    "summary": {scene: {impl: [mean PSNR, runs]}}}``, more seeds of the same rows) and each
    ``other_runs.<name>`` with rows of the same shape (variants run beside the table, e.g. ours
    without the opacity reset). Blocks without such rows are left out."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"benchmark file not found: {path}")
    doc = read_json(path)
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not _bench_rows_ok(rows):
        raise ValueError(f"{path}: expected {{\"environment\", \"rows\": [{{{', '.join(_BENCH_NEED)}, ...}}]}}")
    others = doc.get("other_runs")
    blocks = [("seeds", doc.get("seeds"))] + ([(str(k), v) for k, v in others.items()] if isinstance(others, dict) else [])
    extra = [{"name": name, "note": b.get("note") if isinstance(b.get("note"), str) else None, "rows": b["rows"]}
             for name, b in blocks if isinstance(b, dict) and _bench_rows_ok(b.get("rows"))]
    seeds = doc.get("seeds") if isinstance(doc.get("seeds"), dict) else {}
    summary = seeds.get("summary") if isinstance(seeds.get("summary"), dict) else None
    return {"source": path.as_posix(), "environment": doc.get("environment") or {}, "rows": rows,
            "protocol": doc.get("protocol") if isinstance(doc.get("protocol"), str) else None,
            "peer": doc.get("peer") if isinstance(doc.get("peer"), str) else None,
            "extra": extra, "seed_summary": summary}


def seed_summary_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a seeds summary: one row a scene, one column an implementation, cells
    "mean dB (runs)"; an implementation a scene lacks gets an empty cell."""
    impls = list(dict.fromkeys(i for per in summary.values() if isinstance(per, dict) for i in per))
    out = []
    for scene, per in summary.items():
        cells = []
        for impl in impls:
            v = per.get(impl) if isinstance(per, dict) else None
            ok = isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], (int, float))
            cells.append(f"{v[0]:.2f} dB ({v[1]})" if ok else "")
        out.append([str(scene), *cells])
    return ["scene", *impls], out


def _decimals(value, nd: int) -> int:
    """``nd``, or 2 for a value under 1 that ``nd`` decimals would print as 0 (a CPU's 0.06 views/s)."""
    if nd == 0 and isinstance(value, (int, float)) and 0 < abs(value) < 1:
        return 2
    return nd


def by_budget(rows: list[dict]) -> bool:
    """Whether the rows are snapshots at wall-clock budgets (every row has a ``budget_s``): then rows
    pair up by budget, and the comparison is PSNR at equal training time, not time at equal steps."""
    return all(isinstance(r.get("budget_s"), (int, float)) for r in rows)


def benchmark_rows(rows: list[dict], peer: str | None = None) -> list[list[str]]:
    """Table rows, each compared with the peer's row of the same scene and steps (its training time, as
    a ratio) or, for snapshots at wall-clock budgets (:func:`by_budget`), the same scene and budget (its
    PSNR, as a difference in dB).

    ``peer`` names the implementation every other row is compared with (a file with more than two
    rows a scene, e.g. ours graphed and eager beside gsplat and a patched gsplat); without it, each
    row is compared with the first other implementation of its scene and steps (or budget)."""
    key = "budget_s" if by_budget(rows) else "steps"
    out = []
    for r in rows:
        cells = [fmt(r.get(k), _decimals(r.get(k), nd)) if nd is not None else fmt(r.get(k))
                 for _, k, nd in BENCH_COLUMNS]
        peer_row = next((x for x in rows if x is not r and x.get("scene") == r.get("scene")
                         and x.get(key) == r.get(key) and x.get("impl") != r.get("impl")
                         and x.get("poses_md5") == r.get("poses_md5")  # SfM run again: not comparable
                         and (peer is None or x.get("impl") == peer)), None)
        if key == "budget_s":
            ok = peer_row is not None and all(isinstance(x.get("psnr"), (int, float)) for x in (r, peer_row))
            vs = f"{r['psnr'] - peer_row['psnr']:+.2f} dB vs {peer_row['impl']}" if ok else ""
        else:
            ratio = (r["train_s"] / peer_row["train_s"]) if peer_row and peer_row.get("train_s") else None
            vs = f"{ratio:.2f}x {peer_row['impl']}'s" if ratio else ""
        out.append(cells[:4] + [vs] + cells[4:])
    return out


def vs_header(rows: list[dict]) -> str:
    """The comparison column's title for :func:`benchmark_rows`."""
    return "PSNR vs peer, same time" if by_budget(rows) else "time vs peer"


def benchmark_table(rows: list[dict], peer: str | None = None) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a benchmark appendix table: :data:`BENCH_COLUMNS` with the comparison column."""
    headers = [h for h, _, _ in BENCH_COLUMNS]
    return headers[:4] + [vs_header(rows)] + headers[4:], benchmark_rows(rows, peer)


# ---------------------------------------------------------------- published numbers


def load_references(path: str | Path = REFERENCES) -> dict[str, dict]:
    """``scenes`` of the published-numbers file, with every alias as a key of its own (lower case)."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the published numbers: {exc}") from None
    scenes = doc.get("scenes") if isinstance(doc, dict) else None
    if not isinstance(scenes, dict):
        raise ValueError(f"{path}: expected a 'scenes' mapping")
    out = {}
    for name, entry in scenes.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("results", []), list):
            raise ValueError(f"{path}: scene {name!r}: expected a mapping with a 'results' list")
        for key in [name, *entry.get("aliases", [])]:
            out[str(key).lower()] = {**entry, "name": name}
    return out


def protocol_differences(ref: dict, ev: dict, method: str) -> list[str]:
    """Where this run's protocol differs from the one the published numbers used."""
    proto = ref.get("protocol") or {}
    notes = []
    w, h = ev.get("width"), ev.get("height")
    if proto.get("width") and (w, h) != (proto.get("width"), proto.get("height")):
        notes.append(f"resolution: ours {w}x{h}, published {proto['width']}x{proto['height']} "
                     "(PSNR is not comparable across resolutions: downsampling removes the finest detail)")
    n = ev.get("num_test_views")
    if proto.get("test_views") and n != proto["test_views"]:
        notes.append(f"test views: ours {n}, published {proto['test_views']}")
    if proto.get("split"):
        notes.append(f"published split: {proto['split']}")
    if ev.get("lpips") is None:
        notes.append("LPIPS: not computed here, so only PSNR and SSIM can be set side by side")
    notes.append(f"method: ours is rayforge's {method} ({fmt(ev.get('steps'))} steps on "
                 f"{ev.get('gpu_name') or ev.get('device') or 'n/a'}); each published row is its paper's own "
                 "method, schedule and GPU")
    return notes


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


# ---------------------------------------------------------------- numbers and text


def _read_metrics(path: Path, required: bool) -> Any:
    """A stage's full metrics record (``<name>.full.json``, else the headline ``<name>.json``)."""
    if not path.is_file() and not full_path(path).is_file():
        if required:
            raise ValueError(f"{path}: missing; run the evaluate stage first (`dvc repro evaluate`)")
        log.warning("%s: missing; its section of the report is left out", path)
        return None
    return read_metrics(path)


def _read_json(path: Path, required: bool) -> Any:
    if not path.is_file():
        if required:
            raise ValueError(f"{path}: missing; run the evaluate stage first (`dvc repro evaluate`)")
        log.warning("%s: missing; its section of the report is left out", path)
        return None
    return read_json(path)


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

class Doc:
    """The report, built once as Markdown and once as HTML: each call appends to both."""

    def __init__(self, assets: dict[str, bytes]):
        self.md: list[str] = []
        self.html: list[str] = []
        self.assets = assets

    def h2(self, title: str) -> None:
        self.md.append(f"\n## {title}\n")
        self.html.append(f"<h2>{html.escape(title)}</h2>")

    def h3(self, title: str) -> None:
        self.md.append(f"\n### {title}\n")
        self.html.append(f"<h3>{html.escape(title)}</h3>")

    def para(self, text: str, em: bool = False) -> None:
        self.md.append(f"\n_{text}_\n" if em else f"\n{text}\n")
        self.html.append(f"<p><em>{html.escape(text)}</em></p>" if em else f"<p>{html.escape(text)}</p>")

    def bullets(self, items: list[str]) -> None:
        self.md.append("\n" + "".join(f"- {t}\n" for t in items))
        self.html.append("<ul>" + "".join(f"<li>{html.escape(t)}</li>" for t in items) + "</ul>")

    def table(self, header: list[str], rows: list[list[str]], cls: str) -> None:
        self.md.append("\n" + _md_table(header, rows))
        self.html.append(_html_table(header, rows, cls))

    def code(self, text: str) -> None:
        self.md.append(f"\n```\n{text}\n```\n")
        self.html.append(f"<pre><code>{html.escape(text)}</code></pre>")

    def figure(self, asset: str, alt: str, caption: str = "", link: bool = False) -> None:
        path = f"assets/{asset}"
        self.md.append(f"\n![{alt}]({path})\n" + (f"\n[{alt} ({asset})]({path})\n" if link else ""))
        mime = MIME[asset.rsplit(".", 1)[-1].lower()]
        data = base64.b64encode(self.assets[asset]).decode("ascii")
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self.html.append(f'<figure><img src="data:{mime};base64,{data}" alt="{html.escape(alt)}">{cap}</figure>')

    def details(self, summary: str, header: list[str], rows: list[list[str]], cls: str) -> None:
        self.md.append(f"\n#### {summary}\n\n" + _md_table(header, rows))
        self.html.append(f"<details><summary>{html.escape(summary)}</summary>{_html_table(header, rows, cls)}"
                         "</details>")


def _load_view_images(per_view: list[dict], evaluate_dir: Path, poses_dir: Path) -> dict[str, tuple[Path, Path]]:
    """Render and ground-truth paths of every test view, checked to exist and to match in size."""
    if not isinstance(per_view, list) or not per_view:
        raise ValueError(f"{evaluate_dir / 'per_view.json'}: lists no test views; nothing to report "
                         "(rerun `dvc repro evaluate`)")
    gt_files = {}
    if (poses_dir / "transforms.json").is_file():
        from stages.common.cameras import read_transforms

        _, files, _, _ = read_transforms(poses_dir / "transforms.json")
        gt_files = {Path(f).name: poses_dir / f for f in files}
    out = {}
    for k, row in enumerate(per_view):
        missing = [key for key in ("file", "psnr", "ssim", "render_time_s") if not isinstance(row, dict)
                   or key not in row]
        if missing:
            raise ValueError(f"{evaluate_dir / 'per_view.json'}: entry {k} lacks {', '.join(missing)}")
        name = row["file"]
        render_path = evaluate_dir / "renders" / f"{Path(name).stem}.png"
        gt_path = evaluate_dir / "ground_truth" / f"{Path(name).stem}.png"  # as scored (shrunk, composited)
        gt_path = gt_path if gt_path.is_file() else gt_files.get(name, poses_dir / "images" / name)
        if not render_path.is_file():
            raise ValueError(f"{render_path}: missing render of test view {name} (per_view.json lists it); "
                             "rerun `dvc repro evaluate`")
        if not gt_path.is_file():
            raise ValueError(f"{gt_path}: missing ground truth of test view {name}")
        with Image.open(gt_path) as a, Image.open(render_path) as b:
            if a.size != b.size:
                raise ValueError(f"{render_path} is {b.size[0]}x{b.size[1]} but its ground truth {gt_path} is "
                                 f"{a.size[0]}x{a.size[1]}")
        out[name] = (render_path, gt_path)
    return out


def _train_time(v: Any) -> str:
    if v is None:
        return "n/a"
    v = float(v)
    return f"{fmt(v, 1)} s" + (f" ({v / 60:.1f} min)" if v >= 120 else "")


def run(
    params: ReportParams,
    evaluate_dir: str | Path,
    metrics_dir: str | Path,
    plots_csv: str | Path,
    poses_dir: str | Path,
    out_dir: str | Path,
    scene: str | None = None,
    test_every: int | None = None,
    scaling: str | Path | Sequence[str | Path] | None = None,
    photos: str | None = None,
    references: str | Path = REFERENCES,
    benchmarks: Sequence[str | Path] | None = None,
) -> dict:
    """Write ``report.md`` (+ ``assets/``) and ``report.html`` into ``out_dir``.

    Args:
        params: the ``report`` section (``params.scene``, when set, overrides ``scene``).
        evaluate_dir: the evaluate stage's out (``renders/``, ``per_view.json``, the orbit).
        metrics_dir: holds ``evaluate.json`` (required), ``poses.json`` and ``reconstruct.json``, each
            read as its full record (``<name>.full.json``) where there is one.
        plots_csv: the training curve ``train.csv`` (optional: a note replaces the chart).
        poses_dir: the poses stage's out (ground-truth images, ``split.json``).
        out_dir: this stage's out folder (replaced atomically).
        scene: a name for the title and the published-numbers lookup (default: "scene").
        test_every: ``poses.test_every``, to state the split rule (inferred from split.json when None).
        scaling: a JSON file of runs at several GPU counts (:func:`read_scaling`), or several (one
            table each); None: no table.
        photos: ``ingest.photos``, for the reproduce block.
        benchmarks: method benchmarks beside a peer (:func:`read_benchmark`), each an appendix table.
        references: the published-numbers file.

    Returns:
        ``{"html", "md", "assets", "views", "published"}``: the final paths, the number of
        views shown and the number of published rows shown.
    """
    evaluate_dir, metrics_dir, plots_csv, poses_dir, out_dir = map(
        Path, (evaluate_dir, metrics_dir, plots_csv, poses_dir, out_dir))
    check_outs({"--evaluate": evaluate_dir, "--metrics-dir": metrics_dir, "--plots": plots_csv, "--poses": poses_dir,
                "references": references, **{f"scaling {f}": f for f in ([scaling] if isinstance(scaling, (str, Path))
                                                                           else scaling or [])},
                **{f"benchmark {f}": f for f in benchmarks or []}}, {"--out": out_dir})
    ev = _read_metrics(metrics_dir / "evaluate.json", required=True)
    poses_m = _read_metrics(metrics_dir / "poses.json", required=False)
    rec_m = _read_metrics(metrics_dir / "reconstruct.json", required=False)
    per_view = _read_json(evaluate_dir / "per_view.json", required=True)
    split = _read_json(poses_dir / "split.json", required=False) or {}
    if scaling is None:
        scaling = []
    elif isinstance(scaling, (str, Path)):
        scaling = [scaling]
    scaling_docs = [sc for f in scaling for sc in read_scaling(f)]  # all read and checked before anything is written
    bench_docs = [read_benchmark(f) for f in benchmarks or []]
    refs = load_references(references)
    env = ev.get("environment") or {}
    method = ev.get("method") or "?"
    scene = params.scene or scene or "scene"
    ref = refs.get(scene.lower())

    # ---- pictures
    images = _load_view_images(per_view, evaluate_dir, poses_dir)  # every view checked, not just those shown
    assets: dict[str, bytes] = {}
    views = []
    for i in _select(len(per_view), params.max_views):
        row = per_view[i]
        name = row["file"]
        render_path, gt_path = images[name]
        with Image.open(gt_path) as a, Image.open(render_path) as b:
            gt, rd = np.array(a.convert("RGB")), np.array(b.convert("RGB"))
        caption = f"PSNR {row['psnr']:.2f} dB, SSIM {row['ssim']:.4f}"
        asset = f"row_{Path(name).stem}.png"
        assets[asset] = png_bytes(view_row(gt, rd, name, caption))
        views.append((asset, name, caption))
    orbit = ev.get("orbit") if isinstance(ev.get("orbit"), dict) else None
    if orbit:
        orbit_path = evaluate_dir / str(orbit.get("file"))
        if not orbit_path.is_file():
            raise ValueError(f"{orbit_path}: missing; evaluate.json names it as the orbit animation "
                             "(rerun `dvc repro evaluate`)")
        assets[orbit_path.name] = orbit_path.read_bytes()
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
    summary += [
        ["reconstruct", "method", fmt(method)],
        ["reconstruct", "steps", fmt(_pick([rec_m, ev], "steps"))],
        ["reconstruct", "train time", _train_time(_pick([rec_m, ev], "train_time_s"))],
        ["reconstruct", "device", f"{fmt(ev.get('device'))}" + (f" ({ev['gpu_name']} x{ev.get('gpu_count')})"
                                                                if ev.get("gpu_name") else "")],
        ["reconstruct", "world size", fmt(ev.get("world_size"))],
        ["reconstruct", "peak GPU memory", fmt_bytes(ev.get("peak_gpu_memory_bytes"))],
        ["reconstruct", "parameters", fmt(ev.get("num_params"))
         + (f" (model.pt {fmt_bytes(ev['model_size_bytes'])})" if ev.get("model_size_bytes") else "")],
    ]
    if ev.get("num_gaussians") is not None:
        summary.append(["reconstruct", "Gaussians", fmt(ev["num_gaussians"])])
    settings = ev.get("method_settings") if isinstance(ev.get("method_settings"), dict) else {}
    if len(settings) > 1:
        summary.append(["reconstruct", f"{fmt(settings.get('method'))} settings",
                        ", ".join(f"{k} {fmt(v)}" for k, v in settings.items() if k != "method")])
    if isinstance(rec_m, dict) and rec_m.get("rays_per_s") is not None:
        summary.append(["reconstruct", "training throughput", f"{fmt(rec_m['rays_per_s'])} rays/s"
                        + (f", {fmt(rec_m['samples_per_s'])} samples/s" if rec_m.get("samples_per_s") else "")])
    if isinstance(rec_m, dict) and rec_m.get("final_train_psnr") is not None:
        summary.append(["reconstruct", "final training-batch PSNR", f"{fmt(rec_m['final_train_psnr'], 2)} dB"])
    ours = [
        ["evaluate", "PSNR", f"{fmt(ev.get('psnr'), 2)} ± {fmt(ev.get('psnr_std'), 2)} dB"],
        ["evaluate", "SSIM", f"{fmt(ev.get('ssim'), 4)} ± {fmt(ev.get('ssim_std'), 4)}"],
        ["evaluate", "LPIPS", fmt(ev.get("lpips")) + (f" ({ev['lpips_note']})" if ev.get("lpips_note") else "")],
        ["evaluate", "render speed", f"{fmt(ev.get('fps'), 2)} views/s"],
        ["evaluate", "test views", f"{fmt(ev.get('num_test_views'))} at {ev.get('width')}x{ev.get('height')}"],
    ]
    summary += ours
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
    libs = env.get("libraries") if isinstance(env.get("libraries"), dict) else {}
    env_rows = [
        ["code revision", fmt(env.get("code_revision")) + (" (dirty)" if env.get("code_dirty") else "")
         + (" (params.yaml changed)" if env.get("params_modified") else "")],
        ["params sha256", fmt(env.get("params_sha256")) + (f" ({env['params_sha256_of']})"
                                                            if env.get("params_sha256_of") else "")],
        ["seed", fmt(ev.get("seed"))],
        ["torch", fmt(env.get("torch_version")) + (f" (CUDA {env['cuda_version']})" if env.get("cuda_version")
                                                   else "")],
        ["libraries", ", ".join(f"{k} {v}" for k, v in libs.items() if v) or "n/a"],
        ["python", fmt(env.get("python_version"))],
        ["platform", fmt(env.get("platform"))],
        ["train device", fmt(ev.get("device"))],
        ["train GPU", f"{ev['gpu_name']} x{fmt(ev.get('gpu_count'))}" if ev.get("gpu_name") else "none"],
        ["world size", fmt(ev.get("world_size"))],
        ["evaluation device", fmt(ev.get("eval_device"))
         + (f" ({env['eval_gpu_name']} x{env.get('eval_gpu_count')})" if env.get("eval_gpu_name") else "")],
        ["GPU driver (evaluating host)", fmt(env.get("gpu_driver")) if env.get("gpu_driver") else "none"],
    ]
    all_metrics = [(full_path(name).name, [[k, fmt(v, 6)] for k, v in flatten(doc)])
                   for name, doc in (("poses.json", poses_m), ("reconstruct.json", rec_m), ("evaluate.json", ev))
                   if isinstance(doc, dict)]
    title = f"Reconstruction report: {scene}, {method}"
    views_note = (f"{len(views)} of {len(per_view)} test views (evenly spaced); each row: ground truth | render | "
                  f"error heatmap (0 to {ERROR_MAX:g}).")

    # ---- the document
    doc = Doc(assets)
    doc.md.append(f"# {title}\n")
    doc.html += ['<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
                 f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
                 f"<h1>{html.escape(title)}</h1>",
                 f'<p class="sub">code revision {html.escape(fmt(env.get("code_revision")))}'
                 f' · {html.escape(fmt(env.get("platform")))}</p>']
    doc.h2("Summary")
    doc.table(["stage", "metric", "value"], summary, "summary")
    published = _published_section(doc, ref, scene, ev, method, references)
    doc.h2("Protocol")
    doc.bullets(protocol)
    doc.h2("Test views")
    doc.table(["file", "PSNR (dB)", "SSIM", "render time (s)"], per_view_rows, "per-view")
    doc.para(views_note)
    for a, n, c in views:
        doc.figure(a, f"{n}: ground truth | render | error", f"{n}: {c}")
    doc.h2("Orbit")
    if orbit:
        doc.para(f"{orbit.get('frames')} frames at {orbit.get('width')}x{orbit.get('height')}, "
                 + ("a full turn about the scene's up axis" if orbit.get("path") == "circle" else
                    "swinging across the arc the cameras cover")
                 + f", at the cameras' mean height and distance, looking at the scene box's centre; rendered in "
                 f"{fmt(orbit.get('render_s'), 1)} s on {ev.get('eval_device', 'n/a')}.")
        doc.figure(Path(str(orbit["file"])).name, "orbit animation", "orbit of the trained model", link=True)
    else:
        doc.para("no orbit animation in evaluate.json (evaluate.orbit_frames: 0, or an evaluate run from before "
                 "orbits)", em=True)
    doc.h2("Training curve")
    if curve_note:
        doc.para(curve_note, em=True)
    else:
        doc.figure("training_curve.png", "training curve")
    _partitioned_section(doc, rec_m.get("partitioned") if isinstance(rec_m, dict) else None)
    here = [sc for sc in scaling_docs if same_scene(sc.get("scene"), scene)]
    elsewhere = [sc for sc in scaling_docs if not same_scene(sc.get("scene"), scene)]
    if here:
        doc.h2("Scaling")
        doc.para(f"Benchmark runs of this scene (benchmarks/bench_scaling.py), not this run, which trained on "
                 f"{ev.get('gpu_name') or ev.get('device') or 'n/a'}; each table names the GPUs it was measured "
                 "on and its file.")
        for sc in here:
            _scaling_section(doc, sc, scene, method, titled=len(here) > 1)
    doc.h2("Environment")
    doc.table(["", "value"], env_rows, "environment")
    doc.h2("Reproduce")
    text, notes = reproduce_block(ev, env, photos)
    doc.bullets(notes)
    doc.code(text)
    doc.h2("All metrics")
    for name, rows in all_metrics:
        doc.details(name, ["key", "value"], rows, "all")
    for bench in bench_docs:
        env_b = bench["environment"]
        impls = list(dict.fromkeys(str(r.get("impl")) for r in bench["rows"]))
        doc.h2("Appendix: " + ", ".join(impls) + (" side by side" if len(impls) > 1 else ""))
        where = env_b.get("gpu") or env_b.get("machine") or "n/a"
        # the file says how its rows were made ("protocol"); else the side-by-side benchmark's wording
        how = bench.get("protocol") or "on the same images, poses, split, starting Gaussians and metric code."
        doc.para(f"Not this run: {bench['source']}, measured on {where} (torch "
                 f"{env_b.get('torch', 'n/a')}{', gsplat ' + str(env_b['gsplat']) if env_b.get('gsplat') else ''}) "
                 + how, em=True)
        doc.table(*benchmark_table(bench["rows"], bench["peer"]), "benchmark")
        if bench.get("seed_summary"):
            doc.h3("Mean test PSNR over seeds")
            doc.table(*seed_summary_rows(bench["seed_summary"]), "benchmark")
        for block in bench.get("extra") or []:
            doc.h3(f"Also run: {block['name']}")
            if block["note"]:
                doc.para(block["note"], em=True)
            doc.table(*benchmark_table(block["rows"], bench["peer"]), "benchmark")
    if elsewhere:
        doc.h2("Appendix: scaling measured on other scenes")
        others = sorted({str(sc.get("scene") or "scene not recorded") for sc in elsewhere})
        doc.para(f"Not this report's scene ('{scene}') and not this run: the configured scaling files also hold "
                 f"runs of {', '.join(others)}, kept here for context on the distributed path.", em=True)
        for sc in elsewhere:
            _scaling_section(doc, sc, scene, method, titled=True)
    doc.html.append("</body></html>\n")

    with atomic_dir(out_dir) as tmp:
        for name, data in assets.items():
            atomic_write_bytes(tmp / "assets" / name, data)
        atomic_write_text(tmp / "report.md", re.sub(r"\n{3,}", "\n\n", "\n".join(doc.md)))
        atomic_write_text(tmp / "report.html", "\n".join(doc.html))
    out = out_dir.resolve()
    return {"html": out / "report.html", "md": out / "report.md",
            "assets": sorted(out / "assets" / a for a in assets), "views": len(views), "published": published}


def _published_section(doc: Doc, ref: dict | None, scene: str, ev: dict, method: str, references: Path) -> int:
    """The published reference numbers, apart from ours; returns the number of published rows shown."""
    doc.h2("Published reference numbers")
    if ref is None:
        doc.para(f"No published numbers are recorded for scene '{scene}' (add them to "
                 f"{Path(references).name}).", em=True)
        return 0
    results = ref.get("results") or []
    if not results:
        doc.para(f"{ref.get('dataset', scene)}: no published numbers. {ref.get('note', '')}".strip(), em=True)
        return 0
    proto = ref.get("protocol") or {}
    res = f"{proto['width']}x{proto['height']}" if proto.get("width") else "n/a"
    doc.para(f"PUBLISHED figures for {ref.get('dataset', scene)}, copied from the papers named below; they were "
             "not measured by this run, on other hardware and, where flagged, under another protocol.")
    doc.h3("This run")
    doc.table(["", "PSNR (dB)", "SSIM", "LPIPS", "resolution", "test views", "GPU", "training"],
              [["this run (rayforge " + method + ")", fmt(ev.get("psnr"), 2), fmt(ev.get("ssim"), 3),
                fmt(ev.get("lpips"), 3), f"{ev.get('width')}x{ev.get('height')}", fmt(ev.get("num_test_views")),
                f"{ev['gpu_name']} x{ev.get('gpu_count')}" if ev.get("gpu_name") else fmt(ev.get("device")),
                _train_time(ev.get("train_time_s"))]], "ours")
    doc.h3("Published (not this run)")
    rows = [[str(r.get("method", "?")), fmt(r.get("psnr"), 2), fmt(r.get("ssim"), 3), fmt(r.get("lpips"), 3), res,
             fmt(proto.get("test_views")), str(r.get("gpu") or "n/a"), str(r.get("train_time") or "n/a"),
             str(r.get("source") or "n/a") + (f"; {r['note']}" if r.get("note") else "")] for r in results]
    doc.table(["published method", "PSNR (dB)", "SSIM", "LPIPS", "resolution", "test views", "GPU", "training",
               "source"], rows, "published")
    doc.para("Protocol differences to keep in mind:")
    doc.bullets(protocol_differences(ref, ev, method))
    return len(rows)


def _partitioned_section(doc: Doc, part: Any) -> None:
    """The figures of a ``distributed.mode: partitioned`` run (reconstruct.json's ``partitioned``): per
    rank its Gaussians, rasterization time and bytes sent per step; the step's communication; the load
    imbalance over training. Nothing when the run was not partitioned."""
    if not isinstance(part, dict):
        return

    def at(key: str, r: int) -> Any:
        values = part.get(key)
        return values[r] if isinstance(values, list) and r < len(values) else None

    doc.h2("Partitioned training")
    ranks = range(len(part.get("gaussians_per_rank") or []))
    doc.table(["rank", "Gaussians (end)", "rasterization ms / step", "bytes sent / step"],
              [[str(r), fmt(at("gaussians_per_rank", r)), fmt(at("render_ms_per_rank", r), 2),
                fmt_bytes(at("comm_bytes_per_step_per_rank", r))] for r in ranks], "partitioned")
    c = part.get("comm_bytes_per_step") if isinstance(part.get("comm_bytes_per_step"), dict) else {}
    doc.para(f"Sent per training step by all ranks together: {fmt_bytes(c.get('total'))} (2D Gaussians to the "
             f"tiles' ranks {fmt_bytes(c.get('fwd'))}, their gradients back {fmt_bytes(c.get('bwd'))}, image tiles "
             f"{fmt_bytes(c.get('image'))}, split sizes and step figures {fmt_bytes(c.get('other'))}). Mean load "
             f"imbalance (slowest rank's rasterization time / fastest's - 1) {fmt(part.get('mean_imbalance'), 3)}; "
             f"tile ranges re-split {fmt(part.get('tile_resplits'))} times, Gaussian shards "
             f"{fmt(part.get('shard_moves'))} times.")
    series = [p for p in part.get("imbalance") or [] if isinstance(p, dict)]
    if series:
        doc.details("Load imbalance over training", ["from step", "imbalance"],
                    [[fmt(p.get("step")), fmt(p.get("imbalance"), 3)] for p in series], "imbalance")


_BASIS = {"rays_per_s": "training rays/s", "samples_per_s": "samples/s", "wall_s": "1 / wall time"}


def _scaling_section(doc: Doc, sc: dict, scene: str, method: str, titled: bool = False) -> None:
    what = ", ".join(x for x in (sc.get("scene"), sc.get("method")) if x) or "runs"
    if titled:
        doc.h3(f"{what}, {sc.get('mode') or 'scaling'}" + (f" ({sc['global_batch_rays']} rays per step)"
               if sc.get("mode") == "strong" else f" ({sc['batch_rays_per_gpu']} rays per GPU per step)"
               if sc.get("batch_rays_per_gpu") else ""))
    doc.para(f"{what}: one workload at several GPU counts. Speedup: throughput "
             f"({_BASIS[sc['rows'][0]['speedup_basis']]}) against "
             f"the run with the fewest GPUs ({sc['rows'][0]['gpus']}), counted from one GPU with that run taken as "
             "perfectly efficient; efficiency = speedup / GPUs; ΔPSNR against that run.")
    if sc.get("mode") == "strong":
        doc.para(f"Strong scaling: every run takes the same steps with the same global batch "
                 f"({sc.get('global_batch_rays')} rays per step, split over the GPUs) and learning rate.")
    elif sc.get("mode") == "weak" or sc.get("batch_rays_per_gpu"):
        doc.para(f"Same training rays per run at {sc.get('batch_rays_per_gpu')} rays per GPU per step: N GPUs "
                 "take 1/N of the steps with an N-times larger global batch.")
    if sc.get("scene") and not same_scene(sc["scene"], scene):
        doc.para(f"Note: the scaling runs are of scene '{sc['scene']}', this report of '{scene}'.", em=True)
    if sc.get("source"):
        on = f" on {', '.join(sc['gpu_names'])} GPUs" if sc.get("gpu_names") else ""
        doc.para(f"Measured{on} by benchmarks/bench_scaling.py: {sc['source']}.")
    rows = [[fmt(r["gpus"]), "n/a" if r.get("wall_s") is None else fmt(float(r["wall_s"]), 1),
             "n/a" if r.get("rays_per_s") is None else f"{r['rays_per_s']:,.0f}",
             "n/a" if r.get("samples_per_s") is None else f"{r['samples_per_s']:,.0f}", f"{r['speedup']:.2f}x",
             f"{100 * r['efficiency']:.0f}%", fmt(r.get("psnr"), 2),
             "n/a" if r["delta_psnr"] is None else f"{r['delta_psnr']:+.2f}"] for r in sc["rows"]]
    doc.table(["GPUs", "wall time (s)", "rays/s", "samples/s", "speedup", "efficiency", "PSNR (dB)", "ΔPSNR (dB)"], rows,
              "scaling")


def reproduce_block(ev: dict, env: dict, photos: str | None) -> tuple[str, list[str]]:
    """Shell lines that rerun this result, and the facts they rely on."""
    rev, dirty = env.get("code_revision"), env.get("code_dirty")
    lines = [f"git checkout {rev}" if rev else "# code revision unknown (not a git checkout)", "dvc repro"]
    gpus = ev.get("gpu_count") or 0
    if ev.get("device") == "cuda" and gpus > 1:
        lines[-1] = f"dvc repro   # params.yaml sets reconstruct.distributed; this run used {gpus} GPUs"
    lines += ["# prints the params sha256 stated above; a different one means different params:",
              "python -c \"from stages.evaluate import params_sha256; print(params_sha256('params.yaml'))\""]
    notes = []
    if rev:
        changed = env.get("code_dirty_files") or []
        notes.append(f"Code revision {rev}" + (
            " — the working tree had UNCOMMITTED changes" + (f" ({', '.join(changed)})" if changed else "")
            + ", so this revision alone does not reproduce the run"
            if dirty else ", clean working tree (dvc.lock and the pipeline's own metrics and plots aside)"
            if dirty is False else ""))
    if env.get("params_modified"):
        notes.append("params.yaml differed from that commit (as in a `dvc exp run -S ...`): restore the "
                     "experiment's params (`dvc exp apply <name>`) or set them so that the sha256 below matches.")
    notes.append(f"params.yaml ({env.get('params_sha256_of', 'n/a')}): sha256 {fmt(env.get('params_sha256'))}; "
                 f"seed {fmt(ev.get('seed'))}. dvc.lock at that revision pins every stage's inputs and outputs.")
    if photos:
        notes.append(f"Photos: ingest.photos = {photos}" + (" (outside the repository: put the same files there)"
                                                              if photos.startswith(("..", "/")) else ""))
    libs = env.get("libraries") if isinstance(env.get("libraries"), dict) else {}
    notes.append("Libraries: " + (", ".join(f"{k} {v}" for k, v in libs.items() if v)
                                  or f"torch {fmt(env.get('torch_version'))}")
                 + f"; Python {fmt(env.get('python_version'))}")
    gpu = f"{ev['gpu_name']} x{gpus}" if ev.get("gpu_name") else "no GPU (CPU)"
    notes.append(f"Trained on {gpu}, world size {fmt(ev.get('world_size'))}; GPU driver "
                 f"{fmt(env.get('gpu_driver'))}, CUDA {fmt(env.get('cuda_version'))} (evaluating host). "
                 "Other GPUs or library versions give close but not bit-identical numbers.")
    return "\n".join(lines), notes


def scene_key(name: Any) -> str | None:
    """A scene name reduced for comparison: lower case, its last path part; every name of the
    generated default scene (``default``, ``default scene (generated)``) is ``default``."""
    if not isinstance(name, str) or not name.strip():
        return None
    key = name.strip().lower()
    if key.startswith("default"):
        return "default"
    return Path(key).name


def same_scene(a: Any, b: Any) -> bool:
    """Whether two scene names (a scaling file's and the report's) name one scene; unknown never matches."""
    ka, kb = scene_key(a), scene_key(b)
    return ka is not None and ka == kb


def _scene_name(photos: Any) -> str | None:
    """A readable scene name from ``ingest.photos`` (``data/scene/images`` is the generated default).

    The folder's name, or its parent's when the folder is a generic one (``images``,
    ``images_8``, ``train``, ``test``, ``val``), e.g. ``../shared/data/fern/images_8`` -> ``fern``.
    """
    if not isinstance(photos, str) or not photos:
        return None
    p = Path(photos)
    if p.as_posix().rstrip("/") == "data/scene/images":
        return "default scene (generated)"
    generic = p.name.startswith("images") or p.name in ("train", "test", "val")
    return p.parent.name if generic and p.parent.name else p.name


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--evaluate", type=Path, required=True, help="the evaluate stage's out folder")
    ap.add_argument("--metrics-dir", type=Path, required=True, help="folder of poses/reconstruct/evaluate .json")
    ap.add_argument("--plots", type=Path, required=True, help="the training curve train.csv")
    ap.add_argument("--poses", type=Path, required=True, help="the poses stage's out folder")
    ap.add_argument("--out", type=Path, required=True, help="this stage's out folder")
    ap.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="params file (default: params.yaml)")
    ap.add_argument("--scaling", type=Path, action="append", default=None,
                    help='JSON {"scene", "method", "runs": [{"gpus", "wall_s", "samples_per_s", "psnr"}]}: '
                         "adds a scaling table (repeatable)")
    args = ap.parse_args(argv)
    setup("report")

    def body() -> None:
        data = read_yaml(args.params)
        params = load_section(ReportParams, "report", args.params, data=data)
        ingest, poses = data.get("ingest") or {}, data.get("poses") or {}
        photos = ingest.get("photos") if isinstance(ingest, dict) else None
        test_every = poses.get("test_every") if isinstance(poses, dict) else None
        out = run(params, args.evaluate, args.metrics_dir, args.plots, args.poses, args.out,
                  scene=_scene_name(photos),
                  test_every=test_every if isinstance(test_every, int) and test_every > 0 else None,
                  scaling=[args.params.parent / f for f in params.scaling] + list(args.scaling or []),
                  benchmarks=[args.params.parent / f for f in params.benchmarks],
                  photos=photos if isinstance(photos, str) else None)
        print(f"Report: {out['html']}")

    return run_stage("report", body)


if __name__ == "__main__":
    cli(main)
