#!/usr/bin/env bash
# `make test`: set-up, lint, then every test; prints each step's time at the end, pass or fail, so
# a CI run that grows toward its 90-minute limit says where the time went (issue 30).
#
# The tests run as two pytest sessions at once: the control-plane tests (-m cluster: the API server,
# the node agent's pods, helm) and the rest. Most of either group's time is spent waiting on servers,
# pods and subprocesses, so on 2 cores the pair finishes well before the two would one after the
# other (README, "Where the time goes"). HSX_TEST_GROUPS=1, or any pytest arguments, run one session.
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
summary() { printf '[make test] %s\n' "${times[@]}" "${group_times[@]}" "total    $((SECONDS - t0))s"; }

# One pytest session per marker expression, at the same time; each line is prefixed with its group
# and each group's own time is recorded. Fails if either group fails.
two_groups() {
  local base name rc=0
  base=$(mktemp -d /tmp/hsx-test.XXXXXX)
  group() { # <name> <marker expression>
    local name="$1" start=$SECONDS code=0
    "$bin/python" -m pytest -m "$2" --basetemp "$base/$name" -o "cache_dir=.pytest_cache/$name" \
      > >(sed -u "s/^/[$name] /") 2>&1 || code=$?
    printf '%-8s %5ss  exit %s\n' "$name" "$((SECONDS - start))" "$code" > "$base/$name.time"
    return "$code"
  }
  group cluster "cluster" & local cluster=$!
  group other "not cluster" & local other=$!
  wait "$cluster" || rc=$?
  wait "$other" || rc=$?
  sleep 0.2 # the prefixing seds flush their last lines
  for name in cluster other; do group_times+=("  $(cat "$base/$name.time" 2>/dev/null || echo "$name ?")"); done
  rm -rf "$base"
  return "$rc"
}

times=() group_times=()
rc=0
if [[ $# -gt 2 || "${HSX_TEST_GROUPS:-2}" == 1 ]]; then
  run_tests() { "$bin/python" -m pytest "${@:3}"; }
else
  run_tests() { two_groups; }
fi
step setup "$make" --no-print-directory test-tools && step lint "$make" --no-print-directory lint \
  && step pytest run_tests "$@" || rc=$?
summary
exit "$rc"
