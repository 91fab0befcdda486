"""The poses stage's import path: match the cameras to the ingested images and write the outs
that structure from motion writes (docs/contracts.md, "Imported cameras")."""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..common import cameras as C
from ..common.io import atomic_dir, atomic_write_json, atomic_write_text, remove
from ..common.metrics_files import remove_metrics, write_metrics
from .colmap import read_colmap
from .llff import read_llff
from .scene import Camera, ImportedScene, _fail, _side
from .transforms import _load_json, read_transforms

log = logging.getLogger("stages.poses")


def read_cameras(source: str, path: str | Path, llff_names: list[str] | None = None) -> ImportedScene:
    """Dispatch on the poses stage's ``source``."""
    if source == "colmap":
        return read_colmap(path)
    if source == "transforms":
        return read_transforms(path)
    if source == "llff":
        return read_llff(path, llff_names)
    raise ValueError(f"unknown camera source {source!r} (colmap, transforms or llff)")


# ---------------------------------------------------------------- the poses stage's import path


def read_manifest(ingest_dir: Path) -> tuple[list[dict], dict | None]:
    """The ingest manifest's image entries (checked) and the ground truth, if any."""
    path = ingest_dir / "manifest.json"
    doc = _load_json(path)
    entries = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise _fail(path, "needs an 'images' list")
    out = []
    for i, e in enumerate(entries):
        at = f"{path}, images[{i}]"
        if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("file", "source")):
            raise _fail(at, "needs 'file' and 'source' strings")
        p = Path(e["file"])
        if p.parent != Path("images") or not (ingest_dir / p).is_file():
            raise _fail(at, f"{e['file']!r} is not an existing file directly under images/")
        out.append({**e, "width": _side(e.get("width"), "width", at), "height": _side(e.get("height"), "height", at)})
    if len({Path(e["file"]).name for e in out}) != len(out):
        raise _fail(path, "duplicate image names")
    gt = _load_json(ingest_dir / "ground_truth.json") if (ingest_dir / "ground_truth.json").is_file() else None
    return out, gt


def match_images(scene: ImportedScene, sources: list[str]) -> dict[str, int]:
    """Ingested source path -> index into ``scene.names``.

    A source matches a scene name when its path components are the trailing components of
    that name (``0001.jpg`` matches ``images/0001.jpg``; ``train/r_0.png`` matches
    ``train/r_0.png`` but ``r_0.png`` alone would match train and test: an error). Sources
    without a match are left out (unregistered).
    """
    by_suffix: dict[tuple[str, ...], list[int]] = {}
    for i, n in enumerate(scene.names):
        parts = tuple(Path(n).parts)
        for k in range(len(parts)):
            by_suffix.setdefault(parts[k:], []).append(i)
    out, taken = {}, {}
    for s in sources:
        hits = by_suffix.get(tuple(Path(s).parts), [])
        if len(hits) > 1:
            raise _fail(scene.path, f"ingested image {s!r} matches {len(hits)} images "
                                    f"({', '.join(scene.names[i] for i in hits[:3])}); ingest with "
                                    "ingest.recursive: true so that the source names keep their folders")
        if hits:
            if hits[0] in taken:
                raise _fail(scene.path, f"{scene.names[hits[0]]} matches both {taken[hits[0]]!r} and {s!r}")
            taken[hits[0]] = s
            out[s] = hits[0]
    return out


def focus_aabb(c2w: np.ndarray, aabb_scale: float | None) -> np.ndarray | None:
    """[2, 3] cube around the point the cameras look at, or None when their axes do not meet.

    The point is the least-squares nearest point to all optical axes (what instant-ngp's
    colmap2nerf calls the centre of attention); the cube's half side is half the cameras' mean
    distance to it (an object that fills a ~55 degree view at distance d is ~0.5 d across on
    each side), times ``aabb_scale`` when that is > 1 (instant-ngp: the scene reaches that many
    times past its unit cube).
    """
    o, d = c2w[:, :3, 3], c2w[:, :3, 2]
    A = np.zeros((3, 3))
    b = np.zeros(3)
    for oi, di in zip(o, d):
        P = np.eye(3) - np.outer(di, di)
        A += P
        b += P @ oi
    if np.linalg.cond(A) > 1e4:  # (nearly) parallel axes, e.g. a forward-facing capture
        return None
    p = np.linalg.solve(A, b)
    depth = np.einsum("ij,ij->i", p - o, d)
    if np.median(depth) <= 0:
        return None
    half = 0.5 * float(np.linalg.norm(p - o, axis=1).mean()) * max(1.0, aabb_scale or 1.0)
    return np.stack([p - half, p + half])


