"""A leg's events -> each wire's ``GenerateResponse`` stream, in the shape its real servicer sends.

Stage: engine response.  In: a :class:`~mmgate.refengine.core.Run` (tokens and choice ends);
out: the wire's response messages, via :func:`drive` and one :class:`Writer` per wire.

The three shapes (smg-grpc-servicer 0.14.1):
  * vLLM (``vllm/servicer.py`` ``_chunk_response`` / ``_complete_response``): streamed, one chunk
    per token (``completion_tokens`` 1, a delta); then a ``GenerateComplete`` per choice carrying
    every output id and the totals (the reference engine's long-standing form; the real servicer
    leaves a streamed Complete's ids to the last delta), logprobs on the chunks or, not streamed,
    on the Complete; a prefill leg's Complete carries ``kv_transfer_params_json``;
  * SGLang (``sglang/servicer.py`` ``Generate``, ``_create_chunk_response``,
    ``_create_completion_response``; ``request_manager.py``): streamed, one chunk per scheduler
    output (a delta, ``completion_tokens`` cumulative), and at the finish the Complete of that
    last output (``output_ids`` = its delta); not streamed, one Complete with every id; the stop
    token stays in the ids;
  * TokenSpeed (``tokenspeed/servicer.py`` ``Generate``, ``_generated_output_ids``,
    ``_chunk_response``, ``_complete_response``): as SGLang, but the matched stop token is trimmed
    from the ids unless ``no_stop_trim``, an empty chunk is skipped unless it is the choice's
    first, and ``completion_tokens`` counts every generated token.  A token that may be the
    matched stop is held back one event to know whether it is trimmed.
Every wire's ``output_logprobs``: the sampled token's logprob and id per position, ``top_logprobs``
only when k > 0 (``_build_output_logprobs`` / ``_convert_output_logprobs_to_proto``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from smg_grpc_proto.generated import (
    sglang_scheduler_pb2,
    tokenspeed_scheduler_pb2,
    vllm_engine_pb2,
)

from mmgate.refengine.core import ChoiceEnd, Run, Token
from mmgate.refengine.generation import FinishReason, GenerationResult
from mmgate.refengine.sampler import TokenLogprobs


def output_logprobs(pb: ModuleType, entries: list[TokenLogprobs], k: int) -> Any:
    """``OutputLogProbs`` of some positions (None when there are none), in wire module ``pb``."""
    if not entries:
        return None
    proto = pb.OutputLogProbs(token_logprobs=[e.logprob for e in entries], token_ids=[e.token_id for e in entries])
    if k > 0:
        proto.top_logprobs.extend(pb.TopLogProbs(values=list(e.top_logprobs[:k]), token_ids=list(e.top_ids[:k]))
                                  for e in entries)
    return proto


def _matched(result: GenerationResult) -> dict[str, Any]:
    if result.matched_token_id is not None:
        return {"matched_token_id": result.matched_token_id}
    if result.matched_stop_str is not None:
        return {"matched_stop_str": result.matched_stop_str}
    return {}


class Writer:
    """One wire's messages for one request (state per choice lives here)."""

    def __init__(self, request_id: str, stream: bool, prompt_tokens: int, k: int) -> None:
        self.request_id = request_id
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.k = k
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprobs]] = {}

    def token(self, event: Token) -> list[Any]:
        self.tokens.setdefault(event.index, []).append(event.token)
        if event.logprobs is not None:
            self.logprobs.setdefault(event.index, []).append(event.logprobs)
        return self.chunk(event) if self.stream else []

    def chunk(self, event: Token) -> list[Any]:
        raise NotImplementedError

    def complete(self, event: ChoiceEnd) -> list[Any]:
        raise NotImplementedError


class VllmWriter(Writer):
    pb = vllm_engine_pb2

    def __init__(self, request_id: str, stream: bool, prompt_tokens: int, k: int,
                 kv_transfer_params: str | None = None) -> None:
        super().__init__(request_id, stream, prompt_tokens, k)
        self.kv_transfer_params = kv_transfer_params

    def chunk(self, event: Token) -> list[Any]:
        lp = [event.logprobs] if event.logprobs is not None else []
        return [self.pb.GenerateResponse(chunk=self.pb.GenerateStreamChunk(
            token_ids=[event.token], prompt_tokens=self.prompt_tokens, completion_tokens=1, index=event.index,
            output_logprobs=output_logprobs(self.pb, lp, self.k)))]

    def complete(self, event: ChoiceEnd) -> list[Any]:
        r = event.result
        done = self.pb.GenerateComplete(output_ids=list(r.output_ids), finish_reason=r.finish_reason.value,
                                        prompt_tokens=self.prompt_tokens, completion_tokens=len(r.output_ids),
                                        index=event.index, **_matched(r))
        if not self.stream:  # a stream carried them on its chunks
            entries = output_logprobs(self.pb, self.logprobs.get(event.index, []), self.k)
            if entries is not None:
                done.output_logprobs.CopyFrom(entries)
        if self.kv_transfer_params is not None:
            done.kv_transfer_params_json = self.kv_transfer_params
        return [self.pb.GenerateResponse(complete=done)]


