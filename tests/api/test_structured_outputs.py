"""Structured outputs, tools and reasoning on /v1/chat/completions (issue 14, H-C2).

Through a real gateway process to the reference engine process (random weights,
so the text is noise: every constraint below must still hold), with the
``openai`` client where the issue asks for it; the parsers on fixed texts; the
request checks; the prompt with tools against transformers' own rendering.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from mmgate.api.output_parsing import output_parsing
from mmgate.request.parse import parse_chat_request
from mmgate.api.reasoning import ReasoningStream, split_reasoning
from mmgate.request.structured import ToolChoice, ToolMode, request_constraint, required_tools_schema, template_tools
from mmgate.api.tool_parsing import ToolCallStream, parse_hermes
from mmgate.chat.template import render_chat
from mmgate.engines.vllm import sampling_message
from mmgate.errors import GatewayError
from mmgate.cli.launch import start_engine, start_gateway
from mmgate.models.bundle import resolve_bundle
from mmgate.refengine.bundle import LazyTokenizer
from mmgate.refengine.config import CompileLimits
from mmgate.refengine.constraint_pool import ConstraintCompiler
from mmgate.refengine.constraint_worker import choice_grammar
from mmgate.types import Constraint, ConstraintKind, SamplingParams
from tests.abuse.support import DEFAULT_MODEL, Stack, bundle_path, chat_body, running_stack

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
#: a schema whose every value is bounded, so noise ends within a few dozen tokens
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("structured")) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(stack: Stack, **fields: Any) -> httpx.Response:
    return httpx.post(f"{stack.base}/v1/chat/completions", json=chat_body(**fields), timeout=120)


def _content(stack: Stack, **fields: Any) -> str:
    r = _post(stack, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the grammar ended it, not max_tokens
    return str(choice["message"]["content"])


# ---- through the gateway to the reference engine ----------------------------------------------


def test_json_schema_output_validates_against_the_schema(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Describe a color."}], max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), SCHEMA)


def test_json_object_output_is_one_object(stack: Stack) -> None:
    # the bias makes "{}" the model's pick at every step: unconstrained it repeats until max_tokens,
    # constrained the object is complete after one and the turn ends
    ids = AutoTokenizer.from_pretrained(bundle_path()).convert_tokens_to_ids(["{}"])
    bias = {str(ids[0]): 100}
    free = _post(stack, max_tokens=4, logit_bias=bias).json()["choices"][0]
    assert free["finish_reason"] == "length" and free["message"]["content"] == "{}" * 4
    content = _content(stack, max_tokens=4, logit_bias=bias, response_format={"type": "json_object"})
    assert json.loads(content) == {}


def test_guided_choice_output_is_one_of_the_choices(stack: Stack) -> None:
    choices = ["yes", "no", "maybe so"]
    assert _content(stack, max_tokens=16, guided_choice=choices) in choices


def test_guided_regex_output_fullmatches(stack: Stack) -> None:
    pattern = r"[0-9]{3}-[a-z]{2}"
    assert re.fullmatch(pattern, _content(stack, max_tokens=16, guided_regex=pattern))


def test_guided_grammar_output_is_in_the_language(stack: Stack) -> None:
    grammar = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9]'
    assert re.fullmatch(r"\([1-9](\+[1-9])?\)", _content(stack, max_tokens=16, guided_grammar=grammar))


def test_structured_outputs_field_takes_a_regex(stack: Stack) -> None:
    assert re.fullmatch(r"[A-C]{2}", _content(stack, max_tokens=8, structured_outputs={"regex": "[A-C]{2}"}))


def _valid_arguments(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])  # type: ignore[index]


def test_tool_choice_required_returns_a_parsed_tool_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)  # type: ignore[list-item]
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert calls[0].id.startswith("chatcmpl-tool-")
    _valid_arguments(calls[0].function.arguments)  # type: ignore[union-attr]


def test_named_tool_choice_streams_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=64, stream=True,
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})  # type: ignore[list-item]
    names, arguments, finish = [], "", None
    for chunk in stream:
        choice = chunk.choices[0]
        for call in choice.delta.tool_calls or ():
            assert call.index == 0
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    # A function forced by name finishes "stop", as vLLM and OpenAI report it (auto/required: "tool_calls").
    assert names == ["get_weather"] and finish == "stop"
    _valid_arguments(arguments)


def test_tool_choice_required_streams_the_whole_call(stack: Stack) -> None:
    body = chat_body(max_tokens=64, stream=True, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=body, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", ())]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    _valid_arguments(calls[0]["function"]["arguments"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "(", }, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_constraints_are_refused_naming_the_field(stack: Stack, fields: dict[str, Any], param: str) -> None:
    r = _post(stack, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_grammar_the_engine_cannot_compile_is_refused(stack: Stack) -> None:
    r = _post(stack, guided_grammar="root ::= undefined_rule")
    assert r.status_code == 400 and r.json()["error"]["code"] == "engine_rejected", r.text


# ---- request checks and the wire -----------------------------------------------------------------


def _req(**fields: Any) -> Any:
    return parse_chat_request(json.dumps(chat_body(**fields)).encode())


def test_constraints_map_onto_the_wire_oneof() -> None:
    cases = {
        "json_schema": (_req(guided_json={"type": "object"}), "json_schema", '{"type": "object"}'),
        "regex": (_req(guided_regex="a+"), "regex", "a+"),
        "grammar": (_req(guided_grammar='root ::= "a"'), "grammar", 'root ::= "a"'),
        "json_object": (_req(response_format={"type": "json_object"}), "json_object", True),
    }
    for req, field, value in cases.values():
        wire = sampling_message(SamplingParams(constraint=request_constraint(req)))
        assert wire.WhichOneof("constraint") == field and getattr(wire, field) == value
    wire = sampling_message(SamplingParams(constraint=request_constraint(_req(guided_choice=["a", "b"]))))
    assert wire.WhichOneof("constraint") == "choice" and list(wire.choice.choices) == ["a", "b"]
    assert request_constraint(_req(response_format={"type": "text"})) is None
    assert request_constraint(_req(tools=[WEATHER], tool_choice="auto")) is None


def test_required_tool_choice_schema_is_vllms() -> None:
    req = _req(tools=[WEATHER], tool_choice="required")
    expected = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]},  # type: ignore[index]
         "required": ["name", "parameters"]}]}}
    assert required_tools_schema(req.tools) == expected
    assert request_constraint(req) == Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(expected))
    named = request_constraint(_req(tools=[WEATHER], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}))
    assert named == Constraint(ConstraintKind.JSON_SCHEMA,
                               json.dumps(WEATHER["function"]["parameters"]))  # type: ignore[index]


def test_two_constraints_are_refused() -> None:
    with pytest.raises(GatewayError) as info:
        _req(guided_choice=["a"], structured_outputs={"regex": "a"})
    assert info.value.param == "structured_outputs.regex"


def test_tools_render_as_transformers_renders_them() -> None:
    name = "Qwen/Qwen3-VL-2B-Instruct"
    bundle = resolve_bundle(bundle_path(name), [])
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reference = AutoTokenizer.from_pretrained(bundle_path(name)).apply_chat_template(
        messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert bundle.chat_template is not None
    ours = render_chat(bundle.chat_template, messages, {}, tools=template_tools(_req(tools=[WEATHER])))
    assert ours == reference and "<tools>" in ours


# ---- parsers on fixed texts ---------------------------------------------------------------------


QWEN_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>')


def test_hermes_parser_reads_qwen_tool_calls() -> None:
    content, calls = parse_hermes(QWEN_CALLS)
    assert content == "Let me check.\n"
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
        {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert parse_hermes('<tool_call>\n{"name": "f", "arguments": {}}') [1][0]["function"] == {
        "name": "f", "arguments": "{}"}  # unterminated last block, as vLLM's second pattern
    assert parse_hermes("a <tool_call>not json</tool_call>") == ("a <tool_call>not json</tool_call>", [])
    assert parse_hermes("plain") == ("plain", [])


def test_streamed_tool_calls_equal_the_whole_parse() -> None:
    for size in (1, 2, 3, 7, 64):
        stream = ToolCallStream(ToolChoice(ToolMode.AUTO))
        content, calls = "", []
        for i in range(0, len(QWEN_CALLS), size):
            text, more = stream.feed(QWEN_CALLS[i:i + size])
            content, calls = content + text, calls + more
        text, more = stream.flush()
        content, calls = content + text, calls + more
        assert content == "Let me check.\n" and [c["index"] for c in calls] == [0, 1] and stream.called
        assert [c["function"] for c in calls] == [c["function"] for c in parse_hermes(QWEN_CALLS)[1]]


def test_reasoning_is_split_from_think_tags() -> None:
    assert split_reasoning("<think>\nWhy.\n</think>\n\nBecause.") == ("\nWhy.\n", "\n\nBecause.")
    assert split_reasoning("Why.</think>Because.", started=True) == ("Why.", "Because.")
    assert split_reasoning("<think>Still thinking") == ("Still thinking", None)
    assert split_reasoning("No thought.") == (None, "No thought.")
    text = "<think>\nWhy.\n</think>\n\nBecause."
    for size in (1, 2, 5, 100):
        stream, reasoning, content = ReasoningStream(), "", ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.flush()
        assert (reasoning + r, content + c) == ("\nWhy.\n", "\n\nBecause.")


def test_reasoning_content_only_for_templates_that_think() -> None:
    thinking = "{{- '<|im_start|>assistant\\n<think>\\n' }}"  # a Qwen3 thinking template's generation prompt
    prompt = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    text = "Because.\n</think>\n\nIt is so."
    parsed = output_parsing(_req(), thinking).message(text, prompt)
    assert parsed == ({"role": "assistant", "reasoning_content": "Because.\n", "content": "\n\nIt is so."}, False)
    plain = output_parsing(_req(), "{{ messages }}").message(text, prompt)
    assert plain == ({"role": "assistant", "content": text}, False)
    # a constrained output starts at the first token: nothing to split
    assert not output_parsing(_req(guided_regex="a"), thinking).reasoning
    with_tools = output_parsing(_req(tools=[WEATHER]), thinking).message("Hm.</think>" + QWEN_CALLS, prompt)
    assert with_tools[1] and with_tools[0]["reasoning_content"] == "Hm." and len(with_tools[0]["tool_calls"]) == 2


def test_engine_compiles_structural_tags_and_refuses_what_xgrammar_cannot() -> None:
    compiler = ConstraintCompiler(LazyTokenizer(Path(bundle_path())), 151936, CompileLimits())  # Qwen2-VL vocab_size
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    try:
        assert compiler.compile(Constraint(ConstraintKind.STRUCTURAL_TAG, json.dumps(tag)), threading.Event())
        for bad in (Constraint(ConstraintKind.STRUCTURAL_TAG, '{"begin": "x"}'), Constraint(ConstraintKind.REGEX, "(")):
            with pytest.raises(GatewayError) as info:
                compiler.compile(bad, threading.Event())
            assert info.value.code.value == "invalid_request"
    finally:
        compiler.close()
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def _thinking_bundle(folder: Path) -> Path:
    """The Qwen3-VL-2B-Instruct bundle with a thinking template: its generation prompt opens ``<think>``,
    as the Qwen3-VL Thinking templates do (every other file linked unchanged)."""
    source = Path(bundle_path("Qwen/Qwen3-VL-2B-Instruct"))
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "chat_template.json":
            (folder / item.name).symlink_to(item)
    template = json.loads((source / "chat_template.json").read_text())["chat_template"]
    opened = template.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert opened != template
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": opened}))
    return folder


def test_reasoning_content_on_a_thinking_template(tmp_path: Path) -> None:
    bundle = str(_thinking_bundle(tmp_path / "Qwen--Qwen3-VL-2B-Thinking-test"))
    engine = start_engine(bundle, log_dir=tmp_path)
    try:
        gateway = start_gateway(bundle, [engine.port], extra=["--served-model-name", "thinker"], log_dir=tmp_path)
        try:
            url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
            body = chat_body("thinker", max_tokens=4)
            whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
            # the thought is never closed within 4 tokens (noise): all of it is reasoning, none content
            assert whole["message"]["content"] is None and whole["message"]["reasoning_content"]
            streamed = httpx.post(url, json={**body, "stream": True}, timeout=120).text
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.splitlines()
                      if line.startswith("data: {")]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["message"]["reasoning_content"]
            assert not "".join(d.get("content", "") for d in deltas)
        finally:
            gateway.stop()
    finally:
        engine.stop()
