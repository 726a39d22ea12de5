"""The text and logprobs of one chat choice, built token by token from the engine's ids.

Stage: api (response rendering).  In: the token ids of one choice as the engine
streams them (the ``token_ids`` of its :class:`~mmgate.engines.base.EngineEvent` values),
their :class:`~mmgate.engines.base.Logprobs` when requested, then the choice's ``complete``
event; out: text deltas safe to send, the whole text, and OpenAI ``logprobs.content``
entries.

Mirrors vLLM's detokenizer (``vllm/v1/engine/detokenizer.py``, v0.11), which the
engine does not run for the gateway (the wire carries ids only):

- incremental decoding with ``skip_special_tokens`` (``tokenizers``' ``DecodeStream``);
- stop strings (``check_stop_strings``): checked once more than ``min_tokens``
  tokens were generated, in the text the new token added; the text is cut
  before the stop string, or after it with ``include_stop_str_in_output``;
  while streaming, the last ``max(len(stop)) - 1`` characters are held back
  (``stop_buffer_length``) so a stop string is never half sent;
- a choice ended by a stop token (``matched_token_id``) leaves that token's text
  out unless ``include_stop_str_in_output`` (``IncrementalDetokenizer.update``,
  ``stop_terminated``).  Tokens of the request's ``stop_token_ids`` (and, with
  ``skip_special_tokens=false``, every special token: the model's eos among them)
  are held back until the choice is known not to have ended on them.

Logprob entries as vLLM's ``OpenAIServingChat._create_chat_logprobs``
(``vllm/entrypoints/openai/serving_chat.py``): ``token`` is the id decoded alone
without skipping special tokens (``convert_ids_list_to_tokens``), ``logprob``
clamped at -9999.0, ``bytes`` its UTF-8 bytes, ``top_logprobs`` the wire's top
k, most likely first.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.engines.base import EngineEvent, Logprobs
from mmgate.types import SamplingParams

#: vLLM's floor for a logprob in a chat response (``-inf`` is not JSON)
LOGPROB_FLOOR = -9999.0


def check_stop_strings(text: str, new_chars: int, stops: tuple[str, ...], include: bool) -> tuple[str, int] | None:
    """vLLM ``check_stop_strings``: the first stop string in the text the last token added, and where to cut.

    Returns:
        ``(stop, cut)``: the text is cut to ``text[:cut]`` (``cut == -1``: no cut), or None.
    """
    if not new_chars or not stops:
        return None
    for stop in stops:
        index = text.find(stop, 1 - new_chars - len(stop))
        if index == -1:
            continue
        if include:
            index += len(stop)
            if index >= len(text):
                return stop, -1
        return stop, index
    return None


def _special_ids(tokenizer: BundleTokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (where the model's stop tokens are)."""
    decoder = tokenizer.tokenizer.get_added_tokens_decoder()
    return frozenset(i for i, t in decoder.items() if t.special)


class ChoiceText:
    """One choice's text, token count and logprob entries (see the module docstring)."""

    def __init__(self, tokenizer: BundleTokenizer, sampling: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=sampling.skip_special_tokens)
        self._stops = tuple(sampling.stop)
        self._include = sampling.include_stop_str_in_output
        self._min_tokens = sampling.min_tokens
        self._hold_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.skip_special_tokens else _special_ids(tokenizer))
        self._buffer = max(map(len, self._stops)) - 1 if self._stops and not self._include else 0
        self._held: int | None = None
        self._stopped = False
        self._pieces: dict[int, str] = {}
        # Text handed out is never cut again (a stop cut lands at or after it): it is kept as parts, and
        # only the pending text plus a tail of the handed-out text (for a stop string that began in it)
        # is searched and sliced, so a long answer costs linear time.
        self._sent: list[str] = []
        self._pending = ""
        self._tail = ""
        self._window = max(map(len, self._stops), default=0)
        self.tokens = 0  # every generated token, a final stop token included
        self.logprobs: list[dict[str, Any]] | None = [] if sampling.logprobs is not None else None

    def add(self, ids: list[int] | tuple[int, ...], wire: Logprobs | None = None) -> str:
        """Take the next tokens (and their logprobs); the text now safe to send."""
        for token in ids:
            self.tokens += 1
            if self._held is not None:
                self._decode(self._held)
                self._held = None
            if token in self._hold_ids:
                self._held = token
            else:
                self._decode(token)
        if wire is not None and self.logprobs is not None:
            self._add_logprobs(wire)
        return self._take(finished=False)

    def finish(self, complete: EngineEvent) -> str:
        """The choice ended (its ``complete`` event): settle a held stop token; the rest of the text."""
        if self._held is not None:
            # vLLM drops the last token whenever the engine stopped on a token (``stop_terminated``);
            # the SMG servicer leaves ``matched_stop`` empty for EOS, so a plain "stop" counts too.
            unmatched = complete.matched_token_id is None and complete.matched_stop_str is None
            ended_on_it = complete.matched_token_id == self._held or (
                unmatched and complete.finish_reason == "stop")
            if self._include or not ended_on_it:
                self._decode(self._held)
            self._held = None
        return self._take(finished=True)

    @property
    def text(self) -> str:
        """The whole text so far (handed out and pending)."""
        return "".join(self._sent) + self._pending

    def _decode(self, token: int) -> None:
        piece = self._decoder.step(self._tokenizer.tokenizer, token) or ""
        if self._stopped or not piece:
            return
        self._pending += piece
        if self.tokens > self._min_tokens:
            window = self._tail + self._pending
            hit = check_stop_strings(window, len(piece), self._stops, self._include)
            if hit is not None:
                self._stopped = True
                if hit[1] != -1:
                    self._pending = self._pending[:max(hit[1] - len(self._tail), 0)]

    def _take(self, finished: bool) -> str:
        end = len(self._pending) - (0 if finished or self._stopped else self._buffer)
        if end <= 0:
            return ""
        out, self._pending = self._pending[:end], self._pending[end:]
        self._sent.append(out)
        if self._window:
            self._tail = (self._tail + out)[-self._window:]
        return out

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return piece

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self._piece(token)
        return {"token": piece, "logprob": max(logprob, LOGPROB_FLOOR),
                "bytes": list(piece.encode("utf-8", errors="replace"))}

    def _add_logprobs(self, wire: Logprobs) -> None:
        assert self.logprobs is not None
        for i, (token, logprob) in enumerate(zip(wire.token_ids, wire.token_logprobs, strict=False)):
            entry = self._entry(token, logprob)
            top = wire.top_logprobs[i] if i < len(wire.top_logprobs) else None
            entry["top_logprobs"] = [self._entry(t, v) for t, v in zip(top.token_ids, top.values, strict=False)] \
                if top is not None else []
            self.logprobs.append(entry)

    def take_logprobs(self) -> dict[str, Any] | None:
        """``{"content": [...]}`` of the entries added since the last call (None without logprobs)."""
        if self.logprobs is None:
            return None
        content, self.logprobs = self.logprobs, []
        return {"content": content}
