"""Property-based fuzz of the structured-output and tools fields through the gateway's HTTP API (issue 20).

Hypothesis builds chat bodies whose ``response_format``, ``guided_*``, ``structured_outputs``,
``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``logit_bias`` hold random JSON of every
type, hostile shapes (JSON text nested thousands deep, regexes of thousands of nested groups or huge
counted repetitions, enums and choice lists past their bounds, ``$defs`` of the wrong type, long digit
keys) and ordinary values.  Each body is POSTed to an in-thread gateway (the real app under
``mmgate serve``'s uvicorn config) in front of a loopback gRPC worker that answers at once.  The
property: never a 500, always the one error shape when refused, and every answer within
:data:`ANSWER_BOUND_S`.  A fixed example budget and a fixed seed (:data:`SEED`, named in every
failure message) keep CI runs reproducible.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from mmgate.config.settings import Settings
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker
from tests.support.servers import gateway_in_thread

#: re.compile warns about ECMA-style sets such as ``[[`` in generated regexes; harmless here
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

MODEL = "Qwen/Qwen2-VL-2B-Instruct"
SEED = 20_261_202
EXAMPLES = 400
#: longest an answer may take (the gateway never compiles; a refusal is a linear scan)
ANSWER_BOUND_S = 5.0

_text = st.text(alphabet=st.sampled_from('ab(){}[]|*+?\\^$.,:"# 0123456789-_'), max_size=64)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "properties", "required", "items", "enum", "const", "pattern", "$defs",
                         "$ref", "anyOf", "patternProperties", "minItems", "maxLength", "x"]) | _text,
        inner, max_size=6),
    max_leaves=40)


#: sizes around the bounds and the issue's attack sizes, plus anything up to 70,000
_sizes = st.sampled_from([2, 63, 64, 65, 1001, 4097, 5000, 60_000]) | st.integers(0, 70_000)


@st.composite
def _hostile_text(draw: st.DrawFn) -> str:
    """Text in the shapes that once crashed, froze or 500ed a worker or the gateway."""
    n = draw(_sizes)
    return draw(st.sampled_from([
        "[" * n + "]" * n,  # JSON text nested n deep
        "(" * n + "a" + ")" * n,  # n nested groups
        f"[a-z]{{{n}}}",  # a large counted repetition
        f"([a-z]{{{n % 500}}}){{{n % 500}}}",  # nested counted repetitions
        'root ::= ' + "(" * n + '"a"' + ")" * n,  # a grammar of n nested groups
    ]))


@st.composite
def _hostile_schema(draw: st.DrawFn) -> dict[str, Any]:
    """Schemas in the shapes the issue found (each a JSON object, so the request itself is well typed)."""
    n = draw(_sizes)
    return draw(st.sampled_from([
        {"type": "string", "pattern": "(" * n + "a" + ")" * n},
        {"type": "object", "properties": {"s": {"type": "string", "pattern": f"[a-z]{{{n}}}"}}},
        {"enum": list(range(n % 3000))},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n % 600)}},
        {"type": "object", "$defs": draw(st.integers() | _text | st.lists(st.integers(), min_size=1, max_size=3))},
        {"type": "object", "patternProperties": {"(" * (n % 2000) + ")" * (n % 2000): {}}},
    ]))


_schema_object = st.one_of(_hostile_schema(), _hostile_schema(), st.dictionaries(_text, _json, max_size=4), _json)
#: a schema as vLLM takes it: an object, or its JSON text (hostile text included)
_schema = st.one_of(_schema_object, _schema_object.map(json.dumps), _hostile_text())
_regex = st.one_of(_hostile_text(), _text)
_choices = st.one_of(st.lists(_text, max_size=8), st.builds(lambda n, k: ["x" * (k % 20_000)] * (n % 3000), _sizes, _sizes))
_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "x"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", ""])}, optional={"parameters": _schema_object, "description": _text})})

#: one constraint source each: (field name, strategy of the fields it sets), mostly well typed
_SOURCES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "response_format": st.fixed_dictionaries({"response_format": st.one_of(
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": _text, "schema": _schema}, optional={"strict": st.booleans()})}),
        st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "x"])}))}),
    "guided_json": st.fixed_dictionaries({"guided_json": _schema}),
    "guided_regex": st.fixed_dictionaries({"guided_regex": _regex}),
    "guided_choice": st.fixed_dictionaries({"guided_choice": _choices}),
    "guided_grammar": st.fixed_dictionaries({"guided_grammar": _regex}),
    "structured_outputs": st.fixed_dictionaries({"structured_outputs": st.one_of(
        st.fixed_dictionaries({"json": _schema}), st.fixed_dictionaries({"regex": _regex}),
        st.fixed_dictionaries({"choice": _choices}), st.fixed_dictionaries({"grammar": _regex}),
        st.fixed_dictionaries({"structural_tag": st.one_of(_hostile_text(), st.builds(
            lambda schema: json.dumps({"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
                                       "triggers": ["<f>"]}), _schema_object))}))}),
    "tools": st.fixed_dictionaries({"tools": st.lists(_tool, min_size=1, max_size=3)}, optional={
        "tool_choice": st.sampled_from(["none", "auto", "required", "required", "x"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})}),
        "parallel_tool_calls": st.booleans()}),
    "logit_bias": st.fixed_dictionaries({"logit_bias": st.dictionaries(
        st.builds(lambda n: "9" * (n % 6000 or 1), _sizes) | st.sampled_from(["5", "151643", "-1", "x"]),
        st.floats(-200, 200), min_size=1, max_size=2)}),
    "junk": st.dictionaries(st.sampled_from(["response_format", "guided_json", "guided_regex", "guided_choice",
                                             "guided_grammar", "structured_outputs", "tools", "tool_choice",
                                             "logit_bias"]), _json, min_size=1, max_size=3),
}


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(_SOURCES)), min_size=1, max_size=2, unique=True))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for name in names:
        body.update(draw(_SOURCES[name]))
    return body


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, FakeWorker]]:
    worker = FakeWorker()
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, worker_urls=(worker.url,))
    try:
        with gateway_in_thread(settings) as base:
            yield base, worker
    finally:
        worker.stop()


def test_structured_output_and_tool_fields_never_give_a_500_or_hang(gateway: tuple[str, FakeWorker]) -> None:
    base, worker = gateway
    seen: dict[int, int] = {}

    with httpx.Client(base_url=base, timeout=30) as client:
        @seed(SEED)
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture])
        @given(_bodies())
        def probe(body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            start = time.perf_counter()
            r = client.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
            elapsed = time.perf_counter() - start
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            where = f"(hypothesis seed {SEED}; fields {sorted(set(body) - {'model', 'max_tokens', 'messages'})})"
            assert r.status_code != 500, f"500 {r.text[:300]} {where}"
            assert r.status_code in (200, 400, 413), f"status {r.status_code} {r.text[:300]} {where}"
            assert elapsed < ANSWER_BOUND_S, f"answered after {elapsed:.1f}s {where}"
            if r.status_code != 200:
                error = r.json()["error"]
                assert r.headers["X-SMG-Error-Code"] == error["code"], where
                assert set(error) == {"type", "code", "message", "param"}, where

        probe()
    assert seen.get(400, 0) > EXAMPLES // 4, seen  # the hostile shapes were refused ...
    assert seen.get(200, 0) > 0, seen  # ... and some bodies were valid and reached the worker
    assert worker.state.received, "no request reached the worker"
