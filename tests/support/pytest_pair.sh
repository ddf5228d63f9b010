#!/usr/bin/env bash
# `make test`: tests/e2e and the rest of the suite as two pytest processes side by side.
#
# usage: tests/support/pytest_pair.sh PYTHON [PYTEST_ARGS...]
#
# Why: the e2e tests mostly wait on the processes they start (services coming up, drains,
# heartbeats, timeouts), the unit and integration tests run in-process and keep one core
# busy. One after the other they left one of a 2-core CI machine's cores idle for most of
# the run. The rest runs at nice 10, so that when both want the CPU the e2e tests (whose
# processes answer heartbeats and meet deadlines) get it first, and the in-process tests use
# what they leave idle.
#
# At nice 10 the rest weighs 110 against a nice-0 process's 1024 in the kernel's fair share:
# while the e2e tests keep both cores busy (the vLLM ones do), a test of the rest runs up to
# ten times slower than alone, and a tokenizer test that takes 3 s alone hit its 30 s timeout.
# Its timeouts guard against hangs, not speed, so TANDEM_TEST_TIMEOUT_SCALE=10 gives each
# test of the rest ten times its written limit (tests/conftest.py).
#
# Each process writes its own log, shown when both are done (progress dots of two processes
# on one terminal would interleave); the exit status is the worst of the two. PYTEST_ARGS
# that name a test path (`make test PYTEST_ARGS=tests/unit/x.py`) run one process: a
# selection is not split. Ctrl-C stops both.
set -uo pipefail
python=$1
shift
pytest=("$python" -m pytest -q -m "not image" --durations=40)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then
    exec "${pytest[@]}" "$@"
  fi
done
e2e_log=$(mktemp -t pytest-e2e.XXXXXX)
rest_log=$(mktemp -t pytest-rest.XXXXXX)
"${pytest[@]}" "$@" tests/e2e >"$e2e_log" 2>&1 &
e2e_pid=$!
TANDEM_TEST_TIMEOUT_SCALE=10 nice -n 10 "${pytest[@]}" "$@" --ignore=tests/e2e >"$rest_log" 2>&1 &
rest_pid=$!
trap 'kill -INT "$e2e_pid" "$rest_pid" 2>/dev/null; wait; exit 130' INT TERM
start=$SECONDS
echo "pytest: tests/e2e (pid $e2e_pid, log $e2e_log) and the rest (pid $rest_pid, log $rest_log)"
wait "$rest_pid"
rest_rc=$?
echo "pytest: the rest finished after $((SECONDS - start)) s (exit $rest_rc)"
wait "$e2e_pid"
e2e_rc=$?
echo "pytest: tests/e2e finished after $((SECONDS - start)) s (exit $e2e_rc)"
echo "================================ the rest (unit, integration) ================================"
cat "$rest_log"
echo "================================ tests/e2e ================================"
cat "$e2e_log"
rm -f "$e2e_log" "$rest_log"
# 5: pytest collected nothing (a -k or -m that selects from one side only)
if [ "$rest_rc" -eq 5 ] && [ "$e2e_rc" -eq 5 ]; then
  exit 5
fi
for rc in "$rest_rc" "$e2e_rc"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit 1
  fi
done
