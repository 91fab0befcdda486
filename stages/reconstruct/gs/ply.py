"""Gaussians as a PLY file in the layout the common 3DGS viewers read, and back, bit-exact.

The 3DGS reference's ``save_ply`` layout: one ``vertex`` element, binary little-endian float32
properties ``x y z nx ny nz f_dc_0..2 f_rest_0..M-1 opacity scale_0..2 rot_0..3`` with the stored
(pre-activation) values: log scales, logit opacity, unnormalised quaternion (w, x, y, z). Normals are
zero. ``f_rest`` is channel-major: all higher coefficients of red, then green, then blue
(``f_rest_{c * (K - 1) + k}`` = ``shN[:, k, c]``), so M = 3 (K - 1) = 0, 9, 24 or 45 for SH degrees
0..3. gsplat's exporter writes the same order (without the normals). The colour the model renders
onto, where it has one, rides in the header as ``comment background r g b`` (:func:`read_background`).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from stages.common.io import atomic_write_bytes

from .model import MAX_SH_DEGREE, sh_degree_of

_FLOAT = np.dtype("<f4")
# PLY scalar types -> little-endian numpy types
_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "<i2", "int16": "<i2",
    "ushort": "<u2", "uint16": "<u2", "int": "<i4", "int32": "<i4", "uint": "<u4", "uint32": "<u4",
    "float": "<f4", "float32": "<f4", "double": "<f8", "float64": "<f8",
}
_HEADER_LIMIT = 1 << 20  # bytes searched for end_header
_DEGREE_OF_REST = {3 * ((d + 1) ** 2 - 1): d for d in range(MAX_SH_DEGREE + 1)}  # f_rest count -> degree


def property_names(sh_degree: int) -> list[str]:
    """The vertex properties of a file with SH coefficients up to ``sh_degree``, in order."""
    rest = 3 * ((sh_degree + 1) ** 2 - 1)
    return (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
            + [f"f_rest_{i}" for i in range(rest)]
            + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])


def _columns(params: Mapping[str, Tensor]) -> tuple[Tensor, int]:
    """[N, P] float32 rows in property order, and the SH degree."""
    shapes = {"means": 3, "quats": 4, "scales": 3}
    n = params["means"].shape[0]
    for name, width in shapes.items():
        if tuple(params[name].shape) != (n, width):
            raise ValueError(f"params[{name!r}] must be [{n}, {width}], got {tuple(params[name].shape)}")
    if tuple(params["opacities"].shape) != (n,):
        raise ValueError(f"params['opacities'] must be [{n}], got {tuple(params['opacities'].shape)}")
    if tuple(params["sh0"].shape) != (n, 1, 3):
        raise ValueError(f"params['sh0'] must be [{n}, 1, 3], got {tuple(params['sh0'].shape)}")
    sh_n = params["shN"]
    if sh_n.ndim != 3 or sh_n.shape[0] != n or sh_n.shape[2] != 3:
        raise ValueError(f"params['shN'] must be [{n}, K - 1, 3], got {tuple(sh_n.shape)}")
    if sh_n.shape[1] + 1 not in (1, 4, 9, 16):
        raise ValueError(f"params['shN'] holds {sh_n.shape[1]} higher SH coefficients per channel; "
                         "SH degrees 0..3 have 0, 3, 8 or 15")
    degree = sh_degree_of(sh_n.shape[1] + 1)
    parts = {name: params[name].detach().to("cpu", torch.float32) for name in
             ("means", "quats", "scales", "opacities", "sh0", "shN")}
    for name, value in parts.items():
        bad = int((~torch.isfinite(value.reshape(n, -1))).any(1).sum()) if n else 0
        if bad:
            raise ValueError(f"params[{name!r}] is not finite in {bad} of {n} Gaussians; "
                             "a non-finite model is not written")
    rows = torch.cat([parts["means"], torch.zeros(n, 3), parts["sh0"][:, 0],
                      parts["shN"].transpose(1, 2).reshape(n, 3 * sh_n.shape[1]), parts["opacities"][:, None],
                      parts["scales"], parts["quats"]], 1)
    return rows, degree


def save_ply(path: str | Path, params: Mapping[str, Tensor], background=None) -> None:
    """Write the Gaussians to ``path`` atomically (a temporary file, then a rename).

    ``background``: the colour the model renders onto (3 values in [0, 1]: the learned sky of a
    capture, white for RGBA scenes), kept as a header comment ``comment background r g b`` that
    viewers skip and :func:`read_background` reads; None writes no comment.

    Args:
        path: the ``.ply`` file to write.
        params: ``means [N, 3], quats [N, 4], scales [N, 3], opacities [N], sh0 [N, 1, 3],
            shN [N, K - 1, 3]`` (any device; float32 values are written bit for bit).

    Raises:
        ValueError: a shape is wrong, K is no SH degree 0..3, or a value is NaN or Inf.
    """
    rows, degree = _columns(params)
    names = property_names(degree)
    header = ["ply", "format binary_little_endian 1.0"]
    if background is not None:
        rgb = [float(v) for v in (background.tolist() if isinstance(background, Tensor) else background)]
        if len(rgb) != 3 or not all(0.0 <= v <= 1.0 for v in rgb):
            raise ValueError(f"background must be 3 values in [0, 1], got {rgb}")
        header.append("comment background " + " ".join(f"{v:.9g}" for v in rgb))
    header.append(f"element vertex {rows.shape[0]}")
    header += [f"property float {name}" for name in names] + ["end_header"]
    body = rows.numpy().astype(_FLOAT, copy=False).tobytes()
    atomic_write_bytes(path, ("\n".join(header) + "\n").encode("ascii") + body)


def _parse_header(data: bytes, path: Path) -> tuple[int, list[tuple[str, int, list[tuple[str, str]]]]]:
    """(length of the header in bytes, elements as (name, count, [(property, numpy type)]))."""
    end = data.find(b"end_header", 0, _HEADER_LIMIT)
    if not data.startswith(b"ply") or end < 0:
        raise ValueError(f"{path}: not a PLY file (no 'ply' magic or no end_header)")
    newline = data.find(b"\n", end)
    if newline < 0:
        raise ValueError(f"{path}: header ends without a newline after end_header")
    lines = data[:end].decode("ascii", errors="replace").replace("\r", "").split("\n")[1:]
    elements: list[tuple[str, int, list[tuple[str, str]]]] = []
    fmt = None
    for number, line in enumerate(lines, start=2):
        words = line.split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "format":
            fmt = " ".join(words[1:])
        elif words[0] == "element" and len(words) == 3 and words[2].isdigit():
            elements.append((words[1], int(words[2]), []))
        elif words[0] == "property" and elements:
            if len(words) != 3:
                raise ValueError(f"{path}: header line {number}: unsupported property {line.strip()!r} "
                                 "(list properties cannot be read)")
            if words[1] not in _PLY_TYPES:
                raise ValueError(f"{path}: header line {number}: unknown property type {words[1]!r}")
            elements[-1][2].append((words[2], _PLY_TYPES[words[1]]))
        else:
            raise ValueError(f"{path}: header line {number}: cannot parse {line.strip()!r}")
    if fmt != "binary_little_endian 1.0":
        raise ValueError(f"{path}: format {fmt!r} is not supported (expected binary_little_endian 1.0)")
    return newline + 1, elements


def _vertex_table(data: bytes, path: Path) -> np.ndarray:
    offset, elements = _parse_header(data, path)
    if not elements or elements[0][0] != "vertex":
        raise ValueError(f"{path}: the first element must be 'vertex', got "
                         f"{[e[0] for e in elements]}")
    _, count, props = elements[0]
    names = [name for name, _ in props]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: repeated vertex property names")
    table = np.dtype([(name, kind) for name, kind in props])
    need = offset + count * table.itemsize
    if len(data) < need or (len(elements) == 1 and len(data) != need):
        raise ValueError(f"{path}: {count} vertices of {table.itemsize} bytes need {need - offset} bytes "
                         f"after the header, the file has {len(data) - offset}"
                         + (" (truncated)" if len(data) < need else " (trailing bytes)"))
    return np.frombuffer(data, dtype=table, count=count, offset=offset)


def read_background(path: str | Path) -> tuple[float, float, float] | None:
    """The ``comment background r g b`` of a file :func:`save_ply` wrote, or None without one."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_HEADER_LIMIT)
    end = head.find(b"end_header")
    for line in head[:end if end >= 0 else 0].decode("ascii", errors="replace").splitlines():
        words = line.split()
        if words[:2] == ["comment", "background"] and len(words) == 5:
            try:
                return tuple(float(w) for w in words[2:])
            except ValueError:
                raise ValueError(f"{path}: cannot read the background comment {line.strip()!r}") from None
    return None


