"""CUDA side of the 3DGS rasterizer ops: programs, launches and autograd Functions.

:mod:`kernels.gaussians` checks the inputs and calls these on CUDA tensors. Sources:
``csrc/gaussians_project.cu`` (projection, spherical harmonics), ``csrc/gaussians_tiles.cu``
(tile binning), ``csrc/gaussians_raster.cu`` (blending); each op's twin is in
:mod:`kernels._gs_reference`, whose constants the kernels get as defines.

Each autograd Function saves only what its backward reads: the projection its inputs and radii
(the backward recomputes the rest), the blending its inputs, the lists, and per pixel the final
transmittance and the index of the last Gaussian blended.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._driver import KernelProgram, f32, i32, i64, ptr
from ._gs_reference import ALPHA_MAX, ALPHA_MIN, EXTEND, T_MIN, Projection, key_bits

BLOCK = 256  # threads per block of the per-Gaussian and per-intersection kernels
SH_BLOCK = 192  # threads per block of the SH kernels (csrc/gaussians_project.cu: three per item, a multiple of 3)
MAX_CHANNELS = 4  # rasterize kernels exist for 1..4 channels; more go through in chunks of 4
DEFINES = {"RF_ALPHA_MIN": f"({ALPHA_MIN!r}f)", "RF_ALPHA_MAX": f"({ALPHA_MAX!r}f)",
           "RF_T_MIN": f"({T_MIN!r}f)", "RF_EXTEND": f"({EXTEND!r}f)", "RF_SH_BLOCK": str(SH_BLOCK)}
_PROJECT = ["check_inputs", "projection_fwd", "projection_bwd", "sh_fwd", "sh_bwd"]
_TILES = ["tile_counts", "tile_emit", "tile_finish", "tile_offsets", "radix_histogram", "radix_scatter"]
# How bin_tiles sorts the M camera|tile keys: "torch" (torch.sort, stable, all 32 bits, an int64
# permutation), "torch16" (torch.sort of the keys narrowed to int16 where the cameras' tiles number
# fewer than 2^15, e.g. up to four 1080p views at 16 px: half the radix passes; else as "torch") or
# "radix" (csrc/gaussians_tiles.cu: only the key's bits, key/value pairs, 16 bytes per intersection
# instead of ~32). benchmarks/bench_rasterizer.py measures each.
SORT = "torch"
_PAD_KEY = 2**31 - 1  # tile_emit's key for the unused tail of a fixed budget: sorts after every real key
_SHIFT16 = 2**31 - 2**15  # tile_emit's int32 key, (camera | tile) ^ 0x80000000, plus this: (camera | tile) - 2^15
_SORT_ITEMS = 256 * 16  # keys per radix block (kSortItems)
_programs: dict[str, KernelProgram] = {}


def program(name: str) -> KernelProgram:
    """"project", "tiles" or "raster<D>" (blending of D channels, one unit per D so that a first
    call compiles only the channel count it renders; "raster<D>@A" clamps alpha at A instead of
    ALPHA_MAX): the compiled unit, built lazily, cached."""
    prog = _programs.get(name)
    if prog is None:
        defines = DEFINES
        if name.startswith("raster<"):
            head, _, clamp = name.partition("@")
            d = int(head[7:-1])
            source, names = "gaussians_raster.cu", [f"rasterize_fwd<{d}>", f"rasterize_bwd<{d}>"]
            if clamp:
                defines = {**DEFINES, "RF_ALPHA_MAX": f"({float(clamp)!r}f)"}
        else:
            source, names = {"project": ("gaussians_project.cu", _PROJECT),
                             "tiles": ("gaussians_tiles.cu", _TILES)}[name]
        prog = _programs.setdefault(name, KernelProgram(source, names, defines=defines))
    return prog


def raster_program(D: int, alpha_max: float = ALPHA_MAX) -> KernelProgram:
    """The blending unit for D channels and an alpha clamp (one compiled unit per clamp used)."""
    return program(f"raster<{D}>" if alpha_max == ALPHA_MAX else f"raster<{D}>@{float(alpha_max)!r}")


def default_programs() -> list[KernelProgram]:
    return [program("project"), program("tiles"), *(program(f"raster<{d}>") for d in range(1, MAX_CHANNELS + 1))]


def _p(t: torch.Tensor | None):
    return (0 if t is None else t.data_ptr(), ptr)


def _blocks(n: int, block: int = BLOCK) -> tuple[int]:
    return (-(-n // block),)


def _grad(g: torch.Tensor | None, shape: tuple, device) -> torch.Tensor:
    """An output's incoming gradient as float32 and contiguous, zeros of ``shape`` when autograd has none."""
    return torch.zeros(shape, device=device) if g is None else g.to(torch.float32).contiguous()


