"""Decode one ``TensorData`` message into a torch tensor.

Stage: engine request intake.  In: a ``TensorData`` (shape, dtype name, one
payload); out: a writable CPU ``torch.Tensor`` that owns its memory.

The one place a payload kind is dispatched on: inline bytes
(:func:`mmgate.transport.inline.from_tensor_data`) or a shared-memory handle, for the
vLLM and TokenSpeed ``TensorData`` (the same ``payload`` oneof in both protos, as
``smg_grpc_servicer/mm_shm.py`` reads them); the SGLang wire's bare ``data`` bytes
through :func:`tensor_from_bytes`.

Mirrors ``smg_grpc_servicer/tensor_wire.py`` ``tensor_from_parts``
(smg-grpc-servicer 0.14.1): a dtype name outside its ``PROTO_DTYPE_MAP``
(:data:`mmgate.engines.wire_values.SERVICER_DTYPES`; int32 among them) is refused,
as the servicer refuses it; ``bfloat16`` travels as raw 16-bit patterns and
becomes ``torch.bfloat16``; ``uint32`` (grids) widens to ``int64``, the dtype
transformers indexes with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2, vllm_engine_pb2

from mmgate.engines.wire_values import SERVICER_DTYPES
from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport.inline import from_parts, from_tensor_data
from mmgate.transport.shm import ShmError, read_segment


def decode_tensor(td: vllm_engine_pb2.TensorData | tokenspeed_scheduler_pb2.TensorData) -> torch.Tensor:
    """Decode ``td`` into a tensor of its declared shape.

    Args:
        td: ``TensorData`` with an ``inline`` payload, or a ``shm`` handle to a
            ``/dev/shm`` segment, which is read (never through a symlink) and
            then unlinked (SMG convention).

    Returns:
        ``torch.Tensor`` of ``tuple(td.shape)``: float32 / float16 / bfloat16 /
        int64 / uint8 as sent; ``uint32`` widened to int64.

    Raises:
        GatewayError(INVALID_REQUEST): unknown dtype, byte count that does not
            match the shape, or a payload kind this engine does not read.
    """
    _check_dtype(td.dtype)
    if td.WhichOneof("payload") == "shm":
        try:
            raw = read_segment(td.shm.name, int(td.shm.offset), int(td.shm.nbytes))
        except ShmError as exc:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"shared-memory tensor unreadable: {exc}") from None
        array = from_parts(raw, tuple(td.shape), td.dtype)
    else:
        array = from_tensor_data(td)
    return _to_torch(array, td.dtype)


def tensor_from_bytes(data: bytes, shape: Sequence[int], dtype_name: str) -> torch.Tensor:
    """A tensor from raw bytes + shape + dtype name: the SGLang wire's ``TensorData`` (``data``, no
    payload oneof), read as ``tensor_wire.tensor_from_parts`` reads it (with ``uint32`` widened to
    int64 and bfloat16 kept, as :func:`decode_tensor`).

    Raises:
        GatewayError(INVALID_REQUEST): unknown dtype, or a byte count that does not match the shape.
    """
    _check_dtype(dtype_name)
    return _to_torch(from_parts(data, tuple(shape), dtype_name), dtype_name)


def _check_dtype(dtype_name: str) -> None:
    if dtype_name not in SERVICER_DTYPES:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"Unsupported proto tensor dtype: {dtype_name!r}")


def _to_torch(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    if dtype_name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    if dtype_name == "uint32":
        return torch.from_numpy(array.astype(np.int64))
    return torch.from_numpy(array.copy())


def require_shape(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """Refuse a tensor whose rank is not ``ndim``.

    Raises:
        GatewayError(INVALID_REQUEST): naming the tensor and both ranks.
    """
    if tensor.ndim != ndim:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"tensor {name!r} has shape {list(tensor.shape)}; expected {ndim} dimensions",
        )