def load_ply(path: str | Path) -> dict[str, Tensor]:
    """Read Gaussians written by :func:`save_ply` (or any file in the reference layout).

    Args:
        path: the ``.ply`` file.

    Returns:
        ``{"means" [N, 3], "quats" [N, 4], "scales" [N, 3], "opacities" [N], "sh0" [N, 1, 3],
        "shN" [N, K - 1, 3]}`` float32 CPU tensors, bit-equal to what was saved.

    Raises:
        ValueError: not a binary little-endian PLY, no vertex element first, a missing property, a
            required property that is not float32, an f_rest count that is no SH degree, or a
            truncated file.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    vertices = _vertex_table(data, path)
    fields = vertices.dtype.fields
    rest = sorted((int(name[7:]) for name in fields if name.startswith("f_rest_") and name[7:].isdigit()))
    if rest != list(range(len(rest))):
        raise ValueError(f"{path}: f_rest properties must be numbered 0..M-1, got {rest}")
    degree = _DEGREE_OF_REST.get(len(rest))
    if degree is None:
        raise ValueError(f"{path}: {len(rest)} f_rest properties is not 3 x (K - 1) for K = 1, 4, 9, 16 "
                         f"(expected one of {sorted(_DEGREE_OF_REST)})")
    wanted = [n for n in property_names(degree) if n not in ("nx", "ny", "nz")]
    missing = [n for n in wanted if n not in fields]
    if missing:
        raise ValueError(f"{path}: missing vertex properties {missing}")
    not_float = [n for n in wanted if fields[n][0] != _FLOAT]
    if not_float:
        raise ValueError(f"{path}: properties {not_float} must be float (float32)")
    n = vertices.shape[0]

    def stack(names: list[str]) -> Tensor:
        if not names:
            return torch.zeros(n, 0)
        return torch.from_numpy(np.stack([vertices[name] for name in names], 1).astype(np.float32))

    k1 = len(rest) // 3
    return {
        "means": stack(["x", "y", "z"]),
        "quats": stack([f"rot_{i}" for i in range(4)]),
        "scales": stack([f"scale_{i}" for i in range(3)]),
        "opacities": stack(["opacity"])[:, 0].contiguous(),
        "sh0": stack([f"f_dc_{i}" for i in range(3)])[:, None, :].contiguous(),
        "shN": stack([f"f_rest_{i}" for i in range(len(rest))]).reshape(n, 3, k1).transpose(1, 2).contiguous(),
    }
