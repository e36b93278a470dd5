"""The extraction server's HTTP API, as hsx uses it: SGLang's /generate, /health, /get_model_info, or
vLLM's /v1/completions and /health.

Knows the wire formats and nothing else. At most ``concurrency`` requests are in flight; the
caller queues more than that so the server always has the next request waiting.

A retried POST never reuses its rid: once a request was sent, the server may have run it (and
written its dump) even if the answer was lost, and SGLang rejects a rid it has seen. The caller
supplies the next rid for each retry (``renew``) and learns which rid was finally answered.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from hsx_extractor import protocol


class ServerUnavailable(RuntimeError):
    """The server cannot be reached or keeps failing (a transient, whole-run error)."""


# Client errors that are not the request's fault (a router's timeout or rate limit): asked again, like a 5xx.
RETRIED_CLIENT_ERRORS = frozenset({408, 429})


class RequestRejected(RuntimeError):
    """The server answered this one request (sent as ``rid``) with a client error (4xx)."""

    def __init__(self, status: int, body: str, rid: str = "") -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body
        self.rid = rid


@dataclass(frozen=True)
class Answered:
    """The server's answer to /generate and the rid it answered (the last one sent)."""

    rid: str
    body: dict[str, Any]


def generate_body(input_ids: Sequence[int], rid: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One prefill, one generated token; the dump is the wanted result.

    ``return_hidden_states`` must be true: SGLang only runs the hooked result path for batches
    that ask for hidden states, and the hook then writes them to the dump instead of the response.
    ``extra``: more fields (the consistency check's logprob request).
    """
    return {
        "input_ids": [int(i) for i in input_ids],
        "rid": rid,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_hidden_states": True,
        **(extra or {}),
    }


def completions_body(input_ids: Sequence[int], rid: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM: one prefill, one generated token. vLLM rewrites request ids (``cmpl-{id}-0-{random}``),
    so the rid travels to hsx's connector in ``kv_transfer_params``; X-Request-Id carries it too, for logs."""
    if extra:  # SGLang's logprob fields: the consistency check does not speak vLLM's yet
        raise ValueError(f"vLLM requests take no extra fields ({sorted(extra)})")
    return {
        "prompt": [int(i) for i in input_ids],
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {protocol.VLLM_RID_PARAM: rid},
    }


# engine -> (path, body maker)
_REQUESTS = {"sglang": ("/generate", generate_body), "vllm": ("/v1/completions", completions_body)}


@dataclass(frozen=True)
class Sampling:
    """One turn's generation request (responses: regenerate): config.GenerationSpec for one row."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Generated:
    """What the server generated: its token ids (the end-of-turn token included when it stopped on
    one), ``finish`` stop or length, and the prompt tokens it prefilled."""

    ids: list[int]
    finish: str
    prompt_tokens: int


def sglang_generation(input_ids: Sequence[int], s: Sampling) -> dict[str, Any]:
    """No rid and no return_hidden_states: SGLang runs it as any request, hsx's hook writes no dump.
    Stop strings stay in the output (no_stop_trim) so the text re-renders to the generated ids."""
    params: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                              "skip_special_tokens": False, "no_stop_trim": True}  # fmt: skip
    if s.stop:
        params["stop"] = list(s.stop)
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    return {"input_ids": [int(i) for i in input_ids], "sampling_params": params}


def sglang_generated(body: dict[str, Any]) -> Generated:
    meta = body.get("meta_info") or {}
    finish = (meta.get("finish_reason") or {}).get("type")
    return Generated([int(i) for i in body["output_ids"]], str(finish), int(meta.get("prompt_tokens", 0)))


def vllm_generation(input_ids: Sequence[int], s: Sampling) -> dict[str, Any]:
    """No kv_transfer_params: hsx's connector writes no dump for it."""
    return {"prompt": [int(i) for i in input_ids], "max_tokens": s.max_new_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "seed": s.seed, "stop": list(s.stop), "include_stop_str_in_output": True,
            "skip_special_tokens": False, "return_token_ids": True}  # fmt: skip


def vllm_generated(body: dict[str, Any]) -> Generated:
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    return Generated([int(i) for i in choice["token_ids"]], str(choice.get("finish_reason")), int(usage.get("prompt_tokens", 0)))


# engine -> (path, body maker, answer reader) of a generation
_GENERATIONS = {"sglang": ("/generate", sglang_generation, sglang_generated),
                "vllm": ("/v1/completions", vllm_generation, vllm_generated)}  # fmt: skip


class ServerClient:
    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        concurrency: int,
        request_timeout: float = 3600.0,
        connect_retries: int = 5,
        engine: str = "sglang",
    ) -> None:
        self.engine = engine
        self._path, self._body = _REQUESTS[engine]
        self.base_url = base_url.rstrip("/")
        self.session = session
        self._slots = asyncio.Semaphore(concurrency)
        self.in_flight = 0
        self.max_in_flight = 0
        self.request_timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=30)
        self.connect_retries = connect_retries
        self.health_error: str | None = None

    async def health(self) -> bool:
        """Whether /health answers 200; if not, :attr:`health_error` says what came back instead."""
        try:
            async with self.session.get(
                f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=10)
            ) as r:
                self.health_error = None if r.status == 200 else f"HTTP {r.status}"
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.health_error = f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else type(exc).__name__
            return False

    async def wait_healthy(self, timeout: float, waiting: Callable[[str], None] = lambda _: None) -> None:
        """Wait for /health, telling ``waiting`` what is awaited and the last error on each miss."""
        deadline = time.monotonic() + timeout
        while not await self.health():
            why = f"waiting for the server at {self.base_url}/health: {self.health_error}"
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{why}; gave up after {timeout:.0f}s (serverStartTimeoutSeconds)")
            waiting(why)
            await asyncio.sleep(0.5)

    async def model_info(self) -> dict[str, Any]:
        """SGLang's /get_model_info; vLLM has none ({}: the model's config.json says it all)."""
        if self.engine == "vllm":
            return {}
        try:
            async with self.session.get(
                f"{self.base_url}/get_model_info", timeout=aiohttp.ClientTimeout(total=30)
            ) as r:
                r.raise_for_status()
                info = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ServerUnavailable(f"{self.base_url}/get_model_info failed: {exc}") from exc
        if not isinstance(info, dict):
            raise ServerUnavailable(f"{self.base_url}/get_model_info returned {type(info).__name__}")
        return info

    async def generate(
        self,
        input_ids: Sequence[int],
        rid: str,
        renew: Callable[[str], str],
        extra: Mapping[str, Any] | None = None,
    ) -> Answered:
        """POST /generate, first as ``rid``. Retries connection failures and 5xx, each retry under
        ``renew(previous rid)`` (a new rid); raises :class:`RequestRejected` on 4xx and
        :class:`ServerUnavailable` when retries run out."""
        async with self._slots:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await self._post_with_retries(input_ids, rid, renew, extra)
            finally:
                self.in_flight -= 1

    async def _post_with_retries(
        self,
        input_ids: Sequence[int],
        rid: str,
        renew: Callable[[str], str],
        extra: Mapping[str, Any] | None,
    ) -> Answered:
        rids = [rid]

        def request(attempt: int) -> tuple[dict[str, Any], str]:
            if attempt:  # a retried rid is a new one: the lost attempt's dump, if any, is never taken for it
                rids.append(renew(rids[-1]))
            return self._body(input_ids, rids[-1], extra), rids[-1]

        text = await self._post_answered(self._path, request, lambda: f"{self._path} (rids {rids[0]} .. {rids[-1]})")
        out = json.loads(text) if text else {}
        return Answered(rids[-1], out if isinstance(out, dict) else {"response": out})

    async def _post_answered(
        self, path: str, request: Callable[[int], tuple[dict[str, Any], str]], what: Callable[[], str]
    ) -> str:
        """POST ``request(attempt)`` (its body and rid) until the server answers below 500: the answer's text.
        Connection failures, 5xx, 408 and 429 are retried with backoff; another 4xx raises :class:`RequestRejected`."""
        last = ""
        for attempt in range(self.connect_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2**attempt, 10.0))
            body, rid = request(attempt)
            try:
                headers = {"X-Request-Id": rid} if rid else None
                async with self.session.post(
                    f"{self.base_url}{path}", json=body, headers=headers, timeout=self.request_timeout
                ) as r:
                    text = await r.text()
                    if r.status < 400:
                        return text
                    if r.status < 500 and r.status not in RETRIED_CLIENT_ERRORS:
                        raise RequestRejected(r.status, text, rid)
                    last = f"HTTP {r.status}: {text[:300]}"
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
        raise ServerUnavailable(f"{what()} failed {self.connect_retries + 1} times: {last}")

    async def complete(self, input_ids: Sequence[int], sampling: Sampling) -> Generated:
        """Generate a turn from ``input_ids`` (no dump is written). Retries connection failures and 5xx
        (nothing was stored yet, so a lost answer is only asked again); :class:`RequestRejected` on 4xx."""
        path, body_of, read = _GENERATIONS[self.engine]
        async with self._slots:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                text = await self._post_answered(path, lambda _: (body_of(input_ids, sampling), ""),
                                                 lambda: f"{path} (generation)")  # fmt: skip
            finally:
                self.in_flight -= 1
        try:
            return read(json.loads(text))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ServerUnavailable(f"{path} answered a generation without its token ids ({exc}): {text[:300]}") from exc
