"""The seam between the training loop and a reconstruction method.

The loop (``train.py``) knows nothing of rays or Gaussians: it asks the method for a batch
sampler, runs ``forward_backward`` on each micro-batch, lets the parallel strategy reduce
the gradients, steps the method's optimizers, calls ``after_step`` (where 3DGS densifies)
and saves ``state_dict`` / the optimizers by name. Every method registered in
:data:`METHODS` provides the members of :class:`Method`.

Adding a method: write a class with these members, register its constructor in
:data:`METHODS` (imported lazily, so a NeRF run never imports the Gaussian code), give it a
params section in ``config.py``, and list the keys that may differ between a run and its
resume (kernel switches and the like) in its ``OPERATIONAL_KEYS``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

import torch

from stages.common.cameras import Intrinsics

# name -> "module:class", relative to this package; the constructor takes
# (params: ReconstructParams, aabb, device, background=None, scene=None)
METHODS: dict[str, str] = {
    "nerf": ".nerf.method:NerfMethod",
    "3dgs": ".gs.method:GaussianMethod",
}


class BatchSampler(Protocol):
    """Draws one micro-batch of this rank's training data (rays, or views)."""

    def sample(self, n: int) -> Any: ...


class Method(Protocol):
    """What the training loop, the checkpoints and evaluation call on a method."""

    name: str
    VERSION: int  # bumped when a checkpoint of an older version can no longer be resumed
    OPERATIONAL_KEYS: frozenset[str]  # params keys ("nerf.cuda_graph") that may change on resume
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    use_kernels: bool

    @property
    def num_params(self) -> int: ...

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable tensors, in a fixed order (the gradient reducer's buckets follow it)."""

    def batch_size(self) -> int:
        """Units (rays, views) one rank trains on per step; split into micro-batches."""

    def place(self, views):
        """The training views where the method trains on them (the device, or pinned CPU memory)."""

    def make_sampler(self, views, generator: torch.Generator) -> BatchSampler:
        """This shard's sampler; one with a ``seek(units_drawn)`` is told where a resumed run is."""

    def step_pre_forward(self, step: int, generator: torch.Generator) -> torch.Tensor | None:
        """Refresh shared state before the step (same generator on every rank); not None when
        :meth:`buffers` changed (the strategy then broadcasts them)."""

    def forward_backward(self, batch: Any, generator: torch.Generator,
                         before_backward: Callable[[], None] | None = None) -> dict:
        """Add one micro-batch's gradients to ``.grad``; returns device tensors ``loss``, ``mse``
        and ``num_samples`` (the work done: ray samples, or rendered pixels)."""

    def optimizer_step(self, step: int) -> None:
        """Step every optimizer and scheduler, then drop the gradients."""

    def after_step(self, step: int, strategy) -> bool:
        """Work after the optimizer step (densification); True when :meth:`parameters` changed."""

    def quick_test_psnr(self, views, generator: torch.Generator) -> float | None:
        """A cheap PSNR on held-out views for the training curve."""

    def render_image(self, intr: Intrinsics, c2w: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """[H, W, 3] float32 in [0, 1] on the method's device."""

    def state_dict(self) -> dict:
        """The replicated state: the same on every rank (the replica check compares it)."""

    def load_state_dict(self, state: dict) -> None: ...

    def local_state(self) -> dict:
        """State that differs between ranks (3DGS: densification statistics of its own views); a
        checkpoint keeps every rank's."""

    def load_local_state(self, state: dict) -> None: ...

    def summary(self) -> dict:
        """Method-specific figures for ``summary.json``."""


def resolve_use_kernels(setting: str, device: torch.device) -> bool:
    """Whether a method runs the CUDA kernels (``reconstruct.kernels``): ``auto`` means on a GPU
    where the NVRTC runtime works."""
    import kernels

    if setting == "off":
        return False
    can = device.type == "cuda" and kernels.available()
    if setting == "on" and not can:
        raise ValueError("reconstruct.kernels is 'on' but CUDA kernels cannot run here "
                         f"(device {device}, kernels.available()={kernels.available()})")
    return can


def method_class(name: str):
    """The class registered for ``name`` (imported on first use)."""
    if name not in METHODS:
        raise ValueError(f"reconstruct.method: unknown method {name!r}; one of {', '.join(METHODS)}")
    module, _, cls = METHODS[name].partition(":")
    return getattr(importlib.import_module(module, __package__), cls)


def build_method(params, aabb: torch.Tensor, device: torch.device,
                 background: tuple[float, float, float] | None = None, scene=None):
    """A fresh ``params.method`` on ``device``; ``scene`` (a :class:`data.Scene`) seeds methods
    that initialise from data (3DGS from the sparse points), None when a state dict follows."""
    return method_class(params.method)(params, aabb, device, background, scene)


def expectation(params, seed: int, world_size: int):
    """What a checkpoint must match for a run of ``params`` to resume it (checkpoint.Expectation)."""
    from stages.common.params import to_dict

    from .checkpoint import Expectation

    cls = method_class(params.method)
    if params.distributed.mode == "partitioned":
        world_size = None  # shards are re-split over any world size
    return Expectation(params.method, to_dict(params), seed, world_size, cls.OPERATIONAL_KEYS, cls.VERSION)


def all_optimizer_state(method) -> dict[str, dict]:
    return {name: opt.state_dict() for name, opt in method.optimizers.items()}


def all_scheduler_state(method) -> dict[str, dict]:
    return {name: s.state_dict() for name, s in method.schedulers.items()}


def load_optimizer_state(method, optimizers: dict, schedulers: dict | None) -> None:
    """Restore the optimizers and schedulers saved by name; a name missing on either side is an error."""
    if set(optimizers) != set(method.optimizers):
        raise ValueError(f"checkpoint has optimizers {sorted(optimizers)}, the {method.name} method "
                         f"{sorted(method.optimizers)}")
    for name, sd in optimizers.items():
        method.optimizers[name].load_state_dict(sd)
    for name, sd in (schedulers or {}).items():
        if name in method.schedulers and sd is not None:
            method.schedulers[name].load_state_dict(sd)


def step_optimizers(optimizers: dict[str, torch.optim.Optimizer], schedulers: dict[str, Any],
                    skip: torch.Tensor) -> None:
    """Step every optimizer unless ``skip`` (0-d float on the device, 1 = a non-finite step) is set,
    then drop the gradients and step the schedulers (a skipped step still advances them).

    On a GPU the fused Adam kernels read the flag themselves (``found_inf``, as under a
    GradScaler), so skipping costs no host sync; elsewhere the flag is read here."""
    opts = list(optimizers.values())
    on_device = all(o.defaults.get("fused") for o in opts) and skip.device.type == "cuda"
    if on_device:
        for o in opts:
            o.found_inf = skip
            o.step()
            del o.found_inf
    elif not bool(skip.item()):
        for o in opts:
            o.step()
    for o in opts:
        o.zero_grad(set_to_none=True)
    for s in schedulers.values():
        s.step()
