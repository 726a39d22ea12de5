"""The wire-neutral engine: request registry, the model thread, and each role's leg.

Stage: engine.  In: a :class:`Leg` (one Generate request, read from any wire by its servicer)
and the engine's role; out: a :class:`Run` whose events (:class:`Token`, :class:`ChoiceEnd`)
the wire's servicer turns into its own ``GenerateResponse`` stream (:mod:`.streaming`).

Roles (``--role``), per leg:
  * ``single``: the prompt with its media, every token here (:func:`~.generation.run_generation`);
  * ``prefill`` with a KV link: reserve the room on this engine's handoff listener, run the prompt,
    publish the KV cache and each choice's first token (:mod:`.kv_state`), answer with that
    token.  Without a link (a vLLM request with no ``kv_transfer_params``) it serves whole, as a
    vLLM ``kv_producer`` does;
  * ``decode`` with a KV link: pull the prefill's state from ``(host, port, room)`` (waiting up to
    ``--handoff-wait``), check it is this prompt's, continue every choice from it;
  * ``encode`` (:meth:`EngineCore.encode`): run the tower on one item and publish its embeddings.
An EPD prefill (items without encoder input, plus ``encode_bootstrap_info``) first pulls each
item's embeddings from its encode engine and passes them as ``mm_encoder_outputs``.

``--record-dir``: a leg the model runs from its own inputs (single, prefill) is recorded as the model
takes it; a decode leg, which continues from the prefill's KV, as it arrived (its prompt ids and the
tensors of its media identity), so a recording shows what each leg was sent.

Structured outputs: a leg's constraint is compiled on the gRPC handler's thread, in a child
process (:mod:`.constraint_pool`), before the leg reaches a model thread, so a slow or crashing
compile holds neither the model thread nor the process; the compiled grammar rides with the leg's
job.  A leg cancelled while its constraint compiles ends ``abort`` with no tokens, as a leg
aborted while queued does (a prefill leg publishes the failure to its room).

Threads: network waits (handoff pulls) and constraint compiles run on the gRPC handler's thread;
model work runs on ``config.model_workers`` model threads.  A handler waits on a queue the model thread fills.
A Generate stream holds its pool thread for its whole life, so at most ``config.rpc_workers``
run at once (more: ``RESOURCE_EXHAUSTED``); :data:`MANAGEMENT_THREADS` more pool threads keep
health and info answered while the engine is busy (issue 15).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import grpc
import torch
import xgrammar as xgr
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines.vllm import carried_error_details
from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError
from mmgate.refengine.bundle import LazyTokenizer, LoadedModel
from mmgate.refengine.config import EngineConfig, Role
from mmgate.refengine.constraint_pool import CompileCancelled, ConstraintCompiler
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.encoding import combine, encode_item
from mmgate.refengine.generation import (
    FinishReason,
    GenerationResult,
    run_decode,
    run_generation,
    run_prefill,
)
from mmgate.refengine.handoff import HandoffError, HandoffServer, fetch
from mmgate.refengine.kv_state import pack_prefill, unpack_prefill
from mmgate.refengine.mm_inputs import MediaBatch, ModelInputs, assemble_inputs
from mmgate.refengine.mm_processor import media_rpc_status
from mmgate.refengine.recording import RequestRecorder
from mmgate.refengine.sampler import TokenLogprobs
from mmgate.refengine.sampling import GenerationPlan, plan_generation
from mmgate.types import Modality

logger = logging.getLogger("mmgate.refengine")

#: pool threads that Generate streams can never take (HealthCheck, info, Abort); see :mod:`.server`
MANAGEMENT_THREADS = 4
#: exceptions the model code raises for inputs it refuses (the request's fault)
MODEL_INPUT_ERRORS = (ValueError, TypeError, IndexError, RuntimeError)
_DONE = object()


def kv_key(room: str | int) -> str:
    """The handoff key of a PD room."""
    return f"kv/{room}"


def embedding_key(room: str | int) -> str:
    """The handoff key of an EPD item's room."""
    return f"embedding/{room}"


@dataclass(frozen=True, slots=True)
class KvLink:
    """A PD leg's handshake: the prefill engine's handoff listener and the request's room."""

    host: str
    port: int
    room: str


