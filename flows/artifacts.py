"""The run's results as Prefect artifacts: the report as markdown, the metrics as a table."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.stage_task import run_logger

REPORT = Path("data/report/report.md")
METRICS_DIR = Path("data/metrics")
REPORT_KEY = "reconstruction-report"
METRICS_KEY = "reconstruction-metrics"


def metrics_rows(metrics_dir: Path) -> list[dict[str, Any]]:
    """One row per metric of every ``*.json`` in ``metrics_dir``: file, dotted name, value.

    Nested objects are flattened (``{"psnr": {"mean": 1}}`` -> ``psnr.mean``); lists are
    kept as JSON text.
    """
    rows: list[dict[str, Any]] = []

    def walk(source: str, prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(source, f"{prefix}.{k}" if prefix else str(k), v)
        else:
            if isinstance(value, (list, tuple)):
                value = json.dumps(value)
            rows.append({"file": source, "metric": prefix, "value": value})

    for path in sorted(metrics_dir.glob("*.json")):
        walk(path.name, "", json.loads(path.read_text(encoding="utf-8")))
    return rows


@task(name="publish-results", task_run_name="publish-results", cache_policy=NO_CACHE)
def publish_results(repo: str, description: str = "") -> dict[str, str | None]:
    """Publish ``data/report/report.md`` and ``data/metrics/*.json`` of ``repo`` as artifacts.

    A missing report or metrics folder is logged and skipped (a pipeline without those
    stages still completes). Returns the artifact ids, None where nothing was published.
    """
    logger = run_logger()
    root = Path(repo)
    ids: dict[str, str | None] = {REPORT_KEY: None, METRICS_KEY: None}
    report = root / REPORT
    if report.is_file():
        ids[REPORT_KEY] = str(create_markdown_artifact(
            markdown=report.read_text(encoding="utf-8"), key=REPORT_KEY,
            description=f"{report} (images: see report.html beside it). {description}".strip(),
        ))
        logger.info("published %s as the markdown artifact %r", report, REPORT_KEY)
    else:
        logger.warning("no report at %s; no report artifact", report)
    rows = metrics_rows(root / METRICS_DIR) if (root / METRICS_DIR).is_dir() else []
    if rows:
        ids[METRICS_KEY] = str(create_table_artifact(
            table=rows, key=METRICS_KEY, description=f"{root / METRICS_DIR}/*.json. {description}".strip(),
        ))
        logger.info("published %d metrics as the table artifact %r", len(rows), METRICS_KEY)
    else:
        logger.warning("no metrics in %s; no metrics artifact", root / METRICS_DIR)
    return ids
