"""Tool calls out of the generated text: the Qwen family's format, and constrained tool choice.

Stage: api response.  In: the detokenized completion (after ``reasoning_content``
is split off, :mod:`mmgate.api.reasoning`), whole or as streamed pieces, and the
request's :class:`~mmgate.request.structured.ToolChoice`; out: ``content`` and OpenAI
``tool_calls`` entries (``{"id", "type": "function", "function": {"name", "arguments"}}``,
``arguments`` a JSON string), or their streamed ``delta.tool_calls`` pieces.

Formats, by tool mode:

- ``auto``: the Qwen / Hermes format the Qwen templates ask for, as vLLM's
  ``hermes`` tool parser reads it (``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py``
  ``Hermes2ProToolParser.extract_tool_calls``, v0.11): every
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the last one may
  be unterminated) is a call; the text before the first ``<tool_call>`` is the
  content (``None`` when empty).  When a block is not JSON of that shape, there are
  no calls and the whole text is the content, as vLLM.
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` (the
  constraint of :func:`mmgate.request.structured.required_tools_schema`), read as vLLM's
  ``serving_chat.py`` reads it; ``content`` is ``None``.
- ``named``: the whole output is the named function's arguments.

Streaming sends a call once it is complete (one ``delta.tool_calls`` entry with
id, name and all arguments), except for ``named``, whose arguments stream piece
by piece after a first delta carrying id and name (as vLLM streams a named tool
choice).  Text that may start a ``<tool_call>`` tag is held back until it is known.
Tool call ids are ``chatcmpl-tool-<32 hex>`` (vLLM ``random_tool_call_id``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mmgate.request.structured import ToolChoice, ToolMode

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def tool_call_id() -> str:
    """A fresh tool call id (vLLM ``random_tool_call_id``: ``chatcmpl-tool-`` + uuid4 hex)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments_json(value: Any) -> str:
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _hermes_call(block: str) -> dict[str, Any] | None:
    """One ``{"name", "arguments"}`` JSON block as a call; ``None`` when it is not one."""
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], _arguments_json(obj.get("arguments")))


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole completion in the Qwen / Hermes format (``auto``).

    ``'hi<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'`` ->
    ``("hi", [{"id": ..., "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}])``.
    """
    if TOOL_CALL_START not in text:
        return text or None, []
    calls = []
    for match in _TOOL_CALL.finditer(text):
        call = _hermes_call(match.group(1) if match.group(1) is not None else match.group(2))
        if call is None:
            return text or None, []
        calls.append(call)
    content = text[: text.find(TOOL_CALL_START)]
    return content or None, calls


def parse_required(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a ``tool_choice: "required"`` completion (a JSON array of
    ``{"name", "parameters"}``); the text as content, without calls, when it is not one (cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return text or None, []
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return text or None, []
    return None, [_call(i["name"], _arguments_json(i.get("parameters"))) for i in items]


def parse_tool_calls(text: str, choice: ToolChoice) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole completion under the request's tool choice."""
    if choice.mode is ToolMode.AUTO:
        return parse_hermes(text)
    if choice.mode is ToolMode.REQUIRED:
        return parse_required(text)
    if choice.mode is ToolMode.NAMED and choice.name is not None:
        return None, [_call(choice.name, text)]
    return text or None, []


def _partial_start(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:n]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """Streamed text pieces -> ``(content_delta, tool_call_deltas)`` under one tool choice.

    ``feed(piece)`` and ``flush()`` each return the content to send now (``""`` for
    none) and the ``delta.tool_calls`` entries to send now (each with its ``index``).
    ``called`` tells whether any call was sent (``finish_reason: "tool_calls"``).
    """

    choice: ToolChoice
    called: bool = False
    _buffer: str = ""  # auto: held text (partial tag or an open block); required: the whole output
    _in_call: bool = False
    _index: int = 0
    _named_started: bool = False
    _content_sent: bool = False
    _calls: list[dict[str, Any]] = field(default_factory=list)

    def _numbered(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"index": self._index, **call})
            self._index += 1
        self.called = self.called or bool(out)
        return out

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.choice.mode
        if mode is ToolMode.NAMED:
            if not self._named_started:
                self._named_started = True
                call = _call(self.choice.name or "", piece)
                return "", self._numbered([call])
            return "", [{"index": 0, "function": {"arguments": piece}}] if piece else []
        if mode is ToolMode.REQUIRED:
            self._buffer += piece
            return "", []
        if mode is not ToolMode.AUTO:
            return piece, []
        return self._feed_hermes(piece)

    def _feed_hermes(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        text = self._buffer + piece
        self._buffer = ""
        content: list[str] = []
        calls: list[dict[str, Any]] = []

        def add(part: str) -> None:  # after the first call, text between calls is not content (vLLM)
            if not (self.called or calls):
                content.append(part)

        while text:
            if not self._in_call:
                start = text.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_start(text)
                    add(text[: len(text) - keep])
                    self._buffer = text[len(text) - keep:]
                    break
                add(text[:start])
                text = text[start + len(TOOL_CALL_START):]
                self._in_call = True
            end = text.find(TOOL_CALL_END)
            if end < 0:
                self._buffer = text  # the open block, without its start tag
                text = ""
                break
            call = _hermes_call(text[:end])
            if call is not None:
                calls.append(call)
            else:  # not a call after all: sent as text, as vLLM falls back to content
                add(TOOL_CALL_START + text[: end + len(TOOL_CALL_END)])
            text = text[end + len(TOOL_CALL_END):]
            self._in_call = False
        return "".join(content), self._numbered(calls)

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        held, self._buffer = self._buffer, ""
        if self.choice.mode is ToolMode.REQUIRED:
            content, calls = parse_required(held)
            return content or "", self._numbered(calls)
        if self.choice.mode is ToolMode.AUTO and held:
            if self._in_call:  # an unterminated last block (vLLM's second pattern)
                self._in_call = False
                call = _hermes_call(held)
                if call is not None:
                    return "", self._numbered([call])
                held = TOOL_CALL_START + held
            return ("" if self.called else held), []
        return held, []
