"""Ingest a folder of photos: one clean 8-bit RGB PNG per usable photo, and a manifest.

Every file of the photo folder (with ``recursive: true`` also of its subfolders, the source
name then keeping its folders, e.g. ``train/r_0.png``), in name order:

* an image (jpg, jpeg, png, tif, tiff, bmp, webp; any case) is decoded with Pillow, turned
  upright by its EXIF orientation, converted to 8-bit RGB (grayscale, palette, CMYK, 16-bit
  and float images are scaled properly; an alpha channel is dropped, or with ``alpha: white``
  / ``black`` composited on that colour, or with ``alpha: keep`` kept (an RGBA PNG), and
  noted) and, with ``max_size > 0``, shrunk
  (Lanczos) so its longest side is ``max_size``; it is written as ``<out>/images/<stem>.png``
  (``<stem>-2.png`` ... when two photos share a stem; in a subfolder the stem is prefixed with
  the folders, ``train_r_0.png``);
* a corrupt, truncated or empty image, a byte-identical copy of an earlier photo, and any
  other file are skipped, each with its reason in the manifest; only regular files are ever
  opened (a named pipe, device or socket among the photos is skipped unread: reading one
  would block forever or never end);
* ``ground_truth.json`` (the generated scene's cameras, see docs/contracts.md) is checked
  and copied to ``<out>/ground_truth.json``, its frames restricted to the ingested photos
  (renamed to their output names) and its intrinsics rescaled to the written size.

A Blender / nerf_synthetic folder (``transforms_train.json`` beside a ``train/`` folder) is
recognised: with ``recursive: auto`` its ``train/`` and ``test/`` folders are read (``val/`` is
skipped: the poses stage imports the train and test cameras), with ``alpha: auto`` its RGBA
views are composited on white (how the scenes are scored), and the manifest's ``layout``
names the folder, so that the poses stage can import its cameras (``poses.source: auto``)
without naming it again. Elsewhere ``auto`` means ``recursive: false`` and ``alpha: drop``.

``<out>/manifest.json`` lists the images (output file, source, size, sha256 of the PNG,
EXIF orientation, and the EXIF camera body and focal length where the photo has them, which
the poses stage's ``camera_mode: auto`` groups cameras by), the skipped files and the recognised
``layout`` (or null). The out folder is built aside and swapped in on success, so an error leaves
no outs; an out that is the photo folder, above it or inside it is refused before anything is touched.

Usage::

    python -m stages.ingest --photos <folder> --out data/ingest [--params params.yaml]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .common import params as P
from .common.cameras import Intrinsics
from .common.entry import cli, run_stage
from .common.io import atomic_dir, atomic_write_json, check_outs
from .common.log import setup

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp"}
# Photo formats people bring that Pillow cannot read without plugins: say so, not just "not an image".
CONVERT_FIRST_EXTS = {".heic", ".heif", ".avif", ".dng", ".cr2", ".cr3", ".nef", ".arw", ".orf", ".rw2", ".raf"}
GROUND_TRUTH = "ground_truth.json"
BLENDER_CAMERAS = "transforms_train.json"  # with a train/ folder beside it: the Blender / nerf_synthetic layout
BLENDER_SPLITS = ("train", "test")  # the subfolders of that layout whose cameras the poses stage imports
EXIF_ORIENTATION = 0x0112
# EXIF tags of the camera that took a photo: Make and Model (base IFD), FocalLength and
# FocalLengthIn35mmFilm (Exif sub-IFD)
EXIF_MAKE, EXIF_MODEL, EXIF_IFD, EXIF_FOCAL, EXIF_FOCAL_35 = 0x010F, 0x0110, 0x8769, 0x920A, 0xA405


@dataclass(frozen=True)
class IngestParams:
    """``ingest`` section of params.yaml."""

    photos: str = "data/scene/images"  # the photo folder (dvc.yaml passes it as --photos too)
    max_size: int = 0  # longest side after ingest; 0 keeps the photos' size
    min_images: int = 3
    # also ingest the subfolders' photos (e.g. a Blender layout's train/ and test/);
    # auto: for a Blender layout only
    recursive: bool | Literal["auto"] = "auto"
    # what becomes of an alpha channel: drop it (keep the colour), composite on white / black, or
    # keep it (RGBA PNGs, for training on random backgrounds); auto: white for a Blender /
    # nerf_synthetic layout, else drop
    alpha: Literal["auto", "drop", "white", "black", "keep"] = "auto"

    def __post_init__(self) -> None:
        P.check(bool(self.photos.strip()), "photos", "must name a folder", self.photos)
        P.check(self.max_size >= 0, "max_size", "must be >= 0 (0 keeps the size)", self.max_size)
        P.check(self.min_images >= 3, "min_images", "must be >= 3", self.min_images)


# ---------------------------------------------------------------- one image


def to_rgb8(img, notes: list[str], alpha: str = "drop"):
    """An 8-bit RGB copy of a Pillow image of any mode; what was lost goes in ``notes``.

    ``alpha``: ``drop`` keeps the colour under a transparent pixel as it is; ``white`` /
    ``black`` composite the (straight) alpha over that background; ``keep`` returns an 8-bit
    RGBA copy of an image that has alpha.
    """
    from PIL import Image

    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        a = np.asarray(img).astype(np.float64)
        if mode.startswith("I;16"):
            a = a / 257.0
            notes.append(f"16-bit {mode} scaled to 8 bits")
        elif mode == "I":
            if a.size and a.max() > 255:
                a = np.clip(a, 0, 65535) / 257.0
                notes.append("32-bit integer image scaled from 16 bits to 8 bits")
        else:  # float: [0, 1] when it fits, else taken as 8-bit values
            if a.size and np.nanmax(a) <= 1.0:
                a = a * 255.0
            notes.append("float image scaled to 8 bits")
        a = np.clip(np.round(np.nan_to_num(a)), 0, 255).astype(np.uint8)
        return Image.fromarray(a, mode="L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in img.info):
        if alpha == "keep":
            notes.append("alpha kept")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Pillow's palette-transparency hint
                return img.convert("RGBA")
        if alpha in ("white", "black"):
            rgba = img.convert("RGBA")
            bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255) if alpha == "white" else (0, 0, 0, 255))
            notes.append(f"alpha composited on {alpha}")
            return Image.alpha_composite(bg, rgba).convert("RGB")
        notes.append("alpha channel dropped")
        if mode == "P":
            img = img.convert("RGBA")
    elif mode == "CMYK":
        notes.append("CMYK converted to RGB (naive, no colour profile)")
    elif mode not in ("L", "P", "1"):
        notes.append(f"{mode} converted to RGB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's palette-transparency hint; noted above
        return img.convert("RGB")


def exif_camera(exif) -> dict[str, Any] | None:
    """``{"make", "model", "focal_length_mm", "focal_length_35mm"}`` from a Pillow ``Exif`` (each
    None where missing), or None when it names no camera at all."""
    def text(tag: int) -> str | None:
        v = exif.get(tag)
        v = v.decode("ascii", "replace") if isinstance(v, bytes) else v
        return (v.strip("\x00 ").strip() or None) if isinstance(v, str) else None

    def number(ifd: dict, tag: int) -> float | None:
        try:
            v = float(ifd.get(tag))
        except (TypeError, ValueError, ZeroDivisionError):
            return None
        return v if v > 0 and np.isfinite(v) else None

    try:
        sub = exif.get_ifd(EXIF_IFD)
    except Exception:  # a broken sub-IFD: the base tags may still be there
        sub = {}
    cam = {"make": text(EXIF_MAKE), "model": text(EXIF_MODEL), "focal_length_mm": number(sub, EXIF_FOCAL),
           "focal_length_35mm": number(sub, EXIF_FOCAL_35)}
    return cam if any(v is not None for v in cam.values()) else None


def load_photo(data: bytes, max_size: int, alpha: str = "drop"
               ) -> tuple[Any, int, tuple[int, int], list[str], dict | None]:
    """Decode, turn upright, convert and shrink one photo.

    Returns (RGB image (RGBA with ``alpha: keep``), EXIF orientation, upright source size (w, h),
    notes, EXIF camera (:func:`exif_camera`)); raises ``OSError``/``ValueError`` (and Pillow's
    errors) for unreadable data.
    """
    from PIL import Image, ImageOps

    notes: list[str] = []
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if getattr(im, "n_frames", 1) > 1:
            notes.append(f"first of {im.n_frames} frames used")
        camera = None
        try:
            exif = im.getexif()
            orientation = int(exif.get(EXIF_ORIENTATION, 1) or 1)
            camera = exif_camera(exif)
        except Exception:  # a broken EXIF block must not lose the photo
            orientation = 1
            notes.append("unreadable EXIF ignored")
        if orientation not in range(1, 9):
            notes.append(f"invalid EXIF orientation {orientation} ignored")
            orientation = 1
        upright = ImageOps.exif_transpose(im) if orientation != 1 else im.copy()
    rgb = to_rgb8(upright, notes, alpha)
    src_size = rgb.size
    w, h = src_size
    if max_size and max(w, h) > max_size:
        scale = max_size / max(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
        notes.append(f"downscaled from {w}x{h}")
    return rgb, orientation, src_size, notes, camera


def png_bytes(img) -> bytes:
    """PNG bytes without metadata: identical pixels give identical files."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def unique_name(stem: str, used: set[str]) -> str:
    """``<stem>.png``, or ``<stem>-2.png``, ``-3`` ... if taken (case-insensitively)."""
    name, k = f"{stem}.png", 1
    while name.lower() in used:
        k += 1
        name = f"{stem}-{k}.png"
    used.add(name.lower())
    return name


