"""Hash encoding: argument checks, the reference against a naive loop, gradcheck, HashGrid training;
on a GPU, the CUDA kernels against the reference."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import hash_encode, hash_encode_reference, hashgrid, loader
from kernels._reference import grid_index

try:
    from conftest import requires_gpu
except ImportError:  # conftest absent or changed: same marker, defined here
    requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EPS32 = 2.0**-24  # unit roundoff of float32
EPS16 = 2.0**-11  # unit roundoff of float16


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def naive_encode(points: torch.Tensor, table: torch.Tensor, resolutions: list[int],
                 offset: float = 0.0) -> torch.Tensor:
    """One point, one level, one corner at a time in Python floats and ints: the spec, written out."""
    levels, size, features = table.shape
    tab = table.double().tolist()
    out = torch.zeros(points.shape[0], levels * features, dtype=torch.float64)
    for i, p in enumerate(points.double().tolist()):
        for lvl, r in enumerate(resolutions):
            v1 = r + (2 if offset else 1)  # vertices per axis
            pos = [min(max(v, 0.0), 1.0) * r + offset for v in p]
            cell = [min(math.floor(q), v1 - 2) for q in pos]
            frac = [q - c for q, c in zip(pos, cell)]
            for dx in (0, 1):
                for dy in (0, 1):
                    for dz in (0, 1):
                        x, y, z = cell[0] + dx, cell[1] + dy, cell[2] + dz
                        w = ((frac[0] if dx else 1 - frac[0]) * (frac[1] if dy else 1 - frac[1])
                             * (frac[2] if dz else 1 - frac[2]))
                        assert max(x, y, z) < v1
                        if v1 ** 3 <= size:
                            row = x + y * v1 + z * v1 ** 2
                        else:
                            row = ((x * 1) ^ (y * 2654435761) ^ (z * 805459861)) % 2**32 % size
                        for f in range(features):
                            out[i, lvl * features + f] += w * tab[lvl][row][f]
    return out


def _special_points() -> torch.Tensor:
    """Corners of the box, cell boundaries, and points outside it (clamped)."""
    return torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.25, 0.75], [-0.3, 1.4, 0.5],
                         [1.0, 0.0, 0.999999], [0.1, 0.2, 0.3]])


# T = 64: R = 2 and 3 are dense ((R+1)^3 = 27, 64: the boundary), R = 7 and 20 are hashed; T = 60
# is not a power of two, so the hash takes the modulo path rather than the mask. With the half-cell
# offset a level has R + 2 vertices per axis: R = 2 is dense (64 <= 64), R = 3 is hashed (125).
@pytest.mark.parametrize("offset", [0.0, 0.5])
@pytest.mark.parametrize("size, resolutions", [(64, [2, 3, 7, 20]), (60, [1, 3, 5, 16])])
def test_reference_matches_naive_loop(size, resolutions, offset):
    g = torch.Generator().manual_seed(0)
    points = torch.cat([_special_points(), torch.rand(10, 3, generator=g)])
    table = torch.rand(len(resolutions), size, 3, generator=g, dtype=torch.float64) * 2 - 1
    expected = naive_encode(points, table, resolutions, offset)
    # float64 reference on the same arithmetic: only summation order differs (1e-12 is ~1e4 ulp).
    got64 = hash_encode_reference(points.double(), table, resolutions, offset=offset)
    torch.testing.assert_close(got64, expected, rtol=0, atol=1e-12)
    # float32 public path: x * R rounded to float32 moves weights by <= R * 2^-24 (R <= 20 here),
    # times |feature| <= 1 summed over 8 corners -> well under 1e-5.
    got32 = hash_encode(points, table.float(), resolutions, offset=offset)
    assert got32.dtype == torch.float32 and got32.shape == (16, 3 * len(resolutions))
    torch.testing.assert_close(got32.double(), expected, rtol=0, atol=1e-5)


def test_dense_and_hashed_rows():
    corners = torch.tensor([[1, 2, 3], [4, 0, 7]])
    assert grid_index(corners, 7, 512).tolist() == [1 + 2 * 8 + 3 * 64, 4 + 7 * 64]
    # with an offset R = 7 has 9 vertices per axis: 729 rows, dense in T = 729, hashed in 728
    assert grid_index(corners, 7, 729, offset=0.5).tolist() == [1 + 2 * 9 + 3 * 81, 4 + 7 * 81]
    assert grid_index(corners, 7, 728, offset=0.5).tolist() == [
        ((1 ^ (2 * 2654435761) ^ (3 * 805459861)) & 0xFFFFFFFF) % 728,
        ((4 ^ 0 ^ (7 * 805459861)) & 0xFFFFFFFF) % 728]
    expected = [((1 ^ (2 * 2654435761) ^ (3 * 805459861)) & 0xFFFFFFFF) % 100,
                ((4 ^ 0 ^ (7 * 805459861)) & 0xFFFFFFFF) % 100]
    assert grid_index(corners, 7, 100).tolist() == expected


def test_gradcheck_reference_float64():
    g = torch.Generator().manual_seed(1)
    points = torch.rand(7, 3, generator=g, dtype=torch.float64)
    table = torch.randn(3, 32, 2, generator=g, dtype=torch.float64, requires_grad=True)
    # R = 2 dense (27 <= 32), R = 3 and 5 hashed.
    assert torch.autograd.gradcheck(lambda t: hash_encode_reference(points, t, [2, 3, 5]), (table,))


def test_float16_table_matches_float32_reference_of_its_values():
    g = torch.Generator().manual_seed(2)
    points = torch.rand(50, 3, generator=g)
    table16 = (torch.rand(3, 128, 2, generator=g) * 2 - 1).half().requires_grad_()
    out = hash_encode(points, table16, [2, 6, 40])
    assert out.dtype == torch.float32
    # fp16 -> fp32 is exact, so this is the same computation on the same numbers.
    torch.testing.assert_close(out, hash_encode(points, table16.detach().float(), [2, 6, 40]),
                               rtol=0, atol=0)
    out.sum().backward()
    assert table16.grad.dtype == torch.float16


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-0.5, 1.5, allow_nan=False, width=32), min_size=3, max_size=3),
       st.sampled_from([1, 2, 3, 9]))
def test_invariants_constant_and_linear_tables(xyz, r):
    """Weights sum to 1 (a constant table gives that constant, hashed or not); trilinear
    interpolation reproduces a linear field exactly on a dense level (position = x)."""
    points = torch.tensor([xyz], dtype=torch.float32)
    const = torch.full((2, 8, 1), 0.75)  # T = 8: R = 1 dense, R >= 2 hashed
    torch.testing.assert_close(hash_encode(points, const, [1, r]), torch.full((1, 2), 0.75),
                               rtol=0, atol=1e-6)
    size = (r + 1) ** 3
    idx = torch.arange(size)
    coords = torch.stack([idx % (r + 1), idx // (r + 1) % (r + 1), idx // (r + 1) ** 2], -1)
    linear = (coords.float() / r).reshape(1, size, 3)  # feature f of corner = its coordinate f / R
    out = hash_encode(points, linear, [r])
    torch.testing.assert_close(out, points.clamp(0, 1), rtol=0, atol=1e-6)
    # with the half-cell offset vertex k sits at (k - 0.5) / R: the same field, shifted vertices
    v1 = r + 2
    idx = torch.arange(v1**3)
    coords = torch.stack([idx % v1, idx // v1 % v1, idx // v1**2], -1)
    shifted = ((coords.float() - 0.5) / r).reshape(1, v1**3, 3)
    out = hash_encode(points, shifted, [r], offset=0.5)
    torch.testing.assert_close(out, points.clamp(0, 1), rtol=0, atol=1e-6)


def test_offset_staggers_the_levels():
    """Without an offset the box's corner is a vertex of every level (its feature alone, whatever
    the level); with tiny-cuda-nn's half cell it sits mid-cell, between the first two vertices."""
    table = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 64, 1)  # [2, 3]: 16 and 25 <= 64 dense
    corner = torch.zeros(1, 3)
    assert hash_encode(corner, table, [2, 3]).tolist() == [[0.0, 64.0]]
    # offset 0.5 at x = 0: pos 0.5 on every axis, the mean of rows x + 4 y + 16 z (R = 2, V = 4) and
    # x + 5 y + 25 z (R = 3, V = 5, 125 > 64: hashed) over x, y, z in {0, 1}
    got = hash_encode(corner, table, [2, 3], offset=0.5)
    dense = sum(x + 4 * y + 16 * z for x in (0, 1) for y in (0, 1) for z in (0, 1)) / 8
    assert got[0, 0].item() == pytest.approx(dense)
    for bad in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match="offset"):
            hash_encode(corner, table, [2, 3], offset=bad)


