#!/usr/bin/env bash
# GPU smoke test of SGLang extraction mode: start the patched SGLang 0.5.23 server on a small local
# model, run `hsx extract` on a few samples, `hsx verify` the output, and compare the stored states
# with a Hugging Face forward of the same ids. Nothing is downloaded: the model is a local directory.
#
#   bench/gpu_smoke.sh MODEL_DIR [--tp N] [--port P] [--layer-ids "1 3 5"] [--work DIR]
#                      [--server-arg ARG]...   (repeatable; e.g. --server-arg --cuda-graph-backend-prefill
#                                               --server-arg breakable to test with the prefill graph on)
#                      [--rehearse-on-cpu]     (the CPU reference server stands in for SGLang: tests
#                                               this script itself, proves nothing about SGLang)
#
# SMOKE_LENGTHS="1 7 64 513 3000" sets the samples' token counts (capped by the model's positions).
# Needs: a CUDA GPU; python3 with sglang==0.5.23 and hsx installed and the hook's .pth in
# site-packages (the hsx-sglang image); `hsx` with the extractor extra (HSX=... to point at it).
# Exit status 0 only if every step passed. Logs and outputs stay in the work directory.
set -euo pipefail

usage() { sed -n '2,15p' "$0" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
MODEL=$1; shift
TP=1 PORT=30123 LAYER_IDS="" WORK="" SERVER_EXTRA=() REHEARSE=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --tp) TP=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --layer-ids) LAYER_IDS=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --server-arg) SERVER_EXTRA+=("$2"); shift 2 ;;
    --rehearse-on-cpu) REHEARSE=1; shift ;;
    *) usage ;;
  esac
done
PYTHON=${PYTHON:-python3}
HSX=${HSX:-hsx}
WORK=${WORK:-$(mktemp -d -t hsx-gpu-smoke.XXXXXX)}
DUMPS=${DUMP_DIR:-/dev/shm/hsx-smoke-$$}
[[ -e $DUMPS ]] && OWN_DUMPS=0 || OWN_DUMPS=1
mkdir -p "$WORK" "$DUMPS"
SERVER_PID=""
cleanup() {
  if [[ -n $SERVER_PID ]]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [[ $OWN_DUMPS == 1 ]]; then rm -rf "$DUMPS"; fi
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

step "checks"
[[ -f $MODEL/config.json ]] || fail "$MODEL has no config.json (give a local model directory)"
if [[ $REHEARSE == 0 ]]; then
  if ! nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; then
    fail "no working nvidia-smi: this needs a GPU machine"
  fi
  "$PYTHON" -c "from hsx_extractor.sglang_hook.launch import SGLANG_VERSION as pin
from hsx_extractor.sglang_hook.bootstrap import installed_sglang_version as v
assert v() == pin, f'sglang {v()} installed, hsx pins {pin}'
print('sglang', pin, 'ok')" || fail "python3 lacks the pinned SGLang or hsx"
  SGLANG_HS_DUMP_DIR=$DUMPS "$PYTHON" -c \
    "import sys; assert any(type(f).__name__ == 'HookFinder' for f in sys.meta_path), 'the .pth did not activate the hook'" \
    || fail "hook not active: run python3 -m hsx_extractor.sglang_hook install-pth"
fi
"$HSX" --help >/dev/null || fail "no hsx command (set HSX=/path/to/hsx)"

step "dataset: token rows of mixed lengths"
"$PYTHON" - "$MODEL" "$WORK/data.jsonl" "${SMOKE_LENGTHS:-1 7 64 513 3000}" <<'EOF'
import json, random, sys
model, out, lengths = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split()]
cfg = json.load(open(f"{model}/config.json"))
cfg = cfg.get("text_config") or cfg
vocab, longest = int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 4096))
try:  # rows start with the BOS the chat template writes, as hsx requires of token rows
    from hsx_extractor.run.tokens import ChatTokenizer, TokenizerError
    bos = ChatTokenizer(model).bos_id
except TokenizerError:
    bos = None
