#!/usr/bin/env bash
# Quick start: install, then run one image chat request through the gateway to the reference engine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec python3 -m mmgate.cli demo "$@"
