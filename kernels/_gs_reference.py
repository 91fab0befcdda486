"""PyTorch twins of the 3D Gaussian Splatting rasterizer kernels (what the CPU runs).

Each function mirrors one op of :mod:`kernels.gaussians` (same signature, ``*_reference`` name) and
the arithmetic of its kernel in ``csrc/gaussians*.cu``: EWA projection, spherical harmonics, tile
intersection, tile offsets, and front-to-back alpha blending. The semantics are gsplat 1.5's
(``rasterization(..., packed=False)``): pixel centres at +0.5, a 0.3-pixel low-pass on the 2D
covariance, per-axis tile boxes from the 2D covariance's diagonal, 64-bit keys
``camera | tile | depth bits`` sorted, alpha skipped below 1/255 and clamped at ALPHA_MAX, and each
pixel stopping before the Gaussian that would bring its transmittance to 1e-4 or below.

Blending (:func:`rasterize_to_pixels_reference`) is vectorised and needs no [pixels x Gaussians]
buffer: every tile's list is first cut down to the 4x4-pixel sub-tiles each Gaussian can reach
(a conservative box around the ellipse where its alpha reaches 1/255), the sub-tiles' lists are
padded into chunks of similar length, and each chunk is blended as one [rows, 16 px, L] batch with
a cumulative product along the list. Its backward recomputes a chunk at a time (an analytic
gradient, the front-to-back form of the reference 3DGS backward); tests compare it with autograd
through a dense formulation and with ``gradcheck``.

Paper: Kerbl, Kopanas, Leimkuehler, Drettakis, "3D Gaussian Splatting for Real-Time Radiance Field
Rendering", SIGGRAPH 2023; EWA splatting: Zwicker et al. 2002.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ALPHA_MIN = 1.0 / 255.0  # a Gaussian whose alpha at a pixel is below this is skipped there
ALPHA_MAX = 0.99  # alpha is clamped here (the 3DGS reference; gsplat 1.5 uses 0.999)
T_MIN = 1e-4  # a pixel stops before the Gaussian that would bring T to this or below
EXTEND = 3.33  # tile box half-size in standard deviations of the 2D covariance's diagonal
SUBTILE = 4  # the blending twin culls each tile list to sub-tiles of SUBTILE x SUBTILE pixels
CHUNK_PAIRS = 1 << 19  # (pixel, list entry) pairs per blended chunk of sub-tiles
SAVED_PAIRS = 1 << 25  # pairs whose (alpha, T) the forward keeps for backward (2 x 128 MiB in float32)

# Real SH basis constants of the 3DGS reference (utils/sh_utils.py), degrees 0..3.
SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792,
         0.5462742152960396)
SH_C3 = (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154,
         -0.4570457994644658, 1.445305721320277, -0.5900435899266435)


class Projection(NamedTuple):
    """Gaussians projected into C cameras (see :func:`kernels.project_gaussians`).

    Culled entries (radius 0) hold zeros in every other field."""

    radii: torch.Tensor  # [C, N] int32 (or [C, N, 2] with radii_per_axis), 0 = culled
    means2d: torch.Tensor  # [C, N, 2] pixel coordinates
    depths: torch.Tensor  # [C, N] camera-space z
    conics: torch.Tensor  # [C, N, 3] (a, b, c) of the inverse 2D covariance [[a, b], [b, c]]
    compensations: torch.Tensor | None  # [C, N] with antialiased=True, else None


# ---------------------------------------------------------------------------- projection


def quat_to_rotmat(quats: torch.Tensor) -> torch.Tensor:
    """[..., 4] quaternions (w, x, y, z; any norm > 0) -> [..., 3, 3] rotation matrices."""
    w, x, y, z = (quats * torch.rsqrt((quats * quats).sum(-1, keepdim=True))).unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], -1).reshape(*quats.shape[:-1], 3, 3)


def project_gaussians_reference(means, quats, scales, viewmats, Ks, width: int, height: int, *,
                                eps2d: float = 0.3, near: float = 0.01, far: float = 1e10,
                                radius_clip: float = 0.0, antialiased: bool = False,
                                opacities=None, radii_per_axis: bool = False) -> Projection:
    """Twin of ``projection_fwd`` (csrc/gaussians_project.cu); see :func:`kernels.project_gaussians`."""
    R, t = viewmats[:, :3, :3], viewmats[:, :3, 3]
    mean_c = torch.einsum("cij,nj->cni", R, means) + t[:, None, :]  # [C, N, 3]
    rot = quat_to_rotmat(quats)
    M = rot * scales[:, None, :]
    cov = M @ M.transpose(-1, -2)  # [N, 3, 3]
    cov_c = R[:, None] @ cov[None] @ R[:, None].transpose(-1, -2)  # [C, N, 3, 3]
    x, y, z = mean_c.unbind(-1)
    in_depth = (z >= near) & (z <= far)
    z = torch.where(in_depth, z, torch.ones_like(z))  # culled: any finite depth, no NaN gradients
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    # Jacobian at the mean, clamped to 1.3x the field of view (3DGS / gsplat), not the mean itself
    lim_xp = (width - cx) / fx + 0.3 * (0.5 * width / fx)
    lim_xn = cx / fx + 0.3 * (0.5 * width / fx)
    lim_yp = (height - cy) / fy + 0.3 * (0.5 * height / fy)
    lim_yn = cy / fy + 0.3 * (0.5 * height / fy)
    rz = 1.0 / z
    tx = z * torch.minimum(lim_xp, torch.maximum(-lim_xn, x * rz))
    ty = z * torch.minimum(lim_yp, torch.maximum(-lim_yn, y * rz))
    zero = torch.zeros_like(z)
    J = torch.stack([fx * rz, zero, -fx * tx * rz * rz,
                     zero, fy * rz, -fy * ty * rz * rz], -1).reshape(*z.shape, 2, 3)
    cov2d = J @ cov_c @ J.transpose(-1, -2)  # [C, N, 2, 2]
    a, b, c = cov2d[..., 0, 0], cov2d[..., 0, 1], cov2d[..., 1, 1]
    det_orig = a * c - b * b
    a, c = a + eps2d, c + eps2d
    det = a * c - b * b
    ok = in_depth & (det > 0)
    det = torch.where(ok, det, torch.ones_like(det))
    comp = torch.sqrt(torch.clamp(det_orig / det, min=0.0)) if antialiased else None
    conics = torch.stack([c / det, -b / det, a / det], -1)
    means2d = torch.stack([fx * x * rz + cx, fy * y * rz + cy], -1)
    with torch.no_grad():
        extend = torch.full_like(z, EXTEND)
        if opacities is not None:
            op = opacities[None].expand_as(z) * (comp if comp is not None else 1.0)
            ok = ok & (op >= ALPHA_MIN)
            # opacity-aware box (gsplat 1.5): beyond it alpha < 1/255 (arXiv 2402.00525, B.2)
            extend = torch.minimum(extend, torch.sqrt(2.0 * torch.log(op.clamp_min(ALPHA_MIN) / ALPHA_MIN)))
        rx = torch.ceil(extend * torch.sqrt(a.clamp_min(0.0)))
        ry = torch.ceil(extend * torch.sqrt(c.clamp_min(0.0)))
        ok = ok & ((rx > radius_clip) | (ry > radius_clip))
        mx, my = means2d[..., 0], means2d[..., 1]
        ok = ok & (mx + rx > 0) & (mx - rx < width) & (my + ry > 0) & (my - ry < height)
        radii = torch.stack([rx, ry], -1) if radii_per_axis else torch.maximum(rx, ry)
        radii = torch.where(ok[..., None] if radii_per_axis else ok, radii, 0.0).to(torch.int32)
    keep = ok.to(means2d.dtype)
    return Projection(radii, means2d * keep[..., None], mean_c[..., 2] * keep,
                      conics * keep[..., None], None if comp is None else comp * keep)


# ---------------------------------------------------------------------------- spherical harmonics


def sh_basis(degree: int, dirs: torch.Tensor) -> torch.Tensor:
    """[..., 3] directions (normalised here) -> [..., (degree + 1)^2] real SH basis of the 3DGS reference."""
    out = [torch.full_like(dirs[..., 0], SH_C0)]
    if degree >= 1:
        d = dirs * torch.rsqrt((dirs * dirs).sum(-1, keepdim=True).clamp_min(1e-30))
        x, y, z = d.unbind(-1)
        out += [-SH_C1 * y, SH_C1 * z, -SH_C1 * x]
        if degree >= 2:
            xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
            out += [SH_C2[0] * xy, SH_C2[1] * yz, SH_C2[2] * (2 * zz - xx - yy), SH_C2[3] * xz,
                    SH_C2[4] * (xx - yy)]
            if degree >= 3:
                out += [SH_C3[0] * y * (3 * xx - yy), SH_C3[1] * xy * z,
                        SH_C3[2] * y * (4 * zz - xx - yy), SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy),
                        SH_C3[4] * x * (4 * zz - xx - yy), SH_C3[5] * z * (xx - yy),
                        SH_C3[6] * x * (xx - 3 * yy)]
    return torch.stack(out, -1)


def spherical_harmonics_reference(degree: int, dirs: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """Twin of ``sh_fwd`` / ``sh_bwd`` (csrc/gaussians_project.cu); see :func:`kernels.spherical_harmonics`."""
    nb = (degree + 1) ** 2
    return (sh_basis(degree, dirs)[..., None] * coeffs[..., :nb, :]).sum(-2)


# ---------------------------------------------------------------------------- tile intersection


def key_bits(n_cameras: int, n_tiles: int) -> tuple[int, int]:
    """(camera bits, tile bits) of the 64-bit intersection keys (gsplat: floor(log2 n) + 1)."""
    return max(int(n_cameras), 1).bit_length(), max(int(n_tiles), 1).bit_length()


def tile_ranges(means2d: torch.Tensor, radii: torch.Tensor, tile_size: int, tile_width: int,
                tile_height: int) -> tuple[torch.Tensor, ...]:
    """Per Gaussian: the tile box [x0, x1) x [y0, y1) (int64) its radii cover; empty when culled."""
    if radii.ndim == means2d.ndim:  # [C, N, 2]: per axis
        rx, ry = radii[..., 0], radii[..., 1]
        visible = (rx > 0) & (ry > 0)
    else:
        rx = ry = radii
        visible = radii > 0
    ts = float(tile_size)
    rx, ry = rx.to(torch.float32) / ts, ry.to(torch.float32) / ts
    cx, cy = means2d[..., 0].to(torch.float32) / ts, means2d[..., 1].to(torch.float32) / ts
    x0 = torch.floor(cx - rx).clamp(0, tile_width).long()
    x1 = torch.ceil(cx + rx).clamp(0, tile_width).long()
    y0 = torch.floor(cy - ry).clamp(0, tile_height).long()
    y1 = torch.ceil(cy + ry).clamp(0, tile_height).long()
    zero = torch.zeros_like(x0)
    x1, y1 = torch.where(visible, x1, zero), torch.where(visible, y1, zero)
    x0, y0 = torch.where(visible, x0, zero), torch.where(visible, y0, zero)
    return x0, x1, y0, y1


def intersect_tiles_reference(means2d, radii, depths, tile_size: int, tile_width: int, tile_height: int):
    """Twin of ``tile_counts``, ``tile_emit``, the sort and ``tile_finish`` (csrc/gaussians_tiles.cu, without
    the rasterizer's exact culling); see :func:`kernels.intersect_tiles`."""
    C, N = depths.shape
    means2d, depths = means2d.detach(), depths.detach()
    x0, x1, y0, y1 = tile_ranges(means2d, radii, tile_size, tile_width, tile_height)
    w = x1 - x0
    counts = (w * (y1 - y0)).reshape(-1)
    cam_bits, tile_bits = key_bits(C, tile_width * tile_height)
    gauss = torch.repeat_interleave(torch.arange(C * N, device=depths.device), counts)
    k = torch.arange(gauss.numel(), device=depths.device) - (torch.cumsum(counts, 0) - counts)[gauss]
    wg = w.reshape(-1)[gauss]
    tile = (y0.reshape(-1)[gauss] + k // wg.clamp_min(1)) * tile_width + x0.reshape(-1)[gauss] + k % wg.clamp_min(1)
    depth_bits = depths.to(torch.float32).reshape(-1).view(torch.int32).long() & 0xFFFFFFFF
    keys = ((gauss // N) << (32 + tile_bits)) | (tile << 32) | depth_bits[gauss]
    keys, order = torch.sort(keys, stable=True)
    return counts.reshape(C, N).to(torch.int32), keys, gauss[order].to(torch.int32)


def isect_offset_encode_reference(isect_ids, n_cameras: int, tile_width: int, tile_height: int):
    """Twin of ``tile_offsets`` (csrc/gaussians_tiles.cu); see :func:`kernels.isect_offset_encode`."""
    n_tiles = tile_width * tile_height
    _, tile_bits = key_bits(n_cameras, n_tiles)
    hi = isect_ids >> 32
    flat = (hi >> tile_bits) * n_tiles + (hi & ((1 << tile_bits) - 1))
    targets = torch.arange(n_cameras * n_tiles, device=isect_ids.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat, targets)
    return offsets.to(torch.int32).reshape(n_cameras, tile_height, tile_width)


# ---------------------------------------------------------------------------- blending


class _Plan(NamedTuple):
    """Padded per-sub-tile lists: sorted-row r holds slots[row_slot[r] : + L of its chunk]."""

    chunks: list[tuple[int, int, int, int]]  # (first row, rows, L, first slot)
    slots: torch.Tensor  # [total slots] int64 Gaussian index in [0, C*N]; C*N = padding
    pix: torch.Tensor  # [rows, S*S] int64 pixel index in [0, C*H*W]; C*H*W = outside the image
    centres: torch.Tensor  # [rows, 2] the sub-tile's centre in pixels
    features: torch.Tensor  # [S*S, 6] per pixel (1, lx, ly, lx^2, lx ly, ly^2), l = pixel centre - sub-tile centre


def _subtile(tile_size: int) -> int:
    return next(s for s in (SUBTILE, 2, 1) if tile_size % s == 0)


def _alpha_boxes(means2d, conics, opacities):
    """Per Gaussian, half-extents (hx, hy) of a box outside which alpha < ALPHA_MIN at every pixel
    (inf: no bound known, e.g. an indefinite conic; negative: no pixel at all)."""
    a, b, c = conics[..., 0], conics[..., 1], conics[..., 2]
    det = a * c - b * b
    k2 = 2.0 * torch.log(opacities.clamp_min(1e-30) / ALPHA_MIN)
    pd = (a > 0) & (det > 0) & torch.isfinite(det) & torch.isfinite(means2d).all(-1)
    det = torch.where(pd, det, torch.ones_like(det))
    # sigma = d^T Q d / 2 <= ln(255 o) bounds |dx| by sqrt(k2 * (Q^-1)_xx); 0.1 % + 0.01 px slack
    hx = torch.sqrt(k2.clamp_min(0) * c.clamp_min(0) / det) * 1.001 + 0.01
    hy = torch.sqrt(k2.clamp_min(0) * a.clamp_min(0) / det) * 1.001 + 0.01
    inf = torch.full_like(hx, math.inf)
    hx, hy = torch.where(pd, hx, inf), torch.where(pd, hy, inf)
    none = ~(opacities >= ALPHA_MIN)  # alpha <= opacity: never reaches the threshold
    return torch.where(none, -1.0, hx), torch.where(none, -1.0, hy)


@torch.no_grad()
def _plan(means2d, conics, opacities, width, height, tile_size, isect_offsets, flatten_ids) -> _Plan:
    """Cut every tile's list to the sub-tiles its Gaussians can reach; pad them into chunks."""
    dev = means2d.device
    C, th, tw = isect_offsets.shape
    CN = means2d.shape[0] * means2d.shape[1]
    S = _subtile(tile_size)
    ns = tile_size // S  # sub-tiles per tile side
    nsub = ns * ns
    n_tiles = C * th * tw
    M = flatten_ids.numel()
    starts = isect_offsets.reshape(-1).long()
    ends = torch.cat([starts[1:], starts.new_tensor([M])])
    tile_of = torch.repeat_interleave(torch.arange(n_tiles, device=dev), ends - starts)  # [M]
    g = flatten_ids.long()
    hx, hy = _alpha_boxes(means2d.reshape(CN, 2).float(), conics.reshape(CN, 3).float(),
                          opacities.reshape(CN).float())
    mx, my = means2d.reshape(CN, 2).float().index_select(0, g).unbind(-1)
    hx, hy = hx.index_select(0, g), hy.index_select(0, g)
    local = tile_of % (th * tw)
    sub = torch.arange(ns, device=dev)[:, None]

    def cover(m, h, origin, size):  # [ns, M]: sub-tiles holding a pixel centre in m +- h
        last = (size - origin).clamp(max=tile_size) - 1  # last pixel of the tile inside the image
        full = torch.isinf(h)
        lo = torch.where(full, 0.0, torch.ceil(m - h - 0.5) - origin).clamp(min=0)
        hi = torch.minimum(torch.where(full, float(tile_size), torch.floor(m + h - 0.5) - origin), last.float())
        empty = (h < 0) | (lo > hi) | torch.isnan(m)
        return (sub >= lo.long() // S) & (sub <= hi.clamp(min=0).long() // S) & ~empty

    inx = cover(mx, hx, (local % tw) * tile_size, width)
    iny = cover(my, hy, (local // tw) * tile_size, height)
    overlap = (iny[:, None, :] & inx[None, :, :]).reshape(nsub, M)  # sub-tile s = sy * ns + sx
    cs = torch.zeros(nsub, M + 1, dtype=torch.int32, device=dev)  # cs[s, e]: overlaps before e
    torch.cumsum(overlap, 1, dtype=torch.int32, out=cs[:, 1:])
    base = cs.index_select(1, starts)  # [nsub, n_tiles]
    lengths = (cs.index_select(1, ends) - base).t().reshape(-1)  # sub-tile id = tile * nsub + s
    s, e = overlap.nonzero(as_tuple=True)
    te = tile_of.index_select(0, e)
    pos = (cs.view(-1).index_select(0, s * (M + 1) + e) - base.view(-1).index_select(0, s * n_tiles + te)).long()
    order = torch.argsort(lengths, descending=True, stable=True)
    n_rows = int((lengths > 0).sum())
    P = S * S
    chunks, row_slot = [], torch.empty(n_rows, dtype=torch.int64, device=dev)
    lens = lengths.index_select(0, order[:n_rows]).tolist()
    r = slot = 0
    while r < n_rows:
        L = lens[r]
        k = min(max(1, CHUNK_PAIRS // (P * L)), n_rows - r)
        chunks.append((r, k, L, slot))
        row_slot[r:r + k] = slot + L * torch.arange(k, device=dev)
        r, slot = r + k, slot + k * L
    rows = order[:n_rows]
    slot_of = torch.zeros(lengths.numel(), dtype=torch.int64, device=dev)
    slot_of[rows] = row_slot
    slots = torch.full((slot,), CN, dtype=torch.int64, device=dev)
    slots[slot_of.index_select(0, te * nsub + s) + pos] = g.index_select(0, e)
    # pixels of every non-empty sub-tile, in sorted-row order
    tile, s = rows // nsub, rows % nsub
    cam, local = tile // (th * tw), tile % (th * tw)
    px0 = (local % tw) * tile_size + (s % ns) * S
    py0 = (local // tw) * tile_size + (s // ns) * S
    ar = torch.arange(S, device=dev)
    xs = (px0[:, None, None] + ar[None, None, :]).expand(-1, S, S).reshape(n_rows, P)
    ys = (py0[:, None, None] + ar[None, :, None]).expand(-1, S, S).reshape(n_rows, P)
    inside = (xs < width) & (ys < height)
    pix = torch.where(inside, (cam[:, None] * height + ys) * width + xs, C * height * width)
    centres = torch.stack([px0, py0], -1).to(means2d.dtype) + S / 2
    lx = (ar.to(means2d.dtype) + 0.5 - S / 2).repeat(S)  # [P]: x of the pixel centres, row-major
    ly = (ar.to(means2d.dtype) + 0.5 - S / 2).repeat_interleave(S)
    features = torch.stack([torch.ones_like(lx), lx, ly, lx * lx, lx * ly, ly * ly], -1)
    return _Plan(chunks, slots, pix, centres, features)


class _Entries(NamedTuple):
    """The list entries of one chunk of k sub-tiles x L entries (rows of a [k, L] padded list)."""

    ids: torch.Tensor  # [k, L] Gaussian index (C*N = padding)
    mx: torch.Tensor  # [k, L] mean - sub-tile centre
    my: torch.Tensor
    conic: torch.Tensor  # [k, L, 3]
    opac: torch.Tensor  # [k, L]
    color: torch.Tensor  # [k, L, D]


def _entries(plan: _Plan, chunk, mean_p, conic_p, color_p, opac_p) -> _Entries:
    r0, k, L, s0 = chunk
    flat = plan.slots[s0:s0 + k * L]
    m = mean_p.index_select(0, flat).view(k, L, 2) - plan.centres[r0:r0 + k, None, :]
    return _Entries(flat.view(k, L), m[..., 0], m[..., 1], conic_p.index_select(0, flat).view(k, L, 3),
                    opac_p.index_select(0, flat).view(k, L), color_p.index_select(0, flat).view(k, L, -1))


def _below(x: torch.Tensor, limit: float) -> torch.Tensor:
    """1.0 where x > limit, else 0.0 (float arithmetic: bool masks are ~10x slower on the CPU)."""
    return torch.threshold(x, limit, limit).sub_(limit).sign_()


def _blend(plan: _Plan, e: _Entries, alpha_max: float = ALPHA_MAX):
    """Forward of one chunk: (alpha, T before each entry, T after the last blended one).

    alpha [k, P, L] is 0 where an entry is skipped (sigma < 0, alpha < 1/255) or past the pixel's
    stop. sigma is a quadratic in the pixel offset l from the sub-tile centre, so all k x P x L of
    them are one batched matmul of the pixels' (1, lx, ly, lx^2, lx ly, ly^2) with per-entry
    coefficients (d = m - l, m = mean - centre)."""
    mx, my, (a, b, c) = e.mx, e.my, e.conic.unbind(-1)
    coef = torch.stack([0.5 * a * mx * mx + b * mx * my + 0.5 * c * my * my, -(a * mx + b * my),
                        -(b * mx + c * my), 0.5 * a, b, 0.5 * c], 1)  # [k, 6, L]
    neg_sigma = torch.matmul(plan.features, coef.neg_())  # [k, P, L]
    indefinite = (a < 0) | (c < 0) | (a * c < b * b)  # sigma < 0 is possible (not from a projection)
    skip = (neg_sigma > 0) & indefinite[:, None, :] if bool(indefinite.any()) else None
    # a semi-definite conic's sigma >= 0: clamping only undoes the expansion's rounding
    alpha = neg_sigma.clamp_(max=0.0).exp_().mul_(e.opac[:, None, :]).clamp_(max=alpha_max)
    torch.threshold_(alpha, _just_below(ALPHA_MIN, alpha.dtype), 0.0)  # alpha < 1/255: skipped
    if skip is not None:
        alpha.masked_fill_(skip, 0.0)
    k, P, L = alpha.shape
    trans = torch.empty(k, P, L + 1, dtype=alpha.dtype, device=alpha.device)
    trans[..., 0] = 1.0
    torch.sub(1.0, alpha, out=trans[..., 1:])
    trans = torch.cumprod(trans, -1)  # trans[..., i]: T before entry i
    going = _below(trans[..., 1:], T_MIN)  # 1 on a prefix of each pixel's list (T never grows)
    alpha.mul_(going)
    t_final = trans.gather(-1, going.sum(-1, keepdim=True).long()).squeeze(-1)  # [k, P]
    return alpha, trans[..., :-1], t_final


def _just_below(x: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` below ``x`` (so that ``> it`` means ``>= x`` in ``dtype``)."""
    t = torch.tensor(x, dtype=dtype)
    return torch.nextafter(t, torch.zeros_like(t)).item()


class _RasterizeReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, plan, shape, absgrad, alpha_max):
        C, H, W, D = shape
        pads = _padded(means2d, conics, colors, opacities)
        out = torch.zeros(C * H * W + 1, D, dtype=colors.dtype, device=colors.device)
        if backgrounds is not None:
            out[:-1] = backgrounds[:, None, :].expand(C, H * W, D).reshape(-1, D)
        t_map = torch.ones(C * H * W + 1, dtype=colors.dtype, device=colors.device)
        kept, budget = [], SAVED_PAIRS
        for chunk in plan.chunks:
            e = _entries(plan, chunk, *pads)
            alpha, t_prev, t_final = _blend(plan, e, alpha_max)
            rgb = torch.bmm(alpha * t_prev, e.color)  # [k, P, D]
            pix = plan.pix[chunk[0]:chunk[0] + chunk[1]].reshape(-1)
            if backgrounds is not None:
                rgb += t_final[..., None] * backgrounds[(pix // (H * W)).clamp(max=C - 1)].view(rgb.shape)
            out.index_copy_(0, pix, rgb.reshape(-1, D))
            t_map.index_copy_(0, pix, t_final.reshape(-1))
            budget -= alpha.numel()
            kept.append((alpha, t_prev, t_final) if budget >= 0 else None)
        t_map = t_map[:-1]
        ctx.save_for_backward(means2d, conics, colors, opacities, backgrounds, t_map)
        ctx.plan, ctx.shape, ctx.absgrad, ctx.kept, ctx.alpha_max = plan, shape, absgrad, kept, alpha_max
        ctx.means2d_obj = means2d if absgrad else None
        return out[:-1].view(C, H, W, D), (1.0 - t_map).view(C, H, W, 1)

    @staticmethod
    def backward(ctx, g_colors, g_alphas):
        means2d, conics, colors, opacities, backgrounds, t_map = ctx.saved_tensors
        plan, (C, H, W, D) = ctx.plan, ctx.shape
        CN = means2d.shape[0] * means2d.shape[1]
        dt, dev = colors.dtype, colors.device
        gC = torch.zeros(C * H * W + 1, D, dtype=dt, device=dev)  # last row: pixels outside the image
        gA = torch.zeros(C * H * W + 1, dtype=dt, device=dev)
        if g_colors is not None:
            gC[:-1] = g_colors.reshape(-1, D)
        if g_alphas is not None:
            gA[:-1] = g_alphas.reshape(-1)
        # dL/dT_final per pixel: background . dL/dcolour - dL/dalpha
        g_t = gA.neg()
        if backgrounds is not None:
            g_t[:-1] += (gC[:-1].view(C, H * W, D) * backgrounds[:, None, :]).sum(-1).reshape(-1)
        grads = [torch.zeros(CN + 1, n, dtype=dt, device=dev) for n in (2, 3, D, 1, 2 if ctx.absgrad else 0)]
        pads = _padded(means2d, conics, colors, opacities)
        # the forward's (alpha, T) are dropped after a first backward: a second one (retain_graph) recomputes
        for chunk, kept in zip(plan.chunks, ctx.kept or [None] * len(plan.chunks)):
            e = _entries(plan, chunk, *pads)
            alpha, t_prev, t_final = kept if kept is not None else _blend(plan, e, ctx.alpha_max)
            _blend_backward(plan, e, alpha, t_prev, t_final, plan.pix[chunk[0]:chunk[0] + chunk[1]], gC, g_t,
                            grads, ctx.alpha_max)
        ctx.kept = None
        v_mean, v_conic, v_color, v_opac, v_abs = (g[:CN] for g in grads)
        v_bg = None
        if backgrounds is not None and ctx.needs_input_grad[4]:
            v_bg = (gC[:-1] * t_map[:, None]).view(C, H * W, D).sum(1)
        if ctx.absgrad:
            ctx.means2d_obj.absgrad = v_abs.view(means2d.shape)
        return (v_mean.view(means2d.shape), v_conic.view(conics.shape), v_color.view(colors.shape),
                v_opac.view(opacities.shape), v_bg, None, None, None, None)


def _blend_backward(plan: _Plan, e: _Entries, alpha, t_prev, t_final, pix, gC, g_t, grads,
                    alpha_max: float = ALPHA_MAX) -> None:
    """Accumulate one chunk's gradients into grads = [v_mean, v_conic, v_color, v_opac, v_abs]."""
    g_pix = gC.index_select(0, pix.reshape(-1)).view(*pix.shape, -1)  # [k, P, D]
    ids = e.ids.reshape(-1)
    weight = alpha * t_prev
    grads[2].index_add_(0, ids, torch.bmm(weight.transpose(1, 2), g_pix).reshape(-1, g_pix.shape[-1]))
    cg = torch.bmm(g_pix, e.color.transpose(1, 2))  # [k, P, L]: colour . dL/dpixel
    q = weight.mul_(cg)
    behind = q.sum(-1, keepdim=True) - torch.cumsum(q, -1)  # over the later entries
    behind += (t_final * g_t.index_select(0, pix.reshape(-1)).view(pix.shape))[..., None]
    # dL/dalpha_i = T_i (c_i . g) - (sum_{j > i} w_j c_j . g + T_final dL/dT_final) / (1 - alpha_i);
    # through alpha = o exp(-sigma) where blended and not clamped (else alpha is constant):
    # dL/dsigma = -alpha dL/dalpha, dL/do = alpha / o dL/dalpha.
    u = cg.mul_(t_prev).sub_(behind.div_(1.0 - alpha)).mul_(alpha).mul_(_below(alpha_max - alpha, 0.0))
    mom = torch.matmul(plan.features.transpose(0, 1), u)  # [k, 6, L]: moments of u over the pixels
    u0, u1, u2, u3, u4, u5 = mom.unbind(1)
    mx, my, op = e.mx, e.my, e.opac
    s_dx, s_dy = mx * u0 - u1, my * u0 - u2  # sum u dx, sum u dy (d = m - l)
    s_xx = mx * mx * u0 - 2 * mx * u1 + u3
    s_xy = mx * my * u0 - mx * u2 - my * u1 + u4
    s_yy = my * my * u0 - 2 * my * u2 + u5
    a, b, c = e.conic.unbind(-1)
    grads[3].index_add_(0, ids, torch.where(op > 0, u0 / op, 0.0).reshape(-1, 1))
    grads[1].index_add_(0, ids, torch.stack([-0.5 * s_xx, -s_xy, -0.5 * s_yy], -1).reshape(-1, 3))
    grads[0].index_add_(0, ids, torch.stack([-(a * s_dx + b * s_dy), -(b * s_dx + c * s_dy)], -1).reshape(-1, 2))
    if grads[4].shape[1]:  # sum over pixels of |dL/dmean| needs the per-pixel terms
        dx = mx[:, None, :] - plan.features[:, 1, None]  # [k, P, L]
        dy = my[:, None, :] - plan.features[:, 2, None]
        gx = (u * (a[:, None] * dx + b[:, None] * dy)).abs_().sum(1)
        gy = (u * (b[:, None] * dx + c[:, None] * dy)).abs_().sum(1)
        grads[4].index_add_(0, ids, torch.stack([gx, gy], -1).reshape(-1, 2))

def _padded(means2d, conics, colors, opacities):
    """Flattened [C*N + 1, ...] copies whose last row (the padding slot) never contributes."""
    def pad(t, width):
        flat = t.reshape(-1, width) if width else t.reshape(-1)
        return torch.cat([flat, flat.new_zeros((1, width) if width else (1,))])

    return pad(means2d, 2), pad(conics, 3), pad(colors, colors.shape[-1]), pad(opacities, 0)


def rasterize_to_pixels_reference(means2d, conics, colors, opacities, width: int, height: int,
                                  tile_size: int, isect_offsets, flatten_ids, backgrounds=None,
                                  absgrad: bool = False, alpha_max: float = ALPHA_MAX):
    """Twin of ``rasterize_fwd`` / ``rasterize_bwd`` (csrc/gaussians_raster.cu); see
    :func:`kernels.rasterize_to_pixels`."""
    C = isect_offsets.shape[0]
    plan = _plan(means2d.detach(), conics.detach(), opacities.detach(), width, height, tile_size,
                 isect_offsets, flatten_ids)
    return _RasterizeReference.apply(means2d, conics, colors, opacities, backgrounds, plan,
                                     (C, height, width, colors.shape[-1]), absgrad, float(alpha_max))
