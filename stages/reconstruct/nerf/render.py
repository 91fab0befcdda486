"""Volume rendering of rays through the field, with occupancy-grid sample culling.

Samples are taken at a fixed step along each ray between its entry into and exit from
the scene box (stratified jitter while training), samples in empty cells are dropped
before the network runs, and the rest are alpha-composited front to back (Max 1995;
Mildenhall et al. 2020, eq. 3) over the learned background colour.
"""
from __future__ import annotations

import torch

from .field import NerfField, sh_encode_deg4
from .occupancy import OccupancyGrid


def ray_aabb(o: torch.Tensor, d: torch.Tensor, aabb: torch.Tensor, near: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry and exit distances [R] of rays with the box; exit <= entry means a miss."""
    inv = 1.0 / torch.where(d.abs() < 1e-9, torch.full_like(d, 1e-9), d)
    t0 = (aabb[0] - o) * inv
    t1 = (aabb[1] - o) * inv
    tmin = torch.minimum(t0, t1).amax(dim=-1).clamp(min=near)
    tmax = torch.maximum(t0, t1).amin(dim=-1)
    return tmin, tmax


def render_rays(
    field: NerfField,
    grid: OccupancyGrid | None,
    o: torch.Tensor,
    d: torch.Tensor,
    step_size: float,
    max_samples: int,
    near: float = 0.0,
    perturb: bool = False,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Render rays [R, 3] (origins ``o``, unit directions ``d``).

    Returns:
        dict with ``rgb`` [R, 3], ``opacity`` [R], ``depth`` [R] and ``num_samples``
        (network evaluations, a 0-d tensor).
    """
    R = o.shape[0]
    dev = o.device
    tmin, tmax = ray_aabb(o, d, field.aabb, near)
    steps = torch.arange(max_samples, device=dev, dtype=o.dtype)
    if perturb:
        jitter = torch.rand((R, 1), generator=generator, device=generator.device if generator else "cpu").to(dev)
    else:
        jitter = torch.full((R, 1), 0.5, device=dev)
    t = tmin[:, None] + (steps[None, :] + jitter) * step_size  # [R, S] sample midpoints
    valid = t < tmax[:, None]
    pts = o[:, None, :] + t[..., None] * d[:, None, :]
    if grid is not None:
        # every sample looked up (a clamped cell index, cheap) rather than the valid ones picked by a
        # boolean mask first: the mask would cost a second host sync per batch besides nonzero below
        valid = valid & grid.occupied(pts.reshape(-1, 3)).view(R, max_samples)
    idx = valid.nonzero(as_tuple=True)  # the one host sync: the surviving sample count
    sigma = torch.zeros((R, max_samples), device=dev, dtype=o.dtype)
    rgb = torch.zeros((R, max_samples, 3), device=dev, dtype=o.dtype)
    if idx[0].numel() > 0:
        # the view encoding once per ray, gathered per sample (rays hold ~10-100 samples each)
        s, c = field(pts[idx], d_enc=sh_encode_deg4(d)[idx[0]])
        sigma = sigma.index_put(idx, s.to(o.dtype))
        rgb = rgb.index_put(idx, c.to(o.dtype))
    alpha = 1.0 - torch.exp(-sigma * step_size)
    trans = torch.cumprod(torch.cat([torch.ones((R, 1), device=dev), 1.0 - alpha + 1e-10], dim=1), dim=1)[:, :-1]
    w = alpha * trans
    opacity = w.sum(dim=1)
    color = (w[..., None] * rgb).sum(dim=1) + (1.0 - opacity)[:, None] * field.background_rgb()
    depth = (w * t).sum(dim=1)
    return {"rgb": color, "opacity": opacity, "depth": depth, "num_samples": torch.tensor(idx[0].numel())}