def test_grid_resolutions():
    assert kernels.grid_resolutions(1, 16, 2048) == [16]
    res = kernels.grid_resolutions(16, 16, 2048)
    assert res[0] == 16 and res[-1] == 2048 and res == sorted(res)
    b = math.exp((math.log(2048) - math.log(16)) / 15)
    assert res[5] == math.floor(16 * b**5)
    assert kernels.grid_resolutions(16, 16, 2048 * 4)[-1] == 8192  # aabb_scale = 4
    for bad in [(0, 16, 32), (4, 0, 32), (4, 16, 8), (4.0, 16, 32)]:
        with pytest.raises(ValueError):
            kernels.grid_resolutions(*bad)


# ---------------------------------------------------------------------------- argument checks


def _good():
    return torch.rand(4, 3), torch.zeros(2, 64, 2), [2, 8]


@pytest.mark.parametrize("mutate, match", [
    (lambda p, t, r: (p[:, :2], t, r), r"points must have shape \[N, 3\], got \(4, 2\)"),
    (lambda p, t, r: (p[0], t, r), r"points must have 2 dimensions, got shape \(3,\)"),
    (lambda p, t, r: (p.double(), t, r), "points must be float32, got torch.float64"),
    (lambda p, t, r: (torch.rand(3, 4).t(), t, r), "points must be contiguous"),
    (lambda p, t, r: (p.numpy(), t, r), "points must be a torch.Tensor, got ndarray"),
    (lambda p, t, r: (p, t[0], r), r"table must have 3 dimensions, got shape \(64, 2\)"),
    (lambda p, t, r: (p, t.double(), r), "table must be float32 or float16, got torch.float64"),
    (lambda p, t, r: (p, t.transpose(1, 2), r), "table must be contiguous"),
    (lambda p, t, r: (p, t, [2]), r"resolutions must have 2 entries .*got 1: \[2\]"),
    (lambda p, t, r: (p, t, [2, 0]), r"resolutions must be ints in \[1, 2\^24\], got \[0\]"),
    (lambda p, t, r: (p, t, [2, 2.5]), r"got \[2.5\]"),
    (lambda p, t, r: (p, t, torch.tensor([2, 8])), "resolutions must be int32, got torch.int64"),
    (lambda p, t, r: (p, t, torch.tensor([2, 8, 9], dtype=torch.int32)),
     r"resolutions must have shape \[2\]"),
    (lambda p, t, r: (p, t, torch.tensor([2, -1], dtype=torch.int32)), r"got \[-1\]"),
    (lambda p, t, r: (p, t, "2, 8"), "resolutions must be an int32 tensor or a list of ints"),
    (lambda p, t, r: (p.to("meta"), t, r), "points and table must be on one device"),
])
def test_hash_encode_rejects_bad_arguments(mutate, match):
    with pytest.raises(ValueError, match=match):
        hash_encode(*mutate(*_good()))


