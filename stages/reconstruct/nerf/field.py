"""The radiance field: hash encoding -> density MLP -> colour MLP with SH view encoding."""
from __future__ import annotations

import torch
from torch import nn

from kernels import HashGrid
from kernels._reference import cascade_box_reference, contract_reference

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


def sh_encode_deg4_reference(d: torch.Tensor) -> torch.Tensor:
    """Real spherical harmonics up to degree 3 (16 values) of unit directions [N, 3], term by term
    (the reference for :func:`sh_encode_deg4`; ~35 elementwise ops)."""
    x, y, z = d.unbind(-1)
    xx, yy, zz = x * x, y * y, z * z
    xy, yz, xz = x * y, y * z, x * z
    return torch.stack(
        [
            torch.full_like(x, _SH[0]),
            -_SH[1] * y,
            _SH[1] * z,
            -_SH[1] * x,
            _SH[2] * xy,
            -_SH[2] * yz,
            _SH[3] * zz - _SH[4],
            -_SH[2] * xz,
            _SH[5] * (xx - yy),
            _SH[6] * y * (-3.0 * xx + yy),
            _SH[7] * xy * z,
            _SH[8] * y * (1.0 - 5.0 * zz),
            _SH[9] * z * (5.0 * zz - 3.0),
            _SH[8] * x * (1.0 - 5.0 * zz),
            _SH[10] * z * (xx - yy),
            _SH[6] * x * (-xx + 3.0 * yy),
        ],
        dim=-1,
    )


# Normalisation constants of the real SH basis, degrees 0..3 (as in instant-ngp / tiny-cuda-nn).
_SH = (0.28209479177387814, 0.48860251190291987, 1.0925484305920792, 0.94617469575755997,
       0.31539156525251999, 0.54627421529603959, 0.59004358992664352, 2.8906114426405538,
       0.45704579946446572, 0.3731763325901154, 1.4453057213202769)


def _sh_matrix() -> torch.Tensor:
    """[64, 16]: each SH value as a combination of the products m_i m_j m_k of m = (1, x, y, z),
    flattened as 16 i + 4 j + k (one entry per monomial, at its sorted index triple)."""
    c = torch.zeros(64, 16, dtype=torch.float64)

    def put(col: int, coef: float, *axes: str) -> None:
        idx = sorted("1xyz".index(a) for a in axes) + [0] * (3 - len(axes))
        i, j, k = sorted(idx)
        c[16 * i + 4 * j + k, col] += coef

    put(0, _SH[0])
    put(1, -_SH[1], "y"), put(2, _SH[1], "z"), put(3, -_SH[1], "x")
    put(4, _SH[2], "x", "y"), put(5, -_SH[2], "y", "z"), put(7, -_SH[2], "x", "z")
    put(6, _SH[3], "z", "z"), put(6, -_SH[4])
    put(8, _SH[5], "x", "x"), put(8, -_SH[5], "y", "y")
    put(9, -3.0 * _SH[6], "x", "x", "y"), put(9, _SH[6], "y", "y", "y")
    put(10, _SH[7], "x", "y", "z")
    put(11, _SH[8], "y"), put(11, -5.0 * _SH[8], "y", "z", "z")
    put(12, 5.0 * _SH[9], "z", "z", "z"), put(12, -3.0 * _SH[9], "z")
    put(13, _SH[8], "x"), put(13, -5.0 * _SH[8], "x", "z", "z")
    put(14, _SH[10], "x", "x", "z"), put(14, -_SH[10], "y", "y", "z")
    put(15, -_SH[6], "x", "x", "x"), put(15, 3.0 * _SH[6], "x", "y", "y")
    return c


_SH_MATRIX = _sh_matrix()
_SH_MATRIX_ON: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # no copy to the GPU per call


def sh_encode_deg4(d: torch.Tensor) -> torch.Tensor:
    """Real spherical harmonics up to degree 3 (16 values) of unit directions [N, 3].

    Every value is a cubic polynomial in (x, y, z), so all 16 come from one matmul of the 64
    products m_i m_j m_k (m = (1, x, y, z)) with a constant matrix: 5 kernels instead of the ~35
    elementwise ones of :func:`sh_encode_deg4_reference` (training steps are launch-bound on a GPU).
    Same values up to float rounding (sums in another order).
    """
    m = torch.cat([torch.ones_like(d[:, :1]), d], dim=-1)  # [N, 4]
    p2 = (m[:, :, None] * m[:, None, :]).reshape(-1, 16)
    p3 = (p2[:, :, None] * m[:, None, :]).reshape(-1, 64)
    key = (d.device, d.dtype)
    mat = _SH_MATRIX_ON.get(key)
    if mat is None:
        mat = _SH_MATRIX_ON[key] = _SH_MATRIX.to(device=d.device, dtype=d.dtype)
    return p3 @ mat


