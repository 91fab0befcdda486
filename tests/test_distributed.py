"""Distributed training on the CPU: gloo processes started by torchrun, as the stage starts them.

A tiny posed scene (64x48, 8 views, straight from the scene generator's ground truth,
no SfM) and a tiny hash grid keep each run to seconds. Covered: 2 processes against 1
process with the same global batch; two "hosts" on loopback through the c10d
rendezvous; a SIGKILLed worker brought back by torchrun and resumed from the latest
checkpoint; the collectives (dense / sparse gradient sync, replica check) in 2 gloo
processes; the launcher's errors, its torchrun command, the SLURM script and the
Prometheus endpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from _dvc_project import merge

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.integration]

# A hash grid of 2 levels x 1024 rows, MLPs of width 8: ~4.4k parameters, a few ms a step.
TINY = {
    "device": "cpu", "steps": 30, "batch_rays": 128, "eval_every": 10,
    "nerf": {"levels": 2, "log2_hashmap_size": 10, "base_resolution": 4, "max_resolution": 16, "hidden_dim": 8,
             "geo_feat_dim": 3, "samples_per_ray": 16, "occ_resolution": 8, "occ_update_every": 8},
    "distributed": {"checkpoint_every": 10, "replica_check_every": 5, "max_restarts": 0},
}


def make_poses(root: Path, width: int = 64, height: int = 48, views: int = 8) -> Path:
    """A poses-stage folder from the scene generator's ground truth (no SfM)."""
    from conftest import generated_scene
    from stages.scene import poses_from_ground_truth

    generated_scene(root, width, height, views)
    return poses_from_ground_truth(root / "scene" / "images", root / "poses")