# ---------------------------------------------------------------- ground truth


def read_ground_truth(path: Path) -> dict:
    """Load and check a ``ground_truth.json``; one ValueError naming the problem otherwise."""
    try:
        gt = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ground truth: {exc}") from None
    if not isinstance(gt, dict) or "intrinsics" not in gt or "frames" not in gt:
        raise ValueError(f"{path}: ground truth needs 'intrinsics' and 'frames' (see docs/contracts.md)")
    try:
        k = gt["intrinsics"]
        intr = Intrinsics(int(k["width"]), int(k["height"]), float(k["fx"]), float(k["fy"]),
                          float(k["cx"]), float(k["cy"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed intrinsics ({exc!r}); need width, height, fx, fy, cx, cy") from None
    if intr.width <= 0 or intr.height <= 0 or intr.fx <= 0 or intr.fy <= 0:
        raise ValueError(f"{path}: intrinsics must have positive size and focal lengths, got {k}")
    if not isinstance(gt["frames"], list):
        raise ValueError(f"{path}: 'frames' must be a list")
    for i, f in enumerate(gt["frames"]):
        try:
            name = f["file"]
            m = np.asarray(f["world_to_camera"], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: frames[{i}] malformed ({exc!r}); need file and world_to_camera") from None
        if not isinstance(name, str) or m.shape != (4, 4) or not np.isfinite(m).all():
            raise ValueError(f"{path}: frames[{i}] needs a file name and a finite 4x4 world_to_camera")
    return gt


def restrict_ground_truth(gt: dict, path: Path, images: list[dict]) -> dict:
    """The ground truth for the ingested images: their frames, renamed, and rescaled intrinsics."""
    by_source = {im["source"]: im for im in images}
    k = gt["intrinsics"]
    src_w, src_h = int(k["width"]), int(k["height"])
    frames, sizes = [], set()
    for f in gt["frames"]:
        im = by_source.get(Path(f["file"]).name)
        if im is None:
            continue
        if (im["source_width"], im["source_height"]) != (src_w, src_h):
            raise ValueError(
                f"{path}: intrinsics are for {src_w}x{src_h} images but {im['source']} is "
                f"{im['source_width']}x{im['source_height']}")
        sizes.add((im["width"], im["height"]))
        frames.append({**f, "file": Path(im["file"]).name})
    if not frames:
        raise ValueError(f"{path}: none of its {len(gt['frames'])} frames names an ingested image")
    (w, h), = sizes  # every frame's source has the intrinsics' size, so one output size
    sx, sy = w / src_w, h / src_h
    intr = {**k, "width": w, "height": h, "fx": float(k["fx"]) * sx, "fy": float(k["fy"]) * sy,
            "cx": float(k["cx"]) * sx, "cy": float(k["cy"]) * sy}
    return {**gt, "intrinsics": intr, "frames": frames}


# ---------------------------------------------------------------- folder layouts


def blender_layout(photos_dir: Path) -> bool:
    """Whether ``photos_dir`` is a Blender / nerf_synthetic scene: ``transforms_train.json`` and ``train/``."""
    return (photos_dir / BLENDER_CAMERAS).is_file() and (photos_dir / "train").is_dir()


def resolve_auto(params: IngestParams, photos_dir: Path, log: logging.Logger) -> tuple[IngestParams, dict | None]:
    """``params`` with ``auto`` settings decided by the folder's layout, and the layout for the manifest.

    The layout record, ``{"kind": "blender", "folder": <photos_dir as given>, "camera_file": ...,
    "camera_files_sha256": {name: sha256}, "subfolders": [...] or None}``, is what ``poses.source:
    auto`` reads; None for any other folder. The camera files' hashes make the manifest, and so
    DVC's hash of this out, change when they do, so the poses stage reruns. ``subfolders``: with
    ``recursive: auto``, the only ones read (:data:`BLENDER_SPLITS`).
    """
    blender = blender_layout(photos_dir)
    chosen = {}
    if params.recursive == "auto":
        chosen["recursive"] = blender
    if params.alpha == "auto":
        chosen["alpha"] = "white" if blender else "drop"
    if blender and chosen:
        log.info("%s is a Blender / nerf_synthetic folder (%s + train/): %s (ingest.%s: auto)", photos_dir,
                 BLENDER_CAMERAS, ", ".join(f"{k}: {str(v).lower()}" for k, v in chosen.items()),
                 " / ingest.".join(chosen))
    layout = None
    if blender:
        cameras = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(photos_dir.glob("transforms_*.json"))}
        layout = {"kind": "blender", "folder": photos_dir.as_posix(), "camera_file": (photos_dir / BLENDER_CAMERAS).as_posix(),
                  "camera_files_sha256": cameras, "subfolders": list(BLENDER_SPLITS) if chosen.get("recursive") else None}
    return dataclasses.replace(params, **chosen), layout


# ---------------------------------------------------------------- stage


def list_photos(photos_dir: Path, recursive: bool) -> list[tuple[str, Path]]:
    """(source name, path) of every entry to consider, sorted by source name. Top level: files
    and folders; recursive: the files of every subfolder too (folder symlinks not followed),
    named by their POSIX path below ``photos_dir``."""
    if not recursive:
        return sorted(((p.name, p) for p in photos_dir.iterdir()), key=lambda e: e[0])
    found = []
    for dirpath, dirnames, filenames in os.walk(photos_dir):
        dirnames.sort()
        rel = Path(dirpath).relative_to(photos_dir)
        links = [d for d in dirnames if (Path(dirpath) / d).is_symlink()]  # listed, to be skipped
        found += [((rel / f).as_posix(), Path(dirpath) / f) for f in filenames + links]
    return sorted(found, key=lambda e: e[0])


_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_regular_file(path: Path) -> str | None:
    """Why ``path`` (followed if a symlink) is no regular file to read, or None when it is one."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"cannot read file: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
    return f"{kind}, not a photo (never opened)"


def _skip(skipped: list[dict], source: str, reason: str, log: logging.Logger) -> None:
    skipped.append({"source": source, "reason": reason})
    log.warning("skipped %s: %s", source, reason)


def run(params: IngestParams, photos_dir: str | Path, out_dir: str | Path, log: logging.Logger | None = None) -> dict:
    """Ingest ``photos_dir`` into ``out_dir`` (replaced atomically); returns the manifest.

    Raises ValueError for a missing or empty folder, a bad ground truth, or fewer than
    ``params.min_images`` usable images (the message lists what was skipped and why).
    """
    from PIL import Image, UnidentifiedImageError

    log = log or setup("ingest")
    photos_dir = Path(photos_dir)
    out_dir = Path(out_dir)
    check_outs({"--photos": photos_dir}, {"--out": out_dir})
    with atomic_dir(out_dir) as tmp:
        if not photos_dir.exists():
            raise ValueError(f"photo folder not found: {photos_dir}")
        if not photos_dir.is_dir():
            raise ValueError(f"photo folder is not a folder: {photos_dir}")
        params, layout = resolve_auto(params, photos_dir, log)
        entries = list_photos(photos_dir, params.recursive)
        if not entries:
            raise ValueError(f"photo folder is empty: {photos_dir}")
        (tmp / "images").mkdir()
        images: list[dict] = []
        skipped: list[dict] = []
        seen: dict[str, str] = {}  # sha256 of source bytes -> first source
        used: set[str] = set()
        gt_path = None
        only = layout.get("subfolders") if layout else None
        for name, path in entries:
            if only and "/" in name and name.split("/", 1)[0] not in only:
                _skip(skipped, name, f"not in the Blender layout's {' or '.join(only)} folders "
                      "(whose cameras the poses stage imports)", log)
                continue
            if path.is_dir():
                _skip(skipped, name, "a link to a folder (not followed)" if params.recursive
                      else "a folder (subfolders are not searched; ingest.recursive: true would)", log)
                continue
            special = not_a_regular_file(path)
            if special is not None:
                _skip(skipped, name, special, log)
                continue
            if name == GROUND_TRUTH:
                gt_path = path
                continue
            ext = path.suffix.lower()
            if ext not in IMAGE_EXTS:
                if ext in CONVERT_FIRST_EXTS:
                    _skip(skipped, name, f"unsupported photo format {ext} (convert it to JPEG or PNG first)", log)
                else:
                    _skip(skipped, name, f"not an image (extension {ext or 'none'!s})", log)
                continue
            try:
                data = path.read_bytes()
            except OSError as exc:
                _skip(skipped, name, f"cannot read file: {exc.strerror or exc}", log)
                continue
            if not data:
                _skip(skipped, name, "empty file (0 bytes)", log)
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                _skip(skipped, name, f"duplicate of {seen[digest]} (identical bytes)", log)
                continue
            try:
                rgb, orientation, (sw, sh), notes, camera = load_photo(data, params.max_size, params.alpha)
            except (OSError, ValueError, SyntaxError, EOFError, UnidentifiedImageError,
                    Image.DecompressionBombError) as exc:
                reason = "not a readable image" if isinstance(exc, UnidentifiedImageError) else str(exc)
                _skip(skipped, name, f"corrupt or truncated image: {reason}", log)
                continue
            seen[digest] = name
            out_name = unique_name(Path(name).with_suffix("").as_posix().replace("/", "_"), used)
            png = png_bytes(rgb)
            (tmp / "images" / out_name).write_bytes(png)
            images.append({
                "file": f"images/{out_name}", "source": name, "width": rgb.width, "height": rgb.height,
                "sha256": hashlib.sha256(png).hexdigest(), "exif_orientation": orientation,
                "source_width": sw, "source_height": sh, "notes": notes,
                **({"camera": camera} if camera else {}),
            })
            log.info("%s -> images/%s (%dx%d%s)", name, out_name, rgb.width, rgb.height,
                     f"; {'; '.join(notes)}" if notes else "")
        if len(images) < params.min_images:
            why = "; ".join(f"{s['source']}: {s['reason']}" for s in skipped) or "none"
            raise ValueError(
                f"found {len(images)} readable image(s) in {photos_dir}, need at least {params.min_images} "
                f"(ingest.min_images); skipped files: {why}")
        manifest: dict[str, Any] = {"images": images, "skipped": skipped, "ground_truth": None, "layout": layout}
        if gt_path is not None:
            full = read_ground_truth(gt_path)
            gt = restrict_ground_truth(full, gt_path, images)
            atomic_write_json(tmp / GROUND_TRUTH, gt)
            manifest["ground_truth"] = GROUND_TRUTH
            log.info("ground truth: %d of %d frames kept, intrinsics for %dx%d", len(gt["frames"]),
                     len(full["frames"]), gt["intrinsics"]["width"], gt["intrinsics"]["height"])
        atomic_write_json(tmp / "manifest.json", manifest)
    log.info("ingested %d image(s) from %s into %s; skipped %d", len(images), photos_dir, out_dir, len(skipped))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.ingest", description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=Path, default=None,
                    help="folder of photos (default: ingest.photos from the params file)")
    ap.add_argument("--out", required=True, type=Path, help="out folder (images/, manifest.json)")
    ap.add_argument("--params", default=P.DEFAULT_PARAMS, type=Path, help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    log = setup("ingest")

    def body() -> None:
        params = P.load_section(IngestParams, "ingest", args.params)
        photos = args.photos if args.photos is not None else Path(params.photos)
        if args.photos is not None and Path(params.photos) != args.photos:
            log.info("--photos %s overrides ingest.photos %s", args.photos, params.photos)
        check_outs({"--photos": photos, "--params": args.params}, {"--out": args.out})
        run(params, photos, args.out, log=log)

    return run_stage("ingest", body)


if __name__ == "__main__":
    cli(main)
