"""Multi-resolution hash encoding (instant-ngp): public function, autograd wrapper, nn.Module.

Paper: Mueller, Evans, Schied, Keller, "Instant Neural Graphics Primitives with a Multiresolution Hash
Encoding", SIGGRAPH 2022. CUDA source: ``csrc/hashgrid.cu``; reference: ``_reference.hash_encode_reference``.

Example:
    >>> import torch, kernels
    >>> res = kernels.grid_resolutions(levels=4, base_resolution=16, max_resolution=128)
    >>> res
    [16, 32, 64, 128]
    >>> table = torch.zeros(4, 2**14, 2)
    >>> kernels.hash_encode(torch.rand(5, 3), table, res).shape
    torch.Size([5, 8])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from . import _driver
from ._driver import KernelProgram, f32, ptr, u32
from ._reference import grid_vertices, hash_encode_reference

# Launch configuration, chosen with `benchmarks/bench_kernels.py --variants` on an H200 (2^21 random
# points, L=16, F=2, T=2^19): G = 4 ran the forward in 1.11 ms fp32 / 0.98 ms fp16 (30 / 34 G
# level-lookups/s) against 1.40 / 1.01 ms with G = 0 and 1.60 / 1.56 ms with G = 1; merging x-pairs
# saved 6% forward and 24% backward; block sizes 128..512 were within 1% of each other.
BLOCK_SIZE = 256
# Levels per block row (the kernel's template G): None picks 8 // F, so one thread group writes a
# whole 32-byte output sector per point and the table working set is G levels at a time; 0 = all
# levels in one row; 1 = one level per row. See csrc/hashgrid.cu.
LEVELS_PER_BLOCK: int | None = None
# Block-private backward of the coarse dense levels (csrc/hashgrid.cu, hash_encode_bwd_private):
# a leading dense level goes that way when N >= PRIVATE_MIN_HITS x its rows (enough corner updates
# per row for shared-memory accumulation to pay off) and its rows fit in at most PRIVATE_MAX_SLABS
# slabs of shared memory (each group of slabs sharing a block re-reads every point). Slabs that fit
# together in PRIVATE_GROUP_BYTES share a block (one pass over the points). PRIVATE_SMEM_BYTES: shared
# memory per block (None: the device's opt-in maximum less 1 KiB, at most 200 KiB); 0 turns it off.
# Measured on an H200 (2^21 random points, L=16, T=2^19, fp32; bench_kernels.py --variants), two
# separate single-slab passes for levels 0 and 1 cut the backward from 2.25 to 2.13 ms, while
# splitting levels 2 and 3 into 2 and 4 slabs made it slower (2.36 / 2.85 ms): a pass over all
# points costs more than the atomics a slab saves; levels 0 + 1 sharing one 137 KiB block: 2.30 ms.
PRIVATE_MIN_HITS = 16
PRIVATE_MAX_SLABS = 1
PRIVATE_SMEM_BYTES: int | None = None
PRIVATE_BLOCK = 512
PRIVATE_GROUP_BYTES = 96 * 1024
_TABLE_DTYPES = (torch.float32, torch.float16)
_CTYPE_NAMES = {torch.float32: "float", torch.float16: "__half"}
# Items (point, level) per launch stay below 2^31 so the kernel's uint32 thread index cannot wrap.
_MAX_ITEMS = 2**31 - 2**20
_MAX_RESOLUTION = 2**24  # float32 represents every cell index exactly up to here


def levels_per_block(features: int, group: int | None = None) -> int:
    """The kernel's G for ``features`` per level: ``group``, else LEVELS_PER_BLOCK, else 8 // F."""
    if group is None:
        group = LEVELS_PER_BLOCK
    if group is None:
        group = max(1, 8 // features)
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ValueError(f"levels per block must be an int >= 0, got {group!r}")
    return group


def _fwd_name(dtype: torch.dtype, features: int, group: int) -> str:
    return f"hash_encode_fwd<{_CTYPE_NAMES[dtype]}, {features}, {group}>"


def _bwd_name(features: int, group: int) -> str:
    return f"hash_encode_bwd<{features}, {group}>"


def _private_name(features: int) -> str:
    return f"hash_encode_bwd_private<{features}>"


_programs: dict[tuple, KernelProgram] = {}
_launch_specs: dict[tuple, tuple] = {}


def program(features: int = 2, group: int | None = None,
            defines: dict | None = None) -> KernelProgram:
    """The compiled unit for ``features`` per level and ``group`` levels per block row: forward for
    fp32 and fp16 tables, and backward. ``defines``: see csrc/hashgrid.cu (benchmark variants)."""
    group = levels_per_block(features, group)
    key = (features, group, tuple(sorted((defines or {}).items())))
    prog = _programs.get(key)
    if prog is None:
        names = [_fwd_name(dt, features, group) for dt in _TABLE_DTYPES]
        names += [_bwd_name(features, group), _private_name(features)]
        prog = _programs.setdefault(key, KernelProgram("hashgrid.cu", names, defines=defines))
    return prog


def _launch_spec(features: int, group: int | None, defines: dict | None):
    """(program, G, {table dtype: forward name}, backward name), memoised: the per-call path."""
    key = (features, group, None if not defines else tuple(sorted(defines.items())),
           LEVELS_PER_BLOCK)
    spec = _launch_specs.get(key)
    if spec is None:
        g = levels_per_block(features, group)
        spec = (program(features, g, defines), g,
                {dt: _fwd_name(dt, features, g) for dt in _TABLE_DTYPES}, _bwd_name(features, g))
        _launch_specs[key] = spec
    return spec


def default_programs() -> list[KernelProgram]:
    """What HashGrid's defaults (F = 2) use: the programs a first training step compiles."""
    return [program(2)]


def _launch_grid(n: int, levels: int, group: int, block: int) -> tuple[int, int]:
    per_row = levels if group == 0 else group
    rows = -(-levels // per_row)
    return -(-n * per_row // block), rows


def grid_resolutions(levels: int, base_resolution: int, max_resolution: int) -> list[int]:
    """Per-level grid resolutions of instant-ngp: ``R_l = floor(base * b**l)``.

    ``b = exp((ln max - ln base) / (L - 1))`` (paper Eq. 2-3); one level gives ``[base]``.

    Args:
        levels: L >= 1.
        base_resolution: coarsest resolution, >= 1.
        max_resolution: finest resolution, >= base (instant-ngp: 2048 * aabb_scale).

    Returns:
        L non-decreasing ints from ``base_resolution`` to ``max_resolution``.

    Example:
        >>> grid_resolutions(16, 16, 2048)[:4], grid_resolutions(16, 16, 2048)[-1]
        ([16, 22, 30, 42], 2048)
    """
    for name, value, low in (("levels", levels, 1), ("base_resolution", base_resolution, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if isinstance(max_resolution, bool) or not isinstance(max_resolution, int) \
            or max_resolution < base_resolution:
        raise ValueError(f"max_resolution must be an int >= base_resolution={base_resolution}, "
                         f"got {max_resolution!r}")
    if levels == 1:
        return [base_resolution]
    growth = math.exp((math.log(max_resolution) - math.log(base_resolution)) / (levels - 1))
    # The 1e-9 relative nudge keeps floor(16 * b**15) at 2048 rather than 2047.9999999.
    return [int(math.floor(base_resolution * growth**level * (1 + 1e-9))) for level in range(levels)]


def check_offset(offset) -> float:
    """``offset`` as a float in [0, 1), or ValueError naming it."""
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not 0.0 <= float(offset) < 1.0:
        raise ValueError(f"offset must be a number in [0, 1), got {offset!r}")
    return float(offset)


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


_res_cache: dict[tuple, torch.Tensor] = {}


def _validate(points, table, resolutions) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """Check hash_encode's arguments; return ``resolutions`` as an int32 tensor on table's device,
    and as host ints when they are known without a device read (a list, or a CPU tensor)."""
    _check_tensor("points", points, 2)
    if points.shape[1] != 3:
        raise ValueError(f"points must have shape [N, 3], got {tuple(points.shape)}")
    if points.dtype != torch.float32:
        raise ValueError(f"points must be float32, got {points.dtype}")
    if not points.is_contiguous():
        raise ValueError(f"points must be contiguous, got strides {points.stride()}")
    _check_tensor("table", table, 3)
    if table.dtype not in _TABLE_DTYPES:
        raise ValueError(f"table must be float32 or float16, got {table.dtype}")
    if not table.is_contiguous():
        raise ValueError(f"table must be contiguous, got strides {table.stride()}")
    levels, size, features = table.shape
    if levels < 1 or size < 1 or features < 1:
        raise ValueError(f"table must have shape [L, T, F] with L, T, F >= 1, got {tuple(table.shape)}")
    if size >= 2**32:
        raise ValueError(f"table size T must be < 2^32, got {size}")
    if points.device != table.device:
        raise ValueError(f"points and table must be on one device, got points on {points.device} "
                         f"and table on {table.device}")
    if isinstance(resolutions, torch.Tensor):
        if resolutions.ndim != 1 or resolutions.shape[0] != levels:
            raise ValueError(f"resolutions must have shape [{levels}] (one per level of table), "
                             f"got {tuple(resolutions.shape)}")
        if resolutions.dtype != torch.int32:
            raise ValueError(f"resolutions must be int32, got {resolutions.dtype}")
        if resolutions.device != table.device:
            raise ValueError(f"resolutions must be on table's device {table.device}, "
                             f"got {resolutions.device}")
        if resolutions.device.type == "cpu":  # on a GPU this check would cost a sync every call
            host = tuple(resolutions.tolist())
            bad = [r for r in host if not 1 <= r <= _MAX_RESOLUTION]
            if bad:
                raise ValueError(f"resolutions must be in [1, 2^24], got {bad}")
            return resolutions.contiguous(), host
        return resolutions.contiguous(), None
    if not isinstance(resolutions, Sequence) or isinstance(resolutions, str):
        raise ValueError(f"resolutions must be an int32 tensor or a list of ints, "
                         f"got {type(resolutions).__name__}")
    values = tuple(resolutions)
    if len(values) != levels:
        raise ValueError(f"resolutions must have {levels} entries (one per level of table), "
                         f"got {len(values)}: {list(values)}")
    bad = [r for r in values if isinstance(r, bool) or not isinstance(r, int)
           or not 1 <= r <= _MAX_RESOLUTION]
    if bad:
        raise ValueError(f"resolutions must be ints in [1, 2^24], got {bad}")
    key = (values, table.device)
    cached = _res_cache.get(key)
    if cached is None:
        if len(_res_cache) > 64:
            _res_cache.clear()
        cached = _res_cache[key] = torch.tensor(values, dtype=torch.int32, device=table.device)
    return cached, values


def _aligned(t: torch.Tensor) -> bool:
    """The kernels' vector loads and atomics (up to 16 bytes) need a 16-byte aligned base."""
    return t.data_ptr() % 16 == 0


def _forward_cuda(points: torch.Tensor, table: torch.Tensor, res: torch.Tensor,
                  group: int | None = None, block: int | None = None,
                  defines: dict | None = None, offset: float = 0.0) -> torch.Tensor:
    n = points.shape[0]
    levels, size, features = table.shape
    prog, group, fwd_names, _ = _launch_spec(features, group, defines)
    block = block or BLOCK_SIZE
    out = torch.empty((n, levels * features), dtype=torch.float32, device=points.device)
    if n == 0:
        return out
    prog.launch(
        fwd_names[table.dtype], _launch_grid(n, levels, group, block), (block,),
        [(points.data_ptr(), ptr), (table.data_ptr(), ptr), (res.data_ptr(), ptr),
         (out.data_ptr(), ptr), (n, u32), (levels, u32), (size, u32), (offset, f32)],
        device=points.device)
    return out


def private_plan(n: int, resolutions: Sequence[int], table_size: int, features: int,
                 smem_bytes: int, offset: float = 0.0) -> tuple[int, list[tuple[int, int, int]]]:
    """Which leading levels the backward accumulates block-privately, and their slabs (``offset``:
    the grid offset, which sets the vertices per axis; see :func:`grid_vertices`).

    Returns:
        (l0, slabs): levels 0..l0-1 go to ``hash_encode_bwd_private``, the rest to
        ``hash_encode_bwd``; ``slabs`` lists (level, first row, rows) with rows * features * 4
        <= smem_bytes. (0, []) when no level qualifies (see PRIVATE_MIN_HITS, PRIVATE_MAX_SLABS).
    """
    rows_per_slab = smem_bytes // (4 * features)
    slabs: list[tuple[int, int, int]] = []
    l0 = 0
    if rows_per_slab < 1:
        return 0, slabs
    for level, r in enumerate(resolutions):
        rows = grid_vertices(r, offset) ** 3
        if rows > table_size:  # a hashed level; resolutions ascend, so the rest are too
            break
        k = -(-rows // rows_per_slab)
        if n < PRIVATE_MIN_HITS * rows or k > PRIVATE_MAX_SLABS:
            break
        per = -(-rows // k)
        slabs += [(level, i * per, min(per, rows - i * per)) for i in range(k)]
        l0 = level + 1
    return l0, slabs


def pack_groups(slabs: Sequence[tuple[int, int, int]], rows_per_block: int
                ) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """Consecutive slabs that fit in one block's shared memory together, for one pass over points.

    Returns:
        (entries, offsets): per slab (level, first row, rows, row offset in its block's shared
        memory); group g is entries[offsets[g]:offsets[g + 1]].
    """
    entries: list[tuple[int, int, int, int]] = []
    offsets = [0]
    used = 0
    for level, row0, rows in slabs:
        if entries and used + rows > rows_per_block:
            offsets.append(len(entries))
            used = 0
        entries.append((level, row0, rows, used))
        used += rows
    if entries:
        offsets.append(len(entries))
    return entries, offsets


_device_info: dict[int, tuple[int, int]] = {}
_slab_tensors: dict[tuple, torch.Tensor] = {}


def _smem_and_sms(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    info = _device_info.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        optin = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
        info = _device_info[index] = (min(optin - 1024, 200 * 1024), int(props.multi_processor_count))
    return info


def _backward_cuda(points: torch.Tensor, grad_out: torch.Tensor, res: torch.Tensor,
                   table_shape: torch.Size, table_dtype: torch.dtype,
                   group: int | None = None, block: int | None = None,
                   defines: dict | None = None,
                   res_host: Sequence[int] | None = None, offset: float = 0.0) -> torch.Tensor:
    n = points.shape[0]
    levels, size, features = table_shape
    prog, group, _, bwd_name = _launch_spec(features, group, defines)
    block = block or BLOCK_SIZE
    # fp32 accumulator whatever the table dtype (see csrc/hashgrid.cu): fp16 atomics would round
    # each partial sum of a coarse-level entry (thousands of contributions) to 11 bits.
    grad = torch.zeros(table_shape, dtype=torch.float32, device=points.device)
    grad_out = grad_out.to(torch.float32).contiguous()
    if not _aligned(grad_out):
        grad_out = grad_out.clone()
    if n == 0:
        return grad if table_dtype == torch.float32 else grad.to(table_dtype)
    l0, slabs = 0, []
    if res_host is not None and PRIVATE_SMEM_BYTES != 0:
        smem_max, sms = _smem_and_sms(points.device)
        smem = smem_max if PRIVATE_SMEM_BYTES is None else min(PRIVATE_SMEM_BYTES, smem_max)
        l0, slabs = private_plan(n, res_host, size, features, smem, offset)
    args = [(points.data_ptr(), ptr), (grad_out.data_ptr(), ptr), (res.data_ptr(), ptr)]
    if slabs:
        # Slabs share a block only within PRIVATE_GROUP_BYTES: bigger blocks cost occupancy (levels
        # 0 + 1 of the default grid in one 137 KiB block ran no faster than direct atomics).
        entries, offsets = pack_groups(slabs, min(smem, PRIVATE_GROUP_BYTES) // (4 * features))
        key = (tuple(entries), points.device)
        plan = _slab_tensors.get(key)
        if plan is None:
            if len(_slab_tensors) > 64:
                _slab_tensors.clear()
            flat = [v for e in entries for v in e] + offsets
            plan = _slab_tensors[key] = torch.tensor(flat, dtype=torch.int32, device=points.device)
        groups = len(offsets) - 1
        nbytes = max(sum(e[2] for e in entries[offsets[g]:offsets[g + 1]]) for g in range(groups)) * features * 4
        name = _private_name(features)
        prog.set_max_dynamic_shared(name, nbytes, points.device)
        per_group = max(1, min(-(-sms // groups) * 2, -(-n // PRIVATE_BLOCK)))
        prog.launch(name, (per_group, groups), (PRIVATE_BLOCK,),
                    args + [(plan.data_ptr(), ptr), (plan.data_ptr() + 16 * len(entries), ptr),
                            (grad.data_ptr(), ptr), (n, u32), (levels, u32), (size, u32), (offset, f32)],
                    device=points.device, shared_mem=nbytes)
    if l0 < levels:
        prog.launch(bwd_name, _launch_grid(n, levels - l0, group, block), (block,),
                    args + [(grad.data_ptr(), ptr), (n, u32), (levels, u32), (size, u32), (l0, u32),
                            (offset, f32)],
                    device=points.device)
    return grad if table_dtype == torch.float32 else grad.to(table_dtype)


class _HashEncode(torch.autograd.Function):
    """CUDA forward and backward; gradient for ``table`` only (``points`` gets None)."""

    @staticmethod
    def forward(ctx, points, table, resolutions, group=None, block=None, defines=None, res_host=None,
                offset=0.0):
        out = _forward_cuda(points, table, resolutions, group, block, defines, offset)
        ctx.save_for_backward(points, resolutions)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        ctx.launch = (group, block, defines, res_host, offset)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grad_table = None
        if ctx.needs_input_grad[1]:
            points, resolutions = ctx.saved_tensors
            grad_table = _backward_cuda(points, grad_out, resolutions, ctx.table_shape,
                                        ctx.table_dtype, *ctx.launch)
        # points: not differentiated by the kernel (NeRF sample positions need no gradient);
        # resolutions and the launch settings: not differentiable.
        return None, grad_table, None, None, None, None, None, None


def _use_kernels(device: torch.device, use_kernels: bool | None) -> bool:
    if use_kernels is False:
        return False
    if device.type != "cuda":
        if use_kernels:
            raise ValueError(f"use_kernels=True needs CUDA tensors, got tensors on {device}")
        return False
    if not _driver.available():
        if use_kernels:
            raise RuntimeError(f"use_kernels=True but CUDA kernels cannot run here: "
                               f"{_driver.unavailable_reason()}")
        return False
    return True


def hash_encode(points: torch.Tensor, table: torch.Tensor,
                resolutions: torch.Tensor | Sequence[int], *,
                use_kernels: bool | None = None, offset: float = 0.0) -> torch.Tensor:
    """Multi-resolution hash encoding: trilinear lookups in one hashed grid per level.

    Per level l with R = resolutions[l]: ``pos = clamp(x, 0, 1) * R + offset``,
    ``cell = min(floor(pos), V-2)`` with V = :func:`grid_vertices` per axis (R+1, or R+2 with an offset),
    trilinear interpolation over the cell's 8 corners (integer corners in [0, V-1]) of rows
    ``x + y V + z V^2`` when ``V^3 <= T`` (dense), else of the spatial hash
    ``(x * 1 ^ y * 2654435761 ^ z * 805459861) mod T`` (uint32).

    Args:
        points: [N, 3] float32, contiguous, positions normalised into the scene box ([0, 1], clamped).
        table: [L, T, F] float32 or float16, contiguous, the features.
        resolutions: [L] int32 tensor on table's device, or a list of L ints (see grid_resolutions).
        use_kernels: None picks the CUDA kernel when the tensors are on a GPU and
            :func:`kernels.available`, else the PyTorch reference; True insists on the kernel; False
            always runs the reference.
        offset: in [0, 1), added to every level's grid coordinate; 0.5 is tiny-cuda-nn's half-cell
            shift, which staggers the levels' vertices.

    Returns:
        [N, L * F] float32, level-major (``out[:, l * F + f]``). Differentiable in ``table``; the
        CUDA path returns no gradient for ``points`` (the reference does).

    Raises:
        ValueError: an argument's shape, dtype, device or layout is wrong (the message names it).

    Example:
        >>> table = torch.arange(2 * 27 * 1, dtype=torch.float32).reshape(2, 27, 1)
        >>> # level 0 (R=1): centre of the one cell, mean of rows 0..7; level 1 (R=2): corner row 13
        >>> hash_encode(torch.tensor([[0.5, 0.5, 0.5]]), table, [1, 2])
        tensor([[ 3.5000, 40.0000]])
    """
    res, res_host = _validate(points, table, resolutions)
    offset = check_offset(offset)
    if not _use_kernels(points.device, use_kernels):
        return hash_encode_reference(points, table, res, offset=offset)
    levels = table.shape[0]
    if points.shape[0] * levels > _MAX_ITEMS:
        chunk = _MAX_ITEMS // levels
        res_arg = list(res_host) if res_host is not None else res
        return torch.cat([hash_encode(p, table, res_arg, use_kernels=True, offset=offset)
                          for p in points.split(chunk)])
    if not _aligned(table):
        table = table.clone()  # a view at an odd offset; clone is differentiable, so grads still flow
    if not _aligned(points):
        points = points.clone()  # no vector loads of points, but keep every base alike
    return _HashEncode.apply(points, table, res, None, None, None, res_host, offset)


class HashGrid(torch.nn.Module):
    """instant-ngp's multi-resolution hash grid as a module: ``[N, 3] in [0, 1] -> [N, L * F]``.

    Args:
        levels: L, number of resolutions.
        features_per_level: F.
        log2_hashmap_size: T = 2**log2_hashmap_size rows per level.
        base_resolution: coarsest grid resolution.
        max_resolution: finest; instant-ngp uses 2048 * aabb_scale.
        dtype: table dtype, float32 or float16 (output is float32 either way).
        use_kernels: None = CUDA kernel when on a GPU and kernels.available(); True/False force it.
        offset: the grid offset of :func:`hash_encode` (0: every level's vertices include the box's
            corners; 0.5: tiny-cuda-nn's staggered levels).

    Attributes:
        table: Parameter [L, T, F], initialised uniform(-1e-4, 1e-4) from the caller's torch RNG.
        resolutions: int32 buffer [L].
        output_dim: L * F.

    Example:
        >>> grid = HashGrid(levels=4, log2_hashmap_size=12, base_resolution=4, max_resolution=32)
        >>> grid(torch.rand(10, 3)).shape, grid.output_dim
        (torch.Size([10, 8]), 8)
    """

    def __init__(self, levels: int = 16, features_per_level: int = 2, log2_hashmap_size: int = 19,
                 base_resolution: int = 16, max_resolution: int = 2048,
                 dtype: torch.dtype = torch.float32, use_kernels: bool | None = None,
                 offset: float = 0.0):
        super().__init__()
        self.offset = check_offset(offset)
        if dtype not in _TABLE_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float16, got {dtype}")
        for name, value in (("features_per_level", features_per_level),
                            ("log2_hashmap_size", log2_hashmap_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if log2_hashmap_size > 31:
            raise ValueError(f"log2_hashmap_size must be <= 31, got {log2_hashmap_size}")
        resolutions = grid_resolutions(levels, base_resolution, max_resolution)
        self.levels, self.features_per_level = levels, features_per_level
        self.log2_hashmap_size, self.table_size = log2_hashmap_size, 2**log2_hashmap_size
        self.base_resolution, self.max_resolution = base_resolution, max_resolution
        self.output_dim = levels * features_per_level
        self.use_kernels = use_kernels
        self.register_buffer("resolutions", torch.tensor(resolutions, dtype=torch.int32))
        self._resolutions_host = list(resolutions)  # lets the backward plan without a device read
        init = torch.empty(levels, self.table_size, features_per_level).uniform_(-1e-4, 1e-4)
        self.table = torch.nn.Parameter(init.to(dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the levels' resolutions come with the state (a model whose finest level was chosen from its
        # scene, nerf.max_resolution auto, is rebuilt without the scene to render)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._resolutions_host = [int(r) for r in self.resolutions.tolist()]
        self.max_resolution = self._resolutions_host[-1]

    def extra_repr(self) -> str:
        return (f"levels={self.levels}, features_per_level={self.features_per_level}, "
                f"log2_hashmap_size={self.log2_hashmap_size}, resolutions="
                f"{self.base_resolution}..{self.max_resolution}, dtype={self.table.dtype}, offset={self.offset}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` [..., 3] in [0, 1] (cast to float32) into [..., L * F] float32."""
        if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] != 3:
            raise ValueError(f"x must have shape [..., 3], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        lead = x.shape[:-1]
        points = x.reshape(-1, 3).to(torch.float32).contiguous()
        out = hash_encode(points, self.table, self._resolutions_host, use_kernels=self.use_kernels,
                          offset=self.offset)
        return out.reshape(*lead, self.output_dim)
