"""LPIPS (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features as a Perceptual
Metric"), version 0.1, with weights the user supplies: nothing is downloaded, nothing estimated.

Two files are needed (``evaluate.lpips_net``, ``evaluate.lpips_backbone``,
``evaluate.lpips_linear``):

* the backbone: torchvision's ImageNet ``alexnet`` or ``vgg16`` state dict (keys
  ``features.<i>.weight`` / ``.bias``; ``classifier.*`` is ignored), e.g.
  ``alexnet-owt-7be5be79.pth`` or ``vgg16-397923af.pth``;
* the linear calibration layers of LPIPS v0.1 for that backbone (keys
  ``lin<k>.model.1.weight``, shape [1, C_k, 1, 1]), e.g. ``weights/v0.1/alex.pth`` of the
  ``lpips`` package.

The distance follows the paper: inputs in [-1, 1] are shifted and scaled per channel, the
backbone's ReLU outputs after each of its 5 stages are unit-normalised along channels, their
squared difference is weighted per channel by the linear layer, averaged over space and summed
over the stages. Lower is more similar; an image against itself scores 0.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# Input normalisation of LPIPS v0.1 (its ScalingLayer), for inputs in [-1, 1].
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)

# torchvision's `features` layers: ("conv", in, out, kernel, stride, padding) | ("pool", kernel, stride).
_ALEX = [("conv", 3, 64, 11, 4, 2), ("pool", 3, 2), ("conv", 64, 192, 5, 1, 2), ("pool", 3, 2),
         ("conv", 192, 384, 3, 1, 1), ("conv", 384, 256, 3, 1, 1), ("conv", 256, 256, 3, 1, 1)]
_VGG16 = [("conv", 3, 64, 3, 1, 1), ("conv", 64, 64, 3, 1, 1), ("pool", 2, 2),
          ("conv", 64, 128, 3, 1, 1), ("conv", 128, 128, 3, 1, 1), ("pool", 2, 2),
          ("conv", 128, 256, 3, 1, 1), ("conv", 256, 256, 3, 1, 1), ("conv", 256, 256, 3, 1, 1), ("pool", 2, 2),
          ("conv", 256, 512, 3, 1, 1), ("conv", 512, 512, 3, 1, 1), ("conv", 512, 512, 3, 1, 1), ("pool", 2, 2),
          ("conv", 512, 512, 3, 1, 1), ("conv", 512, 512, 3, 1, 1), ("conv", 512, 512, 3, 1, 1)]
# LPIPS taps the ReLU after these convolutions (0-based conv counts): alex conv1..5; vgg relu1_2, 2_2, 3_3, 4_3, 5_3.
_TAPS = {"alex": (0, 1, 2, 3, 4), "vgg": (1, 3, 6, 9, 12)}
NETS = {"alex": _ALEX, "vgg": _VGG16}


class LPIPS(nn.Module):
    """LPIPS v0.1 distance with an AlexNet or VGG16 backbone.

    Args:
        net: ``alex`` or ``vgg``.
        backbone: path of the torchvision ImageNet state dict of that network.
        linear: path of the LPIPS v0.1 linear-layer state dict for that network.

    Raises:
        ValueError: a file is missing, unreadable, or its tensors do not fit the network.
    """

    def __init__(self, net: str, backbone: str | Path, linear: str | Path):
        super().__init__()
        if net not in NETS:
            raise ValueError(f"LPIPS net must be one of {sorted(NETS)}, got {net!r}")
        self.net = net
        layers: list[nn.Module] = []
        self._taps: list[int] = []  # indices into `layers` of the ReLUs LPIPS reads
        conv = 0
        for spec in NETS[net]:
            if spec[0] == "conv":
                _, cin, cout, k, s, p = spec
                layers += [nn.Conv2d(cin, cout, k, s, p), nn.ReLU(inplace=False)]
                if conv in _TAPS[net]:
                    self._taps.append(len(layers) - 1)
                conv += 1
            else:
                layers.append(nn.MaxPool2d(spec[1], spec[2]))
        self.features = nn.Sequential(*layers)
        channels = [layers[i - 1].out_channels for i in self._taps]
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, 1, bias=False) for c in channels)
        self.register_buffer("shift", torch.tensor(_SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(_SCALE).view(1, 3, 1, 1))
        self._load(backbone, linear)
        self.eval().requires_grad_(False)

    def _load(self, backbone: str | Path, linear: str | Path) -> None:
        bb = _read_state(backbone, "lpips_backbone")
        # torchvision numbers `features.<i>` over conv, relu and pool layers alike: ours match.
        want = {f"{i}.{kind}": t for i, m in enumerate(self.features) if isinstance(m, nn.Conv2d)
                for kind, t in (("weight", m.weight), ("bias", m.bias))}
        for key, dst in want.items():
            src = bb.get(f"features.{key}")
            if src is None or tuple(src.shape) != tuple(dst.shape):
                got = None if src is None else tuple(src.shape)
                raise ValueError(f"evaluate.lpips_backbone {backbone}: features.{key} should be "
                                 f"{tuple(dst.shape)} for torchvision's {self.net}, got {got}")
            dst.data.copy_(src.float())
        lin = _read_state(linear, "lpips_linear")
        for k, m in enumerate(self.lins):
            src = lin.get(f"lin{k}.model.1.weight")
            if src is None or tuple(src.shape) != tuple(m.weight.shape):
                got = None if src is None else tuple(src.shape)
                raise ValueError(f"evaluate.lpips_linear {linear}: lin{k}.model.1.weight should be "
                                 f"{tuple(m.weight.shape)} for LPIPS v0.1 {self.net}, got {got}")
            m.weight.data.copy_(src.float())

    @torch.no_grad()
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Distances [B] between images [B, 3, H, W] with values in [0, 1]."""
        if a.shape != b.shape or a.ndim != 4 or a.shape[1] != 3:
            raise ValueError(f"LPIPS wants two [B, 3, H, W] batches of one shape, got {tuple(a.shape)} "
                             f"and {tuple(b.shape)}")
        least = {"alex": 32, "vgg": 16}[self.net]
        if min(a.shape[-2:]) < least:
            raise ValueError(f"LPIPS {self.net} needs images of at least {least}x{least} pixels, got "
                             f"{a.shape[-1]}x{a.shape[-2]}")
        feats = []
        for x in (a, b):
            h = ((x.float() * 2 - 1) - self.shift) / self.scale
            taps = []
            for i, layer in enumerate(self.features):
                h = layer(h)
                if i in self._taps:
                    taps.append(h / (h.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10))
                if len(taps) == len(self._taps):
                    break
            feats.append(taps)
        d = torch.zeros(a.shape[0], device=a.device)
        for lin, fa, fb in zip(self.lins, *feats):
            d = d + lin((fa - fb) ** 2).mean(dim=(1, 2, 3))
        return d


def _read_state(path: str | Path, key: str) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"evaluate.{key}: {path} not found (LPIPS needs weights you supply; "
                         "see stages/common/lpips.py)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input problem
        raise ValueError(f"evaluate.{key}: cannot read {path}: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"evaluate.{key}: {path} holds a {type(state).__name__}, not a state dict")
    return state
