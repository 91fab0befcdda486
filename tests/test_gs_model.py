"""3DGS model pieces (stages/reconstruct/gs): nearest neighbours, initialisation, scene extent,
optimizers and their schedule, densification with its optimizer-state surgery, and the PLY format."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from stages.common.params import ParamsError
from stages.reconstruct.gs import densify as dz
from stages.reconstruct.gs import model as gm

BOX = torch.tensor([[-1.0, -2.0, -0.5], [1.0, 2.0, 0.5]])


def _brute_knn(points: torch.Tensor, k: int) -> torch.Tensor:
    d2 = (points[:, None] - points[None]).square().sum(-1)  # the same float32 arithmetic per pair
    d2.fill_diagonal_(torch.inf)
    return d2.topk(k, largest=False).values.sqrt()


def _point_sets() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "uniform": torch.rand(1500, 3, generator=g),
        "plane": torch.cat([torch.rand(1500, 2, generator=g), torch.zeros(1500, 1)], 1),
        "line": torch.linspace(-3, 3, 800)[:, None] * torch.tensor([1.0, 0.5, 0.25]),
        # a dense cluster with far outliers: cells sized for the cluster are empty around the outliers
        "cluster+outliers": torch.cat([torch.randn(1400, 3, generator=g) * 1e-3,
                                       torch.randn(100, 3, generator=g) * 100]),
        "duplicates": torch.rand(400, 3, generator=g).repeat(3, 1),  # each point twice more: distance 0
        "lattice": torch.stack(torch.meshgrid(*[torch.arange(10.0)] * 3, indexing="ij"), -1).reshape(-1, 3),
    }


# ---------------------------------------------------------------------------- nearest neighbours


@pytest.mark.parametrize("name", list(_point_sets()))
def test_knn_is_exact_against_brute_force(name):
    points = _point_sets()[name]
    for k in (1, 3, 5):
        # bit-equal: both compute each pair's squared distance the same way in float32 (ties, as on
        # the lattice, cannot change the k smallest values)
        assert torch.equal(gm.knn_distances(points, k), _brute_knn(points, k)), (name, k)


def test_knn_across_many_grid_levels_with_small_batches():
    """Tiny query and pair batches: every batching boundary and several grid levels are crossed."""
    g = torch.Generator().manual_seed(1)
    points = torch.cat([torch.rand(3000, 3, generator=g) ** 4 * 50, torch.randn(500, 3, generator=g) * 1e-2])
    got = gm.knn_distances(points, 3, query_chunk=97, max_pairs=500)
    assert torch.equal(got, _brute_knn(points, 3))


def test_knn_example_and_errors():
    pts = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 4]])
    torch.testing.assert_close(gm.knn_distances(pts, 2), torch.tensor(
        [[1.0, 2.0], [1.0, math.sqrt(5)], [2.0, math.sqrt(5)], [4.0, math.sqrt(17)]]))
    assert torch.equal(gm.knn_distances(torch.ones(5, 3), 3), torch.zeros(5, 3))  # all coincide
    with pytest.raises(ValueError, match="more than 3 points"):
        gm.knn_distances(torch.rand(3, 3), 3)
    with pytest.raises(ValueError, match="finite"):
        gm.knn_distances(torch.tensor([[0.0, 0, 0], [1, 1, 1], [float("nan"), 0, 0]]), 1)
    with pytest.raises(ValueError, match=r"\[P, 3\]"):
        gm.knn_distances(torch.rand(10, 2), 1)


# ---------------------------------------------------------------------------- initialisation


def test_init_from_sparse_points():
    g = torch.Generator().manual_seed(2)
    points = torch.rand(300, 3, generator=g)
    rgb = torch.randint(0, 256, (300, 3), generator=g, dtype=torch.uint8)
    params = gm.init_gaussians(points, rgb, None, sh_degree=2, init_opacity=0.1, init_scale=0.5)
    assert list(params) == list(gm.PARAM_NAMES)
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in params.values())
    assert torch.equal(params["means"], points)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    assert shapes == {"means": (300, 3), "quats": (300, 4), "scales": (300, 3), "opacities": (300,),
                      "sh0": (300, 1, 3), "shN": (300, 8, 3)}
    # colour = C0 * sh0 + 0.5 renders the point's colour; higher coefficients start at zero
    torch.testing.assert_close(gm.SH_C0 * params["sh0"][:, 0] + 0.5, rgb.float() / 255)
    assert not params["shN"].any()
    # isotropic log scale: log(0.5 * rms of the 3 nearest distances), checked by brute force
    want = torch.log(0.5 * _brute_knn(points, 3).square().mean(1).sqrt())
    torch.testing.assert_close(params["scales"], want[:, None].expand(-1, 3))
    assert torch.equal(params["quats"], torch.tensor([[1.0, 0, 0, 0]]).expand(300, 4))
    torch.testing.assert_close(params["opacities"].sigmoid(), torch.full((300,), 0.1))
    act = gm.activated(params)
    assert act.colors.shape == (300, 9, 3) and torch.equal(act.colors[:, :1], params["sh0"])
    torch.testing.assert_close(act.scales, torch.exp(params["scales"]))
    gray = gm.init_gaussians(points, None, None, sh_degree=0)
    assert gray["shN"].shape == (300, 0, 3) and not gray["sh0"].any()  # gray = SH 0


def test_init_random_in_the_box_is_seeded():
    def make(seed):
        return gm.init_gaussians(None, None, BOX, n_random=2000, generator=torch.Generator().manual_seed(seed))

    a, b, c = make(3), make(3), make(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["means"], c["means"])
    m = a["means"]
    assert m.shape == (2000, 3) and bool((m >= BOX[0]).all() and (m <= BOX[1]).all())
    assert bool((m.amin(0) - BOX[0] < 0.05).all() and (BOX[1] - m.amax(0) < 0.05).all())  # fills the box
    rgb = gm.SH_C0 * a["sh0"].detach()[:, 0] + 0.5
    assert bool((rgb >= 0).all() and (rgb <= 1).all()) and float(rgb.std()) > 0.2  # random colours
    # no sparse points at all (an empty tensor) is the random case too
    assert gm.init_gaussians(torch.zeros(0, 3), None, BOX, n_random=10)["means"].shape == (10, 3)


def test_init_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no sparse points and no scene box"):
        gm.init_gaussians(None, None, None)
    with pytest.raises(ValueError, match="degenerate"):
        gm.init_gaussians(None, None, torch.tensor([[0.0, 0, 0], [1, 0, 1]]))
    with pytest.raises(ValueError, match="degenerate"):
        gm.init_gaussians(torch.zeros(0, 3), None, torch.tensor([[0.0, 0, 0], [float("inf"), 1, 1]]))
    bad = torch.rand(10, 3)
    bad[4, 1] = float("nan")
    with pytest.raises(ValueError, match="1 of 10 sparse points are not finite"):
        gm.init_gaussians(bad, None, BOX)
    with pytest.raises(ValueError, match="uint8"):
        gm.init_gaussians(torch.rand(10, 3), torch.rand(10, 3), BOX)
    with pytest.raises(ValueError, match="at least 2"):
        gm.init_gaussians(torch.rand(1, 3), None, BOX)
    with pytest.raises(ValueError, match="sh_degree"):
        gm.init_gaussians(torch.rand(10, 3), None, BOX, sh_degree=4)


def test_scene_extent():
    c2w = torch.eye(4).repeat(4, 1, 1)
    c2w[:, :3, 3] = torch.tensor([[1.0, 0, 0], [-1, 0, 0], [0, 0.5, 0], [0, -0.5, 0]])  # mean at 0
    assert gm.scene_extent(c2w) == pytest.approx(1.1)
    assert gm.scene_extent(c2w[:, :3] + torch.tensor([0, 0, 0, 5.0])) == pytest.approx(1.1)  # [N, 3, 4], shifted
    with pytest.raises(ValueError, match="all 3 cameras sit at one point"):
        gm.scene_extent(torch.eye(4).repeat(3, 1, 1))
    with pytest.raises(ValueError, match="at least one camera"):
        gm.scene_extent(torch.zeros(0, 4, 4))


def test_sh_degree_schedule():
    assert [gm.sh_degree_at(s, 3) for s in (0, 999, 1000, 2500, 3000, 10**6)] == [0, 0, 1, 2, 3, 3]
    assert gm.sh_degree_at(5000, 1) == 1 and gm.sh_degree_at(40, 3, every=20) == 2
    assert [gm.sh_degree_of(k) for k in (1, 4, 9, 16)] == [0, 1, 2, 3]


def test_optimizers_and_the_means_decay():
    params = gm.init_gaussians(torch.rand(50, 3), None, None)
    opt = gm.make_optimizers(params, scene_extent=2.0, lr_scale=math.sqrt(4))
    lrs = {name: o.param_groups[0]["lr"] for name, o in opt.items()}
    want = {"means": 1.6e-4 * 2.0, "sh0": 2.5e-3, "shN": 2.5e-3 / 20, "opacities": 5e-2, "scales": 5e-3,
            "quats": 1e-3}
    assert lrs == pytest.approx({k: v * 2 for k, v in want.items()})
    assert all(o.param_groups[0]["params"][0] is params[n] for n, o in opt.items())
    assert opt["means"].defaults["eps"] == 1e-15
    lr0 = lrs["means"]
    assert gm.set_means_lr(opt, 0, 1000) == pytest.approx(lr0)
    assert gm.set_means_lr(opt, 500, 1000) == pytest.approx(lr0 / 10)  # geometric midpoint
    assert gm.set_means_lr(opt, 1000, 1000) == pytest.approx(lr0 / 100)
    assert gm.set_means_lr(opt, 5000, 1000) == pytest.approx(lr0 / 100)  # held after the run
    assert opt["means"].param_groups[0]["lr"] == pytest.approx(lr0 / 100)
    with pytest.raises(ValueError, match="exactly"):
        gm.make_optimizers({"means": params["means"]}, scene_extent=1.0)
    with pytest.raises(ValueError, match="scene_extent"):
        gm.make_optimizers(params, scene_extent=0.0)


# ---------------------------------------------------------------------------- optimizer-state surgery


def _trained(n: int = 6, steps: int = 2, fused: bool = False):
    """Gaussians and their Adams after a few steps with random gradients (non-zero moments)."""
    g = torch.Generator().manual_seed(5)
    params = gm.init_gaussians(torch.rand(n, 3, generator=g), None, None, sh_degree=1)
    opt = gm.make_optimizers(params, scene_extent=1.0, fused=fused)
    for _ in range(steps):
        for name, p in params.items():
            p.grad = torch.randn(p.shape, generator=g)
            opt[name].step()
    return params, opt


@pytest.mark.parametrize("fused", [False, True])
def test_update_rows_keeps_adam_state_aligned(fused):
    params, opt = _trained(fused=fused)
    old = {name: p.detach().clone() for name, p in params.items()}
    old_state = {name: {k: v.clone() for k, v in opt[name].state[params[name]].items()} for name in params}
    old_params = dict(params)
    keep = torch.tensor([5, 0, 2])
    new_rows = {name: torch.full((2, *p.shape[1:]), 7.0) for name, p in params.items()}
    dz.update_rows(params, opt, keep, new_rows)
    for name, p in params.items():
        assert isinstance(p, nn.Parameter) and p is not old_params[name] and p.requires_grad
        assert opt[name].param_groups[0]["params"] == [p] and old_params[name] not in opt[name].state
        assert torch.equal(p[:3], old[name][keep]) and torch.equal(p[3:], new_rows[name])
        state = opt[name].state[p]
        assert torch.equal(state["step"], old_state[name]["step"])  # the step count is kept
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == p.shape
            assert torch.equal(state[key][:3], old_state[name][key][keep])  # survivors unchanged
            assert not state[key][3:].any()  # new rows start at zero
    for name, p in params.items():  # the optimizers still step the new tensors
        p.grad = torch.ones_like(p)
        opt[name].step()
    assert params["means"].shape == (5, 3)


def test_append_remove_and_zero_state():
    params, opt = _trained(n=5)
    before = {name: (p.detach().clone(), opt[name].state[p]["exp_avg"].clone()) for name, p in params.items()}
    dz.append_rows(params, opt, {name: p[:1] * 2 for name, p in params.items()})
    assert params["opacities"].shape == (6,)
    assert not opt["opacities"].state[params["opacities"]]["exp_avg"][5:].any()
    dz.remove_rows(params, opt, torch.tensor([True, False, False, True, False, False]))
    for name, p in params.items():
        value, avg = before[name]
        assert torch.equal(p[:3], value[[1, 2, 4]]) and torch.equal(p[3], value[0] * 2)
        assert torch.equal(opt[name].state[p]["exp_avg"][:3], avg[[1, 2, 4]])
    dz.zero_state(opt["scales"], params["scales"])
    state = opt["scales"].state[params["scales"]]
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any() and float(state["step"]) == 2
    with pytest.raises(ValueError, match="must hold exactly"):  # the optimizer still holds an old tensor
        dz.remove_rows({**params, "means": nn.Parameter(params["means"].detach().clone())}, opt,
                       torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="one entry per parameter"):
        dz.append_rows(params, opt, {"means": torch.zeros(1, 3)})


# ---------------------------------------------------------------------------- densification

W, H = 100, 80  # image size of the hand-built views


def _gaussians(scales: list[float], opacities: list[float], adam: bool = True):
    """Gaussians along x with isotropic scales (scene units) and opacities; a 20-degree rotation each.

    With ``adam``, one Adam step each so that every row has moments; without, frozen parameters and
    no optimizers (the gloo workers: constructing the first Adam of a process costs seconds)."""
    n = len(scales)
    params = gm.init_gaussians(torch.stack([torch.arange(n, dtype=torch.float32),
                                            torch.zeros(n), torch.zeros(n)], 1), None, None, sh_degree=1)
    with torch.no_grad():
        params["scales"].copy_(torch.tensor(scales).log()[:, None].expand(n, 3))
        params["scales"][:, 2] -= 1.0  # anisotropic: the split samples follow the rotation
        params["opacities"].copy_(torch.logit(torch.tensor(opacities)))
        params["quats"].copy_(torch.tensor([math.cos(0.17), 0.0, 0.0, math.sin(0.17)]).expand(n, 4))
        params["sh0"].copy_(torch.arange(n * 3, dtype=torch.float32).reshape(n, 1, 3))
    if not adam:
        return {name: p.requires_grad_(False) for name, p in params.items()}, {}
    opt = gm.make_optimizers(params, scene_extent=1.0)
    for name, p in params.items():
        p.grad = torch.ones_like(p)
        opt[name].step()
    return params, opt


def _meta(pixel_grads: torch.Tensor, radii: torch.Tensor) -> dict:
    """Rasterizer meta of C views: pixel-space means2d gradients [C, N, 2] and radii [C, N]."""
    means2d = torch.zeros(pixel_grads.shape, requires_grad=True)
    means2d.grad = pixel_grads.clone()
    means2d.absgrad = pixel_grads.abs() * 3
    return {"means2d": means2d, "radii": radii, "width": W, "height": H, "n_cameras": pixel_grads.shape[0]}


# NDC gradient of one view = |pixel gradient * (W/2, H/2) * C|: 1e-5 px -> 5e-4 in x with C = 1
HIGH, LOW = 1e-5, 1e-6


def _one_view(grads_x: list[float]) -> dict:
    n = len(grads_x)
    g = torch.zeros(1, n, 2)
    g[0, :, 0] = torch.tensor(grads_x)
    return _meta(g, torch.full((1, n), 3, dtype=torch.int32))


def test_accumulate_scales_to_ndc_and_counts_visible_views():
    strat = dz.DensifyStrategy()
    g = torch.zeros(3, 2, 2)
    g[:, 0] = torch.tensor([3e-6, 4e-6])  # per view: |(3e-6 * 50 * 3, 4e-6 * 40 * 3)| = 6.9e-4
    g[:, 1] = torch.tensor([1.0, 1.0])  # Gaussian 1 is culled in every view: ignored
    radii = torch.tensor([[5, 0], [0, 0], [12, 0]], dtype=torch.int32)  # Gaussian 0 seen in views 0, 2
    strat.accumulate(_meta(g, radii))
    per_view = math.hypot(3e-6 * W / 2 * 3, 4e-6 * H / 2 * 3)
    torch.testing.assert_close(strat.stats["grad2d"], torch.tensor([2 * per_view, 0.0]))
    assert strat.stats["count"].tolist() == [2.0, 0.0]
    torch.testing.assert_close(strat.stats["radii"], torch.tensor([12 / W, 0.0]))
    strat.accumulate(_meta(g, radii.flip(0)))  # a second step adds up
    assert strat.stats["count"].tolist() == [4.0, 0.0]
    absgrad = dz.DensifyStrategy(dz.DensifyParams(absgrad=True))
    absgrad.accumulate(_meta(g, radii))
    torch.testing.assert_close(absgrad.stats["grad2d"], 3 * strat.stats["grad2d"] / 2)
    with pytest.raises(ValueError, match="no grad"):
        dz.DensifyStrategy().accumulate({**_meta(g, radii), "means2d": torch.zeros(3, 2, 2)})
    with pytest.raises(ValueError, match="changed outside"):
        strat.accumulate(_meta(torch.zeros(1, 5, 2), torch.ones(1, 5)))


def test_duplicate_split_and_prune_decisions():
    # 0: small + high gradient -> duplicate; 1: large + high -> split; 2: small + low -> kept;
    # 3: transparent -> pruned; 4: too large for the scene, but only pruned after the first reset
    params, opt = _gaussians([0.005, 0.05, 0.005, 0.005, 0.5], [0.5, 0.5, 0.5, 0.001, 0.5])
    before = {name: p.detach().clone() for name, p in params.items()}
    moments = opt["sh0"].state[params["sh0"]]["exp_avg"].clone()
    strat = dz.DensifyStrategy()
    strat.accumulate(_one_view([HIGH, HIGH, LOW, LOW, LOW]))
    gen = torch.Generator().manual_seed(9)
    out = strat.step(600, params, opt, gen, scene_extent=1.0)
    assert out == {"duplicated": 1, "split": 1, "pruned": 1, "reset": False, "budget_hit": False,
                   "n_gaussians": 6}
    # layout: survivors [0, 2, 4], the copy of 0, then the two halves of 1
    for name in ("quats", "opacities", "sh0", "shN"):
        torch.testing.assert_close(params[name], before[name][[0, 2, 4, 0, 1, 1]], rtol=0, atol=0)
    torch.testing.assert_close(params["scales"][:4], before["scales"][[0, 2, 4, 0]], rtol=0, atol=0)
    torch.testing.assert_close(params["scales"][4:], (before["scales"][[1, 1]].exp() / 1.6).log())
    assert torch.equal(params["means"][:4], before["means"][[0, 2, 4, 0]])
    # the halves are drawn from the Gaussian's own distribution: mean + R S z, z from the generator
    z = torch.randn(2, 1, 3, generator=torch.Generator().manual_seed(9))
    rot = gm.quat_to_rotmat(before["quats"][1:2])[0]
    want = before["means"][1] + (rot @ (before["scales"][1].exp() * z[:, 0]).T).T
    torch.testing.assert_close(params["means"][4:], want)
    state = opt["sh0"].state[params["sh0"]]["exp_avg"]
    assert torch.equal(state[:3], moments[[0, 2, 4]]) and not state[3:].any()
    assert strat.stats["count"].shape == (6,) and not strat.stats["count"].any()  # reset after refining

    # after the first opacity reset (step > reset_every) the too-large Gaussian goes too
    strat.accumulate(_one_view([LOW] * 6))
    out = strat.step(3100, params, opt, gen, scene_extent=1.0)
    assert (out["pruned"], out["n_gaussians"]) == (1, 5)
    assert float(params["scales"].detach().exp().amax()) < 0.1


def test_the_schedule_decides_when_to_refine():
    cfg = dz.DensifyParams(refine_start=500, refine_stop=1000, refine_every=100)
    for step, refines in ((500, False), (550, False), (600, True), (999, False), (1000, False)):
        params, opt = _gaussians([0.005, 0.005], [0.5, 0.5])
        strat = dz.DensifyStrategy(cfg)
        strat.accumulate(_one_view([HIGH, LOW]))
        out = strat.step(step, params, opt, torch.Generator(), scene_extent=1.0)
        assert out["duplicated"] == int(refines), step
    assert not strat.active(1000) and strat.active(999)
    with pytest.raises(RuntimeError, match="before any accumulate"):
        dz.DensifyStrategy().step(600, params, opt, torch.Generator(), 1.0)


def test_splits_are_deterministic_with_the_same_generator():
    def run(seed):
        params, opt = _gaussians([0.05] * 20, [0.5] * 20)
        strat = dz.DensifyStrategy()
        strat.accumulate(_one_view([HIGH] * 20))
        strat.step(600, params, opt, torch.Generator().manual_seed(seed), scene_extent=1.0)
        return params

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["means"], c["means"]) and a["means"].shape == (40, 3)


def test_revised_opacity_gives_split_halves_the_parents_combined_alpha():
    # two large Gaussians with high gradients split; a small one with a low gradient stays
    def split(revised: bool):
        params, opt = _gaussians([0.05, 0.05, 0.005], [0.5, 0.9, 0.3])
        before = params["opacities"].detach().sigmoid().clone()
        strat = dz.DensifyStrategy(dz.DensifyParams(revised_opacity=revised))
        strat.accumulate(_one_view([HIGH, HIGH, LOW]))
        out = strat.step(600, params, opt, torch.Generator().manual_seed(3), scene_extent=1.0)
        assert (out["split"], out["n_gaussians"]) == (2, 5)
        return params, before

    (plain, before), (revised, _) = split(False), split(True)
    # layout: the kept Gaussian 2, then the halves of 0 and of 1 (each twice, in that order)
    parents = before[[0, 1, 0, 1]]
    halves = revised["opacities"].detach().sigmoid()[1:]
    assert bool((halves < parents).all())
    torch.testing.assert_close(1.0 - (1.0 - halves) ** 2, parents)  # overlapping, they block what the parent did
    torch.testing.assert_close(plain["opacities"].detach().sigmoid()[1:], parents)  # the reference copies it
    assert float(revised["opacities"][0]) == float(plain["opacities"][0])  # the kept one is untouched
    for name in ("means", "scales", "quats", "sh0", "shN"):  # only the opacities differ
        assert torch.equal(plain[name], revised[name]), name


def test_budget_caps_growth_and_is_reported_once():
    params, opt = _gaussians([0.005, 0.005, 0.05, 0.005], [0.5] * 4)
    strat = dz.DensifyStrategy(dz.DensifyParams(max_gaussians=5))
    strat.accumulate(_one_view([2 * HIGH, HIGH, 3 * HIGH, LOW]))
    out = strat.step(600, params, opt, torch.Generator(), scene_extent=1.0)
    # room for one: the highest gradient (the large Gaussian 2) is split, nothing is duplicated
    assert (out["duplicated"], out["split"], out["budget_hit"], out["n_gaussians"]) == (0, 1, True, 5)
    strat.accumulate(_one_view([HIGH] * 5))
    out = strat.step(700, params, opt, torch.Generator(), scene_extent=1.0)
    assert (out["duplicated"], out["split"], out["budget_hit"], out["n_gaussians"]) == (0, 0, False, 5)
    restored = dz.DensifyStrategy(dz.DensifyParams(max_gaussians=5))
    restored.load_state_dict(strat.state_dict())
    assert restored.budget_reached and torch.equal(restored.stats["count"], strat.stats["count"])


def test_opacity_reset_clamps_and_zeroes_the_moments():
    params, opt = _gaussians([0.005] * 3, [0.5, 0.004, 0.009])
    other = opt["means"].state[params["means"]]["exp_avg"].clone()
    opacities = params["opacities"]
    alpha = opacities.detach().sigmoid()
    assert alpha[0] > 0.01 > alpha[2] > alpha[1]
    strat = dz.DensifyStrategy(dz.DensifyParams(refine_start=10_000, refine_stop=20_000))
    out = strat.step(3000, params, opt, torch.Generator(), scene_extent=1.0)
    assert out["reset"] and params["opacities"] is opacities  # in place: nothing to re-bind
    torch.testing.assert_close(params["opacities"].sigmoid(), alpha.clamp(max=0.01))
    assert torch.equal(params["opacities"][1:].sigmoid(), alpha[1:])  # those below are untouched
    state = opt["opacities"].state[opacities]
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any() and float(state["step"]) == 1
    assert torch.equal(opt["means"].state[params["means"]]["exp_avg"], other)
    assert not strat.step(3001, params, opt, torch.Generator(), scene_extent=1.0)["reset"]


def test_skip_late_reset_keeps_the_reset_that_has_time_to_be_relearned():
    cfg = dz.DensifyParams(refine_start=19_000, refine_stop=20_000, skip_late_reset=True)

    def resets(strat, total):
        params, opt = _gaussians([0.005] * 2, [0.5, 0.5])
        done = [s for s in (3000, 6000, 9000, 12000) if s < total
                and strat.step(s, params, opt, torch.Generator(), scene_extent=1.0)["reset"]]
        return done, params["opacities"].detach().sigmoid()

    # a 7000-step run: the reset at 6000 has 1000 steps left, fewer than reset_every
    done, alpha = resets(dz.DensifyStrategy(cfg, total_steps=7000), 7000)
    assert done == [3000] and torch.allclose(alpha, torch.full((2,), 0.01))
    assert resets(dz.DensifyStrategy(cfg, total_steps=30_000), 30_000)[0] == [3000, 6000, 9000, 12000]
    assert resets(dz.DensifyStrategy(cfg, total_steps=9000), 9000)[0] == [3000, 6000]  # 6000 + 3000 fits
    plain = dz.DensifyParams(refine_start=19_000, refine_stop=20_000, skip_late_reset=False)
    assert resets(dz.DensifyStrategy(plain, total_steps=7000), 7000)[0] == [3000, 6000]  # off: the reference
    assert resets(dz.DensifyStrategy(cfg), 7000)[0] == [3000, 6000]  # no known length: every reset kept
    assert dz.DensifyParams().skip_late_reset  # the default since 2026-12-06


def test_decisions_read_the_reduced_statistics():
    """The reduce hook's output decides: here a stand-in for a second rank whose views saw
    Gaussian 1 with a high gradient."""
    seen = []

    def reduce(stats):
        seen.append({k: v.clone() for k, v in stats.items()})
        other = {"grad2d": torch.tensor([0.0, 10 * HIGH * W / 2]), "count": torch.tensor([0.0, 1.0]),
                 "radii": torch.tensor([0.0, 0.5])}
        return {"grad2d": stats["grad2d"] + other["grad2d"], "count": stats["count"] + other["count"],
                "radii": torch.maximum(stats["radii"], other["radii"])}

    params, opt = _gaussians([0.005, 0.005], [0.5, 0.5])
    strat = dz.DensifyStrategy(reduce=reduce)
    strat.accumulate(_one_view([LOW, LOW]))
    out = strat.step(600, params, opt, torch.Generator(), scene_extent=1.0)
    assert len(seen) == 1 and seen[0]["count"].tolist() == [1.0, 1.0]
    assert out["duplicated"] == 1 and torch.equal(params["means"][2], params["means"][1])


def _rank_views(rank: int) -> dict:
    """Rank r's views: rank 0 sees Gaussian 0 with a high gradient, rank 1 Gaussian 2 (large)."""
    grads = [[HIGH, LOW, LOW, LOW], [LOW, LOW, HIGH, LOW]][rank]
    meta = _one_view(grads)
    meta["radii"][0, 3] = 0 if rank == 0 else 40  # Gaussian 3 only on rank 1, with a large radius
    return meta


