"""The rows of a partitioned 3DGS run's shards: moved between ranks with their Adam moments and
densification statistics, gathered on rank 0, and written as checkpoint shards (issue 21).

Rank r owns the contiguous rows ``offsets[r] : offsets[r + 1]`` of the global Gaussians (the
concatenation of the shards in rank order). Everything a row carries is packed into one float32 row
(:func:`layout`, :func:`pack`): the six parameters, every Adam state tensor shaped like its parameter
(``exp_avg``, ``exp_avg_sq``) and the three densification statistics; Adam's ``step`` and the param
groups are the same on every rank and stay where they are. :func:`move` re-splits the global rows
over the ranks (one all-to-all; rows keep their global order), :func:`gather_to_main` sends them all
to rank 0 (the final ``model.pt`` is one file).

Checkpoint shards (:func:`save_shard`, :func:`read_rows`): one file per rank,
``step_<step>.shard<r>of<world>.pt``, written atomically, its sha256 recorded in the manifest
(``step_<step>.pt``, rank 0, written last through :class:`..checkpoint.CheckpointStore`), so a set
is whole only when the manifest names every shard with a matching digest. A resume with another
world size reads, on every new rank, the slices of the old shards that make up its new rows.
"""
from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from stages.common.io import atomic_write_bytes

from ..checkpoint import CorruptCheckpoint
from .model import PARAM_NAMES

SHARD_FORMAT = "rayforge-3dgs-shard-v1"
STATS = ("grad2d", "count", "radii")
_SHARD = re.compile(r"^step_(\d+)\.shard\d+of\d+\.pt$")

Layout = list[tuple[str, str, str, tuple[int, ...]]]  # (kind, name, state key, row shape)


# ---------------------------------------------------------------------------- rows


def _moment_keys(method, name: str) -> list[str]:
    p = method.gaussians[name]
    state = method.optimizers[name].state.get(p, {})
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step" and v.shape == p.shape)


def layout(method) -> Layout:
    """What a packed row holds, in order (the same on every rank: the parameters' trailing shapes,
    the optimizers' state keys and whether statistics exist are)."""
    out: Layout = [("param", n, "", tuple(method.gaussians[n].shape[1:])) for n in PARAM_NAMES]
    for n in PARAM_NAMES:
        out += [("moment", n, k, tuple(method.gaussians[n].shape[1:])) for k in _moment_keys(method, n)]
    if method.densify.stats is not None:
        out += [("stat", s, "", ()) for s in STATS]
    return out


def _width(shape: tuple[int, ...]) -> int:
    w = 1
    for s in shape:
        w *= s
    return w


@torch.no_grad()
def pack(method, lay: Layout) -> torch.Tensor:
    """[n, D] float32: every row of this rank's shard (see :func:`layout`)."""
    g, n = method.gaussians, method.n
    cols = []
    for kind, name, key, _ in lay:
        if kind == "param":
            t = g[name]
        elif kind == "moment":
            t = method.optimizers[name].state[g[name]][key]
        else:
            t = method.densify.stats[name]
        cols.append(t.detach().reshape(n, -1).to(device=g["means"].device, dtype=torch.float32))
    return torch.cat(cols, 1) if cols else g["means"].new_zeros((n, 0))


@torch.no_grad()
def install(method, rows: torch.Tensor, lay: Layout, moments_device: torch.device | None = None) -> None:
    """Make ``rows`` [n, D] (packed as ``lay``) this rank's shard: new parameters in the method's dict
    and its optimizers' param groups, their Adam moments (on ``moments_device``, default the rows'),
    ``step`` and hyperparameters kept; the densification statistics replaced."""
    n, col = rows.shape[0], 0
    params, moments, stats = {}, {}, {}
    for kind, name, key, shape in lay:
        w = _width(shape)
        t = rows[:, col:col + w].reshape(n, *shape).clone()
        col += w
        if kind == "param":
            params[name] = t
        elif kind == "moment":
            moments.setdefault(name, {})[key] = t if moments_device is None else t.to(moments_device)
        else:
            stats[name] = t
    for name, value in params.items():
        old = method.gaussians[name]
        new = nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)
        opt = method.optimizers[name]
        state = opt.state.pop(old, {})
        state = {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.shape == old.shape)}
        state.update(moments.get(name, {}))
        opt.param_groups[0]["params"] = [new]
        if state:
            opt.state[new] = state
        method.gaussians[name] = new
    method.densify.stats = stats or None


def exchange_counts(ctx, n: int) -> list[int]:
    """Every rank's row count, in rank order."""
    if not ctx.active:
        return [n]
    dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    out = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(ctx.world_size)]
    dist.all_gather(out, torch.tensor([n], dtype=torch.int64, device=dev))
    return [int(t) for t in torch.cat(out).tolist()]


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def move_plan(old: list[int], new: list[int], rank: int) -> tuple[list[int], list[int]]:
    """(rows to each rank, rows from each rank) when the global rows split as ``old`` counts are
    re-split as ``new``."""
    o, w = _offsets(old), _offsets(new)
    world = len(old)
    send = [_overlap(o[rank], o[rank + 1], w[d], w[d + 1]) for d in range(world)]
    recv = [_overlap(o[s], o[s + 1], w[rank], w[rank + 1]) for s in range(world)]
    return send, recv


