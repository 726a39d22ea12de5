#!/usr/bin/env bash
# Install, check that nothing the suite needs is missing, then run the whole test suite
# (both parity tiers, API, engine, end to end).
#   ./scripts/test.sh [--no-setup] [pytest args...]
# --no-setup: skip scripts/setup.sh (.ci/run runs it once as its own step).
# The preflight (tests/support/preflight.py) names each missing model bundle, unbuilt C extension,
# tool (ffmpeg, redis-server) or corpus generator; under CI=true (or MMGATE_REQUIRE_ALL=1) any of
# them fails the run before pytest starts. pytest's "no tests collected" (exit 5) is a failure too.
# --durations=40: the slowest tests are printed, so the CI log shows where the time goes.
# pytest-xdist: N worker processes, each test file whole on one worker (--dist loadfile: its module
# fixtures start once); N = MMGATE_TEST_WORKERS, else as many as the memory holds
# (tests/support/xdist_workers.py); N = 1 runs in this process. A worker that dies ends the run
# (--max-worker-restart=0) rather than leaving xdist waiting; pytest-timeout fails a test past
# MMGATE_TEST_TIMEOUT_S (default 900 s) so a hang cannot hold CI.
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
WORKERS=$("$PY" -m tests.support.xdist_workers)
XDIST=()
if [ "$WORKERS" -gt 1 ]; then
    XDIST=(-n "$WORKERS" --dist loadfile --max-worker-restart=0)
fi
echo "test.sh: $WORKERS pytest worker(s) (MMGATE_TEST_WORKERS=${MMGATE_TEST_WORKERS:-auto})"
rc=0
"$PY" -m pytest -q --durations=40 --timeout="${MMGATE_TEST_TIMEOUT_S:-900}" ${XDIST[@]+"${XDIST[@]}"} "$@" || rc=$?
if [ "$rc" = 5 ]; then
    echo "test.sh: FAILED: pytest collected no tests (args: $*): a run that tests nothing is a failure"
fi
exit "$rc"