def test_use_kernels_true_on_cpu_is_an_error():
    with pytest.raises(ValueError, match="use_kernels=True needs CUDA tensors"):
        hash_encode(*_good(), use_kernels=True)


def test_empty_batch():
    out = hash_encode(torch.zeros(0, 3), torch.zeros(2, 64, 2), [2, 8])
    assert out.shape == (0, 4)


# ---------------------------------------------------------------------------- HashGrid


def test_hashgrid_shapes_init_and_pickle():
    torch.manual_seed(0)
    grid = kernels.HashGrid(levels=4, features_per_level=2, log2_hashmap_size=10,
                            base_resolution=4, max_resolution=32)
    assert grid.table.shape == (4, 1024, 2) and grid.output_dim == 8
    assert grid.resolutions.dtype == torch.int32 and grid.resolutions.tolist() == [4, 8, 16, 32]
    assert grid.table.abs().max() <= 1e-4
    out = grid(torch.rand(2, 5, 3))
    assert out.shape == (2, 5, 8) and out.dtype == torch.float32
    clone = pickle.loads(pickle.dumps(grid))
    torch.testing.assert_close(clone.table, grid.table)
    torch.manual_seed(0)
    same = kernels.HashGrid(levels=4, features_per_level=2, log2_hashmap_size=10,
                            base_resolution=4, max_resolution=32)
    assert torch.equal(same.table, grid.table), "initialisation must follow the caller's RNG"
    half = kernels.HashGrid(levels=2, log2_hashmap_size=8, base_resolution=2, max_resolution=8,
                            dtype=torch.float16)
    assert half.table.dtype == torch.float16 and half(torch.rand(3, 3)).dtype == torch.float32
    with pytest.raises(ValueError, match="x must have shape"):
        grid(torch.rand(4, 2))
    with pytest.raises(ValueError, match="dtype must be"):
        kernels.HashGrid(dtype=torch.float64)


