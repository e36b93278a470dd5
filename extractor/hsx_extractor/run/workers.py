"""``hsx extract`` with ``workers > 1``: a supervisor that runs that many extractor processes in this pod.

Each worker is its own interpreter (one is capped near 4 GB/s of hidden states by its GIL:
bench/gil.py) and its own lease-taker (run/leases.py), with its own slot in the request ids
(protocol.RunKey's worker), a share of the dump directory's budget and its own progress server on
127.0.0.1. The supervisor forwards their log lines (``[w1] ...``), serves their progress as one on the
configured port (contract.merge_reports), writes the merged final report as the termination message,
and decides the exit code: 0 when all end 0; a worker that fails transiently is started again (its
leases are its slot's, so the new process takes them over at once) up to WORKER_RESTARTS times; a
permanent failure, or a worker out of restarts, stops the others and is the pod's exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT, EXIT_TRANSIENT, ProgressReport, merge_reports

WORKER_RESTARTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_config(cfg: ExtractConfig, index: int, port: int, final: Path) -> ExtractConfig:
    """Worker ``index``'s config: one process, its own slot and progress port, its share of dumpDir, its
    final report in ``final``."""
    return cfg.model_copy(update={
        "workers": 1, "workerIndex": index, "progressPort": port, "progressHost": "127.0.0.1",
        "terminationMessagePath": str(final), "dumpDirMaxBytes": max(cfg.dumpDirMaxBytes // cfg.workers, 1 << 20),
    })  # fmt: skip


@dataclass
class Worker:
    index: int
    config: Path
    port: int
    final: Path
    proc: asyncio.subprocess.Process | None = None
    last: ProgressReport = field(default_factory=ProgressReport)
    restarts: int = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hsx_extractor.tools.cli", "extract", "--config", str(self.config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip

    async def forward(self) -> int:
        """Print its lines with its index until it exits; its exit code."""
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            sys.stdout.write(f"[w{self.index}] {line.decode(errors='replace')}")
            sys.stdout.flush()
        code = await self.proc.wait()
        with contextlib.suppress(OSError, ValueError):
            self.last = ProgressReport.model_validate_json(self.final.read_text())
        return code

    async def poll(self, session: aiohttp.ClientSession) -> ProgressReport:
        """Its progress now, or the last one it served (starting, restarting, gone)."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(f"http://127.0.0.1:{self.port}/progress") as r:
                self.last = ProgressReport.model_validate(await r.json())
        return self.last


def sum_metrics(texts: list[str]) -> str:
    """Prometheus texts of several workers as one: samples of the same name and labels summed (counters,
    gauges such as requests in flight, histogram buckets alike)."""
    families: dict[str, tuple[str, str]] = {}
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue
            families.setdefault(family.name, (family.type, family.documentation))
            for sample in family.samples:
                if not sample.name.endswith("_created"):  # a start time: no sum means anything
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    sums[key] = sums.get(key, 0.0) + sample.value
    lines = []
    for name, (kind, doc) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for (sample_name, labels), value in sums.items():
            if sample_name == name or sample_name.startswith(name + "_"):
                shown = ",".join(f'{k}="{v}"' for k, v in labels)
                lines.append(f"{sample_name}{{{shown}}} {value}" if shown else f"{sample_name} {value}")
    return "\n".join(lines) + "\n"


class Supervisor:
    def __init__(self, cfg: ExtractConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workers = []
        for index in range(cfg.workers):
            port = free_port()
            path, final = workdir / f"worker-{index}.json", workdir / f"worker-{index}.final.json"
            path.write_text(worker_config(cfg, index, port, final).model_dump_json())
            self.workers.append(Worker(index, path, port, final))
        self.stopping = False

    async def merged(self, session: aiohttp.ClientSession) -> ProgressReport:
        return merge_reports(list(await asyncio.gather(*(w.poll(session) for w in self.workers))))

    def stop_all(self) -> None:
        self.stopping = True
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)  # each releases its leases and exits

    async def run_worker(self, w: Worker) -> int:
        while True:
            await w.start()
            code = await w.forward()
            if code in (EXIT_OK, EXIT_PERMANENT) or self.stopping or w.restarts >= WORKER_RESTARTS:
                if code != EXIT_OK:
                    self.stop_all()
                return code
            w.restarts += 1
            print(f"hsx extract: worker {w.index} exited {code}; starting it again ({w.restarts}/{WORKER_RESTARTS})",
                  flush=True)  # fmt: skip

    async def run(self) -> int:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            site = await self.serve(session) if self.cfg.progressPort else None
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGTERM, self.stop_all)
            print(f"hsx extract: {len(self.workers)} workers", flush=True)
            codes = await asyncio.gather(*(self.run_worker(w) for w in self.workers))
            final = merge_reports([w.last for w in self.workers])
            if site is not None:
                await site.cleanup()
        code = next((c for c in codes if c == EXIT_PERMANENT), next((c for c in codes if c != EXIT_OK), EXIT_OK))
        if self.stopping and code == EXIT_OK:
            code = EXIT_TRANSIENT
        if self.cfg.terminationMessagePath:
            with contextlib.suppress(OSError):
                Path(self.cfg.terminationMessagePath).write_text(final.termination_message())
        print(f"hsx extract: workers done, exit codes {codes}; {json.dumps(final.model_dump(include={'samplesDone', 'samplesTotal', 'state'}))}",
              flush=True)  # fmt: skip
        return code

    async def serve(self, session: aiohttp.ClientSession) -> web.AppRunner:
        async def get_progress(_: web.Request) -> web.Response:
            return web.json_response((await self.merged(session)).model_dump())

        async def get_metrics(_: web.Request) -> web.Response:
            async def one(w: Worker) -> str:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"http://127.0.0.1:{w.port}/metrics") as r:
                        return await r.text()
                return ""

            texts = await asyncio.gather(*(one(w) for w in self.workers))
            return web.Response(text=sum_metrics(list(texts)), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/progress", get_progress)
        app.router.add_get("/metrics", get_metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.cfg.progressHost, self.cfg.progressPort).start()
        return runner


def run_workers(cfg: ExtractConfig) -> int:
    with tempfile.TemporaryDirectory(prefix="hsx-workers-") as workdir:
        return asyncio.run(Supervisor(cfg, Path(workdir)).run())
