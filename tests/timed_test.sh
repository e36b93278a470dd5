#!/usr/bin/env bash
# `make test`: set-up, lint, then every test; prints each step's time at the end, pass or fail, so
# a CI run that grows toward its 90-minute limit says where the time went (issue 30).
set -uo pipefail
make="$1" bin="$2"
t0=$SECONDS
step() { # <name> <command...>
  local name="$1" start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  times+=("$(printf '%-8s %5ss  exit %s' "$name" "$((SECONDS - start))" "$rc")")
  return "$rc"
}
summary() { printf '[make test] %s\n' "${times[@]}" "total    $((SECONDS - t0))s"; }
times=()
rc=0
step setup "$make" --no-print-directory test-tools && step lint "$make" --no-print-directory lint \
  && step pytest "$bin/python" -m pytest "${@:3}" || rc=$?
summary
exit "$rc"
