"""Compare experiments: one offline page from `dvc exp show` of several `dvc exp run`s.

    python -m stages.compare --out data/compare [--all-commits | --rev REV ...] [--baseline NAME]

Reads ``dvc exp show --json`` in the repository (``--repo``, default: here), or a file
saved from it (``--from-json``), and writes into ``--out``:

* ``compare.html``: self-contained (inline CSS, the chart as a ``data:`` URI), opens offline;
* ``compare.md``: the same tables, with the chart beside it in ``assets/``;
* ``compare.json``: the rows as parsed, for scripts.

One row per run: the baseline commit (highlighted) and each experiment derived from it,
with the params that differ from the baseline, PSNR / SSIM / render FPS / training time /
throughput and their change against the baseline, the world size and the registered
images. When runs that differ only in ``reconstruct.distributed`` settings ran with
different numbers of workers (GPUs, or gloo processes on a CPU), a scaling table
(``stages.report.scaling_rows``: speedup and efficiency against the smallest world) is
added for each such group.

Not a DVC stage: it reads every experiment of the repository, not the outs of one run.
Experiments keep their metrics only if the metrics files are tracked by git (``cache: false``
outs that are not git-ignored); rows without metrics say so. ``dvc exp show`` gives the
headline metrics; the figures beyond them (environment, samples/s, GPU, ...) come from each
run's full records (``<name>.full.json``, ``stages.common.metrics_files``), read from git at
the run's commit (the workspace row: from the working tree).
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import logging
import math
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from PIL import Image, ImageDraw, ImageFont

from stages import report as R
from stages.common.entry import cli, run_stage
from stages.common.io import atomic_dir, atomic_write_bytes, atomic_write_text, check_outs
from stages.common.metrics_files import full_path
from stages.common.plots import png_bytes

log = logging.getLogger("compare")

# Params that change how the work is spread, not what is computed: runs that differ only in
# these (and in the evaluate/report sections, which do not touch training) form a scaling group.
SCALING_FREE_PREFIXES = ("reconstruct.distributed.", "evaluate.", "report.")


@dataclass
class Run:
    """One row of the comparison: a baseline commit, an experiment, or the workspace."""

    name: str
    rev: str
    kind: str  # "baseline" | "experiment" | "workspace"
    baseline_rev: str  # the commit the run derives from (itself for a baseline)
    timestamp: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # flattened: "reconstruct.steps" -> 1000
    metrics: dict[str, dict] = field(default_factory=dict)  # by file stem: "evaluate" -> {...}
    metric_files: dict[str, str] = field(default_factory=dict)  # by file stem: "evaluate" -> its path
    error: str | None = None

    def metric(self, *keys: str) -> Any:
        """The first of ``keys`` ("evaluate.psnr", ...) that is present and not None."""
        for key in keys:
            stem, _, name = key.partition(".")
            value = self.metrics.get(stem, {})
            for part in name.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                return value
        return None

    @property
    def world_size(self) -> int | None:
        ws = self.metric("evaluate.world_size", "reconstruct.world_size")
        if isinstance(ws, int):
            return ws
        gpus = self.params.get("reconstruct.distributed.gpus")
        return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else None


# ---------------------------------------------------------------- reading `dvc exp show --json`


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: doc}


def _params(data: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, entry in (data.get("params") or {}).items():
        flat = _flatten((entry or {}).get("data") or {})
        pre = "" if Path(path).name == "params.yaml" else f"{path}:"
        out.update({pre + k: v for k, v in flat.items()})
    return out


def _metrics(data: dict) -> tuple[dict[str, dict], dict[str, str], list[str]]:
    out, paths, errors = {}, {}, []
    for path, entry in (data.get("metrics") or {}).items():
        entry = entry or {}
        if entry.get("data"):
            out[Path(path).stem] = entry["data"]
            paths[Path(path).stem] = path
        elif entry.get("error"):
            err = entry["error"]
            errors.append(f"{path}: {err.get('type', 'error')}" if isinstance(err, dict) else f"{path}: {err}")
    return out, paths, errors


def _error_text(err: Any) -> str | None:
    if not err:
        return None
    if isinstance(err, dict):
        return ": ".join(str(err[k]) for k in ("type", "msg") if err.get(k)) or json.dumps(err)
    return str(err)


def _run_from(entry: dict, name: str, kind: str, baseline_rev: str) -> Run:
    data = entry.get("data") or {}
    metrics, metric_files, metric_errors = _metrics(data)
    error = _error_text(entry.get("error"))
    if not metrics and metric_errors:
        error = "; ".join(([error] if error else []) + ["no metrics: " + ", ".join(metric_errors)])
    rev = entry.get("rev") or data.get("rev") or "?"
    return Run(name=name, rev=rev, kind=kind, baseline_rev=baseline_rev, timestamp=data.get("timestamp"),
               params=_params(data), metrics=metrics, metric_files=metric_files, error=error)


def parse_exp_show(doc: Any) -> list[Run]:
    """The rows of ``dvc exp show --json`` (DVC 3): baselines first, each followed by its experiments.

    The workspace row is kept only when it matches no other row (after ``dvc exp run`` the
    workspace holds the last experiment's results, a duplicate).
    """
    if not isinstance(doc, list):
        raise ValueError(f"dvc exp show --json: expected a list of commits, got {type(doc).__name__}")
    runs, workspace = [], []
    for commit in doc:
        if not isinstance(commit, dict):
            raise ValueError(f"dvc exp show --json: expected an object per commit, got {commit!r:.80}")
        rev = commit.get("rev") or "?"
        if rev == "workspace":
            workspace.append(_run_from(commit, "workspace", "workspace", "workspace"))
            continue
        runs.append(_run_from(commit, commit.get("name") or rev[:7], "baseline", rev))
        for exp in commit.get("experiments") or []:
            revs = exp.get("revs") or []
            if not revs:
                continue
            head = revs[0]  # newest first; DVC 3 keeps one rev per experiment
            name = head.get("name") or exp.get("name") or (head.get("rev") or "?")[:7]
            run = _run_from(head, name, "experiment", rev)
            state = (exp.get("executor") or {}).get("state") if isinstance(exp.get("executor"), dict) else None
            if state and state not in ("success", "done"):
                run.error = run.error or f"experiment {state}"
            runs.append(run)
    head = next((r.rev for r in runs if r.kind == "baseline"), None)
    for ws in workspace:
        if not any(r.params == ws.params and r.metrics == ws.metrics for r in runs):
            ws.baseline_rev = head or ws.baseline_rev  # uncommitted changes on top of HEAD (listed first)
            runs.insert(0, ws)
    return runs


def _full_record_text(repo: Path, run: Run, path: str) -> str | None:
    if run.rev == "workspace":
        file = repo / path
        return file.read_text(encoding="utf-8") if file.is_file() else None
    p = subprocess.run(["git", "show", f"{run.rev}:./{path}"], cwd=repo, capture_output=True, text=True, check=False)
    return p.stdout if p.returncode == 0 else None


def add_full_records(runs: list[Run], repo: str | Path) -> None:
    """Lay each run's full metrics records under its headline metrics (in place).

    ``dvc exp show`` reads only the headline files; their ``<name>.full.json`` comes from git
    at the run's commit (every experiment is one), or from the working tree for the workspace.
    A run without one (metrics from before the split) keeps its headline alone.
    """
    repo = Path(repo)
    for run in runs:
        for stem, path in run.metric_files.items():
            text = _full_record_text(repo, run, full_path(path).as_posix())
            try:
                doc = json.loads(text) if text else None
            except json.JSONDecodeError:
                log.warning("%s at %s: not valid JSON; only the headline metrics are used", full_path(path), run.name)
                continue
            if isinstance(doc, dict):
                run.metrics[stem] = {**doc, **run.metrics[stem]}


def dvc_exp_show(repo: str | Path, all_commits: bool = False, revs: list[str] | None = None) -> list:
    """``dvc exp show --json`` in ``repo``; one call per ``--rev``, commits merged in order."""
    base = [sys.executable, "-m", "dvc", "exp", "show", "--json", "--no-pager"]
    calls = [base + ["--all-commits"]] if all_commits else [base + ["--rev", r] for r in revs] if revs else [base]
    merged, seen = [], set()
    for cmd in calls:
        p = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise ValueError(f"`{' '.join(cmd[2:])}` failed in {repo} ({p.returncode}): {p.stderr.strip()[-2000:]}")
        try:
            doc = json.loads(p.stdout)
        except json.JSONDecodeError as exc:
            raise ValueError(f"`{' '.join(cmd[2:])}` printed no JSON ({exc}): {p.stdout[:500]!r}") from None
        for commit in doc:
            key = commit.get("rev")
            if key not in seen:
                seen.add(key)
                merged.append(commit)
    return merged


# ---------------------------------------------------------------- comparing


def choose_baselines(runs: list[Run], baseline: str | None = None) -> dict[str, Run]:
    """For each baseline rev, the run that deltas are taken against.

    Normally the commit itself. With ``baseline`` (an experiment's name or a rev prefix), that
    run for every row. When a commit has no metrics (metrics files not in git), an experiment
    or the workspace with the commit's params (a rerun of the baseline) stands in.
    """
    if baseline:
        hits = [r for r in runs if r.name == baseline or r.rev.startswith(baseline)]
        if not hits:
            raise ValueError(f"--baseline {baseline!r}: no such experiment or rev; have "
                             + ", ".join(r.name for r in runs))
        return {r.baseline_rev: hits[0] for r in runs}
    chosen = {r.rev: r for r in runs if r.kind == "baseline" or r.baseline_rev == r.rev}
    for rev, base in list(chosen.items()):
        if base.metrics:
            continue
        twin = next((r for r in runs if r.baseline_rev == rev and r is not base and r.metrics
                     and r.params == base.params), None)
        if twin is not None:
            log.info("baseline %s has no metrics; using experiment %s (same params) instead", base.name, twin.name)
            chosen[rev] = twin
    return chosen


MISSING = object()  # a param one of two runs does not have


def changed_params(run: Run, base: Run) -> list[tuple[str, Any, Any]]:
    """(key, baseline value, this run's value) for each param that differs; :data:`MISSING` where absent."""
    keys = sorted(set(run.params) | set(base.params))
    return [(k, base.params.get(k, MISSING), run.params.get(k, MISSING)) for k in keys
            if base.params.get(k, MISSING) != run.params.get(k, MISSING)]


def describe_change(key: str, old: Any, new: Any) -> str:
    if old is MISSING:
        return f"{key}={_value(new)} (new)"
    if new is MISSING:
        return f"{key} removed (was {_value(old)})"
    return f"{key}={_value(new)} (was {_value(old)})"


@dataclass
class Column:
    header: str
    get: Callable[[Run], Any]
    show: Callable[[Any], str]
    delta: Callable[[Any, Any], str] | None = None  # (value, baseline value) -> text


def _pct(v: Any, b: Any) -> str:
    if not isinstance(v, (int, float)) or not isinstance(b, (int, float)) or not b:
        return ""
    return f"{100.0 * (v - b) / b:+.0f}%"


def _diff(fmt: str, unit: str = "") -> Callable[[Any, Any], str]:
    def d(v: Any, b: Any) -> str:
        if not isinstance(v, (int, float)) or not isinstance(b, (int, float)):
            return ""
        return f"{v - b:{fmt}}{unit}"
    return d


def _num(fmt: str, unit: str = "") -> Callable[[Any], str]:
    def s(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return "n/a" if v is None else str(v)
        return f"{v:{fmt}}{unit}"
    return s


def _registered(r: Run) -> str | None:
    n, total = r.metric("poses.num_registered"), r.metric("poses.num_images")
    if n is None:
        return None
    return f"{n} / {total}" if total is not None else str(n)


def _device(r: Run) -> str | None:
    gpu = r.metric("evaluate.gpu_name", "reconstruct.gpu_name")
    return gpu or r.metric("reconstruct.device", "evaluate.device")


COLUMNS = [
    Column("PSNR (dB)", lambda r: r.metric("evaluate.psnr"), _num(".2f"), _diff("+.2f", " dB")),
    Column("SSIM", lambda r: r.metric("evaluate.ssim"), _num(".4f"), _diff("+.4f")),
    Column("render (views/s)", lambda r: r.metric("evaluate.fps"), _num(".2f"), _pct),
    Column("train time", lambda r: r.metric("evaluate.train_time_s", "reconstruct.train_time_s"), _num(".1f", " s"),
           _pct),
    Column("samples/s", lambda r: r.metric("reconstruct.samples_per_s"), _num(",.0f"), _pct),
    Column("steps", lambda r: r.metric("evaluate.steps", "reconstruct.steps"), _num(",d")),
    Column("world size", lambda r: r.world_size, _num("d")),
    Column("device", _device, lambda v: "n/a" if v is None else str(v)),
    Column("registered images", _registered, lambda v: "n/a" if v is None else str(v)),
]


def _value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) or v is None else str(v)


def table_rows(runs: list[Run], bases: dict[str, Run]) -> list[dict]:
    """One dict per run: name, rev, role, changed params, and per column value + delta texts."""
    rows = []
    for r in runs:
        base = bases.get(r.baseline_rev, r)
        is_base = base is r
        changes = [] if is_base else changed_params(r, base)
        cells = []
        for c in COLUMNS:
            v, bv = c.get(r), c.get(base)
            delta = "" if is_base or c.delta is None or v is None or bv is None else c.delta(v, bv)
            cells.append({"value": c.show(v), "delta": delta})
        rows.append({
            "name": r.name, "rev": r.rev[:7] if r.rev != "workspace" else "workspace",
            "role": "baseline" if is_base else "commit" if r.kind == "baseline" else r.kind, "baseline": base.name,
            "changed": [describe_change(k, a, b) for k, a, b in changes],
            "cells": cells, "error": r.error,
        })
    return rows


def scaling_groups(runs: list[Run]) -> list[list[Run]]:
    """Runs with the same params apart from :data:`SCALING_FREE_PREFIXES`, over >= 2 world sizes.

    Within a group one run per world size (the first in ``runs``, baselines come first);
    groups sorted by their smallest world size's position.
    """
    groups: dict[str, list[Run]] = {}
    for r in runs:
        if r.world_size is None or r.metric("reconstruct.samples_per_s", "evaluate.train_time_s") is None:
            continue
        key = json.dumps({k: v for k, v in r.params.items() if not k.startswith(SCALING_FREE_PREFIXES)},
                         sort_keys=True, default=str)
        group = groups.setdefault(key, [])
        if all(g.world_size != r.world_size for g in group):
            group.append(r)
    return [sorted(g, key=lambda r: r.world_size) for g in groups.values() if len(g) >= 2]


def scaling_table(group: list[Run]) -> list[dict]:
    """``stages.report.scaling_rows`` over one group (each row keeps the run's ``name``)."""
    return R.scaling_rows([{"name": r.name, "gpus": r.world_size,
                            "wall_s": r.metric("reconstruct.train_time_s", "evaluate.train_time_s"),
                            "rays_per_s": r.metric("reconstruct.rays_per_s"),
                            "samples_per_s": r.metric("reconstruct.samples_per_s"),
                            "psnr": r.metric("evaluate.psnr")} for r in group])


SCALING_HEADER = ["run", "world size", "train time", "samples/s", "speedup", "efficiency", "PSNR (dB)"]


def _scaling_cells(row: dict) -> list[str]:
    eff = row.get("efficiency")
    return [str(row["name"]), _num("d")(row.get("gpus")), _num(".1f", " s")(row.get("wall_s")),
            _num(",.0f")(row.get("samples_per_s")), _num(".2f", "x")(row.get("speedup")),
            "n/a" if not isinstance(eff, (int, float)) else f"{100 * eff:.0f}%", _num(".2f")(row.get("psnr"))]


# ---------------------------------------------------------------- the documents


def psnr_chart(rows: list[dict], runs: list[Run]) -> bytes | None:
    """Horizontal bars of test PSNR per run, the baseline(s) in orange; PNG bytes (None: no PSNR)."""
    vals = [(row["name"], r.metric("evaluate.psnr"), row["role"] == "baseline") for row, r in zip(rows, runs)]
    vals = [(n, v, b) for n, v, b in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None
    try:
        font = ImageFont.load_default(size=13)
    except (TypeError, OSError):
        font = ImageFont.load_default()
    bar_h, gap, left, right, top = 18, 8, 170, 80, 30
    width = 760
    height = top + len(vals) * (bar_h + gap) + 10
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 6), "test PSNR (dB)", fill=(30, 30, 30), font=font)
    hi = max(v for _, v, _ in vals)
    scale = (width - left - right) / max(hi, 1e-9)
    for k, (name, v, is_base) in enumerate(vals):
        y = top + k * (bar_h + gap)
        label = name if len(name) <= 24 else name[:23] + "…"
        d.text((6, y + 2), label, fill=(30, 30, 30), font=font)
        color = (230, 97, 1) if is_base else (31, 119, 180)
        d.rectangle([left, y, left + max(1, round(v * scale)), y + bar_h], fill=color)
        d.text((left + round(v * scale) + 6, y + 2), f"{v:.2f}", fill=(30, 30, 30), font=font)
    return png_bytes(img)


_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;max-width:1500px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}th,td{border:1px solid #d0d0d0;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%;height:auto;display:block}
code{font-family:SFMono-Regular,Consolas,monospace;font-size:.88em}.sub{color:#666}
tr.baseline td{background:#fff4e5;font-weight:600}tr.failed td{color:#999}
.delta{color:#666;font-size:.85em;white-space:nowrap}.delta.up{color:#1a7f37}.delta.down{color:#b42318}
td.changed{font-family:SFMono-Regular,Consolas,monospace;font-size:.82em}
"""

def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]) + "\n"


def _html_table(header: list[str], rows: list[list[str]], cls: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>\n" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>\n'


# a larger value is better for these columns (for colouring deltas); train time: smaller is better
_BETTER = {"PSNR (dB)": 1, "SSIM": 1, "render (views/s)": 1, "train time": -1, "samples/s": 1}


def _delta_class(header: str, delta: str) -> str:
    if not any(ch in "123456789" for ch in delta):  # +0%, -0.00 dB: no change
        return "delta"
    sign = 1 if delta.startswith("+") else -1 if delta.startswith("-") else 0
    better = _BETTER.get(header, 0) * sign
    return "delta up" if better > 0 else "delta down" if better < 0 else "delta"


def write(runs: list[Run], bases: dict[str, Run], out_dir: str | Path, title: str = "Experiment comparison",
          source: str = "dvc exp show --json") -> dict:
    """Write ``compare.html``, ``compare.md`` (+ ``assets/``) and ``compare.json`` into ``out_dir``."""
    out_dir = Path(out_dir)
    rows = table_rows(runs, bases)
    groups = scaling_groups(runs)
    scaling = [scaling_table(g) for g in groups]
    chart = psnr_chart(rows, runs)
    header = ["run", "rev", "changed params (vs baseline)"] + [c.header for c in COLUMNS]
    failed = [r for r in rows if r["error"]]

    def md_cell(row: dict, k: int) -> str:
        cell = row["cells"][k]
        return cell["value"] + (f" ({cell['delta']})" if cell["delta"] else "")

    md = [f"# {title}", "", f"{len(runs)} runs from `{source}`. The baseline of each group is marked **bold**; "
          "changes are against it.", ""]
    md_rows = []
    for row in rows:
        name = f"**{row['name']}** (baseline)" if row["role"] == "baseline" else row["name"]
        md_rows.append([name, row["rev"], "<br>".join(row["changed"]) or "—"]
                       + [md_cell(row, k) for k in range(len(COLUMNS))])
    md.append(_md_table(header, md_rows))
    if chart:
        md += ["![test PSNR per run](assets/psnr.png)", ""]
    for table, group in zip(scaling, groups):
        md += [f"## Scaling: {', '.join(r.name for r in group)}", "",
               "Same params apart from `reconstruct.distributed` (and evaluate/report); speedup and efficiency "
               "against the smallest world size (`stages.report.scaling_rows`).", "",
               _md_table(SCALING_HEADER, [_scaling_cells(t) for t in table])]
    if failed:
        md += ["## Runs without results", ""] + [f"* {r['name']} ({r['rev']}): {r['error']}" for r in failed] + [""]

    esc = html.escape
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         '<meta name="viewport" content="width=device-width, initial-scale=1">',
         f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
         f"<h1>{esc(title)}</h1>",
         f'<p class="sub">{len(runs)} runs from <code>{esc(source)}</code>. The baseline of each group is '
         "highlighted; the small figures are changes against it.</p>",
         '<table class="experiments"><thead><tr>' + "".join(f"<th>{esc(x)}</th>" for x in header)
         + "</tr></thead><tbody>"]
    for row in rows:
        cls = "baseline" if row["role"] == "baseline" else "failed" if row["error"] else ""
        name = esc(row["name"]) + (' <span class="sub">(baseline)</span>' if row["role"] == "baseline" else "")
        tds = [f"<td>{name}</td>", f"<td><code>{esc(row['rev'])}</code></td>",
               '<td class="changed">' + ("<br>".join(esc(c) for c in row["changed"]) or "—") + "</td>"]
        for c, cell in zip(COLUMNS, row["cells"]):
            delta = (f'<br><span class="{_delta_class(c.header, cell["delta"])}">{esc(cell["delta"])}</span>'
                     if cell["delta"] else "")
            tds.append(f"<td>{esc(cell['value'])}{delta}</td>")
        h.append(f'<tr class="{cls}">' + "".join(tds) + "</tr>")
    h.append("</tbody></table>")
    if chart:
        h.append(f'<figure><img alt="test PSNR per run" src="data:image/png;base64,'
                 f'{base64.b64encode(chart).decode()}"></figure>')
    for table, group in zip(scaling, groups):
        h += [f"<h2>Scaling: {esc(', '.join(r.name for r in group))}</h2>",
              "<p>Same params apart from <code>reconstruct.distributed</code> (and evaluate/report); speedup and "
              "efficiency against the smallest world size.</p>",
              _html_table(SCALING_HEADER, [_scaling_cells(t) for t in table], "scaling")]
    if failed:
        h.append("<h2>Runs without results</h2><ul>")
        h += [f"<li>{esc(r['name'])} (<code>{esc(r['rev'])}</code>): {esc(r['error'])}</li>" for r in failed]
        h.append("</ul>")
    env_rows = [[r.name, R.fmt(r.metric("evaluate.environment.code_revision")),
                 R.fmt(r.metric("evaluate.environment.code_dirty")),
                 R.fmt(r.metric("evaluate.environment.torch_version")),
                 R.fmt(r.metric("evaluate.environment.params_sha256"))[:16], r.timestamp or "n/a"] for r in runs]
    env_header = ["run", "code revision", "dirty", "torch", "params sha256 (first 16)", "time"]
    h += ["<h2>Environment</h2>", _html_table(env_header, env_rows, "environment"), "</body></html>\n"]
    md += ["## Environment", "", _md_table(env_header, env_rows)]

    doc = {"source": source, "runs": [asdict(r) for r in runs], "rows": rows, "scaling": scaling}
    with atomic_dir(out_dir) as tmp:
        if chart:
            atomic_write_bytes(tmp / "assets" / "psnr.png", chart)
        atomic_write_text(tmp / "compare.md", "\n".join(md) + "\n")
        atomic_write_text(tmp / "compare.html", "\n".join(h))
        atomic_write_text(tmp / "compare.json", json.dumps(doc, indent=1, default=str) + "\n")
    out = out_dir.resolve()
    return {"html": out / "compare.html", "md": out / "compare.md", "json": out / "compare.json",
            "runs": len(runs), "scaling_tables": len(scaling)}


def run(out_dir: str | Path, repo: str | Path = ".", all_commits: bool = False, revs: list[str] | None = None,
        baseline: str | None = None, from_json: str | Path | None = None) -> dict:
    """Read the experiments (``dvc exp show --json`` in ``repo``, or the saved ``from_json``) and write the page."""
    check_outs({"--from-json": from_json, "--repo": Path(repo) / "dvc.yaml"}, {"--out": out_dir})
    if from_json is not None:
        doc, source = json.loads(Path(from_json).read_text()), str(from_json)
    else:
        doc = dvc_exp_show(repo, all_commits, revs)
        source = "dvc exp show --json" + (" --all-commits" if all_commits else "".join(f" --rev {r}" for r in revs or []))
    runs = parse_exp_show(doc)
    if not runs:
        raise ValueError(f"{source}: no commits or experiments to compare")
    if from_json is None:
        add_full_records(runs, repo)
    no_metrics = [r.name for r in runs if not r.metrics]
    if no_metrics:
        log.warning("no metrics for %s: metrics files that git ignores are not kept with experiments "
                    "(track data/metrics/ in git)", ", ".join(no_metrics))
    return write(runs, choose_baselines(runs, baseline), out_dir, source=source)


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="out folder for compare.html / .md / .json")
    ap.add_argument("--repo", type=Path, default=Path("."), help="the DVC repository (default: here)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--all-commits", "-A", action="store_true", help="experiments of every commit")
    which.add_argument("--rev", action="append", help="experiments of this baseline commit (repeatable; "
                       "default HEAD)")
    which.add_argument("--from-json", type=Path, help="a saved `dvc exp show --json` instead of running it")
    ap.add_argument("--baseline", help="experiment name or rev to take deltas against (default: each commit)")
    args = ap.parse_args(argv)
    setup("compare")

    def body() -> None:
        out = run(args.out, args.repo, args.all_commits, args.rev, args.baseline, args.from_json)
        print(f"Compared {out['runs']} runs ({out['scaling_tables']} scaling table(s))")
        print(f"Comparison: {out['html']}")

    return run_stage("compare", body)


if __name__ == "__main__":
    cli(main)
