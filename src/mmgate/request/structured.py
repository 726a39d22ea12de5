"""Structured outputs and tool choice of a chat request -> one :class:`~mmgate.types.Constraint`.

Stage: api (checked by ``parse_chat_request``) and pipeline (``Pipeline._sampling``
maps the request's constraint onto :class:`~mmgate.types.SamplingParams`).  In: a
decoded :class:`~mmgate.request.protocol.ChatCompletionRequest`; out: the constraint
(or ``None``) and the request's :class:`ToolMode`.

Sources of a constraint, at most one per request (vLLM refuses more than one:
``ChatCompletionRequest.check_structured_outputs_count``, ``vllm/entrypoints/openai/protocol.py``):
``response_format`` (``json_object``, ``json_schema``; ``text`` is none), vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, the
fields of vLLM's ``structured_outputs`` object, and ``tool_choice`` ``"required"`` or
a named function.  The tool-choice schemas are vLLM's
(``ChatCompletionRequest._get_json_schema_from_tool``, v0.11): ``"required"`` -> a
JSON array of at least one ``{"name", "parameters"}`` object, one ``anyOf`` branch
per tool (``$defs`` of the tools hoisted); a named function -> that function's
``parameters`` schema, the whole output being its arguments.

Invariants: every refusal is a 400 ``invalid_request`` whose ``param`` names the
field and whose message never quotes the caller's value.  With the gateway's
:class:`~mmgate.config.settings.ConstraintLimits` (``parse_chat_request``), each constraint's
shape is bounded before it is accepted (:mod:`mmgate.request.constraint_limits`): nothing a
caller sends can make a worker's grammar compiler freeze or crash, and JSON text given in
a string is depth-scanned before it is decoded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from mmgate.request import constraint_limits as bounds
from mmgate.request.protocol import ChatCompletionRequest, NamedToolChoice, Tool, check_json_depth
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import CONSTRAINT_DEPTH_CEILING, ConstraintLimits
from mmgate.types import Constraint, ConstraintKind

#: ``response_format.type`` values (OpenAI's three)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
#: ``tool_choice`` strings (OpenAI's)
TOOL_CHOICES = ("none", "auto", "required")


class ToolMode(StrEnum):
    """How the output of a request is read for tool calls (:mod:`mmgate.api.tool_parsing`)."""

    NONE = "none"  # no tools, or tool_choice "none": the output is content
    AUTO = "auto"  # the model may call tools in the Qwen (hermes) format; parsed out of the text
    REQUIRED = "required"  # the output is a JSON array of {"name", "parameters"} (constrained)
    NAMED = "named"  # the output is the named function's arguments (constrained)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The request's tool mode, and the function name when ``mode`` is ``NAMED``."""

    mode: ToolMode
    name: str | None = None


