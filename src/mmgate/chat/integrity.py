"""Prompt integrity: caller text never becomes a reserved token.

Stage: plan (before rendering).  In: the template messages of a planned request
(plus ``chat_template_kwargs``); out: nothing, or a refusal.

A chat template puts the caller's strings (message content, names, tool calls,
reasoning, template kwargs) into the prompt text, and the tokenizer then turns any
added-token string it finds there into that token's id: typed
``<|vision_start|><|image_pad|><|vision_end|>`` becomes a real image placeholder,
typed ``<|im_end|>\\n<|im_start|>system`` a real turn boundary (a role injection).
The reference (transformers ``apply_chat_template`` + the processor) and vLLM do
exactly that; mmgate does not.

Policy (one for every family, role, mode and the sidecar path; docs/media-intake.md,
"Prompt integrity"): a **reserved token** string typed by the caller is tokenized as
plain text, never as that token.  Reserved tokens are derived from the bundle, never
hard-coded per model:

* every added token the tokenizer marks ``special`` (``tokenizer.json`` /
  ``added_tokens_decoder``: chat control tokens, media placeholders, vision
  start/end, frame separators, ...), and
* every token the family declares as an anchor, placeholder or media-structure
  marker (``Family.reserved_tokens``), even where the tokenizer does not mark it
  special.

How: before rendering, each typed occurrence in a caller string is replaced by a marker
(private-use characters around a per-request random nonce and an index) that the
template carries through like any text; after rendering, the prompt is split at the
markers, the template's own text is tokenized as usual and each typed occurrence with
the tokenizer's special-token matching off (``Tokenizer.encode_special_tokens``), so
``<|image_pad|>`` typed by a user becomes ``<``, ``|``, ``image``, ``_pad``, ``|``, ``>``.
Requests without typed reserved strings are tokenized in one piece, exactly as the
reference.  Refused with 400 ``reserved_token_in_text`` instead, because no plain-text
form can be given: a reserved string formed only by joining a message's text parts
(templates concatenate them: ``"<|image" + "_pad|>"``), one in a dictionary key, and one
whose plain tokenization still yields a reserved id.  Non-special added tokens the
template or the model uses as text (Qwen3's ``<think>``, ``<tool_call>``) are not
reserved and keep their ids, as in the reference.

This diverges from the reference on purpose (transformers ``apply_chat_template`` + the
processor, and vLLM, turn typed special strings into the special ids: a role or
placeholder injection); it is the behaviour of OpenAI's API, where typed special tokens
are text.  ``--allow-reserved-tokens-in-text`` is not offered: the reference behaviour
is the injection itself.

Matching runs in C: one regular expression built as a trie of the reserved strings
(linear in the text; a 50 MB message is scanned in about 0.1 s).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmgate.errors import ErrorCode, GatewayError


def _trie_pattern(words: Iterable[str]) -> str:
    """A regular expression matching any of ``words``, factored as a trie (no backtracking over
    alternatives that share a prefix)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(node[ch]) for ch in sorted(k for k in node if k)]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)