@pytest.fixture(scope="module")
def poses(tmp_path_factory) -> Path:
    return make_poses(tmp_path_factory.mktemp("dist"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_params(path: Path, over: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump({"seed": 0, "reconstruct": merge(TINY, over or {})}, sort_keys=False))
    return path


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT)
    e.update(extra)
    return e


def stage_cmd(poses: Path, out: Path, params: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "stages.reconstruct", "--poses", str(poses), "--out", str(out),
            "--params", str(params), "--plots", str(out.parent / f"{out.name}.csv"), *more]


def run_stage(cmd: list[str], timeout: float = 180, **extra: str) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def load_state(out: Path) -> dict[str, torch.Tensor]:
    blob = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    return {f"{part}.{k}": v for part, sd in blob["state"].items() for k, v in sd.items()}


def assert_same_model(a: Path, b: Path) -> None:
    # Bitwise equal on one machine: the same ops in the same order (a sum of two
    # gradients is commutative, so all-reduce and accumulation agree exactly). The
    # tolerance only absorbs a different BLAS thread split on another machine.
    sa, sb = load_state(a), load_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        if sa[k].dtype.is_floating_point:
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def two_proc_run(poses, tmp_path_factory) -> Path:
    """2 gloo processes x 128 rays, lr x sqrt(2), checkpoints and replica checks on."""
    d = tmp_path_factory.mktemp("two")
    params = write_params(d / "params.yaml", {"distributed": {"cpu_workers": 2}})
    p = run_stage(stage_cmd(poses, d / "out", params, "--metrics", str(d / "metrics.json")))
    assert "2 process(es) x 128 rays" in p.stderr
    return d / "out"


def test_two_processes_equal_one_process_with_the_same_global_batch(two_proc_run, poses, tmp_path):
    # 1 process, 256 rays as 2 micro-batches: the same two shards of rays (shard k is
    # seeded from seed and k), one optimizer step on their mean; the learning rate the
    # 2-process run gets from the sqrt rule (lr x sqrt(2)) given explicitly.
    s = math.sqrt(2.0)
    params = write_params(tmp_path / "params.yaml", {
        "batch_rays": 256, "nerf": {"lr": 0.01 * s, "lr_final": 0.0005 * s},
        "distributed": {"micro_batches": 2}})
    run_stage(stage_cmd(poses, tmp_path / "out", params), OMP_NUM_THREADS="1")  # torchrun gives workers 1 thread
    assert_same_model(two_proc_run, tmp_path / "out")
    one = (tmp_path / "out.csv").read_text().splitlines()
    two = (two_proc_run.parent / "out.csv").read_text().splitlines()
    col = one[0].split(",").index("loss")
    assert [r.split(",")[col] for r in one[1:]] == [r.split(",")[col] for r in two[1:]]

    summary = json.loads((two_proc_run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch_rays"] == 256
    assert summary["lr_scale"] == pytest.approx(s)
    assert summary["step_comm_s"] > 0 and len(summary["per_rank"]) == 2
    assert json.loads((two_proc_run.parent / "metrics.json").read_text())["world_size"] == 2
    assert not (two_proc_run.parent / "out.ckpt").exists(), "checkpoints are removed on success"


def test_tensorboard_scalars_of_every_rank_land_in_the_out(two_proc_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((two_proc_run / "tensorboard").iterdir())  # <out>/tensorboard/<run name>/
    assert len(runs) == 1
    tb = runs[0]
    assert (two_proc_run.parent / "out.tb" / tb.name).is_dir(), "the run's folder stays for tensorboard --logdir"
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "train/psnr", "train/lr", "test/psnr", "throughput/samples_per_s"}
    want |= {f"rank{r}/{k}" for r in (0, 1) for k in ("samples_per_s", "step_compute_ms", "step_comm_ms")}
    assert want <= tags, want - tags
    loss = acc.Scalars("train/loss")
    assert loss[-1].step == TINY["steps"] and all(math.isfinite(e.value) and e.value > 0 for e in loss)
    rows = (two_proc_run.parent / "out.csv").read_text().splitlines()
    col = rows[0].split(",").index("loss")
    assert loss[-1].value == pytest.approx(float(rows[-1].split(",")[col]), rel=1e-6)  # same numbers as train.csv


def test_two_hosts_on_loopback(two_proc_run, poses, tmp_path):
    """Two launches, one process each, meeting at a c10d rendezvous on 127.0.0.1."""
    port = free_port()
    params = write_params(tmp_path / "params.yaml", {"distributed": {
        "nodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_timeout_s": 60, "cpu_workers": 1}})
    cmd = stage_cmd(poses, tmp_path / "out", params)
    procs = [subprocess.Popen(cmd + ["--node-rank", str(r)], cwd=ROOT, env=env(OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in [p.pid] + _descendants(p.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                p.wait()
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-6000:]
    assert "--rdzv-backend c10d" in outs[0][1] and f"127.0.0.1:{port}" in outs[0][1]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["world_size"] == 2
    assert_same_model(two_proc_run, tmp_path / "out")  # the same world of 2, split over two "hosts"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _worker_pid(launcher: int, rank: int) -> int | None:
    for pid in _descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b"\0".join(environ):
            return pid
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
def test_sigkilled_worker_is_restarted_and_the_run_resumes(poses, tmp_path):
    steps, every = 200, 20
    over = {"steps": steps, "eval_every": 100,
            "distributed": {"cpu_workers": 2, "max_restarts": 1, "checkpoint_every": every}}
    params = write_params(tmp_path / "params.yaml", over)
    out, ckpt = tmp_path / "out", tmp_path / "out.ckpt"
    log_file = (tmp_path / "stage.log").open("w")  # a file, not a pipe nobody reads while we wait
    proc = subprocess.Popen(stage_cmd(poses, out, params), cwd=ROOT, env=env(), stdout=log_file, stderr=log_file)
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("step_*.pt")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        victim = _worker_pid(proc.pid, 1)
        assert victim is not None and proc.poll() is None, "run ended before a checkpoint could be seen"
        os.kill(victim, signal.SIGKILL)
        killed_after = max(int(p.stem.split("_")[1]) for p in ckpt.glob("step_*.pt"))
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:  # torchrun and its workers too, not only the launcher
            for pid in [proc.pid] + _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        log_file.close()
    err = (tmp_path / "stage.log").read_text()
    assert proc.returncode == 0, err[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1
    resumed = summary["resumed_from_step"]
    assert resumed is not None and resumed >= killed_after, (resumed, killed_after)  # lost < checkpoint_every steps
    assert "resumed from" in err
    assert not ckpt.exists()

    # Resuming restores every rank's generators: the result is the uninterrupted run's.
    ref = write_params(tmp_path / "ref.yaml", merge(over, {"batch_rays": 256, "nerf": {
        "lr": 0.01 * math.sqrt(2), "lr_final": 0.0005 * math.sqrt(2)}, "distributed": {
        "cpu_workers": 1, "micro_batches": 2, "checkpoint_every": 0}}))
    run_stage(stage_cmd(poses, tmp_path / "ref", ref), OMP_NUM_THREADS="1")
    assert_same_model(out, tmp_path / "ref")


# ---------------------------------------------------------------- collectives in 2 gloo processes


def _collectives_worker(rank: int, world: int, init_file: str, results: str) -> None:
    import torch.distributed as dist

    from stages.reconstruct.distributed import DistContext, GradReducer, ReplicaDivergence, check_replicas

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, backend="gloo")
    out = {}
    try:
        g = torch.Generator().manual_seed(100 + rank)
        table = torch.zeros(2**16 + 8, 2)  # a hash-table-like gradient: 1% of rows non-zero
        rows = torch.randperm(table.shape[0], generator=g)[:700]
        table[rows] = torch.randn(700, 2, generator=g)
        table[:5] = torch.randn(5, 2, generator=g)  # rows every rank touches
        mlp = torch.randn(37, 5, generator=g)
        for mode in ("dense", "sparse", "auto"):
            ps = [torch.nn.Parameter(torch.zeros_like(table)), torch.nn.Parameter(torch.zeros_like(mlp)),
                  torch.nn.Parameter(torch.zeros(3))]
            ps[0].grad, ps[1].grad = table.clone(), mlp.clone()  # ps[2] has no gradient on any rank
            red = GradReducer(ps, ctx, mode)
            extras = red.reduce(0.5, torch.tensor([1.0 + rank, 10.0]))
            out[mode] = {"table": ps[0].grad.clone(), "mlp": ps[1].grad.clone(), "none": ps[2].grad.clone(),
                         "extras": extras, "sparse_steps": red.sparse_steps}
        # Overlap: buckets launched from backward hooks during the last micro-batch's backward
        # give the same sums as one reduce after backward; bf16 on the wire stays close.
        for name, kw in (("plain", {}), ("overlap", {"overlap": True}),
                         ("bf16", {"overlap": True, "wire_dtype": torch.bfloat16}),
                         ("views", {"attach": True}), ("views+overlap", {"overlap": True, "attach": True})):
            attach = kw.pop("attach", False)
            torch.manual_seed(0)  # identical initial weights on both ranks
            net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                      torch.nn.ReLU(), torch.nn.Linear(32, 3))
            unused = torch.nn.Parameter(torch.zeros(4))  # never gets a gradient
            params = list(net.parameters()) + [unused]
            red = GradReducer(params, ctx, "dense", bucket_bytes=1200, **kw)
            xg = torch.Generator().manual_seed(7 + rank)
            launched = []
            if attach:  # gradients as views of the bucket buffers: accumulated and reduced in place
                red.attach()
                views = [p.grad.data_ptr() for p in params]
            for m in range(2):
                x = torch.randn(16, 6, generator=xg)
                if m == 1:
                    red.arm()
                net(x).square().mean().backward()
                if m == 1:
                    launched.append(len(red._inflight))
            stats = red.reduce(0.25, torch.tensor([1.0 + rank, 2.0]))
            red.close()
            out[name] = {"grads": [p.grad.clone() for p in params], "buckets": len(red.buckets),
                         "launched_in_backward": launched[0], "extras": stats.tolist(),
                         "still_views": attach and [p.grad.data_ptr() for p in params] == views}
        same = [("a", torch.arange(10.0)), ("b", torch.ones(3, dtype=torch.bool))]
        check_replicas(ctx, same, step=7)
        differ = [("a", torch.arange(10.0) + (1e-7 if rank == 1 else 0.0)), ("b", torch.ones(3, dtype=torch.bool))]
        try:
            check_replicas(ctx, differ, step=42)
            out["divergence"] = None
        except ReplicaDivergence as exc:
            out["divergence"] = str(exc)
        out["inputs"] = (table, mlp)
    finally:
        torch.save(out, f"{results}.{rank}")
        dist.destroy_process_group()


def test_gradient_sync_modes_and_replica_check_in_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_collectives_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "res")), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"res.{r}", weights_only=False) for r in range(2)]
    (t0, m0), (t1, m1) = res[0]["inputs"], res[1]["inputs"]
    want_table, want_mlp = (t0 + t1) * 0.5, (m0 + m1) * 0.5
    for r in range(2):
        for mode in ("dense", "sparse", "auto"):
            got = res[r][mode]
            # exact: every mode adds the same two numbers per element (commutative) and halves
            assert torch.equal(got["table"], want_table), (r, mode)
            assert torch.equal(got["mlp"], want_mlp), (r, mode)
            assert torch.equal(got["none"], torch.zeros(3))
            assert got["extras"].tolist() == [3.0, 20.0]
        assert res[r]["sparse"]["sparse_steps"] == 1
        assert res[r]["auto"]["sparse_steps"] == 1  # 1% of rows: gathering them is fewer bytes
        plain, over, bf16 = res[r]["plain"], res[r]["overlap"], res[r]["bf16"]
        assert over["buckets"] >= 3 and over["launched_in_backward"] == over["buckets"] - 1  # all but the unused one
        assert plain["launched_in_backward"] == 0
        for a, b, c, d in zip(plain["grads"], over["grads"], bf16["grads"], res[1 - r]["overlap"]["grads"]):
            assert torch.equal(a, b)  # same additions, only earlier
            assert torch.equal(b, d)  # identical on both ranks
            # bf16 keeps 8 significant bits: each of the two summands and the sum round once
            torch.testing.assert_close(c, a, rtol=2e-2, atol=1e-3 * float(a.abs().max()) + 1e-12)
        # gradients as bucket views (with and without overlap): the same sums, still views afterwards,
        # and the statistics summed in the first bucket's tail (or on their own after an overlap)
        for name in ("views", "views+overlap"):
            v = res[r][name]
            assert v["still_views"], name
            for a, b in zip(plain["grads"], v["grads"]):
                assert torch.equal(a, b), name
            assert v["extras"] == [3.0, 4.0] == plain["extras"], name
        assert res[r]["views+overlap"]["launched_in_backward"] == over["launched_in_backward"]
        msg = res[r]["divergence"]
        assert msg is not None and "step 42" in msg and "rank(s) [1]" in msg and "a" in msg, msg


# ---------------------------------------------------------------- launcher


def _params(over: dict | None = None):
    from stages.common.params import from_dict
    from stages.reconstruct.config import ReconstructParams

    return from_dict(ReconstructParams, merge(TINY, over or {}), "reconstruct")


def test_more_gpus_than_visible_is_a_clear_error():
    from stages.reconstruct.launch import plan

    with pytest.raises(ValueError, match=r"gpus is 4 but only 2 GPU\(s\) are visible"):
        plan(_params({"device": "auto", "distributed": {"gpus": 4}}), visible_gpus=2)
    with pytest.raises(ValueError, match=r"gpus is 1 but only 0 GPU\(s\)"):
        plan(_params({"device": "auto", "distributed": {"gpus": 1}}), visible_gpus=0)
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        plan(_params({"device": "cuda"}), visible_gpus=0)
    with pytest.raises(ValueError, match="nodes is 2 but rdzv_endpoint is empty"):
        plan(_params({"distributed": {"nodes": 2}}), visible_gpus=0)
    p = plan(_params({"device": "auto", "distributed": {"gpus": "auto", "nodes": 2,
                                                        "rdzv_endpoint": "head:29500"}}), visible_gpus=8)
    assert (p.device_type, p.nproc_per_node, p.world_size) == ("cuda", 8, 16)
    p = plan(_params({"device": "cpu", "distributed": {"gpus": 4, "cpu_workers": 3}}), visible_gpus=8)
    assert (p.device_type, p.world_size, p.needs_torchrun) == ("cpu", 3, True)
    assert not plan(_params({"device": "auto"}), visible_gpus=1).needs_torchrun


def test_bad_params_are_rejected_with_the_key():
    from stages.common.params import ParamsError

    with pytest.raises(ParamsError, match="reconstruct.distributed.nodes"):
        _params({"distributed": {"nodes": 0}})
    with pytest.raises(ParamsError, match="reconstruct.distributed.gpus"):
        _params({"distributed": {"gpus": 0}})
    with pytest.raises(ParamsError, match="unknown params key.*reconstruct.distributed.gpu\\b"):
        _params({"distributed": {"gpu": 2}})
    with pytest.raises(ParamsError, match="rdzv_endpoint: must be host:port"):
        _params({"distributed": {"rdzv_endpoint": "nohost"}})


def test_cli_errors_before_training(poses, tmp_path, capsys):
    from stages.reconstruct.__main__ import main

    p = write_params(tmp_path / "p.yaml", {"device": "auto", "distributed": {"gpus": 64}})
    assert main(["--poses", str(poses), "--out", str(tmp_path / "o"), "--params", str(p)]) == 1
    assert "gpus is 64" in capsys.readouterr().err
    p = write_params(tmp_path / "q.yaml", {"batch_rays": 100, "distributed": {"micro_batches": 3}})
    assert main(["--poses", str(poses), "--out", str(tmp_path / "o"), "--params", str(p)]) == 1
    assert "multiple of reconstruct.distributed.micro_batches" in capsys.readouterr().err
    p = write_params(tmp_path / "r.yaml")
    assert main(["--poses", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--params", str(p)]) == 1
    assert "missing transforms.json" in capsys.readouterr().err


def test_rendezvous_endpoint_that_does_not_answer(poses, tmp_path, capsys):
    from stages.reconstruct.__main__ import main

    port = free_port()  # nobody listens there
    p = write_params(tmp_path / "p.yaml", {"distributed": {
        "nodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_timeout_s": 2}})
    t = time.monotonic()
    rc = main(["--poses", str(poses), "--out", str(tmp_path / "o"), "--params", str(p), "--node-rank", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"rendezvous endpoint 127.0.0.1:{port} did not answer within rdzv_timeout_s=2 s" in err, err[-3000:]
    assert time.monotonic() - t < 60
    assert not (tmp_path / "o").exists()


def test_torchrun_command_and_environment(monkeypatch):
    from stages.reconstruct.launch import LaunchPlan, child_env, torchrun_command

    params = _params({"distributed": {"nodes": 2, "rdzv_endpoint": "head:29400", "max_restarts": 2,
                                      "rdzv_timeout_s": 30}})
    cmd = torchrun_command(LaunchPlan("cuda", 4, 2, 4), params, ["--poses", "p", "--out", "o"], node_rank=1,
                           rdzv_id="x")
    s = " ".join(cmd)
    assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --max-restarts 2" in s
    assert "--rdzv-backend c10d --rdzv-endpoint head:29400 --rdzv-id x" in s
    assert "join_timeout=30,read_timeout=30" in s and "is_host=false" in s
    assert s.endswith("-m stages.reconstruct --poses p --out o")
    assert "--standalone" in torchrun_command(LaunchPlan("cpu", 2, 1, 0), _params(), [])
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    e = child_env()
    assert e["NCCL_SOCKET_IFNAME"] == "ib0" and e["NCCL_DEBUG"] == "WARN"
    assert str(ROOT) in e["PYTHONPATH"].split(os.pathsep)


def test_write_slurm(poses, tmp_path):
    from stages.reconstruct.__main__ import main

    p = write_params(tmp_path / "p.yaml", {"device": "auto", "distributed": {
        "nodes": 4, "rdzv_endpoint": "", "gpus": "auto", "max_restarts": 2}})
    job = tmp_path / "job.sbatch"
    assert main(["--poses", str(poses), "--out", "data/reconstruct", "--params", str(p),
                 "--write-slurm", str(job)]) == 0
    text = job.read_text()
    for want in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "srun --kill-on-bad-exit=1",
                 "-m torch.distributed.run", "--nnodes=4 --nproc-per-node=gpu --max-restarts=2",
                 "--rdzv-backend=c10d", 'scontrol show hostnames "$SLURM_JOB_NODELIST"',
                 "-m stages.reconstruct --poses", "--checkpoint-dir"):
        assert want in text, want
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    assert not (tmp_path / "data").exists()  # nothing trained


def test_prometheus_endpoint_on_loopback():
    from stages.reconstruct.telemetry import MetricsServer

    port = free_port()
    m = MetricsServer(port, world_size=2, steps_total=100)
    try:
        m.update(10, 0.01, 20.0, 19.5, [[1000.0, 50.0, 0.01, 0.002], [900.0, 45.0, 0.011, 0.001]])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert m.server.server_address[0] == "127.0.0.1"
    finally:
        m.close()
    assert "rayforge_reconstruct_step 10.0" in text
    assert 'rayforge_reconstruct_step_comm_seconds{rank="1"} 0.001' in text
    assert 'rayforge_reconstruct_samples_per_second{rank="0"} 1000.0' in text
    assert "rayforge_reconstruct_world_size 2.0" in text


def test_lr_scale_rule():
    from stages.reconstruct.distributed import lr_scale, scale_learning_rates

    assert lr_scale("sqrt", 4) == 2.0 and lr_scale("linear", 4) == 4.0 and lr_scale("none", 4) == 1.0
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    scale_learning_rates(opt, sched, 2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # base 0.02 x 0.5


def test_large_gradients_get_their_own_bucket_and_small_ones_pack_around_them():
    from stages.reconstruct.distributed import DistContext, GradReducer

    # background (3), a hash table (bigger than the cap), MLP weight and bias: the small three
    # share one bucket although the table sits between them in parameter order
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 1000, 40, 8)]
    red = GradReducer(ps, DistContext(), "dense", bucket_bytes=400)
    assert red.buckets == [[1], [0, 2, 3]]
    red = GradReducer(ps, DistContext(), "dense", bucket_bytes=100)  # the MLP weight alone fills one
    assert red.buckets == [[1], [2], [0, 3]]
