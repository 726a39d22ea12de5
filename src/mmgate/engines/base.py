"""Engine-neutral types of the engine seam: wires, roles, capabilities, and the answer stream.

Stage: select worker / assemble / transport / engine.  Every wire adapter (``vllm``, ``sglang``,
``tokenspeed``; one module pair per wire under ``mmgate/engines/``) turns a
:class:`~mmgate.types.PreparedRequest` into its wire's message for a :class:`Role`, and the
wire's response stream into :class:`EngineEvent` values.  ``api/`` and ``routing/`` see only
these types; engine field names and proto types stay in ``engines/``.

The three wires' answers have the same shape (``GenerateResponse`` = one ``chunk`` or one
``complete`` per choice, in ``vllm_engine.proto``, ``sglang_scheduler.proto`` and
``tokenspeed_scheduler.proto`` of smg-grpc-proto 0.4), so one neutral event covers them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from mmgate.types import Modality, PendingTensor, RowTarget


class Wire(StrEnum):
    """The gRPC protocol a worker speaks (its smg-grpc-proto service)."""

    VLLM = "vllm"  # vllm.grpc.engine.VllmEngine
    SGLANG = "sglang"  # sglang.grpc.scheduler.SglangScheduler
    TOKENSPEED = "tokenspeed"  # tokenspeed.grpc.scheduler.TokenSpeedScheduler (+ tokenspeed.grpc.encoder.TokenSpeedEncoder)


class Role(StrEnum):
    """What a worker does for a request: all of it, one leg of a prefill/decode pair, or encoding."""

    SINGLE = "single"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a worker says about itself (health + GetModelInfo + GetServerInfo), typed.

    ``modalities``: what the worker's engine takes from the gateway on this wire
    (:data:`mmgate.engines.capabilities.MATRIX` and the model's ``supports_vision``).
    ``language_model_only``: the worker runs the language model without its vision tower
    (a decode worker that cannot embed media itself).  ``encoder_dtype``: the dtype the worker
    wants encoder input in (``float32``, ``bfloat16``, ``float16``; '' = the gateway's setting).
    ``labels``: the flattened labels ``GET /workers`` shows.
    """

    wire: Wire
    role: Role
    model_type: str = ""
    supports_vision: bool = False
    language_model_only: bool = False
    modalities: frozenset[Modality] = frozenset()
    shm_namespace: str = ""
    encoder_dtype: str = ""
    device_normalize: bool = False
    mm_processor: str = ""
    media_ref_schemes: frozenset[str] = frozenset()
    max_context_length: int = 0
    eos_token_ids: tuple[int, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The most likely tokens at one position: ids and their log probabilities."""

    token_ids: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Log probabilities of generated tokens (the wires' ``OutputLogProbs``)."""

    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """One message of an engine's answer stream, for one choice (``index``).

    ``kind`` ``chunk``: new ``token_ids`` of a streamed choice (``GenerateStreamChunk``);
    ``complete``: the choice's end (``GenerateComplete``): ``token_ids`` are its output ids
    (all of them for a non-streamed request), ``finish_reason`` (``stop``, ``length``,
    ``abort``, ``error``), the stop that ended it (``matched_token_id`` or
    ``matched_stop_str``; both None for EOS on some engines), and the engine's token counts.
    ``kv_transfer_params``: what a vLLM prefill leg hands its decode leg (the JSON of
    ``GenerateComplete.kv_transfer_params_json``), None elsewhere.
    """

    kind: str  # "chunk" | "complete"
    index: int
    token_ids: tuple[int, ...]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: Logprobs | None = None
    finish_reason: str = ""
    matched_token_id: int | None = None
    matched_stop_str: str | None = None
    kv_transfer_params: str | None = None

    @property
    def is_complete(self) -> bool:
        return self.kind == "complete"


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """The prefill/decode (or encode/prefill) handshake of SGLang and TokenSpeed: where the
    sending leg's engine listens for the receiving one, and the room (a per-request id, minted by
    the gateway) that pairs the two legs of one request."""

    host: str
    port: int
    room: int


class ProbeOutcome(StrEnum):
    """What one health probe of a worker found (:mod:`mmgate.routing.workers` tells busy from dead by it)."""

    OK = "ok"  # the engine service's HealthCheck said healthy and the info RPCs answered
    NOT_SERVING = "not_serving"  # the worker answered, and said it is not healthy
    UNREACHABLE = "unreachable"  # UNAVAILABLE: nothing listening, connection refused or reset
    TIMEOUT = "timeout"  # DEADLINE_EXCEEDED: no answer in time (busy or hung)
    ERROR = "error"  # any other RPC status, or a server that serves none of the engine services


@dataclass(frozen=True, slots=True)
class Probe:
    """One health probe: its outcome, and the worker's capabilities when it answered everything."""

    outcome: ProbeOutcome
    capabilities: Capabilities | None = None
    wire: Wire | None = None  # the engine service the worker serves, once detected


@dataclass(frozen=True, slots=True)
class EncodedRequest:
    """One wire message, serialized, for one leg of a request; ``await fill()`` computes its pending
    tensors in place.

    ``data`` is complete once ``fill`` has returned (at once when ``pending`` is empty): a pending
    tensor (:class:`~mmgate.types.PendingTensor`) is computed straight into the shared-memory segment
    or the slice of ``data`` the adapter chose for it, so the pixels are written once.
    """

    data: bytes
    pending: tuple[tuple[PendingTensor, RowTarget], ...] = ()
    #: non-empty once ``WorkerClient.generate`` has sent ``data`` with its pages to be given back after grpc's
    #: copy (the whole pages inside it then read as zeros): it may not be sent again
    released: list[bool] = field(default_factory=list, compare=False, repr=False)

    async def fill(self) -> None:
        for tensor, target in self.pending:
            await tensor.fill(target)
