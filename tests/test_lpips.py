"""LPIPS with user-supplied weights: the network, the weight formats it reads, its errors, and the
evaluate stage reporting it. (Real ImageNet/LPIPS weights are not downloadable here, so the
weights are random tensors in the published files' layouts; the values are checked for the
properties of a distance, not against the lpips package.)"""
from __future__ import annotations

import pytest
import torch

from stages.common.lpips import LPIPS, NETS


def _weights(tmp_path, net: str, corrupt: str | None = None):
    g = torch.Generator().manual_seed(0)
    bb, convs = {}, []
    i = 0
    for spec in NETS[net]:
        if spec[0] == "conv":
            _, cin, cout, k, _, _ = spec
            bb[f"features.{i}.weight"] = torch.randn(cout, cin, k, k, generator=g) * (2 / (cin * k * k)) ** 0.5
            bb[f"features.{i}.bias"] = torch.zeros(cout)
            convs.append(cout)
            i += 2  # conv, relu
        else:
            i += 1
    bb["classifier.1.weight"] = torch.zeros(4, 4)  # torchvision's head: ignored
    taps = {"alex": [0, 1, 2, 3, 4], "vgg": [1, 3, 6, 9, 12]}[net]
    lin = {f"lin{k}.model.1.weight": torch.rand(1, convs[c], 1, 1, generator=g) for k, c in enumerate(taps)}
    if corrupt == "backbone":
        bb["features.0.weight"] = bb["features.0.weight"][:, :2]
    if corrupt == "linear":
        del lin["lin2.model.1.weight"]
    torch.save(bb, tmp_path / f"{net}_backbone.pth")
    torch.save(lin, tmp_path / f"{net}_lin.pth")
    return tmp_path / f"{net}_backbone.pth", tmp_path / f"{net}_lin.pth"


@pytest.mark.parametrize("net", ["alex", "vgg"])
def test_lpips_is_a_distance_on_user_weights(tmp_path, net):
    m = LPIPS(net, *_weights(tmp_path, net))
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 3, 64, 64, generator=g)
    b = (a + 0.2 * torch.randn(2, 3, 64, 64, generator=g)).clamp(0, 1)
    c = (a + 0.05 * torch.randn(2, 3, 64, 64, generator=g)).clamp(0, 1)
    assert torch.equal(m(a, a), torch.zeros(2))
    dab, dba, dac = m(a, b), m(b, a), m(a, c)
    assert (dab > 0).all() and torch.allclose(dab, dba)
    assert (dac < dab).all()  # less noise, closer


def test_lpips_weight_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(ValueError, match="lpips_backbone .*features.0.weight"):
        LPIPS("alex", *_weights(tmp_path, "alex", corrupt="backbone"))
    with pytest.raises(ValueError, match="lpips_linear .*lin2.model.1.weight"):
        LPIPS("alex", *_weights(tmp_path, "alex", corrupt="linear"))
    with pytest.raises(ValueError, match="not found"):
        LPIPS("alex", tmp_path / "nope.pth", tmp_path / "nope2.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read"):
        LPIPS("alex", tmp_path / "junk.pth", tmp_path / "junk.pth")
    m = LPIPS("alex", *_weights(tmp_path, "alex"))
    with pytest.raises(ValueError, match="at least 32x32"):
        m(torch.rand(1, 3, 24, 32), torch.rand(1, 3, 24, 32))
    with pytest.raises(ValueError, match="net must be"):
        LPIPS("squeeze", tmp_path / "junk.pth", tmp_path / "junk.pth")


def test_evaluate_params_need_both_lpips_files():
    from stages.common.params import ParamsError
    from stages.evaluate import EvaluateParams

    with pytest.raises((ParamsError, ValueError), match="lpips"):
        EvaluateParams(lpips_backbone="a.pth")