class NerfField(nn.Module):
    """Density and view-dependent colour at points inside the scene box.

    Args:
        cfg: the NeRF params.
        aabb: [2, 3] scene box; points outside it have zero density, unless ``scene_contraction``
            maps the whole world into the encoding's cube (the box in its middle half per axis), or
            (``cascades``) the encoding spans the box scaled by ``aabb_scale`` about its centre.
        use_kernels: whether the hash encoding runs the CUDA kernel (None = when possible).
        num_images: training images, one appearance code each (``appearance_dim`` > 0).
    """

    def __init__(self, cfg: NerfParams, aabb: torch.Tensor, use_kernels: bool | None = None, num_images: int = 1):
        super().__init__()
        self.register_buffer("aabb", aabb.clone().float())
        self.contract = cfg.scene_contraction == "mipnerf360"
        # occupancy cascades (instant-ngp's aabb_scale = 2^(cascades - 1)); 0: none
        self.cascades = cfg.aabb_scale.bit_length() if cfg.scene_contraction == "cascades" else 0
        self.cone = cfg.cone_angle if self.cascades else 0.0
        self.encoding = HashGrid(
            levels=cfg.levels,
            features_per_level=cfg.features_per_level,
            log2_hashmap_size=cfg.log2_hashmap_size,
            base_resolution=cfg.base_resolution,
            max_resolution=cfg.max_resolution,
            use_kernels=use_kernels,
            offset=cfg.grid_offset,
        )
        h = cfg.hidden_dim
        self.geo_feat_dim = cfg.geo_feat_dim
        tcnn = cfg.mlp_init == "tcnn"

        def linear(n_in: int, n_out: int) -> nn.Linear:
            layer = nn.Linear(n_in, n_out, bias=not tcnn)
            if tcnn:
                nn.init.xavier_uniform_(layer.weight)
            return layer

        self.density_mlp = nn.Sequential(
            linear(self.encoding.output_dim, h), nn.ReLU(inplace=True), linear(h, 1 + cfg.geo_feat_dim)
        )
        self.color_mlp = nn.Sequential(
            linear(cfg.geo_feat_dim + 16 + cfg.appearance_dim, h),
            nn.ReLU(inplace=True),
            linear(h, h),
            nn.ReLU(inplace=True),
            linear(h, 3),
        )
        # Learned background colour for rays that leave the box unoccluded, unless the images were
        # composited on a known one (fixed_background >= 0, set by the method; saved with the model).
        # A learned one starting at grey lets the field paint a white background into the box as
        # floaters (nerf_synthetic lego: 14 dB test PSNR) before the colour has moved to white.
        self.background = nn.Parameter(torch.zeros(3))
        self.register_buffer("fixed_background", torch.full((3,), -1.0))
        self.half = torch.bfloat16 if cfg.mlp_precision == "bfloat16" else None
        # per-image appearance codes (nerfacto's N(0, 1) initialisation); rows resized on loading a model
        self.appearance = nn.Embedding(max(1, num_images), cfg.appearance_dim) if cfg.appearance_dim else None

    def _mlp(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``net(x)`` in float32, or under bfloat16 autocast (``mlp_precision``) and read back as
        float32 (no autocast weight cache: a CUDA graph replays the casts with the live weights)."""
        if self.half is None:
            return net(x)
        with torch.autocast(x.device.type, dtype=self.half, cache_enabled=False):
            return net(x).float()

    def encoded_box(self) -> torch.Tensor:
        """[2, 3] the box the encoding spans: the scene box, or the cascades' outermost (from the live
        ``aabb``, which a loaded model replaces)."""
        return cascade_box_reference(self.aabb, self.cascades) if self.cascades else self.aabb

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.contract:
            return contract_reference(x, self.aabb)
        box = self.encoded_box()
        return (x - box[0]) / (box[1] - box[0])

    def density(self, x: torch.Tensor, return_feat: bool = False):
        """Density [N] (and geometry features [N, geo_feat_dim]) at world points [N, 3]."""
        xn = self.normalize(x)
        h = self._mlp(self.density_mlp, self.encoding(xn.clamp(0.0, 1.0)))
        sigma = trunc_exp(h[:, 0] - 1.0)
        if not self.contract:
            sigma = sigma * ((xn >= 0) & (xn <= 1)).all(dim=-1)
        return (sigma, h[:, 1:]) if return_feat else sigma

    def forward(self, x: torch.Tensor, d: torch.Tensor | None = None, d_enc: torch.Tensor | None = None,
                app: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Density [N] and colour [N, 3] at points [N, 3] seen along unit directions ``d`` [N, 3]
        (or their encoding ``d_enc`` [N, 16] from :func:`sh_encode_deg4`, e.g. computed once per
        ray and gathered per sample); ``app`` [N, appearance_dim]: the appearance codes (None: the
        mean code, when the field has them)."""
        if d_enc is None:
            d_enc = sh_encode_deg4(d)
        sigma, feat = self.density(x, return_feat=True)
        parts = [feat, d_enc]
        if self.appearance is not None:
            parts.append(self.mean_appearance().expand(len(x), -1) if app is None else app)
        rgb = torch.sigmoid(self._mlp(self.color_mlp, torch.cat(parts, dim=-1)))
        return sigma, rgb

    def mean_appearance(self) -> torch.Tensor:
        """[1, appearance_dim]: the training images' mean code (what views are rendered with)."""
        return self.appearance.weight.mean(dim=0, keepdim=True)

    def background_rgb(self) -> torch.Tensor:
        fixed = self.fixed_background
        return torch.where(fixed >= 0, fixed, torch.sigmoid(self.background))  # no host read: no sync
