"""Constraint compiles cannot crash, freeze or 500 the reference engine (issue 20, deliverable 2).

Straight to a real engine over gRPC on loopback (no gateway, so none of its constraint
checks): each compile runs in a real :mod:`mmgate.refengine.constraint_worker` child with
real xgrammar.  The attacks are the issue's own: a JSON-schema ``pattern`` of 60,000 nested
groups (SIGSEGV in xgrammar's schema converter), an enum of 100,000 values (167 s in
process), 256 choices of 10 KB (past the memory cap within a second).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import xgrammar as xgr
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines.rpc_errors import map_rpc_error
from mmgate.errors import ErrorCode
from mmgate.refengine.config import CompileLimits, EngineConfig
from mmgate.refengine.constraint_worker import compile_constraint
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.types import Constraint, ConstraintKind
from tests.refengine.refengine_support import generate_request, stub_for

LIMITS = CompileLimits(timeout_s=3.0, memory_bytes=128 << 20, workers=2)
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # <|im_start|>user\nHello<|im_end|>\n...assistant\n
NESTED = 60_000
CRASHING_SCHEMA = json.dumps({"type": "string", "pattern": "(" * NESTED + "a" + ")" * NESTED})
SLOW_SCHEMA = json.dumps({"enum": [f"v{i}" for i in range(100_000)]})
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(qwen2_vl_bundle: Path) -> Iterator[RunningEngine]:
    running = start_engine(EngineConfig(model=qwen2_vl_bundle, port=0, compile_limits=LIMITS))
    try:
        _generate(running, "warm-up", regex="[a-z]{2}")  # one warm child before any timing
        yield running
    finally:
        running.stop(grace=0)


def _generate(engine: RunningEngine, request_id: str, max_tokens: int = 8,
              **sampling: object) -> vllm_engine_pb2.GenerateComplete:
    responses = list(stub_for(engine.address).Generate(
        generate_request(PROMPT, max_tokens=max_tokens, request_id=request_id, **sampling), timeout=120))
    return responses[-1].complete


def _refusal(engine: RunningEngine, request_id: str, **sampling: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _generate(engine, request_id, **sampling)
    return info.value


def _settled(engine: RunningEngine, gone: int) -> None:
    """Wait until child ``gone`` is reaped and a warm child, idle, stands in its place."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children, busy = engine.core.grammars.pids()
        if gone not in children and not Path(f"/proc/{gone}").exists() and children and not busy:
            return
        time.sleep(0.05)
    raise AssertionError(f"child {gone} not replaced: {engine.core.grammars.pids()}")


def _busy_child(engine: RunningEngine) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        busy = engine.core.grammars.pids()[1]
        if busy:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no child took the compile")


def test_a_pattern_that_crashes_xgrammar_is_refused_and_the_engine_serves_on(engine: RunningEngine) -> None:
    (child,) = engine.core.grammars.pids()[0]
    error = _refusal(engine, "nested", json_schema=CRASHING_SCHEMA)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "crashed the constraint compiler (SIGSEGV)" in error.details()
    mapped = map_rpc_error(error)  # what the gateway answers
    assert mapped.code is ErrorCode.CONSTRAINT_TOO_COMPLEX and mapped.status == 400
    _settled(engine, child)
    assert _generate(engine, "after-crash", max_tokens=1).finish_reason == "length"
    assert _generate(engine, "after-crash-constrained", regex="[a-z]{3}").finish_reason == "stop"


def test_a_compile_past_the_deadline_is_refused_while_other_requests_run(engine: RunningEngine) -> None:
    slow: dict[str, object] = {}

    def send_slow() -> None:
        started = time.monotonic()
        slow["error"] = _refusal(engine, "enum-100k", json_schema=SLOW_SCHEMA)
        slow["seconds"], slow["ended"] = time.monotonic() - started, time.monotonic()

    sender = threading.Thread(target=send_slow)
    sender.start()
    child = _busy_child(engine)
    stub = stub_for(engine.address)
    assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=1).healthy
    assert _generate(engine, "one-token", max_tokens=1).finish_reason == "length"
    plain_ended = time.monotonic()
    sender.join(timeout=60)
    error = slow["error"]
    assert isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "did not compile within 3 s" in error.details() and "[code=constraint_too_complex]" in error.details()
    assert plain_ended < slow["ended"]  # type: ignore[operator]
    assert slow["seconds"] < LIMITS.timeout_s + 10  # type: ignore[operator]
    _settled(engine, child)


def test_a_compile_past_the_memory_cap_is_refused(engine: RunningEngine) -> None:
    child = engine.core.grammars.pids()[0][0]
    choices = vllm_engine_pb2.ChoiceConstraint(choices=[f"{i:04d}" + "x" * 10_000 for i in range(256)])
    error = _refusal(engine, "choices-256x10k", choice=choices)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "needs more than 128 MiB to compile" in error.details()
    _settled(engine, child)


def test_cancelling_the_rpc_kills_its_compile(engine: RunningEngine) -> None:
    call = stub_for(engine.address).Generate(generate_request(PROMPT, request_id="cancelled", json_schema=SLOW_SCHEMA),
                                             timeout=120)
    sent = time.monotonic()
    child = _busy_child(engine)
    call.cancel()
    while Path(f"/proc/{child}").exists():
        time.sleep(0.02)
    assert time.monotonic() - sent < LIMITS.timeout_s  # killed for the cancel, not at the deadline
    _settled(engine, child)


def test_an_aborted_request_ends_abort_and_its_compile_is_killed(engine: RunningEngine) -> None:
    stub = stub_for(engine.address)
    responses: list[vllm_engine_pb2.GenerateResponse] = []
    reader = threading.Thread(target=lambda: responses.extend(stub.Generate(
        generate_request(PROMPT, request_id="aborted", json_schema=SLOW_SCHEMA), timeout=120)))
    reader.start()
    sent = time.monotonic()
    child = _busy_child(engine)
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["aborted"]), timeout=5)
    reader.join(timeout=30)
    assert time.monotonic() - sent < LIMITS.timeout_s
    assert [r.complete.finish_reason for r in responses] == ["abort"] and not responses[0].complete.output_ids
    _settled(engine, child)


#: one constraint of each kind, as the wire carries it
EACH_KIND = {
    ConstraintKind.JSON_SCHEMA: json.dumps(SCHEMA),
    ConstraintKind.JSON_OBJECT: "",
    ConstraintKind.REGEX: "[a-z]{3,6}[0-9]",
    ConstraintKind.GRAMMAR: 'root ::= "yes" | "no"',
    ConstraintKind.CHOICE: json.dumps(["alpha", 'b"eta']),
    ConstraintKind.STRUCTURAL_TAG: json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                                               "triggers": ["<f>"]}),
}


@pytest.mark.parametrize("kind", list(EACH_KIND), ids=str)
def test_a_grammar_from_a_child_equals_one_compiled_in_process(engine: RunningEngine, kind: ConstraintKind) -> None:
    pool, constraint = engine.core.grammars, Constraint(kind, EACH_KIND[kind])
    from_child = pool.compile(constraint, threading.Event())
    compiler = xgr.GrammarCompiler(from_child.tokenizer_info, max_threads=1)
    assert from_child.serialize_json() == compile_constraint(compiler, kind, constraint.value).serialize_json()
    assert pool.compile(constraint, threading.Event()) is from_child  # cached
