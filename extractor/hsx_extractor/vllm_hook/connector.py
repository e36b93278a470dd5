"""hsx's KV connector for vLLM 0.32: writes one hsx dump (protocol.py) per request hsx sent.

vLLM loads it by module path (``--kv-transfer-config``, see :mod:`.launch`). With the
``extract_hidden_states`` speculative method, vLLM's model runner stores, for every prompt token,
the hidden states of the layer ids in the draft config into a cache-only "attention" layer whose KV
cache is ``[blocks, K+1, block_size, H]``. When a request finishes, the scheduler keeps its blocks
(``request_finished`` returns True) until this connector, on the worker, has copied its rows out;
it then writes ``{rid}.safetensors`` through :func:`hsx_extractor.protocol.write_dump`.

The rid is the one hsx sent in the body's ``kv_transfer_params`` (:data:`RID_PARAM`): vLLM
rewrites request ids (``cmpl-{id}-{index}-{8 random chars}``), so the engine's id is never used.
A request without it (a plain completion) gets no dump.

The last layer id :mod:`.launch` passes is the model's layer count: vLLM's state after the last
decoder layer, before the final norm. It becomes the dump's ``hidden_states`` and the meta says
``final_state: pre-norm`` (SGLang's hook stores it after the norm): docs/vllm.md says why the norm
is not applied here.

Two copy paths, chosen by the cache's device: on CPU the rows are copied synchronously; on CUDA
they are copied on a side stream into pinned memory and the blocks are released once that copy's
event completes. In both the file is written by a thread pool, never on the engine's step.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from hsx_extractor import protocol
from hsx_extractor.model import capture_layers_from_vllm_ids
from hsx_extractor.vllm_hook.launch import FINAL_STATE, PRODUCER, RID_PARAM

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("hsx.vllm_connector")


@dataclass
class Save:
    """One finished request whose rows the worker copies out and writes (scheduler -> worker)."""

    req_id: str  # vLLM's internal id: what get_finished reports back
    rid: str  # hsx's
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


def _rid_of(request: Request) -> str | None:
    params = request.kv_transfer_params or {}
    rid = params.get(RID_PARAM)
    return None if rid is None else protocol.validate_rid(str(rid))


def rows_of(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """A request's ``[T, K+1, H]`` rows out of the hidden-state cache ``[blocks, K+1, block_size, H]``."""
    blocks = cache[torch.tensor(block_ids, dtype=torch.long, device=cache.device)]
    return blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:num_tokens]


class HsxDumpConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        dump_dir = os.environ.get(protocol.DUMP_DIR_ENV)
        if not dump_dir:
            raise RuntimeError(
                f"{protocol.DUMP_DIR_ENV} is not set: the connector has nowhere to write dumps"
            )
        self.dump_dir = protocol.make_dump_dir(dump_dir)
        spec = vllm_config.speculative_config
        if spec is None or spec.draft_model_config is None:
            raise RuntimeError(
                "HsxDumpConnector needs --speculative-config with method extract_hidden_states"
            )
        ids = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", []) or [])
        text = vllm_config.model_config.hf_text_config
        self.capture_layers = tuple(capture_layers_from_vllm_ids(ids, int(text.num_hidden_layers)))
        self.hidden_size = int(text.hidden_size)
        self.architecture = str((vllm_config.model_config.architectures or [""])[0])
        self._group = self._hidden_state_group(kv_cache_config)
        # Scheduler side: finished requests waiting for the next build_connector_meta.
        self._finished: list[Save] = []
        # Worker side.
        self._cache: torch.Tensor | None = None
        self._writes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hsx-dump")
        self._copies: dict[str, Any] = {}  # req_id -> CUDA event of its copy (None once done on CPU)
        self._writer_rank = True

    @staticmethod
    def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
        """The KV cache group holding the hidden states (the model's own attention has the others)."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if not found and len(groups) == 1:
            return 0  # one group in all (the worker's view while the cache is being set up)
        if len(found) != 1:
            raise RuntimeError(f"expected one hidden-state KV cache group among {len(groups)}, found {found}")
        return found[0]

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # one token's K+1 states contiguous, as rows_of reads them

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 writes, so one notice per request

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # store-only

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HsxConnectorMetadata(saves=self._finished)
        self._finished = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        try:
            rid = _rid_of(request)
        except protocol.ProtocolError as exc:
            log.warning("request %s: %s; no dump", request.request_id, exc)
            return False, None
        if rid is None:
            return False, None
        prompt = list(request.prompt_token_ids or [])
        if request.status == RequestStatus.FINISHED_ABORTED or request.num_computed_tokens < len(prompt):
            # The prompt did not run to the end: its cache rows are incomplete.
            protocol.write_error(self.dump_dir, rid, "aborted",
                                 f"vLLM finished the request as {request.status.name} after "
                                 f"{request.num_computed_tokens} of {len(prompt)} prompt tokens")  # fmt: skip
            return False, {RID_PARAM: rid}
        self._finished.append(Save(request.request_id, rid, prompt, list(block_ids)))
        return True, {RID_PARAM: rid}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None  # never scheduled: no blocks
        return self.request_finished(request, block_ids[self._group])

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writer_rank = get_tensor_model_parallel_rank() == 0
        layers = list(
            get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        )
        if len(layers) != 1:
            raise RuntimeError(f"expected one hidden-state cache layer, found {layers}")
        self._cache = kv_caches[layers[0]]
        k1 = len(self.capture_layers) + 1
        if self._cache.shape[1] != k1 or self._cache.shape[3] != self.hidden_size:
            raise RuntimeError(f"hidden-state cache {tuple(self._cache.shape)} is not [blocks, {k1}, bs, "
                               f"{self.hidden_size}]")  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the forward already cached the states; they are read when the request finishes

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, HsxConnectorMetadata):
                for save in meta.saves:
                    self._start_copy(save)
        done = set()
        for req_id, event in list(self._copies.items()):
            if event is None or event.query():
                done.add(req_id)
                del self._copies[req_id]
        return done or None, None

    def _start_copy(self, save: Save) -> None:
        """Copy the request's rows off the cache (the blocks are freed once this is done), then write."""
        if not self._writer_rank:
            return
        assert self._cache is not None
        try:
            rows = rows_of(self._cache, save.block_ids, len(save.token_ids))
            if rows.is_cuda:
                host, event = self._copy_cuda(rows)
            else:
                host, event = rows.to(torch.bfloat16, copy=True), None
        except Exception as exc:  # the request gets an error marker; the engine goes on
            log.exception("copying the rows of %s failed", save.rid)
            protocol.write_error(self.dump_dir, save.rid, "hook_error", f"{type(exc).__name__}: {exc}")
            self._copies[save.req_id] = None
            return
        self._copies[save.req_id] = event
        self._writes.submit(self._write, save, host, event, str(self._cache.dtype).removeprefix("torch."))

    @staticmethod
    def _copy_cuda(rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Untested here (no GPU in CI): bf16 on the device, then a side-stream copy into pinned memory."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the gather that made `rows` runs there
        rows.record_stream(stream)  # so the allocator does not reuse its memory before the copy ran
        with torch.cuda.stream(stream):
            dev = rows.to(torch.bfloat16)
            host = torch.empty(dev.shape, dtype=torch.bfloat16, pin_memory=True)
            host.copy_(dev, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return host, event

    def _write(self, save: Save, host: torch.Tensor, event: Any, source_dtype: str) -> None:
        try:
            if event is not None:
                event.synchronize()
            t, k1, h = host.shape
            k = k1 - 1
            bits = host.view(torch.int16).numpy()
            ids = torch.tensor(save.token_ids, dtype=torch.int32).numpy()
            meta = protocol.DumpMeta(
                rid=save.rid,
                seq_len=len(save.token_ids),
                hidden_size=h,
                capture_layers=self.capture_layers,
                producer=PRODUCER,
                extra={
                    "architecture": self.architecture,
                    "source_dtype": source_dtype,
                    protocol.FINAL_STATE_KEY: FINAL_STATE,
                },
            )
            aux = bits[:, :k, :].reshape(t, k * h).copy()
            final = bits[:, k, :].copy()
            protocol.write_dump(self.dump_dir, meta, ids, aux, final)
        except Exception as exc:
            log.exception("writing the dump of %s failed", save.rid)
            protocol.write_error(self.dump_dir, save.rid, "writer_error", f"{type(exc).__name__}: {exc}")
