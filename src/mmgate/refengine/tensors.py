"""Decode one ``TensorData`` message into a torch tensor.

Stage: engine request intake.  In: a ``TensorData`` (shape, dtype name, one
payload); out: a writable CPU ``torch.Tensor`` that owns its memory.

The one place a payload kind is dispatched on: inline bytes today
(:func:`mmgate.transport.inline.from_tensor_data`); a shared-memory branch
slots in here without touching the callers.

Mirrors ``smg_grpc_servicer/tensor_wire.py`` ``tensor_from_parts``
(smg-grpc-servicer 0.14.1): ``bfloat16`` travels as raw 16-bit patterns and
becomes ``torch.bfloat16``; ``uint32`` (grids) widens to ``int64``, the dtype
transformers indexes with.
"""

from __future__ import annotations

import numpy as np
import torch
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport.inline import from_parts, from_tensor_data
from mmgate.transport.shm import ShmError, read_segment


def decode_tensor(td: vllm_engine_pb2.TensorData) -> torch.Tensor:
    """Decode ``td`` into a tensor of its declared shape.

    Args:
        td: ``TensorData`` with an ``inline`` payload, or a ``shm`` handle to a
            ``/dev/shm`` segment, which is read (never through a symlink) and
            then unlinked (SMG convention).

    Returns:
        ``torch.Tensor`` of ``tuple(td.shape)``: float32 / float16 / bfloat16 /
        int64 / int32 / uint8 as sent; ``uint32`` widened to int64.

    Raises:
        GatewayError(INVALID_REQUEST): unknown dtype, byte count that does not
            match the shape, or a payload kind this engine does not read.
    """
    if td.WhichOneof("payload") == "shm":
        try:
            raw = read_segment(td.shm.name, int(td.shm.offset), int(td.shm.nbytes))
        except ShmError as exc:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"shared-memory tensor unreadable: {exc}") from None
        array = from_parts(raw, tuple(td.shape), td.dtype)
    else:
        array = from_tensor_data(td)
    if td.dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    if td.dtype == "uint32":
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
