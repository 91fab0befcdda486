"""Seeded Gaussian scenes and a dense blending formula for the rasterizer tests (test_gs_*.py).

:func:`dense_rasterize` is the blending rule written the plain way: every pixel against its whole
tile list as one [pixels, L] tensor, differentiated by autograd. The twin in kernels/_gs_reference.py
(sub-tile culling, chunks, an analytic backward) is checked against it on small images.
"""
from __future__ import annotations

import math

import torch

from kernels._gs_reference import ALPHA_MAX, ALPHA_MIN, T_MIN


def camera(width: int, height: int, focal: float, n: int = 1, seed: int = 0, spread: float = 0.0):
    """n OpenCV cameras looking down +z from near the origin: (viewmats [n, 4, 4], Ks [n, 3, 3]).

    Camera 0 is the identity; the others are turned by up to ``spread`` radians and shifted a little."""
    g = torch.Generator().manual_seed(seed)
    views = []
    for i in range(n):
        angle = 0.0 if i == 0 else float(torch.rand((), generator=g) * 2 - 1) * spread
        c, s = math.cos(angle), math.sin(angle)
        R = torch.tensor([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])
        t = torch.zeros(3) if i == 0 else (torch.rand(3, generator=g) - 0.5) * 0.2
        v = torch.eye(4)
        v[:3, :3], v[:3, 3] = R, t
        views.append(v)
    K = torch.tensor([[focal, 0.0, width / 2], [0.0, focal, height / 2], [0.0, 0.0, 1.0]])
    return torch.stack(views), K.expand(n, 3, 3).contiguous()


def gaussians(n: int, seed: int = 0, depth=(2.0, 5.0), fov: float = 0.6, log_scale=(-3.5, 0.5),
              sh_k: int = 16, dtype=torch.float32):
    """n random Gaussians in front of the cameras of :func:`camera` (sizes and opacities like a
    trained scene: log-normal scales, sigmoid-normal opacities): means, quats, scales, opacities,
    SH coefficients [n, sh_k, 3]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(n, generator=g) * (depth[1] - depth[0]) + depth[0]
    xy = (torch.rand(n, 2, generator=g) - 0.5) * 2 * fov * z[:, None]
    means = torch.cat([xy, z[:, None]], -1)
    quats = torch.randn(n, 4, generator=g)
    scales = torch.exp(torch.randn(n, 3, generator=g) * log_scale[1] + log_scale[0])
    opacities = torch.sigmoid(torch.randn(n, generator=g) * 1.5)
    sh = torch.randn(n, sh_k, 3, generator=g) * 0.3
    return tuple(t.to(dtype) for t in (means, quats, scales, opacities, sh))


def dense_rasterize(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets,
                    flatten_ids, backgrounds=None, stopped: list | None = None):
    """rasterize_to_pixels' rule as one [pixels, L] tensor per camera, through autograd.

    ``stopped``: a list that receives, per camera, the [H, W] mask of pixels that stopped early."""
    C, th, tw = isect_offsets.shape
    M = flatten_ids.numel()
    starts = isect_offsets.reshape(-1).long()
    ends = torch.cat([starts[1:], starts.new_tensor([M])])
    L = max(int((ends - starts).max()), 1)
    idx = starts[:, None] + torch.arange(L)
    listed = idx < ends[:, None]
    ids = torch.where(listed, flatten_ids.long()[idx.clamp(max=max(M - 1, 0))] if M else idx * 0, 0)
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    tile = ((ys // tile_size) * tw + xs // tile_size).reshape(-1)
    px, py = xs.reshape(-1, 1) + 0.5, ys.reshape(-1, 1) + 0.5
    D = colors.shape[-1]
    mf, qf, of, cf = means2d.reshape(-1, 2), conics.reshape(-1, 3), opacities.reshape(-1), colors.reshape(-1, D)
    out, alphas = [], []
    for c in range(C):
        g, v = ids[c * th * tw + tile], listed[c * th * tw + tile]  # [HW, L]
        dx, dy = mf[g, 0] - px.to(mf.dtype), mf[g, 1] - py.to(mf.dtype)
        q = qf[g]
        sigma = 0.5 * (q[..., 0] * dx * dx + q[..., 2] * dy * dy) + q[..., 1] * dx * dy
        alpha = torch.clamp(of[g] * torch.exp(-sigma), max=ALPHA_MAX)
        alpha = torch.where(v & (sigma >= 0) & (alpha >= ALPHA_MIN), alpha, torch.zeros_like(alpha))
        going = (torch.cumprod(1 - alpha, -1) > T_MIN).detach()
        if stopped is not None:
            stopped.append((~going).any(-1).reshape(height, width))
        alpha = alpha * going
        T = torch.cumprod(1 - alpha, -1)
        T_prev = torch.cat([torch.ones_like(T[:, :1]), T[:, :-1]], -1)
        rgb = ((alpha * T_prev)[..., None] * cf[g]).sum(1)
        if backgrounds is not None:
            rgb = rgb + T[:, -1:] * backgrounds[c]
        out.append(rgb.reshape(height, width, D))
        alphas.append((1 - T[:, -1]).reshape(height, width, 1))
    return torch.stack(out), torch.stack(alphas)