def test_hashgrid_trains_on_cpu():
    torch.manual_seed(0)
    grid = kernels.HashGrid(levels=4, features_per_level=2, log2_hashmap_size=10,
                            base_resolution=4, max_resolution=32)
    head = torch.nn.Linear(grid.output_dim, 1)
    opt = torch.optim.Adam([*grid.parameters(), *head.parameters()], lr=1e-2)

    def target(x):
        return torch.sin(2 * math.pi * x[:, :1]) * torch.cos(2 * math.pi * x[:, 1:2]) + x[:, 2:]

    losses = []
    for _ in range(150):
        x = torch.rand(512, 3)
        loss = torch.nn.functional.mse_loss(head(grid(x)), target(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert grid.table.grad is not None and grid.table.grad.abs().sum() > 0
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.1 * first, (first, last)


# ---------------------------------------------------------------------------- GPU: kernel vs reference


# Kernel builds the tests run: (levels per block row, defines). The default (None) first; then all
# levels per row, one level per row, and the build without pair merging and streaming hints.
VARIANTS = [(None, None), (0, None), (1, None), (4, {"RF_NO_PAIR_MERGE": 1, "RF_NO_STREAMING": 1})]


def _random_inputs(n, dtype, seed, levels=8, size=2**14, features=2):
    g = torch.Generator().manual_seed(seed)
    points = torch.rand(n, 3, generator=g)
    points[: min(n, 4)] = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 1.0, 0.0],
                                        [-0.2, 0.5, 1.3]])[: min(n, 4)]
    table = (torch.rand(levels, size, features, generator=g) * 2 - 1).to(dtype)
    # base 4 .. 512: with T = 2^14, levels up to R = 24 are dense ((R+1)^3 <= T), the rest hashed.
    res = kernels.grid_resolutions(levels, 4, 512)
    return points.cuda(), table.cuda(), torch.tensor(res, dtype=torch.int32, device="cuda")


# (N, T): N = 1, around the block size (256) and not a multiple of it; T = 12345 is odd, so the
# pair-merged loads are off and the hash takes the modulo path.
SIZES = [(1, 2**14), (3, 2**14), (255, 2**14), (256, 2**14), (257, 2**14), (1000, 2**14),
         (65536 + 17, 2**14), (1000, 12345), (4099, 12345)]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n, size", SIZES)