def _densify_worker(rank: int, world: int, init_file: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        params, opt = _gaussians([0.005, 0.005, 0.05, 0.005], [0.5] * 4, adam=False)  # alike on every rank
        strat = dz.DensifyStrategy(dz.DensifyParams(refine_scale2d_stop=1000),
                                   reduce=dz.all_reduce_statistics())
        strat.accumulate(_rank_views(rank))
        out = strat.step(600, params, opt, torch.Generator().manual_seed(11), scene_extent=1.0)
        torch.save({"out": out, "params": {k: v.detach() for k, v in params.items()}}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_decide_identically_through_all_reduce_in_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_densify_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "res")), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"res.{r}", weights_only=True) for r in range(2)]
    # the same decisions from one process that merges both ranks' statistics by hand
    local = [dz.DensifyStrategy(dz.DensifyParams(refine_scale2d_stop=1000)) for _ in range(2)]
    for rank, strat in enumerate(local):
        strat.accumulate(_rank_views(rank))
    a, b = local[0].stats, local[1].stats
    local[0].reduce = lambda s: {"grad2d": s["grad2d"] + b["grad2d"], "count": s["count"] + b["count"],
                                 "radii": torch.maximum(s["radii"], b["radii"])}
    params, opt = _gaussians([0.005, 0.005, 0.05, 0.005], [0.5] * 4, adam=False)
    want = local[0].step(600, params, opt, torch.Generator().manual_seed(11), scene_extent=1.0)
    # Gaussian 0 duplicated (rank 0's gradient), 2 split (rank 1's), 3 split by rank 1's 2D radius
    assert (want["duplicated"], want["split"]) == (1, 2)
    for r in range(2):
        assert res[r]["out"] == want
        for name, p in params.items():
            assert torch.equal(res[r]["params"][name], p.detach()), (r, name)


