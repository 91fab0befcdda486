"""The pinned dependencies: every one is used, and the tools the README tells users to run start."""
from __future__ import annotations

import functools
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Dependencies that code does not import by their own name, and why they are pinned.
USED_WITHOUT_IMPORT = {
    "cuda-python": "a meta-package: kernels/ import its cuda.bindings",
    "nvidia-cuda-nvrtc": "NVRTC's shared library, which kernels/loader.py loads from the install",
    "nvidia-cuda-runtime": "the CUDA headers the kernels compile against",
    "dvc": "run as a command (`python -m dvc`) by dvc.yaml's users, flows/ and stages/compare.py",
    "tensorboard": "torch.utils.tensorboard writes its event files through it",
    "setuptools": "tensorboard 2.20 imports pkg_resources from it",
    "open3d": "the same package as open3d-cpu, for platforms without a CPU-only wheel",
    "pytest-timeout": "a pytest plugin (pyproject's [tool.pytest.ini_options] timeout)",
}


def _name(spec: str) -> str:
    return re.split(r"[ ;=<>!~\[]", spec, maxsplit=1)[0].lower().replace("_", "-")


def _imported(folders: list[str]) -> set[str]:
    """Top-level modules that the Python files under ``folders`` import (or pytest.importorskip)."""
    pattern = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)|importorskip\(\s*[\"']([A-Za-z_]\w*)", re.M)
    found = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            found |= {a or b for a, b in pattern.findall(path.read_text(encoding="utf-8"))}
    return found


@functools.cache
def _distributions() -> dict[str, set[str]]:
    """Installed distribution (normalised name) -> the top-level modules it provides."""
    out: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for d in dists:
            out.setdefault(d.lower().replace("_", "-"), set()).add(module)
    return out


def _modules_of(dist: str) -> set[str]:
    return _distributions().get(dist, set())


def test_every_dependency_is_imported_or_has_a_reason():
    """A runtime dependency is imported by the project's code (not only its tests); a dev one by the
    tests; the rest are listed above with the reason. (kornia was pinned and imported by nothing.)"""
    runtime = _imported(["stages", "kernels", "flows", "benchmarks", "scripts"])
    tests = _imported(["tests"])
    groups = [(PYPROJECT["project"]["dependencies"], runtime, "the project's code"),
              (PYPROJECT["project"]["optional-dependencies"]["dev"], tests | runtime, "the tests")]
    unused = []
    for specs, imported, where in groups:
        for dist in map(_name, specs):
            if dist in USED_WITHOUT_IMPORT:
                continue
            modules = _modules_of(dist)
            if not modules & imported:
                unused.append(f"{dist} (modules {sorted(modules) or '?'}): imported nowhere in {where}")
    assert not unused, "pinned but not used; drop them or say why in USED_WITHOUT_IMPORT:\n" + "\n".join(unused)


def test_setup_checks_only_pinned_imports():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    line = re.search(r'python -c "import ([^"]+)"', setup).group(1)
    assert "kornia" not in line
    pinned = {m for spec in PYPROJECT["project"]["dependencies"] for m in _modules_of(_name(spec))} | {"cuda"}
    assert {m.strip().split(".")[0] for m in line.split(",")} <= pinned


def test_tensorboard_console_script_starts():
    """The README's `tensorboard --logdir ...` in the project's venv (it died with `No module named
    'pkg_resources'` under setuptools 82+)."""
    exe = Path(sys.executable).parent / "tensorboard"
    p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == importlib.metadata.version("tensorboard")
