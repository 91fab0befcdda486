"""The radiance field: hash encoding -> density MLP -> colour MLP with SH view encoding."""
from __future__ import annotations

import torch
from torch import nn

from kernels import HashGrid

from ..config import NerfParams


class _TruncExp(torch.autograd.Function):
    """exp(x) whose gradient is clamped, as in instant-ngp, so early spikes do not explode."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.exp(x.clamp(max=15.0))


def trunc_exp(x: torch.Tensor) -> torch.Tensor:
    return _TruncExp.apply(x)


def sh_encode_deg4(d: torch.Tensor) -> torch.Tensor:
    """Real spherical harmonics up to degree 3 (16 values) of unit directions [N, 3]."""
    x, y, z = d.unbind(-1)
    xx, yy, zz = x * x, y * y, z * z
    xy, yz, xz = x * y, y * z, x * z
    return torch.stack(
        [
            torch.full_like(x, 0.28209479177387814),
            -0.48860251190291987 * y,
            0.48860251190291987 * z,
            -0.48860251190291987 * x,
            1.0925484305920792 * xy,
            -1.0925484305920792 * yz,
            0.94617469575755997 * zz - 0.31539156525251999,
            -1.0925484305920792 * xz,
            0.54627421529603959 * (xx - yy),
            0.59004358992664352 * y * (-3.0 * xx + yy),
            2.8906114426405538 * xy * z,
            0.45704579946446572 * y * (1.0 - 5.0 * zz),
            0.3731763325901154 * z * (5.0 * zz - 3.0),
            0.45704579946446572 * x * (1.0 - 5.0 * zz),
            1.4453057213202769 * z * (xx - yy),
            0.59004358992664352 * x * (-xx + 3.0 * yy),
        ],
        dim=-1,
    )


class NerfField(nn.Module):
    """Density and view-dependent colour at points inside the scene box.

    Args:
        cfg: the NeRF params.
        aabb: [2, 3] scene box; points outside it have zero density.
        use_kernels: whether the hash encoding runs the CUDA kernel (None = when possible).
    """

    def __init__(self, cfg: NerfParams, aabb: torch.Tensor, use_kernels: bool | None = None):
        super().__init__()
        self.register_buffer("aabb", aabb.clone().float())
        self.encoding = HashGrid(
            levels=cfg.levels,
            features_per_level=cfg.features_per_level,
            log2_hashmap_size=cfg.log2_hashmap_size,
            base_resolution=cfg.base_resolution,
            max_resolution=cfg.max_resolution,
            use_kernels=use_kernels,
        )
        h = cfg.hidden_dim
        self.geo_feat_dim = cfg.geo_feat_dim
        self.density_mlp = nn.Sequential(
            nn.Linear(self.encoding.output_dim, h), nn.ReLU(inplace=True), nn.Linear(h, 1 + cfg.geo_feat_dim)
        )
        self.color_mlp = nn.Sequential(
            nn.Linear(cfg.geo_feat_dim + 16, h),
            nn.ReLU(inplace=True),
            nn.Linear(h, h),
            nn.ReLU(inplace=True),
            nn.Linear(h, 3),
        )
        # Learned background colour for rays that leave the box unoccluded, unless the images were
        # composited on a known one (fixed_background >= 0, set by the method; saved with the model).
        # A learned one starting at grey lets the field paint a white background into the box as
        # floaters (nerf_synthetic lego: 14 dB test PSNR) before the colour has moved to white.
        self.background = nn.Parameter(torch.zeros(3))
        self.register_buffer("fixed_background", torch.full((3,), -1.0))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.aabb[0]) / (self.aabb[1] - self.aabb[0])

    def density(self, x: torch.Tensor, return_feat: bool = False):
        """Density [N] (and geometry features [N, geo_feat_dim]) at world points [N, 3]."""
        xn = self.normalize(x)
        inside = ((xn >= 0) & (xn <= 1)).all(dim=-1)
        h = self.density_mlp(self.encoding(xn.clamp(0.0, 1.0)))
        sigma = trunc_exp(h[:, 0] - 1.0) * inside
        return (sigma, h[:, 1:]) if return_feat else sigma

    def forward(self, x: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Density [N] and colour [N, 3] at points [N, 3] seen along unit directions [N, 3]."""
        sigma, feat = self.density(x, return_feat=True)
        rgb = torch.sigmoid(self.color_mlp(torch.cat([feat, sh_encode_deg4(d)], dim=-1)))
        return sigma, rgb

    def background_rgb(self) -> torch.Tensor:
        fixed = self.fixed_background
        return torch.where(fixed >= 0, fixed, torch.sigmoid(self.background))  # no host read: no sync
