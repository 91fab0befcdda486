"""Adam over several tensors in one kernel launch, each with its own learning rate.

3D Gaussian Splatting keeps one Adam per parameter (means, quats, scales, opacities, sh0, shN:
the learning rates differ, and densification resizes each one's state). Stepping six
``torch.optim.Adam(fused=True)`` objects costs six Python ``step`` calls and six launches a
training step, about 0.7 ms of host time and 0.45 ms of GPU time at 120k Gaussians on an H200
(torch.profiler, lego); this op is one launch for the update and one for the step counts.

It works on the optimizers' own state tensors (``exp_avg``, ``exp_avg_sq`` and the float32
``step`` on the device, torch's fused layout), so ``state_dict``/``load_state_dict`` and the
densification's row surgery see exactly what ``torch.optim.Adam`` would. The arithmetic is
fused Adam's (no weight decay, no amsgrad). CUDA source: ``csrc/adam.cu``; on CPU tensors the
PyTorch twin :func:`adam_step_reference` runs.

:func:`sparse_adam_step` is the NeRF hash table's: tiny-cuda-nn's rule for sparse gradients (an
entry whose gradient is exactly zero is not stepped and its moments do not decay; each entry's
bias correction counts the steps it was trained in), one fused pass instead of the ~30 elementwise
ones of its reference ``_reference.sparse_adam_reference`` (~2 ms a step on an H200 for a table of
2^19 x 16 x 2 entries, about a training step's own time).

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

MAX_TENSORS = 6
BLOCK = 256
_NAMES = ["adam_multi", "adam_bump_steps", "sparse_adam"]
_program: KernelProgram | None = None


def program() -> KernelProgram:
    global _program
    if _program is None:
        _program = KernelProgram("adam.cu", _NAMES)
    return _program


def default_programs() -> list[KernelProgram]:
    return [program()]


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, lrs) -> torch.device:
    n = len(params)
    if not 1 <= n <= MAX_TENSORS:
        raise ValueError(f"adam_step takes 1..{MAX_TENSORS} tensors, got {n}")
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("steps", steps),
                      ("lrs", lrs)):
        if len(seq) != n:
            raise ValueError(f"adam_step: {name} has {len(seq)} entries, params {n}")
    dev = params[0].device
    for i, (p, g, m, v, s) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device != dev or t.shape != p.shape:
                raise ValueError(f"adam_step: {name} {i} must be a contiguous float32 tensor of shape "
                                 f"{tuple(p.shape)} on {dev}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != dev:
            raise ValueError(f"adam_step: step {i} must be a one-element float32 tensor on {dev}")
    return dev


@torch.no_grad()
def adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, steps, lrs, *, beta1: float = 0.9,
                        beta2: float = 0.999, eps: float = 1e-8, found_inf: torch.Tensor | None = None) -> None:
    """PyTorch twin of :func:`adam_step` (the same formula, tensor by tensor)."""
    if found_inf is not None and bool(found_inf.reshape(-1)[0] != 0):
        return
    for p, g, m, v, s, lr in zip(params, grads, exp_avgs, exp_avg_sqs, steps, lrs):
        s += 1.0
        t = float(s)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.sqrt().div_((1.0 - beta2**t) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1.0 - beta1**t))


@torch.no_grad()
def adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lrs: list[float], *, beta1: float = 0.9,
              beta2: float = 0.999, eps: float = 1e-8, found_inf: torch.Tensor | None = None,
              use_kernels: bool | None = None) -> None:
    """One Adam step of every tensor in place, skipped entirely when ``found_inf`` is non-zero.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: up to six float32 tensors each, contiguous, one device.
        steps: each tensor's step count (one-element float32 tensors, advanced by one).
        lrs: each tensor's learning rate.
        found_inf: optional one-element float32 flag on the device (no host read on a GPU).
        use_kernels: None: the CUDA kernel on CUDA tensors where it runs, else the twin.
    """
    dev = _check(params, grads, exp_avgs, exp_avg_sqs, steps, lrs)
    if not _use_kernels(dev, use_kernels):
        adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, steps, lrs, beta1=beta1, beta2=beta2, eps=eps,
                            found_inf=found_inf)
        return
    args = []
    n_max = 0
    for k in range(MAX_TENSORS):
        if k < len(params):
            p, g, m, v, s = params[k], grads[k], exp_avgs[k], exp_avg_sqs[k], steps[k]
            args += [(p.data_ptr(), ptr), (g.data_ptr(), ptr), (m.data_ptr(), ptr), (v.data_ptr(), ptr),
                     (s.data_ptr(), ptr), (p.numel(), i64), (float(lrs[k]), f32)]
            n_max = max(n_max, p.numel())
        else:
            args += [(0, ptr)] * 5 + [(0, i64), (0.0, f32)]
    flag = (0 if found_inf is None else found_inf.data_ptr(), ptr)
    blocks = max(1, min(-(-n_max // BLOCK), 1024))
    prog = program()
    prog.launch("adam_multi", (blocks, len(params)), (BLOCK,),
                args + [flag, (float(beta1), f32), (float(beta2), f32), (float(eps), f32)], device=dev)
    step_ptrs = [(steps[k].data_ptr() if k < len(steps) else 0, ptr) for k in range(MAX_TENSORS)]
    prog.launch("adam_bump_steps", (1,), (32,), step_ptrs + [flag], device=dev)


def step_adams(optimizers: dict[str, torch.optim.Adam], found_inf: torch.Tensor | None = None,
               use_kernels: bool | None = None) -> None:
    """Step a dict of single-parameter Adams (no weight decay, no amsgrad) with :func:`adam_step`,
    creating their state as torch would on a first step, then drop the gradients."""
    params, grads, ms, vs, steps, lrs = [], [], [], [], [], []
    betas = eps = None
    for opt in optimizers.values():
        group = opt.param_groups[0]
        (p,) = group["params"]
        if p.grad is None:
            continue
        if group.get("weight_decay", 0) or group.get("amsgrad") or group.get("maximize"):
            raise ValueError("step_adams: weight decay, amsgrad and maximize are not supported")
        state = opt.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # a CPU step count (a checkpoint read back): the kernel reads it
            state["step"] = state["step"].to(p.device, torch.float32)
        if (betas, eps) != (None, None) and (tuple(group["betas"]), group["eps"]) != (betas, eps):
            raise ValueError("step_adams: every optimizer must share betas and eps")
        betas, eps = tuple(group["betas"]), group["eps"]
        params.append(p.data)
        grads.append(p.grad.contiguous())
        ms.append(state["exp_avg"])
        vs.append(state["exp_avg_sq"])
        steps.append(state["step"])
        lrs.append(group["lr"])
    if params:
        adam_step(params, grads, ms, vs, steps, lrs, beta1=betas[0], beta2=betas[1], eps=eps, found_inf=found_inf,
                  use_kernels=use_kernels)
    for opt in optimizers.values():
        opt.param_groups[0]["params"][0].grad = None


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
        program().launch("sparse_adam", (-(-n // BLOCK),), (BLOCK,),
                         [(param.data_ptr(), ptr), (grad.data_ptr(), ptr), (exp_avg.data_ptr(), ptr),
                          (exp_avg_sq.data_ptr(), ptr), (steps.data_ptr(), ptr),
                          (0 if found_inf is None else found_inf.data_ptr(), ptr), (n, i64), (float(lr), f32),
                          (float(betas[0]), f32), (float(betas[1]), f32), (float(eps), f32)], device=dev)
