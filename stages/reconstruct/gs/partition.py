"""Partitioned 3DGS rendering: Gaussians sharded over ranks, image tiles split over ranks (issue 21).

Every rank owns a contiguous block of the Gaussians' rows (with their Adam state) and renders, for
the view every rank draws alike, a contiguous range of the image's tiles (row-major tile ids
``[bounds[r], bounds[r + 1])``). One render (:class:`PartitionedRenderer`, ``kernels.rasterization``'s
signature) is:

1. the owner projects its Gaussians and evaluates their SH colours (``kernels.project_gaussians``,
   ``kernels.spherical_harmonics``);
2. :func:`destinations`: the tile box of every visible Gaussian (the kernels' own box) against every
   rank's tile range; an all-to-all (``all_to_all_single`` with split sizes: gloo on the CPU, NCCL on
   GPUs) sends each rank the 2D attributes of the Gaussians that touch its tiles, :data:`FWD` floats
   a row (means2d, conics, colours, opacity, depth, radii), in global row order;
3. each rank bins what it received, keeps its tiles' lists and blends them (``kernels.rasterize_to_pixels``);
4. an all-to-all of the tiles gives every rank the whole image (the loss needs it: SSIM's window
   crosses tile boundaries), and every rank computes the same loss.

Backward runs the same way round: the image's gradient on a rank's own tiles is already there (every
rank holds the same loss), the rasterizer's backward gives the gradients of the received attributes,
and the reverse all-to-all (:class:`_Link`) returns them to the owners, where they are summed per
Gaussian over every rank that drew it, and the owner's projection and SH backward run locally. So the
view-space gradient densification reads (``meta["means2d"].grad``, and ``.absgrad``) is each
Gaussian's whole gradient, on its owner.

Load balancing (:class:`TileBalancer`): each rank's rasterization time (forward + backward of its
tiles, without the communication) is measured for every training render; when the slowest rank of a
render took more than :data:`IMBALANCE` longer than the fastest (Grendel-GS's 0.06), that view's
tile ranges are re-split at equal shares of a cost per tile estimated from the measured times (each
rank's time spread evenly over its tiles). The split is kept per view (a view is next rendered an
epoch later), and the latest split is the starting point of a view not seen yet.

Communication per render, in bytes (:func:`comm_model`; docs/distributed.md has the derivation and
measured numbers): ``FWD * 4`` forward and ``GRAD * 4`` backward per (visible Gaussian, other rank
whose tiles it touches), ``(D + 1) * 4`` per pixel of every tile to each other rank for the image.

Paper: Zhao et al., "On Scaling Up 3D Gaussian Splatting Training" (Grendel-GS), 2024.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import kernels
from kernels import ALPHA_MAX

IMBALANCE = 0.06  # re-split when the slowest rank takes more than this much longer than the fastest
SH_COLOUR = 3  # colour channels the method renders (RGB from SH)


def fwd_cols(colours: int = SH_COLOUR) -> int:
    """Floats sent forward per (Gaussian, rank): means2d 2, conics 3, colours, opacity, depth, radii 2."""
    return 2 + 3 + colours + 1 + 1 + 2


def grad_cols(colours: int = SH_COLOUR, absgrad: bool = False) -> int:
    """Floats returned per (Gaussian, rank): the gradients of means2d, conics, colours, opacity (and
    |dL/dmeans2d| with absgrad)."""
    return 2 + 3 + colours + 1 + (2 if absgrad else 0)


FWD, GRAD = fwd_cols(), grad_cols()


# ---------------------------------------------------------------------------- tile ranges


def even_bounds(total: int, world: int) -> list[int]:
    """[world + 1] boundaries splitting ``total`` items into contiguous blocks, sizes differing by at most 1."""
    base, extra = divmod(total, world)
    out = [0]
    for r in range(world):
        out.append(out[-1] + base + (1 if r < extra else 0))
    return out


def tile_boxes(means2d: torch.Tensor, radii: torch.Tensor, tile_size: int, tile_width: int, tile_height: int):
    """The tile box ``[x0, x1) x [y0, y1)`` (int64 [N] each) of every Gaussian, as the kernels bin it
    (``gs_tile_box`` in csrc/gaussians.cuh, ``tile_ranges`` of the twins): empty when culled.

    Args:
        means2d: [N, 2] pixel coordinates; radii: [N, 2] int32 box half-sizes (0 = culled).
    """
    ts = float(tile_size)
    rx, ry = radii[:, 0].to(torch.float32) / ts, radii[:, 1].to(torch.float32) / ts
    cx, cy = means2d[:, 0].to(torch.float32) / ts, means2d[:, 1].to(torch.float32) / ts
    visible = (radii[:, 0] > 0) & (radii[:, 1] > 0)
    zero = torch.zeros_like(radii[:, 0], dtype=torch.int64)
    x0 = torch.where(visible, torch.floor(cx - rx).clamp(0, tile_width).long(), zero)
    x1 = torch.where(visible, torch.ceil(cx + rx).clamp(0, tile_width).long(), zero)
    y0 = torch.where(visible, torch.floor(cy - ry).clamp(0, tile_height).long(), zero)
    y1 = torch.where(visible, torch.ceil(cy + ry).clamp(0, tile_height).long(), zero)
    return x0, x1, y0, y1


def destinations(x0, x1, y0, y1, bounds: list[int], tile_width: int) -> torch.Tensor:
    """[ranks, N] bool: which ranks' tile ranges the boxes touch.

    Rank r's range ``[lo, hi)`` covers the end of tile row ``ra`` from column ``ca``, the rows in
    between, and the start of row ``rb`` up to column ``cb``; a box touches it when it meets one
    of the three."""
    tw = tile_width
    nonempty = (x1 > x0) & (y1 > y0)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            out.append(torch.zeros_like(nonempty))
            continue
        ra, rb = lo // tw, (hi - 1) // tw
        ca, cb = lo % tw, (hi - 1) % tw + 1  # row ra from column ca on, row rb up to column cb
        if ra == rb:
            hit = (y0 <= ra) & (ra < y1) & (x0 < cb) & (x1 > ca)
        else:
            hit = ((y0 <= ra) & (ra < y1) & (x1 > ca)) | ((y0 <= rb) & (rb < y1) & (x0 < cb))
            if rb - ra >= 2:  # whole rows ra + 1 .. rb - 1
                hit |= (y0 <= rb - 1) & (y1 > ra + 1)
        out.append(hit & nonempty)
    return torch.stack(out)


def resplit(bounds: list[int], times: list[float]) -> list[int]:
    """New boundaries that give every rank an equal share of the estimated cost.

    The cost of a tile is its rank's measured time divided by its rank's tile count (ranks without
    tiles tell nothing); the new boundaries sit where the cumulative cost reaches k / ranks of the
    total, rounded to whole tiles, with at least one tile per rank when there are enough tiles."""
    world, n = len(times), bounds[-1]
    cum = [0.0]  # cumulative cost at every old boundary
    for r in range(world):
        cum.append(cum[-1] + (max(times[r], 0.0) if bounds[r + 1] > bounds[r] else 0.0))
    total = cum[-1]
    if total <= 0 or n == 0:
        return list(bounds)
    new = [0]
    r = 0
    for k in range(1, world):
        target = total * k / world
        while r < world - 1 and cum[r + 1] < target:
            r += 1
        span = bounds[r + 1] - bounds[r]
        cost = cum[r + 1] - cum[r]
        pos = bounds[r] + (span * (target - cum[r]) / cost if cost > 0 else 0.0)
        new.append(int(round(pos)))
    new.append(n)
    least = 1 if n >= world else 0
    for k in range(1, world):  # non-decreasing, room for the ranks after
        new[k] = min(max(new[k], new[k - 1] + least), n - least * (world - k))
    return new


class TileBalancer:
    """Tile ranges per view, re-split from measured times (see the module docstring).

    Every rank holds an identical copy: it is only changed by :meth:`update` with times every rank
    has (all-reduced), in the same order."""

    def __init__(self, world: int, threshold: float = IMBALANCE):
        self.world, self.threshold = world, threshold
        self.views: dict[bytes, list[int]] = {}
        self.latest: list[float] = [r / world for r in range(world + 1)]  # the last split, as fractions
        self.pinned: list[int] | None = None
        self.resplits = 0

    def bounds(self, key: bytes, n_tiles: int) -> list[int]:
        if self.pinned is not None:
            if self.pinned[-1] != n_tiles or len(self.pinned) != self.world + 1:
                raise ValueError(f"pinned tile bounds {self.pinned} do not split {n_tiles} tiles over "
                                 f"{self.world} ranks")
            return list(self.pinned)
        b = self.views.get(key)
        if b is None:
            b = [int(round(f * n_tiles)) for f in self.latest]
            b[0], b[-1] = 0, n_tiles
            for k in range(1, self.world + 1):
                b[k] = max(b[k], b[k - 1])
        return b

    def pin(self, bounds: list[int] | None) -> None:
        """Use ``bounds`` for every view and never re-split (tests, benchmarks); None unpins."""
        self.pinned = None if bounds is None else list(bounds)

    def imbalance(self, times: list[float]) -> float:
        """(slowest - fastest) / fastest."""
        return max(times) / max(min(times), 1e-12) - 1.0

    def update(self, key: bytes, bounds: list[int], times: list[float]) -> bool:
        """Re-split ``key``'s tiles when the ranks' ``times`` of a render with ``bounds`` are too uneven."""
        if self.pinned is not None or self.world == 1 or self.imbalance(times) <= self.threshold:
            return False
        new = resplit(bounds, times)
        if new == bounds:
            return False
        self.views[key] = new
        self.latest = [b / new[-1] for b in new]
        self.resplits += 1
        return True

    def state_dict(self) -> dict:
        keys = list(self.views)
        width = max((len(k) for k in keys), default=0)
        return {"world": self.world, "latest": torch.tensor(self.latest, dtype=torch.float64),
                "keys": torch.tensor([list(k) for k in keys], dtype=torch.uint8).reshape(len(keys), width),
                "bounds": torch.tensor([self.views[k] for k in keys], dtype=torch.int64).reshape(
                    len(keys), self.world + 1),
                "resplits": self.resplits}

    def load_state_dict(self, state: dict) -> None:
        """Restore a split of the same world size (another world size starts even)."""
        if int(state["world"]) != self.world:
            return
        self.latest = state["latest"].tolist()
        self.views = {bytes(k.tolist()): b.tolist() for k, b in zip(state["keys"], state["bounds"])}
        self.resplits = int(state["resplits"])


def view_key(viewmats: torch.Tensor, Ks: torch.Tensor, width: int, height: int) -> bytes:
    """The camera's bytes: the same view gives the same key on every rank (one small host copy)."""
    cam = torch.cat([viewmats.reshape(-1), Ks.reshape(-1)]).detach().to("cpu", torch.float32)
    return cam.numpy().tobytes() + int(width).to_bytes(4, "little") + int(height).to_bytes(4, "little")