@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_kernel_forward_matches_reference(n, size, dtype, offset):
    points, table, res = _random_inputs(n, dtype, seed=n, size=size)
    expected = hash_encode(points, table, res, use_kernels=False, offset=offset)
    for group, defines in VARIANTS:  # every thread layout and build
        out = hashgrid._HashEncode.apply(points, table, res, group, None, defines, None, offset)
        # The kernel picks the same cell and weights as the reference (x * R rounded by __fmul_rn,
        # the same float32 ops after it); only the 8-term sum differs (FMA chain vs product + sum):
        # |features| <= 1 and weights sum to 1, so the difference is a few ulp of 1 (< 1e-6).
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _reordered_sum_bound(points, res, size, features, grad_out, offset=0.0):
    """Per table entry: (contributions k, sum of |terms| S). Two float32 sums of the same k rounded
    terms in different orders (atomics vs PyTorch's index backward) differ by at most
    2 (k - 1) eps S (Higham, Accuracy and Stability, eq. 4.3)."""
    levels = len(res)
    counts = torch.zeros(levels, size, dtype=torch.float64, device=points.device)
    x = points.clamp(0, 1)
    bits = torch.tensor([[(c >> d) & 1 for d in range(3)] for c in range(8)], device=points.device)
    for lvl, r in enumerate(res.tolist()):
        pos = x * r + offset
        cell = torch.floor(pos).clamp(max=r if offset else r - 1).long()
        rows = grid_index(cell[:, None, :] + bits, r, size, offset).flatten()
        counts[lvl] += torch.bincount(rows, minlength=size).double()
    table64 = torch.zeros(levels, size, features, dtype=torch.float64, device=points.device,
                          requires_grad=True)
    out = hash_encode_reference(points.double(), table64, res, offset=offset)
    (abs_sum,) = torch.autograd.grad(out, table64, grad_out.double().abs())
    return counts[..., None], abs_sum


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n, size", [(1, 2**14), (257, 2**14), (1000, 2**14), (65536 + 17, 2**14),
                                     (4099, 12345)])
@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_kernel_backward_matches_reference(n, size, dtype, offset, monkeypatch):
    points, table, res = _random_inputs(n, dtype, seed=100 + n, size=size)
    table.requires_grad_(True)
    levels, size, features = table.shape
    cot = torch.randn(n, levels * features, device="cuda",
                      generator=torch.Generator(device="cuda").manual_seed(n))
    (expected,) = torch.autograd.grad(hash_encode(points, table, res, use_kernels=False, offset=offset),
                                      table, cot)
    counts, abs_sum = _reordered_sum_bound(points, res, size, features, cot, offset)
    host = tuple(res.tolist())
    # Block-private accumulation of the dense levels: off (no host resolutions), every dense level
    # that fits (min hits 1), and tiny 4 KiB slabs so levels span several slabs with edges inside.
    private = [(None, None, None), (host, 1, None), (host, 1, 4096), (host, 1, 1 << 14)]
    cases = [(g, d, p) for g, d in VARIANTS for p in private[:1]] + [(None, None, p) for p in private[1:]]
    for group, defines, (res_host, min_hits, smem) in cases:
        monkeypatch.setattr(hashgrid, "PRIVATE_MIN_HITS", min_hits or hashgrid.PRIVATE_MIN_HITS)
        monkeypatch.setattr(hashgrid, "PRIVATE_MAX_SLABS", 64)
        monkeypatch.setattr(hashgrid, "PRIVATE_SMEM_BYTES", smem)
        if res_host is not None:
            l0, slabs = hashgrid.private_plan(n, res_host, size, features, smem or 4096, offset)
            assert n < 16 or l0 >= 1, (n, res_host)  # the private kernel really runs here
        (got,) = torch.autograd.grad(
            hashgrid._HashEncode.apply(points, table, res, group, None, defines, res_host, offset), table, cot)
        assert got.dtype == dtype and got.shape == table.shape
        err = (got.double() - expected.double()).abs()
        bound = 2 * counts * EPS32 * abs_sum + 1e-30
        if dtype == torch.float16:
            # Each side rounds its float32 sum to float16 once: up to one fp16 ulp apart (relative
            # 2^-10 of the value), and 2^-24 absolute in fp16's subnormal range.
            bound = bound * (1 + EPS16) + 2 * EPS16 * expected.double().abs() + 2.0**-24
        worst = (err - bound).max().item()
        assert worst <= 0, (f"{group}, {defines}, private {min_hits} {smem}: error exceeds the "
                            f"reordering bound by {worst}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_against_float64_on_dyadic_points(dtype):
    """Points k / 2^7 make every float32 weight exact (<= 21 significant bits for R <= 128), so the
    float64 reference is the exact answer and the kernel's error is its rounding alone."""
    g = torch.Generator().manual_seed(7)
    n = 5000
    points = (torch.randint(0, 129, (n, 3), generator=g).float() / 128).cuda()
    table = (torch.rand(4, 2**12, 2, generator=g) * 2 - 1).to(dtype).cuda().requires_grad_()
    res = [2, 8, 32, 128]
    cot = torch.randn(n, 8, generator=g).cuda()
    out = hash_encode(points, table, res, use_kernels=True)
    table64 = table.detach().double().requires_grad_()
    out64 = hash_encode_reference(points.double(), table64, res)
    # Forward: 8 products and an 8-term float32 sum, |features| <= 1, weights sum to 1: < 1e-6.
    torch.testing.assert_close(out.double(), out64, rtol=0, atol=1e-6)
    (got,) = torch.autograd.grad(out, table, cot)
    (exact,) = torch.autograd.grad(out64, table64, cot.double())
    # Each term w * g is rounded once and k terms are summed in float32 in any (atomic) order:
    # |error| <= k eps sum|w g| to first order (Higham eq. 4.3); 1% margin for the second order.
    counts, abs_sum = _reordered_sum_bound(points, torch.tensor(res, device="cuda"), 2**12, 2, cot)
    bound = 1.01 * counts * EPS32 * abs_sum + 1e-30
    if dtype == torch.float16:
        # One rounding of the float32 sum to float16: relative 2^-11, or 2^-25 among subnormals.
        bound = bound * (1 + EPS16) + EPS16 * exact.abs() + 2.0**-25
    worst = ((got.double() - exact).abs() - bound).max().item()
    assert worst <= 0, f"gradient error exceeds the rounding bound by {worst}"


@pytest.mark.gpu
@requires_gpu
def test_gradcheck_reference_float64_on_gpu():
    g = torch.Generator().manual_seed(4)
    points = torch.rand(9, 3, generator=g, dtype=torch.float64).cuda()
    table = torch.randn(3, 32, 2, generator=g, dtype=torch.float64).cuda().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: hash_encode_reference(points, t, [2, 3, 5]), (table,))


