"""``hsx extract`` around one :class:`pipeline.Extraction`: the progress server, the log line,
signals, and the mapping of every failure to an exit code."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT, EXIT_TRANSIENT
from hsx_extractor.run.extraction import Extraction, RunResult
from hsx_extractor.run.failures import describe_failure, failure_reason
from hsx_extractor.run.progress import Progress, report_loop, start_progress_server


async def extract(cfg: ExtractConfig, progress: Progress | None = None) -> tuple[int, RunResult | None]:
    """Run one extraction with its progress server and log; returns ``(exit code, result)``."""
    run = Extraction(cfg, progress)
    progress = run.progress
    runner = None
    if cfg.progressPort:
        try:
            runner = await start_progress_server(progress, cfg.progressHost, cfg.progressPort)
        except OSError as exc:
            print(
                f"hsx extract: error: cannot serve progress on {cfg.progressHost}:{cfg.progressPort} "
                f"({exc.strerror or exc}): choose another progressPort (0: none)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_PERMANENT, None
        print(f"hsx: progress on http://{cfg.progressHost}:{cfg.progressPort}/progress", flush=True)
    reporter = asyncio.create_task(report_loop(progress, cfg.logIntervalSeconds))
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        # Eviction sends SIGTERM: stop cleanly and report a retryable failure.
        loop.add_signal_handler(signal.SIGTERM, lambda: main.cancel() if main else None)
    try:
        result = await run.run()
        code = EXIT_OK
    except asyncio.CancelledError:
        progress.fail("stopped by SIGTERM")
        result, code = None, EXIT_TRANSIENT
    except Exception as exc:
        message, code = describe_failure(exc)
        progress.fail(message, failure_reason(exc))
        result = None
        print(f"hsx extract: error: {message}", file=sys.stderr, flush=True)
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter  # a terminal's bar draws its last state and closes before the lines below
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGTERM)
        print(progress.log_line(), file=sys.stderr, flush=True)
        if runner is not None:
            await runner.cleanup()
        if cfg.terminationMessagePath:
            write_termination_message(cfg.terminationMessagePath, progress.termination_message())
    if result is not None:
        state = "manifest written" if result.manifest else "other replicas' shards pending; no manifest yet"
        print(f"hsx extract: done: {result.output} ({state}); this process committed shards {result.shards_done}",
              flush=True)  # fmt: skip
        print(f"hsx extract: samples {progress.quarantine_summary()}", flush=True)
    return code, result


def write_termination_message(path: str, text: str) -> None:
    """Best effort: a missing or read-only path must not turn a finished run into a failure."""
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        print(f"hsx extract: warning: cannot write termination message to {path}: {exc}", file=sys.stderr)


def run_extract(cfg: ExtractConfig) -> int:
    if cfg.workers > 1 and cfg.workerIndex is None:
        from hsx_extractor.run.workers import run_workers

        return run_workers(cfg)
    code, _ = asyncio.run(extract(cfg))
    return code