rng = random.Random(0)
with open(out, "w") as f:
    for i, n in enumerate(min(n, longest - 8) for n in lengths):
        ids = [rng.randrange(10, vocab - 10) for _ in range(n)]
        if bos is not None:
            ids[0] = bos
        f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [1] * n}) + "\n")
print(open(out).read().count("\n"), "samples")
EOF

step "server"
mapfile -t ARGV < <("$PYTHON" - "$MODEL" "$TP" "$PORT" "$LAYER_IDS" "${SERVER_EXTRA[@]}" <<'EOF'
import sys
from hsx_extractor.sglang_hook.launch import server_args
model, tp, port, ids, *extra = sys.argv[1:]
print("\n".join(server_args(model, int(tp), int(port), [int(i) for i in ids.split()] or None, extra)))
EOF
)
if [[ $REHEARSE == 1 ]]; then
  # shellcheck disable=SC2206  # word splitting of the id list is wanted
  ARGV=("$HSX" serve-reference --model "$MODEL" --dump-dir "$DUMPS" --port "$PORT" --host 127.0.0.1
        ${LAYER_IDS:+--aux-layer-ids $LAYER_IDS})
fi
printf '%q ' "${ARGV[@]}"; echo
SGLANG_HS_DUMP_DIR=$DUMPS "${ARGV[@]}" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER_PID 2>/dev/null || { tail -50 "$WORK/server.log"; fail "server exited"; }
  sleep 5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { tail -50 "$WORK/server.log"; fail "server not healthy in 15 min"; }
if [[ $REHEARSE == 0 ]] && ! grep -q "hsx: patched" "$WORK/server.log"; then
  echo "note: no 'hsx: patched' line in the server log (logging level?)"
fi

step "extract"
# SGLang's /get_model_info lacks the capture layers: the extractor derives them from the same ids.
"$HSX" extract --run-id smoke --dataset "$WORK/data.jsonl" --format tokens --output "$WORK/out" \
  --model "$MODEL" --server-url "http://127.0.0.1:$PORT" --dump-dir "$DUMPS" \
  --progress-port 0 --dump-timeout 120 --on-mismatch fail \
  ${LAYER_IDS:+--set "auxLayerIds=[${LAYER_IDS// /,}]"} 2>&1 | tee "$WORK/extract.log" \
  || { tail -50 "$WORK/server.log"; fail "hsx extract failed"; }

step "verify"
"$HSX" verify "$WORK/out/smoke" || fail "hsx verify failed"

step "states against a Hugging Face forward of the same ids (fp32, CPU)"
"$PYTHON" - "$MODEL" "$WORK/out/smoke" "$LAYER_IDS" <<'EOF' || fail "stored states differ from the reference"
import sys
import numpy as np
from hsx_extractor.reader import OutputReader
from hsx_extractor.tools.reference_server import ReferenceModel

model_dir, run, ids = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split()] or None
ref = ReferenceModel(model_dir, ids)
reader = OutputReader(run)

def floats(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

def min_row_cosine(a, b):
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12
    return float((num / den).min())

worst = 1.0
for pos in range(len(reader)):
    rec = reader.read(pos)
    fwd = ref.forward(rec.input_ids.tolist())
    aux, final = fwd.aux, fwd.final
    k = len(ref.capture_layers)
    got_aux = floats(rec.aux_hidden_states).reshape(len(rec.input_ids), k, -1)
    want_aux = floats(aux).reshape(len(rec.input_ids), k, -1)
    cos = [min_row_cosine(got_aux[:, j], want_aux[:, j]) for j in range(k)]
    cos.append(min_row_cosine(floats(rec.hidden_states), floats(final)))
    print(f"sample {rec.sample_id}: L={len(rec.input_ids)} min row cosine per layer (aux..., final) {np.round(cos, 4)}")
    worst = min(worst, *cos)
print("worst", worst)
sys.exit(0 if worst > 0.99 else 1)
EOF

step "PASS (work directory: $WORK)"
