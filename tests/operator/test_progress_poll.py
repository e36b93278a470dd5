"""The operator's /progress poll against a real HTTP server on 127.0.0.1 that misbehaves on purpose.

Whoever runs the pod decides what its progress port answers; the operator must not follow it
elsewhere, read without bound, or wait without end.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from hsx_operator.cluster import POLL_WORKERS, PROGRESS_TIMEOUT, poll_pods, poll_progress
from hsx_operator.desired import EXTRACTOR_CONTAINER

REPORT = {"runId": "r1", "replicaIndex": 0, "state": "running", "samplesDone": 3}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        if "Content_Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        s = self.server
        s.paths.append(self.path)
        if self.path == "/secret":  # where a redirect points: must never be fetched
            self._send(200, json.dumps(REPORT).encode())
            return
        mode = s.mode
        try:
            if mode == "ok":
                self._send(200, json.dumps(REPORT).encode())
            elif mode == "redirect":
                self._send(302, b"", Location=f"http://127.0.0.1:{s.server_port}/secret")
            elif mode == "huge":
                # A valid report padded to 64 MiB, streamed: the poll must stop at its cap.
                pad = 64 << 20
                head, tail = b'{"runId": "r1", "pad": "', b'"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(head) + pad + len(tail)))
                self.end_headers()
                self.wfile.write(head)
                block = b"x" * (1 << 20)
                for _ in range(pad >> 20):
                    self.wfile.write(block)
                    s.sent += len(block)
                self.wfile.write(tail)
            elif mode == "huge_undeclared":  # no Content-Length: read until close
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(b'{"runId": "r1", "pad": "')
                for _ in range(64):
                    self.wfile.write(b"x" * (1 << 20))
                    s.sent += 1 << 20
                self.wfile.write(b'"}')
            elif mode == "trickle":
                # Headers at once, then one byte of a valid report every 0.2 s (about 12 s in all).
                body = json.dumps(REPORT).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(0.2)
            elif mode == "deep":
                self._send(200, b"[" * 200_000 + b"]" * 200_000)
            elif mode == "infinity":
                self._send(200, b'{"runId": "r1", "samplesDone": Infinity}')
            elif mode == "list":
                self._send(200, b"[1, 2, 3]")
            elif mode == "slow":  # a well-formed answer after half a second
                time.sleep(0.5)
                self._send(200, json.dumps(REPORT).encode())
            elif mode == "other_run":
                self._send(200, json.dumps({**REPORT, "runId": "r0"}).encode())
        except (BrokenPipeError, ConnectionResetError):
            s.broken = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    mode = "ok"
    sent = 0
    broken = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths: list[str] = []


@pytest.fixture
def progress_server() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _pod() -> dict[str, Any]:
    return {
        "status": {
            "podIP": "127.0.0.1",
            "containerStatuses": [{"name": EXTRACTOR_CONTAINER, "state": {"running": {}}}],
        }
    }


def _poll(server: _Server, mode: str) -> tuple[dict[str, Any] | None, float]:
    server.mode = mode
    start = time.monotonic()
    got = poll_progress(_pod(), server.server_port, "r1")
    return got, time.monotonic() - start


def test_a_well_behaved_pod_is_read(progress_server: _Server) -> None:
    got, _ = _poll(progress_server, "ok")
    assert got == REPORT


def test_a_redirect_is_not_followed(progress_server: _Server) -> None:
    got, _ = _poll(progress_server, "redirect")
    assert got is None and progress_server.paths == ["/progress"]


@pytest.mark.parametrize("mode", ["huge", "huge_undeclared"])
def test_a_huge_body_is_refused_without_reading_it(progress_server: _Server, mode: str) -> None:
    got, elapsed = _poll(progress_server, mode)
    assert got is None and elapsed < PROGRESS_TIMEOUT + 1
    time.sleep(0.2)
    # The poll read at most its cap (plus socket buffers) and hung up: the server could not send it all.
    assert progress_server.sent < 64 << 20


def test_a_trickling_answer_is_cut_at_the_deadline(progress_server: _Server) -> None:
    got, elapsed = _poll(progress_server, "trickle")
    assert got is None and elapsed < PROGRESS_TIMEOUT + 1


@pytest.mark.parametrize("mode", ["deep", "infinity", "list", "other_run"])
def test_bodies_that_are_no_report_of_this_run_are_ignored(progress_server: _Server, mode: str) -> None:
    got, elapsed = _poll(progress_server, mode)
    assert got is None and elapsed < PROGRESS_TIMEOUT + 1


def test_a_wide_runs_slow_pods_end_its_round_at_the_budget(progress_server: _Server) -> None:
    """96 pods answering in 0.5 s each need 3 s of the shared poll threads; a 1.6 s budget returns the
    reports that came (at least the first POLL_WORKERS), and the polls never started are dropped,
    not left queued in front of the next run's."""
    progress_server.mode = "slow"
    pods = [{**_pod(), "metadata": {"name": f"pod-{i}"}} for i in range(96)]
    reports = poll_pods(pods, progress_server.server_port, "r1", budget=1.6)
    assert POLL_WORKERS <= len(reports) < 96 and all(r == REPORT for r in reports.values())
    time.sleep(1.0)  # the polls running at the budget finish; none queued behind them may start
    assert len(progress_server.paths) < 96

