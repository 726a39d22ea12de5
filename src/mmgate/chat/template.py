"""Chat-template rendering, as transformers renders it.

Stage: render.  In: OpenAI chat messages (plain JSON), the bundle's template
and the tokenizer's special-token strings; out: the prompt text with one
anchor per media item (``<|image_pad|>`` for Qwen-VL).

Mirrors transformers 5.24 ``utils/chat_template_utils.py``
(``_cached_compile_jinja_template``, ``render_jinja_template``) and
``processing_utils.ProcessorMixin.apply_chat_template``: an
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension, the ``tojson`` filter without HTML escaping, the
``raise_exception`` / ``strftime_now`` / ``dict`` / ``namespace`` globals, and
the tokenizer's special tokens (``bos_token`` ...) as template variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mmgate.errors import ErrorCode, GatewayError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` global without attribute access to the class (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` global refusing underscore attributes (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("chat templates cannot store underscore-prefixed attributes")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` blocks and renders their body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' sandbox (cached by source)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigned_names(root: jinja2.nodes.Node, varname: str) -> list[str]:
    """``varname`` and every name assigned from it (or from its elements), transitively."""
    names, queue = [varname], [varname]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if _is_var_or_elems_access(assign.node, current) and isinstance(target, jinja2.nodes.Name):
                if target.name not in names:
                    names.append(target.name)
                    queue.append(target.name)
    return names


@lru_cache(maxsize=16)
def content_format(source: str) -> str:
    """``openai`` when the template loops over a message's ``content`` (it expects a list of parts),
    else ``string``.

    Mirrors vLLM ``vllm/entrypoints/chat_utils.py`` ``_detect_content_format`` (v0.11: a ``for``
    over ``message['content']`` / ``message.content`` of a ``for message in messages`` loop, names
    assigned from ``messages`` included), which decides whether vLLM passes a string ``content`` to
    the template as it is or as ``[{"type": "text", "text": ...}]``.  A template that does not parse
    counts as ``string`` (vLLM's default).
    """
    try:
        root = compile_template(source).environment.parse(source)
    except jinja2.TemplateError:
        return "string"
    message_names: list[str] = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, v) for v in _assigned_names(root, "messages")):
            if isinstance(loop.target, jinja2.nodes.Name):
                message_names.append(loop.target.name)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, v, "content") for v in message_names):
            return "openai"
    return "string"


def _alias_reasoning(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """transformers ``_alias_reasoning_fields``: fill ``reasoning_content`` / ``thinking``."""
    out: list[dict[str, Any]] = []
    for message in messages:
        msg = dict(message)
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """Render ``messages`` into the prompt text.

    Args:
        template: the jinja source.
        messages: plain-JSON chat messages; content parts already mapped to
            what the template expects (an ``image_url`` part stays as is: the
            Qwen-VL templates test ``'image_url' in content``).
        special_tokens: ``bos_token``, ``eos_token``, ... strings (the
            tokenizer's ``special_tokens_map``).
        add_generation_prompt: append the assistant header.
        tools: tool schemas, if any.
        extra: further template variables (``chat_template_kwargs``); they
            override special tokens, as in transformers.
        continue_final_message: the prompt ends where the last message's text ends
            (:func:`_continue_final_message`).

    Raises:
        GatewayError(INVALID_REQUEST): the template raised (``raise_exception``)
            or failed on these messages.
    """
    compiled = compile_template(template)
    variables: dict[str, Any] = {**special_tokens, **(extra or {})}
    if continue_final_message:
        messages = _tag_final_message(messages)
    try:
        rendered = compiled.render(
            messages=_alias_reasoning(messages),
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"chat template refused the conversation: {exc}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"chat template failed on these messages ({type(exc).__name__})") from None
    return _cut_at_tag(rendered) if continue_final_message else rendered


#: transformers 5.24 ``utils/chat_template_utils.py`` ``render_jinja_template``'s ``continue_final_message_tag``
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tag appended to the last message's text (its last text part, or its string
    content), as transformers 5.24 ``render_jinja_template`` does for ``continue_final_message=True``.

    Raises:
        GatewayError(INVALID_REQUEST): no messages, or a last message without text to continue.
    """
    if not messages:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "continue_final_message needs a message to continue", "messages")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                part["text"] = str(part["text"]) + _CONTINUE_TAG
                break
        else:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "continue_final_message is set but the final message has "
                               "no text to continue", "messages")
        last["content"] = parts
    else:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "continue_final_message is set but the final message has no "
                           "content to continue", "messages")
    return [*(dict(m) for m in messages[:-1]), last]


def _cut_at_tag(rendered: str) -> str:
    """The rendered prompt up to the tag (transformers: cut at its last occurrence; when the template trimmed
    the space after it, the text before it is right-stripped too).

    Raises:
        GatewayError(INVALID_REQUEST): the template dropped the final message's text.
    """
    loc = rendered.rfind(_CONTINUE_TAG.strip())
    if loc < 0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "continue_final_message is set but the chat template drops the "
                           "final message", "messages")
    if rendered[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()
