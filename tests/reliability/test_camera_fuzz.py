"""Fuzzing the camera files the parsers of tests/test_importers.py do not reach: LLFF arrays and
``.npy`` bytes, whole ``transforms.json`` files as bytes (encodings, truncation), and the ingest
stage's ``ground_truth.json``. Each example must parse or be refused with a ``ValueError`` (which the
stages print as one line); anything else (a crash, another exception) fails. The COLMAP text/binary
and transforms-document fuzzers stay in tests/test_importers.py."""
from __future__ import annotations

import io
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from stages import importers as I
from stages import ingest

AREA = "bad input: camera files"
# derandomized: the same examples, so the same table, every run
FUZZ = settings(max_examples=120, deadline=2000, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
COUNT: dict[str, list[int]] = {}  # fuzz target -> [examples, parsed, refused]


def _try(target: str, fn, *args) -> None:
    n = COUNT.setdefault(target, [0, 0, 0])
    n[0] += 1
    try:
        fn(*args)
        n[1] += 1
    except ValueError:
        n[2] += 1


def _record(reliability, target: str, what: str) -> None:
    n, ok, refused = COUNT.pop(target)
    assert n > 0
    reliability(AREA, f"{what} (hypothesis, {n} examples)", "parsed, or refused with a ValueError naming the file",
                f"{ok} parsed, {refused} refused, no other exception")


def _good_rows(n: int = 3) -> np.ndarray:
    rows = []
    for k in range(n):
        m = np.zeros((3, 5))
        m[:, 0], m[:, 1], m[:, 2] = [0, 1, 0], [1, 0, 0], [0, 0, -1]  # down, right, back
        m[:, 3] = [k, 0, 3]
        m[:, 4] = [48, 64, 50]
        rows.append(np.r_[m.ravel(), 1.0, 10.0])
    return np.array(rows)


FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64) | st.sampled_from([0.0, -1.0, 1e308, 48.0, 64.0])


def test_fuzz_llff_arrays(reliability):
    @FUZZ
    @given(arr=hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=18), elements=FLOATS),
           rows=st.integers(0, 4), edits=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 16), FLOATS),
                                                  max_size=6))
    def run(arr, rows, edits):
        _try("llff", I.parse_poses_bounds, arr, "fuzz.npy", [f"{i}.png" for i in range(len(arr))])
        good = _good_rows()
        for r, c, v in edits:
            good[r, c] = v
        _try("llff", I.parse_poses_bounds, good, "fuzz.npy", [f"{i}.png" for i in range(rows)])

    run()
    _record(reliability, "llff", "LLFF poses_bounds arrays: any shape and values, mutated good rows")


def test_fuzz_llff_npy_bytes(tmp_path, reliability):
    buf = io.BytesIO()
    np.save(buf, _good_rows())
    good = buf.getvalue()
    path = tmp_path / "poses_bounds.npy"
    path.write_bytes(good)
    I.read_llff(path, ["0.png", "1.png", "2.png"])  # the unmutated file parses

    @FUZZ
    @given(flips=st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=6),
           cut=st.just(len(good)) | st.integers(0, len(good)))
    def run(flips, cut):
        raw = bytearray(good)
        for i, b in flips:
            raw[i] = b
        path.write_bytes(bytes(raw[:cut]))
        _try("npy", I.read_llff, path, ["0.png", "1.png", "2.png"])

    run()
    _record(reliability, "npy", "LLFF poses_bounds.npy bytes: flipped and truncated")


def test_fuzz_transforms_json_bytes(tmp_path, reliability):
    doc = {"fl_x": 50.0, "fl_y": 50.0, "cx": 32.0, "cy": 24.0, "w": 64, "h": 48, "frames": [
        {"file_path": "images/a.png", "transform_matrix": np.eye(4).tolist()}]}
    good = json.dumps(doc).encode()
    path = tmp_path / "transforms.json"
    (tmp_path / "images").mkdir()
    Image.new("RGB", (64, 48)).save(tmp_path / "images" / "a.png")
    path.write_bytes(good)
    I.read_transforms(path)  # the unmutated file parses

    @FUZZ
    @given(flips=st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=6),
           cut=st.just(len(good)) | st.integers(0, len(good)), bom=st.booleans())
    def run(flips, cut, bom):
        raw = bytearray(good)
        for i, b in flips:
            raw[i] = b
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + bytes(raw[:cut]))
        _try("transforms", I.read_transforms, path)

    run()
    _record(reliability, "transforms", "transforms.json files as bytes: flipped, truncated, with a BOM")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=16)


def test_fuzz_ingest_ground_truth(tmp_path, reliability):
    good = {"intrinsics": {"width": 64, "height": 48, "fx": 50, "fy": 50, "cx": 32, "cy": 24},
            "frames": [{"file": "a.png", "world_to_camera": np.eye(4).tolist()}]}
    images = [{"source": "a.png", "file": "images/a.png", "width": 32, "height": 24, "source_width": 64,
               "source_height": 48}]
    path = tmp_path / "ground_truth.json"

    def read(text: str) -> None:
        path.write_text(text)
        gt = ingest.read_ground_truth(path)
        ingest.restrict_ground_truth(gt, path, images)

    read(json.dumps(good))  # the unmutated file parses

    @settings(FUZZ, max_examples=50)
    @given(doc=JSON, key=st.sampled_from(["intrinsics", "frames", "width", "fx", "file", "world_to_camera"]),
           value=JSON)
    def run(doc, key, value):
        _try("gt", read, json.dumps(doc))
        mutated = json.loads(json.dumps(good))
        where = mutated if key in ("intrinsics", "frames") else (
            mutated["intrinsics"] if key in ("width", "fx") else mutated["frames"][0])
        where[key] = value
        _try("gt", read, json.dumps(mutated))

    run()
    _record(reliability, "gt", "ingest's ground_truth.json: any JSON, and the good one with a key replaced")