# ---------------------------------------------------------------------------- projection


def check_inputs(means, quats, scales, viewmats, Ks) -> int:
    """The bits of kernels.gaussians.VALUE_CHECKS that fail (one host read)."""
    N, C = means.shape[0], viewmats.shape[0]
    flags = torch.zeros(1, dtype=torch.int32, device=means.device)
    program("project").launch("check_inputs", _blocks(max(N, C)), (BLOCK,),
                              [(N, i64), _p(means), _p(quats), _p(scales), (C, i32), _p(viewmats), _p(Ks), _p(flags)],
                              device=means.device)
    return int(flags)



class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means, quats, scales, viewmats, Ks, opacities, cfg):
        width, height, eps2d, near, far, radius_clip, antialiased = cfg
        C, N = viewmats.shape[0], means.shape[0]
        dev = means.device
        radii = torch.zeros(C, N, 2, dtype=torch.int32, device=dev)
        means2d = torch.zeros(C, N, 2, device=dev)
        depths = torch.zeros(C, N, device=dev)
        conics = torch.zeros(C, N, 3, device=dev)
        comps = torch.zeros(C, N, device=dev)
        if C * N:
            program("project").launch(
                "projection_fwd", _blocks(C * N), (BLOCK,),
                [_p(means), _p(quats), _p(scales), _p(opacities), _p(viewmats), _p(Ks), (C, i32), (N, i32),
                 (width, i32), (height, i32), (eps2d, f32), (near, f32), (far, f32), (radius_clip, f32),
                 (int(antialiased), i32), _p(radii), _p(means2d), _p(depths), _p(conics), _p(comps)],
                device=dev)
        ctx.mark_non_differentiable(radii)
        ctx.save_for_backward(means, quats, scales, viewmats, Ks, radii)
        ctx.cfg = cfg
        return radii, means2d, depths, conics, comps

    @staticmethod
    @once_differentiable
    def backward(ctx, _g_radii, g_means2d, g_depths, g_conics, g_comps):
        means, quats, scales, viewmats, Ks, radii = ctx.saved_tensors
        width, height, eps2d, near, far, _, antialiased = ctx.cfg
        if not any(ctx.needs_input_grad[:3]):
            return None, None, None, None, None, None, None
        C, N = viewmats.shape[0], means.shape[0]
        v_means, v_quats, v_scales = torch.zeros_like(means), torch.zeros_like(quats), torch.zeros_like(scales)
        g_means2d = _grad(g_means2d, (C, N, 2), means.device)
        g_depths = _grad(g_depths, (C, N), means.device)
        g_conics = _grad(g_conics, (C, N, 3), means.device)
        g_comps = None if g_comps is None or not antialiased else g_comps.to(torch.float32).contiguous()
        if C * N:
            program("project").launch(
                "projection_bwd", _blocks(C * N), (BLOCK,),
                [_p(means), _p(quats), _p(scales), _p(viewmats), _p(Ks), (C, i32), (N, i32), (width, i32),
                 (height, i32), (eps2d, f32), (near, f32), (far, f32), _p(radii), _p(g_means2d), _p(g_depths),
                 _p(g_conics), _p(g_comps), _p(v_means), _p(v_quats), _p(v_scales)],
                device=means.device)
        return v_means, v_quats, v_scales, None, None, None, None


