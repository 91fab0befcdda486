"""3D Gaussian Splatting rasterizer ops: projection, SH colours, tile binning, alpha blending.

The public functions check their inputs (shapes, dtypes, devices, contiguity, finiteness, image
size, the intersection budget) and raise ValueError naming the argument, then run the CUDA kernels
(``csrc/gaussians*.cu``, through :mod:`kernels._gs_cuda`) on CUDA tensors where
:func:`kernels.available`, else the PyTorch twins of :mod:`kernels._gs_reference`. Shapes and
semantics follow gsplat 1.5 (``gsplat.rasterization(..., packed=False)``), so the same tensors go
into either: OpenCV cameras (``viewmats`` world-to-camera [C, 4, 4], pinhole ``Ks`` [C, 3, 3]),
pixel centres at +0.5, float32 everywhere.

Example:
    >>> import torch, kernels
    >>> means = torch.tensor([[0.0, 0.0, 2.0]]); quats = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    >>> scales = torch.full((1, 3), 0.05); opac = torch.tensor([0.9]); rgb = torch.tensor([[1.0, 0.5, 0.0]])
    >>> K = torch.tensor([[[40.0, 0, 16], [0, 40.0, 16], [0, 0, 1]]])
    >>> img, alpha, meta = kernels.rasterization(means, quats, scales, opac, rgb, torch.eye(4)[None], K, 32, 32)
    >>> img.shape, meta["radii"].tolist(), round(alpha[0, 16, 16, 0].item(), 3)
    (torch.Size([1, 32, 32, 3]), [[4]], 0.743)
"""

from __future__ import annotations

import math

import torch

from . import _driver
from ._gs_reference import (ALPHA_MAX, ALPHA_MIN, Projection, intersect_tiles_reference,
                            isect_offset_encode_reference, key_bits, project_gaussians_reference,
                            rasterize_to_pixels_reference, spherical_harmonics_reference, tile_ranges)

MAX_INTERSECTIONS = 2**31 - 1  # flatten_ids and isect_offsets are int32
TILE_SIZES = (8, 16, 32)
RENDER_MODES = ("RGB", "D", "ED", "RGB+D", "RGB+ED")

__all__ = ["Projection", "intersect_tiles", "isect_offset_encode", "project_gaussians", "rasterization",
           "rasterize_to_pixels", "spherical_harmonics"]


# ---------------------------------------------------------------------------- input checks


