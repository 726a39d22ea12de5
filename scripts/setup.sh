#!/usr/bin/env bash
# Install mmgate with the reference-engine and test extras into the current Python.
# torch/torchvision are pinned to the releases this machine kind keeps on disk
# (the PyPI torchvision does not load beside the CPU-only torch 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    "torch==2.14.1" "torchvision==0.29.1" -e ".[engine,test]"
"$PY" -c "import mmgate, transformers, torchvision, grpc, smg_grpc_proto"
