"""Engine <-> sidecar protocol over Redis (schema version 1).

Stage: transport between a worker and its media sidecar.  In/out: msgspec
msgpack messages; tensors travel as raw little-endian bytes (msgpack ``bin``),
never as JSON lists.

Keys under ``smg:mm:v1:{namespace}``:

* ``:hello``         HASH written by the sidecar every ``refresh`` seconds with
                     a ``ttl`` (defaults 5 s / 15 s): ``schema``,
                     ``fingerprint``, ``schemes``, ``max_result_bytes``,
                     ``settings`` (the fingerprint's description, JSON), ``model``.
* ``:jobs``          LIST, the engine LPUSHes a :class:`Job`, sidecars BRPOP.
* ``:res:{job_id}``  LIST, the sidecar LPUSHes one :class:`JobResult` and sets a
                     120 s expiry; the engine BRPOPs it until the job's deadline.

A result carries the expanded prompt and full tensors (one :class:`WireBatch`
per modality) or a failure ``code``: an mmgate :class:`~mmgate.errors.ErrorCode`
value for media failures (the caller's 400s, transient 503s), or one of the
protocol codes below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from mmgate.transport.inline import from_parts, wire_dtype_name
from mmgate.types import (
    EncoderBatch,
    Modality,
    PlaceholderRange,
    TensorLayout,
    TensorSpec,
)

SCHEMA_VERSION = 1
KEY_ROOT = "smg:mm:v1"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ENV_REDIS_URL = "SMG_VLLM_MM_REDIS_URL"

HELLO_TTL_S = 15.0
HELLO_REFRESH_S = 5.0
RESULT_TTL_S = 120
#: Redis's own ``proto-max-bulk-len`` default; a result at or above the limit is not pushed
DEFAULT_MAX_RESULT_BYTES = 512 * 1024 * 1024

# Protocol failure codes (media failures use ErrorCode values).
CODE_EXPIRED = "expired"  # the job's deadline passed before the sidecar began it
CODE_DEADLINE = "deadline_exceeded"  # processing ran past the job's deadline
CODE_FINGERPRINT = "fingerprint_mismatch"  # the job was made for other processing settings
CODE_RESULT_TOO_LARGE = "result_too_large"  # the encoded result is at or above the result limit
CODE_BAD_JOB = "bad_job"  # wrong schema or an unknown modality
CODE_PROCESSOR_ERROR = "processor_error"  # a bug in the sidecar


@dataclass(frozen=True, slots=True)
class Keys:
    """The Redis keys of one namespace."""

    prefix: str  # smg:mm:v1:{namespace}

    @classmethod
    def for_namespace(cls, namespace: str) -> Keys:
        return cls(prefix=f"{KEY_ROOT}:{namespace}")

    @property
    def hello(self) -> str:
        return f"{self.prefix}:hello"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    def result(self, job_id: str) -> str:
        return f"{self.prefix}:res:{job_id}"


def default_namespace(fingerprint: str) -> str:
    """The namespace when none is given: fleets with different settings never share keys."""
    return fingerprint[:16]


class JobItem(msgspec.Struct, frozen=True):
    modality: str  # "image" | "video"
    url: str  # verbatim from the request


class Job(msgspec.Struct, frozen=True):
    v: int
    job_id: str
    request_id: str
    fingerprint: str  # the engine's processing fingerprint; the sidecar refuses another
    prompt_token_ids: list[int]  # unexpanded: one anchor per item
    items: list[JobItem]  # prompt order
    enqueued_ms: int  # epoch milliseconds
    deadline_ms: int  # epoch milliseconds: the engine stops waiting then; so does the sidecar


class WireTensor(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # mmgate.transport.inline wire dtype name
    shape: list[int]
    data: bytes  # raw little-endian, C order


class WireBatch(msgspec.Struct, frozen=True):
    """An :class:`~mmgate.types.EncoderBatch` on the wire."""

    modality: str
    tensors: list[WireTensor]
    batched_keys: list[str]
    flat_keys: dict[str, str]
    keep_on_cpu_keys: list[str]
    placeholder_token_id: int
    placeholders: list[tuple[int, int]]  # (offset, length) in the expanded prompt
    mm_hashes: list[str]
    primary_key: str = "pixel_values"  # the encoder input among ``tensors``


class JobResult(msgspec.Struct, frozen=True):
    v: int
    job_id: str
    ok: bool
    fingerprint: str = ""
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)  # expanded
    batches: list[WireBatch] = msgspec.field(default_factory=list)
    code: str = ""  # failure: an ErrorCode value or a CODE_* above
    message: str = ""
    item: int = -1  # failure: index of the item at fault, -1 when none
    timing_ms: dict[str, float] = msgspec.field(default_factory=dict)


def failure(job_id: str, code: str, message: str, item: int = -1) -> JobResult:
    return JobResult(v=SCHEMA_VERSION, job_id=job_id, ok=False, code=code, message=message, item=item)


def batch_to_wire(batch: EncoderBatch) -> WireBatch:
    """Encode a batch; each tensor becomes one contiguous byte string."""
    tensors = []
    for name, array in batch.tensors.items():
        array = np.ascontiguousarray(array)
        tensors.append(WireTensor(name=name, dtype=wire_dtype_name(array), shape=list(array.shape),
                                  data=array.tobytes()))
    return WireBatch(
        modality=batch.modality.value, tensors=tensors, batched_keys=list(batch.batched_keys),
        flat_keys=dict(batch.flat_keys), keep_on_cpu_keys=list(batch.keep_on_cpu_keys),
        placeholder_token_id=batch.placeholder_token_id,
        placeholders=[(r.offset, r.length) for r in batch.placeholders], mm_hashes=list(batch.mm_hashes),
        primary_key=batch.primary_key,
    )


def batch_from_wire(wire: WireBatch) -> EncoderBatch:
    """Decode a batch (arrays are read-only views over the message bytes).

    Raises:
        GatewayError(INVALID_REQUEST): a tensor whose bytes do not match its shape and dtype.
        ValueError: an unknown modality.
    """
    tensors = {t.name: from_parts(t.data, tuple(t.shape), t.dtype) for t in wire.tensors}
    specs = tuple(
        TensorSpec(name, str(array.dtype),
                   TensorLayout.BATCHED if name in wire.batched_keys else
                   TensorLayout.FLAT if name in wire.flat_keys else TensorLayout.SHARED,
                   sizes_key=wire.flat_keys.get(name), keep_on_cpu=name in wire.keep_on_cpu_keys,
                   primary=name == wire.primary_key)
        for name, array in tensors.items())
    return EncoderBatch(
        modality=Modality(wire.modality), tensors=tensors, specs=specs,
        placeholder_token_id=wire.placeholder_token_id,
        placeholders=tuple(PlaceholderRange(offset=o, length=n) for o, n in wire.placeholders),
        mm_hashes=tuple(wire.mm_hashes),
    )


_JOB_ENCODER = msgspec.msgpack.Encoder()
_JOB_DECODER = msgspec.msgpack.Decoder(type=Job)
_RESULT_DECODER = msgspec.msgpack.Decoder(type=JobResult)


def encode(message: Job | JobResult) -> bytes:
    return _JOB_ENCODER.encode(message)


def decode_job(raw: bytes) -> Job:
    """Raises msgspec.DecodeError / ValidationError on a malformed job."""
    return _JOB_DECODER.decode(raw)


def decode_result(raw: bytes) -> JobResult:
    """Raises msgspec.DecodeError / ValidationError on a malformed result."""
    return _RESULT_DECODER.decode(raw)


def hello_text(hello: Mapping[Any, Any], name: str) -> str:
    """One field of a hello HASH as text ('' when absent); redis-py returns bytes keys and values."""
    for key, value in hello.items():
        k = key.decode() if isinstance(key, bytes) else key
        if k == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return ""
