#!/usr/bin/env bash
# Builds the real SGLang release (the one hsx's hook pins) for CPU, once, into
# ${HSX_CACHE:-$HOME/.cache/hsx}/sglang-<version>-cpu/: a venv with SGLang (--no-deps), its own
# Requires-Dist minus the GPU-only packages (tests/engines/sglang_venv.py says which), and hsx's hook
# .pth installed by `python -m hsx_extractor.sglang_hook install-pth`, the command the image runs.
# Nothing of this checkout stays in the venv: tests/engines hand each process this checkout's hsx
# and the test ground's sgl_kernel stand-in through PYTHONPATH. A stamp marks a finished build; it
# records the requirement list, so a changed list rebuilds and an unchanged one is a no-op.
# uv hard-links from its cache: a rebuild with a warm cache takes no download. Bytecode is compiled
# here (--compile-bytecode) because PYTHONDONTWRITEBYTECODE may be set where tests run: SGLang's
# three processes would then compile thousands of modules at every server start (~2x slower).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${HSX_CACHE:-$HOME/.cache/hsx}"
project_py="${HSX_VENV_BIN:-$repo/.venv/bin}/python"
uv="$(find "$cache" -maxdepth 3 -path "$cache/uv-*/bin/uv" 2>/dev/null | sort | tail -n 1 || true)"
[[ -x "$uv" ]] || uv="$(command -v uv || true)"
[[ -x "$uv" ]] || { echo "build_sglang.sh: no uv under $cache (run 'make venv' first)" >&2; exit 1; }
[[ -x "$project_py" ]] || { echo "build_sglang.sh: no project venv at $project_py (run 'make venv')" >&2; exit 1; }

say() { printf '[test-tools] %s\n' "$*"; }
cd "$repo"
t0=$SECONDS

venv="$("$project_py" -m tests.engines.sglang_venv venv-dir)"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9 # one build at a time; a second caller waits, then finds the stamp

reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$project_py" -m tests.engines.sglang_venv requirements >"$reqs" # fetches the pinned wheel once
wheel="$("$project_py" -m tests.engines.sglang_venv wheel)"
key="$( (basename "$wheel"; cat "$reqs") | sha256sum | cut -d' ' -f1)"

if [[ -f "$venv/.complete" && "$(cat "$venv/.complete")" == "$key" ]]; then
  say "sglang CPU venv: cached in $venv"
  exit 0
fi

say "building the SGLang CPU venv in $venv (~4 min on 2 cores; the first ever also downloads torch's GBs)"
rm -rf "$venv"
"$uv" venv -q -p "${PYTHON:-python3}" "$venv"
"$venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"the sglang wheel is cp311, got {sys.version}"'

t=$SECONDS
"$uv" pip install -q --compile-bytecode -p "$venv/bin/python" -r "$reqs"
say "  requirements ($(wc -l <"$reqs") of the release's, GPU-only ones left out) in $((SECONDS - t))s"
t=$SECONDS
"$uv" pip install -q --compile-bytecode -p "$venv/bin/python" --no-deps "$wheel"
say "  $(basename "$wheel") (--no-deps) in $((SECONDS - t))s"

# The hook, as the image installs it: a --no-deps wheel of this checkout's hsx (on PYTHONPATH here,
# see above), then the Dockerfile sglang stage's own steps (install-pth and its two checks), read
# from the Dockerfile and run by the venv's python3.
t=$SECONDS
hsx_dir="$(mktemp -d)"
trap 'rm -f "$reqs"; rm -rf "$hsx_dir"' EXIT
"$project_py" -m tests.engines.sglang_venv install-hook "$hsx_dir/hsx" | sed 's/^/[test-tools]   /'
export PYTHONPATH="$hsx_dir/hsx:$here/sgl_kernel_standin"
say "  hook .pth installed and checked in $((SECONDS - t))s"

# The server's entry module imports (fails here, not in a test, if a requirement is missing).
t=$SECONDS
if ! out="$(SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c "import sglang.launch_server, sglang.srt.entrypoints.http_server" 2>&1)"; then
  printf '%s\n' "$out" >&2
  echo "build_sglang.sh: SGLang does not import in $venv (see above); the stamp is not written" >&2
  exit 1
fi
say "  sglang.launch_server imports in $((SECONDS - t))s"

printf '%s' "$key" >"$venv/.complete"
say "built the SGLang CPU venv in $((SECONDS - t0))s ($(du -sh "$venv" | cut -f1) on disk, hard-linked from uv's cache)"
