"""``POST /v1/responses`` with the official ``openai`` client: client -> gateway process -> reference engine.

One Qwen2-VL stack (``mmgate serve`` + ``mmgate engine`` on loopback, private media hosts allowed so a
loopback origin can serve an image).  The engine runs the real transformers model code with random
weights, so the text is noise; greedy decoding (``temperature=0``) makes it repeatable, which lets the
Responses answer be compared with the chat endpoint's answer to the same conversation.  Expected
token counts come from the transformers processor / tokenizer of the bundle.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.cli.launch import free_port
from mmgate.config.settings import Settings
from tests.abuse.support import DEFAULT_MODEL as MODEL
from tests.abuse.support import Stack, running_stack
from tests.conftest import bundle_dir
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin

INSTRUCTIONS = "Answer briefly."
QUESTION = "Compare these two pictures."


def _png(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, MediaOrigin, openai.OpenAI]]:
    logs = tmp_path_factory.mktemp("logs")
    with running_stack(logs, gateway_args=["--mm-allow-private-media-hosts"]) as stack, media_origin() as origin:
        client = openai.OpenAI(base_url=stack.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield stack, origin, client


@pytest.fixture(scope="module")
def images(served: tuple[Stack, MediaOrigin, openai.OpenAI]) -> tuple[bytes, bytes, str]:
    """Two images: the first sent as a data URL, the second served by the loopback origin (its URL)."""
    _, origin, _ = served
    first, second = _png(120, 200, 1), _png(90, 60, 2)
    return first, second, origin.add("/second.png", second, "image/png")


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _responses_input(first: bytes, url: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": _data_url(first)},
        {"type": "input_image", "image_url": url, "detail": "auto"}]}]


def _chat_messages(first: bytes, url: str) -> list[dict[str, object]]:
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": _data_url(first)}},
        {"type": "image_url", "image_url": {"url": url}}]}]


def _reference_image_prompt_tokens(first: bytes, second: bytes) -> int:
    """Length of the transformers processor's ``input_ids`` for the same conversation."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(bundle_dir(MODEL))
    conversation = [{"role": "system", "content": [{"type": "text", "text": INSTRUCTIONS}]},
                    {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"},
                                                 {"type": "image"}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in (first, second)]
    return int(processor(text=[prompt], images=pil, return_tensors="np")["input_ids"].shape[1])


def test_images_non_stream_match_the_chat_endpoint_and_the_reference(
        served: tuple[Stack, MediaOrigin, openai.OpenAI], images: tuple[bytes, bytes, str]) -> None:
    _, origin, client = served
    first, second, url = images
    expected_prompt = _reference_image_prompt_tokens(first, second)
    hits = origin.hits["/second.png"]

    resp = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=_responses_input(first, url),
                                   max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=_chat_messages(first, url), max_tokens=5,
                                          temperature=0)

    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens == expected_prompt
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == expected_prompt + resp.usage.output_tokens
    assert len(resp.output) == 1
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    # same tensors, greedy decoding: the same answer as the chat endpoint's
    assert resp.output_text == chat.choices[0].message.content
    cut = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    assert message.status == resp.status
    assert origin.hits["/second.png"] == hits + 2  # fetched once per request


def test_images_stream_event_sequence(served: tuple[Stack, MediaOrigin, openai.OpenAI],
                                      images: tuple[bytes, bytes, str]) -> None:
    _, _, client = served
    first, _, url = images
    whole = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=_responses_input(first, url),
                                    max_output_tokens=4, temperature=0)
    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS,
                                          input=_responses_input(first, url), max_output_tokens=4, temperature=0,
                                          stream=True))

    types = [e.type for e in events]
    final_type = "response.completed" if whole.status == "completed" else "response.incomplete"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     final_type]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert len(item_ids) == 1
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == whole.status
    assert final.output_text == text == whole.output_text
    assert final.output[0].id in item_ids
    assert final.usage is not None and whole.usage is not None
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_plain_string_input_counts_as_one_user_message(served: tuple[Stack, MediaOrigin, openai.OpenAI]) -> None:
    from transformers import AutoTokenizer

    _, _, client = served
    text = "Say one word."
    tokenizer = AutoTokenizer.from_pretrained(bundle_dir(MODEL))
    expected = len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])
    resp = client.responses.create(model=MODEL, input=text, max_output_tokens=3, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3,
                                          temperature=0)
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens == expected
    assert resp.output_text == chat.choices[0].message.content