def frustum_points(c2w: np.ndarray, cams: list[Camera], near_far: np.ndarray) -> np.ndarray:
    """[N * 10, 3]: each view's image corners and centre at its near and far depths."""
    pts = []
    for T, cam, (near, far) in zip(c2w, cams, near_far):
        uv = np.array([[0, 0], [cam.width, 0], [0, cam.height], [cam.width, cam.height],
                       [cam.cx, cam.cy]], dtype=np.float64)
        rays = np.c_[(uv[:, 0] - cam.cx) / cam.fx, (uv[:, 1] - cam.cy) / cam.fy, np.ones(5)]
        for z in (near, far):
            pts.append((rays * z) @ T[:3, :3].T + T[:3, 3])
    return np.concatenate(pts)


def scene_aabb(xyz_n: np.ndarray, c2w_n: np.ndarray, cams: list[Camera], near_far: np.ndarray | None,
               aabb_scale: float | None, S: np.ndarray) -> tuple[np.ndarray, str]:
    """The scene box in the normalized frame and the rule that made it (docs/contracts.md):
    sparse points; else LLFF near/far frusta; else the cameras' focus cube; else the cameras."""
    from ..poses import robust_aabb

    centres = c2w_n[:, :3, 3]
    if len(xyz_n) >= 8:
        return robust_aabb(xyz_n, centres), "sparse points"
    if near_far is not None:
        scale = float(np.cbrt(np.linalg.det(S[:3, :3])))
        return robust_aabb(frustum_points(c2w_n, cams, near_far * scale), centres), "near/far frusta"
    box = focus_aabb(c2w_n, aabb_scale)
    if box is not None:
        return box, "camera focus" + (f", aabb_scale {aabb_scale:g}" if aabb_scale and aabb_scale > 1 else "")
    return robust_aabb(np.zeros((0, 3)), centres), "camera centres"


def write_empty_ply(path: Path) -> None:
    """A PLY with no vertices, in the layout write_ply uses (open3d refuses to write one)."""
    atomic_write_text(path, "ply\nformat binary_little_endian 1.0\nelement vertex 0\nproperty double x\n"
                            "property double y\nproperty double z\nproperty uchar red\nproperty uchar green\n"
                            "property uchar blue\nend_header\n")


def _background(entries: list[dict], scene: ImportedScene) -> str | None:
    notes = " ".join(n for e in entries for n in e.get("notes", []) if isinstance(n, str))
    if "alpha kept" in notes:
        return "alpha kept"
    if "composited on" in notes:
        return "white" if "on white" in notes else "black"
    if "alpha channel dropped" in notes:
        if scene.background == "white":
            log.warning("the %s layout's RGBA images are meant to be composited on white, but ingest "
                        "dropped their alpha channel; set ingest.alpha: white", scene.layout)
        return "alpha dropped"
    return None


def ingested_cameras(scene: ImportedScene, regs: list[tuple[str, dict, int]]) -> tuple[list[str], list[Camera]]:
    """Names and cameras of the matched ingested images ``regs`` (output name, manifest entry,
    index into the scene): each image's camera from the file, rescaled to the ingested size.

    An ingested image may be smaller than its camera says (ingest's ``max_size``, LLFF's
    ``images_N``), never larger, and must keep the camera's aspect ratio."""
    names, cams = [], []
    for name, e, i in regs:
        cam = scene.cameras[i]
        where = f"image {scene.names[i]} (ingested from {e['source']} as {e['width']}x{e['height']})"
        if e["width"] > cam.width or e["height"] > cam.height:
            raise _fail(scene.path, f"{where} is larger than its camera, {cam.width}x{cam.height}; the camera file "
                                    "must describe the photos as they are or larger")
        if abs(cam.height * e["width"] / cam.width - e["height"]) > 1.0:
            turned = e.get("exif_orientation") in (5, 6, 7, 8)  # ingest turned it upright: a quarter turn
            raise _fail(scene.path, f"{where}: its camera is {cam.width}x{cam.height}, another aspect ratio"
                                    + (" (the camera file describes the photo before its EXIF rotation, which "
                                       "ingest applied)" if turned else ""))
        names.append(name)
        cams.append(cam.resized(e["width"], e["height"]))
    return names, cams


