"""The Kubeflow PyTorchJob manifest that ``python -m stages.reconstruct --write-k8s`` writes.

Checked against the PyTorchJob CRD's OpenAPI v3 schema (vendored from the Kubeflow Training
Operator v1.9.0, tests/data/kubeflow_pytorchjob_v1_schema.NOTICE.md) with jsonschema, plus what
a strict API server and the operator's admission webhook add: no field the schema does not know
(``kubectl --validate=strict``), replica types Master / Worker, one Master, a container named
``pytorch`` with an image, a DNS-1035 job name. The container command must parse with torchrun's
own argument parser and the stage's, with the numbers of reconstruct.distributed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

try:
    import jsonschema
except ImportError:  # an error on a CPU-only machine (CI); a skip on the lent GPU machine
    from conftest import import_or_skip_on_gpu_host

    jsonschema = import_or_skip_on_gpu_host("jsonschema", "the manifests are checked against their JSON schemas")

from stages.common.params import from_dict
from stages.reconstruct.config import ReconstructParams

SCHEMA = Path(__file__).resolve().parent / "data" / "kubeflow_pytorchjob_v1_schema.json"


def params(**distributed) -> ReconstructParams:
    device = distributed.pop("device", "auto")
    return from_dict(ReconstructParams, {"device": device, "distributed": distributed}, "reconstruct")


def unknown_fields(doc, schema, where: str = "") -> list[str]:
    """Paths of keys in ``doc`` that ``schema`` does not declare (where it declares properties)."""
    if isinstance(doc, dict) and isinstance(schema, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        out = []
        for k, v in doc.items():
            if props is not None and k in props:
                out += unknown_fields(v, props[k], f"{where}.{k}")
            elif isinstance(extra, dict):
                out += unknown_fields(v, extra, f"{where}.{k}")
            elif props is not None:
                out.append(f"{where}.{k}")
        return out
    if isinstance(doc, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        return [p for i, v in enumerate(doc) for p in unknown_fields(v, schema["items"], f"{where}[{i}]")]
    return []


def check_manifest(doc: dict) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft4Validator.check_schema(schema)
    jsonschema.Draft4Validator(schema).validate(doc)
    assert unknown_fields(doc, schema) == []
    # the operator's webhook (pkg/webhooks/pytorch/pytorchjob_webhook.go, v1.9.0)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    for spec in specs.values():
        assert spec["replicas"] >= 1
        containers = spec["template"]["spec"]["containers"]
        assert any(c["name"] == "pytorch" for c in containers) and all(c["image"] for c in containers)


def torchrun_args(container: dict):
    from torch.distributed.run import get_args_parser

    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    return get_args_parser().parse_args(cmd[3:])


def write(tmp_path: Path, p: ReconstructParams, **kw) -> dict:
    from stages.reconstruct.launch import write_k8s

    args = ["--poses", "data/poses", "--out", "data/reconstruct", "--params", "params.yaml",
            "--checkpoint-dir", "data/reconstruct.ckpt"]
    text = write_k8s(tmp_path / "job.yaml", p, args, image="registry.example/rayforge:1", **kw)
    assert text == (tmp_path / "job.yaml").read_text() and text.startswith("# Kubeflow PyTorchJob")
    return yaml.safe_load(text)


def test_gpu_job_of_two_nodes_validates_and_runs_torchrun_with_the_params(tmp_path: Path) -> None:
    from stages.reconstruct.__main__ import _parser

    doc = write(tmp_path, params(gpus=4, nodes=2, max_restarts=2, rdzv_timeout_s=300), volume_claim="scenes",
                namespace="vision")
    check_manifest(doc)
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert doc["metadata"]["namespace"] == "vision" and doc["spec"]["nprocPerNode"] == "4"
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert specs["Worker"]["replicas"] == 1
    for role, spec in specs.items():
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert {"name": "pytorchjob-port", "containerPort": 29500} in c["ports"]  # the operator's MASTER_PORT
        assert c["workingDir"] == "/workspace"
        assert {"name": "work", "persistentVolumeClaim": {"claimName": "scenes"}} in pod["volumes"]
        a = torchrun_args(c)
        assert (a.nnodes, a.nproc_per_node, a.max_restarts) == ("2", "4", 2)
        assert a.rdzv_backend == "c10d" and a.rdzv_endpoint == "$(MASTER_ADDR):$(MASTER_PORT)"
        assert a.rdzv_id == "rayforge-reconstruct" and a.module and a.training_script == "stages.reconstruct"
        assert a.rdzv_conf == f"join_timeout=300,read_timeout=300,is_host={'true' if role == 'Master' else 'false'}"
        stage = _parser().parse_args(a.training_script_args)
        assert (stage.poses, stage.out, stage.checkpoint_dir) == ("data/poses", "data/reconstruct",
                                                                   "data/reconstruct.ckpt")


def test_one_node_and_cpu_jobs(tmp_path: Path) -> None:
    doc = write(tmp_path, params(gpus=8))
    check_manifest(doc)
    assert list(doc["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    (c,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert torchrun_args(c).nproc_per_node == "8" and "workingDir" not in c
    doc = write(tmp_path, params(device="cpu", cpu_workers=2, nodes=3), job_name="cpu-run")
    check_manifest(doc)
    assert doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    (c,) = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert "resources" not in c and torchrun_args(c).nproc_per_node == "2"


def test_schema_check_catches_what_kubectl_would_refuse(tmp_path: Path) -> None:
    doc = write(tmp_path, params(gpus=2, nodes=2))
    bad = json.loads(json.dumps(doc))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        check_manifest(bad)
    typo = json.loads(json.dumps(doc))
    typo["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(AssertionError):
        check_manifest(typo)


def test_bad_requests_name_the_problem(tmp_path: Path) -> None:
    from stages.reconstruct.launch import write_k8s

    with pytest.raises(ValueError, match="distributed.gpus is 'auto'"):
        write_k8s(tmp_path / "a.yaml", params(), [], image="x")
    with pytest.raises(ValueError, match="--k8s-image"):
        write_k8s(tmp_path / "a.yaml", params(gpus=1), [], image="")
    with pytest.raises(ValueError, match="DNS-1035"):
        write_k8s(tmp_path / "a.yaml", params(gpus=1), [], image="x", job_name="Rayforge_Run")
    assert not (tmp_path / "a.yaml").exists()


def test_stage_command_writes_the_manifest(tmp_path: Path) -> None:
    from stages.reconstruct.__main__ import main

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"reconstruct": {"distributed": {"gpus": 2, "nodes": 2}}}))
    rc = main(["--poses", "data/poses", "--out", "data/reconstruct", "--params", str(tmp_path / "params.yaml"),
               "--write-k8s", str(tmp_path / "job.yaml"), "--k8s-image", "img:1", "--k8s-pvc", "data"])
    assert rc == 0
    check_manifest(yaml.safe_load((tmp_path / "job.yaml").read_text()))
    assert main(["--poses", "p", "--out", "o", "--params", str(tmp_path / "params.yaml"),
                 "--write-k8s", str(tmp_path / "no.yaml")]) == 1  # no image
    assert not (tmp_path / "no.yaml").exists()
