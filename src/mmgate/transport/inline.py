"""Inline tensor transport: numpy arrays <-> ``TensorData`` proto messages.

Stage: transport.  In: a C-contiguous numpy array; out: a
``smg.grpc.common``-compatible ``TensorData`` (``shape``, ``dtype`` name,
raw little-endian bytes in the ``inline`` payload).  The reverse direction is
used by the reference engine and by tests.

Mirrors ``smg_grpc_servicer/tensor_wire.py`` (``tensor_from_parts``,
smg-grpc-servicer 0.14.1): dtype names ``float32``, ``bfloat16``, ``float16``,
``int64``, ``uint32``, ``uint8``.
"""

from __future__ import annotations

import sys

import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.errors import ErrorCode, GatewayError

#: proto dtype name -> numpy dtype (bfloat16 travels as raw uint16 bit patterns)
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint32": np.dtype("<u4"),
    "uint8": np.dtype("u1"),
}

_NUMPY_TO_WIRE: dict[np.dtype, str] = {
    np.dtype("<f4"): "float32",
    np.dtype("<f2"): "float16",
    np.dtype("<i8"): "int64",
    np.dtype("<i4"): "int32",
    np.dtype("<u4"): "uint32",
    np.dtype("u1"): "uint8",
}

assert sys.byteorder == "little", "the wire is little-endian; big-endian hosts are not supported"


def wire_dtype_name(array: np.ndarray) -> str:
    """The proto dtype name for ``array`` (raises GatewayError(INTERNAL_ERROR) if unsupported)."""
    try:
        return _NUMPY_TO_WIRE[array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype]
    except KeyError:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"dtype {array.dtype} has no wire name") from None


def to_tensor_data(array: np.ndarray, dtype_name: str | None = None) -> vllm_engine_pb2.TensorData:
    """Encode ``array`` inline.

    Args:
        array: any shape; made C-contiguous (one copy only if it is not already).
        dtype_name: override the wire dtype name (``"bfloat16"`` for a uint16 array
            holding bfloat16 bit patterns).

    Returns:
        ``TensorData`` with ``shape``, ``dtype`` and ``inline`` bytes.
    """
    array = np.ascontiguousarray(array)
    name = dtype_name or wire_dtype_name(array)
    return vllm_engine_pb2.TensorData(shape=list(array.shape), dtype=name, inline=array.tobytes())


def from_parts(payload: bytes | memoryview, shape: list[int] | tuple[int, ...], dtype_name: str) -> np.ndarray:
    """Decode raw bytes into an array of ``shape``.

    Raises:
        GatewayError(INVALID_REQUEST): unknown dtype or byte count that does not
            match ``shape``.
    """
    dtype = WIRE_DTYPES.get(dtype_name)
    if dtype is None:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"unknown tensor dtype {dtype_name!r}")
    count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if count * dtype.itemsize != len(payload):
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"tensor payload has {len(payload)} bytes, shape {list(shape)} of {dtype_name} needs {count * dtype.itemsize}",
        )
    return np.frombuffer(payload, dtype=dtype).reshape(tuple(shape))


def from_tensor_data(td: vllm_engine_pb2.TensorData) -> np.ndarray:
    """Decode an inline ``TensorData`` (read-only view over the message bytes).

    Raises:
        GatewayError(INVALID_REQUEST): the payload is not inline, or is malformed.
    """
    kind = td.WhichOneof("payload")
    if kind != "inline":
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"tensor payload {kind!r} is not inline")
    return from_parts(td.inline, tuple(td.shape), td.dtype)