@pytest.mark.gpu
@requires_gpu
def test_kernel_odd_features_misaligned_view_and_points_grad():
    g = torch.Generator().manual_seed(5)
    points = torch.rand(300, 3, generator=g).cuda()
    res = [3, 6, 20]
    odd = (torch.rand(3, 256, 3, generator=g) * 2 - 1).cuda()  # F = 3: scalar loads and atomics
    torch.testing.assert_close(hash_encode(points, odd, res, use_kernels=True),
                               hash_encode(points, odd, res, use_kernels=False),
                               rtol=1e-5, atol=1e-6)  # as in test_kernel_forward_matches_reference
    # F = 2 at a base 4 bytes past an aligned address: float2 loads would fault, so the wrapper
    # copies the table (differentiably) first.
    leaf = torch.rand(1 + 3 * 256 * 2, generator=g).cuda().requires_grad_()
    (grad,) = torch.autograd.grad(
        hash_encode(points, leaf[1:].view(3, 256, 2), res, use_kernels=True).sum(), leaf)
    (ref_grad,) = torch.autograd.grad(
        hash_encode(points, leaf[1:].view(3, 256, 2), res, use_kernels=False).sum(), leaf)
    # Reordered float32 sums of <= 300 * 8 weights in [0, 1], each entry's sum <= 2400:
    # 2 k eps S <= 2 * 2400 * 6e-8 * 2400 ~ 0.7 in the worst case; typical errors are ~1e-5.
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-4)
    pts = points.clone().requires_grad_()
    hash_encode(pts, odd.requires_grad_(), res, use_kernels=True).sum().backward()
    assert pts.grad is None  # documented: the CUDA path does not differentiate points
    assert odd.grad is not None


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_hashgrid_cuda_matches_reference(dtype, offset):
    torch.manual_seed(0)
    grid = kernels.HashGrid(levels=16, features_per_level=2, log2_hashmap_size=15,
                            base_resolution=16, max_resolution=512, dtype=dtype, offset=offset).cuda()
    ref = kernels.HashGrid(levels=16, features_per_level=2, log2_hashmap_size=15,
                           base_resolution=16, max_resolution=512, dtype=dtype,
                           use_kernels=False, offset=offset).cuda()
    ref.load_state_dict(grid.state_dict())
    x = torch.rand(4096, 3, device="cuda")
    torch.testing.assert_close(grid(x), ref(x), rtol=1e-5, atol=1e-6)
    (g_kernel,) = torch.autograd.grad(grid(x).square().sum(), grid.table)
    (g_ref,) = torch.autograd.grad(ref(x).square().sum(), ref.table)
    # Outputs ~1e-4 (init), so gradients 2 * out * w summed over <= 4096 * 8 terms stay ~1e-3;
    # reordering moves them by far less than 1e-6 (fp32) or one fp16 ulp (fp16).
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-7)
    torch.testing.assert_close(g_kernel, g_ref, **tol)