def _check(name: str, t, shape: tuple, sizes: dict, dtype=torch.float32, device=None) -> None:
    """``t`` is a contiguous ``dtype`` tensor of ``shape`` on ``device``. A str in ``shape`` is a
    size bound by its first use in ``sizes`` and checked against it afterwards."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = "[" + ", ".join(str(s) for s in shape) + "]"
    if t.ndim != len(shape):
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    for size, spec in zip(t.shape, shape):
        if isinstance(spec, str):
            spec = sizes.setdefault(spec, size)
        if size != spec:
            bound = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(f"{name} must have shape {want} ({bound}), got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} with the other inputs, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def _check_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_image(width, height) -> None:
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (image size), got {value!r}")


def _check_tile_size(tile_size) -> None:
    if isinstance(tile_size, bool) or tile_size not in TILE_SIZES:
        raise ValueError(f"tile_size must be one of {TILE_SIZES}, got {tile_size!r}")


# The value checks of the Gaussians and cameras: a bit each (the CUDA path computes them in one
# kernel, csrc/gaussians_project.cu check_inputs), the first failing one is raised.
VALUE_CHECKS = (
    (1, "means must be finite (found NaN or inf)"),
    (2, "scales must be finite (found NaN or inf)"),
    (4, "quats must be finite (found NaN or inf)"),
    (8, "quats must be non-zero: found a quaternion of norm 0 (or one whose squared norm under- or "
        "overflows float32)"),
    (16, "viewmats must be finite"),
    (32, "Ks must be finite with fx, fy > 0"),
)


def _check_values(means, quats, scales, viewmats, Ks) -> None:
    """Raise the first failing VALUE_CHECKS entry (one host read)."""
    if _use_cuda(means.device):
        bits = _cuda().check_inputs(means, quats, scales, viewmats, Ks)
    else:
        norm2 = (quats * quats).sum(-1)
        failed = torch.stack([~torch.isfinite(means).all(), ~torch.isfinite(scales).all(),
                              ~torch.isfinite(quats).all(), ~((norm2 > 0) & torch.isfinite(norm2)).all(),
                              ~torch.isfinite(viewmats).all(),
                              ~(torch.isfinite(Ks).all() & (Ks[:, 0, 0] > 0).all() & (Ks[:, 1, 1] > 0).all())])
        bits = sum(bit for (bit, _), bad in zip(VALUE_CHECKS, failed.tolist()) if bad)
    for bit, message in VALUE_CHECKS:
        if bits & bit:
            raise ValueError(message)


def _raise_flags(flags: list[tuple[str, torch.Tensor]]) -> None:
    """One host read for several on-device conditions; raise for the first that holds."""
    if not flags:
        return
    values = torch.stack([f for _, f in flags]).tolist()
    for (message, _), bad in zip(flags, values):
        if bad:
            raise ValueError(message)


def _check_gaussians(means, quats, scales, sizes: dict) -> None:
    _check("means", means, ("N", 3), sizes)
    dev = means.device
    _check("quats", quats, ("N", 4), sizes, device=dev)
    _check("scales", scales, ("N", 3), sizes, device=dev)


def _check_cameras(viewmats, Ks, width, height, sizes: dict, device) -> None:
    _check("viewmats", viewmats, ("C", 4, 4), sizes, device=device)
    _check("Ks", Ks, ("C", 3, 3), sizes, device=device)
    _check_image(width, height)
    if sizes["C"] < 1:
        raise ValueError("viewmats must hold at least one camera, got C=0")


def _check_planes(eps2d, near, far, radius_clip) -> None:
    for name, value in (("eps2d", eps2d), ("radius_clip", radius_clip)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not (isinstance(near, (int, float)) and isinstance(far, (int, float)) and 0 < near < far):
        raise ValueError(f"near and far must satisfy 0 < near < far, got near={near!r}, far={far!r}")


def _check_alpha_max(alpha_max) -> float:
    if not (isinstance(alpha_max, (int, float)) and not isinstance(alpha_max, bool)
            and ALPHA_MIN < alpha_max < 1.0):
        raise ValueError(f"alpha_max must be a number in (1/255, 1) (alpha is clamped there; 1 would let a "
                         f"pixel's transmittance reach 0), got {alpha_max!r}")
    return float(alpha_max)


def _use_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and _driver.available()


def _cuda():
    from . import _gs_cuda  # the kernels' autograd Functions; imported when a CUDA tensor comes

    return _gs_cuda


# ---------------------------------------------------------------------------- ops


def project_gaussians(means, quats, scales, viewmats, Ks, width: int, height: int, *, eps2d: float = 0.3,
                      near: float = 0.01, far: float = 1e10, radius_clip: float = 0.0,
                      antialiased: bool = False, opacities=None, radii_per_axis: bool = False,
                      validate: bool = True) -> Projection:
    """EWA projection of 3D Gaussians into C pinhole cameras (gsplat ``fully_fused_projection``).

    ``Sigma = R S S^T R^T`` (R from the normalised quaternion), ``Sigma_2d = J W Sigma W^T J^T + eps2d I``
    with the perspective Jacobian J at the mean (its x/z, y/z clamped to 1.3x the field of view).
    A Gaussian is culled (radius 0) when its depth is outside [near, far], ``det Sigma_2d <= 0``, its
    tile box lies off the image, both box half-sizes are <= radius_clip, or (with ``opacities``) its
    opacity (times the compensation when antialiased) is below 1/255. The box half-size per axis is
    ``ceil(e * sqrt(Sigma_2d[i, i]))`` with e = 3.33, or with ``opacities`` the smaller
    ``sqrt(2 ln(255 opacity))`` beyond which alpha stays below 1/255 (gsplat 1.5).

    Args:
        means: [N, 3]; quats: [N, 4] (w, x, y, z), normalised inside; scales: [N, 3] (linear).
        viewmats: [C, 4, 4] world-to-camera; Ks: [C, 3, 3]; width, height: image size (>= 1).
        eps2d: low-pass added to the 2D covariance's diagonal (pixels^2).
        near, far: depth range kept; radius_clip: cull boxes no bigger than this (pixels).
        antialiased: also return ``compensations = sqrt(det(Sigma_2d - eps2d I) / det(Sigma_2d))``
            (Mip-Splatting's opacity factor).
        opacities: optional [N]: the opacity-aware box and cull above.
        radii_per_axis: radii [C, N, 2] (x, y half-sizes, gsplat 1.5's layout) instead of their
            maximum [C, N].
        validate: check the values (finite, non-zero quaternions, cameras) as :func:`rasterization`
            does; that check reads back to the host, so a training loop that guards its own steps
            passes False. Shapes, dtypes and devices are checked either way.

    Returns:
        :class:`Projection`; differentiable in means, quats, scales.
    """
    sizes: dict = {}
    _check_gaussians(means, quats, scales, sizes)
    _check_cameras(viewmats, Ks, width, height, sizes, means.device)
    _check_planes(eps2d, near, far, radius_clip)
    if opacities is not None:
        _check("opacities", opacities, ("N",), sizes, device=means.device)
    if validate:
        _check_values(means, quats, scales, viewmats, Ks)
    return _project(means, quats, scales, viewmats, Ks, width, height, eps2d, near, far, radius_clip,
                    antialiased, opacities, radii_per_axis)


def _project(means, quats, scales, viewmats, Ks, width, height, eps2d, near, far, radius_clip,
             antialiased, opacities, radii_per_axis) -> Projection:
    if _use_cuda(means.device):
        return _cuda().project(means, quats, scales, viewmats, Ks, width, height, eps2d, near, far,
                               radius_clip, antialiased, opacities, radii_per_axis)
    return project_gaussians_reference(means, quats, scales, viewmats, Ks, width, height, eps2d=eps2d,
                                       near=near, far=far, radius_clip=radius_clip,
                                       antialiased=antialiased, opacities=opacities,
                                       radii_per_axis=radii_per_axis)


def spherical_harmonics(degree: int, dirs, coeffs):
    """View-dependent colour from real spherical harmonics of degree 0..3 (3DGS reference basis).

    Args:
        degree: 0..3; the first ``(degree + 1)^2`` of the K coefficients are used.
        dirs: [..., 3] view directions (normalised inside; any length > 0).
        coeffs: [..., K, 3], K >= (degree + 1)^2; or a 3DGS model's pair (sh0 [..., 1, 3],
            shN [..., K - 1, 3]), read in place (no concatenated copy on a GPU).

    Returns:
        [..., 3] the raw sum ``sum_k Y_k(dir) coeffs[k]`` (:func:`rasterization` adds 0.5 and clamps
        at 0). Differentiable in coeffs and dirs.

    Example:
        >>> spherical_harmonics(0, torch.tensor([[0.0, 0, 1]]), torch.ones(1, 1, 3))
        tensor([[0.2821, 0.2821, 0.2821]])
    """
    if isinstance(degree, bool) or degree not in (0, 1, 2, 3):
        raise ValueError(f"degree must be 0, 1, 2 or 3, got {degree!r}")
    if not isinstance(dirs, torch.Tensor) or dirs.ndim < 1:
        raise ValueError(f"dirs must be a tensor of shape [..., 3], got {getattr(dirs, 'shape', dirs)!r}")
    batch = {f"B{i}": s for i, s in enumerate(dirs.shape[:-1])}
    _check("dirs", dirs, (*batch, 3), dict(batch))
    sizes = dict(batch)
    _check_sh_coeffs("coeffs", coeffs, tuple(batch), sizes, dirs.device)
    if sizes["K"] < (degree + 1) ** 2:
        raise ValueError(f"coeffs must hold K >= (degree + 1)^2 = {(degree + 1) ** 2} coefficients "
                         f"for degree {degree}, got K={sizes['K']}")
    return _sh(degree, dirs, coeffs)


def _check_sh_coeffs(label: str, coeffs, lead: tuple, sizes: dict, device) -> None:
    """``coeffs`` [*lead, K, 3], or the pair (sh0 [*lead, 1, 3], shN [*lead, K - 1, 3]) that a 3DGS
    model holds; sets ``sizes["K"]``."""
    if isinstance(coeffs, (tuple, list)):
        if len(coeffs) != 2:
            raise ValueError(f"{label} as SH parts must be (sh0 [N, 1, 3], shN [N, K - 1, 3]), got "
                             f"{len(coeffs)} tensors")
        _check(f"{label}[0] (sh0)", coeffs[0], (*lead, 1, 3), sizes, device=device)
        _check(f"{label}[1] (shN)", coeffs[1], (*lead, "K-1", 3), sizes, device=device)
        sizes["K"] = sizes.pop("K-1") + 1
    else:
        _check(label, coeffs, (*lead, "K", 3), sizes, device=device)


def _sh(degree, dirs, coeffs):
    """coeffs' batch dims are those of dirs or a suffix of them (broadcast over the leading ones);
    coeffs may be the pair (degree-0 row [..., 1, 3], the others [..., K - 1, 3])."""
    parts = tuple(coeffs) if isinstance(coeffs, (tuple, list)) else (coeffs,)
    if _use_cuda(dirs.device):
        return _cuda().spherical_harmonics(degree, dirs, *parts)
    return spherical_harmonics_reference(degree, dirs, parts[0] if len(parts) == 1 else torch.cat(parts, -2))


def _check_budget(total: int) -> None:
    """The intersection count fits the int32 index of flatten_ids and isect_offsets."""
    if total > MAX_INTERSECTIONS:
        raise ValueError(f"{total} tile intersections exceed the budget of MAX_INTERSECTIONS = "
                         f"{MAX_INTERSECTIONS} (2^31 - 1, the int32 index); use fewer Gaussians, smaller "
                         f"images or fewer cameras per call")


def intersect_tiles(means2d, radii, depths, tile_size: int, tile_width: int, tile_height: int):
    """Which tiles each projected Gaussian touches, as depth-sorted 64-bit keys.

    A Gaussian with radii (rx, ry) > 0 covers tiles ``floor((m - r) / ts) .. ceil((m + r) / ts) - 1``
    per axis, clamped to the grid. Key of an intersection:
    ``camera << (32 + tile_bits) | tile << 32 | float bits of depth`` (tile_bits =
    floor(log2(tile_width * tile_height)) + 1), sorted ascending; ties keep Gaussian order.

    Args:
        means2d: [C, N, 2]; radii: [C, N] or [C, N, 2] int32 (0 = culled); depths: [C, N] (> 0).
        tile_size: pixels per tile side (8, 16 or 32); tile_width, tile_height: tiles per row / column.

    Returns:
        (tiles_per_gauss [C, N] int32, isect_ids [M] int64 sorted, flatten_ids [M] int32 indices
        into the flattened [C * N]).
    """
    sizes: dict = {}
    _check("means2d", means2d, ("C", "N", 2), sizes)
    if isinstance(radii, torch.Tensor) and radii.ndim == 3:
        _check("radii", radii, ("C", "N", 2), sizes, dtype=torch.int32, device=means2d.device)
    else:
        _check("radii", radii, ("C", "N"), sizes, dtype=torch.int32, device=means2d.device)
    _check("depths", depths, ("C", "N"), sizes, device=means2d.device)
    _check_tile_size(tile_size)
    _check_int("tile_width", tile_width)
    _check_int("tile_height", tile_height)
    _check_key_space(sizes["C"], sizes["N"], tile_width * tile_height)
    return _intersect(means2d, radii, depths, tile_size, tile_width, tile_height)


def _check_key_space(C: int, N: int, n_tiles: int) -> None:
    cam_bits, tile_bits = key_bits(C, n_tiles)
    if cam_bits + tile_bits > 32:
        raise ValueError(f"{C} cameras x {n_tiles} tiles need {cam_bits + tile_bits} key bits, more than "
                         f"the 32 above the depth: use fewer cameras per call or a smaller image")
    if C * N > MAX_INTERSECTIONS:
        raise ValueError(f"C * N = {C * N} Gaussian-camera pairs exceed the int32 index of flatten_ids")


def _intersect(means2d, radii, depths, tile_size, tile_width, tile_height):
    if _use_cuda(means2d.device):
        return _cuda().intersect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height,
                                       _check_budget)
    x0, x1, y0, y1 = tile_ranges(means2d, radii, tile_size, tile_width, tile_height)
    _check_budget(int(((x1 - x0) * (y1 - y0)).sum()))
    return intersect_tiles_reference(means2d, radii, depths, tile_size, tile_width, tile_height)


def isect_offset_encode(isect_ids, n_cameras: int, tile_width: int, tile_height: int):
    """Start of every tile's run in the sorted keys: [C, tile_height, tile_width] int32.

    Tile t of camera c holds ``isect_ids[offsets[c, t] : next offset]`` (the last: up to M).
    """
    _check("isect_ids", isect_ids, ("M",), {}, dtype=torch.int64)
    _check_int("n_cameras", n_cameras)
    _check_int("tile_width", tile_width)
    _check_int("tile_height", tile_height)
    _check_key_space(n_cameras, 1, tile_width * tile_height)
    return _offsets(isect_ids, n_cameras, tile_width, tile_height)


def _offsets(isect_ids, n_cameras, tile_width, tile_height):
    if _use_cuda(isect_ids.device):
        return _cuda().isect_offset_encode(isect_ids, n_cameras, tile_width, tile_height)
    return isect_offset_encode_reference(isect_ids, n_cameras, tile_width, tile_height)


def rasterize_to_pixels(means2d, conics, colors, opacities, width: int, height: int, tile_size: int,
                        isect_offsets, flatten_ids, backgrounds=None, absgrad: bool = False,
                        alpha_max: float = ALPHA_MAX):
    """Front-to-back alpha blending of the tiles' depth-sorted Gaussians (gsplat 1.5 semantics).

    Per pixel centre p (x + 0.5, y + 0.5) and Gaussian in its tile's list, in order:
    ``sigma = (a dx^2 + c dy^2) / 2 + b dx dy`` (d = mean - p), ``alpha = min(alpha_max, o exp(-sigma))``;
    skipped when sigma < 0 or alpha < 1/255; the pixel stops before the Gaussian that would bring
    its transmittance T to 1e-4 or below. ``colour = sum_i alpha_i T_i c_i + T background``,
    ``alpha = 1 - T``.

    Args:
        means2d: [C, N, 2]; conics: [C, N, 3]; colors: [C, N, D]; opacities: [C, N].
        width, height: image size; tile_size: 8, 16 or 32.
        isect_offsets: [C, ceil(H / ts), ceil(W / ts)] int32 (:func:`isect_offset_encode`).
        flatten_ids: [M] int32 indices into [C * N] (:func:`intersect_tiles`).
        backgrounds: optional [C, D].
        absgrad: after backward, ``means2d.absgrad`` holds the sum over pixels of |dL/dmeans2d|.
        alpha_max: the clamp of alpha, in (1/255, 1): 0.99 as the 3DGS reference (the default);
            gsplat clamps at 0.999, so 0.999 renders gsplat's image.

    Returns:
        (render_colors [C, H, W, D], render_alphas [C, H, W, 1]); differentiable in means2d,
        conics, colors, opacities and backgrounds.
    """
    sizes: dict = {}
    _check("means2d", means2d, ("C", "N", 2), sizes)
    dev = means2d.device
    _check("conics", conics, ("C", "N", 3), sizes, device=dev)
    _check("colors", colors, ("C", "N", "D"), sizes, device=dev)
    _check("opacities", opacities, ("C", "N"), sizes, device=dev)
    _check_image(width, height)
    _check_tile_size(tile_size)
    alpha_max = _check_alpha_max(alpha_max)
    if sizes["D"] < 1:
        raise ValueError("colors must have at least one channel, got D=0")
    sizes["tile_height"], sizes["tile_width"] = -(-height // tile_size), -(-width // tile_size)
    _check("isect_offsets", isect_offsets, ("C", "tile_height", "tile_width"), sizes, dtype=torch.int32,
           device=dev)
    _check("flatten_ids", flatten_ids, ("M",), sizes, dtype=torch.int32, device=dev)
    if backgrounds is not None:
        _check("backgrounds", backgrounds, ("C", "D"), sizes, device=dev)
    M = sizes["M"]
    off = isect_offsets.reshape(-1)
    flags = [(f"isect_offsets must be non-decreasing and within [0, M={M}]",
              ~((off >= 0).all() & (off <= M).all() & (off[1:] >= off[:-1]).all()))]
    if M:
        flags.append((f"flatten_ids must lie in [0, C * N = {sizes['C'] * sizes['N']})",
                      ~((flatten_ids >= 0).all() & (flatten_ids < sizes["C"] * sizes["N"]).all())))
    _raise_flags(flags)
    return _rasterize(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets,
                      flatten_ids, backgrounds, absgrad, alpha_max=alpha_max)


def _rasterize(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
               backgrounds, absgrad, needed=None, alpha_max: float = ALPHA_MAX):
    if _use_cuda(means2d.device):
        return _cuda().rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size,
                                           isect_offsets, flatten_ids, backgrounds, absgrad, needed, alpha_max)
    return rasterize_to_pixels_reference(means2d, conics, colors, opacities, width, height, tile_size,
                                         isect_offsets, flatten_ids, backgrounds, absgrad, alpha_max)


def rasterization(means, quats, scales, opacities, colors, viewmats, Ks, width: int, height: int, *,
                  sh_degree: int | None = None, backgrounds=None, render_mode: str = "RGB",
                  near_plane: float = 0.01, far_plane: float = 1e10, eps2d: float = 0.3,
                  radius_clip: float = 0.0, antialiased: bool = False, absgrad: bool = False,
                  tile_size: int = 16, validate: bool = True, capacity: int | None = None,
                  alpha_max: float = ALPHA_MAX):
    """Render N Gaussians into C cameras: project, colour, bin into tiles, blend (gsplat's
    ``rasterization(..., packed=False)``).

    Args:
        means [N, 3], quats [N, 4], scales [N, 3] (linear), opacities [N] (in [0, 1]).
        colors: [N, D] colours, or with ``sh_degree`` [N, K, 3] SH coefficients (colour =
            max(SH sum + 0.5, 0), view directions from each camera's centre to the means), or
            those as the pair (sh0 [N, 1, 3], shN [N, K - 1, 3]) of a 3DGS model's parameters,
            which the CUDA path reads in place (no concatenation, and a gradient for each).
        viewmats [C, 4, 4], Ks [C, 3, 3], width, height: cameras sharing one image size.
        backgrounds: optional [C, D] (D = colour channels; depth channels get 0).
        render_mode: "RGB", "D" (accumulated depth), "ED" (D / alpha), "RGB+D", "RGB+ED".
        near_plane, far_plane, eps2d, radius_clip, antialiased: see :func:`project_gaussians`;
            antialiased multiplies opacities by the compensation.
        absgrad: ``meta["means2d"].absgrad`` after backward (see :func:`rasterize_to_pixels`).
        tile_size: 8, 16 or 32.
        alpha_max: the clamp of alpha (see :func:`rasterize_to_pixels`; 0.999 is gsplat's).
        validate: check the values (finite means, scales, quaternions and cameras, no zero
            quaternion): on a GPU one kernel and a host read, which makes the host wait for the
            GPU. A caller whose tensors cannot hold such values (the training loop: a step with a
            non-finite gradient never updates them) passes False; shapes, dtypes and devices are
            checked either way.
        capacity: on a GPU, room for this many tile intersections, so that nothing is read back to
            size the buffers and the call can be captured in a CUDA graph (the 3DGS training
            step's). ``meta["n_intersections"]`` is then the count the views needed, a [1] int64
            device tensor; above the capacity the farthest Gaussians' tiles are left out of the
            render. None sizes them exactly (one host read). The CPU twins always size them
            exactly.

    Returns:
        (render_colors [C, H, W, D'], render_alphas [C, H, W, 1], meta). meta holds "means2d"
        ([C, N, 2]; ``retain_grad()`` called, so after backward ``meta["means2d"].grad`` is the
        view-space gradient densification reads), "radii" ([C, N] int32, the larger box half-size),
        "depths", "conics", "opacities" (as blended), "width", "height", "n_cameras", "tile_size",
        "tile_width", "tile_height", "tiles_per_gauss", "isect_ids", "flatten_ids", "isect_offsets",
        "n_intersections" (an int; with ``capacity`` on a GPU a device tensor, see above).
    """
    sizes: dict = {}
    _check_gaussians(means, quats, scales, sizes)
    dev = means.device
    _check("opacities", opacities, ("N",), sizes, device=dev)
    _check_cameras(viewmats, Ks, width, height, sizes, dev)
    _check_planes(eps2d, near_plane, far_plane, radius_clip)
    _check_tile_size(tile_size)
    alpha_max = _check_alpha_max(alpha_max)
    if render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode must be one of {RENDER_MODES}, got {render_mode!r}")
    if sh_degree is None:
        _check("colors", colors, ("N", "D"), sizes, device=dev)
        if sizes["D"] < 1:
            raise ValueError("colors must have at least one channel, got D=0")
    else:
        if isinstance(sh_degree, bool) or sh_degree not in (0, 1, 2, 3):
            raise ValueError(f"sh_degree must be None or 0..3, got {sh_degree!r}")
        _check_sh_coeffs("colors", colors, ("N",), sizes, dev)
        if sizes["K"] < (sh_degree + 1) ** 2:
            raise ValueError(f"colors must hold K >= (sh_degree + 1)^2 = {(sh_degree + 1) ** 2} SH "
                             f"coefficients, got K={sizes['K']}")
        sizes["D"] = 3
    C, N = sizes["C"], sizes["N"]
    if backgrounds is not None and render_mode not in ("D", "ED"):
        _check("backgrounds", backgrounds, ("C", "D"), sizes, device=dev)
    tw, th = -(-width // tile_size), -(-height // tile_size)
    _check_key_space(C, N, tw * th)
    if validate:
        _check_values(means, quats, scales, viewmats, Ks)  # the one host read of the checks

    proj = _project(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane,
                    radius_clip, antialiased, opacities, True)
    opac = opacities[None].expand(C, N)
    if proj.compensations is not None:
        opac = opac * proj.compensations
    opac = opac.contiguous()
    if render_mode in ("D", "ED"):
        rgb = None  # depth only: no colours to evaluate
    elif sh_degree is None:
        rgb = colors[None].expand(C, N, sizes["D"])
    else:
        campos = torch.linalg.inv_ex(viewmats).inverse[:, :3, 3]  # [C, 3] camera centres (inv_ex: no sync)
        dirs = means[None] - campos[:, None]
        rgb = torch.clamp_min(_sh(sh_degree, dirs.contiguous(), colors) + 0.5, 0.0)  # [N, K, 3] broadcast
    bg = backgrounds
    if render_mode in ("RGB+D", "RGB+ED"):
        rgb = torch.cat([rgb, proj.depths[..., None]], -1)
        if bg is not None:
            bg = torch.cat([bg, bg.new_zeros(C, 1)], -1)
    elif render_mode in ("D", "ED"):
        rgb = proj.depths[..., None]
        bg = None if bg is None else bg.new_zeros(C, 1)
    rgb = rgb.contiguous()
    needed = None
    if capacity is not None:
        _check_int("capacity", capacity)
    if _use_cuda(dev):  # binning that also drops the tiles of a box the Gaussian's alpha cannot reach
        tiles_per_gauss, isect_ids, flatten_ids, offsets, needed = _cuda().bin_tiles(
            proj.means2d, proj.radii, proj.depths, tile_size, tw, th, _check_budget, width, height,
            proj.conics.detach(), opac.detach(), capacity)
    else:
        tiles_per_gauss, isect_ids, flatten_ids = _intersect(proj.means2d, proj.radii, proj.depths, tile_size,
                                                             tw, th)
        offsets = _offsets(isect_ids, C, tw, th)
    means2d = proj.means2d
    if means2d.requires_grad:
        means2d.retain_grad()
    render, alphas = _rasterize(means2d, proj.conics, rgb, opac, width, height, tile_size, offsets,
                                flatten_ids, bg, absgrad, needed, alpha_max)
    if render_mode in ("ED", "RGB+ED"):
        render = torch.cat([render[..., :-1], render[..., -1:] / alphas.clamp(min=1e-10)], -1)
    meta = {"means2d": means2d, "radii": proj.radii.amax(-1), "depths": proj.depths, "conics": proj.conics,
            "opacities": opac, "width": width, "height": height, "n_cameras": C, "tile_size": tile_size,
            "tile_width": tw, "tile_height": th, "tiles_per_gauss": tiles_per_gauss, "isect_ids": isect_ids,
            "flatten_ids": flatten_ids, "isect_offsets": offsets,
            "n_intersections": int(flatten_ids.numel()) if needed is None else needed}
    return render, alphas, meta
