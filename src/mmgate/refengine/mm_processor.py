"""Worker-side media processing in the reference engine (``--mm-processor inprocess|redis``).

Stage: engine request intake, before the model inputs are built.  In: a
``GenerateRequest`` with ``media_refs`` (unexpanded prompt, one anchor per
item, URLs in prompt order); out: the same request with the expanded
``input_ids`` and ``mm_inputs`` filled, so the rest of the engine handles it
exactly like a router-processed request (same decoding, same layout checks).

``inprocess`` runs :class:`~mmgate.sidecar.processor.MediaProcessor` (the
gateway's own pipeline) on an event loop thread of this process; ``redis``
hands the job to ``mmgate sidecar`` through
:class:`~mmgate.sidecar.client.SidecarClient`, and is advertised only while a
sidecar with the engine's fingerprint keeps its hello alive.

Labels (GetServerInfo): ``mm_processor`` (``""`` | ``inprocess`` | ``redis``),
``mm_processor_source`` (``flag`` | ``env`` | ``default``; ``""`` when not
advertised) and ``mm_media_ref_schemes`` (``data,http,https``).

Failures keep their cause (:func:`media_rpc_status`): a media error becomes
INVALID_ARGUMENT (the caller's) or UNAVAILABLE (transient) with the mmgate
code carried in the details (``[code=media_fetch_timeout item=0] ...``,
:func:`mmgate.engines.vllm.carried_error_details`); the sidecar being down,
overloaded or late is UNAVAILABLE; a result too large to deliver is
INVALID_ARGUMENT ``media_too_large: ...``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from mmgate.engines.vllm import build_mm_inputs, carried_error_details
from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError
from mmgate.media.ref_sizes import check_ref_sizes
from mmgate.refengine.mm_config import MmProcessorConfig, MmProcessorMode
from mmgate.sidecar.client import SidecarClient, SidecarRefused, SidecarUnavailable
from mmgate.sidecar.processor import MediaProcessor, ProcessedPrompt, item_index, load_runtime, refs_from_items
from mmgate.sidecar.protocol import Keys, default_namespace
from mmgate.types import MediaRef

logger = logging.getLogger(__name__)

_NO_DEADLINE_S = 365 * 24 * 3600.0
_MODALITY_NAMES = {common_pb2.IMAGE: "image", common_pb2.VIDEO: "video", common_pb2.AUDIO: "audio"}


class MediaStageError(Exception):
    """A media failure of worker-side processing (the carried :class:`GatewayError`)."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


