#!/usr/bin/env bash
# Install, then run the whole test suite (both parity tiers, API, engine, end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 -m pytest -q "$@"
