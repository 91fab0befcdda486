"""The Gaussians of 3DGS: initialisation, activations, optimizers and the means' learning-rate decay.

Paper: Kerbl, Kopanas, Leimkühler, Drettakis, "3D Gaussian Splatting for Real-Time Radiance Field
Rendering", SIGGRAPH 2023. Parameters are a dict of ``nn.Parameter`` with gsplat's simple_trainer names:

=============  ============  ================================================================
name           shape         meaning
=============  ============  ================================================================
``means``      [N, 3]        centres, scene units (the normalized frame)
``quats``      [N, 4]        rotations (w, x, y, z), unnormalised; :func:`activated` normalises
``scales``     [N, 3]        log of the standard deviations along the rotated axes
``opacities``  [N]           logit of the opacity
``sh0``        [N, 1, 3]     degree-0 spherical-harmonic coefficient per RGB channel
``shN``        [N, K - 1, 3] higher SH coefficients, K = (sh_degree + 1)^2 (K - 1 = 0 at degree 0)
=============  ============  ================================================================

One Adam per name (:func:`make_optimizers`), so densification can replace a tensor together with its
optimizer state (:mod:`.densify`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn

SH_C0 = 0.28209479177387814  # the degree-0 real SH basis function, 1 / (2 sqrt(pi))
MAX_SH_DEGREE = 3
PARAM_NAMES = ("means", "quats", "scales", "opacities", "sh0", "shN")
# The reference clamps the mean squared neighbour distance at 1e-7 (scene units^2) before the log, so
# coincident points get a small Gaussian rather than log(0) = -inf.
MIN_NEIGHBOUR_DIST2 = 1e-7


def num_sh_coeffs(degree: int) -> int:
    """K = (degree + 1)^2 coefficients per colour channel for SH degrees 0..3."""
    if isinstance(degree, bool) or not isinstance(degree, int) or not 0 <= degree <= MAX_SH_DEGREE:
        raise ValueError(f"sh_degree must be an int in 0..{MAX_SH_DEGREE}, got {degree!r}")
    return (degree + 1) ** 2


def sh_degree_of(num_coeffs: int) -> int:
    """The SH degree whose coefficient count K = (degree + 1)^2 is ``num_coeffs`` (1, 4, 9 or 16)."""
    for degree in range(MAX_SH_DEGREE + 1):
        if (degree + 1) ** 2 == num_coeffs:
            return degree
    raise ValueError(f"{num_coeffs} SH coefficients per channel is no degree in 0..{MAX_SH_DEGREE} "
                     f"(expected 1, 4, 9 or 16)")


def rgb_to_sh(rgb: Tensor) -> Tensor:
    """Degree-0 SH coefficient [..., 3] that renders as ``rgb`` [..., 3] in [0, 1] (colour = C0 sh + 0.5)."""
    return (rgb - 0.5) / SH_C0


# ---------------------------------------------------------------------------- nearest neighbours

_KEY_BITS = 21  # bits per axis of a cell key: three fit in an int64
_MAX_CELL = 2**_KEY_BITS - 3  # cells are shifted by +1 and neighbours reach +1 more: no key overflows
_NO_PAIR = torch.iinfo(torch.int64).max
# A query's 27 neighbour cells as 9 columns (dx, dy): the cells z - 1, z, z + 1 of a column are three
# consecutive keys, so one sorted-key range covers each column.
_COLUMN_OFFSETS = [(dx << (2 * _KEY_BITS)) + (dy << _KEY_BITS) for dx in (-1, 0, 1) for dy in (-1, 0, 1)]
# The first grid level's cells hold this many points on average over points (see _first_level): for
# uniform points, their third neighbour is then within a cell's size about half the time.
_FIRST_LEVEL_OCCUPANCY = 4


def _cell_keys(cells: Tensor) -> Tensor:
    """int64 key [...] of integer cells [..., 3] in [0, 2^21): x major, z minor."""
    return (cells[..., 0] << (2 * _KEY_BITS)) | (cells[..., 1] << _KEY_BITS) | cells[..., 2]


def _k_smallest(points: Tensor, queries: Tensor, start: Tensor, count: Tensor, order: Tensor,
                k: int) -> Tensor:
    """Squared distances [Q, k], ascending, from each query to its k nearest candidates (inf if fewer).

    Candidates of query q are ``order[start[q, c] : start[q, c] + count[q, c]]`` for its 9 columns c.
    The k smallest come out of k rounds of a segmented minimum over int64 keys (distance bits << 32 |
    candidate index): non-negative float32 compare as their bit patterns do, and the index makes every
    key unique, so each round removes exactly one candidate.
    """
    dev = points.device
    counts, starts = count.reshape(-1), start.reshape(-1)
    segment = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
    first = torch.cumsum(counts, 0) - counts
    cand = order[torch.arange(segment.numel(), device=dev) - first[segment] + starts[segment]]
    local = segment // len(_COLUMN_OFFSETS)
    query = queries[local]
    d2 = (points[query] - points[cand]).square().sum(-1)
    key = torch.where(cand == query, _NO_PAIR, (d2.view(torch.int32).long() << 32) | cand)
    best = torch.empty(queries.numel(), k, dtype=torch.int64, device=dev)
    for j in range(k):
        best[:, j] = torch.full_like(best[:, j], _NO_PAIR).scatter_reduce_(0, local, key, "amin")
        if j + 1 < k:
            key = torch.where(key == best[local, j], _NO_PAIR, key)
    return torch.where(best == _NO_PAIR, torch.inf, (best >> 32).int().view(torch.float32))


def _first_level(cells0: Tensor, n: int) -> int:
    """The coarsest grid level whose cells hold on average (over points) at most 4 points.

    sum over cells of occupancy^2 / P is the mean occupancy of a point's own cell; it grows with the
    level, so a binary search finds the level. Finer levels leave sparse points for later levels
    (cheap: they have few candidates); coarser ones would give points in dense clusters many
    candidates. Occupancies at every level come from one sort of Morton keys: with the three axes' bits
    interleaved, a coarser level's key is a finer key shifted right by 3 bits per level.
    """
    def spread(v: Tensor) -> Tensor:  # bit i of v -> bit 3i
        v = v & 0x1FFFFF
        v = (v | (v << 32)) & 0x1F00000000FFFF
        v = (v | (v << 16)) & 0x1F0000FF0000FF
        v = (v | (v << 8)) & 0x100F00F00F00F00F
        v = (v | (v << 4)) & 0x10C30C30C30C30C3
        return (v | (v << 2)) & 0x1249249249249249

    morton, _ = torch.sort((spread(cells0[:, 0]) << 2) | (spread(cells0[:, 1]) << 1) | spread(cells0[:, 2]))
    lo, hi = 0, _KEY_BITS  # level hi: one cell holds everything
    while lo < hi:
        mid = (lo + hi + 1) // 2
        _, occupancy = torch.unique_consecutive(morton >> (3 * mid), return_counts=True)
        if int(occupancy.square().sum()) <= _FIRST_LEVEL_OCCUPANCY * n:
            lo = mid
        else:
            hi = mid - 1
    return lo


def knn_distances(points: Tensor, k: int = 3, *, query_chunk: int = 2**16,
                  max_pairs: int = 2**22) -> Tensor:
    """Exact Euclidean distances from every point to its k nearest other points.

    A uniform grid finds candidates: a point's neighbours within the cell size h all lie in its 27
    neighbour cells, so once the k-th nearest candidate is within h the answer is exact. Points not
    settled at one cell size go on to twice the size, until one cell spans the whole set (then every
    point is a candidate). Cost is about (points x candidates per point) per level; memory is bounded by
    ``max_pairs`` candidate pairs at a time. 100k points take seconds on one CPU core.

    Args:
        points: [P, 3] float32 (other float types are cast), finite, P > k, any device.
        k: neighbours per point, >= 1.
        query_chunk: points answered per batch of neighbour-cell lookups.
        max_pairs: candidate pairs held at once.

    Returns:
        [P, k] float32 distances in the points' units, ascending per row; exactly what
        ``(points[i] - points[j]).square().sum().sqrt()`` gives in float32 for the k nearest j != i
        (coincident points are at distance 0).

    Example:
        >>> knn_distances(torch.tensor([[0., 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 4]]), k=2)
        tensor([[1.0000, 2.0000],
                [1.0000, 2.2361],
                [2.0000, 2.2361],
                [4.0000, 4.1231]])
    """
    if not isinstance(points, Tensor) or points.ndim != 2 or points.shape[1] != 3:
        raise ValueError(f"points must be a [P, 3] tensor, got "
                         f"{tuple(points.shape) if isinstance(points, Tensor) else type(points).__name__}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    n = points.shape[0]
    if n <= k:
        raise ValueError(f"{k} nearest neighbours need more than {k} points, got {n}")
    points = points.float().contiguous()
    if not bool(torch.isfinite(points).all()):
        raise ValueError("points must be finite (found NaN or Inf)")
    dev = points.device
    lo = points.min(0).values.double()
    full = float((points.max(0).values.double() - lo).max())
    if full == 0.0:
        return torch.zeros(n, k, device=dev)  # all points coincide
    h0 = full / _MAX_CELL
    cells0 = ((points.double() - lo) / h0).floor().long().clamp_(0, _MAX_CELL)
    level = _first_level(cells0, n)
    columns = torch.tensor(_COLUMN_OFFSETS, device=dev)
    out = torch.full((n, k), torch.inf, device=dev)
    pending = torch.arange(n, device=dev)
    while pending.numel():
        h = h0 * 2**level
        complete = h >= full  # cells of 0 and 1 only: every point is every query's candidate
        cells = (cells0 >> level) + 1
        keys, order = torch.sort(_cell_keys(cells))
        unsettled = []
        for q0 in range(0, pending.numel(), query_chunk):
            queries = pending[q0:q0 + query_chunk]
            column = _cell_keys(cells[queries])[:, None] + columns  # [Q, 9] keys of the centre cells
            start = torch.searchsorted(keys, column - 1)
            count = torch.searchsorted(keys, column + 1, right=True) - start
            total = count.sum(1)
            if not complete:  # too few candidates (the query itself and k more): next level
                enough = total > k
                unsettled.append(queries[~enough])
                queries, start, count, total = queries[enough], start[enough], count[enough], total[enough]
            ends = torch.cumsum(total, 0)
            a = 0
            while a < queries.numel():  # batches of at most max_pairs pairs (at least one query)
                base = int(ends[a - 1]) if a else 0
                b = min(max(int(torch.searchsorted(ends, base + max_pairs, right=True)), a + 1),
                        queries.numel())
                d2 = _k_smallest(points, queries[a:b], start[a:b], count[a:b], order, k)
                # Settled: the k-th candidate is within h (less a margin for the float32 distance's
                # rounding; cells are computed in float64).
                ok = torch.ones(b - a, dtype=torch.bool, device=dev) if complete \
                    else d2[:, -1] <= (h * (1.0 - 1e-6)) ** 2
                out[queries[a:b][ok]] = d2[ok]
                unsettled.append(queries[a:b][~ok])
                a = b
        pending = torch.cat(unsettled)
        level += 1
    return out.sqrt()


# ---------------------------------------------------------------------------- initialisation


def _check_box(aabb: Tensor | None) -> Tensor:
    if aabb is None:
        raise ValueError("no sparse points and no scene box: random initialisation needs the box "
                         "(aabb [2, 3]) to draw the Gaussians in")
    if not isinstance(aabb, Tensor) or tuple(aabb.shape) != (2, 3):
        raise ValueError(f"aabb must be a [2, 3] tensor (min corner, max corner), got "
                         f"{tuple(aabb.shape) if isinstance(aabb, Tensor) else type(aabb).__name__}")
    box = aabb.detach().float()
    if not bool(torch.isfinite(box).all()) or not bool((box[1] > box[0]).all()):
        raise ValueError(f"aabb is empty or degenerate (needs finite min < max on every axis), "
                         f"got {box.tolist()}")
    return box


def _check_points(points: Tensor, point_rgb: Tensor | None) -> None:
    if not isinstance(points, Tensor) or points.ndim != 2 or points.shape[1] != 3:
        raise ValueError(f"points must be a [P, 3] tensor, got "
                         f"{tuple(points.shape) if isinstance(points, Tensor) else type(points).__name__}")
    if not points.is_floating_point():
        raise ValueError(f"points must be a float tensor, got {points.dtype}")
    bad = int((~torch.isfinite(points).all(1)).sum())
    if bad:
        raise ValueError(f"{bad} of {points.shape[0]} sparse points are not finite (NaN or Inf)")
    if points.shape[0] < 2:
        raise ValueError("initialising from sparse points needs at least 2 (a Gaussian's size is its "
                         f"distance to its nearest points), got {points.shape[0]}")
    if point_rgb is not None:
        if not isinstance(point_rgb, Tensor) or tuple(point_rgb.shape) != tuple(points.shape):
            raise ValueError(f"point_rgb must be [{points.shape[0]}, 3] like points, got "
                             f"{tuple(point_rgb.shape) if isinstance(point_rgb, Tensor) else point_rgb!r}")
        if point_rgb.dtype != torch.uint8:
            raise ValueError(f"point_rgb must be uint8 (0..255), got {point_rgb.dtype}")


def init_gaussians(points: Tensor | None, point_rgb: Tensor | None, aabb: Tensor | None, *,
                   sh_degree: int = 3, init_opacity: float = 0.1, init_scale: float = 1.0,
                   n_random: int = 100_000, generator: torch.Generator | None = None,
                   device: torch.device | str | None = None) -> dict[str, nn.Parameter]:
    """The initial Gaussians, as the 3DGS reference makes them.

    One Gaussian per sparse point when there are any, coloured by the point (gray where ``point_rgb``
    is None); else ``n_random`` Gaussians uniform in the box with uniform random colours (the
    reference's nerf_synthetic case). Sizes: isotropic, ``init_scale`` x the root mean square of the
    distances to the 3 nearest other Gaussians (the reference's ``distCUDA2``, and gsplat's). Rotations:
    the identity, as in the reference (gsplat draws random ones): the covariance is isotropic, so a
    rotation changes nothing at the start, and the identity needs no random draws. Opacities:
    ``init_opacity``. Higher SH coefficients: zero.

    Args:
        points: [P, 3] float sparse points (normalized frame) or None; P == 0 counts as None.
        point_rgb: [P, 3] uint8 colours of the points, or None.
        aabb: [2, 3] scene box (min, max corner), needed when there are no points.
        sh_degree: 0..3, sets K = (sh_degree + 1)^2.
        init_opacity: in (0, 1).
        init_scale: > 0, multiplies the neighbour distance.
        n_random: >= 4, Gaussians of the random initialisation.
        generator: CPU generator for the random positions and colours (None: torch's default).
        device: where the parameters live; None: the points' (else the box's) device.

    Returns:
        ``{"means", "quats", "scales", "opacities", "sh0", "shN"}`` float32 ``nn.Parameter`` (see the
        module docstring for shapes).

    Raises:
        ValueError: no points and no usable box (missing, empty or degenerate), non-finite points,
            fewer than 2 points, mismatched colours, or an argument out of range.
    """
    k = num_sh_coeffs(sh_degree)
    if not 0.0 < init_opacity < 1.0:
        raise ValueError(f"init_opacity must be in (0, 1), got {init_opacity!r}")
    if not init_scale > 0.0:
        raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
    if points is not None and points.numel() == 0 and points.ndim == 2:
        points, point_rgb = None, None
    if points is not None:
        _check_points(points, point_rgb)
        device = points.device if device is None else device
        means = points.detach().float().to(device)
        rgb = (point_rgb.to(device).float() / 255.0 if point_rgb is not None
               else torch.full_like(means, 0.5))
    else:
        box = _check_box(aabb)
        if isinstance(n_random, bool) or not isinstance(n_random, int) or n_random < 4:
            raise ValueError(f"n_random must be an int >= 4, got {n_random!r}")
        device = aabb.device if device is None else device
        u = torch.rand(n_random, 3, generator=generator)
        means = (box[0].cpu() + u * (box[1] - box[0]).cpu()).to(device)
        rgb = torch.rand(n_random, 3, generator=generator).to(device)
    n = means.shape[0]
    dist2 = knn_distances(means, min(3, n - 1)).square().mean(1).clamp_min(MIN_NEIGHBOUR_DIST2)
    scales = torch.log(init_scale * dist2.sqrt())[:, None].repeat(1, 3)
    quats = torch.zeros(n, 4, device=device)
    quats[:, 0] = 1.0
    sh = torch.zeros(n, k, 3, device=device)
    sh[:, 0] = rgb_to_sh(rgb)
    values = {"means": means, "quats": quats, "scales": scales,
              "opacities": torch.full((n,), math.log(init_opacity / (1.0 - init_opacity)), device=device),
              "sh0": sh[:, :1], "shN": sh[:, 1:]}
    return {name: nn.Parameter(values[name].contiguous()) for name in PARAM_NAMES}


def init_box(aabb: Tensor, c2w: Tensor, init_extent: float) -> Tensor:
    """Where a random start is drawn (``reconstruct.gs.init_extent``): the scene box ``aabb`` [2, 3]
    for 0, else a cube of half-side ``init_extent`` x :func:`scene_extent` of the cameras ``c2w``
    around the box's centre (gsplat's simple_trainer draws in 3.0 x its scene scale)."""
    if init_extent <= 0:
        return aabb
    half = init_extent * scene_extent(c2w)
    centre = aabb.mean(0)
    return torch.stack([centre - half, centre + half])


def scene_extent(c2w: Tensor) -> float:
    """The scene's size for learning rates and densification thresholds, as the 3DGS reference has it.

    1.1 x the largest distance of a camera centre from the centres' mean (the reference's
    ``getNerfppNorm`` radius; gsplat's ``scene_scale`` x 1.1).

    Args:
        c2w: [N, 4, 4] or [N, 3, 4] camera-to-world poses; only the centres (translations) are read,
            so the camera axis convention does not matter.

    Returns:
        The extent in scene units (> 0).

    Raises:
        ValueError: no cameras, non-finite poses, or all cameras at one point.
    """
    if not isinstance(c2w, Tensor) or c2w.ndim != 3 or tuple(c2w.shape[1:]) not in ((4, 4), (3, 4)):
        raise ValueError(f"c2w must be [N, 4, 4] or [N, 3, 4], got "
                         f"{tuple(c2w.shape) if isinstance(c2w, Tensor) else type(c2w).__name__}")
    if c2w.shape[0] == 0:
        raise ValueError("scene_extent needs at least one camera, got none")
    centres = c2w[:, :3, 3].double()
    if not bool(torch.isfinite(centres).all()):
        raise ValueError("camera poses are not finite (NaN or Inf in a camera centre)")
    mean = centres.mean(0)
    radius = float((centres - mean).norm(dim=1).max())
    if radius <= 1e-9 * max(1.0, float(mean.norm())):
        raise ValueError(f"degenerate scene: all {c2w.shape[0]} cameras sit at one point "
                         f"{mean.tolist()}, so the scene has no extent to scale learning rates and "
                         "densification by")
    return 1.1 * radius


# ---------------------------------------------------------------------------- activations


class Activated(NamedTuple):
    """The Gaussians as the rasterizer takes them."""

    means: Tensor  # [N, 3]
    quats: Tensor  # [N, 4] unit (w, x, y, z)
    scales: Tensor  # [N, 3] standard deviations, scene units
    opacities: Tensor  # [N] in (0, 1)
    colors: Tensor  # [N, K, 3] SH coefficients, cat(sh0, shN)


def activated(params: Mapping[str, Tensor]) -> Activated:
    """Normalised quaternions, exp of the log scales, sigmoid of the logit opacities, the SH stack."""
    return Activated(params["means"], nn.functional.normalize(params["quats"], dim=-1),
                     params["scales"].exp(), params["opacities"].sigmoid(),
                     torch.cat([params["sh0"], params["shN"]], 1))


def sh_degree_at(step: int, max_degree: int, every: int = 1000) -> int:
    """SH degree in use at ``step`` (0-based): one more every ``every`` steps, up to ``max_degree``."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every!r}")
    return min(max(step, 0) // every, max_degree)


def quat_to_rotmat(quats: Tensor) -> Tensor:
    """Rotation matrices [N, 3, 3] of quaternions [N, 4] (w, x, y, z), normalised here."""
    w, x, y, z = nn.functional.normalize(quats, dim=-1).unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], -1).reshape(-1, 3, 3)


