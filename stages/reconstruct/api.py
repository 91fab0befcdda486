"""Loading a trained model for rendering (used by the evaluate stage and by users).

Example:
    >>> model = load_trained("data/reconstruct")
    >>> img = model.render(intr, c2w_cv)          # [H, W, 3] float32 in [0, 1], on the CPU
    >>> out = model.render_outputs(intr, c2w_cv)  # {"rgb", "depth", "alpha"}, on the CPU
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from stages.common.cameras import Intrinsics
from stages.common.params import from_dict

from . import MODEL_FORMAT, pick_device
from .config import ReconstructParams, migrate_config
from .methods import build_method


class TrainedModel:
    """A trained method ready to render views of the normalized scene frame."""

    def __init__(self, method, device: torch.device):
        self._method = method
        self.method = method.name
        self.device = device
        self.num_params = method.num_params

    @property
    def module(self):
        """The method object itself (``NerfMethod``, ...), for tools that need more than renders (export)."""
        return self._method

    @torch.no_grad()
    def render(self, intr: Intrinsics, c2w_cv: np.ndarray, chunk_rays: int = 8192) -> torch.Tensor:
        c2w = torch.as_tensor(np.asarray(c2w_cv), dtype=torch.float32)
        return self._method.render_image(intr, c2w, chunk_rays).float().cpu()

    @property
    def has_outputs(self) -> bool:
        """Whether the method renders depth and opacity besides RGB (:meth:`render_outputs`)."""
        return hasattr(self._method, "render_outputs")

    @torch.no_grad()
    def render_outputs(self, intr: Intrinsics, c2w_cv: np.ndarray, chunk_rays: int = 8192) -> dict[str, torch.Tensor]:
        """``rgb`` [H, W, 3] in [0, 1], ``depth`` [H, W] (expected ray distance, weights' sum of
        distances along the unit ray, not divided by the opacity) and ``alpha`` [H, W] (opacity),
        float32 on the CPU.

        Raises:
            ValueError: the method renders RGB only.
        """
        if not self.has_outputs:
            raise ValueError(f"method {self.method!r} renders RGB only (no render_outputs): no depth or opacity")
        c2w = torch.as_tensor(np.asarray(c2w_cv), dtype=torch.float32)
        return {k: v.float().cpu() for k, v in self._method.render_outputs(intr, c2w, chunk_rays).items()}


def read_model(model_dir: str | Path) -> dict:
    """The checked contents of ``<model_dir>/model.pt`` (format, method, config, aabb, state) on the CPU."""
    path = Path(model_dir) / "model.pt"
    if not path.is_file():
        raise ValueError(f"no trained model at {path}; run the reconstruct stage first")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise ValueError(f"{path}: not a readable model file ({exc})") from None
    if not isinstance(blob, dict) or blob.get("format") != MODEL_FORMAT:
        raise ValueError(f"{path}: not a {MODEL_FORMAT} file")
    return blob


def load_trained(model_dir: str | Path, device: str = "auto") -> TrainedModel:
    """Load ``<model_dir>/model.pt`` written by the reconstruct stage."""
    blob = read_model(model_dir)
    params = from_dict(ReconstructParams, migrate_config(blob["config"]), "reconstruct")
    params.kernels = "auto"  # render with kernels where they run, whatever trained it
    dev = pick_device(device)
    method = build_method(params, blob["aabb"], dev)
    method.load_state_dict(blob["state"])
    return TrainedModel(method, dev)
