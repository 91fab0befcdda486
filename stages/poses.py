"""Camera poses from the photos: COLMAP structure from motion (pycolmap, CPU).

Reads ``<ingest>/manifest.json`` and ``<ingest>/images/*.png`` and writes ``<out>/``:

* ``images/``: the registered images, pinhole (undistorted when the SfM camera model has
  distortion),
* ``sparse/0/``: the COLMAP binary model of those images, in the SfM's own frame,
* ``transforms.json``: nerfstudio / instant-ngp cameras in the normalized frame (camera
  centres' mean at the origin, farthest camera at 1, mean up along +z): one shared camera at the
  top level, or with several cameras each frame's own ``fl_x fl_y cx cy w h`` (nerfstudio's
  layout), nerfstudio's ``applied_transform`` (SfM world -> this frame, 3x4), ``ply_file_path``,
  ``train/val/test_filenames`` (the split) and per frame ``colmap_im_id``, and the extra keys
  ``normalization`` (the same map, 4x4), ``aabb`` and ``camera_model``,
* ``points3D.ply``: the sparse points with colours, normalized frame,
* ``split.json``: every ``test_every``-th registered image (sorted by name) is a test view,

and the metrics: the headline (registered images, reprojection error and, when
``<ingest>/ground_truth.json`` exists, the pose error after a similarity alignment) in the
metrics file, and everything (track length, step times, the registered and unregistered
images, ...) in ``<metrics stem>.full.json`` beside it (``stages.common.metrics_files``).

Options (params.yaml ``poses``): SIFT on the GPU when pycolmap has CUDA (``device``), at most
``max_features`` per image, optionally on images shrunk to ``sift_max_size``; exhaustive or
sequential matching; the incremental or the global (GLOMAP) mapper; cameras (``camera_mode``):
``auto`` (one per EXIF camera body and focal length when the photos' EXIF names several, and
per image size: phone photos in portrait and landscape), one shared camera, one per image size
or one per image, of model SIMPLE_PINHOLE, PINHOLE, SIMPLE_RADIAL, RADIAL, OPENCV or
OPENCV_FISHEYE (distorted models are undistorted image by image); known intrinsics (from the
params or the ingest's ground truth) as a prior or held fixed. When the mapper makes several
models the largest is kept and the others are reported. A model whose geometry is implausible
(:func:`degenerate_reasons`: cameras all in one spot or on one line, points behind the cameras,
a large reprojection error, an implausible focal length) stops the stage unless
``allow_degenerate``; the numbers are in the metrics' ``geometry``.

Determinism: images enter the database in sorted-name order before extraction, so image ids
never depend on thread timing; SIFT on the CPU is deterministic per image (extraction stays
multi-threaded); matching and mapping run on one thread each; every RANSAC (two-view
verification, mapper, triangulator) is seeded from ``seed``. Identical inputs, params and library
versions gave bit-identical models in repeated runs on the CPU (GPU SIFT is not checked for this).

Imports (``source: colmap | transforms | llff``): no SfM; the cameras come from
``camera_file`` (a COLMAP model, a ``transforms.json`` / Blender folder, or LLFF's
``poses_bounds.npy``; for ``transforms`` left empty: the Blender folder the ingest stage
recognised, its manifest's ``layout``), are matched to the ingested images by source name
(LLFF: sorted-name order) and written as the same outs, with a given train/test split kept
(``stages/importers/``, docs/contracts.md). ``source: auto``, the default, imports a
Blender / nerf_synthetic folder's cameras that way and runs SfM on any other photos.

Usage::

    python -m stages.poses --ingest data/ingest --out data/poses --metrics data/metrics/poses.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .common import cameras as C
from .common import params as P
from .common.entry import cli, run_stage
from .common.io import atomic_dir, atomic_write_json, check_outs
from .common.metrics_files import remove_metrics, write_metrics
from .common.log import setup

log = logging.getLogger("stages.poses")

PINHOLE_MODELS = ("SIMPLE_PINHOLE", "PINHOLE")  # no distortion: images are copied as they are
NOT_IMPLEMENTED_SOURCES: tuple[str, ...] = ()
IMPORT_SOURCES = ("colmap", "transforms", "llff")  # cameras read by stages/importers/
# COLMAP parameter layouts of the camera models offered (the distortion terms come last)
CAMERA_PARAM_NAMES = {"SIMPLE_PINHOLE": "f, cx, cy", "PINHOLE": "fx, fy, cx, cy", "SIMPLE_RADIAL": "f, cx, cy, k",
                      "RADIAL": "f, cx, cy, k1, k2", "OPENCV": "fx, fy, cx, cy, k1, k2, p1, p2",
                      "OPENCV_FISHEYE": "fx, fy, cx, cy, k1, k2, k3, k4"}
NUM_CAMERA_PARAMS = {m: len(v.split(", ")) for m, v in CAMERA_PARAM_NAMES.items()}
NUM_DISTORTION = {"SIMPLE_PINHOLE": 0, "PINHOLE": 0, "SIMPLE_RADIAL": 1, "RADIAL": 2, "OPENCV": 4,
                  "OPENCV_FISHEYE": 4}
CameraModel = Literal["SIMPLE_PINHOLE", "PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV", "OPENCV_FISHEYE"]
# degenerate_reasons' bounds: what no usable capture has (module docstring)
MIN_BASELINE_RATIO = 0.01  # spread of the camera centres / median point depth
MIN_COLLINEARITY = 1e-3  # second / first singular value of the centred camera centres
MAX_BEHIND_FRACTION = 0.1  # observations with the point behind the camera
MAX_REPROJECTION_PX = 4.0  # mean reprojection error (COLMAP filters observations above 4 px)
FOCAL_RANGE = (0.2, 20.0)  # focal length / longest image side: fields of view of 136 to 2.9 degrees
# the metrics `dvc metrics show` tabulates (the pose errors only with a ground truth); the rest is in .full.json
METRICS_HEADLINE = ("num_registered", "mean_reprojection_error_px", "center_error_mean", "rotation_error_mean_deg")


@dataclass(frozen=True)
class PosesParams:
    """``poses`` section of params.yaml."""

    # auto: transforms for a Blender / nerf_synthetic folder the ingest recognised, else sfm
    source: Literal["auto", "sfm", "colmap", "transforms", "llff"] = "auto"
    # for the import sources: a COLMAP model folder, a transforms.json (or a Blender folder with
    # transforms_train.json) or a poses_bounds.npy; relative to the working directory; with
    # transforms, "" takes the Blender folder the ingest recognised
    camera_file: str = ""
    camera_model: CameraModel = "PINHOLE"
    max_features: int = 8192
    matcher: Literal["exhaustive", "sequential"] = "exhaustive"
    # sequential matcher: each image is matched with the next `sequential_overlap` ones (linear,
    # not quadratic, overlap); keep it >= the views per orbit ring so a ring closes its loop.
    sequential_overlap: int = 20
    test_every: int = 8
    min_registered_fraction: float = 0.8
    align_up: bool = True
    # SfM engine: incremental (COLMAP's mapper) or global (GLOMAP's rotation averaging +
    # global positioning, pycolmap.global_mapping: much faster on large sets).
    mapper: Literal["incremental", "global"] = "incremental"
    # Longest image side SIFT extraction works at; COLMAP scales the keypoints back to the full
    # image, so intrinsics stay those of the ingested images. 0 = full size.
    sift_max_size: int = 0
    # SIFT extraction and matching device: auto = the GPU when pycolmap was built with CUDA.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: one camera per (EXIF camera body and focal length, image size) when EXIF names several
    # bodies or focal lengths, else one per image size (one shared camera when all have one size);
    # single: one camera shared by all images; per_size: one per distinct image size; per_image: one
    # per image (what COLMAP does unless told otherwise).
    camera_mode: Literal["auto", "single", "per_size", "per_image"] = "auto"
    # Known intrinsics: none (estimated), params (`camera_params`) or ground_truth (the ingest's
    # ground_truth.json). They seed the camera (a focal-length prior) and, with
    # `fix_intrinsics`, stay fixed in bundle adjustment.
    known_intrinsics: Literal["none", "params", "ground_truth"] = "none"
    # COLMAP's parameter order for camera_model at the ingested image size, e.g. PINHOLE
    # fx, fy, cx, cy; OPENCV fx, fy, cx, cy, k1, k2, p1, p2.
    camera_params: tuple[float, ...] = ()
    fix_intrinsics: bool = False
    # Refine the principal point in bundle adjustment too (COLMAP keeps it at the image centre
    # by default); for real lenses whose optical centre is off the middle. Not with fix_intrinsics.
    refine_principal_point: bool = False
    # Keep a model that degenerate_reasons flags (cameras in one spot or on a line, points behind
    # the cameras, ...) instead of stopping; the flags stay in the metrics.
    allow_degenerate: bool = False

    def __post_init__(self) -> None:
        P.check(self.source not in NOT_IMPLEMENTED_SOURCES, "source",
                "not implemented yet (only 'sfm' is available for now)", self.source)
        P.check(self.source not in ("colmap", "llff") or bool(self.camera_file.strip()), "camera_file",
                f"must name the camera file to import with source {self.source!r}", self.camera_file)
        P.check(self.max_features >= 256, "max_features", "must be >= 256", self.max_features)
        P.check(self.sequential_overlap >= 1, "sequential_overlap", "must be >= 1", self.sequential_overlap)
        P.check(self.test_every >= 2, "test_every", "must be >= 2", self.test_every)
        P.check(0.0 < self.min_registered_fraction <= 1.0, "min_registered_fraction",
                "must be in (0, 1]", self.min_registered_fraction)
        P.check(self.sift_max_size == 0 or self.sift_max_size >= 64, "sift_max_size",
                "must be 0 (full size) or >= 64", self.sift_max_size)
        n = NUM_CAMERA_PARAMS[self.camera_model]
        if self.known_intrinsics == "params":
            P.check(len(self.camera_params) == n, "camera_params",
                    f"{self.camera_model} takes {n} values ({CAMERA_PARAM_NAMES[self.camera_model]})",
                    list(self.camera_params))
            P.check(all(v > 0 for v in self.camera_params[:n - NUM_DISTORTION[self.camera_model]]),
                    "camera_params", "focal lengths and principal point must be > 0", list(self.camera_params))
        else:
            P.check(not self.camera_params, "camera_params",
                    "is only read with known_intrinsics: params (set it, or leave camera_params empty)",
                    list(self.camera_params))
        P.check(not self.fix_intrinsics or self.known_intrinsics != "none", "fix_intrinsics",
                "needs known intrinsics (known_intrinsics: params or ground_truth)", self.fix_intrinsics)
        P.check(not (self.fix_intrinsics and self.refine_principal_point), "refine_principal_point",
                "contradicts fix_intrinsics: true", self.refine_principal_point)


def load_seed(path: str | Path = P.DEFAULT_PARAMS, data: dict | None = None) -> int:
    """The top-level ``seed`` of params.yaml (0 when absent)."""
    data = P.read_yaml(path) if data is None else data
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise P.ParamsError(f"seed: expected an integer >= 0, got {seed!r}")
    return seed


# ---------------------------------------------------------------- inputs


def read_ingest(ingest_dir: Path, allow_mixed_sizes: bool = False) -> tuple[list[str], dict | None]:
    """Image names (relative to ``<ingest>/images``, sorted) and the ground truth, if any.

    Images of several sizes are an error unless ``allow_mixed_sizes`` (any ``camera_mode`` but single).
    """
    manifest_path = ingest_dir / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["images"]
        files = [str(e["file"]) for e in entries]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{manifest_path}: cannot read the ingest manifest ({exc!r})") from None
    names = []
    for f in files:
        p = Path(f)
        if p.parent != Path("images"):
            raise ValueError(f"{manifest_path}: image {f!r} is not directly under images/")
        if not (ingest_dir / p).is_file():
            raise ValueError(f"{manifest_path}: lists {f!r} but {ingest_dir / p} does not exist")
        names.append(p.name)
    if len(set(names)) != len(names):
        raise ValueError(f"{manifest_path}: duplicate image names")
    if len(names) < 3:
        raise ValueError(f"{manifest_path}: structure from motion needs at least 3 images, got {len(names)}")
    sizes = {(e.get("width"), e.get("height")) for e in entries}
    if len(sizes) > 1 and not allow_mixed_sizes:
        raise ValueError(f"{manifest_path}: images have different sizes {sorted(sizes, key=str)}; "
                         "with poses.camera_mode: single the SfM uses one shared camera, so all images must "
                         "have one size (or set poses.camera_mode: auto or per_size)")
    gt = None
    gt_path = ingest_dir / "ground_truth.json"
    if gt_path.is_file():
        try:
            gt = json.loads(gt_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{gt_path}: cannot read ground truth ({exc})") from None
    return sorted(names), gt


def resolve_source(params: PosesParams, ingest_dir: Path) -> PosesParams:
    """``params`` with ``source: auto`` and an empty ``camera_file`` for ``transforms`` decided from
    the ingest manifest's ``layout`` (a Blender / nerf_synthetic folder, see stages/ingest.py)."""
    if params.source not in ("auto", "transforms") or (params.source == "transforms" and params.camera_file.strip()):
        return params
    try:
        layout = json.loads((ingest_dir / "manifest.json").read_text()).get("layout")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{ingest_dir / 'manifest.json'}: cannot read the ingest manifest ({exc!r})") from None
    folder = layout.get("folder") if isinstance(layout, dict) and layout.get("kind") == "blender" else None
    if params.source == "auto" and folder is None:
        log.info("poses.source: auto -> sfm (the photos are not a Blender / nerf_synthetic folder)")
        return dataclasses.replace(params, source="sfm")
    if folder is None:
        raise P.ParamsError("poses.camera_file: must name the camera file to import with source 'transforms' "
                            "(the ingest found no Blender / nerf_synthetic folder to take it from)")
    log.info("poses.source: %s -> transforms, camera_file: %s (the Blender / nerf_synthetic folder the ingest "
             "stage read)", params.source, folder)
    return dataclasses.replace(params, source="transforms", camera_file=folder)


