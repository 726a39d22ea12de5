"""Structured-output and tool attacks through the gateway to the reference engine (issue 20, acceptance).

Each attack the issue measured is sent through ``mmgate serve`` to a running ``mmgate engine``
(both child processes on loopback) while a :class:`~tests.abuse.support.HealthWatch` polls
``/health``.  After each one: the attack got a 4xx within :data:`ATTACK_BOUND_S`, the engine process
is alive, ``/health`` answered within 1 s throughout and a light request completes within 2 s
(:func:`~tests.abuse.support.after_attack`), and no 500 was seen.

The smaller findings go through the default stack too: Responses ``metadata`` past OpenAI's bounds,
``instructions`` echoed once in a stream, and the framework's 404 / 405 in the one error shape.

Two stacks: the default gateway, whose ``--constraint-*`` bounds refuse every attack before it is
sent; and a gateway with those bounds opened wide in front of an engine with a 3 s compile
deadline, so the same crash and freeze attacks reach the engine and are stopped there
(``--constraint-compile-timeout``, the compile's child process): defence in depth.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.abuse.support import DEFAULT_MODEL, HealthWatch, Stack, after_attack, chat_body, running_stack, shm_segments

#: longest an attack may take to be refused (the gateway scans; the engine's deadline below is 3 s)
ATTACK_BOUND_S = 15.0
#: the engine's compile deadline in the open stack
COMPILE_DEADLINE_S = 3


def _groups(n: int) -> str:
    return "(" * n + "a" + ")" * n


def _pattern_schema(n: int = 60_000) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": _groups(n)}}, "required": ["s"]}


def _tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _nested_arrays_text(levels: int) -> str:
    return '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels


_NAMED = {"type": "function", "function": {"name": "f"}}

#: the issue's attacks: name -> request fields
ATTACKS: dict[str, Callable[[], dict[str, Any]]] = {
    "pattern_60000_groups_response_format": lambda: {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _pattern_schema()}}},
    "pattern_60000_groups_named_tool": lambda: {"tools": [_tool(_pattern_schema())], "tool_choice": _NAMED},
    "pattern_60000_groups_required_tool": lambda: {"tools": [_tool(_pattern_schema())], "tool_choice": "required"},
    "pattern_60000_groups_guided_json": lambda: {"guided_json": _pattern_schema()},
    "pattern_60000_groups_structured_outputs": lambda: {"structured_outputs": {"json": json.dumps(_pattern_schema())}},
    "enum_100000_values": lambda: {"guided_json": {"enum": [f"value-{i:06d}" for i in range(100_000)]}},
    "choices_256_of_1kb": lambda: {"guided_choice": [f"{i:04d}" + "x" * 1020 for i in range(256)]},
    "choices_1024_of_10kb": lambda: {"guided_choice": [f"{i:04d}" + "y" * 10236 for i in range(1024)]},
    "guided_json_950_arrays_deep": lambda: {"guided_json": _nested_arrays_text(950)},
    "json_text_5000_deep_guided_json": lambda: {"guided_json": "[" * 5000 + "]" * 5000},
    "json_text_5000_deep_structured_outputs": lambda: {"structured_outputs": {"json": "[" * 5000 + "]" * 5000}},
    "json_text_5000_deep_response_format": lambda: {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "[" * 5000 + "]" * 5000}}},
    "json_text_5000_deep_structural_tag": lambda: {"structured_outputs": {"structural_tag": "{" * 5000 + "}" * 5000}},
    "defs_not_an_object": lambda: {"tools": [_tool({"type": "object", "$defs": [1, 2]})], "tool_choice": "required"},
    "logit_bias_key_of_5000_digits": lambda: {"logit_bias": {"7" * 5000: 1.0}},
}


def _attack(stack: Stack, fields: dict[str, Any]) -> tuple[int, float, httpx.Response]:
    start = time.perf_counter()
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=chat_body(stack.model, max_tokens=8, **fields),
                   timeout=ATTACK_BOUND_S + 30)
    return r.status_code, time.perf_counter() - start, r


def _survives(stack: Stack, fields: dict[str, Any], code: str | None = None) -> httpx.Response:
    shm_before = shm_segments()
    with HealthWatch(stack.base) as watch:
        status, seconds, r = _attack(stack, fields)
    assert 400 <= status < 500, f"attack answered {status}: {r.text[:300]}"
    assert seconds < ATTACK_BOUND_S, f"attack refused after {seconds:.1f}s"
    assert r.headers["X-SMG-Error-Code"] == r.json()["error"]["code"]
    if code is not None:
        assert r.json()["error"]["code"] == code, r.text[:300]
    assert stack.engine.proc.poll() is None, f"engine died: {stack.engine.log_tail()}"
    after_attack(stack, watch, [status], shm_before)
    return r


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("constraint-attacks")) as s:
        yield s


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_the_gateway_refuses_each_attack_and_the_engine_serves_on(stack: Stack, name: str) -> None:
    r = _survives(stack, ATTACKS[name]())
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["param"]  # the field is named
    assert len(r.content) < 1024  # no echo of the payload


#: every gateway bound opened wide: the attacks reach the engine
_OPEN = ["--constraint-max-chars", "100000000", "--constraint-max-depth", "512",
         "--constraint-max-schema-nodes", "100000000", "--constraint-max-values", "100000000",
         "--constraint-max-optional-weight", "100000000000", "--constraint-max-regex-depth", "100000000",
         "--constraint-max-regex-repeat", "100000000"]


@pytest.fixture(scope="module")
def open_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir: Path = tmp_path_factory.mktemp("constraint-attacks-open")
    with running_stack(log_dir, DEFAULT_MODEL, gateway_args=_OPEN,
                       engine_args=["--constraint-compile-timeout", str(COMPILE_DEADLINE_S)]) as s:
        yield s


@pytest.mark.parametrize("name", ["pattern_60000_groups_guided_json", "pattern_60000_groups_named_tool",
                                  "enum_100000_values"])
def test_past_open_gateway_bounds_the_engine_stops_the_crash_and_the_freeze(open_stack: Stack, name: str) -> None:
    r = _survives(open_stack, ATTACKS[name](), code="constraint_too_complex")
    assert r.status_code == 400


# ---- the smaller findings, through the same stack ------------------------------------------


def _framework_attack(stack: Stack, method: str, path: str, body: bytes | None) -> httpx.Response:
    shm_before = shm_segments()
    with HealthWatch(stack.base) as watch:
        r = httpx.request(method, stack.base + path, content=body, timeout=ATTACK_BOUND_S + 30,
                          headers={"content-type": "application/json"})
    assert stack.engine.proc.poll() is None
    after_attack(stack, watch, [r.status_code], shm_before)
    return r


def test_responses_metadata_past_openais_bounds_is_a_400_and_nothing_is_streamed(stack: Stack) -> None:
    # 8 MB of metadata: before the bound it was streamed back three times (24 MB)
    metadata = {f"k{i}": "v" * (8 << 20 >> 4) for i in range(16)}
    body = json.dumps({"model": stack.model, "input": "Hi", "metadata": metadata, "max_output_tokens": 4,
                       "stream": True}).encode()
    r = _framework_attack(stack, "POST", "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    assert len(r.content) < 1024


def test_streamed_instructions_are_echoed_once(stack: Stack) -> None:
    instructions = "word " * 4000  # 20 KB: the stream carried it three times before
    body = json.dumps({"model": stack.model, "input": "Hi", "instructions": instructions, "max_output_tokens": 4,
                       "stream": True}).encode()
    r = _framework_attack(stack, "POST", "/v1/responses", body)
    assert r.status_code == 200
    assert r.content.count(instructions.encode()) == 1
    assert len(r.content) < len(body) + 8192


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/no-such-route", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/responses", 405, "method_not_allowed"),
])
def test_framework_refusals_are_in_the_one_error_shape(stack: Stack, method: str, path: str, status: int,
                                                       code: str) -> None:
    r = _framework_attack(stack, method, path, None)
    assert r.status_code == status
    assert r.headers["X-SMG-Error-Code"] == code == r.json()["error"]["code"]