def test_densify_params_are_checked():
    with pytest.raises(ParamsError, match="prune_opa"):
        dz.DensifyParams(prune_opa=0.6)
    with pytest.raises(ParamsError, match="refine_every"):
        dz.DensifyParams(refine_every=0)
    with pytest.raises(ParamsError, match="max_gaussians"):
        dz.DensifyParams(max_gaussians=-1)


# ---------------------------------------------------------------------------- PLY


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_ply_round_trip_is_bit_exact(tmp_path, degree):
    from stages.reconstruct.gs.ply import load_ply, save_ply

    g = torch.Generator().manual_seed(degree)
    k = (degree + 1) ** 2
    params = {"means": torch.randn(257, 3, generator=g), "quats": torch.randn(257, 4, generator=g),
              "scales": torch.randn(257, 3, generator=g) - 4, "opacities": torch.randn(257, generator=g),
              "sh0": torch.randn(257, 1, 3, generator=g), "shN": torch.randn(257, k - 1, 3, generator=g)}
    params["means"][0] = torch.tensor([1e-38, -0.0, 3.4e38])  # subnormal, negative zero, near max
    save_ply(tmp_path / "g.ply", {n: nn.Parameter(v) for n, v in params.items()})
    back = load_ply(tmp_path / "g.ply")
    assert set(back) == set(params)
    for name, value in params.items():
        assert back[name].dtype == torch.float32 and torch.equal(back[name], value), name
    assert torch.equal(back["means"][0].view(torch.int32), params["means"][0].view(torch.int32))  # -0.0
    header = (tmp_path / "g.ply").read_bytes().split(b"end_header\n")[0].decode().split("\n")
    names = [line.split()[-1] for line in header if line.startswith("property")]
    assert names[:9] == ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
    assert names[9:-8] == [f"f_rest_{i}" for i in range(3 * (k - 1))]
    assert names[-8:] == ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    assert header[1] == "format binary_little_endian 1.0" and header[2] == "element vertex 257"
    empty = {name: value[:0] for name, value in params.items()}  # no Gaussians at all
    save_ply(tmp_path / "empty.ply", empty)
    assert {n: v.shape for n, v in load_ply(tmp_path / "empty.ply").items()} == {n: v.shape for n, v in empty.items()}
    if degree:  # channel-major f_rest: the first K - 1 values of a row are red's coefficients
        row = np.frombuffer((tmp_path / "g.ply").read_bytes()[-257 * 4 * len(names):], "<f4")
        row = row.reshape(257, len(names))[5]
        assert np.array_equal(row[9:9 + k - 1], params["shN"][5, :, 0].numpy())
        assert np.array_equal(row[9 + k - 1:9 + 2 * (k - 1)], params["shN"][5, :, 1].numpy())


