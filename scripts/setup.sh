#!/usr/bin/env bash
# Install mmgate with the reference-engine and test extras into the current Python,
# plus the system tools the tests use: redis-server (the worker-mode sidecar tests start
# their own) and ffmpeg (the edge-case corpus generator encodes its video cases with it).
# torch/torchvision are pinned to the releases this machine kind keeps on disk
# (the PyPI torchvision does not load beside the CPU-only torch 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null || ! command -v ffmpeg >/dev/null; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq redis-server ffmpeg >/dev/null
fi
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    "torch==2.14.1" "torchvision==0.29.1" -e ".[engine,test]"
"$PY" -c "import mmgate, transformers, torchvision, grpc, smg_grpc_proto, smg_grpc_servicer.vllm.mm_tensors, redis, av"