# ---------------------------------------------------------------------------- optimizers


def make_optimizers(params: Mapping[str, nn.Parameter], *, scene_extent: float,
                    means_lr: float = 1.6e-4, sh0_lr: float = 2.5e-3, shN_lr: float = 2.5e-3 / 20,
                    opacities_lr: float = 5e-2, scales_lr: float = 5e-3, quats_lr: float = 1e-3,
                    lr_scale: float = 1.0, eps: float = 1e-15,
                    betas: tuple[float, float] = (0.9, 0.999),
                    fused: bool = False) -> dict[str, torch.optim.Adam]:
    """One Adam per parameter with the 3DGS reference's learning rates.

    The means' rate is ``means_lr x scene_extent``; ``lr_scale`` multiplies every rate (gsplat and
    Grendel-GS scale by sqrt(batch size x world size)). Each optimizer's single param group holds its
    parameter, its ``name`` and ``initial_lr`` (what :func:`set_means_lr` decays from).

    Args:
        params: the six parameters of :func:`init_gaussians`.
        scene_extent: :func:`scene_extent`, > 0.
        means_lr ... quats_lr: base rates (> 0).
        lr_scale: > 0.
        eps, betas: Adam's (gsplat also scales these with the batch; pass them scaled if wanted).
        fused: torch's fused Adam (CUDA, or recent CPU builds).

    Returns:
        ``{name: Adam}`` for every name in ``params``.
    """
    rates = {"means": means_lr * scene_extent, "quats": quats_lr, "scales": scales_lr,
             "opacities": opacities_lr, "sh0": sh0_lr, "shN": shN_lr}
    if set(params) != set(rates):
        raise ValueError(f"params must have exactly {sorted(rates)}, got {sorted(params)}")
    if not scene_extent > 0:
        raise ValueError(f"scene_extent must be > 0, got {scene_extent!r}")
    if not lr_scale > 0:
        raise ValueError(f"lr_scale must be > 0, got {lr_scale!r}")
    bad = {name: lr for name, lr in rates.items() if not lr > 0}
    if bad:
        raise ValueError(f"learning rates must be > 0, got {bad}")
    optimizers = {}
    for name, param in params.items():
        lr = rates[name] * lr_scale
        optimizers[name] = torch.optim.Adam([{"params": [param], "lr": lr, "initial_lr": lr,
                                              "name": name}], eps=eps, betas=betas, fused=fused)
    return optimizers