def project(means, quats, scales, viewmats, Ks, width, height, eps2d, near, far, radius_clip, antialiased,
            opacities, radii_per_axis) -> Projection:
    cfg = (width, height, float(eps2d), float(near), float(far), float(radius_clip), bool(antialiased))
    radii, means2d, depths, conics, comps = _Project.apply(means, quats, scales, viewmats, Ks, opacities, cfg)
    if not radii_per_axis:
        radii = radii.amax(-1)
    return Projection(radii, means2d, depths, conics, comps if antialiased else None)


# ---------------------------------------------------------------------------- spherical harmonics


def _sh_arrays(coeffs, rest) -> tuple[int, int, tuple]:
    """(K, coefficient sets, the kernels' four array arguments dc, dc_stride, rest, rest_stride) of
    one [..., K, 3] tensor (``rest`` None: coefficient 1 starts 3 floats into each set) or of the
    pair ([..., 1, 3], [..., K - 1, 3]); the same for their gradients."""
    if rest is None:
        K = coeffs.shape[-2]
        return K, coeffs.numel() // (3 * K), (_p(coeffs), (3 * K, i64), (coeffs.data_ptr() + 4 * 3, ptr),
                                              (3 * K, i64))
    K = 1 + rest.shape[-2]
    return K, coeffs.numel() // 3, (_p(coeffs), (3, i64), _p(rest), (3 * (K - 1), i64))


class _SH(torch.autograd.Function):
    """One [..., K, 3] coefficient tensor (``rest`` None), or 3DGS's pair: ``coeffs`` the degree-0
    row [..., 1, 3] and ``rest`` the other K - 1 rows [..., K - 1, 3], read where they lie (the
    kernels take a pointer and a stride for each, csrc/gaussians_project.cu)."""

    @staticmethod
    def forward(ctx, dirs, coeffs, rest, degree):
        K, sets, arrays = _sh_arrays(coeffs, rest)
        items = dirs.numel() // 3
        out = torch.empty(*dirs.shape[:-1], 3, device=dirs.device)
        if items:
            program("project").launch(
                "sh_fwd", _blocks(3 * items, SH_BLOCK), (SH_BLOCK,),
                [(degree, i32), (items, i64), (sets, i64), (K, i32), _p(dirs), *arrays, _p(out)],
                device=dirs.device)
        ctx.save_for_backward(dirs, coeffs, rest)
        ctx.degree = degree
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_colors):
        dirs, coeffs, rest = ctx.saved_tensors
        K, sets, arrays = _sh_arrays(coeffs, rest)
        items = dirs.numel() // 3
        # one thread per (coefficient set, channel), which writes its channel of the set (and, for
        # channel 0, each item's v_dirs); without items nothing is written, so the buffers start at 0
        new = torch.empty_like if items else torch.zeros_like
        v_coeffs, v_rest = new(coeffs), None if rest is None else new(rest)
        v_arrays = _sh_arrays(v_coeffs, v_rest)[2]  # laid out as the coefficients: same strides
        v_dirs = torch.empty_like(dirs) if ctx.needs_input_grad[0] else None
        g_colors = g_colors.to(torch.float32).contiguous()
        if items:
            program("project").launch(
                "sh_bwd", _blocks(3 * sets, SH_BLOCK), (SH_BLOCK,),
                [(ctx.degree, i32), (items, i64), (sets, i64), (K, i32), _p(dirs), *arrays, _p(g_colors),
                 v_arrays[0], v_arrays[2], _p(v_dirs)],
                device=dirs.device)
        return (v_dirs, v_coeffs if ctx.needs_input_grad[1] else None,
                v_rest if ctx.needs_input_grad[2] else None, None)


