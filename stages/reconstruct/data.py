"""Posed images for training and evaluation, read from the poses stage's outs.

Everything here is in the normalized frame of ``transforms.json`` with OpenCV camera
axes; rays are generated on the fly from pixel indices, so a batch costs a few
matrix products rather than a precomputed ray buffer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from stages.common.cameras import Intrinsics, read_transforms


@dataclass
class PosedImages:
    """Images [N, H, W, 3] uint8 with shared intrinsics and camera-to-world poses [N, 4, 4]."""

    names: list[str]
    images: torch.Tensor  # [N, H, W, 3] uint8
    c2w: torch.Tensor  # [N, 4, 4] float32, OpenCV axes
    intr: Intrinsics

    def to(self, device: torch.device | str) -> "PosedImages":
        return PosedImages(self.names, self.images.to(device), self.c2w.to(device), self.intr)

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


def load_scene(poses_dir: str | Path) -> Scene:
    """Load the train and test views and scene box from ``<poses_dir>``."""
    poses_dir = Path(poses_dir)
    for name in ("transforms.json", "split.json"):
        if not (poses_dir / name).is_file():
            raise ValueError(f"{poses_dir}: missing {name}; run the poses stage first")
    intr, files, c2w, doc = read_transforms(poses_dir / "transforms.json")
    split = json.loads((poses_dir / "split.json").read_text())
    by_name = {Path(f).name: (f, m) for f, m in zip(files, c2w)}

    def take(names: list[str]) -> PosedImages:
        imgs, mats = [], []
        for n in names:
            if n not in by_name:
                raise ValueError(f"{poses_dir}/split.json names {n!r}, which transforms.json does not have")
            f, m = by_name[n]
            path = poses_dir / f
            try:
                img = np.asarray(Image.open(path).convert("RGB"))
            except OSError as exc:
                raise ValueError(f"cannot read image {path}: {exc}") from None
            if img.shape[:2] != (intr.height, intr.width):
                raise ValueError(
                    f"{path}: image is {img.shape[1]}x{img.shape[0]}, cameras say {intr.width}x{intr.height}"
                )
            imgs.append(img)
            mats.append(m)
        if not imgs:
            return PosedImages([], torch.zeros(0, intr.height, intr.width, 3, dtype=torch.uint8),
                               torch.zeros(0, 4, 4), intr)
        return PosedImages(list(names), torch.from_numpy(np.stack(imgs)),
                           torch.from_numpy(np.stack(mats)).float(), intr)

    train, test = take(split.get("train", [])), take(split.get("test", []))
    if len(train) == 0:
        raise ValueError(f"{poses_dir}/split.json has no training views")
    if "aabb" in doc:
        aabb = torch.tensor(doc["aabb"], dtype=torch.float32)
        if aabb.shape != (2, 3) or not bool((aabb[1] > aabb[0]).all()):
            raise ValueError(f"{poses_dir}/transforms.json: aabb must be [[min x,y,z],[max x,y,z]], got {doc['aabb']}")
    else:  # cameras are normalized to the unit sphere; assume the scene lies within it
        aabb = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    bg = doc.get("background")
    known = {"white": (1.0, 1.0, 1.0), "black": (0.0, 0.0, 0.0)}
    background = known.get(bg) if isinstance(bg, str) else None
    return Scene(train, test, aabb, background)


def pixel_rays(
    intr: Intrinsics, c2w: torch.Tensor, u: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rays through pixel centres.

    Args:
        intr: shared pinhole intrinsics.
        c2w: [R, 4, 4] camera-to-world (OpenCV axes), one per ray, or [4, 4] for all.
        u, v: [R] integer (or float) pixel column and row.

    Returns:
        origins [R, 3] and unit directions [R, 3].
    """
    x = (u.float() + 0.5 - intr.cx) / intr.fx
    y = (v.float() + 0.5 - intr.cy) / intr.fy
    d_cam = torch.stack([x, y, torch.ones_like(x)], dim=-1)
    R = c2w[..., :3, :3]
    d = (R @ d_cam.unsqueeze(-1)).squeeze(-1) if R.dim() == 3 else d_cam @ R.T
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
    """Draws random training rays (and their colours) from all training images.

    Args:
        views: training images on the device where rays are wanted.
        generator: the torch generator seeded from ``seed`` and the global rank, so
            every rank draws its own rays and a rerun draws the same ones.
    """

    def __init__(self, views: PosedImages, generator: torch.Generator):
        self.views = views
        self.gen = generator
        self.device = views.images.device

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N, H, W, _ = self.views.images.shape
        idx = torch.randint(0, N * H * W, (n,), generator=self.gen, device=self.gen.device).to(self.device)
        img, pix = idx // (H * W), idx % (H * W)
        v, u = pix // W, pix % W
        o, d = pixel_rays(self.views.intr, self.views.c2w[img], u, v)
        rgb = self.views.images[img, v, u].float() / 255.0
        return o, d, rgb
