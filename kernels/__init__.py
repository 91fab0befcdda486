"""CUDA kernels compiled at first use with NVRTC (cuda-python), each with a pure-PyTorch twin.

``import kernels`` needs no GPU, driver or toolkit: nothing is compiled or loaded until a kernel is
first launched on CUDA tensors. On CPU tensors (or where :func:`available` is False) the PyTorch
references run instead.

Pieces: ``csrc/*.cu`` (CUDA C++), :mod:`kernels.loader` (NVRTC compile + disk cache, no device
needed), :mod:`kernels._driver` (module load and launch on PyTorch's stream), one module per op
(:mod:`kernels.hashgrid`, :mod:`kernels.render`, :mod:`kernels.adam`, :mod:`kernels.gaussians` with its CUDA side
:mod:`kernels._gs_cuda`) and the references (:mod:`kernels._reference`, :mod:`kernels._gs_reference`).
"""

from ._driver import CudaDriverError, KernelProgram, available, unavailable_reason
from ._gs_reference import ALPHA_MAX  # the default alpha clamp of the 3DGS blending (0.99, the reference's)
from ._gs_reference import intersect_tiles_reference
from ._gs_reference import isect_offset_encode_reference
from ._gs_reference import project_gaussians_reference
from ._gs_reference import rasterize_to_pixels_reference
from ._gs_reference import spherical_harmonics_reference
from ._reference import composite_reference, hash_encode_reference, march_rays_reference, sparse_adam_reference
from .adam import sparse_adam_step
from .gaussians import Projection
from .gaussians import intersect_tiles
from .gaussians import isect_offset_encode
from .gaussians import project_gaussians
from .gaussians import rasterization
from .gaussians import rasterize_to_pixels
from .gaussians import spherical_harmonics
from .hashgrid import HashGrid, grid_resolutions, hash_encode
from .loader import KernelCompileError
from .render import Samples, composite, march_rays

__all__ = [
    "ALPHA_MAX",
    "CudaDriverError",
    "HashGrid",
    "KernelCompileError",
    "KernelProgram",
    "Projection",
    "Samples",
    "available",
    "composite",
    "composite_reference",
    "default_programs",
    "grid_resolutions",
    "hash_encode",
    "hash_encode_reference",
    "intersect_tiles",
    "intersect_tiles_reference",
    "isect_offset_encode",
    "isect_offset_encode_reference",
    "march_rays",
    "march_rays_reference",
    "project_gaussians",
    "project_gaussians_reference",
    "rasterization",
    "rasterize_to_pixels",
    "rasterize_to_pixels_reference",
    "sparse_adam_reference",
    "sparse_adam_step",
    "spherical_harmonics",
    "spherical_harmonics_reference",
    "unavailable_reason",
]


def default_programs() -> list[KernelProgram]:
    """Every kernel program the ops compile with their default settings (benchmark and CI use it)."""
    from . import _gs_cuda, adam, hashgrid, render, ssim

    return [*hashgrid.default_programs(), *render.default_programs(), *_gs_cuda.default_programs(),
            *ssim.default_programs(), *adam.default_programs()]
