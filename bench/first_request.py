"""Time to the first request of a fresh run: planning ahead vs. the whole-dataset pre-pass it replaced.

    .venv/bin/python -m bench.first_request [--rows 37000] [--turns 4] [--words 120] [--rounds 3]

Before, ``hsx extract`` on a run without plan.json tokenized every row (lengths, ids, row digests)
before its first request: the GPUs idled for that pass (~5-8 min for 37k rows of ~3k tokens on one
core, bench/tokenize.py). Now a planning thread makes the plan while extraction starts on each row as
soon as that thread has placed it (run/planning.py).

Each round measures, on the same dataset of chat rows (tokenized with the tiny model's tokenizer and
chat template, hsx's own reader and masks):

- **pre-pass**: the pass the old code ran before its first request: run.plan.Planner over every row as
  the reader yields it, with row digests (what ``compute_plan`` did);
- **plan ahead**: a real ``hsx extract`` (run.runner.extract) against the synthetic server
  (bench/synth_server.py) with the null S3 sink as output: seconds from the call to the first request
  in flight (progress polled every 5 ms), start-up included (tokenizer load, server health, model
  info). The run is stopped right after; the planning pass it started is not waited for.

The old first request came after start-up plus the pre-pass; the ratio reported is the pre-pass
over plan-ahead's time to first request (medians of the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import null_sink, rmtree, scratch, synth_server, tokenizer_dir, write_result
from bench.tokenize import conversations

HIDDEN = 256  # the synthetic server's dumps stay small: this measures when requests start, not bytes


def write_rows(path: Path, rows: int, turns: int, words: int) -> Path:
    import json

    with path.open("w") as f:
        for i, messages in enumerate(conversations(rows, turns, words)):
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


def pre_pass(dataset: Path, tok_dir: Path) -> tuple[float, int, int]:
    """The old pre-pass: (seconds, rows, tokens)."""
    from hsx_extractor.run.dataset import Prepared, read_samples
    from hsx_extractor.run.plan import Planner, hashed
    from hsx_extractor.run.sources import iter_rows
    from hsx_extractor.run.tokens import ChatTokenizer

    tok = ChatTokenizer(str(tok_dir))
    started = time.perf_counter()
    digests: dict[int, int] = {}
    planner = Planner({}, 3, HIDDEN, 1 << 30, digests)
    tokens = 0
    for item in read_samples(hashed(iter_rows(str(dataset), None), digests), tok, 1 << 16, "messages"):
        accepted = isinstance(item, Prepared)
        tokens += item.length if isinstance(item, Prepared) else 0
        planner.add(item.length if isinstance(item, Prepared) else None, item.sample_id if accepted else None,
                    item.line or 0)
    planner.finish()
    return time.perf_counter() - started, planner.rows, tokens


def first_request(cfg: dict[str, Any]) -> float:
    """Seconds from calling extract to its first request in flight; the run is then cancelled."""
    from hsx_extractor.config import ExtractConfig
    from hsx_extractor.run.progress import Progress
    from hsx_extractor.run.runner import extract

    config = ExtractConfig.model_validate(cfg)
    progress = Progress(config.runId, 0)

    async def go() -> float:
        started = time.perf_counter()
        task = asyncio.create_task(extract(config, progress))
        while not task.done():
            report = progress.report()
            if report.requestsInFlight > 0 or report.samplesDone > 0:
                seen = time.perf_counter() - started
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return seen
            await asyncio.sleep(0.005)
        raise RuntimeError(f"the run ended before its first request: {progress.last_error}")

    return asyncio.run(go())


def run_first_request(rows_wanted: int = 37_000, turns: int = 4, words: int = 120, rounds: int = 3,
                      argv: list[str] | None = None) -> dict[str, Any]:
    work = scratch("first")
    dumps = scratch("first-dumps", shm=True)
    try:
        tok = tokenizer_dir(work)
        dataset = write_rows(work / "chat.jsonl", rows_wanted, turns, words)
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
        passes, firsts = [], []
        rows = tokens = 0
        with synth_server(dumps, HIDDEN, 1 << 16) as synth, null_sink() as sink:
            for r in range(rounds):
                seconds, rows, tokens = pre_pass(dataset, tok)
                passes.append(seconds)
                cfg = {
                    "runId": f"first-{r}",
                    "dataset": {"uri": str(dataset), "format": "messages", "tokenizer": str(tok), "maxLength": 1 << 16},
                    "output": {"uri": "s3://bench/first", "endpoint": sink, "pathStyle": True},
                    "serverUrl": synth.url,
                    "dumpDir": str(dumps),
                    "progressPort": 0,
                    "logIntervalSeconds": 3600,
                }
                firsts.append(first_request(cfg))
                print(f"  round {r + 1}: pre-pass {seconds:.1f}s over {rows} rows; plan ahead: first request "
                      f"after {firsts[-1]:.2f}s", flush=True)
        result = {
            "what": "seconds to the first request of a fresh run: the old whole-dataset pre-pass vs planning ahead",
            "command": "python -m bench.first_request " + " ".join(argv or []),
            "rows": rows,
            "tokens": tokens,
            "tokens_per_row": round(tokens / max(rows, 1), 1),
            "rounds": rounds,
            "pre_pass_s": [round(s, 2) for s in passes],
            "plan_ahead_first_request_s": [round(s, 3) for s in firsts],
            "median_pre_pass_s": round(statistics.median(passes), 2),
            "median_first_request_s": round(statistics.median(firsts), 3),
            "pre_pass_over_first_request": round(statistics.median(passes) / statistics.median(firsts), 1),
        }
        path = write_result("first_request", result)
        print(f"pre-pass {result['median_pre_pass_s']}s vs first request after {result['median_first_request_s']}s "
              f"({result['pre_pass_over_first_request']}x); {path}", flush=True)
    finally:
        rmtree(work)
        rmtree(dumps)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=37_000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    run_first_request(args.rows, args.turns, args.words, args.rounds, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
