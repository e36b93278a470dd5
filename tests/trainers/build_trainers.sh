#!/usr/bin/env bash
# Builds the real EAGLE-3 trainers from PyPI (SpecForge, speculators, NVIDIA Model-Optimizer), once,
# into ${HSX_CACHE:-$HOME/.cache/hsx}/trainers-<versions>/: their offline-data and training code,
# installed --no-deps, beside the requirement list tests/trainers/trainers_venv.py gives (their own
# pins cannot hold together; that module says why). A stamp records both lists: a changed list
# rebuilds, an unchanged one is a no-op. uv hard-links from its cache (torch is the SGLang venv's).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${HSX_CACHE:-$HOME/.cache/hsx}"
project_py="${HSX_VENV_BIN:-$repo/.venv/bin}/python"
uv="$(find "$cache" -maxdepth 3 -path "$cache/uv-*/bin/uv" 2>/dev/null | sort | tail -n 1 || true)"
[[ -x "$uv" ]] || uv="$(command -v uv || true)"
[[ -x "$uv" ]] || { echo "build_trainers.sh: no uv under $cache (run 'make venv' first)" >&2; exit 1; }
[[ -x "$project_py" ]] || { echo "build_trainers.sh: no project venv at $project_py (run 'make venv')" >&2; exit 1; }

say() { printf '[test-tools] %s\n' "$*"; }
cd "$repo"
t0=$SECONDS

venv="$("$project_py" -m tests.trainers.trainers_venv venv-dir)"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

reqs="$(mktemp)"; trainers="$(mktemp)"
trap 'rm -f "$reqs" "$trainers"' EXIT
"$project_py" -m tests.trainers.trainers_venv requirements >"$reqs"
"$project_py" -m tests.trainers.trainers_venv trainers >"$trainers"
key="$(cat "$reqs" "$trainers" | sha256sum | cut -d' ' -f1)"

if [[ -f "$venv/.complete" && "$(cat "$venv/.complete")" == "$key" ]]; then
  say "trainers venv: cached in $venv"
  exit 0
fi

say "building the trainers venv in $venv"
rm -rf "$venv"
"$uv" venv -q -p "${PYTHON:-python3}" "$venv"
t=$SECONDS
"$uv" pip install -q -p "$venv/bin/python" -r "$reqs"
say "  requirements ($(wc -l <"$reqs")) in $((SECONDS - t))s"
t=$SECONDS
"$uv" pip install -q -p "$venv/bin/python" --no-deps -r "$trainers"
say "  $(tr '\n' ' ' <"$trainers")(--no-deps) in $((SECONDS - t))s"

# The modules the tests use import (fails here, not in a test, when a requirement is missing).
if ! out="$("$venv/bin/python" -c '
import specforge.runtime.data_plane.offline_reader, specforge.algorithms.eagle3.data
import specforge.data.utils, specforge.modeling.draft.llama3_eagle, specforge.core.loss
import speculators.train.data, speculators.models.eagle3.core
import modelopt.torch.speculative.eagle.utils
' 2>&1)"; then
  printf '%s\n' "$out" >&2
  echo "build_trainers.sh: a trainer does not import in $venv (see above); the stamp is not written" >&2
  exit 1
fi
printf '%s' "$key" >"$venv/.complete"
say "built the trainers venv in $((SECONDS - t0))s ($(du -sh "$venv" | cut -f1) on disk, hard-linked from uv's cache)"
