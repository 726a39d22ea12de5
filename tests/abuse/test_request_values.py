"""Issue 15, items 3, 4, 9, 10: request values the wire or the model cannot take are 400s, never 500s.

Ranges come from the references, written out here: ``smg_grpc_proto`` ``vllm_engine.proto``
``SamplingParams`` (``optional uint32 max_tokens``, ``uint32 top_k``, ``optional int32 seed``), vLLM
``SamplingParams._verify_args`` (``top_p`` in (0, 1], ``top_k`` -1 = disabled, penalties in [-2, 2], no
empty stop string), the OpenAI role set.  Every refusal names the field in ``param`` and never quotes
the caller's value; a value at the edge of its range reaches the worker's wire unchanged (checked on
a recording fake worker).  The prompt of an assistant turn with ``tool_calls`` and ``content: null`` is
compared with transformers' ``apply_chat_template`` on the messages as vLLM's ``chat_utils`` builds them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

from mmgate.request.parse import parse_chat_request
from mmgate.chat.template import render_chat
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.engines.vllm import sampling_message
from mmgate.errors import GatewayError
from mmgate.models.bundle import load_bundle
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.pipeline.planning import plan_request
from mmgate.config.settings import Settings
from mmgate.types import SamplingParams
from tests.abuse.support import HealthWatch, Stack, after_attack, chat_body, running_stack, shm_segments
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker, FakeWorkerState, Received
from tests.support.servers import gateway_in_thread

MODEL = "Qwen/Qwen2-VL-2B-Instruct"
U32_MAX = 2**32 - 1  # proto uint32
I32_MIN, I32_MAX = -(2**31), 2**31 - 1  # proto int32
MARK = "zq-caller-value-7731"  # a string that must never come back in an error body


def body_bytes(**fields: Any) -> bytes:
    return json.dumps(chat_body(MODEL, **fields)).encode()


def nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def with_field(raw_value: bytes, field: str = "ignored_field") -> bytes:
    """A valid light body with ``field`` set to the raw JSON ``raw_value``."""
    return body_bytes()[:-1] + b', "' + field.encode() + b'": ' + raw_value + b"}"


#: (body fields, the param the 400 must name); each value is outside what the wire or vLLM takes
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"max_completion_tokens": 2**32}, "max_completion_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**31}, "seed"),
    ({"seed": -(2**31) - 1}, "seed"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**32}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"stop": [""]}, "stop[0]"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"temperature": MARK}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "<|im_start|>system", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": MARK, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": MARK, "text": "hi"}]}]}, "messages[0].content[0].type"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:,", "max_long_side_pixel": 28 * 2**60}}]}]},
     "messages[0].content[0].image_url.max_long_side_pixel"),
]


def param_id(case: tuple[dict[str, Any], str]) -> str:
    return case[1] + "=" + json.dumps(next(iter(case[0].values())))[:24]


@pytest.mark.parametrize("fields,param", BAD_VALUES, ids=[param_id(c) for c in BAD_VALUES])
def test_out_of_range_value_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_chat_request(body_bytes(**fields))
    assert info.value.status == 400 and info.value.code.value == "invalid_request"
    assert info.value.param == param
    assert MARK not in info.value.message and "wizard" not in info.value.message


#: (body fields at the edge of their range, the vLLM-wire ``SamplingParams`` fields the worker must receive);
#: ``max_completion_tokens`` travels as ``max_tokens``, a string ``stop`` as a one-item list
EDGE_VALUES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"max_tokens": 1}, {"max_tokens": 1}),
    ({"max_tokens": U32_MAX}, {"max_tokens": U32_MAX}),
    ({"max_completion_tokens": U32_MAX}, {"max_tokens": U32_MAX}),
    ({"seed": I32_MIN}, {"seed": I32_MIN}), ({"seed": I32_MAX}, {"seed": I32_MAX}), ({"seed": 0}, {"seed": 0}),
    ({"top_k": 0}, {"top_k": 0}), ({"top_k": 1}, {"top_k": 1}), ({"top_k": U32_MAX}, {"top_k": U32_MAX}),
    ({"top_p": 1.0}, {"top_p": 1.0}), ({"temperature": 0.0}, {"temperature": 0.0}),
    ({"temperature": 2.0}, {"temperature": 2.0}),
    ({"frequency_penalty": -2.0}, {"frequency_penalty": -2.0}), ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    ({"stop": [f"s{i}" for i in range(16)]}, {"stop": [f"s{i}" for i in range(16)]}),
    ({"stop": "x" * 1024}, {"stop": ["x" * 1024]}),
]
#: proto3 ``optional`` fields of the wire's SamplingParams: set (even to 0) means the caller's value, unset its default
OPTIONAL_WIRE_FIELDS = ("max_tokens", "seed", "temperature")
#: room in the context for the largest uint32 ``max_tokens`` after the prompt (the bundle's 32768 has none)
HUGE_CONTEXT = 2**33


@pytest.fixture(scope="module")
def edge_gateway() -> Iterator[tuple[str, FakeWorkerState]]:
    """The real gateway in a thread over a recording fake vLLM-wire worker."""
    worker = FakeWorker()
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, worker_urls=(worker.url,),
                        max_model_len=HUGE_CONTEXT)
    try:
        with gateway_in_thread(settings) as base:
            yield base, worker.state
    finally:
        worker.stop()


def send_to_worker(gateway: tuple[str, FakeWorkerState], fields: dict[str, Any]) -> Received:
    """POST a light chat with ``fields``; what the worker received for it."""
    base, state = gateway
    before = len(state.received)
    resp = httpx.post(base + "/v1/chat/completions", json=chat_body(MODEL, **fields), timeout=30)
    assert resp.status_code == 200, resp.text
    assert len(state.received) == before + 1
    return state.received[-1]


@pytest.mark.parametrize("fields,wire", EDGE_VALUES, ids=[f"{k}={json.dumps(v)[:16]}" for (f, _) in EDGE_VALUES
                                                           for k, v in f.items()])
def test_values_at_the_edges_reach_the_wire(edge_gateway: tuple[str, FakeWorkerState], fields: dict[str, Any],
                                            wire: dict[str, Any]) -> None:
    received = send_to_worker(edge_gateway, fields).sampling
    assert received is not None
    for name, value in wire.items():
        if name in OPTIONAL_WIRE_FIELDS:
            assert received.HasField(name), f"{name} not set on the wire"
        got = list(getattr(received, name)) if name == "stop" else getattr(received, name)
        assert got == value, f"{name}: {got!r} on the wire, {value!r} expected"


def test_deep_template_kwargs_at_the_depth_limit_are_accepted_and_render_the_same_prompt(
        edge_gateway: tuple[str, FakeWorkerState]) -> None:
    """60 levels (under the 64 of ``MAX_JSON_DEPTH``) reach the template; Qwen2-VL's reads neither key,
    so the prompt on the wire is the one without them."""
    plain = send_to_worker(edge_gateway, {})
    deep = send_to_worker(edge_gateway, {"chat_template_kwargs": {"enable_thinking": False,
                                                                  "deep": json.loads(nested(60))}})
    assert deep.input_ids == plain.input_ids


def test_top_k_minus_one_means_disabled_and_travels_as_zero() -> None:
    assert parse_chat_request(body_bytes(top_k=-1)).top_k == 0  # vLLM: -1 disables; the wire's off is 0
    wire = sampling_message(SamplingParams(max_tokens=U32_MAX, top_k=-1, seed=I32_MIN))
    assert (wire.top_k, wire.max_tokens, wire.seed) == (0, U32_MAX, I32_MIN)


@pytest.mark.parametrize("sampling,param", [
    (SamplingParams(max_tokens=2**32), "max_tokens"), (SamplingParams(seed=2**31), "seed"),
    (SamplingParams(top_k=2**32), "top_k"),
])
def test_wire_mapping_refuses_what_the_proto_cannot_carry(sampling: SamplingParams, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        sampling_message(sampling)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_every_openai_role_is_accepted(role: str) -> None:
    assert parse_chat_request(body_bytes(messages=[{"role": role, "content": "hi"}])).messages[0].role == role


DEEP_BODIES = {
    "ignored-1000": with_field(nested(1000)),
    "ignored-100000": with_field(nested(100_000)),
    "ignored-unclosed-100000": with_field(b"[" * 100_000),
    "messages-1000": body_bytes()[:-1].replace(b'"messages": [', b'"messages": [' + nested(1000) + b",") + b"}",
    "content-100000": json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "@"}]}).encode()
    .replace(b'"@"', nested(100_000)),
    "template-kwargs-1000": with_field(b'{"k": ' + nested(1000) + b"}", "chat_template_kwargs"),
    "template-kwargs-65": with_field(b'{"k": ' + nested(63) + b"}", "chat_template_kwargs"),
    "tool-arguments-1000": body_bytes(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]}]),
}


@pytest.mark.parametrize("name", list(DEEP_BODIES))
def test_deep_json_is_a_400_not_a_recursion_error(name: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_chat_request(DEEP_BODIES[name])
    assert info.value.status == 400 and "nested more than 64 levels" in info.value.message


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = '\\"[' * 2000 + "{" * 2000
    assert parse_chat_request(body_bytes(text=text)).messages[0].content == text


# ---- planning and rendering -----------------------------------------------------------------------


@cache
def runtime(model: str) -> ModelRuntime:
    bundle = load_bundle(bundle_dir(model), name=model)
    return ModelRuntime(bundle=bundle, tokenizer=load_tokenizer(bundle), family=None, served_name=model)


def test_unknown_model_is_refused_without_quoting_its_name() -> None:
    req = parse_chat_request(json.dumps(chat_body(MARK)).encode())
    with pytest.raises(GatewayError) as info:
        plan_request(req, runtime(MODEL), Settings(model=MODEL))
    assert (info.value.status, info.value.param) == (404, "model") and MARK not in info.value.message


def test_template_kwargs_may_not_override_special_tokens() -> None:
    req = parse_chat_request(body_bytes(chat_template_kwargs={"eos_token": "x"}))
    with pytest.raises(GatewayError) as info:
        plan_request(req, runtime(MODEL), Settings(model=MODEL))
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")


@pytest.mark.parametrize("arguments", ["{not json", "1" * 5000, "[1, 2]", None])
def test_tool_call_arguments_that_are_not_a_json_object_become_empty(arguments: str | None) -> None:
    # vLLM _postprocess_messages: a string that is not JSON, or no arguments, -> {}; a JSON list is kept.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    req = parse_chat_request(body_bytes(messages=[{"role": "assistant", "content": None, "tool_calls": [call]}]))
    plan = plan_request(req, runtime(MODEL), Settings(model=MODEL))
    expected: Any = [1, 2] if arguments == "[1, 2]" else {}
    assert plan.template_messages[0]["tool_calls"][0]["function"]["arguments"] == expected
    # content null -> no parts: the Qwen templates loop over content parts (vLLM's "openai" content format)
    assert plan.template_messages[0]["content"] == []


TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]

#: TOOL_TURN as vLLM's chat_utils hands it to the template (v0.11 ``_parse_chat_message_content`` with
#: the "openai" content format these Qwen templates get, then ``_postprocess_messages``): content null
#: -> [], string content -> one text part, arguments parsed (an empty string -> {}), a tool message's text
#: parts joined into a string.
TOOL_TURN_AS_VLLM = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": [], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


@pytest.mark.parametrize("model", ["Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen2-VL-2B-Instruct"])
def test_tool_calls_with_null_content_render_as_transformers(model: str) -> None:
    from transformers import AutoTokenizer

    rt = runtime(model)
    req = parse_chat_request(json.dumps({"model": model, "messages": TOOL_TURN}).encode())
    plan = plan_request(req, rt, Settings(model=model))
    assert rt.bundle.chat_template is not None
    ours = render_chat(rt.bundle.chat_template, plan.template_messages, rt.tokenizer.special_tokens)
    template = json.loads((bundle_dir(model) / "chat_template.json").read_text())["chat_template"]
    reference = AutoTokenizer.from_pretrained(str(bundle_dir(model))).apply_chat_template(
        TOOL_TURN_AS_VLLM, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours == reference
    if "tool_call" in template:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours


# ---- through a real gateway and engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("request-values")), MODEL) as s:
        yield s


def post(client: httpx.Client, base: str, body: bytes) -> httpx.Response:
    return client.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})


def test_bad_values_through_the_gateway_are_400s_naming_the_field(stack: Stack) -> None:
    shm_before = shm_segments()
    statuses: list[int] = []
    with HealthWatch(stack.base) as watch, httpx.Client(timeout=30.0) as client:
        for fields, param in BAD_VALUES:
            r = post(client, stack.base, body_bytes(**fields))
            statuses.append(r.status_code)
            assert r.status_code == 400, (param, r.text)
            assert r.headers["X-SMG-Error-Code"] == "invalid_request"
            assert r.json()["error"]["param"] == param
            assert MARK not in r.text and "wizard" not in r.text
        for name, body in DEEP_BODIES.items():
            r = post(client, stack.base, body)
            statuses.append(r.status_code)
            assert (r.status_code, r.headers.get("X-SMG-Error-Code")) == (400, "invalid_request"), (name, r.text)
        r = post(client, stack.base, json.dumps(chat_body(MARK)).encode())
        statuses.append(r.status_code)
        assert (r.status_code, r.headers["X-SMG-Error-Code"]) == (404, "model_not_found") and MARK not in r.text
    after_attack(stack, watch, statuses, shm_before)


def test_edge_values_complete_end_to_end(stack: Stack) -> None:
    with httpx.Client(timeout=60.0) as client:
        sampled = post(client, stack.base, body_bytes(temperature=0.7, top_k=-1, top_p=0.9, seed=I32_MIN))
        assert sampled.status_code == 200, sampled.text
        assert sampled.json()["usage"]["completion_tokens"] == 1
        tools = post(client, stack.base, json.dumps({"model": MODEL, "max_tokens": 1, "messages": TOOL_TURN}).encode())
        assert tools.status_code == 200, tools.text
        # The largest max_tokens the wire carries is no 500: capped or refused against the context.
        with client.stream("POST", f"{stack.base}/v1/chat/completions", json=chat_body(MODEL, max_tokens=U32_MAX,
                                                                                       stream=True)) as huge:
            assert huge.status_code in (200, 400), huge.status_code
            if huge.status_code == 400:
                huge.read()
                assert huge.headers["X-SMG-Error-Code"] == "context_length_exceeded"
                assert huge.json()["error"]["param"] == "max_tokens"
