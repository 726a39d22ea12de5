#!/usr/bin/env bash
# Install, check that nothing the suite needs is missing, then run the whole test suite
# (both parity tiers, API, engine, end to end).
#   ./scripts/test.sh [--no-setup] [pytest args...]
# --no-setup: skip scripts/setup.sh (.ci/run runs it once as its own step).
# The preflight (tests/support/preflight.py) names each missing model bundle, unbuilt C extension,
# tool (ffmpeg, redis-server) or corpus generator; under CI=true (or MMGATE_REQUIRE_ALL=1) any of
# them fails the run before pytest starts. pytest's "no tests collected" (exit 5) is a failure too.
# --durations=40: the slowest tests are printed, so the CI log shows where the time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--no-setup" ]; then
    shift
else
    ./scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
"$PY" -m tests.support.preflight
rc=0
"$PY" -m pytest -q --durations=40 "$@" || rc=$?
if [ "$rc" = 5 ]; then
    echo "test.sh: FAILED: pytest collected no tests (args: $*): a run that tests nothing is a failure"
fi
exit "$rc"