# ---------------------------------------------------------------------------- the exchange ops


class _Clock:
    """Marks on the host clock (CPU) or CUDA events (GPU, read later without waiting)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a, b) -> float:
        if a is None or b is None:
            return 0.0
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


@dataclass
class RenderRecord:
    """One training render of this rank: the view, its split, and the clock marks of its tile work."""

    key: bytes
    bounds: list[int]
    marks: list = field(default_factory=lambda: [None, None, None, None])  # raster fwd start/end, bwd start/end
    bytes_fwd: int = 0
    bytes_bwd: int = 0
    bytes_image: int = 0
    received: int = 0  # Gaussians received (own ones included)
    step: int = -1  # the training step (set by the strategy)
    visible: torch.Tensor | None = None  # this rank's visible Gaussians (0-d, on the device)
    span: torch.Tensor | None = None  # the sum of their boxes' tile-id spans (comm_model's input)
    model_args: tuple = ()  # (n_tiles, tile_size, colours, absgrad) for comm_model


class _Link:
    """The forward and reverse all-to-all of one render's 2D attributes (through :class:`_Collective`)."""

    def __init__(self, group_active: bool, send: list[int], recv: list[int], rank: int, index: torch.Tensor,
                 n_local: int, colours: int, absgrad: bool, owner_means2d, record: RenderRecord | None, clock,
                 counters: "CommCounters"):
        self.active, self.send, self.recv, self.rank, self.counters = group_active, send, recv, rank, counters
        self.index, self.n_local, self.colours, self.absgrad = index, n_local, colours, absgrad
        self.owner_means2d, self.record, self.clock = owner_means2d, record, clock
        # the rasterizer's means2d input (its .absgrad after backward), held weakly: the tensor is
        # downstream of the exchange's autograd node, whose ctx holds this link, and a strong
        # reference would close a cycle through C++ autograd that the garbage collector cannot free
        # (every training render leaked its graph). The rasterizer saves it until the backward.
        self.received_means2d: weakref.ref | None = None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return rows.clone()
        out = rows.new_empty((sum(self.recv), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), self.recv, self.send)
        return out

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.record is not None:
            self.record.marks[3] = self.clock.mark()
        g = grad[:, :grad_cols(self.colours)]
        if self.absgrad:
            received = self.received_means2d() if self.received_means2d is not None else None
            ab = getattr(received, "absgrad", None)
            ab = grad.new_zeros((grad.shape[0], 2)) if ab is None else ab.reshape(-1, 2)
            g = torch.cat([g, ab], 1)
        if self.active:
            back = g.new_empty((sum(self.send), g.shape[1]))
            dist.all_to_all_single(back, g.contiguous(), self.send, self.recv)
            if self.record is not None:
                self.record.bytes_bwd = sent = (sum(self.recv) - self.recv[self.rank]) * g.shape[1] * 4
                self.counters.bwd += sent
        else:
            back = g
        out = grad.new_zeros((back.shape[0], grad.shape[1]))
        cols = grad_cols(self.colours)
        out[:, :cols] = back[:, :cols]
        if self.absgrad and self.owner_means2d is not None:
            owner = back.new_zeros((self.n_local, 2)).index_add_(0, self.index, back[:, cols:])
            self.owner_means2d.absgrad = owner[None]
        return out