def spherical_harmonics(degree, dirs, coeffs, rest=None):
    """coeffs [..., K, 3] with the batch dims of dirs [..., 3], or a suffix of them (one set of
    coefficients broadcast over the leading dims, e.g. [C, N, 3] directions and [N, K, 3]); or, with
    ``rest``, coeffs the degree-0 row [..., 1, 3] and rest the K - 1 others [..., K - 1, 3]."""
    return _SH.apply(dirs, coeffs.contiguous(), None if rest is None else rest.contiguous(), int(degree))


# ---------------------------------------------------------------------------- tile binning


def bin_tiles(means2d, radii, depths, tile_size, tile_width, tile_height, check_budget, width=None, height=None,
              conics=None, opacities=None, capacity=None):
    """(tiles_per_gauss [C, N], isect_ids [M], flatten_ids [M], isect_offsets [C, th, tw], needed).

    With conics and opacities (and the image size) tiles that the Gaussian's alpha cannot reach
    at 1/255 are dropped (csrc/gaussians_tiles.cu); without, every tile of the radii's box counts.

    ``capacity``: buffers of that many intersections, sized without reading the count back (what a
    CUDA graph needs). ``needed`` is then the count the view needed, a [1] int64 device tensor; only
    the first min(needed, capacity) entries are real, and past the capacity the farthest Gaussians'
    tiles are the ones left out. Without a capacity M is exact (one host read) and ``needed`` None."""
    C, N = depths.shape
    CN, dev = C * N, depths.device
    n_tiles = tile_width * tile_height
    _, tile_bits = key_bits(C, n_tiles)
    width = tile_width * tile_size if width is None else width
    height = tile_height * tile_size if height is None else height
    prog = program("tiles")
    counts = torch.empty(CN, dtype=torch.int32, device=dev)  # tile_counts writes every entry
    box = [_p(means2d), _p(radii), (int(radii.ndim == 3), i32), _p(conics), _p(opacities), (tile_size, i32),
           (tile_width, i32), (tile_height, i32), (width, i32), (height, i32)]
    if CN:
        prog.launch("tile_counts", _blocks(CN), (BLOCK,), [(CN, i64), *box, _p(counts)], device=dev)
    order = torch.sort(depths.reshape(-1), stable=True).indices  # depth first, ties in Gaussian order
    ends = torch.cumsum(counts[order], 0)
    needed = None
    if capacity is None:
        M = int(ends[-1]) if CN else 0  # host sync: how many intersections to allocate
        check_budget(M)
    else:
        M = int(capacity)
        check_budget(M)
        needed = ends[-1:] if CN else torch.zeros(1, dtype=torch.int64, device=dev)
    flatten_ids = torch.empty(M, dtype=torch.int32, device=dev)
    isect_ids = torch.empty(M, dtype=torch.int64, device=dev)
    offsets = (torch.empty if M and needed is None else torch.zeros)(C * n_tiles, dtype=torch.int32, device=dev)
    if M and CN:
        # a fixed budget pads the tail with the largest key, which sorts after every real one
        keys = (torch.empty(M, dtype=torch.int32, device=dev) if needed is None
                else torch.full((M,), _PAD_KEY, dtype=torch.int32, device=dev))
        values = torch.empty(M, dtype=torch.int32, device=dev)
        prog.launch("tile_emit", _blocks(CN), (BLOCK,),
                    [(CN, i64), (N, i32), *box, (tile_bits, i32), _p(order), _p(ends), _p(counts), (M, i64),
                     _p(keys), _p(values)], device=dev)
        if SORT == "radix":
            sorted_keys, values = _radix_sort(keys, values, sum(key_bits(C, n_tiles)))
            perm = None
        elif SORT == "torch16" and C * n_tiles < 2**15:
            sorted_keys, perm = sort_keys_int16(keys)
        else:
            sorted_keys, perm = torch.sort(keys, stable=True)
        del keys
        prog.launch("tile_finish", _blocks(M), (BLOCK,),
                    [(M, i64), _p(needed), _p(sorted_keys), _p(perm), _p(values), _p(depths), (tile_bits, i32),
                     (n_tiles, i32), (C * n_tiles, i64), _p(flatten_ids), _p(isect_ids), _p(offsets)], device=dev)
    return counts.view(C, N), isect_ids, flatten_ids, offsets.view(C, tile_height, tile_width), needed


