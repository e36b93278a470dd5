#!/usr/bin/env bash
# Builds every test tool, in two lanes at once: the Go builds (CPU-bound) beside the Python venvs
# (mostly download, unpack and bytecode compile), which on 2 cores overlap instead of adding up.
# Each lane's lines are prefixed; a lane that fails fails the whole step with its own exit code.
# Every script below is a no-op for what is already cached.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"
make="${MAKE:-make}"
t0=$SECONDS

lane() { # <name> <command...>: runs the command with its output prefixed, records its time
  local name="$1"
  shift
  local start=$SECONDS rc=0
  "$@" 2>&1 | sed -u "s/^/[$name] /" || rc=$?
  printf '[setup] lane %s finished in %ss (exit %s)\n' "$name" "$((SECONDS - start))" "$rc"
  return "$rc"
}

# Without the venv the Go lane skips only its final check of the wheel tools (kubectl, hadolint).
HSX_TOOLS_SKIP_WHEEL_CHECK=1 lane go bash tests/cluster/build.sh &
go_pid=$!
py_rc=0
lane py bash -c "$make --no-print-directory venv && bash tests/engines/build_sglang.sh \
  && bash tests/trainers/build_trainers.sh && bash tests/engines/build_vllm.sh" || py_rc=$?
go_rc=0
wait "$go_pid" || go_rc=$?
((py_rc == 0 && go_rc == 0)) || exit $((py_rc ? py_rc : go_rc))
bash tests/cluster/build.sh | tail -n 1 # every binary cached, and the wheel tools in the venv
printf '[setup] test tools ready in %ss\n' "$((SECONDS - t0))"