def run_import(params, ingest_dir: str | Path, out_dir: str | Path, metrics_path: str | Path) -> dict:
    """The poses stage for ``source != "sfm"``: cameras from ``params.camera_file``, images from
    the ingest stage; writes the same outs as the SfM path and returns the metrics."""
    from PIL import Image  # noqa: F401  (Pillow before pycolmap: their zlib copies clash the other way round)
    import pycolmap

    from ..poses import METRICS_HEADLINE, _intrinsics, ground_truth_errors, make_split, undistort, write_ply

    ingest_dir, out_dir, metrics_path = Path(ingest_dir), Path(out_dir), Path(metrics_path)
    remove_metrics(metrics_path)  # a failed run must leave neither the previous outs nor its numbers
    remove(out_dir)
    t_start = time.perf_counter()
    entries, gt = read_manifest(ingest_dir)
    sources = sorted(e["source"] for e in entries)
    scene = read_cameras(params.source, params.camera_file, llff_names=sources)
    log.info("poses: %d cameras (%s) from %s for %d ingested images", len(scene.names), scene.layout,
             scene.path, len(entries))
    matched = match_images(scene, sources)
    where = scene.path.name
    reasons = {Path(e["file"]).name: f"no camera in {where}" for e in entries if e["source"] not in matched}
    regs = sorted((Path(e["file"]).name, e, matched[e["source"]]) for e in entries if e["source"] in matched)
    fraction = len(regs) / max(len(entries), 1)
    if not regs or fraction < params.min_registered_fraction:
        shown = ", ".join(list(reasons)[:10]) + (f" (and {len(reasons) - 10} more)" if len(reasons) > 10 else "")
        raise ValueError(f"{scene.path}: cameras for {len(regs)} of {len(entries)} ingested images "
                         f"({fraction:.0%}), below poses.min_registered_fraction={params.min_registered_fraction}; "
                         f"without a camera: {shown}. Camera file names: {', '.join(scene.names[:3])}...")
    for name, why in reasons.items():
        log.warning("not registered: %s: %s", name, why)
    names, cams = ingested_cameras(scene, regs)
    c2w = np.stack([scene.c2w[i] for _, _, i in regs])
    camera_id = {c: k + 1 for k, c in enumerate(dict.fromkeys(cams))}  # one per distinct camera, name order
    kinds = list(camera_id)
    models = sorted({c.model for c in kinds})
    distorted = models != ["PINHOLE"]
    times = {"read": time.perf_counter() - t_start}

    with tempfile.TemporaryDirectory(prefix="rayforge-import-") as tmp, atomic_dir(out_dir) as out:
        work = Path(tmp)
        t = time.perf_counter()
        rec = pycolmap.Reconstruction()
        for cam, cid in camera_id.items():
            rec.add_camera_with_trivial_rig(pycolmap.Camera(camera_id=cid, model=cam.model, width=cam.width,
                                                            height=cam.height, params=cam.colmap_params()))
        for k, (name, cam, T) in enumerate(zip(names, cams, c2w)):
            w2c = C.c2w_to_w2c(T)
            rec.add_image_with_trivial_frame(pycolmap.Image(name=name, camera_id=camera_id[cam], image_id=k + 1),
                                             pycolmap.Rigid3d(pycolmap.Rotation3d(w2c[:3, :3]), w2c[:3, 3]))
        for p, colour in zip(scene.points_xyz, scene.points_rgb):
            rec.add_point3D(p, pycolmap.Track(), colour)
        if distorted:  # image by image, each with its own camera
            rec, src_images = undistort(pycolmap, rec, ingest_dir / "images", work)
            times["undistort"] = time.perf_counter() - t
            log.info("undistort (%s, %d camera(s)): %.1f s", ", ".join(models), len(kinds), times["undistort"])
        else:
            src_images = ingest_dir / "images"
        (out / "images").mkdir()
        for n in names:
            shutil.copy2(src_images / n, out / "images" / n)
        (out / "sparse" / "0").mkdir(parents=True)
        rec.write(out / "sparse" / "0")

        by_name = {im.name: im for im in rec.images.values()}
        intrs = [_intrinsics(rec.cameras[by_name[n].camera_id]) for n in names]
        S = C.normalization_transform(c2w, params.align_up)
        c2w_n = C.apply_similarity_to_c2w(S, c2w)
        xyz_n = C.apply_similarity_to_points(S, scene.points_xyz)
        aabb, aabb_rule = scene_aabb(xyz_n, c2w_n, cams, scene.near_far, scene.aabb_scale, S)
        split, split_rule = None, f"every {params.test_every}th"
        if scene.split is not None:
            out_name = {scene.names[i]: name for name, _, i in regs}
            split = {part: sorted(out_name[n] for n in scene.split[part] if n in out_name) for part in ("train", "test")}
            if split["train"] and split["test"]:
                split_rule = "given"
            else:
                log.warning("%s: the given split leaves %s empty among the matched images; using every %dth image",
                            scene.path, "train" if not split["train"] else "test", params.test_every)
                split = None
        split = split or make_split(names, params.test_every)
        atomic_write_json(out / "split.json", split)

        background = _background([e for _, e, _ in regs], scene)
        extra = {"camera_model": "PINHOLE", "source": params.source, "source_layout": scene.layout,
                 "source_camera_model": ", ".join(models), "normalization": S.tolist(),
                 "applied_transform": S[:3].tolist(), "ply_file_path": "points3D.ply", **C.split_keys(split),
                 "aabb": aabb.tolist()}
        if scene.aabb_scale is not None:
            extra["aabb_scale"] = scene.aabb_scale
        if background is not None:
            extra["background"] = background
        C.write_transforms(out / "transforms.json", intrs, [f"images/{n}" for n in names], c2w_n, extra=extra,
                           frame_extra=[{"colmap_im_id": by_name[n].image_id} for n in names])
        if len(xyz_n):
            write_ply(out / "points3D.ply", xyz_n, scene.points_rgb)
        else:
            write_empty_ply(out / "points3D.ply")

        metrics: dict[str, Any] = {
            "source": params.source,
            "layout": scene.layout,
            "camera_file": str(params.camera_file),
            "num_images": len(entries),
            "num_registered": len(names),
            "registered_fraction": fraction,
            "num_cameras_in_file": len(scene.names),
            "num_cameras_without_image": len(scene.names) - len(names),
            "num_points": int(len(xyz_n)),
            "source_camera_model": ", ".join(models),
            "num_cameras": len(kinds),
            "undistorted": distorted,
            "aabb_rule": aabb_rule,
            "split": split_rule,
            "num_train": len(split["train"]),
            "num_test": len(split["test"]),
        }
        if background is not None:
            metrics["background"] = background
        if gt is not None:
            metrics.update(ground_truth_errors(gt, names, c2w))
        metrics["unregistered"] = [{"file": n, "reason": w} for n, w in reasons.items()]
        metrics["other_models"] = []
        times["total"] = time.perf_counter() - t_start
        metrics["time_s"] = {k: round(v, 3) for k, v in times.items()}
    write_metrics(metrics_path, metrics, METRICS_HEADLINE)
    log.info("poses: imported %d/%d cameras (%s, %s, %d distinct), %d points, box from %s, %s split, %.1f s -> %s",
             len(names), len(entries), scene.layout, ", ".join(models), len(kinds), len(xyz_n), aabb_rule, split_rule,
             times["total"], out_dir)
    return metrics