def test_open3d_reads_the_ply_as_gaussians(tmp_path):
    """An independent reader of the layout: Open3D's tensor point cloud knows the 3DGS PLY attributes
    and un-permutes the channel-major f_rest into [N, K - 1, 3] itself. On reading it takes exp of the
    scales and rescales the quaternions in its own way, so ``rot`` is not compared."""
    o3d = pytest.importorskip("open3d")
    from stages.reconstruct.gs.ply import save_ply

    g = torch.Generator().manual_seed(7)
    params = {"means": torch.randn(30, 3, generator=g), "quats": torch.randn(30, 4, generator=g),
              "scales": torch.randn(30, 3, generator=g), "opacities": torch.randn(30, generator=g),
              "sh0": torch.randn(30, 1, 3, generator=g), "shN": torch.randn(30, 15, 3, generator=g)}
    save_ply(tmp_path / "g.ply", params)
    cloud = o3d.t.io.read_point_cloud(str(tmp_path / "g.ply")).point
    assert np.array_equal(cloud["positions"].numpy(), params["means"].numpy())
    assert np.array_equal(cloud["f_dc"].numpy(), params["sh0"][:, 0].numpy())
    assert np.array_equal(cloud["f_rest"].numpy(), params["shN"].numpy())
    np.testing.assert_allclose(cloud["scale"].numpy(), params["scales"].exp().numpy(), rtol=1e-6)
    assert np.array_equal(cloud["opacity"].numpy()[:, 0], params["opacities"].numpy())