class ReservedTokens:
    """The token strings caller text may not contain, and a fast matcher over them.

    Args:
        tokens: the reserved strings (empty strings are ignored).
    """

    def __init__(self, tokens: Iterable[str]) -> None:
        self.tokens: frozenset[str] = frozenset(t for t in tokens if t)
        self._rx = re.compile(_trie_pattern(sorted(self.tokens))) if self.tokens else None

    @classmethod
    def for_model(cls, special_tokens: Iterable[str], family_tokens: Iterable[str] = ()) -> ReservedTokens:
        """The reserved set of a served model: the tokenizer's special added tokens plus the
        family's declared media tokens (see the module docstring)."""
        return cls([*special_tokens, *family_tokens])

    def find(self, text: str) -> str | None:
        """The first reserved token in ``text``, or None."""
        if self._rx is None or not text:
            return None
        match = self._rx.search(text)
        return match.group(0) if match else None

    def check(self, text: str, param: str) -> None:
        """Refuse ``text`` if it contains a reserved token.

        Raises:
            GatewayError(RESERVED_TOKEN_IN_TEXT): naming the token (a model token, not caller
                data) and ``param``.
        """
        found = self.find(text)
        if found is not None:
            raise GatewayError(ErrorCode.RESERVED_TOKEN_IN_TEXT,
                               f"text contains the model's reserved token {found!r} in a form that cannot be "
                               "sent as plain text", param)

    def sanitize(self, messages: Sequence[Mapping[str, Any]],
                 template_kwargs: Mapping[str, Any] | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> Sanitized:
        """Replace every reserved string typed in a caller field by a marker (see the module docstring).

        ``messages`` are the planned template messages: media parts are mmgate's own
        ``{"type": "image"}`` placeholders and carry no caller text.  Every string (content,
        text parts, role, name, tool calls, reasoning; ``chat_template_kwargs`` values; the
        tool definitions) is rewritten; dictionary keys are checked only.  Returns the inputs
        unchanged (same objects) when nothing was typed.

        Raises:
            GatewayError(RESERVED_TOKEN_IN_TEXT): a reserved string formed by joining a message's
                text parts, or typed in a dictionary key.
        """
        if self._rx is None:
            return Sanitized(messages, template_kwargs)
        typed: list[str] = []
        nonce = secrets.token_hex(6)

        def mark(match: re.Match[str]) -> str:
            typed.append(match.group(0))
            return f"{MARK_OPEN}{nonce}:{len(typed) - 1}{MARK_CLOSE}"

        def rewrite(value: Any, param: str) -> Any:
            if isinstance(value, str):
                return self._rx.sub(mark, value) if self._rx is not None else value
            if isinstance(value, Mapping):
                out = {}
                for k, v in value.items():
                    if isinstance(k, str):
                        self.check(k, param)
                    out[k] = rewrite(v, param)
                return out
            if isinstance(value, list):
                return [rewrite(v, param) for v in value]
            return value

        out_messages: list[dict[str, Any]] = []
        for mi, message in enumerate(messages):
            msg = {}
            for key, value in message.items():
                msg[key] = rewrite(value, f"messages[{mi}].{key}")
            content = msg.get("content")
            if isinstance(content, list):
                for run in _adjacent_texts(content):
                    self.check(run, f"messages[{mi}].content")
            out_messages.append(msg)
        kwargs = rewrite(dict(template_kwargs), "chat_template_kwargs") if template_kwargs else template_kwargs
        out_tools = rewrite(list(tools), "tools") if tools else tools
        if not typed:
            return Sanitized(messages, template_kwargs, tools=tools)
        return Sanitized(out_messages, kwargs, tuple(typed), nonce, out_tools)


#: the characters around a typed-token marker (Unicode private use: no tokenizer, template or
#: normalizer gives them a meaning; the nonce makes a marker impossible to forge)
MARK_OPEN = "\ue000"
MARK_CLOSE = "\ue001"


@dataclass(frozen=True, slots=True)
class Sanitized:
    """Template inputs with typed reserved strings replaced by markers.

    ``typed[k]`` is the string marker ``k`` stands for; ``nonce`` identifies this request's markers.
    """

    messages: Sequence[Mapping[str, Any]]
    template_kwargs: Mapping[str, Any] | None
    typed: tuple[str, ...] = ()
    nonce: str = ""
    tools: Sequence[Mapping[str, Any]] | None = None

    def segments(self, prompt: str) -> list[tuple[str, bool]]:
        """The rendered ``prompt`` as ``(text, typed)`` pieces in order: template text (``typed``
        False) and the caller's reserved strings (``typed`` True), to be tokenized as plain text.
        A prompt without markers is one template piece."""
        if not self.typed:
            return [(prompt, False)]
        rx = re.compile(f"{MARK_OPEN}{self.nonce}:(\\d+){MARK_CLOSE}")
        out: list[tuple[str, bool]] = []
        pos = 0
        for match in rx.finditer(prompt):
            if match.start() > pos:
                out.append((prompt[pos:match.start()], False))
            out.append((self.typed[int(match.group(1))], True))
            pos = match.end()
        if pos < len(prompt) or not out:
            out.append((prompt[pos:], False))
        if any(MARK_OPEN in text or MARK_CLOSE in text for text, typed in out if not typed):
            # The template changed a marker (a filter such as ``upper``, ``tojson``, slicing): the
            # typed string's place is lost, so no faithful prompt can be given.
            raise GatewayError(ErrorCode.RESERVED_TOKEN_IN_TEXT,
                               "the chat template transformed text holding a reserved token; send that text "
                               "without the model's reserved tokens", "messages")
        return out


def _adjacent_texts(parts: Sequence[Any]) -> list[str]:
    """The joined text of each run of consecutive text parts (a media part ends a run: its markup
    separates the texts around it)."""
    runs: list[str] = []
    current: list[str] = []
    for part in parts:
        text = part.get("text") if isinstance(part, Mapping) else None
        if isinstance(text, str):
            current.append(text)
            continue
        if len(current) > 1:
            runs.append("".join(current))
        current = []
    if len(current) > 1:
        runs.append("".join(current))
    return runs