class _Collective(torch.autograd.Function):
    """``op.forward(x)`` with ``op.backward`` as its gradient: the exchange (:class:`_Link`: rows
    [S, F] in send order -> the rows every rank sent here [R, F]) and the image assembly
    (:class:`_Gather`: this rank's tiles -> every tile)."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        return op.forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.op.backward(grad), None


class _Gather:
    """The whole image's tiles from every rank's own range (through :class:`_Collective`)."""

    def __init__(self, active: bool, bounds: list[int], rank: int, record: RenderRecord | None, clock):
        self.active, self.bounds, self.rank, self.record, self.clock = active, bounds, rank, record, clock

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return tiles.clone()
        world = len(self.bounds) - 1
        sizes = [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        out = tiles.new_empty((self.bounds[-1], *tiles.shape[1:]))
        dist.all_to_all_single(out, tiles.repeat(world, *([1] * (tiles.ndim - 1))), sizes, [tiles.shape[0]] * world)
        return out

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.record is not None:
            self.record.marks[2] = self.clock.mark()
        # every rank computed the same loss of the same image: its gradient on this rank's tiles is here
        return grad[self.bounds[self.rank]:self.bounds[self.rank + 1]].contiguous()


def to_tiles(image: torch.Tensor, tile_size: int, tile_width: int, tile_height: int) -> torch.Tensor:
    """[H, W, F] -> [tiles, ts, ts, F] in row-major tile order (zeros past the image's edge)."""
    H, W, F = image.shape
    ts = tile_size
    pad = torch.nn.functional.pad(image, (0, 0, 0, tile_width * ts - W, 0, tile_height * ts - H))
    return pad.view(tile_height, ts, tile_width, ts, F).permute(0, 2, 1, 3, 4).reshape(-1, ts, ts, F)


def from_tiles(tiles: torch.Tensor, tile_width: int, tile_height: int, width: int, height: int) -> torch.Tensor:
    """Inverse of :func:`to_tiles`: [tiles, ts, ts, F] -> [H, W, F]."""
    ts, F = tiles.shape[1], tiles.shape[-1]
    full = tiles.view(tile_height, tile_width, ts, ts, F).permute(0, 2, 1, 3, 4).reshape(
        tile_height * ts, tile_width * ts, F)
    return full[:height, :width]


# ---------------------------------------------------------------------------- the renderer


@dataclass
class CommCounters:
    """Bytes this rank sent, and renders done, since the last :meth:`take`."""

    fwd: int = 0
    bwd: int = 0
    image: int = 0
    other: int = 0  # split sizes, step statistics
    renders: int = 0

    def take(self) -> dict:
        out = {"fwd": self.fwd, "bwd": self.bwd, "image": self.image, "other": self.other, "renders": self.renders}
        self.fwd = self.bwd = self.image = self.other = self.renders = 0
        return out


class PartitionedRenderer:
    """``kernels.rasterization`` for a shard of the Gaussians and a range of the tiles (module docstring).

    Every rank must call it for the same view at the same time (collectives inside, forward and
    backward). Returns the whole image on every rank and a meta whose ``means2d`` / ``radii`` are
    this rank's own Gaussians' (what densification reads)."""

    def __init__(self, rank: int, world: int, active: bool, device: torch.device,
                 balancer: TileBalancer | None = None):
        self.rank, self.world, self.active = rank, world, active
        self.balancer = balancer or TileBalancer(world)
        self.clock = _Clock(device)
        self.records: list[RenderRecord] = []  # the training renders since the strategy last took them
        self.counters = CommCounters()

    def __call__(self, means, quats, scales, opacities, colors, viewmats, Ks, width: int, height: int, *,
                 sh_degree: int | None = None, backgrounds=None, render_mode: str = "RGB",
                 near_plane: float = 0.01, far_plane: float = 1e10, eps2d: float = 0.3, radius_clip: float = 0.0,
                 antialiased: bool = False, absgrad: bool = False, tile_size: int = 16, validate: bool = True,
                 alpha_max: float = ALPHA_MAX):
        if render_mode != "RGB":
            raise ValueError(f"partitioned rendering draws render_mode 'RGB' only, got {render_mode!r}")
        if viewmats.ndim != 3 or viewmats.shape[0] != 1:
            raise ValueError(f"partitioned rendering takes one camera per call, got viewmats {tuple(viewmats.shape)}")
        ts = tile_size
        tw, th = -(-width // ts), -(-height // ts)
        key = view_key(viewmats, Ks, width, height)
        bounds = self.balancer.bounds(key, tw * th)
        record = RenderRecord(key, bounds) if torch.is_grad_enabled() else None

        # 1. this rank's Gaussians: projection and colours (as kernels.rasterization computes them)
        proj = kernels.project_gaussians(means, quats, scales, viewmats, Ks, width, height, eps2d=eps2d,
                                         near=near_plane, far=far_plane, radius_clip=radius_clip,
                                         antialiased=antialiased, opacities=opacities, radii_per_axis=True,
                                         validate=validate)
        opac = opacities[None] * proj.compensations if proj.compensations is not None else opacities[None]
        if sh_degree is None:
            rgb = colors[None]
        else:
            campos = torch.linalg.inv_ex(viewmats).inverse[:, :3, 3]
            dirs = (means[None] - campos[:, None])[0].contiguous()
            # colors may be the method's (sh0, shN), read in place as kernels.rasterization reads them
            rgb = torch.clamp_min(kernels.spherical_harmonics(sh_degree, dirs, colors) + 0.5, 0.0)[None]
        D = rgb.shape[-1]
        means2d = proj.means2d
        if means2d.requires_grad:
            means2d.retain_grad()

        # 2. each Gaussian to the ranks whose tiles its box touches
        n_local = means.shape[0]
        boxes = tile_boxes(means2d.detach()[0], proj.radii[0], ts, tw, th)
        dest = destinations(*boxes, bounds, tw)  # [world, N]
        if record is not None:
            x0, x1, y0, y1 = boxes
            vis = (x1 > x0) & (y1 > y0)
            record.visible = vis.sum().double()
            record.span = torch.where(vis, (y1 - 1 - y0) * tw + (x1 - 1 - x0), 0).sum().double()
        index = torch.nonzero(dest.reshape(-1)).squeeze(1) % max(n_local, 1)  # send order: by rank, then row
        packed = torch.cat([means2d[0], proj.conics[0], rgb[0], opac[0, :, None], proj.depths[0, :, None].detach(),
                            proj.radii[0].to(means2d.dtype)], 1)
        send, recv = self._split_sizes(dest.sum(1))
        link = _Link(self.active, send, recv, self.rank, index, n_local, D, absgrad, means2d, record, self.clock,
                     self.counters)
        received = _Collective.apply(packed.index_select(0, index), link)

        # 3. this rank's tiles
        marks = record.marks if record is not None else [None] * 4
        marks[0] = self.clock.mark()
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        tiles = self._rasterize(received, link, D, lo, hi, width, height, ts, tw, th, backgrounds, absgrad,
                                alpha_max)
        marks[1] = self.clock.mark()

        # 4. the whole image on every rank
        gather = _Gather(self.active, bounds, self.rank, record, self.clock)
        image = from_tiles(_Collective.apply(tiles, gather), tw, th, width, height)[None]
        if record is not None:  # bytes of training renders (evaluation renders are not counted)
            c = self.counters
            fwd = (sum(send) - send[self.rank]) * packed.shape[1] * 4
            img = (self.world - 1) * tiles.numel() * 4 if self.active else 0
            c.fwd, c.image, c.renders = c.fwd + fwd, c.image + img, c.renders + 1
            c.other += 8 * (self.world - 1) if self.active else 0
            record.bytes_fwd, record.bytes_image, record.received = fwd, img, received.shape[0]
            record.model_args = (tw * th, ts, D, absgrad)
            self.records.append(record)
        meta = {"means2d": means2d, "radii": proj.radii.amax(-1), "depths": proj.depths, "conics": proj.conics,
                "opacities": opac, "width": width, "height": height, "n_cameras": 1, "tile_size": ts,
                "tile_width": tw, "tile_height": th, "tile_bounds": bounds, "received": int(received.shape[0]),
                "sent": send}
        return image[..., :D].contiguous(), image[..., D:].contiguous(), meta

    def _split_sizes(self, send_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """(rows to every rank, rows from every rank): the counts' all-to-all (one host read)."""
        if not self.active:
            n = send_counts.tolist()
            return n, n
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        both = torch.stack([send_counts, recv_counts]).tolist()
        return both[0], both[1]

    def _rasterize(self, received, link: _Link, D: int, lo: int, hi: int, width: int, height: int, ts: int,
                   tw: int, th: int, backgrounds, absgrad: bool, alpha_max: float) -> torch.Tensor:
        """[hi - lo, ts, ts, D + 1]: colour and alpha of this rank's tiles."""
        R = received.shape[0]
        if R == 0 or hi <= lo:  # nothing drawn here: background; still in the graph (its backward is a collective)
            bg = received.new_zeros(D) if backgrounds is None else backgrounds[0]
            tile = torch.cat([bg, bg.new_zeros(1)]).expand(hi - lo, ts, ts, D + 1)
            return tile + received.sum() * 0.0
        m2 = received[:, 0:2].contiguous()[None]
        conics = received[:, 2:5].contiguous()[None]
        colours = received[:, 5:5 + D].contiguous()[None]
        opac = received[:, 5 + D].contiguous()[None]
        depths = received[:, 6 + D].detach().contiguous()[None]
        radii = received[:, 7 + D:9 + D].detach().to(torch.int32)[None]
        link.received_means2d = weakref.ref(m2)
        keys, flatten_ids, offsets = _bin(m2, radii, depths, conics, opac, ts, tw, th, width, height)
        flat = offsets.reshape(-1)
        a, b = torch.cat([flat, flat.new_tensor([flatten_ids.numel()])])[[lo, hi]].tolist()
        offsets = (offsets - a).clamp_(0, b - a)  # the other ranks' tiles: empty lists
        img, alpha = kernels.rasterize_to_pixels(m2, conics, colours, opac, width, height, ts, offsets,
                                                 flatten_ids[a:b].contiguous(), backgrounds=backgrounds,
                                                 absgrad=absgrad, alpha_max=alpha_max)
        return to_tiles(torch.cat([img, alpha], -1)[0], ts, tw, th)[lo:hi]


def _bin(means2d, radii, depths, conics, opacities, ts: int, tw: int, th: int, width: int, height: int):
    """(isect_ids, flatten_ids, isect_offsets) of the received Gaussians over the whole tile grid.

    On a GPU the binning kernels.rasterization uses (it also drops tiles a Gaussian's alpha cannot
    reach, which changes no pixel); on the CPU the public intersect_tiles / isect_offset_encode."""
    from kernels import gaussians as G

    if G._use_cuda(means2d.device):
        _, keys, flatten_ids, offsets, _ = G._cuda().bin_tiles(means2d.detach(), radii, depths, ts, tw, th,
                                                               G._check_budget, width, height, conics.detach(),
                                                               opacities.detach())
        return keys, flatten_ids, offsets
    _, keys, flatten_ids = kernels.intersect_tiles(means2d.detach().contiguous(), radii, depths, ts, tw, th)
    return keys, flatten_ids, kernels.isect_offset_encode(keys, 1, tw, th)


# ---------------------------------------------------------------------------- communication model


def comm_model(world: int, visible: float, mean_span: float, n_tiles: int, tile_size: int = 16,
               colours: int = SH_COLOUR, absgrad: bool = False) -> dict:
    """Bytes sent per training render, summed over all ranks, for even tile ranges.

    A visible Gaussian whose box spans tile ids ``min .. max`` (``span = max - min``) goes to
    ``1 + (world - 1) * span / n_tiles`` ranks on average (a boundary falls in its span with that
    probability, boundaries placed uniformly); its owner is one of them with probability
    destinations / world (rows are not ordered by screen position), so ``(world - 1) / world`` of the
    rows cross the network. The image: every rank's tiles to every other rank.

    Args:
        world: ranks; visible: Gaussians visible in the view (all ranks together); mean_span: their
            mean tile-id span; n_tiles: tiles of the image.

    Returns:
        {"fwd", "bwd", "image", "total"} bytes, and "destinations" (mean ranks per visible Gaussian).
    """
    dests = 1.0 + (world - 1) * min(mean_span / max(n_tiles, 1), 1.0)
    rows = visible * dests * (world - 1) / world
    fwd = 4.0 * fwd_cols(colours) * rows
    bwd = 4.0 * grad_cols(colours, absgrad) * rows
    image = 4.0 * (colours + 1) * n_tiles * tile_size * tile_size * (world - 1)
    return {"fwd": fwd, "bwd": bwd, "image": image, "total": fwd + bwd + image, "destinations": dests}


def mean_span(boxes, tile_width: int) -> tuple[int, float]:
    """(visible Gaussians, their mean tile-id span ``max id - min id``) of :func:`tile_boxes` output,
    the inputs of :func:`comm_model`."""
    x0, x1, y0, y1 = boxes
    vis = (x1 > x0) & (y1 > y0)
    n = int(vis.sum())
    if n == 0:
        return 0, 0.0
    span = (y1 - 1 - y0) * tile_width + (x1 - 1 - x0)
    return n, float(span[vis].double().mean())
