#!/usr/bin/env bash
# `make test`'s steps, each run even when one before it failed; each step's time is printed as it
# ends, and the end names every step that failed (exit 1) or says all passed (exit 0).
#
#   PY=.venv/bin/python VENV=.venv PYTHON=python3 MAKE=make scripts/make_test.sh [STEP ...]
#
# STEP: suite matrix mypy audit-sm_90 audit-sm_80 wheel (default: all, in this order). The suite
# ends with its 25 slowest tests' times (the README's "The test suite" holds each to 60 s quiet).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
MAKE="${MAKE:-make}"
all=(suite matrix mypy audit-sm_90 audit-sm_80 wheel)
steps=("${@:-${all[@]}}")
for s in "${steps[@]}"; do
  case " ${all[*]} " in *" $s "*) ;; *) echo "unknown step '$s': choose from ${all[*]}"; exit 2 ;; esac
done

run_step() {
  case "$1" in
    suite) "$PY" -m pytest -q --durations 25 tests --ignore=tests/frameworks ;;
    matrix) "$MAKE" --no-print-directory test-matrix ;;
    mypy) "$VENV/bin/mypy" ;;
    audit-sm_90) "$PY" -m mmbalance.bench.kernel_audit --arch sm_90 ;;
    audit-sm_80) "$PY" -m mmbalance.bench.kernel_audit --arch sm_80 ;;
    wheel) PYTHON="$PYTHON" .ci/check_wheel ;;
  esac
}

failed=()
summary=()
for s in "${steps[@]}"; do
  echo "== make test: $s"
  start=$(date +%s)
  run_step "$s"
  rc=$?
  took=$(($(date +%s) - start))
  if [ "$rc" -ne 0 ]; then
    failed+=("$s")
    summary+=("$s: FAILED (exit $rc) in ${took} s")
  else
    summary+=("$s: passed in ${took} s")
  fi
  echo "== make test: ${summary[-1]}"
done
echo "== make test: the steps"
printf '   %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "make test: ${#failed[@]} step(s) failed: ${failed[*]}"
  exit 1
fi
echo "make test: every step passed"
