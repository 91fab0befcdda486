"""kernels.adam: six tensors in one Adam launch, against torch.optim.Adam, on the CPU (the twin)
and on a GPU (the kernel), with the skip flag and the state layout torch reads back."""
from __future__ import annotations

import pytest
import torch

from kernels import loader
from kernels.adam import adam_step, step_adams

from conftest import requires_gpu

SHAPES = [(50, 3), (50, 4), (50, 3), (50,), (50, 1, 3), (50, 15, 3)]
LRS = [1.6e-4, 1e-3, 5e-3, 5e-2, 2.5e-3, 1.25e-4]


def _pair(device, fused: bool):
    torch.manual_seed(0)
    base = [torch.randn(s, device=device) for s in SHAPES]
    ours = [torch.nn.Parameter(t.clone()) for t in base]
    ref = [torch.nn.Parameter(t.clone()) for t in base]
    mk = lambda p, lr: torch.optim.Adam([p], lr=lr, eps=1e-15, fused=fused)  # noqa: E731
    return ({str(i): mk(p, lr) for i, (p, lr) in enumerate(zip(ours, LRS))},
            [mk(p, lr) for p, lr in zip(ref, LRS)], ours, ref)


def _train(device, fused: bool, steps: int = 5, skip_at: int | None = None):
    ours_opt, ref_opt, ours, ref = _pair(device, fused)
    for step in range(steps):
        g = [torch.randn(s, device=device) for s in SHAPES]
        flag = torch.full((), 1.0 if step == skip_at else 0.0, device=device)
        for p, gi in zip(ours, g):
            p.grad = gi.clone()
        step_adams(ours_opt, flag)
        if step != skip_at:
            for p, gi, o in zip(ref, g, ref_opt):
                p.grad = gi.clone()
                o.step()
                o.zero_grad()
    return ours_opt, ref_opt, ours, ref


def _compare(ours_opt, ref_opt, ours, ref, rtol, atol):
    for p, q, o, r in zip(ours, ref, ours_opt.values(), ref_opt):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
        so, sr = o.state[p], r.state[q]
        torch.testing.assert_close(so["exp_avg"], sr["exp_avg"], rtol=rtol, atol=atol)
        torch.testing.assert_close(so["exp_avg_sq"], sr["exp_avg_sq"], rtol=rtol, atol=atol)
        assert float(so["step"]) == float(sr["step"])
        assert p.grad is None


def test_twin_matches_torch_adam_and_skips_a_flagged_step():
    # the same float32 formula as torch's Adam; rounding of the order of a few ulps
    _compare(*_train("cpu", fused=False, skip_at=2), rtol=1e-5, atol=1e-7)


def test_the_state_reads_back_into_torch_adam():
    ours_opt, _, ours, _ = _train("cpu", fused=False, steps=3)
    sd = ours_opt["5"].state_dict()
    fresh = torch.optim.Adam([torch.nn.Parameter(ours[5].detach().clone())], lr=LRS[5], eps=1e-15)
    fresh.load_state_dict(sd)
    assert float(next(iter(fresh.state.values()))["step"]) == 3.0


def test_bad_tensors_are_refused():
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="1..6 tensors"):
        adam_step([p] * 7, [p] * 7, [p] * 7, [p] * 7, [torch.zeros(())] * 7, [1.0] * 7)
    with pytest.raises(ValueError, match="grad 0 must be a contiguous float32"):
        adam_step([p], [torch.zeros(3, dtype=torch.float64)], [p.clone()], [p.clone()], [torch.zeros(())], [1.0])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_adam_compiles_through_nvrtc(arch, tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    prog = loader.compile_source(loader.CSRC_DIR / "adam.cu", arch, name_expressions=["adam_multi", "adam_bump_steps"])
    assert prog.image_kind == "cubin" and set(prog.lowered_names) == {"adam_multi", "adam_bump_steps"}


@pytest.mark.gpu
@requires_gpu
def test_kernel_matches_torch_fused_adam_and_skips_a_flagged_step():
    # fused Adam computes the same float32 formula; powf / sqrtf in the kernel may differ by an ulp
    _compare(*_train("cuda", fused=True, steps=20, skip_at=7), rtol=1e-5, atol=1e-6)
