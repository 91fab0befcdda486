"""Every kind of bad photo a user brings, through ``python -m stages.ingest`` (a subprocess with a
timeout, so a hang fails the test instead of hanging it): each one ingested properly or skipped with
its reason in the manifest; special files (FIFO, devices, a socket) are skipped without being opened."""
from __future__ import annotations

import io
import json
import os
import socket
import stat
import struct
import subprocess
import zlib

import numpy as np
import pytest
from PIL import Image

from reliability._faults import ROOT, env, stage

AREA = "bad input: images"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h pixels (a decompression bomb), with a few bytes of data."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92, **kw)
    return buf.getvalue()


def make_photos(folder) -> dict[str, tuple[str, str]]:
    """Writes the photos; returns {file: (what it is, the expected outcome: "ingested" or a reason's words)}."""
    rng = np.random.default_rng(3)
    rgb = lambda w=48, h=32: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    cases: dict[str, tuple[str, str]] = {}
    for i in range(3):
        rgb().save(folder / f"good_{i}.png")
        cases[f"good_{i}.png"] = ("an ordinary PNG", "ingested")
    good = _jpeg(rgb())
    (folder / "a.jpg").write_bytes(good)
    cases["a.jpg"] = ("an ordinary JPEG", "ingested")
    (folder / "truncated.jpg").write_bytes(good[: len(good) // 2])
    cases["truncated.jpg"] = ("a JPEG cut in half", "truncated")
    (folder / "zero.png").write_bytes(b"")
    cases["zero.png"] = ("a zero-byte file", "0 bytes")
    (folder / "text.jpg").write_bytes(b"this is not a JPEG at all\n" * 20)
    cases["text.jpg"] = ("text named .jpg (non-image)", "not a readable image")
    (folder / "notes.txt").write_text("shot list")
    cases["notes.txt"] = ("a text file", "not an image")
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=95)
    cases["cmyk.jpg"] = ("CMYK JPEG", "ingested:CMYK converted")
    Image.fromarray(np.full((30, 40), 40000, np.uint16)).save(folder / "deep16.png")
    cases["deep16.png"] = ("16-bit grayscale PNG", "ingested:16-bit")
    Image.fromarray(rng.integers(0, 256, (30, 40), dtype=np.uint8), mode="L").save(folder / "gray.png")
    cases["gray.png"] = ("8-bit grayscale", "ingested")
    rgba = np.dstack([rng.integers(0, 256, (30, 40, 3), dtype=np.uint8), np.full((30, 40), 128, np.uint8)])
    Image.fromarray(rgba, mode="RGBA").save(folder / "rgba.png")
    cases["rgba.png"] = ("RGBA PNG", "ingested:alpha channel dropped")
    exif = Image.Exif()
    exif[0x0112] = 6
    (folder / "rotated.jpg").write_bytes(_jpeg(rgb(48, 32), exif=exif))
    cases["rotated.jpg"] = ("EXIF orientation 6 (rotated)", "ingested:upright 32x48")
    (folder / "huge.png").write_bytes(bomb_png(60000, 60000))
    cases["huge.png"] = ("header claims 60000x60000 (decompression bomb)", "exceeds limit")
    (folder / "zz_copy.png").write_bytes((folder / "good_0.png").read_bytes())
    cases["zz_copy.png"] = ("a byte-identical duplicate", "duplicate of")
    os.mkfifo(folder / "pipe.jpg")
    cases["pipe.jpg"] = ("a named pipe (FIFO) called .jpg", "named pipe")
    os.symlink("/dev/zero", folder / "zeros.png")
    cases["zeros.png"] = ("a symlink to /dev/zero (endless character device)", "character device")
    try:
        os.mknod(folder / "null.png", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        cases["null.png"] = ("a character device node (1,3)", "character device")
        os.mknod(folder / "disk.jpg", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
        cases["disk.jpg"] = ("a block device node (loop0)", "block device")
    except PermissionError:
        pass  # not root: the /dev/zero symlink stands for device files
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock.png"))
    sock.close()
    cases["sock.png"] = ("a UNIX socket", "socket")
    return cases


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_every_kind_of_bad_photo_is_ingested_or_skipped_with_its_reason(tmp_path, reliability):
    photos = tmp_path / "photos"
    photos.mkdir()
    cases = make_photos(photos)
    (tmp_path / "params.yaml").write_text("ingest: {}\n")
    cmd = stage("stages.ingest", "--photos", photos, "--out", tmp_path / "out", "--params", tmp_path / "params.yaml")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("ingest hung (a FIFO or device file among the photos was opened)")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    images = {im["source"]: im for im in manifest["images"]}
    skipped = {s["source"]: s["reason"] for s in manifest["skipped"]}
    assert set(images) | set(skipped) == set(cases)
    for name, (what, want) in cases.items():
        if want.startswith("ingested"):
            assert name in images, (name, skipped.get(name))
            im = images[name]
            with Image.open(tmp_path / "out" / im["file"]) as out:
                assert out.mode == "RGB"
            detail = want.partition(":")[2]
            got = f"ingested as {im['width']}x{im['height']} RGB" + (f" ({'; '.join(im['notes'])})" if im["notes"]
                                                                       else "")
            if detail.startswith("upright"):
                assert (im["width"], im["height"]) == (32, 48) and im["exif_orientation"] == 6
            elif detail:
                assert any(detail in n for n in im["notes"]), (name, im["notes"])
            reliability(AREA, f"{name}: {what}", "ingested as 8-bit RGB" + (f" ({detail})" if detail else ""), got)
        else:
            assert name in skipped and want in skipped[name], (name, skipped.get(name))
            reliability(AREA, f"{name}: {what}", f"skipped with a reason ({want})", f"skipped: {skipped[name]}")