def sort_keys_int16(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(keys, stable=True) for tile_emit's int32 keys when every camera | tile id is below
    2^15: the keys are sorted as int16 (half the radix passes of int32) and widened back. Returns
    (sorted int32 keys, int64 permutation); the tail's padding keys sort last, as they do in int32,
    and come back as other values below _PAD_KEY (tile_finish never reads past the count needed)."""
    narrow = torch.where(keys == _PAD_KEY, 2**15 - 1, keys + _SHIFT16).to(torch.int16)
    sorted16, perm = torch.sort(narrow, stable=True)
    return sorted16.to(torch.int32) - _SHIFT16, perm


def _radix_sort(keys, values, bits):
    """Stable sort of int32 (key, value) pairs by the keys' low ``bits`` bits (ceil(bits / 8) passes)."""
    M, dev = keys.numel(), keys.device
    blocks = -(-M // _SORT_ITEMS)
    prog = program("tiles")
    hist = torch.empty(256 * blocks, dtype=torch.int32, device=dev)
    keys_alt, values_alt = torch.empty_like(keys), torch.empty_like(values)
    for shift in range(0, bits, 8):
        prog.launch("radix_histogram", (blocks,), (256,), [(M, i64), _p(keys), (shift, i32), _p(hist)], device=dev)
        offsets = torch.cumsum(hist, 0) - hist  # exclusive, int64
        prog.launch("radix_scatter", (blocks,), (256,),
                    [(M, i64), _p(keys), _p(values), (shift, i32), _p(offsets), _p(keys_alt), _p(values_alt)],
                    device=dev)
        keys, keys_alt, values, values_alt = keys_alt, keys, values_alt, values
    return keys, values


def intersect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height, check_budget):
    counts, isect_ids, flatten_ids, _, _ = bin_tiles(means2d, radii, depths, tile_size, tile_width, tile_height,
                                                     check_budget)
    return counts, isect_ids, flatten_ids


def isect_offset_encode(isect_ids, n_cameras, tile_width, tile_height):
    M, n_tiles = isect_ids.numel(), tile_width * tile_height
    _, tile_bits = key_bits(n_cameras, n_tiles)
    offsets = (torch.empty if M else torch.zeros)(n_cameras * n_tiles, dtype=torch.int32, device=isect_ids.device)
    if M:
        program("tiles").launch("tile_offsets", _blocks(M), (BLOCK,),
                                [(M, i64), _p(isect_ids), (tile_bits, i32), (n_tiles, i32),
                                 (n_cameras * n_tiles, i64), _p(offsets)], device=isect_ids.device)
    return offsets.view(n_cameras, tile_height, tile_width)


# ---------------------------------------------------------------------------- blending


def _smem(tile_size: int, D: int, backward: bool) -> int:
    """Dynamic shared memory of rasterize_fwd / rasterize_bwd (csrc/gaussians_raster.cu)."""
    per_thread = 16 + 8 + 4 * D + 4 + (4 * 16 + 4 if backward else 0)  # entry, colour, warp mask (+ sums, id)
    return tile_size * tile_size * per_thread


def _raster_launch(name: str, tile_size: int, D: int, backward: bool, grid, args, device,
                   alpha_max: float = ALPHA_MAX) -> None:
    prog = raster_program(D, alpha_max)
    nbytes = _smem(tile_size, D, backward)
    if nbytes > 48 * 1024:
        prog.set_max_dynamic_shared(name, nbytes, device)
    prog.launch(name, grid, (tile_size, tile_size), args, device=device, shared_mem=nbytes)


class _Rasterize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, cfg,
                absgrad_target, needed):
        width, height, tile_size, alpha_max = cfg
        C, D = colors.shape[0], colors.shape[-1]
        th, tw = isect_offsets.shape[1:]
        dev = means2d.device
        out = torch.empty(C, height, width, D, device=dev)
        alphas = torch.empty(C, height, width, device=dev)
        T = torch.empty(C, height, width, device=dev)
        last_ids = torch.empty(C, height, width, dtype=torch.int32, device=dev)
        _raster_launch(f"rasterize_fwd<{D}>", tile_size, D, False, (tw, th, C),
                       [_p(means2d), _p(conics), _p(colors), _p(opacities), _p(backgrounds), _p(isect_offsets),
                        _p(flatten_ids), (flatten_ids.numel(), i32), _p(needed), (width, i32), (height, i32),
                        _p(out), _p(alphas), _p(T), _p(last_ids)], dev, alpha_max)
        ctx.save_for_backward(means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, T,
                              last_ids, needed)
        ctx.cfg, ctx.absgrad_target = cfg, absgrad_target
        return out, alphas.view(C, height, width, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out, g_alphas):
        (means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, T, last_ids,
         needed) = ctx.saved_tensors
        width, height, tile_size, alpha_max = ctx.cfg
        C, D = colors.shape[0], colors.shape[-1]
        th, tw = isect_offsets.shape[1:]
        dev = means2d.device
        g_out = _grad(g_out, (C, height, width, D), dev)
        g_alphas = None if g_alphas is None else g_alphas.to(torch.float32).contiguous()
        v_means2d, v_conics = torch.zeros_like(means2d), torch.zeros_like(conics)
        v_colors, v_opac = torch.zeros_like(colors), torch.zeros_like(opacities)
        v_abs = torch.zeros_like(means2d) if ctx.absgrad_target is not None else None
        _raster_launch(f"rasterize_bwd<{D}>", tile_size, D, True, (tw, th, C),
                       [_p(means2d), _p(conics), _p(colors), _p(opacities), _p(backgrounds), _p(isect_offsets),
                        _p(flatten_ids), (flatten_ids.numel(), i32), _p(needed), (width, i32), (height, i32),
                        _p(T), _p(last_ids), _p(g_out), _p(g_alphas), _p(v_means2d), _p(v_abs), _p(v_conics),
                        _p(v_colors), _p(v_opac)], dev, alpha_max)
        v_bg = None
        if backgrounds is not None and ctx.needs_input_grad[4]:
            v_bg = (g_out * T[..., None]).sum((1, 2))
        if v_abs is not None:
            ctx.absgrad_target.absgrad = v_abs
        return v_means2d, v_conics, v_colors, v_opac, v_bg, None, None, None, None, None


def rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                        backgrounds, absgrad, needed=None, alpha_max: float = ALPHA_MAX):
    target = means2d if absgrad else None
    if means2d.data_ptr() % 8:  # float2 loads need an 8-byte aligned base (a view at an odd offset)
        means2d = means2d.clone()
    cfg = (width, height, tile_size, float(alpha_max))
    D = colors.shape[-1]
    if D <= MAX_CHANNELS:
        return _Rasterize.apply(means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, cfg,
                                target, needed)
    if absgrad:
        raise ValueError(f"absgrad needs at most {MAX_CHANNELS} colour channels on CUDA (|dL/dmeans2d| per pixel "
                         f"is not a sum over channel chunks), got {D}")
    outs, alphas = [], None
    for k in range(0, D, MAX_CHANNELS):
        bg = None if backgrounds is None else backgrounds[:, k:k + MAX_CHANNELS].contiguous()
        out, alpha = _Rasterize.apply(means2d, conics, colors[..., k:k + MAX_CHANNELS].contiguous(), opacities, bg,
                                      isect_offsets, flatten_ids, cfg, None, needed)
        outs.append(out)
        alphas = alpha if alphas is None else alphas  # the first chunk's alpha carries its gradient
    return torch.cat(outs, -1), alphas