def _refuse(message: str, param: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def _json_document(value: Any, param: str, limits: ConstraintLimits | None) -> Any:
    """``value``, or the JSON text it holds decoded once its nesting is known to be within the depth bound
    (``limits.max_depth``; without limits :data:`~mmgate.config.settings.CONSTRAINT_DEPTH_CEILING`), so the
    decoder never recurses past it."""
    if not isinstance(value, str):
        return value
    check_json_depth(value.encode(), param, limits.max_depth if limits else CONSTRAINT_DEPTH_CEILING)
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise _refuse(f"{param} must be a JSON schema (a JSON object or its JSON text)", param) from None


def _schema_object(value: Any, param: str, limits: ConstraintLimits | None) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text; refused unless it is a JSON object within ``limits``."""
    value = _json_document(value, param, limits)
    if not isinstance(value, dict):
        raise _refuse(f"{param} must be a JSON schema (a JSON object)", param)
    if limits is not None:
        bounds.check_document(value, param, limits)
    return value


#: longest accepted regex constraint, in characters (compiling is checked on the event loop: a
#: 900 KB pattern took 2.6 s to compile)
MAX_REGEX_CHARS = 16 * 1024


def _regex(value: str, param: str, limits: ConstraintLimits | None) -> Constraint:
    if len(value) > MAX_REGEX_CHARS:
        raise _refuse(f"{param} is longer than {MAX_REGEX_CHARS} characters", param)
    if limits is not None:
        bounds.check_regex(value, param, limits)  # before re.compile, which recurses per nested group
    try:
        re.compile(value)
    except (re.error, RecursionError, OverflowError):
        raise _refuse(f"{param} must be a valid regular expression", param) from None
    return Constraint(ConstraintKind.REGEX, value)


def _choice(value: list[str], param: str, limits: ConstraintLimits | None) -> Constraint:
    if not value:
        raise _refuse(f"{param} must be a non-empty list of strings", param)
    if limits is not None:
        bounds.check_choices(value, param, limits)
    return Constraint(ConstraintKind.CHOICE, json.dumps(value))


def _grammar(value: str, param: str, limits: ConstraintLimits | None) -> Constraint:
    if not value.strip():
        raise _refuse(f"{param} must be a non-empty grammar", param)
    if limits is not None:
        bounds.check_grammar(value, param, limits)
    return Constraint(ConstraintKind.GRAMMAR, value)


def _json_schema(value: Any, param: str, limits: ConstraintLimits | None) -> Constraint:
    return _schema_constraint(_schema_object(value, param, limits), param, limits)


def _schema_constraint(schema: dict[str, Any], param: str, limits: ConstraintLimits | None) -> Constraint:
    """The schema's JSON text as the worker receives it, bounded by ``limits.max_chars``."""
    text = json.dumps(schema)
    if limits is not None:
        bounds.check_chars(len(text), param, limits)
    return Constraint(ConstraintKind.JSON_SCHEMA, text)


def _response_format(req: ChatCompletionRequest, limits: ConstraintLimits | None) -> Constraint | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT, "")
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise _refuse("response_format of type json_schema needs json_schema", "response_format.json_schema")
        return _json_schema(fmt.json_schema.schema, "response_format.json_schema.schema", limits)
    raise _refuse(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}", "response_format.type")


def _checked(holder: Any, prefix: str, limits: ConstraintLimits | None) -> list[tuple[str, Constraint]]:
    """The json / regex / choice / grammar constraints set on ``holder`` (fields ``<prefix>json`` ...
    for the request's ``guided_*``; ``json`` ... of ``structured_outputs``), each checked, named by
    its field."""
    found: list[tuple[str, Constraint]] = []
    for key, check in (("json", _json_schema), ("regex", _regex), ("choice", _choice), ("grammar", _grammar)):
        value = getattr(holder, key if prefix.endswith(".") else prefix + key)
        if value is not None:
            param = prefix + key
            found.append((param, check(value, param, limits)))  # type: ignore[operator]
    return found


def _structured_outputs(req: ChatCompletionRequest, limits: ConstraintLimits | None) -> list[tuple[str, Constraint]]:
    so = req.structured_outputs
    if so is None:
        return []
    found = _checked(so, "structured_outputs.", limits)
    if so.json_object:
        found.append(("structured_outputs.json_object", Constraint(ConstraintKind.JSON_OBJECT, "")))
    if so.structural_tag is not None:
        param = "structured_outputs.structural_tag"
        if limits is not None:
            bounds.check_chars(len(so.structural_tag), param, limits)
        _schema_object(so.structural_tag, param, limits)
        found.append(("structured_outputs.structural_tag",
                      Constraint(ConstraintKind.STRUCTURAL_TAG, so.structural_tag)))
    return found


def tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    """The request's :class:`ToolChoice` (OpenAI's default: ``"auto"`` with tools, ``"none"`` without).

    Raises:
        GatewayError(INVALID_REQUEST): an unknown ``tool_choice`` string; ``"required"`` or a
            named function without ``tools``; a named function that is not among ``tools``
            (vLLM ``ChatCompletionRequest.check_tool_usage``).
    """
    choice = req.tool_choice
    tools = req.tools or []
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise _refuse("tool_choice.type must be function", "tool_choice.type")
        if not any(t.function.name == choice.function.name for t in tools):
            raise _refuse("tool_choice names a function that is not in tools", "tool_choice.function.name")
        return ToolChoice(ToolMode.NAMED, choice.function.name)
    if choice is None:
        return ToolChoice(ToolMode.AUTO if tools else ToolMode.NONE)
    if choice not in TOOL_CHOICES:
        raise _refuse(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise _refuse("tool_choice required needs tools", "tool_choice")
    if choice == "none" or not tools:
        return ToolChoice(ToolMode.NONE)
    return ToolChoice(ToolMode(choice))


def _check_tools(tools: list[Tool]) -> None:
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise _refuse("tools[].type must be function", f"tools[{i}].type")
        if not tool.function.name:
            raise _refuse("a tool's function name must not be empty", f"tools[{i}].function.name")


def _tool_parameters(tool: Tool) -> dict[str, Any]:
    """A tool's parameters schema (an empty object schema when it has none), as vLLM's ``_get_tool_schema``."""
    return dict(tool.function.parameters) if tool.function.parameters else {"type": "object", "properties": {}}


def required_tools_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"`` (vLLM ``_get_json_schema_from_tool``, v0.11).

    ``{"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [one per tool]}}``
    where a tool's branch is ``{"properties": {"name": {"type": "string", "enum": [name]},
    "parameters": <its parameters>}, "required": ["name", "parameters"]}``; the tools'
    ``$defs`` move to the top (refused when two tools define one name differently).
    ``parallel=False`` (``parallel_tool_calls: false``) adds ``"maxItems": 1``: one call at
    most, enforced by the grammar (vLLM keeps only the first call after the fact).

    Raises:
        GatewayError(INVALID_REQUEST): conflicting ``$defs``, or ``$defs`` that is not an object.
    """
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        params = _tool_parameters(tool)
        tool_defs = params.pop("$defs", None) or {}
        if not isinstance(tool_defs, dict):
            raise _refuse("a tool's parameters $defs must be an object", f"tools[{i}].function.parameters.$defs")
        for name, definition in tool_defs.items():
            if name in defs and defs[name] != definition:
                raise _refuse("two tools define one $defs name differently", f"tools[{i}].function.parameters")
            defs[name] = definition
        branches.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def request_constraint(req: ChatCompletionRequest, limits: ConstraintLimits | None = None) -> Constraint | None:
    """The request's one structured-output constraint, checked (``None`` when it has none).

    With ``limits`` (the gateway's, at parse time), each constraint's shape is bounded too
    (:mod:`mmgate.request.constraint_limits`); without, the request is taken as already checked
    (later stages build the same constraint again).

    Raises:
        GatewayError(INVALID_REQUEST): more than one constraint (``param`` names the first
            two fields), a schema that is not a JSON object, a regex that does not compile,
            an empty choice list or grammar, an unknown ``response_format.type`` or
            ``tool_choice``, a tool that is not a function, a constraint past ``limits``
            (``param`` the field, the message the limit).
    """
    found: list[tuple[str, Constraint]] = []
    fmt = _response_format(req, limits)
    if fmt is not None:
        found.append(("response_format", fmt))
    found += _checked(req, "guided_", limits)
    found += _structured_outputs(req, limits)
    _check_tools(req.tools or [])
    choice = tool_choice(req)
    tools = req.tools or []
    if choice.mode is ToolMode.REQUIRED:
        if limits is not None:
            for i, tool in enumerate(tools):
                bounds.check_document(tool.function.parameters or {}, f"tools[{i}].function.parameters", limits)
        schema = required_tools_schema(tools, parallel=req.parallel_tool_calls is not False)
        found.append(("tool_choice", _tools_constraint(schema, "tools", limits)))
    elif choice.mode is ToolMode.NAMED:
        i, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == choice.name)
        found.append(("tool_choice", _tools_constraint(_tool_parameters(tool), f"tools[{i}].function.parameters",
                                                       limits)))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise _refuse("at most one structured-output constraint per request; this one sets "
                      + ", ".join(names), names[1])
    return found[0][1] if found else None


def _tools_constraint(schema: dict[str, Any], param: str, limits: ConstraintLimits | None) -> Constraint:
    """A tool-choice schema as one constraint, bounded as a whole (the tools' shapes add up in it)."""
    if limits is not None:
        bounds.check_document(schema, param, limits)
    return _schema_constraint(schema, param, limits)


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template receives them (``None`` without tools).

    As vLLM passes ``[tool.model_dump() for tool in request.tools]`` to the template
    (``serving_chat.py``), without the fields the caller left unset; the Qwen templates
    render each with ``tool | tojson`` inside ``<tools></tools>``.
    """
    if not req.tools:
        return None
    out = []
    for tool in req.tools:
        function = {k: v for k, v in msgspec.to_builtins(tool.function).items() if v is not None}
        out.append({"type": tool.type, "function": function})
    return out