@dataclass(frozen=True, slots=True)
class EncodeLink:
    """Where one item's embeddings wait (an EPD prefill): its modality, its encode engine, its room."""

    modality: Modality
    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class Leg:
    """One Generate request, read from any wire."""

    request_id: str
    input_ids: list[int]  # the expanded prompt, checked against the vocabulary
    batches: list[MediaBatch]  # media tensors (EPD: without encoder input; a decode leg ignores them)
    sampling: vllm_engine_pb2.SamplingParams  # the engine's sampling schema (other wires converted)
    kv: KvLink | None = None
    encode: tuple[EncodeLink, ...] = ()  # EPD, in prompt order


@dataclass(frozen=True, slots=True)
class Token:
    """A generated token of choice ``index``."""

    index: int
    token: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """Choice ``index`` finished."""

    index: int
    result: GenerationResult


@dataclass(frozen=True, slots=True)
class Run:
    """A started leg: its plan, its prompt length, and the events of its choices."""

    plan: GenerationPlan
    prompt_tokens: int
    events: Iterator[Token | ChoiceEnd]


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and details a failed request ends with."""
    media = media_rpc_status(exc)  # worker-side media processing: cause kept, code carried
    if media is not None:
        return media
    if isinstance(exc, HandoffError):
        if exc.reason == "duplicate":
            return grpc.StatusCode.ALREADY_EXISTS, exc.message
        if exc.reason == "failed" and exc.caller_fault:
            return grpc.StatusCode.INVALID_ARGUMENT, exc.message
        return grpc.StatusCode.UNAVAILABLE, f"handoff {exc.reason}: {exc.message}"
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


def _emitter(events: queue.Queue[object], index: int) -> Callable[[int, TokenLogprobs | None], None]:
    """The token callback of choice ``index``: each token becomes a :class:`Token` event."""
    def emit(token: int, logprobs: TokenLogprobs | None) -> None:
        events.put(Token(index, token, logprobs))
    return emit


def _caller_fault(exc: BaseException) -> bool:
    return grpc_status(exc)[0] is grpc.StatusCode.INVALID_ARGUMENT


class EngineShutdown(Exception):
    """The model threads are gone (the engine is stopping)."""


def _aborted(plan: GenerationPlan, prompt_tokens: int) -> Run:
    """A leg cancelled before it reached a model thread: its first choice ends ``abort``, no tokens."""
    return Run(plan, prompt_tokens, iter([ChoiceEnd(0, GenerationResult((), FinishReason.ABORT, None, None))]))


class EngineCore:
    """One loaded model behind any wire and role (see the module docstring)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, normalizer: DeviceNormalizer | None) -> None:
        self.config = config
        self.loaded = loaded
        self.normalizer = normalizer
        self.tokenizer = LazyTokenizer(config.model)
        self.grammars = ConstraintCompiler(self.tokenizer, loaded.facts.vocab_size, config.compile_limits)
        self.recorder = RequestRecorder(config.record_dir) if config.record_dir is not None else None
        self.handoff = (HandoffServer(config.host, config.bootstrap_port, config.handoff_timeout_s)
                        if config.role in (Role.PREFILL, Role.ENCODE) else None)
        self._executor = ThreadPoolExecutor(max_workers=config.model_workers, thread_name_prefix="refengine-model")
        self._lock = threading.Lock()
        self._active: dict[str, threading.Event] = {}  # request id -> cancel flag
        self._running = 0
        self._streams = threading.BoundedSemaphore(config.rpc_workers)  # Generate streams running
        self.started = time.monotonic()
        self.last_receive = 0.0
        self.shutting_down = False

    @property
    def bootstrap_port(self) -> int:
        """The handoff listener's port (0: this role listens on none)."""
        return self.handoff.port if self.handoff is not None else 0

    # ---- registry -------------------------------------------------------------------------------

    def try_stream(self) -> bool:
        """Take a Generate stream slot (False: every one is taken)."""
        return self._streams.acquire(blocking=False)

    def release_stream(self) -> None:
        self._streams.release()

    def register(self, request_id: str) -> threading.Event | None:
        """The new request's cancel flag; None when a request of that id is running."""
        self.last_receive = time.time()
        with self._lock:
            if request_id in self._active:
                return None
            flag = self._active[request_id] = threading.Event()
            return flag

    def finish(self, request_id: str, cancelled: threading.Event) -> None:
        cancelled.set()
        with self._lock:
            if self._active.get(request_id) is cancelled:
                del self._active[request_id]

    def abort(self, request_ids: Sequence[str]) -> int:
        """Cancel the running requests among ``request_ids``; how many there were."""
        with self._lock:
            flags = [self._active[r] for r in request_ids if r in self._active]
        for flag in flags:
            flag.set()
        return len(flags)

    def active_ids(self) -> tuple[str, ...]:
        """The ids of the requests registered now (running or queued), in arrival order."""
        with self._lock:
            return tuple(self._active)

    def counts(self) -> tuple[int, int]:
        """(active requests, requests on a model thread)."""
        with self._lock:
            return len(self._active), self._running

    def shutdown(self) -> None:
        """Cancel in-flight requests, stop the model threads and the handoff listener."""
        self.shutting_down = True
        with self._lock:
            for flag in self._active.values():
                flag.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()
        if self.handoff is not None:
            self.handoff.close()

    # ---- the model thread ----------------------------------------------------------------------

    def _events(self, job: Callable[[queue.Queue[object]], None]) -> Iterator[Token | ChoiceEnd]:
        """Run ``job(events)`` on a model thread; yield what it puts, then raise what it raised."""
        events: queue.Queue[object] = queue.Queue()

        def work() -> None:
            with self._lock:
                self._running += 1
            try:
                job(events)
            finally:
                with self._lock:
                    self._running -= 1

        try:
            future = self._executor.submit(work)
        except RuntimeError:  # the executor is shut down
            raise EngineShutdown("engine is shutting down") from None
        future.add_done_callback(lambda _: events.put(_DONE))
        while (item := events.get()) is not _DONE:
            yield item  # type: ignore[misc]
        if future.cancelled():
            raise EngineShutdown("engine is shutting down")
        exc = future.exception()
        if exc is not None:
            raise exc

    def run_on_model_thread(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a model thread; its result (or its exception)."""
        box: list[Any] = []
        for _ in self._events(lambda events: box.append(fn())):
            pass
        return box[0]

    # ---- legs ------------------------------------------------------------------------------------

    def start(self, leg: Leg, cancelled: threading.Event) -> Run:
        """Prepare ``leg`` for this engine's role and start it (see the module docstring).

        Raises:
            GatewayError / HandoffError / ValueError: the request is refused (before any model work).
        """
        role = self.config.role
        if role is Role.ENCODE:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "Generate is unavailable on encode workers")
        if role is Role.DECODE and leg.kv is not None:
            return self._decode(leg, cancelled)
        if role is Role.PREFILL and leg.kv is not None:
            return self._prefill(leg, leg.kv, cancelled)
        inputs, plan = self._prepare(leg, cancelled)
        try:
            grammar = self._grammar(plan, cancelled)
        except CompileCancelled:
            return _aborted(plan, inputs.prompt_len)

        def job(events: queue.Queue[object]) -> None:
            for index in range(plan.n):
                result = run_generation(self.loaded, inputs, plan.for_choice(index), _emitter(events, index),
                                        cancelled, self.tokenizer, grammar)
                events.put(ChoiceEnd(index, result))
                if result.finish_reason == "abort":
                    break

        return Run(plan, inputs.prompt_len, self._events(job))

    def _plan(self, leg: Leg) -> GenerationPlan:
        return plan_generation(leg.sampling, self.loaded.facts, len(leg.input_ids), self.config.max_tokens_default)

    def _grammar(self, plan: GenerationPlan, cancelled: threading.Event) -> xgr.CompiledGrammar | None:
        """The plan's constraint compiled on this (handler) thread, in a child process; None without one.

        Raises:
            GatewayError(INVALID_REQUEST / CONSTRAINT_TOO_COMPLEX): see :meth:`ConstraintCompiler.compile`.
            CompileCancelled: the leg was cancelled first.
        """
        return self.grammars.compile(plan.constraint, cancelled) if plan.constraint is not None else None

    def _prepare(self, leg: Leg, cancelled: threading.Event) -> tuple[ModelInputs, GenerationPlan]:
        """The leg's model inputs (an EPD leg's embeddings pulled first) and its plan."""
        encoder_outputs = self._pull_embeddings(leg.encode, cancelled) if leg.encode else None
        batches = leg.batches
        if encoder_outputs:
            batches = [replace(b, tensors={k: v for k, v in b.tensors.items() if k != b.primary})
                       if b.modality.value in encoder_outputs else b for b in batches]
        inputs = assemble_inputs(leg.input_ids, batches, self.loaded, encoder_outputs)
        if self.recorder is not None:
            self.recorder.record(leg.request_id, inputs)
        if inputs.dropped_keys:
            logger.debug("request %s: not model inputs, dropped: %s", leg.request_id, inputs.dropped_keys)
        return inputs, self._plan(leg)

    def _pull_embeddings(self, links: Sequence[EncodeLink], cancelled: threading.Event) -> dict[str, Any]:
        """Every item's embeddings from its encode engine, combined per modality in prompt order."""
        trees: dict[str, list[dict[str, Any]]] = {}
        for link in links:
            tree = fetch(link.host, link.port, embedding_key(link.room), self.config.handoff_wait_s, cancelled)
            if tree.get("modality") != link.modality.value:
                raise GatewayError(ErrorCode.INVALID_REQUEST,
                                   f"encode room {link.room} holds a {tree.get('modality')} item, not {link.modality}")
            trees.setdefault(link.modality.value, []).append(tree)
        return {modality: combine(items) for modality, items in trees.items()}

    def _prefill(self, leg: Leg, link: KvLink, cancelled: threading.Event) -> Run:
        assert self.handoff is not None
        key = kv_key(link.room)
        store = self.handoff.store
        store.reserve(key)
        try:
            inputs, plan = self._prepare(leg, cancelled)
            grammar = self._grammar(plan, cancelled)
        except CompileCancelled:
            store.fail(key, "the prefill was cancelled while its constraint compiled", False)
            return _aborted(plan, inputs.prompt_len)
        except BaseException as exc:
            store.fail(key, f"the prefill refused the request: {grpc_status(exc)[1]}", _caller_fault(exc))
            raise

        def job(events: queue.Queue[object]) -> None:
            try:
                state, results = run_prefill(self.loaded, inputs, plan,
                                             lambda i, t, lp: events.put(Token(i, t, lp)), self.tokenizer, grammar)
            except BaseException as exc:
                store.fail(key, f"the prefill failed: {grpc_status(exc)[1]}", _caller_fault(exc))
                raise
            store.publish(key, pack_prefill(state))
            for index, result in enumerate(results):
                events.put(ChoiceEnd(index, result))

        return Run(plan, inputs.prompt_len, self._events(job))

    def _record_arrival(self, leg: Leg) -> None:
        """Record a decode leg as it arrived: its ids and every tensor of its batches (no model inputs)."""
        if self.recorder is None:
            return
        input_ids = torch.tensor([list(leg.input_ids)], dtype=torch.int64)
        tensors = {name: tensor for batch in leg.batches for name, tensor in batch.tensors.items()}
        self.recorder.record(leg.request_id, ModelInputs(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                                         mm_kwargs=tensors, dropped_keys=()))

    def _decode(self, leg: Leg, cancelled: threading.Event) -> Run:
        assert leg.kv is not None
        self._record_arrival(leg)
        plan = self._plan(leg)
        try:
            grammar = self._grammar(plan, cancelled)
        except CompileCancelled:
            return _aborted(plan, len(leg.input_ids))
        tree = fetch(leg.kv.host, leg.kv.port, kv_key(leg.kv.room), self.config.handoff_wait_s, cancelled)
        state = unpack_prefill(tree)
        if list(state.prompt_ids) != list(leg.input_ids):
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"the KV of bootstrap room {leg.kv.room} was computed for another prompt "
                               f"({len(state.prompt_ids)} tokens; this request has {len(leg.input_ids)})")
        if len(state.first) != plan.n:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"the prefill sampled {len(state.first)} choices; this request asks for {plan.n}")

        def job(events: queue.Queue[object]) -> None:
            for index in range(plan.n):
                result = run_decode(self.loaded, state, index, plan.for_choice(index), _emitter(events, index),
                                    cancelled, self.tokenizer, grammar)
                events.put(ChoiceEnd(index, result))
                if result.finish_reason == "abort":
                    break

        return Run(plan, len(leg.input_ids), self._events(job))

    def encode(self, items: Sequence[tuple[MediaBatch, int, int]]) -> None:
        """The encode role: run the tower on each (item, embedding rows, room) and publish its embeddings
        under the room; a failure is published too, so the prefill waiting on the room hears of it.

        Raises:
            HandoffError(duplicate): a room already in use; whatever :func:`encode_item` raises.
        """
        assert self.handoff is not None
        store = self.handoff.store
        for item, rows, room in items:
            key = embedding_key(room)
            store.reserve(key)
            try:
                tree = self.run_on_model_thread(partial(encode_item, self.loaded, item, rows))
            except BaseException as exc:
                store.fail(key, f"the encoder failed: {grpc_status(exc)[1]}", _caller_fault(exc))
                raise
            store.publish(key, tree)
