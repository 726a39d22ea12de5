"""``reasoning_content``: the model's thinking split from its answer (``<think>...</think>``).

Stage: api response.  In: the detokenized completion (whole, or as streamed
pieces); out: ``(reasoning, content)``, or per piece the reasoning and content
deltas.

Mirrors vLLM's ``qwen3`` reasoning parser (``vllm/reasoning/qwen3_reasoning_parser.py``
``Qwen3ReasoningParser.extract_reasoning``, the version that takes both template
styles): thinking is open when the model starts with ``<think>`` or the template
put ``<think>`` at the end of the prompt (the Qwen3 thinking templates); then
everything before ``</think>`` is reasoning (the leading ``<think>`` dropped) and
everything after it content (``None`` when empty), and without ``</think>`` the
whole output is reasoning (the thought was cut off).  When thinking is not open
the whole output is content (vLLM also splits a bare ``a</think>b`` there; we do
not, so streamed and whole answers always split alike).

When it runs (see docs/api.md, "Tools and reasoning"): for a model whose chat
template emits ``<think>`` (Qwen3 thinking templates), unless the request sets
``chat_template_kwargs.enable_thinking`` to ``false``.  The bundled Qwen2-VL,
Qwen2.5-VL and Qwen3-VL-Instruct templates do not, so their output is never split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

THINK_START = "<think>"
THINK_END = "</think>"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template emits thinking (its text contains ``<think>``)."""
    return chat_template is not None and THINK_START in chat_template


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` (the model continues its thought)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_START)


def split_reasoning(text: str, started: bool = False) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole completion (``None`` for an empty part).

    ``started``: the prompt opened ``<think>``.  Examples:
    ``"<think>a</think>b"`` -> ``("a", "b")``; ``"<think>a"`` -> ``("a", None)``;
    ``"a</think>b"`` -> ``("a", "b")`` when ``started``, else ``(None, "a</think>b")``;
    ``"b"`` -> ``(None, "b")``, or ``("b", None)`` when ``started``.
    """
    opened = text.startswith(THINK_START)
    if not (started or opened):
        return None, text or None
    body = text[len(THINK_START):] if opened else text
    reasoning, _, content = body.partition(THINK_END)
    return reasoning or None, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """Splits streamed text pieces into reasoning and content deltas, as :func:`split_reasoning` splits the whole.

    ``feed(piece)`` returns ``(reasoning_delta, content_delta)`` (empty strings when
    nothing is ready; a possible partial tag is held back), ``flush()`` the rest.
    The concatenated deltas equal :func:`split_reasoning` of the concatenated pieces
    (with ``""`` for ``None``).
    """

    started: bool = False  # the prompt opened <think>
    _state: str = field(default="start")  # start | thinking | content
    _held: str = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text = self._held + piece
        self._held = ""
        if self._state == "start":
            if len(text) < len(THINK_START) and THINK_START.startswith(text):
                self._held = text
                return "", ""
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
                self._state = "thinking"
            else:  # no opening tag: a thought only if the prompt opened one
                self._state = "thinking" if self.started else "content"
        if self._state == "content":
            return "", text
        if THINK_END in text:
            reasoning, _, content = text.partition(THINK_END)
            self._state = "content"
            return reasoning, content
        keep = _partial_suffix(text, THINK_END)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "content" or (self._state == "start" and not self.started):
            return "", held
        return held, ""
