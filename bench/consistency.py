"""Cost and tolerance of the consistency check (validation.consistency) at a production head size.

    .venv/bin/python -m bench.consistency [--vocab 129280 --hidden 7168] [--dir /tmp/hsx-head]

Writes a model directory holding only a random bf16 lm_head of DeepSeek-V3's shape (1.85 GB; no
weights are downloaded), then in this process:

* cost: wall and CPU seconds of one comparison pass (``compare_items``, the extractor's own code: the head streamed
  from the file, logits, log-softmax, comparison) for 1, 4 and 16 checked requests of 4 positions
  each, warm page cache (the server has just read the same file), and the process's peak RSS;
* tolerance: a bf16 server rounds its logits to bf16 before the log-softmax; the captured state is the
  same bf16 tensor it multiplied. For positions whose logits have a realistic spread (std 4, top near
  20) the error that rounding makes is compared with the default tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result
from hsx_extractor.config import ConsistencySpec
from hsx_extractor.run.consistency import CheckItem, compare_items, compare_position, log_softmax
from hsx_extractor.run.lm_head import LmHead, bf16_to_float32


def bf16_round(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_head(d: Path, vocab: int, hidden: int, scale: float) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / "model.safetensors"
    nbytes = vocab * hidden * 2
    if not f.exists() or f.stat().st_size < nbytes:
        header = {"lm_head.weight": {"dtype": "BF16", "shape": [vocab, hidden], "data_offsets": [0, nbytes]}}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        rng = np.random.default_rng(0)
        with open(f, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            for r0 in range(0, vocab, 4096):
                rows = min(4096, vocab - r0)
                out.write(bf16_round(rng.normal(0, scale, (rows, hidden)).astype(np.float32)).tobytes())
    config = {"hidden_size": hidden, "num_hidden_layers": 61, "vocab_size": vocab, "rms_norm_eps": 1e-6}
    (d / "config.json").write_text(json.dumps(config))
    return d


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dir", default="/tmp/hsx-bench-head")
    ap.add_argument("--positions", type=int, default=256, help="positions for the tolerance measurement")
    args = ap.parse_args(argv)
    spec = ConsistencySpec()
    logit_std = 4.0
    d = write_head(Path(args.dir), args.vocab, args.hidden, logit_std / np.sqrt(args.hidden))
    head = LmHead(d)
    rss_start = rss_mib()
    rng = np.random.default_rng(1)
    cost: dict[str, float] = {}
    head.logits(np.zeros((1, args.hidden), np.float32))  # warm the page cache, as the server has
    for requests in (1, 4, 16):
        states = bf16_round(rng.normal(0, 1, (requests * 4, args.hidden)).astype(np.float32))
        server = {p: [(0, -1.0)] for p in range(4)}  # the answer's content does not change the cost
        items = [CheckItem(i, states[4 * i : 4 * i + 4], server) for i in range(requests)]
        t0, c0 = time.perf_counter(), time.process_time()
        compare_items(items, head, "post-norm", spec)
        cost[f"requests_{requests}_wall_s"] = round(time.perf_counter() - t0, 3)
        cost[f"requests_{requests}_cpu_s"] = round(time.process_time() - c0, 3)
    rss_checks = rss_mib()  # peak so far: the passes (the measurement below holds 256 positions' logits)
    # Tolerance: a bf16 server's logits are its fp32-accumulated products rounded to bf16.
    states = bf16_round(rng.normal(0, 1, (args.positions, args.hidden)).astype(np.float32))
    logits = head.logits(bf16_to_float32(states))
    served = bf16_to_float32(bf16_round(logits))
    errors, ratios, failures = [], [], 0
    for p in range(args.positions):
        lp = log_softmax(served[p][None])[0]
        top = [(int(t), float(lp[t])) for t in np.argsort(-lp)[: spec.topK]]
        res = compare_position(p, logits[p], top, spec.logprobTolerance, spec.logprobRelTolerance)
        errors.append(res.max_error)
        ratios.append(res.max_error / res.tolerance)
        failures += not res.ok
    result = {
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "head": {"vocab": args.vocab, "hidden": args.hidden, "bytes": args.vocab * args.hidden * 2},
        "pass_seconds": cost,
        "rss_mib": {"before_passes": round(rss_start, 1), "peak_after_passes": round(rss_checks, 1)},
        "tolerance": {
            "positions": args.positions,
            "logit_std": logit_std,
            "max_abs_logit": round(float(np.abs(logits).max()), 2),
            "bf16_server_max_error": round(max(errors), 4),
            "max_error_over_tolerance": round(max(ratios), 3),
            "failures_with_defaults": failures,
        },
    }
    print(json.dumps(result, indent=2))
    write_result("consistency", result)
    return result


if __name__ == "__main__":
    main()