def means_lr_at(step: int, total_steps: int, lr_init: float, lr_final: float | None = None) -> float:
    """Log-linear decay from ``lr_init`` at step 0 to ``lr_final`` (default lr_init / 100) at
    ``total_steps``, held after: ``lr_init^(1 - t) lr_final^t``, t = step / total_steps.

    The reference's ``get_expon_lr_func`` without its delay, and gsplat's ExponentialLR with
    gamma = 0.01^(1 / total_steps).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps!r}")
    lr_final = lr_init / 100.0 if lr_final is None else lr_final
    if not (lr_init > 0 and lr_final > 0):
        raise ValueError(f"learning rates must be > 0, got lr_init={lr_init!r}, lr_final={lr_final!r}")
    t = min(max(step / total_steps, 0.0), 1.0)
    return math.exp((1.0 - t) * math.log(lr_init) + t * math.log(lr_final))


def set_means_lr(optimizers: Mapping[str, torch.optim.Optimizer], step: int, total_steps: int) -> float:
    """Set the means' Adam to :func:`means_lr_at` of its group's ``initial_lr``; returns the rate.

    Call it once per step before the optimizer step (the rate of step 0 is the initial one).
    """
    lr = 0.0
    for group in optimizers["means"].param_groups:
        lr = group["lr"] = means_lr_at(step, total_steps, group["initial_lr"])
    return lr
