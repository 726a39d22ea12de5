"""``POST /v1/messages`` through the official ``anthropic`` client -> gateway process -> reference engine.

A system prompt and two images (a ``base64`` source and a ``url`` source served by a loopback origin)
plus text, streamed and not: ``usage.input_tokens`` must equal the length of the transformers
processor's ``input_ids`` for the same conversation, and the chat endpoint's ``prompt_tokens``; greedy
decoding makes the streamed text equal the whole answer (``temperature`` travels in
``extra_body``: the client dropped it from its signature in 2.x; the API and older clients send it).
A stop sequence taken from a greedy answer must end the next answer right before it.  Errors come
back in Anthropic's shape with the error table's status and ``X-SMG-Error-Code``.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import numpy as np
import pytest
from PIL import Image

from tests.abuse.support import DEFAULT_MODEL, Stack, bundle_path, running_stack
from tests.support.servers import MediaOrigin, media_origin

SYSTEM = "You describe pictures briefly."
TEXT = "What differs between these two pictures?"


def _image(h: int, w: int, seed: int, fmt: str) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


PNG = _image(90, 130, 1, "PNG")
JPEG = _image(120, 70, 2, "JPEG")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, MediaOrigin]]:
    logs: Path = tmp_path_factory.mktemp("logs")
    with running_stack(logs, gateway_args=["--mm-allow-private-media-hosts"]) as stack, media_origin() as origin:
        yield stack, origin


def _client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base, api_key="unused", max_retries=0)


def _image_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(PNG).decode()}},
        {"type": "image", "source": {"type": "url", "url": url}},
        {"type": "text", "text": TEXT}]}]


def _reference_input_tokens() -> int:
    """``input_ids`` length of the transformers processor for the same conversation."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(bundle_path(DEFAULT_MODEL))
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": TEXT}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in (PNG, JPEG)]
    return int(processor(text=[prompt], images=images, return_tensors="np")["input_ids"].shape[1])


def _chat_prompt_tokens(stack: Stack, url: str) -> int:
    """``usage.prompt_tokens`` of the chat endpoint for the same conversation."""
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    body = {"model": stack.model, "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": TEXT}]}]}
    r = httpx.post(stack.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_image_message_non_stream_and_stream(served: tuple[Stack, MediaOrigin]) -> None:
    stack, origin = served
    url = origin.add("/second.jpg", JPEG, "image/jpeg")
    expected = _reference_input_tokens()
    client = _client(stack)
    kwargs = {"model": stack.model, "system": SYSTEM, "messages": _image_messages(url), "max_tokens": 6,
              "extra_body": {"temperature": 0}}

    out = client.messages.create(**kwargs)  # type: ignore[call-overload]
    assert out.type == "message" and out.role == "assistant" and out.model == stack.model
    assert out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"]
    assert out.usage.input_tokens == expected
    assert out.usage.input_tokens == _chat_prompt_tokens(stack, url)
    assert out.stop_reason in ("end_turn", "max_tokens") and out.stop_sequence is None
    assert 1 <= out.usage.output_tokens <= 6
    assert (out.stop_reason == "max_tokens") == (out.usage.output_tokens == 6)
    assert origin.hits["/second.jpg"] >= 1

    with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    # Greedy decoding on the same tensors: the streamed text equals the whole answer.
    assert streamed == out.content[0].text  # type: ignore[union-attr]
    assert final.content[0].text == streamed  # type: ignore[union-attr]
    assert final.usage.input_tokens == expected
    assert final.usage.output_tokens == out.usage.output_tokens
    assert final.stop_reason == out.stop_reason


def test_stream_wire_has_anthropic_event_sequence(served: tuple[Stack, MediaOrigin]) -> None:
    stack, _ = served
    body = {"model": stack.model, "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Say something."}]}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
    with httpx.stream("POST", stack.base + "/v1/messages", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for block in raw.split("\n\n"):
        if block.strip():
            name_line, data_line = block.split("\n")
            name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
            assert data["type"] == name
            events.append((name, data))
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert names == (["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    final = events[-2][1]
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 1 <= final["usage"]["output_tokens"] <= 4
    assert final["usage"]["input_tokens"] == start["usage"]["input_tokens"]
    assert all(d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")


def test_stop_sequence_ends_the_text_before_it(served: tuple[Stack, MediaOrigin]) -> None:
    stack, _ = served
    client = _client(stack)
    kwargs = {"model": stack.model, "max_tokens": 16, "extra_body": {"temperature": 0},
              "messages": [{"role": "user", "content": "Count from one to twenty."}]}
    whole = client.messages.create(**kwargs).content[0].text  # type: ignore[call-overload, union-attr]
    # A stop sequence from the middle of the greedy answer: two characters first seen at k.
    picks = [k for k in range(1, len(whole) - 1) if whole.find(whole[k:k + 2]) == k]
    assert picks, f"greedy answer too short to cut: {whole!r}"
    k = picks[len(picks) // 2]
    stop = whole[k:k + 2]

    out = client.messages.create(stop_sequences=[stop], **kwargs)  # type: ignore[call-overload]
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == whole[:k]  # type: ignore[union-attr]
    assert out.usage.output_tokens < 16

    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole[:k]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def _assert_anthropic_error(r: httpx.Response, status: int, kind: str, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["X-SMG-Error-Code"] == code
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body


def test_errors_in_anthropic_shape(served: tuple[Stack, MediaOrigin]) -> None:
    stack, _ = served
    client = _client(stack)
    messages = [{"role": "user", "content": "Hi."}]
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as not_found:
            client.messages.create(model="no/such-model", max_tokens=4, messages=messages,  # type: ignore[arg-type]
                                   stream=stream)
        assert not_found.value.status_code == 404
        assert not_found.value.response.headers["X-SMG-Error-Code"] == "model_not_found"
        assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=stack.model, max_tokens=4, messages=messages,  # type: ignore[arg-type]
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert "tools" in refused.value.message

    url = stack.base + "/v1/messages"
    r = httpx.post(url, json={"model": stack.model, "messages": messages}, timeout=30)
    body = _assert_anthropic_error(r, 400, "invalid_request_error", "invalid_request")
    assert "max_tokens" in body["error"]["message"]
    bmp = {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "AAAA"}}
    r = httpx.post(url, json={"model": stack.model, "max_tokens": 4,
                              "messages": [{"role": "user", "content": [bmp]}]}, timeout=30)
    _assert_anthropic_error(r, 400, "invalid_request_error", "invalid_request")
    r = httpx.post(url, json={"model": stack.model, "max_tokens": 4, "temperature": 1.5, "messages": messages},
                   timeout=30)
    body = _assert_anthropic_error(r, 400, "invalid_request_error", "invalid_request")
    assert "temperature" in body["error"]["message"]
    # A refusal from the pipeline (a data URL that is not base64), with the Messages request's indices.
    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!!!"}}
    r = httpx.post(url, json={"model": stack.model, "max_tokens": 4, "system": SYSTEM,
                              "messages": [{"role": "user", "content": [broken, {"type": "text", "text": "?"}]}]},
                   timeout=30)
    body = _assert_anthropic_error(r, 400, "invalid_request_error", "invalid_media_url")
    assert "messages[0].content[0]" in body["error"]["message"]
