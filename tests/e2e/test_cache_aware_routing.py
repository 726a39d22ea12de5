"""``--policy cache_aware`` end to end: a follow-up turn about the same image goes to the worker that served
the first turn.

Two reference engines (``mmgate engine --record-dir``: each writes ``<request id>.npz`` for every request it
runs) behind one real gateway.  Turn 1 of conversation A goes to the first engine (both idle, none chosen
before); conversation B (another image, other text) goes to the second (the fewest chosen so far); A's
follow-up, which repeats turn 1 with the same image, goes back to the first engine, whose branch of the tree
holds it.  The engine of each request is read from the recordings, by the ``X-Request-Id`` the gateway sent.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.config.settings import parse_settings
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def png(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, "max_tokens": 2, "ignore_eos": True, "messages": messages}


def user(image: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                        {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[RunningEngine, Path]]]:
    running: list[tuple[RunningEngine, Path]] = []
    try:
        for name in ("first", "second"):
            record = tmp_path_factory.mktemp(name)
            running.append((start_engine(EngineConfig(model=bundle_dir(MODEL), port=0, record_dir=record)), record))
        yield running
    finally:
        for engine, _ in running:
            engine.stop(grace=0)


def test_a_follow_up_turn_goes_to_the_worker_that_served_the_first(
        engines: list[tuple[RunningEngine, Path]]) -> None:
    urls = [f"grpc://127.0.0.1:{engine.port}" for engine, _ in engines]
    settings = parse_settings(["--model", str(bundle_dir(MODEL)), "--served-model-name", MODEL,
                               "--worker-urls", *urls, "--policy", "cache_aware"], {})

    def served_by(request_id: str) -> str:
        where = [name for name, (_, record) in zip(("first", "second"), engines)
                 if (record / f"{request_id}.npz").is_file()]
        assert len(where) == 1, where
        return where[0]

    a1 = [user(png(1), "What is in this picture?")]
    b1 = [user(png(2), "Describe the colours you see here, one by one, in detail.")]
    with gateway_in_thread(settings) as base, httpx.Client(base_url=base, timeout=120) as client:

        def ask(messages: list[dict[str, Any]]) -> tuple[str, str]:
            response = client.post("/v1/chat/completions", json=body(messages))
            assert response.status_code == 200, response.text
            return served_by(response.headers["X-Request-Id"]), response.json()["choices"][0]["message"]["content"]

        def follow(turn: list[dict[str, Any]], answer: str, text: str) -> list[dict[str, Any]]:
            return [*turn, {"role": "assistant", "content": answer}, {"role": "user", "content": text}]

        a1_at, a1_answer = ask(a1)
        b1_at, b1_answer = ask(b1)
        b2_at, _ = ask(follow(b1, b1_answer, "Which one is the brightest?"))
        a2_at, _ = ask(follow(a1, a1_answer, "And what colour is its top left corner?"))
    # round_robin would give first, second, first, second; the fewest in flight alone first x 4
    assert [a1_at, b1_at, b2_at, a2_at] == ["first", "second", "second", "first"]


def test_routing_headers_reach_the_consistent_hashing_policy(engines: list[tuple[RunningEngine, Path]]) -> None:
    """``--policy consistent_hashing``: the HTTP request's ``X-SMG-Target-Worker`` picks the worker by index
    (out of range: 503 ``no_healthy_worker``), and one ``X-SMG-Routing-Key`` keeps every request on one worker,
    as SMG reads those headers."""
    urls = [f"grpc://127.0.0.1:{engine.port}" for engine, _ in engines]
    settings = parse_settings(["--model", str(bundle_dir(MODEL)), "--served-model-name", MODEL,
                               "--worker-urls", *urls, "--policy", "consistent_hashing"], {})
    ask = body([{"role": "user", "content": "Say something."}])

    def served_by(request_id: str) -> str:
        where = [name for name, (_, record) in zip(("first", "second"), engines)
                 if (record / f"{request_id}.npz").is_file()]
        assert len(where) == 1, where
        return where[0]

    with gateway_in_thread(settings) as base, httpx.Client(base_url=base, timeout=120) as client:

        def at(headers: dict[str, str]) -> str:
            response = client.post("/v1/chat/completions", json=ask, headers=headers)
            assert response.status_code == 200, response.text
            return served_by(response.headers["X-Request-Id"])

        assert [at({"X-SMG-Target-Worker": i}) for i in ("1", "0", "1")] == ["second", "first", "second"]
        keyed = {at({"X-SMG-Routing-Key": "alice"}) for _ in range(4)}
        assert len(keyed) == 1, keyed
        missing = client.post("/v1/chat/completions", json=ask, headers={"X-SMG-Target-Worker": "2"})
        assert (missing.status_code, missing.headers["X-SMG-Error-Code"]) == (503, "no_healthy_worker")
