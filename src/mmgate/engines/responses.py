"""The answer stream of every wire as neutral events: one reader for the three ``GenerateResponse`` shapes.

Stage: engine -> api.  ``vllm_engine.proto``, ``sglang_scheduler.proto`` and ``tokenspeed_scheduler.proto``
(smg-grpc-proto 0.4) give ``GenerateResponse`` the same ``response`` oneof: a ``chunk``
(``GenerateStreamChunk``: ``token_ids``, counts, ``output_logprobs``, ``index``) or a ``complete``
(``GenerateComplete``: ``output_ids``, ``finish_reason``, counts, ``output_logprobs``, the
``matched_stop`` oneof ``matched_token_id`` | ``matched_stop_str``, ``index``), with the same field names,
so one reader serves them; what differs per wire (vLLM's ``kv_transfer_params_json``) is passed in by
the wire's module.  Each wire's ``events()`` documents what its servicer puts in these fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mmgate.engines.base import EngineEvent, Logprobs, TopLogprobs


def output_logprobs(msg: Any) -> Logprobs | None:
    """``msg.output_logprobs`` (``OutputLogProbs``: per position its token, log probability and top k), or None."""
    if not msg.HasField("output_logprobs"):
        return None
    wire = msg.output_logprobs
    return Logprobs(token_ids=tuple(wire.token_ids), token_logprobs=tuple(wire.token_logprobs),
                    top_logprobs=tuple(TopLogprobs(tuple(t.token_ids), tuple(t.values)) for t in wire.top_logprobs))


def response_events(resp: Any, complete_extra: Callable[[Any], dict[str, Any]] | None = None) -> list[EngineEvent]:
    """One ``GenerateResponse`` as engine events: none for an empty message, else one.

    ``complete_extra(complete)``: further ``EngineEvent`` fields a wire reads from its ``complete``.
    """
    kind = resp.WhichOneof("response")
    if kind == "chunk":
        c = resp.chunk
        return [EngineEvent(kind="chunk", index=c.index, token_ids=tuple(c.token_ids), prompt_tokens=c.prompt_tokens,
                            completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                            logprobs=output_logprobs(c))]
    if kind != "complete":
        return []
    d = resp.complete
    matched = d.WhichOneof("matched_stop")
    return [EngineEvent(
        kind="complete", index=d.index, token_ids=tuple(d.output_ids), prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens, cached_tokens=d.cached_tokens, logprobs=output_logprobs(d),
        finish_reason=d.finish_reason,
        matched_token_id=d.matched_token_id if matched == "matched_token_id" else None,
        matched_stop_str=d.matched_stop_str if matched == "matched_stop_str" else None,
        **(complete_extra(d) if complete_extra is not None else {}))]
