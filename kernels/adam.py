"""Adam for hash tables with tiny-cuda-nn's rule for sparse gradients (one fused pass).

CUDA source: ``csrc/adam.cu``; reference: ``_reference.sparse_adam_reference`` (what the CPU runs, and
the CUDA kernel's yardstick). Entries whose gradient is exactly zero are not stepped and their moments
do not decay; each entry's bias correction counts the steps it was trained in (``steps``). A table of
2^19 x 16 x 2 entries takes one launch instead of the ~30 elementwise ones of the reference (~2 ms a
step on an H200, about a training step's own time).

Example:
    >>> import torch, kernels
    >>> p = torch.zeros(3); g = torch.tensor([0.5, 0.0, -2.0])
    >>> m, v, n = torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.int32)
    >>> kernels.sparse_adam_step(p, g, m, v, n, lr=0.1)
    >>> [round(x, 6) for x in p.tolist()], n.tolist()  # an entry's first step: lr against its gradient's sign
    ([-0.1, 0.0, 0.1], [1, 0, 1])
"""
from __future__ import annotations

import torch

from ._driver import KernelProgram, f32, i64, ptr
from ._reference import sparse_adam_reference
from .hashgrid import _use_kernels

BLOCK_SIZE = 256
_program: KernelProgram | None = None


def program() -> KernelProgram:
    global _program
    if _program is None:
        _program = KernelProgram("adam.cu", ["sparse_adam"])
    return _program


def default_programs() -> list[KernelProgram]:
    return [program()]


@torch.no_grad()
def sparse_adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     steps: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-15,
                     found_inf: torch.Tensor | None = None, *, use_kernels: bool | None = None) -> None:
    """One Adam step of ``param`` in place, skipping entries whose ``grad`` is 0.

    Args:
        param, grad, exp_avg, exp_avg_sq: float32 tensors of one shape on one device (contiguous).
        steps: int32, the same shape: steps each entry has taken (updated).
        lr, betas, eps: Adam's.
        found_inf: [1] float32 on the device; when non-zero nothing changes (a skipped step), read by
            the kernel without a host sync.
        use_kernels: as :func:`kernels.hash_encode`.
    """
    dev = param.device
    for name, t, dtype in (("param", param, torch.float32), ("grad", grad, torch.float32),
                           ("exp_avg", exp_avg, torch.float32), ("exp_avg_sq", exp_avg_sq, torch.float32),
                           ("steps", steps, torch.int32)):
        if not isinstance(t, torch.Tensor) or t.shape != param.shape or t.dtype != dtype or t.device != dev:
            raise ValueError(f"{name} must be a {dtype} tensor of shape {tuple(param.shape)} on {dev}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if found_inf is not None and (found_inf.numel() != 1 or found_inf.dtype != torch.float32 or found_inf.device != dev):
        raise ValueError(f"found_inf must be a one-element float32 tensor on {dev}")
    if not _use_kernels(dev, use_kernels):
        sparse_adam_reference(param, grad, exp_avg, exp_avg_sq, steps, lr, betas, eps, found_inf)
        return
    n = param.numel()
    if n:
        program().launch("sparse_adam", (-(-n // BLOCK_SIZE),), (BLOCK_SIZE,),
                         [(param.data_ptr(), ptr), (grad.data_ptr(), ptr), (exp_avg.data_ptr(), ptr),
                          (exp_avg_sq.data_ptr(), ptr), (steps.data_ptr(), ptr),
                          (0 if found_inf is None else found_inf.data_ptr(), ptr), (n, i64), (float(lr), f32),
                          (float(betas[0]), f32), (float(betas[1]), f32), (float(eps), f32)], device=dev)