def test_ply_bad_files_and_values(tmp_path):
    from stages.reconstruct.gs.ply import load_ply, save_ply

    params = gm.init_gaussians(torch.rand(20, 3), None, None, sh_degree=1)
    good = tmp_path / "good.ply"
    save_ply(good, params)
    data = good.read_bytes()
    cases = {
        "trunc.ply": (data[:-5], "truncated"),
        "tail.ply": (data + b"\0", "trailing bytes"),
        "ascii.ply": (data.replace(b"binary_little_endian", b"ascii", 1), "not supported"),
        "magic.ply": (b"plx" + data[3:], "not a PLY"),
        "noend.ply": (data.replace(b"end_header", b"end_headr", 1), "not a PLY"),
        "missing.ply": (data.replace(b"property float opacity", b"property float opacitx", 1), "opacity"),
        "int.ply": (data.replace(b"property float x\n", b"property int x\n", 1), r"\['x'\] must be float"),
        "gap.ply": (data.replace(b"float f_rest_8\n", b"float f_rest_10\n", 1), "numbered 0..M-1"),
        "count.ply": (data.replace(b"float f_rest_8\n", b"float extra\n", 1), "8 f_rest properties"),
        "list.ply": (data.replace(b"property float nz", b"property list uchar int nz", 1), "list"),
    }
    for name, (blob, message) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match=message):
            load_ply(tmp_path / name)
    with pytest.raises(ValueError, match="cannot read"):
        load_ply(tmp_path / "absent.ply")
    bad = {n: p.detach().clone() for n, p in params.items()}
    bad["scales"][3, 1] = float("inf")
    with pytest.raises(ValueError, match="not finite in 1 of 20"):
        save_ply(tmp_path / "inf.ply", bad)
    assert not (tmp_path / "inf.ply").exists()
    with pytest.raises(ValueError, match="shN"):
        save_ply(tmp_path / "k.ply", {**bad, "shN": torch.zeros(20, 4, 3)})