class SglangWriter(Writer):
    pb = sglang_scheduler_pb2

    def chunk(self, event: Token) -> list[Any]:
        lp = [event.logprobs] if event.logprobs is not None else []
        return [self.pb.GenerateResponse(request_id=self.request_id, chunk=self.pb.GenerateStreamChunk(
            token_ids=[event.token], prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.tokens[event.index]), index=event.index,
            output_logprobs=output_logprobs(self.pb, lp, self.k)))]

    def complete(self, event: ChoiceEnd) -> list[Any]:
        r = event.result
        ids, entries = list(r.output_ids), self.logprobs.get(event.index, [])
        if self.stream:  # the Complete of the finishing output: its delta
            ids, entries = ids[-1:], entries[-1:]
        return [self.pb.GenerateResponse(request_id=self.request_id, complete=self.pb.GenerateComplete(
            output_ids=ids, finish_reason=r.finish_reason.value, prompt_tokens=self.prompt_tokens,
            completion_tokens=len(r.output_ids), index=event.index,
            output_logprobs=output_logprobs(self.pb, entries, self.k), **_matched(r)))]


class TokenSpeedWriter(Writer):
    pb = tokenspeed_scheduler_pb2

    def __init__(self, request_id: str, stream: bool, prompt_tokens: int, k: int, no_stop_trim: bool,
                 stop_token_ids: tuple[int, ...]) -> None:
        super().__init__(request_id, stream, prompt_tokens, k)
        self.no_stop_trim = no_stop_trim
        self.stop_token_ids = frozenset(stop_token_ids)
        self.held: dict[int, Token] = {}
        self.sent: set[int] = set()

    def _chunk(self, index: int, tokens: list[int], lps: list[TokenLogprobs]) -> list[Any]:
        if not tokens and index in self.sent:
            return []
        self.sent.add(index)
        return [self.pb.GenerateResponse(request_id=self.request_id, chunk=self.pb.GenerateStreamChunk(
            token_ids=tokens, prompt_tokens=self.prompt_tokens, completion_tokens=len(self.tokens[index]),
            index=index, output_logprobs=output_logprobs(self.pb, lps, self.k)))]

    def _flush(self, index: int) -> list[Any]:
        held = self.held.pop(index, None)
        if held is None:
            return []
        return self._chunk(index, [held.token], [held.logprobs] if held.logprobs is not None else [])

    def chunk(self, event: Token) -> list[Any]:
        out = self._flush(event.index)
        if not self.no_stop_trim and event.token in self.stop_token_ids:
            self.held[event.index] = event  # trimmed if it turns out to be the matched stop
            return out
        lp = [event.logprobs] if event.logprobs is not None else []
        return out + self._chunk(event.index, [event.token], lp)

    def _trimmed(self, r: GenerationResult, ids: list[int]) -> list[int]:
        if (not self.no_stop_trim and r.finish_reason is FinishReason.STOP and r.matched_token_id is not None
                and ids and ids[-1] == r.matched_token_id):
            return ids[:-1]
        return ids

    def complete(self, event: ChoiceEnd) -> list[Any]:
        r, index, out = event.result, event.index, []
        entries = self.logprobs.get(index, [])
        if self.stream:  # the Complete of the finishing output: its delta (trimmed)
            held = self.held.pop(index, None)
            if held is not None:
                ids = self._trimmed(r, [held.token])
                out += self._chunk(index, ids, entries[-1:][:len(ids)])
            else:
                ids = list(r.output_ids[-1:])  # already sent as a chunk
            entries = entries[-1:][:len(ids)]
        else:
            ids = self._trimmed(r, list(r.output_ids))
            entries = entries[:len(ids)]
        out.append(self.pb.GenerateResponse(request_id=self.request_id, complete=self.pb.GenerateComplete(
            output_ids=ids, finish_reason=r.finish_reason.value, prompt_tokens=self.prompt_tokens,
            completion_tokens=len(r.output_ids), index=index,
            output_logprobs=output_logprobs(self.pb, entries, self.k), **_matched(r))))
        return out


def drive(run: Run, writer: Writer, before_last: Callable[[], None] = lambda: None) -> Iterator[Any]:
    """The wire's messages for ``run``.  The last choice's Complete is held until the model thread
    has ended cleanly (an error after it ends the RPC with a status instead); ``before_last`` runs
    just before it is sent (the request stops being active once the client can see its end)."""
    last_index = run.plan.n - 1
    held: list[Any] = []
    for event in run.events:
        if isinstance(event, Token):
            yield from writer.token(event)
        elif event.index < last_index:
            yield from writer.complete(event)
        else:
            held = writer.complete(event)
    if held:
        before_last()
        yield from held
