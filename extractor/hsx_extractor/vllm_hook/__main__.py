"""``python -m hsx_extractor.vllm_hook serve ...``: start vLLM in extraction mode for a model.

The server container's command (launch.launcher_args). Reads the model's config.json here, where
the model is mounted, turns the spec's layer ids into hsx's capture layers (hsx_extractor.model, the
same rule as for SGLang) and replaces itself with vLLM's server (launch.server_args).
"""

from __future__ import annotations

import argparse
import os
import sys

from hsx_extractor.model import ModelConfigError, capture_layers, model_dims, read_model_config
from hsx_extractor.vllm_hook.launch import server_args


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hsx_extractor.vllm_hook", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="exec vLLM's OpenAI server in extraction mode", allow_abbrev=False)
    s.add_argument("--model", required=True)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--layer-ids", default="", help="the spec's auxLayerIds, comma-separated (none: EAGLE-3's)")
    s.add_argument("--chunked-prefill-size", type=int, default=-1)
    s.add_argument("--context-length", type=int, default=None)
    s.add_argument("extra", nargs=argparse.REMAINDER, help="after --: appended to vLLM's arguments")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    try:
        dims = model_dims(read_model_config(args.model))
        ids = [int(x) for x in args.layer_ids.split(",") if x.strip()] or None
        layers = capture_layers(dims.architecture, dims.num_layers, ids)
        cmd = server_args(args.model, args.tp, args.port, layers, dims.num_layers, extra, host=args.host,
                          chunked_prefill_size=args.chunked_prefill_size, context_length=args.context_length)  # fmt: skip
    except (ModelConfigError, ValueError) as exc:
        print(f"hsx vllm launcher: {exc}", file=sys.stderr)
        return 2
    print(f"hsx vllm launcher: capture layers {layers}; exec {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