def test_max_output_tokens_reached_is_incomplete(served: tuple[Stack, MediaOrigin, openai.OpenAI]) -> None:
    _, _, client = served
    # the chat endpoint on the same greedy request shows the engine stopped for length, not at EOS
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}],
                                          max_tokens=2, temperature=0)
    assert chat.choices[0].finish_reason == "length"
    resp = client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=2, temperature=0)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 2
    assert resp.max_output_tokens == 2
    events = list(client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=2, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == resp.output_text


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_unsupported_fields_and_types_are_refused_by_name(served: tuple[Stack, MediaOrigin, openai.OpenAI],
                                                          extra: dict[str, object], param: str) -> None:
    _, _, client = served
    body: dict[str, object] = {"model": MODEL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=object)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "invalid_request" and error["param"] == param
    assert caught.value.response.headers["X-SMG-Error-Code"] == "invalid_request"
    if param in ("tools", "previous_response_id"):
        assert param in error["message"]


def test_pipeline_errors_name_the_responses_field(served: tuple[Stack, MediaOrigin, openai.OpenAI]) -> None:
    _, _, client = served
    bad = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                        {"type": "input_image", "image_url": "ftp://127.0.0.1/x.png"}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=bad, max_output_tokens=2)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "unsupported_media_url_scheme"
    # the chat endpoint names messages[1].content[1] (instructions are message 0)
    assert error["param"] == "input[0].content[1]"


# ---- bounds (issue 20) ----------------------------------------------------------------------------

CONTEXT = 256  # --max-model-len of the refusing gateway


@pytest.fixture(scope="module")
def refusing() -> Iterator[str]:
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, max_model_len=CONTEXT,
                        worker_urls=(f"grpc://127.0.0.1:{free_port()}",))
    with gateway_in_thread(settings) as base:
        yield base


def _post(base: str, **fields: object) -> httpx.Response:
    return httpx.post(base + "/v1/responses", json={"model": MODEL, "input": "Hi", **fields}, timeout=30)


def _code(resp: httpx.Response) -> str:
    assert resp.headers["X-SMG-Error-Code"] == resp.json()["error"]["code"]
    return str(resp.json()["error"]["code"])


@pytest.mark.parametrize(("metadata", "message"), [
    ({f"k{i}": "v" for i in range(17)}, "metadata takes at most 16 keys"),
    ({"secret-" + "k" * 58: "v"}, "a metadata key takes at most 64 characters"),  # 65 characters
    ({"k": "v" * 513}, "a metadata value takes at most 512 characters"),
    ({"k": 1}, "metadata values must be strings"),
    ({"k": True}, "metadata values must be strings"),
    ({"k": None}, "metadata values must be strings"),
    ({"k": {"nested": "v"}}, "metadata values must be strings"),
    (["k", "v"], "metadata must be an object of string values"),
])
def test_metadata_past_openais_bounds_is_refused(refusing: str, metadata: object, message: str) -> None:
    resp = _post(refusing, metadata=metadata)
    assert resp.status_code == 400 and _code(resp) == "invalid_request"
    error = resp.json()["error"]
    assert error["param"] == "metadata" and error["message"] == message
    assert "secret" not in resp.text  # a caller's key is never quoted


def test_metadata_at_openais_bounds_is_accepted(refusing: str) -> None:
    largest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # 16 keys of 64 characters, values of 512
    assert {len(k) for k in largest} == {64}
    for metadata in (largest, {}, None, {"k": ""}):
        resp = _post(refusing, metadata=metadata)
        assert resp.status_code == 503 and _code(resp) == "no_healthy_worker"  # past every check: the engine


