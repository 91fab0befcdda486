"""Posed images for training and evaluation, read from the poses stage's outs.

Every image has its own pinhole camera (:class:`Cameras`), so images of different sizes and
orientations (a phone's portrait and landscape shots) train together: their pixels sit one
image after the other, row-major, in one flat buffer (:class:`PosedImages`), and a ray is drawn
by a flat pixel index. Everything is in the normalized frame of ``transforms.json`` with OpenCV
camera axes; rays are generated on the fly from pixel indices, so a batch costs a few matrix
products rather than a precomputed ray buffer.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from stages.common.cameras import Intrinsics, read_transforms

log = logging.getLogger("stages.reconstruct.data")

# Longest image side trained on without a GPU (the CPU profile's working resolution): larger images
# are shrunk as they are loaded (80 photos at 4000x3000 are 2.9 GB of pixels; 800 px, 115 MB).
CPU_WORKING_SIDE = 800


def working_side(device: torch.device) -> int:
    """The ``max_side`` of :func:`load_scene` on ``device``: :data:`CPU_WORKING_SIDE` off the GPU, else 0."""
    return 0 if device.type == "cuda" else CPU_WORKING_SIDE


@dataclass
class Cameras:
    """One pinhole camera per image (pixel (0, 0)'s centre at (0.5, 0.5))."""

    fx: torch.Tensor  # [N] float32
    fy: torch.Tensor  # [N] float32
    cx: torch.Tensor  # [N] float32
    cy: torch.Tensor  # [N] float32
    width: torch.Tensor  # [N] int64
    height: torch.Tensor  # [N] int64

    @classmethod
    def from_intrinsics(cls, intrs: Sequence[Intrinsics]) -> "Cameras":
        f32 = [torch.tensor([getattr(i, k) for i in intrs], dtype=torch.float32) for k in ("fx", "fy", "cx", "cy")]
        wh = [torch.tensor([getattr(i, k) for i in intrs], dtype=torch.int64) for k in ("width", "height")]
        return cls(*f32, *wh)

    def K(self) -> torch.Tensor:
        """[N, 3, 3] float32 calibration matrices."""
        K = torch.zeros(len(self), 3, 3, dtype=torch.float32, device=self.fx.device)
        K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2], K[:, 2, 2] = self.fx, self.fy, self.cx, self.cy, 1.0
        return K

    def intrinsics(self, i: int) -> Intrinsics:
        return Intrinsics(int(self.width[i]), int(self.height[i]), float(self.fx[i]), float(self.fy[i]),
                          float(self.cx[i]), float(self.cy[i]))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Cameras":
        return Cameras(*(t.to(device, non_blocking=non_blocking) for t in self._tensors()))

    def pin_memory(self) -> "Cameras":
        return Cameras(*(t.pin_memory() for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.fx, self.fy, self.cx, self.cy, self.width, self.height

    def __len__(self) -> int:
        return int(self.fx.shape[0])


@dataclass
class PosedImages:
    """Images of any sizes with one camera and one camera-to-world pose each.

    Image ``i`` is ``pixels[offsets[i]:offsets[i + 1]]``, ``height[i] x width[i]`` pixels
    row-major; ``channels`` is 3 (RGB) or 4 (RGBA, when the poses out kept alpha).
    """

    names: list[str]
    pixels: torch.Tensor  # [P, C] uint8
    offsets: torch.Tensor  # [N + 1] int64
    c2w: torch.Tensor  # [N, 4, 4] float32, OpenCV axes, normalized frame
    cameras: Cameras

    @classmethod
    def from_images(cls, names: list[str], images: Sequence[np.ndarray], c2w: torch.Tensor,
                    cameras: Cameras) -> "PosedImages":
        """Pack uint8 images [H_i, W_i, C] (one C for all) whose sizes are their cameras'."""
        if not (len(names) == len(images) == len(cameras) == c2w.shape[0]):
            raise ValueError(f"{len(names)} names, {len(images)} images, {len(cameras)} cameras and "
                             f"{c2w.shape[0]} poses: one of each per image")
        channels = {im.shape[2] for im in images}
        if len(channels) > 1 or not channels <= {3, 4}:
            raise ValueError(f"images must all be RGB or all RGBA, got channel counts {sorted(channels)}")
        for n, im, w, h in zip(names, images, cameras.width.tolist(), cameras.height.tolist()):
            if im.shape[:2] != (h, w):
                raise ValueError(f"{n}: image is {im.shape[1]}x{im.shape[0]}, its camera says {w}x{h}")
        offsets = torch.cumsum(torch.tensor([0] + [im.shape[0] * im.shape[1] for im in images]), 0)
        pixels = torch.empty(int(offsets[-1]), channels.pop() if channels else 3, dtype=torch.uint8)
        flat = pixels.numpy()
        for im, a, b in zip(images, offsets[:-1].tolist(), offsets[1:].tolist()):
            flat[a:b] = np.asarray(im).reshape(b - a, -1)  # one copy, into the buffer
        return cls(list(names), pixels, offsets, c2w.float(), cameras)

    @property
    def channels(self) -> int:
        return int(self.pixels.shape[1])

    def image(self, i: int) -> torch.Tensor:
        """[H_i, W_i, C] uint8, a view into ``pixels``."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.pixels[a:b].view(int(self.cameras.height[i]), int(self.cameras.width[i]), self.channels)

    def intr(self, i: int) -> Intrinsics:
        return self.cameras.intrinsics(i)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PosedImages":
        return PosedImages(self.names, self.pixels.to(device, non_blocking=non_blocking),
                           self.offsets.to(device, non_blocking=non_blocking),
                           self.c2w.to(device, non_blocking=non_blocking), self.cameras.to(device, non_blocking))

    def pin_memory(self) -> "PosedImages":
        return PosedImages(self.names, self.pixels.pin_memory(), self.offsets.pin_memory(), self.c2w.pin_memory(),
                           self.cameras.pin_memory())

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class Scene:
    train: PosedImages
    test: PosedImages
    aabb: torch.Tensor  # [2, 3]
    # Known background colour (RGB in [0, 1]) when the images were composited on one (transforms.json
    # "background": "white" | "black", e.g. nerf_synthetic); None: the model learns it.
    background: tuple[float, float, float] | None = None
    # The poses out's sparse points (transforms.json "ply_file_path", normalized frame); None when
    # there is no such file or it has no points.
    points: torch.Tensor | None = None  # [P, 3] float32
    point_rgb: torch.Tensor | None = None  # [P, 3] uint8


# ---------------------------------------------------------------- reading the poses out


def read_image(path: Path, name: str) -> np.ndarray:
    """uint8 [H, W, 3] or, for an image with an alpha channel, [H, W, 4]."""
    try:
        with Image.open(path) as im:
            has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
            return np.asarray(im.convert("RGBA" if has_alpha else "RGB"))
    except OSError as exc:
        raise ValueError(f"cannot read image {name} ({path}): {exc}") from None


def working_size(intr: Intrinsics, max_side: int) -> Intrinsics:
    """The camera of the image shrunk so its longest side is at most ``max_side`` (0: as it is)."""
    longest = max(intr.width, intr.height)
    return intr if not max_side or longest <= max_side else intr.scaled(max_side / longest)


def _shrink(img: np.ndarray, intr: Intrinsics) -> np.ndarray:
    if img.shape[:2] == (intr.height, intr.width):
        return img
    mode = "RGBA" if img.shape[2] == 4 else "RGB"
    return np.asarray(Image.fromarray(img, mode).resize((intr.width, intr.height), Image.Resampling.BOX))


def read_points_ply(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Vertices of a point-cloud PLY (ascii or binary little-endian): xyz [P, 3] float64 and
    rgb [P, 3] uint8 (128 grey without colour properties). Enough of the format for the poses
    stage's ``points3D.ply`` and nerfstudio's ``sparse_pc.ply``; other elements after the
    vertices are ignored."""
    types = {"char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "i2", "int16": "i2",
             "ushort": "u2", "uint16": "u2", "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
             "float": "f4", "float32": "f4", "double": "f8", "float64": "f8"}
    raw = path.read_bytes()
    end = raw.find(b"end_header")
    if not raw.startswith(b"ply") or end < 0:
        raise ValueError(f"{path}: not a PLY file")
    body = raw[raw.index(b"\n", end) + 1:]
    fmt, count, props, in_vertex = None, 0, [], False
    for line in raw[:end].decode("ascii", "replace").splitlines():
        tok = line.split()
        if tok[:1] == ["format"]:
            fmt = tok[1]
        elif tok[:1] == ["element"]:
            in_vertex = tok[1] == "vertex"
            count = int(tok[2]) if in_vertex else count
        elif tok[:1] == ["property"] and in_vertex:
            if tok[1] == "list" or tok[1] not in types:
                raise ValueError(f"{path}: vertex property {' '.join(tok[1:])!r} is not supported")
            props.append((tok[2], types[tok[1]]))
    names = [n for n, _ in props]
    if not all(k in names for k in "xyz"):
        raise ValueError(f"{path}: vertices need x, y and z properties, got {names}")
    if fmt == "ascii":
        rows = [r.split()[:len(props)] for r in body.decode("ascii", "replace").split("\n")[:count]]
        try:
            data = np.array(rows, dtype=np.float64).reshape(count, len(props))
        except ValueError:
            raise ValueError(f"{path}: {count} vertices of {len(props)} numbers announced, the rows disagree") from None
        col = {n: data[:, k] for k, n in enumerate(names)}
    elif fmt == "binary_little_endian":
        dtype = np.dtype([(n, "<" + t) for n, t in props])
        if len(body) < count * dtype.itemsize:
            raise ValueError(f"{path}: {count} vertices announced, the file ends early")
        arr = np.frombuffer(body, dtype=dtype, count=count)
        col = {n: arr[n].astype(np.float64) for n in names}
    else:
        raise ValueError(f"{path}: PLY format {fmt!r} is not supported (ascii or binary_little_endian)")
    xyz = np.stack([col["x"], col["y"], col["z"]], 1)
    if all(k in col for k in ("red", "green", "blue")):
        rgb = np.clip(np.stack([col["red"], col["green"], col["blue"]], 1), 0, 255).astype(np.uint8)
    else:
        rgb = np.full((count, 3), 128, np.uint8)
    return xyz, rgb


def _points(poses_dir: Path, doc: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    rel = doc.get("ply_file_path", "points3D.ply")
    path = poses_dir / str(rel)
    if not path.is_file():
        return None, None
    xyz, rgb = read_points_ply(path)
    if not len(xyz):
        return None, None
    return torch.from_numpy(xyz).float(), torch.from_numpy(rgb)


def load_scene(poses_dir: str | Path, max_side: int = 0) -> Scene:
    """Load the train and test views, their cameras, the scene box and the sparse points of
    ``<poses_dir>``. ``max_side`` > 0 shrinks every image whose longest side is larger to that
    side (area average; its camera scaled to match): a working resolution."""
    poses_dir = Path(poses_dir)
    for name in ("transforms.json", "split.json"):
        if not (poses_dir / name).is_file():
            raise ValueError(f"{poses_dir}: missing {name}; run the poses stage first")
    intrs, files, c2w, doc = read_transforms(poses_dir / "transforms.json")
    split = json.loads((poses_dir / "split.json").read_text())
    by_name = {Path(f).name: (f, m, k) for f, m, k in zip(files, c2w, intrs)}
    shrunk: set[str] = set()

    def take(names: list[str]) -> tuple[list[np.ndarray], list[np.ndarray], list[Intrinsics]]:
        imgs, mats, cams = [], [], []
        for n in names:
            if n not in by_name:
                raise ValueError(f"{poses_dir}/split.json names {n!r}, which transforms.json does not have")
            f, m, intr = by_name[n]
            img = read_image(poses_dir / f, n)
            if img.shape[:2] != (intr.height, intr.width):
                raise ValueError(f"{poses_dir / f}: image is {img.shape[1]}x{img.shape[0]}, its camera in "
                                 f"transforms.json says {intr.width}x{intr.height}")
            work = working_size(intr, max_side)
            if work != intr:
                shrunk.add(f"{intr.width}x{intr.height}")
            imgs.append(_shrink(img, work))
            mats.append(m)
            cams.append(work)
        return imgs, mats, cams

    names = {part: list(split.get(part, [])) for part in ("train", "test")}
    parts = {part: take(n) for part, n in names.items()}
    if not names["train"]:
        raise ValueError(f"{poses_dir}/split.json has no training views")
    channels = max(im.shape[2] for imgs, _, _ in parts.values() for im in imgs)

    def pack(part: str) -> PosedImages:
        imgs, mats, cams = parts[part]
        # RGBA as soon as one image has alpha: the opaque ones get alpha 255
        imgs = [im if im.shape[2] == channels else np.dstack([im, np.full(im.shape[:2], 255, np.uint8)])
                for im in imgs]
        c2w = torch.from_numpy(np.stack(mats) if mats else np.zeros((0, 4, 4))).float()
        return PosedImages.from_images(names[part], imgs, c2w, Cameras.from_intrinsics(cams))

    train, test = pack("train"), pack("test")
    if shrunk:
        log.info("working resolution: images of %s shrunk to a longest side of %d px", ", ".join(sorted(shrunk)),
                 max_side)
    if "aabb" in doc:
        aabb = torch.tensor(doc["aabb"], dtype=torch.float32)
        if aabb.shape != (2, 3) or not bool((aabb[1] > aabb[0]).all()):
            raise ValueError(f"{poses_dir}/transforms.json: aabb must be [[min x,y,z],[max x,y,z]], got {doc['aabb']}")
    else:  # cameras are normalized to the unit sphere; assume the scene lies within it
        aabb = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    bg = doc.get("background")
    known = {"white": (1.0, 1.0, 1.0), "black": (0.0, 0.0, 0.0)}
    background = known.get(bg) if isinstance(bg, str) else None
    points, point_rgb = _points(poses_dir, doc)
    return Scene(train, test, aabb, background, points, point_rgb)


# ---------------------------------------------------------------- rays


def pixel_rays(
    camera: Intrinsics | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    c2w: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rays through pixel centres.

    Args:
        camera: one pinhole camera for every ray, or per-ray ``(fx, fy, cx, cy)``, each [R].
        c2w: [R, 4, 4] camera-to-world (OpenCV axes), one per ray, or [4, 4] for all.
        u, v: [R] integer (or float) pixel column and row.

    Returns:
        origins [R, 3] and unit directions [R, 3].
    """
    fx, fy, cx, cy = (camera.fx, camera.fy, camera.cx, camera.cy) if isinstance(camera, Intrinsics) else camera
    x = (u.float() + 0.5 - cx) / fx
    y = (v.float() + 0.5 - cy) / fy
    d_cam = torch.stack([x, y, torch.ones_like(x)], dim=-1)
    R = c2w[..., :3, :3]
    # R d as products and a sum, not a matmul: a float32 matmul on a GPU follows torch's process-wide TF32
    # switch (nerf.mlp_precision tf32 sets it for the MLPs), and where cuBLAS then picks a TF32 kernel, R and d
    # are rounded to 10-bit mantissas: on lego (400 px, f 556) that bends the rays by up to 0.3 px (0.08 px
    # mean, emulated on the CPU; the same bend every step, another per view). On the CPU the two give the
    # same bits.
    d = (R * d_cam.unsqueeze(-2)).sum(-1)
    d = d / d.norm(dim=-1, keepdim=True)
    o = c2w[..., :3, 3].expand_as(d)
    return o, d


def image_rays(intr: Intrinsics, c2w: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """All rays of one image, row-major: origins and directions [H*W, 3]."""
    v, u = torch.meshgrid(
        torch.arange(intr.height, device=device), torch.arange(intr.width, device=device), indexing="ij"
    )
    return pixel_rays(intr, c2w.to(device), u.reshape(-1), v.reshape(-1))


class RaySampler:
    """Draws random training rays (and their colours) from all pixels of all training images.

    Every pixel is equally likely, whatever the size of its image: a flat index into
    ``views.pixels``, then its image by the offsets, then its row and column.

    Args:
        views: training images on the device where rays are wanted.
        generator: the torch generator seeded from ``seed`` and the global rank, so
            every rank draws its own rays and a rerun draws the same ones.
        jitter: rays through a uniform random point of their pixel (with the pixel's colour, as
            instant-ngp trains) instead of its centre; the draws for it follow the pixel draws.
    """

    def __init__(self, views: PosedImages, generator: torch.Generator, jitter: bool = False):
        self.views = views
        self.gen = generator
        self.jitter = jitter
        self.device = views.pixels.device
        self.total = int(views.pixels.shape[0])
        self.ends = views.offsets[1:].contiguous()

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``n`` rays: origins [n, 3], unit directions [n, 3] and colours [n, C] in [0, 1]."""
        return self.sample_indexed(n)[:3]

    def sample_indexed(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`sample` (the same draws) and each ray's image index [n] int64."""
        v = self.views
        idx = torch.randint(0, self.total, (n,), generator=self.gen, device=self.gen.device).to(self.device)
        img = torch.searchsorted(self.ends, idx, right=True)
        pix = idx - v.offsets[img]
        W = v.cameras.width[img]
        row, col = pix // W, pix % W
        cams = v.cameras
        if self.jitter:  # pixel_rays adds 0.5 (the centre): offsets in [-0.5, 0.5) span the pixel
            du = torch.rand(2, n, generator=self.gen, device=self.gen.device).to(self.device) - 0.5
            col, row = col.float() + du[0], row.float() + du[1]
        o, d = pixel_rays((cams.fx[img], cams.fy[img], cams.cx[img], cams.cy[img]), v.c2w[img], col, row)
        rgb = v.pixels[idx].float() / 255.0
        return o, d, rgb, img


def sizes_text(views: PosedImages) -> str:
    """The image sizes of ``views`` for a log line: ``400x300`` or ``400x300 (30), 300x400 (18)``."""
    pairs = list(zip(views.cameras.width.tolist(), views.cameras.height.tolist()))
    counts = {p: pairs.count(p) for p in dict.fromkeys(pairs)}
    if len(counts) <= 1:
        return "x".join(map(str, next(iter(counts), (0, 0))))
    return ", ".join(f"{w}x{h} ({n})" for (w, h), n in counts.items())


def composite(rgb: torch.Tensor, background: Sequence[float]) -> torch.Tensor:
    """Colours [..., 3] as they are, or RGBA [..., 4] (straight alpha) composited on ``background``."""
    if rgb.shape[-1] == 3:
        return rgb
    a = rgb[..., 3:]
    return rgb[..., :3] * a + torch.as_tensor(background, dtype=rgb.dtype, device=rgb.device) * (1.0 - a)
