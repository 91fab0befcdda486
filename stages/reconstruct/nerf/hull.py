"""The scene box tightened to the visual hull of the training views' alpha masks.

Object captures with alpha (nerf_synthetic, masked turntables) come with a loose box: the
transforms import's camera-focus cube is half the camera distance on each side (4.03 units for
lego, whose object spans about 1.3 x 2.3 x 1.4). The hash grid, the occupancy grid and the march
step are all laid over that box, so most of their resolution goes to empty space. The alpha masks
say where the object cannot be: a point that projects onto transparent pixels in any view that
sees it is empty. The box of what no view carves away is the object's box; the NeRF then trains
in it (``reconstruct.nerf.alpha_box``), and rays that miss it render the known background.

Conservative where it matters: each cell is tested with the mask dilated by the cell's projected
footprint (a max-pool pyramid), a view does not carve points it does not see (behind it, outside
its frame), and the result is padded by ``pad_cells`` cells. Points that no view sees are dropped,
as instant-ngp marks the density-grid cells no training camera sees empty: training cannot put
anything there.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from ..data import PosedImages

log = logging.getLogger(__name__)

# dilation radii (pixels) of the mask pyramid; a cell uses the first one at least its footprint
_RADII = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _pyramid(alpha: torch.Tensor) -> torch.Tensor:
    """[len(_RADII), H, W]: the mask max-pooled over squares of half side r, for each radius r
    (separably: a row pass, then a column pass)."""
    levels = [alpha]
    x = alpha[None, None]
    for r in _RADII[1:]:
        rows = F.max_pool2d(x, (1, 2 * r + 1), stride=1, padding=(0, r))
        levels.append(F.max_pool2d(rows, (2 * r + 1, 1), stride=1, padding=(r, 0))[0, 0])
    return torch.stack(levels)


def _cell_ijk(idx: torch.Tensor, resolution: int) -> torch.Tensor:
    """[N, 3] grid coordinates of flat cell indices (x slowest, z fastest)."""
    return torch.stack([idx // (resolution * resolution), (idx // resolution) % resolution, idx % resolution], -1)


@torch.no_grad()
def alpha_hull_box(views: PosedImages, aabb: torch.Tensor, resolution: int = 64, pad_cells: float = 2.0,
                   empty: float = 2 / 255, device: torch.device | str | None = None,
                   chunk: int = 1 << 20) -> torch.Tensor | None:
    """[2, 3] box of the visual hull of ``views``' alpha masks inside ``aabb``, or None when the
    views have no alpha or the masks carve everything away (they then say nothing usable).

    Args:
        views: training views; their 4th channel is alpha.
        aabb: [2, 3] box to tighten; the result lies inside it.
        resolution: cells per axis of the grid of tested points.
        pad_cells: cells of margin around the kept points' box.
        empty: dilated alpha at or below this carves a point.
        device: where to compute (the views' device by default).
    """
    if views.channels != 4 or len(views) == 0:
        return None
    dev = torch.device(device) if device is not None else views.pixels.device
    lo, hi = aabb[0].to(dev, torch.float32), aabb[1].to(dev, torch.float32)
    cell = (hi - lo) / resolution
    half_diag = 0.5 * float(cell.norm())
    axis = torch.arange(resolution, device=dev, dtype=torch.float32) + 0.5
    n = resolution ** 3
    keep = torch.ones(n, dtype=torch.bool, device=dev)
    seen_by = torch.zeros(n, dtype=torch.int32, device=dev)
    w2c = torch.linalg.inv(views.c2w.to(dev).double()).float()
    radii = torch.tensor(_RADII, device=dev, dtype=torch.float32)
    inside = 0  # views whose mask stays off the image border (the whole object in frame)
    for i in range(len(views)):
        intr = views.intr(i)
        alpha = views.image(i)[..., 3].to(dev).float() / 255.0
        border = torch.cat([alpha[0], alpha[-1], alpha[:, 0], alpha[:, -1]])
        inside += int(bool((border <= empty).all()) and bool((alpha > empty).any()))
        pyr = _pyramid(alpha)  # [L, H, W]
        flat = pyr.reshape(len(_RADII), -1)
        R, t = w2c[i, :3, :3], w2c[i, :3, 3]
        for a in range(0, n, chunk):
            idx = torch.arange(a, min(n, a + chunk), device=dev)
            x = lo + axis[_cell_ijk(idx, resolution)] * cell
            c = x @ R.T + t
            z = c[:, 2]
            seen = z > 1e-6
            zs = torch.where(seen, z, torch.ones_like(z))
            u = intr.fx * c[:, 0] / zs + intr.cx
            v = intr.fy * c[:, 1] / zs + intr.cy
            col, row = torch.floor(u), torch.floor(v)
            seen &= (col >= 0) & (col < intr.width) & (row >= 0) & (row < intr.height)
            # the cell's footprint: its half diagonal at its depth, in pixels (+0.5: the pixel it falls in)
            foot = half_diag * max(intr.fx, intr.fy) / zs + 0.5
            level = torch.searchsorted(radii, foot.contiguous()).clamp(max=len(_RADII) - 1)
            pix = (row.clamp(0, intr.height - 1) * intr.width + col.clamp(0, intr.width - 1)).long()
            a_val = flat[level, pix]
            # a footprint past the largest radius is not tested (no carving from a blurry view)
            carve = seen & (a_val <= empty) & (foot <= float(radii[-1]))
            keep[idx] &= ~carve
            seen_by[idx] += seen.int()
    if not bool((keep & (seen_by > 0)).any()):
        log.warning("the alpha masks of the %d training views carve the whole box away (poses that do not "
                    "match the masks?); keeping the scene box %s", len(views), aabb.tolist())
        return None
    # Cells near the cameras sit in front of the object in the few views that see them, so no view carves
    # them. But every point of the object lies inside the frame of each view whose mask stays off the
    # image border, so it is seen by at least that many views: cells seen by fewer are not the object.
    # (An object that leaves the frame in every view gives 1: the conservative hull.)
    k = max(1, inside)
    idx = (keep & (seen_by >= k)).nonzero()[:, 0]
    if len(idx) == 0:  # the poses and the masks disagree; take what some view sees
        k = 1
        idx = (keep & (seen_by >= 1)).nonzero()[:, 0]
    ijk = _cell_ijk(idx, resolution).float()
    pad = (0.5 + pad_cells) * cell
    box = torch.stack([torch.maximum(lo + (ijk.min(0).values + 0.5) * cell - pad, lo),
                       torch.minimum(lo + (ijk.max(0).values + 0.5) * cell + pad, hi)])
    box = box.cpu()
    shrink = float(torch.prod((box[1] - box[0]) / (aabb[1] - aabb[0]).cpu()))
    log.info("alpha hull of %d views: scene box %s -> %s (%.1f %% of its volume; cells seen by >= %d views, "
             "the views with the whole object in frame)",
             len(views), [[round(v, 3) for v in r] for r in aabb.tolist()],
             [[round(v, 3) for v in r] for r in box.tolist()], 100 * shrink, k)
    return box if not math.isclose(shrink, 1.0) else None