# ---------------------------------------------------------------- COLMAP steps


def image_sizes(image_dir: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    """(width, height) of each image, from the file headers."""
    from PIL import Image

    sizes = {}
    for n in names:
        with Image.open(image_dir / n) as im:
            sizes[n] = im.size
    return sizes


def use_gpu(pycolmap, p: PosesParams) -> bool:
    """Whether SIFT extraction and matching run on the GPU (``device``, and what pycolmap offers)."""
    if p.device == "cuda" and not pycolmap.has_cuda:
        raise ValueError("poses.device: cuda, but this pycolmap was built without CUDA "
                         "(pycolmap.has_cuda is False); use device: auto or cpu")
    return p.device == "cuda" or (p.device == "auto" and bool(pycolmap.has_cuda))


def known_camera_params(p: PosesParams, gt: dict | None, size: tuple[int, int],
                        ref_size: tuple[int, int]) -> list[float] | None:
    """The known intrinsics of a camera of ``size`` (w, h) in COLMAP's order for ``p.camera_model``.

    ``camera_params`` describe images of ``ref_size``; the ground truth's intrinsics describe its
    own width and height. Both are rescaled to ``size`` (focal lengths and principal point;
    distortion terms are scale-free), which must keep the aspect ratio. None when unknown.
    """
    model = p.camera_model
    if p.known_intrinsics == "none":
        return None
    if p.known_intrinsics == "params":
        values, (w0, h0) = [float(v) for v in p.camera_params], ref_size
    else:
        gi = (gt or {}).get("intrinsics")
        if not gi:
            raise ValueError("poses.known_intrinsics: ground_truth, but the ingest folder has no "
                             "ground_truth.json with intrinsics")
        fx, fy, cx, cy = (float(gi[k]) for k in ("fx", "fy", "cx", "cy"))
        w0, h0 = int(gi["width"]), int(gi["height"])
        f = (fx + fy) / 2
        values = {"SIMPLE_PINHOLE": [f, cx, cy], "PINHOLE": [fx, fy, cx, cy], "SIMPLE_RADIAL": [f, cx, cy, 0.0],
                  "RADIAL": [f, cx, cy, 0.0, 0.0], "OPENCV": [fx, fy, cx, cy, 0.0, 0.0, 0.0, 0.0],
                  "OPENCV_FISHEYE": [fx, fy, cx, cy, 0.0, 0.0, 0.0, 0.0]}[model]
    sx, sy = size[0] / w0, size[1] / h0
    if abs(sx - sy) > 0.01 * max(sx, sy):
        raise ValueError(f"poses.known_intrinsics: the known intrinsics are for {w0}x{h0} images, which "
                         f"cannot be rescaled to {size[0]}x{size[1]} (another aspect ratio)")
    n_lin = NUM_CAMERA_PARAMS[model] - NUM_DISTORTION[model]
    # x-like entries (f, fx, cx) scale with the width, y-like ones (fy, cy) with the height
    scales = {"SIMPLE_PINHOLE": [sx, sx, sy], "PINHOLE": [sx, sy, sx, sy], "SIMPLE_RADIAL": [sx, sx, sy],
              "RADIAL": [sx, sx, sy], "OPENCV": [sx, sy, sx, sy], "OPENCV_FISHEYE": [sx, sy, sx, sy]}[model]
    return [v * scales[i] if i < n_lin else v for i, v in enumerate(values)]


def exif_body(camera: dict | None) -> tuple | None:
    """(make, model, focal length) of an ingest manifest's EXIF ``camera`` entry, or None."""
    if not camera:
        return None
    focal = camera.get("focal_length_mm") or camera.get("focal_length_35mm")
    return camera.get("make"), camera.get("model"), None if focal is None else round(float(focal), 2)


def camera_groups(mode: str, names: list[str], sizes: dict[str, tuple[int, int]],
                  exif: dict[str, dict | None] | None = None) -> dict[str, Any]:
    """The camera key of every image: images with one key share a COLMAP camera.

    ``auto``: (EXIF body and focal length, image size) when the photos' EXIF names more than one
    body or focal length (a photo without EXIF counts as one more), else the image size alone.
    """
    exif = exif or {}
    if mode == "single":
        return {n: "shared" for n in names}
    if mode == "per_image":
        return {n: n for n in names}
    bodies = {n: exif_body(exif.get(n)) for n in names}
    several = mode == "auto" and len(set(bodies.values())) > 1
    return {n: (bodies[n], sizes[n]) if several else sizes[n] for n in names}


def read_exif_cameras(ingest_dir: Path) -> dict[str, dict | None]:
    """Image name -> the manifest's EXIF ``camera`` entry (None where the photo had none)."""
    manifest = json.loads((ingest_dir / "manifest.json").read_text())
    return {Path(str(e["file"])).name: e.get("camera") if isinstance(e.get("camera"), dict) else None
            for e in manifest["images"]}


def import_sorted(pycolmap, db_path: Path, image_dir: Path, names: list[str], sizes: dict[str, tuple[int, int]],
                  p: PosesParams, gt: dict | None = None, exif: dict[str, dict | None] | None = None) -> None:
    """Create the database and add every image in sorted-name order, so image ids are 1..N in that
    order whatever the extraction threads do later.

    Cameras as :func:`camera_groups` assigns them for ``p.camera_mode`` (``exif``: the manifest's
    EXIF cameras by name), each seeded with the known intrinsics when there are some. Images are
    added in runs of one key: the first run of a key creates its camera, later runs reuse it
    (``existing_camera_id``).
    """
    pycolmap.Database.open(db_path).close()
    ref_size = sizes[names[0]]
    groups = camera_groups(p.camera_mode, names, sizes, exif)
    camera_of: dict[Any, int] = {}
    runs: list[tuple[Any, list[str]]] = []
    for n in names:
        key = groups[n]
        if runs and runs[-1][0] == key:
            runs[-1][1].append(n)
        else:
            runs.append((key, [n]))
    for key, run_names in runs:
        reader = pycolmap.ImageReaderOptions()
        reader.camera_model = p.camera_model
        known = known_camera_params(p, gt, sizes[run_names[0]], ref_size)
        if known is not None:
            reader.camera_params = ", ".join(repr(v) for v in known)
        if key in camera_of:
            reader.existing_camera_id = camera_of[key]
        pycolmap.import_images(db_path, image_dir, camera_mode=pycolmap.CameraMode.SINGLE,
                               image_names=run_names, options=reader)
        if key not in camera_of:
            db = pycolmap.Database.open(db_path)
            try:
                camera_of[key] = db.read_image_with_name(run_names[0]).camera_id
            finally:
                db.close()
    db = pycolmap.Database.open(db_path)
    try:
        got = sorted((img.image_id, img.name) for img in db.read_all_images())
    finally:
        db.close()
    if [n for _, n in got] != names:
        raise RuntimeError(f"image import did not keep the sorted order: {got[:5]}...")


def extract(pycolmap, db_path: Path, image_dir: Path, names: list[str], p: PosesParams,
            gt: dict | None = None, sizes: dict[str, tuple[int, int]] | None = None,
            exif: dict[str, dict | None] | None = None) -> None:
    """Import the images (see :func:`import_sorted`) and extract SIFT features, at most
    ``max_features`` per image, on images shrunk to ``sift_max_size`` (keypoints come back in
    full-size pixels)."""
    sizes = image_sizes(image_dir, names) if sizes is None else sizes
    import_sorted(pycolmap, db_path, image_dir, names, sizes, p, gt, exif)
    gpu = use_gpu(pycolmap, p)
    reader = pycolmap.ImageReaderOptions()
    reader.camera_model = p.camera_model
    opts = pycolmap.FeatureExtractionOptions()
    opts.use_gpu = gpu
    opts.sift.max_num_features = p.max_features
    # COLMAP's own default caps the size (3200 px); 0 here means really the full size
    opts.max_image_size = p.sift_max_size or max(max(wh) for wh in sizes.values())
    # the images and their cameras are in the database already; SINGLE would also insist that
    # every image has the first one's size
    mode = pycolmap.CameraMode.SINGLE if p.camera_mode == "single" else pycolmap.CameraMode.AUTO
    pycolmap.extract_features(db_path, image_dir, image_names=names, camera_mode=mode,
                              reader_options=reader, extraction_options=opts,
                              device=pycolmap.Device.cuda if gpu else pycolmap.Device.cpu)


def match(pycolmap, db_path: Path, p: PosesParams, seed: int) -> None:
    gpu = use_gpu(pycolmap, p)
    device = pycolmap.Device.cuda if gpu else pycolmap.Device.cpu
    matching = pycolmap.FeatureMatchingOptions()
    matching.use_gpu = gpu
    # One matching thread: with several, identical runs occasionally produced different raw
    # SIFT matches (about 1 run in 40 under CPU load; the CPU matcher's faiss index and the
    # bundled OpenBLAS were called from concurrent threads). Exact brute-force matching
    # (sift.cpu_brute_force_matcher) would avoid faiss too but was ~10x slower here.
    matching.num_threads = 1
    verification = pycolmap.TwoViewGeometryOptions()
    verification.ransac.random_seed = seed  # each RANSAC reseeds itself: independent of thread order
    if p.matcher == "exhaustive":
        pycolmap.match_exhaustive(db_path, matching_options=matching, verification_options=verification,
                                  device=device)
    else:
        pairing = pycolmap.SequentialPairingOptions()
        pairing.overlap = p.sequential_overlap
        pairing.quadratic_overlap = False  # measured: quadratic overlap left ring views unregistered
        pairing.loop_detection = False  # needs a vocabulary tree we do not ship
        pycolmap.match_sequential(db_path, matching_options=matching, pairing_options=pairing,
                                  verification_options=verification, device=device)


def mapping_options(pycolmap, seed: int, p: PosesParams | None = None):
    """Options of the mapper ``p.mapper`` (incremental when ``p`` is None), seeded, one thread,
    intrinsics held fixed with ``p.fix_intrinsics``."""
    p = PosesParams() if p is None else p
    refine = not p.fix_intrinsics
    if p.mapper == "global":
        opts = pycolmap.GlobalPipelineOptions()
        opts.random_seed = seed
        opts.num_threads = 1  # as below: run-independent sums
        m = opts.mapper
        m.random_seed = seed
        m.num_threads = 1
        m.rotation_averaging.random_seed = seed
        m.global_positioning.random_seed = seed
        m.retriangulation.random_seed = seed
        gpu = bool(pycolmap.has_cuda)  # ask for the GPU solvers only where they exist (no warning)
        m.global_positioning.use_gpu = gpu
        m.bundle_adjustment.ceres.use_gpu = gpu
        m.bundle_adjustment.refine_focal_length = refine
        m.bundle_adjustment.refine_extra_params = refine
        m.bundle_adjustment.refine_principal_point = p.refine_principal_point
        return opts
    opts = pycolmap.IncrementalPipelineOptions()
    opts.random_seed = seed  # propagated to the mapper's and triangulator's RANSACs
    opts.num_threads = 1  # multi-threaded bundle adjustment sums in a run-dependent order
    opts.extract_colors = True
    opts.ba_refine_focal_length = refine
    opts.ba_refine_extra_params = refine
    opts.ba_refine_principal_point = p.refine_principal_point
    return opts


def map_images(pycolmap, db_path: Path, image_dir: Path, work: Path, p: PosesParams, seed: int) -> dict[int, Any]:
    """All the models the mapper makes, by index."""
    out = work / "sparse"
    out.mkdir(parents=True, exist_ok=True)
    opts = mapping_options(pycolmap, seed, p)
    if p.mapper == "global":
        return dict(pycolmap.global_mapping(db_path, image_dir, out, opts))
    return dict(pycolmap.incremental_mapping(db_path, image_dir, out, opts))


def unregistered_reasons(pycolmap, db_path: Path, names: list[str], registered: set[str],
                         others: dict[str, int], min_num_matches: int) -> dict[str, str]:
    """Why each image that is not in the kept model is missing, from what the database holds."""
    db = pycolmap.Database.open(db_path)
    try:
        id_by_name = {img.name: img.image_id for img in db.read_all_images()}
        keypoints = {i: db.num_keypoints_for_image(i) for i in id_by_name.values()}
        pair_ids, geoms = db.read_two_view_geometries()
    finally:
        db.close()
    verified: dict[int, list[int]] = {i: [] for i in id_by_name.values()}
    for pid, g in zip(pair_ids, geoms):
        n = len(g.inlier_matches)
        if n >= min_num_matches:
            a, b = pycolmap.pair_id_to_image_pair(pid)
            verified[a].append(n)
            verified[b].append(n)
    reasons = {}
    for name in names:
        if name in registered:
            continue
        iid = id_by_name.get(name)
        if iid is None:
            reasons[name] = "could not be read into the database"
        elif keypoints[iid] == 0:
            reasons[name] = "no SIFT features (blank or unreadable image?)"
        elif not verified[iid]:
            reasons[name] = (f"{keypoints[iid]} features but no geometrically verified match "
                             f"(>= {min_num_matches} inliers) with any other image")
        elif name in others:
            reasons[name] = f"registered only in a smaller separate model (#{others[name]})"
        else:
            reasons[name] = (f"{len(verified[iid])} verified pairs (best {max(verified[iid])} inliers) "
                             "but the mapper could not register it")
    return reasons


def undistort(pycolmap, rec, image_dir: Path, work: Path):
    """Undistort the images of ``rec`` to PINHOLE cameras, each image with its own camera;
    returns (reconstruction, image folder). RGBA images keep their alpha channel, warped alike."""
    src = work / "distorted"
    src.mkdir()
    rec.write(src)
    dst = work / "undistorted"
    pycolmap.undistort_images(dst, src, image_dir, output_type="COLMAP")
    out = pycolmap.Reconstruction(dst / "sparse")
    for cid in list(out.cameras):
        cam = out.cameras[cid]
        if cam.model_name in PINHOLE_MODELS:
            continue
        # COLMAP copies a camera whose distortion is exactly zero (e.g. held fixed at 0) as it
        # is; it is a pinhole camera all the same, so write it as one
        if any(cam.params[i] != 0.0 for i in cam.extra_params_idxs()):
            raise RuntimeError(f"undistortion left camera {cid} with distortion: {cam}")
        out.cameras[cid] = pycolmap.Camera(
            camera_id=cid, model="PINHOLE", width=cam.width, height=cam.height,
            params=[cam.focal_length_x, cam.focal_length_y, cam.principal_point_x, cam.principal_point_y])
    keep_alpha(pycolmap, {im.name: rec.cameras[im.camera_id] for im in rec.images.values()}, image_dir, dst / "images")
    return out, dst / "images"


def keep_alpha(pycolmap, cameras: dict[str, Any], image_dir: Path, undistorted: Path) -> None:
    """pycolmap's undistortion writes RGB images: put the alpha channel of every RGBA source
    back, undistorted by the same warp (``pycolmap.undistort_image`` of the alpha alone, with
    the image's distorted camera ``cameras[name]``)."""
    from PIL import Image

    for name, camera in cameras.items():
        with Image.open(image_dir / name) as im:
            if im.mode != "RGBA":
                continue
            alpha = np.ascontiguousarray(np.asarray(im)[..., 3])
        warped, _ = pycolmap.undistort_image(pycolmap.UndistortCameraOptions(), pycolmap.Bitmap.from_array(alpha),
                                             camera)
        with Image.open(undistorted / name) as im:
            rgb = np.asarray(im.convert("RGB"))
        a = warped.to_array().reshape(rgb.shape[:2])
        Image.fromarray(np.dstack([rgb, a]), "RGBA").save(undistorted / name)


# ---------------------------------------------------------------- plausibility of the model


def model_geometry(rec) -> dict[str, Any]:
    """The numbers :func:`degenerate_reasons` judges, from a pycolmap reconstruction: camera
    spread (largest distance of a centre from their mean) against the median depth of the
    observed points, collinearity of the centres, the fraction of observations with the point
    behind its camera, the mean reprojection error and the extreme focal lengths per image side."""
    ids = sorted(rec.reg_image_ids())
    w2c = {i: rec.image(i).cam_from_world().matrix() for i in ids}
    centres = np.array([-w2c[i][:, :3].T @ w2c[i][:, 3] for i in ids]).reshape(-1, 3)
    img_of, xyz = [], []
    for pt in rec.points3D.values():
        for el in pt.track.elements:
            if el.image_id in w2c:
                img_of.append(el.image_id)
                xyz.append(pt.xyz)
    depths = np.zeros(0)
    if img_of:
        P = np.stack([w2c[i] for i in img_of])  # [M, 3, 4]
        depths = np.einsum("mj,mj->m", P[:, 2, :3], np.asarray(xyz)) + P[:, 2, 3]
    spread = float(np.linalg.norm(centres - centres.mean(0), axis=1).max()) if len(centres) else 0.0
    sv = np.linalg.svd(centres - centres.mean(0), compute_uv=False) if len(centres) >= 3 else np.zeros(3)
    front = depths[depths > 0]
    median_depth = float(np.median(front)) if len(front) else 0.0
    focal = [cam.focal_length_x / max(cam.width, cam.height) for cam in
             (rec.camera(c) for c in {rec.image(i).camera_id for i in ids})]
    return {
        "num_registered": len(ids),
        "camera_spread": spread,
        "median_point_depth": median_depth,
        "baseline_ratio": spread / median_depth if median_depth > 0 else None,
        "collinearity": float(sv[1] / sv[0]) if sv[0] > 0 else 0.0,
        "behind_fraction": float((depths <= 0).mean()) if len(depths) else 0.0,
        "mean_reprojection_error_px": float(rec.compute_mean_reprojection_error()),
        "focal_per_side": [min(focal), max(focal)] if focal else None,
    }


def degenerate_reasons(g: dict[str, Any]) -> list[str]:
    """What is implausible about a model's geometry (:func:`model_geometry`), one sentence each;
    empty for a plausible model or one of fewer than 3 registered images."""
    if g["num_registered"] < 3:
        return []
    out = []
    if g["baseline_ratio"] is not None and g["baseline_ratio"] < MIN_BASELINE_RATIO:
        out.append(f"the cameras barely move: their spread is {g['baseline_ratio']:.2%} of the median point depth "
                   f"(under {MIN_BASELINE_RATIO:.0%}: a rotation-only capture or a collapsed model)")
    if g["num_registered"] >= 4 and g["collinearity"] < MIN_COLLINEARITY:
        out.append(f"the camera centres lie on one line (second / first spread {g['collinearity']:.1e})")
    if g["behind_fraction"] > MAX_BEHIND_FRACTION:
        out.append(f"{g['behind_fraction']:.0%} of the point observations are behind their camera")
    if g["mean_reprojection_error_px"] > MAX_REPROJECTION_PX:
        out.append(f"mean reprojection error {g['mean_reprojection_error_px']:.2f} px (over {MAX_REPROJECTION_PX:g} px)")
    lo, hi = FOCAL_RANGE
    if g["focal_per_side"] and not (lo <= g["focal_per_side"][0] and g["focal_per_side"][1] <= hi):
        out.append(f"implausible focal lengths: {g['focal_per_side'][0]:.3g} to {g['focal_per_side'][1]:.3g} times "
                   f"the longest image side (expected {lo:g} to {hi:g})")
    if g["median_point_depth"] <= 0 and g["num_registered"] >= 3:
        out.append("no point lies in front of the cameras")
    return out


# ---------------------------------------------------------------- outputs


def robust_aabb(points: np.ndarray, fallback: np.ndarray, lo_pct: float = 0.5, hi_pct: float = 99.5,
                pad: float = 0.15) -> np.ndarray:
    """[2, 3] scene box: the 0.5th-99.5th percentiles of ``points`` [N, 3] per axis, padded on
    every side by ``pad`` of the box's LARGEST extent; ``fallback`` [M, 3] points (the
    cameras) stand in when there are too few.

    Sparse SfM points are mostly on the ground of a capture, so per-axis percentiles with a
    per-axis pad cut off the tops of objects (seen on the default scene: a box 0.14 tall for
    objects 0.3 tall, and renders with the tops missing); padding by the largest extent keeps
    them inside while a few stray points still cannot blow the box up.
    """
    pts = points if len(points) >= 8 else np.concatenate([points.reshape(-1, 3), fallback], 0)
    lo, hi = np.percentile(pts, lo_pct, axis=0), np.percentile(pts, hi_pct, axis=0)
    margin = pad * max(float((hi - lo).max()), 1e-3)
    return np.stack([lo - margin, hi + margin])


def write_ply(path: Path, xyz: np.ndarray, rgb_u8: np.ndarray) -> None:
    import open3d as o3d

    pcd = o3d.geometry.PointCloud()
    pcd.points = o3d.utility.Vector3dVector(np.asarray(xyz, dtype=np.float64).reshape(-1, 3))
    pcd.colors = o3d.utility.Vector3dVector(np.asarray(rgb_u8, dtype=np.float64).reshape(-1, 3) / 255.0)
    if not o3d.io.write_point_cloud(str(path), pcd, write_ascii=False):
        raise RuntimeError(f"open3d could not write {path}")


def make_split(names: list[str], test_every: int) -> dict[str, list[str]]:
    """Sorted names; index 0, test_every, 2 * test_every, ... are test views (llffhold)."""
    names = sorted(names)
    return {"train": [n for i, n in enumerate(names) if i % test_every != 0],
            "test": [n for i, n in enumerate(names) if i % test_every == 0]}


def ground_truth_errors(gt: dict, names: list[str], c2w: np.ndarray) -> dict[str, Any]:
    """Pose error against ground_truth.json after a Sim(3) alignment of the camera centres."""
    by_stem = {Path(str(f["file"])).stem: np.asarray(f["world_to_camera"], dtype=np.float64)
               for f in gt.get("frames", [])}
    idx = [i for i, n in enumerate(names) if Path(n).stem in by_stem]
    if len(idx) < 3:
        log.warning("ground truth: only %d registered images have a ground-truth pose; no pose error", len(idx))
        return {}
    gt_c2w = C.w2c_to_c2w(np.stack([by_stem[Path(names[i]).stem] for i in idx]))
    radius = float(gt.get("scene", {}).get("radius", 1.0))
    err = C.pose_errors(c2w[idx], gt_c2w, ref_scale=radius)
    out = {k: err[k] for k in ("center_error_mean", "center_error_max",
                               "rotation_error_mean_deg", "rotation_error_max_deg")}
    out["gt_matched_images"] = len(idx)
    out["gt_scene_radius"] = radius
    return out


def _intrinsics(camera) -> C.Intrinsics:
    return C.Intrinsics(int(camera.width), int(camera.height), float(camera.focal_length_x),
                        float(camera.focal_length_y), float(camera.principal_point_x),
                        float(camera.principal_point_y))


# ---------------------------------------------------------------- the stage


def run(params: PosesParams, ingest_dir: str | Path, out_dir: str | Path, metrics_path: str | Path,
        seed: int = 0) -> dict:
    """Run SfM on the ingested images and write the outs; returns the metrics."""
    params = resolve_source(params, Path(ingest_dir))
    check_outs({"--ingest": ingest_dir, "poses.camera_file": params.camera_file or None},
               {"--out": out_dir, "--metrics": metrics_path})
    if params.source in IMPORT_SOURCES:  # cameras from another tool's files: no SfM
        from .importers import run_import

        return run_import(params, ingest_dir, out_dir, metrics_path)
    import pycolmap

    if params.source != "sfm":  # the schema rejects the others; keep the guard next to the work
        raise ValueError(f"poses.source: {params.source!r} is not implemented yet")
    ingest_dir, out_dir, metrics_path = Path(ingest_dir), Path(out_dir), Path(metrics_path)
    image_dir = ingest_dir / "images"
    names, gt = read_ingest(ingest_dir, allow_mixed_sizes=params.camera_mode != "single")
    sizes = image_sizes(image_dir, names)
    exif = read_exif_cameras(ingest_dir)
    groups = camera_groups(params.camera_mode, names, sizes, exif)
    remove_metrics(metrics_path)  # a failed run must not leave the previous run's numbers behind
    if log.getEffectiveLevel() > logging.DEBUG:
        pycolmap.logging.minloglevel = 1  # COLMAP's per-image INFO lines only at DEBUG
    t_start = time.perf_counter()
    times: dict[str, float] = {}
    log.info("poses: %d images from %s, camera %s (%s: %d camera(s)), %s matching, %s mapper, up to %d features%s",
             len(names), ingest_dir, params.camera_model, params.camera_mode, len(set(groups.values())),
             params.matcher, params.mapper, params.max_features,
             f" at <= {params.sift_max_size} px" if params.sift_max_size else "")

    with tempfile.TemporaryDirectory(prefix="rayforge-poses-") as tmp, atomic_dir(out_dir) as out:
        work = Path(tmp)
        db_path = work / "database.db"

        t = time.perf_counter()
        extract(pycolmap, db_path, image_dir, names, params, gt, sizes, exif)
        times["extract"] = time.perf_counter() - t
        log.info("extract: %.1f s", times["extract"])

        t = time.perf_counter()
        match(pycolmap, db_path, params, seed)
        times["match"] = time.perf_counter() - t
        log.info("match (%s): %.1f s", params.matcher, times["match"])

        t = time.perf_counter()
        models = map_images(pycolmap, db_path, image_dir, work, params, seed)
        times["map"] = time.perf_counter() - t
        log.info("map (%s): %.1f s, %d model(s): %s", params.mapper, times["map"], len(models),
                 ", ".join(f"#{k}: {r.num_reg_images()} images" for k, r in sorted(models.items())) or "none")

        if models:
            key = min(models, key=lambda k: (-models[k].num_reg_images(), -models[k].num_points3D(), k))
            rec = models[key]
        else:
            key, rec = None, None
        registered = {rec.image(i).name for i in rec.reg_image_ids()} if rec is not None else set()
        others = {}
        for k, r in sorted(models.items()):
            if k != key:
                for i in r.reg_image_ids():
                    others.setdefault(r.image(i).name, k)
        other_models = [{"model": k, "num_registered": r.num_reg_images(), "num_points": r.num_points3D()}
                        for k, r in sorted(models.items()) if k != key]
        if other_models:
            log.warning("kept model #%s; %d smaller model(s) dropped: %s", key, len(other_models), other_models)
        reasons = unregistered_reasons(pycolmap, db_path, names, registered, others,
                                       mapping_options(pycolmap, seed, params).min_num_matches)
        for name, why in reasons.items():
            log.warning("not registered: %s: %s", name, why)
        fraction = len(registered) / len(names)
        if fraction < params.min_registered_fraction:
            shown = "; ".join(f"{n}: {w}" for n, w in list(reasons.items())[:10])
            more = f" (and {len(reasons) - 10} more)" if len(reasons) > 10 else ""
            hints = ["photos with more overlap and texture"]
            if params.camera_model not in PINHOLE_MODELS:
                hints.append("camera_model: PINHOLE (distortion parameters need many points to be estimated)")
            if params.matcher == "sequential":
                hints.append("matcher: exhaustive")
            if params.mapper == "global":
                hints.append("mapper: incremental")
            if params.sift_max_size:
                hints.append("a larger sift_max_size (or 0, full size)")
            hints.append("a lower poses.min_registered_fraction")
            raise ValueError(
                f"SfM registered {len(registered)} of {len(names)} images ({fraction:.0%}), below "
                f"poses.min_registered_fraction={params.min_registered_fraction}. Unregistered: {shown}{more}. "
                f"Try {'; or '.join(hints)}.")

        # -- is the geometry plausible? (a registration fraction of 100 % can hide a collapsed model)
        geometry = model_geometry(rec)
        geometry["reasons"] = degenerate_reasons(geometry)
        geometry["degenerate"] = bool(geometry["reasons"])
        if geometry["degenerate"]:
            msg = (f"SfM registered {len(registered)} of {len(names)} images, but the model looks degenerate: "
                   + "; ".join(geometry["reasons"]))
            if not params.allow_degenerate:
                raise ValueError(f"{msg}. Check that the photos see the scene from different places (walk around "
                                 "it, do not turn on the spot); poses.allow_degenerate: true keeps the model anyway")
            log.warning("%s (kept: poses.allow_degenerate)", msg)

        # -- images and the COLMAP model (undistorted to PINHOLE when the model has distortion)
        t = time.perf_counter()
        if params.camera_model in PINHOLE_MODELS:
            src_images = image_dir
            out_rec = rec
        else:
            out_rec, src_images = undistort(pycolmap, rec, image_dir, work)
            times["undistort"] = time.perf_counter() - t
            log.info("undistort: %.1f s", times["undistort"])
        (out / "images").mkdir()
        reg_names = sorted(registered)
        for n in reg_names:
            shutil.copy2(src_images / n, out / "images" / n)
        (out / "sparse" / "0").mkdir(parents=True)
        out_rec.write(out / "sparse" / "0")

        # -- cameras and points in the normalized frame
        by_name = {out_rec.image(i).name: out_rec.image(i) for i in out_rec.reg_image_ids()}
        cam_ids = sorted({by_name[n].camera_id for n in reg_names})
        if len(cam_ids) != 1 and params.camera_mode == "single":
            raise RuntimeError(f"expected one shared camera, the model has {cam_ids}")
        intrs = [_intrinsics(out_rec.camera(by_name[n].camera_id)) for n in reg_names]
        w2c = np.stack([np.vstack([by_name[n].cam_from_world().matrix(), [0, 0, 0, 1]]) for n in reg_names])
        c2w = C.w2c_to_c2w(w2c)
        S = C.normalization_transform(c2w, params.align_up)
        c2w_n = C.apply_similarity_to_c2w(S, c2w)
        pts = out_rec.points3D
        point_ids = sorted(out_rec.point3D_ids())  # a stable order for the PLY
        xyz = np.array([pts[i].xyz for i in point_ids], dtype=np.float64).reshape(-1, 3)
        rgb = np.array([pts[i].color for i in point_ids], dtype=np.uint8).reshape(-1, 3)
        xyz_n = C.apply_similarity_to_points(S, xyz)
        aabb = robust_aabb(xyz_n, c2w_n[:, :3, 3])
        split = make_split(reg_names, params.test_every)
        atomic_write_json(out / "split.json", split)
        # one shared camera at the top level; several: every frame its own (nerfstudio's layout)
        C.write_transforms(out / "transforms.json", intrs, [f"images/{n}" for n in reg_names], c2w_n, extra={
            "camera_model": "PINHOLE",  # what the images in images/ are
            "sfm_camera_model": params.camera_model,
            "applied_transform": S[:3].tolist(),  # nerfstudio's key: SfM world (sparse/0) -> this frame
            "ply_file_path": "points3D.ply",
            **C.split_keys(split),
            "normalization": S.tolist(),
            "aabb": aabb.tolist(),
        }, frame_extra=[{"colmap_im_id": by_name[n].image_id} for n in reg_names])
        write_ply(out / "points3D.ply", xyz_n, rgb)

        metrics: dict[str, Any] = {
            "num_images": len(names),
            "num_registered": len(registered),
            "registered_fraction": fraction,
            "num_points": int(rec.num_points3D()),
            "mean_reprojection_error_px": float(rec.compute_mean_reprojection_error()),
            "mean_track_length": float(rec.compute_mean_track_length()),
            "num_cameras": len(cam_ids),
            "camera_mode": params.camera_mode,
            "mapper": params.mapper,
            "num_train": len(split["train"]),
            "num_test": len(split["test"]),
        }
        if gt is not None:
            metrics.update(ground_truth_errors(gt, reg_names, c2w))
            gi = gt.get("intrinsics", {})
            if gi.get("fx") and gi.get("width"):  # worst SfM camera, its focal rescaled to the ground truth's width
                metrics["focal_error_rel"] = max(
                    abs(float(cam.focal_length_x) * float(gi["width"]) / cam.width - float(gi["fx"])) / float(gi["fx"])
                    for cam in (rec.camera(c) for c in {rec.image(i).camera_id for i in rec.reg_image_ids()}))
        metrics["geometry"] = geometry
        metrics["registered"] = reg_names
        metrics["unregistered"] = [{"file": n, "reason": w} for n, w in reasons.items()]
        metrics["other_models"] = other_models
        times["total"] = time.perf_counter() - t_start
        metrics["time_s"] = {k: round(v, 3) for k, v in times.items()}
    write_metrics(metrics_path, metrics, METRICS_HEADLINE)
    log.info("poses: %d/%d registered, %d points, reprojection %.2f px, track %.1f, %.1f s -> %s",
             len(registered), len(names), metrics["num_points"], metrics["mean_reprojection_error_px"],
             metrics["mean_track_length"], times["total"], out_dir)
    if "center_error_mean" in metrics:
        log.info("pose error vs ground truth: centre mean %.4f / max %.4f of the scene radius, "
                 "rotation mean %.3f / max %.3f deg", metrics["center_error_mean"], metrics["center_error_max"],
                 metrics["rotation_error_mean_deg"], metrics["rotation_error_max_deg"])
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.poses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ingest", required=True, help="the ingest stage's out folder")
    ap.add_argument("--out", required=True, help="this stage's out folder (replaced)")
    ap.add_argument("--metrics", required=True, help="metrics JSON file to write")
    ap.add_argument("--params", default=str(P.DEFAULT_PARAMS), help="params.yaml (section 'poses', key 'seed')")
    args = ap.parse_args(argv)
    setup("stages.poses")

    def body() -> None:  # a ValueError (ParamsError included) is one line to act on, no traceback
        data = P.read_yaml(args.params)
        params = P.load_section(PosesParams, "poses", args.params, data=data)
        check_outs({"--ingest": args.ingest, "--params": args.params}, {"--out": args.out, "--metrics": args.metrics})
        run(params, args.ingest, args.out, args.metrics, seed=load_seed(data=data))

    return run_stage("poses", body)


if __name__ == "__main__":
    cli(main)
