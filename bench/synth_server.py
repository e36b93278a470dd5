"""A synthetic extraction server speaking hsx's subset of SGLang's API, for benchmarks.

    python -m bench.synth_server --dump-dir DIR --hidden 4096 [--capacity TOKENS_PER_S]

No model: ``POST /generate`` writes a dump of the right shape for exactly the rid sent (the sent
ids, activation-like bf16 rows sliced from a pool made once at start) with
:func:`protocol.write_dump`, then answers. With ``--capacity`` it behaves like a GPU with a
fixed token throughput: it batches whatever is in flight, spends ``tokens / capacity`` seconds
(plus a fixed per-batch overhead) per batch, and only then writes the batch's dumps.
``GET /bench/stats`` reports how busy it was, for B2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from hsx_extractor import protocol
from hsx_extractor.protocol import DumpMeta

PRODUCER = "hsx-bench-synth"
LISTENING = "synth server listening on "


def bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def activation_pool(seed: int, rows: int, cols: int) -> np.ndarray:
    """Residual-stream-like bf16 bits: per-channel scales, outlier channels, per-token scale."""
    rng = np.random.default_rng(seed)
    channel = rng.lognormal(0.0, 0.6, cols).astype(np.float32)
    channel[rng.choice(cols, size=max(1, cols // 128), replace=False)] *= 40.0
    out = np.empty((rows, cols), dtype=np.uint16)
    step = max(1, (16 << 20) // (4 * cols))  # bounded float32 temporaries
    for start in range(0, rows, step):
        n = min(step, rows - start)
        token = rng.lognormal(0.0, 0.3, (n, 1)).astype(np.float32)
        out[start : start + n] = bf16_bits(rng.standard_normal((n, cols), dtype=np.float32) * channel * token)
    return out


@dataclass
class BusyStats:
    """How the simulated accelerator spent its time (monotonic seconds)."""

    busy_s: float = 0.0
    batches: int = 0
    tokens: int = 0
    requests: int = 0
    max_batch_requests: int = 0
    first_arrival: float | None = None
    last_done: float | None = None
    in_flight: int = 0
    max_in_flight: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        window = (self.last_done - self.first_arrival) if self.first_arrival and self.last_done else 0.0
        return {
            "busySeconds": self.busy_s,
            "windowSeconds": window,
            "utilization": self.busy_s / window if window > 0 else None,
            "batches": self.batches,
            "tokens": self.tokens,
            "requests": self.requests,
            "maxBatchRequests": self.max_batch_requests,
            "meanBatchRequests": (sum(self.batch_sizes) / len(self.batch_sizes)) if self.batch_sizes else 0,
            "maxInFlight": self.max_in_flight,
            "cpuSeconds": time.process_time(),
        }


class SynthServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dump_dir = Path(args.dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.hidden = args.hidden
        self.layers = tuple(args.capture_layers)
        self.vocab = args.vocab
        self.capacity = args.capacity
        self.overhead_s = args.batch_overhead_ms / 1000.0
        k = len(self.layers)
        self.aux_pool = activation_pool(args.seed, args.pool_rows, k * self.hidden)
        self.final_pool = activation_pool(args.seed + 1, args.pool_rows, self.hidden)
        self.writers = ThreadPoolExecutor(max_workers=args.writers, thread_name_prefix="dump")
        self.stats = BusyStats()
        self._queue: list[tuple[str, np.ndarray, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/bench/stats", self.get_stats)
        app.router.add_post("/bench/reset", self.reset)
        if self.capacity:
            app.on_startup.append(self._start_scheduler)
        return app

    async def _start_scheduler(self, _: web.Application) -> None:
        asyncio.get_running_loop().create_task(self._schedule())

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": "synthetic",
            "architecture": "LlamaForCausalLM",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": max(self.layers) + 2,
            "capture_layers": list(self.layers),
            "producer": PRODUCER,
        })

    async def get_stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.stats.to_json())

    async def reset(self, _: web.Request) -> web.Response:
        self.stats = BusyStats()
        return web.json_response({})

    def _write(self, rid: str, ids: np.ndarray) -> None:
        n = int(ids.shape[0])
        pool_rows = self.aux_pool.shape[0]
        if n > pool_rows:
            raise ValueError(f"{n} tokens > pool of {pool_rows} rows; start with a larger --pool-rows")
        off = zlib.crc32(rid.encode()) % (pool_rows - n + 1)
        meta = DumpMeta(rid, n, self.hidden, self.layers, PRODUCER)
        protocol.write_dump(self.dump_dir, meta, ids, self.aux_pool[off : off + n], self.final_pool[off : off + n])

    async def generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        rid, ids = body["rid"], np.asarray(body["input_ids"], dtype=np.int32)
        st = self.stats
        st.requests += 1
        st.first_arrival = st.first_arrival or time.monotonic()
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            if self.capacity:
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._queue.append((rid, ids, done))
                self._wake.set()
                await done
            else:
                await asyncio.get_running_loop().run_in_executor(self.writers, self._write, rid, ids)
        finally:
            st.in_flight -= 1
            st.last_done = time.monotonic()
        return web.json_response({"text": "", "output_ids": [0], "meta_info": {"id": rid, "prompt_tokens": len(ids)}})

    async def _schedule(self) -> None:
        """One batch at a time, of everything waiting: continuous batching at its simplest."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue, []
                tokens = sum(int(ids.shape[0]) for _, ids, _ in batch)
                seconds = self.overhead_s + tokens / self.capacity
                started = time.monotonic()
                await asyncio.sleep(seconds)
                st = self.stats
                st.busy_s += time.monotonic() - started
                st.batches += 1
                st.tokens += tokens
                st.batch_sizes.append(len(batch))
                st.max_batch_requests = max(st.max_batch_requests, len(batch))
                # Dumps are written off the batch loop (the hook's background writer does the same).
                for rid, ids, done in batch:
                    fut = loop.run_in_executor(self.writers, self._write, rid, ids)
                    fut.add_done_callback(lambda f, d=done: d.set_exception(f.exception()) if f.exception()
                                          else d.set_result(None))


async def serve(server: SynthServer, host: str, port: int) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"{LISTENING}http://{host}:{bound}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--capture-layers", type=int, nargs="+", default=[2, 16, 29])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--pool-rows", type=int, default=2048, help="rows of random states (longest sample)")
    p.add_argument("--capacity", type=float, default=0.0, help="tokens/s of the simulated accelerator (0: none)")
    p.add_argument("--batch-overhead-ms", type=float, default=2.0, help="fixed cost of each batch")
    p.add_argument("--writers", type=int, default=4, help="dump writer threads")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    try:
        asyncio.run(serve(SynthServer(args), args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
