"""The ``vllm.grpc.engine.VllmEngine`` servicer over a transformers model.

Stage: engine.  In: gRPC requests from a gateway; out: streamed
``GenerateResponse`` messages and the management answers.

Threads: gRPC handlers run on the server's pool; model work runs on a
separate single-thread executor, so HealthCheck, GetServerInfo and Abort are
answered while a generation runs.  A handler waits on a queue that the model
thread fills with tokens.  A Generate stream holds its pool thread for its whole
life, so at most ``config.rpc_workers`` streams run at once (more:
``RESOURCE_EXHAUSTED`` at once) and the server's pool has
:data:`MANAGEMENT_THREADS` more threads than that: a health probe never queues
behind generations (issue 15: a busy engine was marked unhealthy).

Generate streaming (``stream=true``): one ``GenerateStreamChunk`` per token
(``token_ids`` = the new token, ``completion_tokens`` = 1, a delta, as the
vLLM servicer's ``_chunk_response`` sends), then one ``GenerateComplete``
carrying the totals: every output id, ``completion_tokens`` = their count.
Non-streaming: the ``GenerateComplete`` only.  ``n`` choices are decoded one
after another; each chunk and each ``GenerateComplete`` carries its choice's
``index`` and the stream ends after the last choice's ``GenerateComplete`` (the
SMG servicer's ``Generate``: a Complete per finished choice).  Logprobs, when the
request asks for them, ride as ``output_logprobs`` (``OutputLogProbs``: the
sampled token's logprob and id per position, ``top_logprobs`` only when k > 0,
as ``_build_output_logprobs`` fills them): per token on each chunk, and all of a
choice's on a non-streamed ``GenerateComplete``.

Errors: a refused request ends the RPC with ``INVALID_ARGUMENT`` and the
reason as details: the engine's own checks (:class:`GatewayError`) and any
``ValueError`` / ``TypeError`` / ``IndexError`` / ``RuntimeError`` the model
code raises on the request's inputs, message unchanged.  Anything else is
``INTERNAL`` and logged with its traceback; the server keeps serving.
Worker-side media processing (``media_refs``, :mod:`.mm_processor`) keeps the
cause instead: INVALID_ARGUMENT or UNAVAILABLE with the mmgate error code
carried in the details.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.engines.vllm import carried_error_details
from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError
from mmgate.refengine.bundle import LazyTokenizer, LoadedModel
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.generation import FinishReason, GenerationResult, run_generation
from mmgate.refengine.mm_inputs import ModelInputs, build_model_inputs
from mmgate.refengine.mm_processor import WorkerMedia, media_rpc_status
from mmgate.refengine.recording import RequestRecorder
from mmgate.refengine.sampler import TokenLogprobs
from mmgate.refengine.sampling import GenerationPlan, plan_generation
from mmgate.transport.shm import shm_namespace_id

logger = logging.getLogger(__name__)

SERVER_TYPE = "vllm-grpc"
#: pool threads that Generate streams can never take (HealthCheck, info, Abort); see :mod:`.server`
MANAGEMENT_THREADS = 4
#: exceptions the model code raises for inputs it refuses (the request's fault)
MODEL_INPUT_ERRORS = (ValueError, TypeError, IndexError, RuntimeError)
_DONE = object()


@dataclass(frozen=True, slots=True)
class _Token:
    """A generated token of choice ``index`` (an event from the model thread)."""

    index: int
    token: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class _Choice:
    """Choice ``index`` finished (an event from the model thread)."""

    index: int
    result: GenerationResult


def output_logprobs(entries: list[TokenLogprobs], k: int) -> vllm_engine_pb2.OutputLogProbs | None:
    """``OutputLogProbs`` of some positions, as the SMG servicer's ``_build_output_logprobs`` fills it.

    ``token_logprobs`` / ``token_ids``: the sampled token's per position;
    ``top_logprobs``: one ``TopLogProbs`` (ids and values, most likely first) per
    position, only when ``k`` > 0.  None when there are no positions.
    """
    if not entries:
        return None
    proto = vllm_engine_pb2.OutputLogProbs(token_logprobs=[e.logprob for e in entries],
                                           token_ids=[e.token_id for e in entries])
    if k > 0:
        proto.top_logprobs.extend(vllm_engine_pb2.TopLogProbs(values=list(e.top_logprobs[:k]),
                                                              token_ids=list(e.top_ids[:k])) for e in entries)
    return proto


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and details a failed request ends with."""
    media = media_rpc_status(exc)  # worker-side media processing: cause kept, code carried
    if media is not None:
        return media
    if isinstance(exc, GatewayError):
        # The code rides along (``[code=context_length_exceeded] ...``) so the gateway reports the same one.
        # ``invalid_request`` is not carried: the gateway accepted the request, so the engine's refusal
        # stays ``engine_rejected``.
        caller_fault = ERROR_TABLE[exc.code].status < 500
        if caller_fault and exc.code is not ErrorCode.INVALID_REQUEST:
            return grpc.StatusCode.INVALID_ARGUMENT, carried_error_details(exc.code, exc.message)
        return (grpc.StatusCode.INVALID_ARGUMENT if caller_fault else grpc.StatusCode.INTERNAL), exc.message
    if isinstance(exc, MODEL_INPUT_ERRORS):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def device_normalizer(config: EngineConfig, loaded: LoadedModel) -> DeviceNormalizer | None:
    """The engine's uint8 normalizer: only with ``--mm-device-do-normalize`` and a family whose raw
    layout the engine knows (``EngineFamily.raw_layout``); GetServerInfo advertises
    ``mm_device_do_normalize`` exactly when there is one.
    """
    if not config.device_normalize:
        return None
    layout = loaded.family.raw_layout
    if layout is None or not loaded.facts.supports_vision:
        logger.warning("--mm-device-do-normalize ignored: the engine knows no raw pixel layout for %s",
                       loaded.facts.model_type)
        return None
    return DeviceNormalizer.from_bundle(config.model, layout)


class RefEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Serves one loaded model; see the module docstring for threading and errors."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self._config = config
        self._loaded = loaded
        self._normalizer = device_normalizer(config, loaded)
        self._tokenizer = LazyTokenizer(config.model)
        self._media = WorkerMedia(config.mm, config.model)
        self._recorder = RequestRecorder(config.record_dir) if config.record_dir is not None else None
        self._executor = ThreadPoolExecutor(max_workers=config.model_workers, thread_name_prefix="refengine-model")
        self._lock = threading.Lock()
        self._active: dict[str, threading.Event] = {}  # request id -> cancel flag
        self._running = 0
        self._streams = threading.BoundedSemaphore(config.rpc_workers)  # Generate streams running
        self._started = time.monotonic()
        self._last_receive = 0.0

    def shutdown(self) -> None:
        """Cancel in-flight requests and stop the model thread."""
        with self._lock:
            for flag in self._active.values():
                flag.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._media.close()

    # ---- Generate ---------------------------------------------------------------

    def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[vllm_engine_pb2.GenerateResponse]:
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "engine busy: every Generate stream slot is taken")
        try:
            yield from self._stream(request, context)
        finally:
            self._streams.release()

    def _stream(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[vllm_engine_pb2.GenerateResponse]:
        self._last_receive = time.time()
        request_id = request.request_id or uuid.uuid4().hex
        cancelled = threading.Event()
        with self._lock:
            if request_id in self._active:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
            self._active[request_id] = cancelled
        context.add_callback(cancelled.set)  # client gone or deadline passed
        last_choice = max(request.sampling_params.n, 1) - 1
        try:
            for response in self._generate(request, context, cancelled):
                if response.HasField("complete") and response.complete.index == last_choice:
                    self._finish(request_id, cancelled)  # no longer active once the client can see the end
                yield response
        finally:
            self._finish(request_id, cancelled)

    def _finish(self, request_id: str, cancelled: threading.Event) -> None:
        cancelled.set()
        with self._lock:
            if self._active.get(request_id) is cancelled:
                del self._active[request_id]

    def _generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.ServicerContext, cancelled: threading.Event
    ) -> Iterator[vllm_engine_pb2.GenerateResponse]:
        try:
            request = self._media.resolve(request, context.time_remaining())
            inputs = build_model_inputs(request, self._loaded, self._tokenizer, self._normalizer)
            if self._recorder is not None:
                self._recorder.record(request.request_id, inputs)
            plan = plan_generation(
                request.sampling_params, self._loaded.facts, inputs.prompt_len, self._config.max_tokens_default
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            self._refuse(request.request_id, exc, context)
            return
        if inputs.dropped_keys:
            logger.debug("request %s: not model inputs, dropped: %s", request.request_id, inputs.dropped_keys)
        events: queue.Queue[object] = queue.Queue()
        try:
            future = self._executor.submit(self._run, inputs, plan, events, cancelled)
        except RuntimeError:  # the executor is shut down
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
        future.add_done_callback(lambda _: events.put(_DONE))
        prompt_tokens = inputs.prompt_len
        k = plan.logprobs or 0
        logprobs: list[list[TokenLogprobs]] = [[] for _ in range(plan.n)]
        finished: list[_Choice] = []
        while (item := events.get()) is not _DONE:
            if isinstance(item, _Token):
                if item.logprobs is not None:
                    logprobs[item.index].append(item.logprobs)
                if request.stream:
                    chunk = vllm_engine_pb2.GenerateStreamChunk(
                        token_ids=[item.token], prompt_tokens=prompt_tokens, completion_tokens=1, index=item.index,
                        output_logprobs=output_logprobs([item.logprobs] if item.logprobs else [], k),
                    )
                    yield vllm_engine_pb2.GenerateResponse(chunk=chunk)
            elif isinstance(item, _Choice):
                finished.append(item)
                if item.index < plan.n - 1:  # the last one is sent once the model thread has ended cleanly
                    yield self._choice_complete(item, prompt_tokens, request.stream, logprobs, k)
        last = finished[-1] if finished and finished[-1].index == plan.n - 1 else None  # not sent yet
        if self._result(future, request.request_id, context) is not None and last is not None:
            yield self._choice_complete(last, prompt_tokens, request.stream, logprobs, k)

    def _choice_complete(self, choice: _Choice, prompt_tokens: int, stream: bool,
                         logprobs: list[list[TokenLogprobs]], k: int) -> vllm_engine_pb2.GenerateResponse:
        complete = self._complete(choice.result, prompt_tokens)
        complete.index = choice.index
        if not stream:  # a stream carried them on its chunks
            entries = output_logprobs(logprobs[choice.index], k)
            if entries is not None:
                complete.output_logprobs.CopyFrom(entries)
        return vllm_engine_pb2.GenerateResponse(complete=complete)

    def _run(
        self, inputs: ModelInputs, plan: GenerationPlan, events: queue.Queue[object], cancelled: threading.Event
    ) -> GenerationResult | None:
        """Decode the ``n`` choices one after another; an aborted choice ends them all."""
        with self._lock:
            self._running += 1
        try:
            result = None
            for index in range(plan.n):
                def on_token(token: int, lp: TokenLogprobs | None, index: int = index) -> None:
                    events.put(_Token(index, token, lp))

                result = run_generation(self._loaded, inputs, plan.for_choice(index), on_token, cancelled,
                                        self._tokenizer)
                events.put(_Choice(index, result))
                if result.finish_reason is FinishReason.ABORT:
                    break
            return result
        finally:
            with self._lock:
                self._running -= 1

    def _result(
        self, future: Future[GenerationResult | None], request_id: str, context: grpc.ServicerContext
    ) -> GenerationResult | None:
        exc = future.exception() if not future.cancelled() else None
        if future.cancelled():
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
        if exc is not None:
            self._refuse(request_id, exc, context)
            return None
        return future.result()

    @staticmethod
    def _refuse(request_id: str, exc: BaseException, context: grpc.ServicerContext) -> None:
        code, details = grpc_status(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request %s failed", request_id, exc_info=exc)
        else:
            logger.info("request %s refused: %s", request_id, details)
        context.abort(code, details)

    @staticmethod
    def _complete(result: GenerationResult, prompt_tokens: int) -> vllm_engine_pb2.GenerateComplete:
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=list(result.output_ids),
            finish_reason=result.finish_reason.value,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(result.output_ids),
        )
        if result.matched_token_id is not None:
            complete.matched_token_id = result.matched_token_id
        elif result.matched_stop_str is not None:
            complete.matched_stop_str = result.matched_stop_str
        return complete

    # ---- management ----------------------------------------------------------------

    def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        with self._lock:
            flags = [self._active[r] for r in request.request_ids if r in self._active]
        for flag in flags:
            flag.set()
        logger.info("abort %s (%d running)", list(request.request_ids), len(flags))
        return vllm_engine_pb2.AbortResponse()

    def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        facts = self._loaded.facts
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=facts.model_path,
            is_generation=True,
            max_context_length=facts.max_context_length,
            vocab_size=facts.vocab_size,
            supports_vision=facts.supports_vision,
            served_model_name=facts.served_model_name,
            tokenizer_path=facts.model_path,
            model_type=facts.model_type,
            architectures=list(facts.architectures),
            eos_token_ids=list(facts.eos_token_ids),
            pad_token_id=facts.pad_token_id,
            bos_token_id=facts.bos_token_id,
            max_req_input_len=facts.max_context_length,
        )

    def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        with self._lock:
            active = len(self._active)
        mm_processor, mm_source, mm_schemes = self._media.labels()
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=active,
            is_paused=False,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.monotonic() - self._started,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            shm_namespace_id=shm_namespace_id(),
            mm_device_do_normalize=self._normalizer is not None,
            model_dtype="torch.float32",
            mm_processor=mm_processor,
            mm_processor_source=mm_source,
            mm_media_ref_schemes=mm_schemes,
            mm_item_limits="",
            multimodal_encoder_dtype=self._config.encoder_dtype,
            max_num_seqs=self._config.model_workers,
        )

    def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        with self._lock:
            active, running = len(self._active), self._running
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=max(active - running, 0),
            num_total_reqs=active,
            max_running_requests=self._config.model_workers,
        )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version="mmgate-refengine", dp_rank_count=1, loads=[load]
        )