def move(ctx, rows: torch.Tensor, old: list[int], new: list[int]) -> torch.Tensor:
    """This rank's rows after re-splitting (one all-to-all; global order kept)."""
    send, recv = move_plan(old, new, ctx.rank)
    out = rows.new_empty((sum(recv), rows.shape[1]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send)
    return out


def gather_to_main(ctx, rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """Every rank's rows on rank 0, in CPU memory ([sum(counts), D]; None on the other ranks).

    Point to point, one rank at a time, so rank 0's device holds one shard beyond its own at once."""
    if not ctx.active:
        return rows.cpu()
    if ctx.rank != 0:
        if counts[ctx.rank]:
            dist.send(rows.contiguous(), dst=0)
        return None
    parts = [rows.cpu()]
    for src in range(1, ctx.world_size):
        if counts[src]:
            buf = rows.new_empty((counts[src], rows.shape[1]))
            dist.recv(buf, src=src)
            parts.append(buf.cpu())
    return torch.cat(parts)


# ---------------------------------------------------------------------------- checkpoint shards


def shard_file(step: int, rank: int, world: int) -> str:
    return f"step_{step:08d}.shard{rank:03d}of{world:03d}.pt"


def shard_contents(method, step: int, rank: int, world: int) -> dict:
    """This rank's rows as named tensors (CPU), for :func:`save_shard`."""
    g = method.gaussians
    moments = {n: {k: method.optimizers[n].state[g[n]][k].detach().cpu() for k in _moment_keys(method, n)}
               for n in PARAM_NAMES}
    stats = method.densify.stats
    return {"format": SHARD_FORMAT, "step": step, "rank": rank, "world_size": world, "rows": method.n,
            "params": {n: g[n].detach().cpu() for n in PARAM_NAMES}, "moments": moments,
            "stats": None if stats is None else {k: stats[k].detach().cpu() for k in STATS},
            "budget_reached": bool(method.densify.budget_reached)}


def save_shard(folder: Path, contents: dict) -> dict:
    """Write one shard atomically; returns what the manifest records of it."""
    buf = io.BytesIO()
    torch.save(contents, buf)
    data = buf.getvalue()
    name = shard_file(contents["step"], contents["rank"], contents["world_size"])
    atomic_write_bytes(Path(folder) / name, data)
    return {"file": name, "rows": int(contents["rows"]), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def _shard_bytes(folder: Path, info: dict) -> bytes:
    """A shard file's bytes, checked against the digest its manifest recorded."""
    path = Path(folder) / info["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read shard {path}: {exc}") from None
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CorruptCheckpoint(f"{path}: sha256 does not match the manifest")
    return data


def _read_shard(folder: Path, info: dict) -> dict:
    path = Path(folder) / info["file"]
    data = _shard_bytes(folder, info)
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged zip or pickle raises several types
        raise CorruptCheckpoint(f"{path}: not a readable shard ({type(exc).__name__}: {exc})") from None
    if not isinstance(blob, dict) or blob.get("format") != SHARD_FORMAT or blob.get("rows") != info["rows"]:
        raise CorruptCheckpoint(f"{path}: not the {SHARD_FORMAT} file the manifest names")
    return blob


def verify_shards(folder: Path, shards: list[dict]) -> None:
    """Raise :class:`CorruptCheckpoint` unless every shard reads back with its recorded digest."""
    for info in shards:
        _shard_bytes(folder, info)


def read_rows(folder: Path, shards: list[dict], lo: int, hi: int) -> dict:
    """Global rows ``lo:hi`` of a saved set of shards, in the layout of :func:`shard_contents`."""
    offsets = _offsets([int(s["rows"]) for s in shards])
    pieces = []
    for i, info in enumerate(shards):
        a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
        if b > a or (not pieces and i == len(shards) - 1):
            blob = _read_shard(folder, info)
            pieces.append((blob, a - offsets[i], max(b, a) - offsets[i]))
    first = pieces[0][0]

    def cat(get):
        return torch.cat([get(blob)[a:b] for blob, a, b in pieces])

    stats = None if first["stats"] is None else {k: cat(lambda bl, k=k: bl["stats"][k]) for k in STATS}
    return {"params": {n: cat(lambda bl, n=n: bl["params"][n]) for n in PARAM_NAMES},
            "moments": {n: {k: cat(lambda bl, n=n, k=k: bl["moments"][n][k]) for k in first["moments"][n]}
                        for n in PARAM_NAMES},
            "stats": stats, "budget_reached": any(bl["budget_reached"] for bl, _, _ in pieces)}


def remove_stale_shards(folder: Path, keep: set[str]) -> None:
    """Delete the shard files no kept manifest names (older sets, a set whose manifest never came, a
    set of the same step written by another world size)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if _SHARD.match(p.name) and p.name not in keep:
            p.unlink(missing_ok=True)
