"""Engine RPC failures -> the one error table (:mod:`mmgate.errors`), for every wire.

Stage: transport (the answer of an engine call).  In: a failed gRPC call of any wire's
service (vLLM, SGLang, TokenSpeed: the servicers of smg-grpc-servicer end a refused request
with a gRPC status and its details, never an error message inside the stream); out: a
:class:`~mmgate.errors.GatewayError`.

gRPC status -> error code: RESOURCE_EXHAUSTED for a message over the channel's
size limit (the caller's payload) -> ``multimodal_payload_too_large`` (413, not
retryable); UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED / other RESOURCE_EXHAUSTED
-> ``engine_unavailable`` (503, retryable); INVALID_ARGUMENT /
FAILED_PRECONDITION / OUT_OF_RANGE -> ``engine_rejected`` (400, with the
engine's message, e.g. the model's placeholder/feature mismatch), or
``context_length_exceeded`` (400) when the message is the engine's over-long prompt refusal;
anything else -> ``engine_error`` (502).  An mmgate code the engine carries in the
details (``[code=media_fetch_timeout item=0] ...``, worker-side media
processing) wins when it agrees with the status (:func:`parse_carried_error`).
"""

from __future__ import annotations

import re

import grpc

from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.CANCELLED}
_REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
_ERROR_CODES = frozenset(c.value for c in ErrorCode)
#: gRPC core's RESOURCE_EXHAUSTED details for a message over max_send/max_receive_message_length
#: ("Sent message larger than max (N vs. M)", "Received message larger than max (N vs. M)")
_MESSAGE_TOO_LARGE = re.compile(r"message larger than max", re.IGNORECASE)
#: the engines' refusals of an over-long prompt: vLLM (``entrypoints/openai/serving_engine.py`` "This model's
#: maximum context length is ..."; ``v1/engine/processor.py`` "... is longer than the maximum model length of
#: ..."), SGLang and TokenSpeed (``managers/tokenizer_manager.py`` "The input (N tokens) is longer than the
#: model's context length (M tokens).")
_CONTEXT_TOO_LONG = re.compile(
    r"maximum context length|longer than the maximum model length|max_model_len|longer than the model's context length",
    re.IGNORECASE)
_CARRIED = re.compile(r"\A\[code=([a-z0-9_]+)(?: item=(\d+))?\] ?(.*)\Z", re.DOTALL)


def carried_error_details(code: ErrorCode, message: str, item: int | None = None) -> str:
    """RPC details that carry an mmgate error code from an engine to the gateway.

    Worker-side media processing (``media_refs``) ends a failed request with
    INVALID_ARGUMENT (the caller's mistake) or UNAVAILABLE (a transient fault)
    and these details, e.g. ``[code=media_fetch_timeout item=1] media fetch
    timed out``: ``item`` is the index into ``media_refs``.
    """
    where = f" item={item}" if item is not None else ""
    return f"[code={code.value}{where}] {message}"


def parse_carried_error(status: grpc.StatusCode, details: str) -> GatewayError | None:
    """The :class:`GatewayError` carried in ``details`` (see :func:`carried_error_details`), or None.

    The code is taken only when the status agrees with it (a 4xx code with
    INVALID_ARGUMENT, a retryable code with UNAVAILABLE); the item index
    becomes ``param = "media_refs[i]"``, which the forwarding path maps back
    to the content part.
    """
    match = _CARRIED.match(details)
    if match is None or match.group(1) not in _ERROR_CODES:
        return None
    code = ErrorCode(match.group(1))
    spec = ERROR_TABLE[code]
    agrees = (status in _REJECTED and spec.status < 500) or (status in _UNAVAILABLE and spec.retryable)
    if not agrees:
        return None
    param = f"media_refs[{match.group(2)}]" if match.group(2) is not None else None
    return GatewayError(code, match.group(3)[:500], param)


def map_rpc_error(exc: grpc.aio.AioRpcError | grpc.RpcError) -> GatewayError:
    """The stable error for a failed RPC (details kept, they come from the engine, not the caller).

    An mmgate code carried in the details (:func:`parse_carried_error`) wins;
    otherwise the status decides as the module docstring says.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    carried = parse_carried_error(code, details)
    if carried is not None:
        return carried
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_TOO_LARGE.search(details):
        return GatewayError(ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE,
                            "the request's encoder input exceeds the gRPC message limit of the engine channel")
    if code in _UNAVAILABLE:
        return GatewayError(ErrorCode.ENGINE_UNAVAILABLE, f"engine unavailable ({code.name})")
    if code in _REJECTED:
        if _CONTEXT_TOO_LONG.search(details):
            return GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                "the prompt and max_tokens do not fit the engine's context length", "messages")
        return GatewayError(ErrorCode.ENGINE_REJECTED, f"engine rejected the request: {details[:500]}")
    return GatewayError(ErrorCode.ENGINE_ERROR, f"engine error ({code.name}): {details[:300]}")