@pytest.mark.gpu
@requires_gpu
def test_hashgrid_trains_on_gpu():
    torch.manual_seed(0)
    grid = kernels.HashGrid(levels=16, features_per_level=2, log2_hashmap_size=15,
                            base_resolution=16, max_resolution=512).cuda()
    head = torch.nn.Linear(grid.output_dim, 1).cuda()
    opt = torch.optim.Adam([*grid.parameters(), *head.parameters()], lr=1e-2, eps=1e-15)
    losses = []
    for _ in range(100):
        x = torch.rand(8192, 3, device="cuda")
        y = torch.sin(6 * x[:, :1]) * x[:, 1:2] + x[:, 2:] ** 2
        loss = torch.nn.functional.mse_loss(head(grid(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < 0.1 * sum(losses[:10]), losses[::10]


def test_private_plan_picks_leading_dense_levels_in_slabs(monkeypatch):
    # The default: only levels that fit one slab (0 and 1 at 200 KiB).
    res0 = kernels.grid_resolutions(16, 16, 2048)
    assert [s[0] for s in hashgrid.private_plan(2**21, res0, 2**19, 2, 200 * 1024)[1]] == [0, 1]
    monkeypatch.setattr(hashgrid, "PRIVATE_MAX_SLABS", 4)
    res = kernels.grid_resolutions(16, 16, 2048)  # 16, 22, 30, 42, 58, 80 (hashed from here at T=2^19) ...
    rows = [(r + 1) ** 3 for r in res]
    # 2^21 points, 200 KiB slabs of F=2 fp32 rows (25600 rows): levels 0..3 need 1, 1, 2, 4 slabs
    # and have >= 16 points per row (2^21 / 79507 = 26); level 4 has 10 per row: not private.
    l0, slabs = hashgrid.private_plan(2**21, res, 2**19, 2, 200 * 1024)
    assert l0 == 4 and [s[0] for s in slabs] == [0, 1, 2, 2, 3, 3, 3, 3]
    for level in range(l0):  # the slabs of a level tile its rows exactly, each within the budget
        mine = [s for s in slabs if s[0] == level]
        assert mine[0][1] == 0 and sum(s[2] for s in mine) == rows[level]
        assert all(a[1] + a[2] == b[1] for a, b in zip(mine, mine[1:]))
        assert all(s[2] * 2 * 4 <= 200 * 1024 for s in mine)
    # Fewer points: only levels with >= PRIVATE_MIN_HITS points per row; none at all for tiny batches.
    assert hashgrid.private_plan(2**18, res, 2**19, 2, 200 * 1024)[0] == 2  # 2^18 / 29791 = 8.8 < 16
    assert hashgrid.private_plan(1000, res, 2**19, 2, 200 * 1024) == (0, [])
    # A hashed first level (tiny table) or no shared memory: nothing private.
    assert hashgrid.private_plan(2**21, res, 2**12, 2, 200 * 1024) == (0, [])
    assert hashgrid.private_plan(2**21, res, 2**19, 2, 4) == (0, [])
    # With the half-cell offset a level has (R + 2)^3 rows: level 0 (16) 5832 in one slab
    l0, slabs = hashgrid.private_plan(2**21, res, 2**19, 2, 200 * 1024, offset=0.5)
    assert [s for s in slabs if s[0] == 0] == [(0, 0, 18**3)]
    assert sum(s[2] for s in slabs if s[0] == 3) == 44**3


def test_pack_groups_shares_blocks_between_small_slabs():
    slabs = [(0, 0, 4913), (1, 0, 12167), (2, 0, 14896), (2, 14896, 14895)]
    entries, offsets = hashgrid.pack_groups(slabs, 25600)
    assert offsets == [0, 2, 3, 4]  # levels 0 + 1 in one block; each half of level 2 alone
    assert entries[0][3] == 0 and entries[1][3] == 4913 and entries[2][3] == 0 and entries[3][3] == 0
    assert hashgrid.pack_groups([], 100) == ([], [0])
