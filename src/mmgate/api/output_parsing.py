"""How a chat completion's text becomes its message: ``reasoning_content``, ``content``, ``tool_calls``.

Stage: api response.  In: the request's :class:`OutputParsing` (built before the
engine call by :func:`output_parsing`), the rendered prompt, and the detokenized
completion, whole or streamed; out: the ``message`` object (non-stream) or the
``delta`` objects (stream), and whether tools were called (``finish_reason:
"tool_calls"`` then, unless the engine stopped for length).

Order, as vLLM's ``serving_chat.py``: the reasoning parser first
(:mod:`mmgate.api.reasoning`), then the tool parser on what is left
(:mod:`mmgate.api.tool_parsing`).  Reasoning is split only for a model whose
chat template emits ``<think>`` and only when the request has no structured-output
constraint: the reference engine applies a constraint from the first generated
token, so a constrained output has no thought to split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmgate.api.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning, template_thinks
from mmgate.api.tool_parsing import ToolCallStream, parse_tool_calls
from mmgate.request.protocol import ChatCompletionRequest
from mmgate.request.structured import ToolChoice, ToolMode, request_constraint, tool_choice


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """Which parsers read a request's output (the default: none, the text is the content)."""

    tools: ToolChoice = ToolChoice(ToolMode.NONE)
    reasoning: bool = False  # split <think>...</think> into reasoning_content

    def message(self, text: str, prompt: str) -> tuple[dict[str, Any], bool]:
        """The ``message`` of a whole completion, and whether it called tools.

        ``prompt`` is the rendered prompt (a thinking template may leave ``<think>`` open at its end).
        """
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning:
            reasoning, content = split_reasoning(text, prompt_opens_thinking(prompt))
        calls: list[dict[str, Any]] = []
        if self.tools.mode is not ToolMode.NONE and content is not None:
            content, calls = parse_tool_calls(content, self.tools)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def stream(self, prompt: str) -> OutputStream:
        """A fresh :class:`OutputStream` for one streamed choice."""
        return OutputStream(self, ReasoningStream(started=prompt_opens_thinking(prompt)) if self.reasoning else None,
                            ToolCallStream(self.tools))


#: no parsing: the text is the content
PLAIN = OutputParsing()


@dataclass
class OutputStream:
    """Streamed text pieces -> ``delta`` objects (``reasoning_content`` / ``content`` / ``tool_calls``)."""

    parsing: OutputParsing
    _reasoning: ReasoningStream | None
    _tools: ToolCallStream
    _pending: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        """Whether a tool call was sent."""
        return self._tools.called

    def _delta(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        text, calls = self._tools.feed(content) if content else ("", [])
        if final:
            more_text, more_calls = self._tools.flush()
            text, calls = text + more_text, calls + more_calls
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        return delta

    def feed(self, piece: str) -> dict[str, Any]:
        """The delta for one detokenized piece (``{}`` when nothing is ready to send)."""
        if self._reasoning is None:
            return self._delta("", piece, final=False)
        reasoning, content = self._reasoning.feed(piece)
        return self._delta(reasoning, content, final=False)

    def flush(self) -> dict[str, Any]:
        """The delta of whatever was held back, at the end of the stream (``{}`` when nothing was)."""
        reasoning, content = self._reasoning.flush() if self._reasoning is not None else ("", "")
        return self._delta(reasoning, content, final=True)


def output_parsing(req: ChatCompletionRequest, chat_template: str | None) -> OutputParsing:
    """The parsers for ``req``'s output on a model with this chat template (see the module docstring)."""
    constrained = request_constraint(req) is not None
    thinking_off = (req.chat_template_kwargs or {}).get("enable_thinking") is False  # the template closes <think>
    return OutputParsing(tools=tool_choice(req),
                         reasoning=template_thinks(chat_template) and not constrained and not thinking_off)
