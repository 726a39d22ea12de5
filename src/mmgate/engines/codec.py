"""Codec core, part 1: the serialized request's tail (the encoder input written once, after the rest).

Stage: assemble -> transport.  In: a wire message serialized by protobuf without its large inline
tensor (the *head*), and that tensor as a :class:`Tail` (values, or a pending tensor to compute);
out: the :class:`~mmgate.engines.base.EncodedRequest` whose bytes are the head followed by one more
nested record ``outer { middle { payload: <bytes> } }`` holding the tensor.  Protobuf merges
repeated occurrences of a singular message field, so the parsed message equals the one built with
the tensor inside (each wire's tests check it).

Used by the wires whose encoder input travels in one record of the request (vLLM's first
``mm_inputs.pixel_values.inline``, SGLang's ``mm_inputs.pixel_values.data``); the difference
between them is only the field tags of that record (:data:`VLLM_PIXEL_TAGS`, :data:`SGLANG_PIXEL_TAGS`).
TokenSpeed slices tensors per item and sends them as protobuf builds them.  Tensor values, ranges,
grammars and runs live in :mod:`mmgate.engines.wire_values`.

Invariants: a pending tensor's bytes are never copied (it is computed straight into the request);
an array's bytes are copied once, into the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmgate.engines.base import EncodedRequest
from mmgate.transport.placement import BufferTarget, Convert, identity, new_bytes
from mmgate.types import PendingTensor, RowTarget

#: tags (field number << 3 | wire type 2) of vLLM's ``GenerateRequest.mm_inputs`` (7) /
#: ``MultimodalInputs.pixel_values`` (2) / ``TensorData.inline`` (1) (``vllm_engine.proto``)
VLLM_PIXEL_TAGS = (b"\x3a", b"\x12", b"\x0a")
#: tags of SGLang's ``GenerateRequest.mm_inputs`` (3) / ``MultimodalInputs.pixel_values`` (4) /
#: ``TensorData.data`` (1) (``sglang_scheduler.proto``)
SGLANG_PIXEL_TAGS = (b"\x1a", b"\x22", b"\x0a")


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def record_prefix(tags: Sequence[bytes], nbytes: int) -> bytes:
    """The nested length-delimited records ``tags[0] { tags[1] { ... tags[-1]: <nbytes bytes> } }``
    up to the payload.

    Example: ``record_prefix((b"\\x1a", b"\\x22", b"\\x0a"), 3)`` is ``1a 07 22 05 0a 03``
    (3 payload bytes, inside 1 + 1 + 3 = 5, inside 1 + 1 + 5 = 7).
    """
    lengths = [nbytes]
    for _ in tags[:0:-1]:
        inner = lengths[-1]
        lengths.append(1 + len(varint(inner)) + inner)
    lengths.reverse()
    return b"".join(tag + varint(length) for tag, length in zip(tags, lengths))


@dataclass(frozen=True, slots=True)
class Tail:
    """The encoder input's bytes, placed after the rest of the serialized request."""

    nbytes: int
    array: np.ndarray | None = None  # wire-form values, copied once into the request
    pending: PendingTensor | None = None  # computed straight into the request bytes
    width: int = 0  # values per row of ``pending``
    itemsize: int = 0  # bytes per wire value of ``pending``
    convert: Convert = identity  # float32 block -> wire dtype, for ``pending``


def join_tail(head: bytes, tail: Tail | None, tags: Sequence[bytes],
              targets: Sequence[tuple[PendingTensor, RowTarget]] = ()) -> EncodedRequest:
    """``head`` followed by ``tail`` in the record ``tags`` names (none: ``head`` alone).

    ``targets``: pending tensors already placed elsewhere (shared memory); the tail's own pending
    tensor, if any, is added with its target inside the returned bytes.
    """
    if tail is None:
        return EncodedRequest(head, tuple(targets))
    prefix = head + record_prefix(tags, tail.nbytes)
    if tail.array is not None:
        return EncodedRequest(b"".join((prefix, tail.array.reshape(-1).view(np.uint8).data)), tuple(targets))
    assert tail.pending is not None
    data, view = new_bytes(len(prefix) + tail.nbytes)
    view[:len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    target = BufferTarget(view[len(prefix):], tail.width, tail.itemsize, tail.convert, owner=data,
                          values=tail.pending.dtype)
    return EncodedRequest(data, (*targets, (tail.pending, target)))
