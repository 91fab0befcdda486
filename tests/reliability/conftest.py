"""The reliability suite's recorder: every fault and bad input tried, and what happened, into docs/reliability.md.

A test declares its case with ``@pytest.mark.reliability(area, case, expected)`` (so a skipped
test still shows up, with its reason) and/or records cases as it goes through the ``reliability``
fixture: ``reliability(area, case, expected, observed)``. A case is "ok" when its test passed,
"FAILED" when it failed, "skipped (reason)" when it was skipped. When every test of this folder ran
(every file collected, nothing deselected or picked by node id, no early stop), the table is
written to ``docs/reliability.md`` (or to ``$RAYFORGE_RELIABILITY_TABLE``; ``0`` turns it off). The table holds no timings or dates, so a
rerun that sees the same behaviour writes the same file.

Shared fixtures: ``tiny_poses`` / ``other_poses`` (two small generated scenes, no SfM).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TABLE = ROOT / "docs" / "reliability.md"

AREAS = [  # the table's order
    "data loss", "wrong checkpoint", "orphans and locks", "stale outs", "hang", "clean stop", "silently wrong",
    "leftovers", "fault: killed training", "fault: non-finite values", "fault: full disk",
    "fault: dvc repro interrupted", "fault: out of memory", "bad input: images", "bad input: camera files",
    "bad input: params", "bad input: paths",
]

_state = {"deselected": 0}
OBSERVED_CHARS = 240  # longer messages are cut in the table (after temporary paths became <tmp>)


def _ours(item: pytest.Item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability(area, case, expected): a case of the reliability table")


def pytest_deselected(items: list[pytest.Item]) -> None:
    _state["deselected"] += sum(1 for it in items if _ours(it))


@pytest.fixture
def reliability(request: pytest.FixtureRequest):
    """``record(area, case, expected, observed)``: one row of the table (several per test are fine)."""
    rows = request.node.__dict__.setdefault("_reliability_rows", [])
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    temp = re.compile("|".join(re.escape(str(b)) + r"/[^/\s]+" for b in {base, base.resolve()}))

    def record(area: str, case: str, expected: str, observed: str) -> None:
        assert area in AREAS, area
        seen = " ".join(temp.sub("<tmp>", observed).split())
        rows.append({"area": area, "case": temp.sub("<tmp>", case), "expected": expected,
                     "observed": seen if len(seen) <= OBSERVED_CHARS else seen[:OBSERVED_CHARS - 1] + "…"})

    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    if not _ours(item):
        return
    if rep.failed:
        item.__dict__["_reliability_result"] = "FAILED"
    elif rep.skipped and "_reliability_result" not in item.__dict__:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        item.__dict__["_reliability_result"] = f"skipped ({reason.removeprefix('Skipped: ')})"
    elif rep.when == "call" and rep.passed:
        item.__dict__.setdefault("_reliability_result", "ok")


def _rows_of(item: pytest.Item) -> list[dict]:
    result = item.__dict__.get("_reliability_result", "not run")
    rows = list(item.__dict__.get("_reliability_rows", []))
    for m in item.iter_markers("reliability"):
        if not any(r["case"] == m.args[1] for r in rows):
            rows.insert(0, {"area": m.args[0], "case": m.args[1], "expected": m.args[2],
                            "observed": "" if result == "ok" else "-"})
    return [{**r, "result": result, "test": item.nodeid.split("::", 1)[-1]} for r in rows]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    items = [it for it in session.items if _ours(it)]
    where = os.environ.get("RAYFORGE_RELIABILITY_TABLE", str(TABLE))
    # the whole folder: every test file collected, no test chosen by node id (file.py::test_x)
    # or deselected (-k, -m), and every test run to the end
    collected = {Path(str(it.fspath)).resolve() for it in items}
    whole = set(HERE.glob("test_*.py")) <= collected and not any("::" in str(a) for a in session.config.args)
    complete = (items and whole and _state["deselected"] == 0
                and all("_reliability_result" in it.__dict__ for it in items))
    if where == "0" or not complete:
        return
    Path(where).write_text(render([row for it in items for row in _rows_of(it)]))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render(cases: list[dict]) -> str:
    order = {a: i for i, a in enumerate(AREAS)}
    cases = sorted(cases, key=lambda c: order[c["area"]])  # stable: within an area, the tests' order
    ok = sum(c["result"] == "ok" for c in cases)
    failed = sum(c["result"] == "FAILED" for c in cases)
    skipped = len(cases) - ok - failed
    lines = [
        "# Reliability: the faults and bad inputs tried, and what happened",
        "",
        "Generated by the reliability suite (`python -m pytest tests/reliability`, part of `make test`;",
        "`tests/reliability/conftest.py` writes this file when the whole suite ran). Each row is one fault",
        "injected or one bad input given to the real stage commands, DVC, torchrun or the Prefect flow; *observed*",
        "is what the test saw, *result* whether that was the expected outcome.",
        "",
        f"{len(cases)} cases: {ok} ok, {failed} failed, {skipped} skipped.",
        "",
        "| area | case | expected | observed | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in cases:
        lines.append(f"| {_cell(c['area'])} | {_cell(c['case'])} | {_cell(c['expected'])} | {_cell(c['observed'])} | "
                     f"{_cell(c['result'])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- shared set-up


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The in-process runs use tiny tensors: on a shared 2-core machine extra threads only contend."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)



@pytest.fixture(scope="session")
def tiny_poses(tmp_path_factory) -> Path:
    """A poses-stage folder of a 64x48, 8-view generated scene (ground-truth cameras, no SfM)."""
    from test_distributed import make_poses

    return make_poses(tmp_path_factory.mktemp("scene_a"))


@pytest.fixture(scope="session")
def other_poses(tmp_path_factory) -> Path:
    """Another scene of the same size (other objects, other seed): "another scene" for the checks."""
    from stages.scene import SceneParams, poses_from_ground_truth, run as scene_run

    root = tmp_path_factory.mktemp("scene_b")
    scene_run(SceneParams(width=64, height=48, views=8, rings=1, objects=4), root / "scene", 1)
    return poses_from_ground_truth(root / "scene" / "images", root / "poses")
