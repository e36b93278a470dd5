"""CPU reference server: the subset of SGLang's HTTP API hsx uses, over a transformers causal LM.

* ``POST /generate`` with ``input_ids`` and ``rid`` (duplicate rids are rejected, as SGLang does):
  runs one prefill on exactly those ids (nothing added) and, before answering, writes the rid's
  dump with :func:`protocol.write_dump`.
* ``POST /generate`` with ``input_ids``, ``sampling_params`` and neither rid nor return_hidden_states
  (responses: regenerate): generates up to ``max_new_tokens`` (``temperature``, ``top_p``,
  ``sampling_seed`` honoured; stop strings are not), stopping on the model's end tokens; no dump.
* ``GET /health``, ``GET /get_model_info`` (model path, vocab size, hidden size, layers, capture
  layers, architecture).

Layer convention (the same as SGLang's EAGLE-3 capture, see hsx_extractor.model): capture layer ``j`` is
the *input* of decoder layer ``j``, which is Hugging Face's ``hidden_states[j]`` (0 = embedding
output). The final state is ``hidden_states[-1]``, which HF returns after the final norm.

Test hooks (clearly not part of the SGLang API; the faults are reference_faults'): ``--fault``
makes the server misbehave on purpose, ``--delay-ms`` slows each request, ``GET /hsx_test/stats``
reports requests in flight as the server saw them, and with ``--enable-test-hooks``
``POST /hsx_test/fault`` changes the fault and delay at runtime (and resets the stats).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from hsx_extractor import protocol
from hsx_extractor.model import capture_layers
from hsx_extractor.protocol import DumpMeta, ProtocolError
from hsx_extractor.tools.reference_faults import (
    ANSWER_FAULTS,
    CAPTURE_FAULTS,
    GENERATION_FAULTS,
    FaultPlan,
    Stats,
)

PRODUCER = "hsx-reference"


# ---- the model -----------------------------------------------------------------------------------
class ReferenceModel:
    """A causal LM on CPU and the layers it captures."""

    def __init__(self, model_dir: str | os.PathLike[str], aux_layer_ids: Sequence[int] | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.model_dir = str(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        text_config = getattr(config, "text_config", None) or config
        self.architecture = (config.architectures or [type(config).__name__])[0]
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.bos_token_id = getattr(text_config, "bos_token_id", None)
        self.capture_layers = capture_layers(self.architecture, self.num_layers, aux_layer_ids)
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        ends = [getattr(text_config, "eos_token_id", None), self.model.generation_config.eos_token_id]
        self.end_ids = {int(i) for e in ends if e is not None for i in ([e] if isinstance(e, int) else e)}
        self.noise: np.random.Generator | None = None  # set by --noise-seed (a test hook)
        self._noise_lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "is_generation": True,
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "capture_layers": list(self.capture_layers),
            "producer": PRODUCER,
        }

    def forward(self, input_ids: Sequence[int], capture_fault: str | None = None) -> Forward:
        """One prompt's capture (``capture_fault``: one of CAPTURE_FAULTS, spoiling the final state)."""
        torch = self._torch
        norm = self.model.get_decoder().norm
        seen: list[Any] = []
        handle = norm.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
        try:
            with torch.inference_mode():
                out = self.model(torch.tensor([list(input_ids)], dtype=torch.long), output_hidden_states=True)
                states = out.hidden_states
                final = states[-1][0]
                if capture_fault == "prenorm":
                    final = seen[-1][0]
                elif capture_fault == "wrong_layer":
                    final = norm(states[-2])[0]
                elif capture_fault == "partial_sum":
                    final = norm(states[-2] + 0.5 * (seen[-1] - states[-2]))[0]
                logprobs = torch.log_softmax(out.logits[0].float(), dim=-1).numpy()
        finally:
            handle.remove()
        aux = torch.cat([states[j][0] for j in self.capture_layers], dim=-1)
        captured = (_bf16_bits(aux), _bf16_bits(final))
        if self.noise is not None:  # TEST HOOK: a GPU's run-to-run differences, one bf16 ULP here and there
            with self._noise_lock:
                for bits in captured:
                    bits ^= self.noise.integers(0, 2, size=bits.shape, dtype=np.uint16)
        return Forward(*captured, int(out.logits[0, -1].argmax()), logprobs)


    def generate(self, ids: Sequence[int], sampling: dict[str, Any]) -> tuple[list[int], str]:
        """Up to max_new_tokens after ``ids`` (the end token it stops on included) and why it stopped."""
        torch = self._torch
        temperature, top_p = float(sampling.get("temperature", 1.0)), float(sampling.get("top_p", 1.0))
        seed = sampling.get("sampling_seed")
        draw = torch.Generator().manual_seed(int(seed) if seed is not None else int.from_bytes(os.urandom(7), "big"))
        out: list[int] = []
        past, step = None, torch.tensor([list(ids)], dtype=torch.long)
        with torch.inference_mode():
            for _ in range(int(sampling.get("max_new_tokens", 128))):
                res = self.model(step, past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[0, -1].float()
                if temperature == 0:
                    token = int(logits.argmax())
                else:
                    probs, order = torch.softmax(logits / temperature, -1).sort(descending=True)
                    probs[(probs.cumsum(0) - probs) > top_p] = 0.0
                    token = int(order[torch.multinomial(probs, 1, generator=draw)])
                out.append(token)
                if token in self.end_ids:
                    return out, "stop"
                step = torch.tensor([[token]], dtype=torch.long)
        return out, "length"


@dataclass(frozen=True)
class Forward:
    aux: np.ndarray  # bf16 bits [L, K*H]
    final: np.ndarray  # bf16 bits [L, H]
    next_token: int
    logprobs: np.ndarray  # float32 [L, vocab]: row p is the distribution of token p + 1


def input_top_logprobs(logprobs: np.ndarray, start: int, k: int) -> list[list[list[Any]] | None]:
    """SGLang's ``meta_info.input_top_logprobs`` (pure): one entry per prompt token from ``start``,
    entry j the top-k of token start + j as ``[logprob, id, null]`` from the state before it, entry
    0 null (SGLang gives no logprob for the first token asked for)."""
    out: list[list[list[Any]] | None] = [None]
    for p in range(start, logprobs.shape[0] - 1):
        row = logprobs[p]
        top = np.argsort(-row, kind="stable")[:k]
        out.append([[float(row[t]), int(t), None] for t in top])
    return out


def _bf16_bits(t: Any) -> np.ndarray:
    import torch

    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


# ---- serving -------------------------------------------------------------------------------------
class ReferenceServer:
    def __init__(
        self,
        model: ReferenceModel,
        dump_dir: str | os.PathLike[str],
        fault: FaultPlan | None = None,
        delay_s: float = 0.0,
        test_hooks: bool = False,
        delay_per_token_s: float = 0.0,
    ) -> None:
        self.model = model
        self.delay_per_token_s = delay_per_token_s
        self.dump_dir = protocol.make_dump_dir(dump_dir)
        self.fault = fault or FaultPlan()
        self._aborted: set[tuple[int, ...]] = set()  # prompts the abort fault answered
        self.delay_s = delay_s
        self.test_hooks = test_hooks
        self.stats = Stats()
        self._in_flight = 0
        self._seen: set[str] = set()
        self._previous: tuple[DumpMeta, np.ndarray, np.ndarray, np.ndarray] | None = None
        # One worker: torch parallelises each forward itself; requests queue here, not in the loop.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/hsx_test/stats", self.get_stats)
        if self.test_hooks:
            app.router.add_post("/hsx_test/fault", self.set_fault)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, _: web.Application) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.model.info())

    async def get_stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.stats.to_json())

    async def set_fault(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            self.fault = FaultPlan(
                body.get("kind"), int(body.get("every", 1)), bool(body.get("firstAttemptOnly"))
            )
            self.delay_s = float(body.get("delayMs", 0)) / 1000.0
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        self.stats = Stats(in_flight=self._in_flight)
        self._aborted = set()
        return web.json_response({"kind": self.fault.kind, "every": self.fault.every, "delayS": self.delay_s})

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON")
        if isinstance(body, dict) and "rid" not in body and "return_hidden_states" not in body:
            return await self._generation(body)
        parsed = self._parse(body)
        if isinstance(parsed, web.Response):
            return parsed
        rid, ids, logprob_ask = parsed
        self._seen.add(rid)
        self.stats.requests += 1
        arrival = self.stats.requests
        if self.fault.kind == "rate_limit" and self.fault.applies(rid, arrival):
            self.stats.faulted.append(rid)
            return _error(429, "rate limited (test fault)")
        # Counted on the server, not per stats epoch: a reset must not forget requests still running.
        self._in_flight += 1
        self.stats.in_flight = self._in_flight
        self.stats.max_in_flight = max(self.stats.max_in_flight, self._in_flight)
        try:
            if self.delay_s or self.delay_per_token_s:
                await asyncio.sleep(self.delay_s + self.delay_per_token_s * len(ids))
            loop = asyncio.get_running_loop()
            ran, kind = await loop.run_in_executor(self._worker, self._serve_one, rid, ids, arrival)
        finally:
            self._in_flight -= 1
            self.stats.in_flight = self._in_flight
        if kind == "drop_response" and request.transport is not None:
            request.transport.abort()  # the dump is there; the answer never arrives
            raise web.HTTPInternalServerError()  # not sent: the connection is gone
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": len(ids),
            "completion_tokens": 1,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 1},
        }
        if logprob_ask is not None:
            start, k = logprob_ask
            meta["input_top_logprobs"] = input_top_logprobs(ran.logprobs, start, k) if k else None
        return web.json_response({"text": "", "output_ids": [ran.next_token], "meta_info": meta})

    async def _generation(self, body: dict[str, Any]) -> web.Response:
        """A request that is no capture: generate text (SGLang's answer, output_ids and finish reason)."""
        ids, sampling = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < self.model.vocab_size
                                                           for i in ids):  # fmt: skip
            return _error(400, f"input_ids must be a non-empty list of ids in [0, {self.model.vocab_size})")
        self.stats.generations += 1
        asked_again = self.fault.first_attempt_only and tuple(ids) in self._aborted
        chosen = zlib.crc32(json.dumps(ids).encode()) % self.fault.every == 0
        if self.fault.kind == "abort" and chosen and not asked_again:
            self._aborted.add(tuple(ids))
            self.stats.faulted.append(f"generation-{zlib.crc32(json.dumps(ids).encode()):08x}")
            meta = {"prompt_tokens": len(ids), "completion_tokens": 0,
                    "finish_reason": {"type": "abort", "message": "aborted (test fault)"}}  # fmt: skip
            return web.json_response({"text": "", "output_ids": [], "meta_info": meta})
        loop = asyncio.get_running_loop()
        out, finish = await loop.run_in_executor(self._worker, self.model.generate, ids, sampling)
        reason = {"type": "stop", "matched": out[-1]} if finish == "stop" else {"type": "length", "length": len(out)}
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "finish_reason": reason}
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    def _parse(self, body: Any) -> tuple[str, list[int], tuple[int, int] | None] | web.Response:
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        if "input_ids" not in body:
            return _error(400, "this server takes input_ids only (hsx never sends text)")
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return _error(400, "input_ids must be a non-empty list of integers")
        if any(not 0 <= i < self.model.vocab_size for i in ids):
            return _error(400, f"input_ids outside [0, {self.model.vocab_size})")
        rid = body.get("rid")
        if not isinstance(rid, str):
            return _error(400, "rid must be a string (hsx always sends one)")
        try:
            protocol.validate_rid(rid)
        except ProtocolError as exc:
            return _error(400, str(exc))
        if rid in self._seen:
            return _error(400, f"Duplicate request ID {rid}")
        # Patched SGLang only dumps requests that ask for hidden states; fail fast instead of a silent no-dump.
        if body.get("return_hidden_states") is not True:
            return _error(
                400, "return_hidden_states must be true: SGLang writes no dump for this request otherwise"
            )
        logprobs = _logprob_ask(body, len(ids))
        if isinstance(logprobs, web.Response):
            return logprobs
        return rid, ids, logprobs

    def _serve_one(self, rid: str, ids: list[int], arrival: int) -> tuple[Forward, str | None]:
        faulted = self.fault.kind not in GENERATION_FAULTS + ANSWER_FAULTS and self.fault.applies(rid, arrival)
        kind = self.fault.kind if faulted else None
        if faulted:
            self.stats.faulted.append(rid)
        ran = ids
        if kind == "add_bos":
            ran = [self.model.bos_token_id or 0, *ids]
        result = self.model.forward(ran, kind if kind in CAPTURE_FAULTS else None)
        aux, final = result.aux, result.final
        meta = DumpMeta(rid, len(ran), self.model.hidden_size, tuple(self.model.capture_layers), PRODUCER)
        ran_ids = np.asarray(ran, dtype=np.int32)
        current = (meta, ran_ids, aux, final)
        if kind == "drop":
            pass
        elif kind == "error":
            protocol.write_error(self.dump_dir, rid, "test_fault", "deliberate error marker (test hook)")
        elif kind == "swap":
            previous = self._previous
            # Swapping with an identical prompt would be no fault at all: then use reversed ids.
            differs = previous is not None and previous[1].tolist() != ran
            other = previous if previous is not None and differs else self._reversed(rid, ids)
            o_meta, o_ids, o_aux, o_final = other
            # Named for this rid, holding the other request's bytes: what a misrouted dump looks like.
            protocol.write_dump(self.dump_dir, DumpMeta(rid, *_meta_tail(o_meta)), o_ids, o_aux, o_final)
        elif kind == "truncate":
            protocol.write_dump(self.dump_dir, meta, ran_ids, aux[:-1].copy(), final[:-1].copy())
        elif kind == "nan":
            spoiled = final.copy()
            spoiled[len(spoiled) // 2, 0] = 0x7FC0  # bf16 quiet NaN
            protocol.write_dump(self.dump_dir, meta, ran_ids, aux, spoiled)
        else:
            protocol.write_dump(self.dump_dir, meta, ran_ids, aux, final)
        self._previous = current
        return result, kind

    def _reversed(self, rid: str, ids: list[int]) -> tuple[DumpMeta, np.ndarray, np.ndarray, np.ndarray]:
        # The first request has no predecessor to swap with: use the dump of its ids reversed.
        other = list(reversed(ids))
        ran = self.model.forward(other)
        aux, final = ran.aux, ran.final
        meta = DumpMeta(rid, len(other), self.model.hidden_size, tuple(self.model.capture_layers), PRODUCER)
        return meta, np.asarray(other, dtype=np.int32), aux, final


def _meta_tail(meta: DumpMeta) -> tuple[int, int, tuple[int, ...], str]:
    return meta.seq_len, meta.hidden_size, meta.capture_layers, meta.producer


def _logprob_ask(body: dict[str, Any], length: int) -> tuple[int, int] | web.Response | None:
    """SGLang's input-logprob request fields: ``(start, top k)`` or None (not asked)."""
    if not body.get("return_logprob"):
        return None
    start, k = body.get("logprob_start_len", -1), body.get("top_logprobs_num", 0)
    if not isinstance(start, int) or not isinstance(k, int) or k < 0 or start < -1:
        return _error(400, "logprob_start_len and top_logprobs_num must be integers (>= -1, >= 0)")
    if start > length:
        return _error(400, f"logprob_start_len={start} is higher than the number of input tokens {length}")
    return (length if start == -1 else start), k


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def serve(server: ReferenceServer, host: str, port: int) -> None:
    """Run until cancelled; prints one flushed line with the bound address once listening."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    server_obj = getattr(site, "_server", None)
    if server_obj is not None and server_obj.sockets:
        bound = server_obj.sockets[0].getsockname()[1]
    print(f"hsx reference server listening on http://{host}:{bound}", flush=True)
    print(json.dumps({"listening": f"http://{host}:{bound}", **server.model.info()}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run(
    model_dir: str,
    dump_dir: str,
    host: str,
    port: int,
    aux_layer_ids: Sequence[int] | None,
    fault: FaultPlan,
    delay_s: float,
    test_hooks: bool,
    threads: int | None,
    noise_seed: int | None = None,
    delay_per_token_s: float = 0.0,
) -> int:
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = ReferenceModel(model_dir, aux_layer_ids)
    if noise_seed is not None:
        model.noise = np.random.default_rng(noise_seed)
    server = ReferenceServer(model, dump_dir, fault, delay_s, test_hooks, delay_per_token_s)
    try:
        asyncio.run(serve(server, host, port))
    except KeyboardInterrupt:
        pass
    print("hsx reference server stopped", file=sys.stderr, flush=True)
    return 0