def test_instructions_count_in_the_prompt_length_check(refusing: str) -> None:
    from transformers import AutoTokenizer

    instructions = "a " * 260  # ~260 tokens in 520 characters: over a 256-token context only as the system message
    tokenizer = AutoTokenizer.from_pretrained(bundle_dir(MODEL))
    expected = len(tokenizer.apply_chat_template(
        [{"role": "system", "content": instructions}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert expected >= CONTEXT
    resp = _post(refusing, instructions=instructions)
    assert resp.status_code == 400 and _code(resp) == "context_length_exceeded"
    message = f"the prompt has {expected} tokens; the model's context is {CONTEXT} tokens"
    assert resp.json()["error"]["message"] == message
    assert _code(_post(refusing)) == "no_healthy_worker"  # the input alone fits
    assert _code(_post(refusing, instructions="a " * 100)) == "no_healthy_worker"
    # past 4 characters per context token (1024) the prompt is counted piecewise: the instructions count there too
    resp = _post(refusing, instructions="word " * 300)
    assert resp.status_code == 400 and _code(resp) == "context_length_exceeded"
    assert resp.json()["error"]["message"] == f"the prompt is longer than the model's context of {CONTEXT} tokens"


def test_instructions_count_in_the_character_pre_check(refusing: str) -> None:
    # the pre-check bound: 256 tokens x 128 characters (Qwen's longest vocabulary entry) x 4 (normalization)
    bound = CONTEXT * 128 * 4
    resp = _post(refusing, instructions="x" * (bound + 1))
    assert resp.status_code == 400 and _code(resp) == "context_length_exceeded"
    assert resp.json()["error"]["message"] == (
        f"the messages are longer than the model's context of {CONTEXT} tokens can hold")  # refused untokenized


def _sse(raw: bytes) -> list[dict[str, object]]:
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def test_a_stream_echoes_instructions_once_and_bounded_metadata_in_each_response(
        served: tuple[Stack, MediaOrigin, openai.OpenAI]) -> None:
    stack, _, client = served
    marker = "MARKER-7f3a"
    instructions = marker + " " + "word " * 2000  # ~10 KB, ~2000 tokens
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # OpenAI's largest
    request = json.dumps({"model": MODEL, "input": "Hi", "instructions": instructions, "metadata": metadata,
                          "max_output_tokens": 4, "temperature": 0, "stream": True}).encode()
    with httpx.stream("POST", stack.base + "/v1/responses", content=request, timeout=120,
                      headers={"content-type": "application/json"}) as resp:
        assert resp.status_code == 200
        raw = resp.read()
    events = _sse(raw)
    responses = {str(e["type"]): e["response"] for e in events if "response" in e}
    assert list(responses) == ["response.created", "response.in_progress", str(events[-1]["type"])]
    final = responses.pop(str(events[-1]["type"]))
    assert isinstance(final, dict) and final["instructions"] == instructions and final["metadata"] == metadata
    for early in responses.values():
        assert isinstance(early, dict) and early["instructions"] is None and early["metadata"] == metadata
    assert raw.count(marker.encode()) == 1  # the instructions once ...
    metadata_bytes = len(json.dumps(metadata, separators=(",", ":")))
    # ... metadata in each of the 3 responses, and 8 KB for the events' own fields and 4 tokens of text
    assert len(raw) <= len(instructions) + 3 * metadata_bytes + 8192, (len(raw), len(request))
    # the client's own view: the streamed final response carries what the whole one does
    whole = client.responses.create(model=MODEL, input="Hi", instructions=instructions, metadata=metadata,
                                    max_output_tokens=4, temperature=0)
    assert whole.instructions == instructions and whole.metadata == metadata
    assert whole.usage is not None and final["usage"]["input_tokens"] == whole.usage.input_tokens  # type: ignore[index]