def media_rpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status of a worker-side processing failure, or None for any other exception."""
    if isinstance(exc, MediaStageError):
        error, spec = exc.error, ERROR_TABLE[exc.error.code]
        if spec.status < 500:
            status = grpc.StatusCode.INVALID_ARGUMENT
        elif spec.retryable:
            status = grpc.StatusCode.UNAVAILABLE
        else:
            status = grpc.StatusCode.INTERNAL
        return status, carried_error_details(error.code, error.message, item_index(error.param))
    if isinstance(exc, SidecarUnavailable):
        return grpc.StatusCode.UNAVAILABLE, f"media sidecar: {exc}"
    if isinstance(exc, SidecarRefused):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "media processing ran past the request's deadline"
    return None


class _LoopThread:
    """An asyncio loop on a daemon thread, for the in-process processor's fetches."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="refengine-mm", daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float | None):  # noqa: ANN001, ANN201 - any coroutine
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class WorkerMedia:
    """The engine's media-reference stage (see the module docstring).

    Raises (construction):
        ValueError: the bundle, its tokenizer or its family cannot be loaded for processing
            (e.g. a media model no family serves); the engine refuses to start.
    """

    def __init__(self, config: MmProcessorConfig, model: Path) -> None:
        self.config = config
        self.mode = config.mode
        self.processor: MediaProcessor | None = None
        self._loop: _LoopThread | None = None
        self._client: SidecarClient | None = None
        if self.mode is MmProcessorMode.OFF:
            return
        try:
            runtime = load_runtime(model, (), config.processing)
        except GatewayError as exc:  # a start-up failure: the engine's main reports ValueError and exits
            raise ValueError(f"--mm-processor {self.mode.value}: {exc.message}") from None
        if runtime.family is None:
            logger.warning("--mm-processor %s ignored: %s takes no media", self.mode.value, runtime.bundle.name)
            self.mode = MmProcessorMode.OFF
            return
        self.processor = MediaProcessor(runtime, config.processing)
        if self.mode is MmProcessorMode.INPROCESS:
            self._loop = _LoopThread()
        else:
            keys = Keys.for_namespace(config.namespace or default_namespace(self.processor.fingerprint))
            self._client = SidecarClient(config.redis_url, keys, self.processor.fingerprint,
                                         timeout_ms=config.sidecar_timeout_ms, max_queue=config.sidecar_max_queue)
            logger.info("media sidecar keys under %s (fingerprint %s)", keys.prefix, self.processor.fingerprint[:16])

    def labels(self) -> tuple[str, str, str]:
        """``(mm_processor, mm_processor_source, mm_media_ref_schemes)`` as advertised right now."""
        if self.processor is None:
            return "", "", ""
        if self._client is not None:
            hello = self._client.probe()
            if hello is None:
                return "", "", ""
            return self.mode.value, self.config.source, ",".join(hello.schemes)
        return self.mode.value, self.config.source, self.processor.schemes_label

    def resolve(self, request: vllm_engine_pb2.GenerateRequest,
                time_remaining_s: float | None) -> vllm_engine_pb2.GenerateRequest:
        """``request`` with its media references processed; unchanged when it has none (or processing is off).

        Raises:
            GatewayError(INVALID_REQUEST): references without tokenized input, or together with tensors.
            MediaStageError, SidecarUnavailable, SidecarRefused, TimeoutError: see :func:`media_rpc_status`.
        """
        if not (request.HasField("media_refs") and request.media_refs.items) or self.processor is None:
            return request  # off: build_model_inputs refuses the references
        if request.WhichOneof("input") != "tokenized":
            raise GatewayError(ErrorCode.INVALID_REQUEST, "media_refs need tokenized input")
        if request.HasField("mm_inputs") or len(request.extra_mm_inputs):
            raise GatewayError(ErrorCode.INVALID_REQUEST, "media_refs and mm_inputs are mutually exclusive")
        try:
            refs = refs_from_items([(_MODALITY_NAMES.get(r.modality, "?"), r.url) for r in request.media_refs.items])
        except ValueError:
            error = GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "unknown media_refs modality")
            raise MediaStageError(error) from None
        ids = list(request.tokenized.input_ids)
        if time_remaining_s is not None and time_remaining_s > _NO_DEADLINE_S:
            time_remaining_s = None  # grpc reports "no deadline" as a huge number
        try:
            check_ref_sizes(refs, self.config.processing.fetch)
            processed = self._process(ids, refs, request.request_id, time_remaining_s)
        except GatewayError as exc:
            raise MediaStageError(exc) from None
        return expanded_request(request, processed)

    def _process(self, ids: list[int], refs: list[MediaRef], request_id: str,
                 time_remaining_s: float | None) -> ProcessedPrompt:
        assert self.processor is not None
        if self._loop is not None:
            return self._loop.run(self.processor.process(ids, refs), time_remaining_s)
        assert self._client is not None
        hello = self._client.probe(fresh=True)
        if hello is None:
            raise SidecarUnavailable(f"sidecar_unavailable: {self._client.last_problem}")
        self.processor.validate(refs, hello.schemes)
        deadline = time.monotonic() + time_remaining_s if time_remaining_s is not None else None
        return self._client.process(ids, refs, request_id, deadline)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
        if self._client is not None:
            self._client.close()


def expanded_request(request: vllm_engine_pb2.GenerateRequest,
                     processed: ProcessedPrompt) -> vllm_engine_pb2.GenerateRequest:
    """A copy of ``request``: expanded ids, tensors inline in ``mm_inputs`` / ``extra_mm_inputs``, no references."""
    out = vllm_engine_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("media_refs")
    del out.tokenized.input_ids[:]
    out.tokenized.input_ids.extend(processed.input_ids)
    for i, batch in enumerate(processed.batches):
        mm = build_mm_inputs(batch)
        if i == 0:
            out.mm_inputs.CopyFrom(mm)
        else:
            out.extra_mm_inputs.append(mm)
    return out
