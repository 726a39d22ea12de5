"""The one entry from a chat-completion body to a validated request.

Stage: request.  In: the raw JSON body and the gateway's constraint limits; out: a validated
:class:`~mmgate.request.protocol.ChatCompletionRequest`: its shape and values
(:func:`~mmgate.request.protocol.decode_chat_request`), then its structured-output or tool-choice
constraint (:func:`~mmgate.request.structured.request_constraint`).  Split from ``protocol`` so that
``structured``, which reads the request shapes, is imported by neither of them.
"""

from __future__ import annotations

import msgspec

from mmgate.errors import ErrorCode, GatewayError
from mmgate.request.protocol import ChatCompletionRequest, decode_chat_request
from mmgate.request.structured import request_constraint
from mmgate.config.settings import ConstraintLimits


def parse_chat_request(body: bytes, limits: ConstraintLimits = ConstraintLimits()) -> ChatCompletionRequest:
    """Decode and validate a chat-completion body.

    Returns the request with ``top_k`` normalized: ``-1`` (vLLM's "disabled",
    as vLLM users write it) and ``0`` both become ``0``, the wire's "off".
    ``limits`` bound its structured-output or tool-choice constraint (the gateway's
    ``--constraint-*`` settings; :mod:`mmgate.request.constraint_limits`).

    Raises:
        GatewayError(INVALID_REQUEST): not JSON, nested deeper than
            :data:`~mmgate.request.protocol.MAX_JSON_DEPTH`, not the OpenAI shape, or a value outside its
            range (``param`` names the JSON path; the message never quotes the value), or a
            constraint past ``limits``.
    """
    req = decode_chat_request(body)
    constraint = request_constraint(req, limits)  # structured outputs and tool_choice: at most one constraint, each checked
    if constraint is not None and req.min_tokens:
        # The grammar may allow only its stop token while min_tokens masks it: nothing would be left.
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           "min_tokens cannot be combined with a structured-output or tool-choice constraint",
                           "min_tokens")
    if req.top_k == -1:
        req = msgspec.structs.replace(req, top_k=0)
    return req
