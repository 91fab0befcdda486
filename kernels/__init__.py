"""CUDA kernels compiled at first use with NVRTC (cuda-python), each with a pure-PyTorch twin.

``import kernels`` needs no GPU, driver or toolkit: nothing is compiled or loaded until a kernel is
first launched on CUDA tensors. On CPU tensors (or where :func:`available` is False) the PyTorch
references run instead.

Pieces: ``csrc/*.cu`` (CUDA C++), :mod:`kernels.loader` (NVRTC compile + disk cache, no device
needed), :mod:`kernels._driver` (module load and launch on PyTorch's stream), one module per op
(:mod:`kernels.hashgrid`, :mod:`kernels.render`, :mod:`kernels.adam`) and the references (:mod:`kernels._reference`).
"""

from ._driver import CudaDriverError, KernelProgram, available, unavailable_reason
from ._reference import composite_reference, hash_encode_reference, march_rays_reference, sparse_adam_reference
from .adam import sparse_adam_step
from .hashgrid import HashGrid, grid_resolutions, hash_encode
from .loader import KernelCompileError
from .render import Samples, composite, march_rays

__all__ = [
    "CudaDriverError",
    "HashGrid",
    "KernelCompileError",
    "KernelProgram",
    "Samples",
    "available",
    "composite",
    "composite_reference",
    "default_programs",
    "grid_resolutions",
    "hash_encode",
    "hash_encode_reference",
    "march_rays",
    "march_rays_reference",
    "sparse_adam_reference",
    "sparse_adam_step",
    "unavailable_reason",
]


def default_programs() -> list[KernelProgram]:
    """Every kernel program the ops compile with their default settings (benchmark and CI use it)."""
    from . import adam, hashgrid, render

    return [*hashgrid.default_programs(), *render.default_programs(), *adam.default_programs()]
