"""Several models behind one gateway started with only ``--worker-urls`` (issue 25, items 1 and 2).

Two reference engines on loopback serve two different models (Qwen2.5-VL and Gemma 3), each under the name
clients send (``--served-model-name``).  The gateway is started without ``--model`` and with a model search
path that holds no bundle (an empty folder), so each model's bundle comes from its worker (GetTokenizer) and
is loaded once.  With the ``openai`` client:

* an image request to each model is answered by its engine, with ``usage.prompt_tokens`` equal to the count
  of that model's transformers processor for the same conversation (computed here);
* ``/v1/models`` lists both, with their modalities; ``GET /workers`` shows each worker's model;
* an unknown model is 404 ``model_not_found`` in each API's own error shape (chat completions, Responses,
  Anthropic messages);
* a worker whose bundle cannot be had (a bundle source that refuses it) is shown ``failed`` with its model
  and the reason, and its model is not served.
"""

from __future__ import annotations

import base64
import io
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.config.settings import parse_settings
from mmgate.gateway.state import build_state
from mmgate.routing.workers import Worker
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread

QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"
GEMMA = "google/gemma-3-4b-it"
TEXT = "What is in the picture?"


def _png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png(120, 160, 7)


def _reference_prompt_tokens(model: str) -> int:
    """``input_ids`` length of the model's transformers processor for the test's conversation (the rendered
    prompt tokenized without added special tokens, as vLLM's chat path does: Gemma's template holds ``<bos>``)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(bundle_dir(model))
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    image = Image.open(io.BytesIO(PNG)).convert("RGB")
    return int(processor(text=[prompt], images=[image], return_tensors="np", add_special_tokens=False)["input_ids"].shape[1])


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, RunningEngine]]:
    running: dict[str, RunningEngine] = {}
    try:
        for name in (QWEN, GEMMA):
            running[name] = start_engine(EngineConfig(model=bundle_dir(name), port=0, served_model_name=name))
        yield running
    finally:
        for engine in running.values():
            engine.stop(grace=0)


@pytest.fixture(scope="module")
def gateway(engines: dict[str, RunningEngine]) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="mmgate-no-bundles-") as empty, \
            tempfile.TemporaryDirectory(prefix="mmgate-bundle-cache-") as cache:
        settings = parse_settings(["--worker-urls", *(f"grpc://{e.address}" for e in engines.values()),
                                   "--model-path", empty, "--worker-bundle-cache-dir", cache], {})
        assert settings.model is None
        with gateway_in_thread(settings) as base:
            yield base
        assert list(Path(empty).iterdir()) == []  # nothing was written on the search path
        assert len(list(Path(cache).iterdir())) == 2  # one <sha256> folder per model, fetched from its worker


def _image_request(client: openai.OpenAI, model: str) -> Any:
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    return client.chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": TEXT}]}])


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_each_model_answers_by_name_with_its_processors_prompt_tokens(gateway: str, model: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    out = _image_request(client, model)
    assert out.model == model
    assert out.usage is not None and out.usage.prompt_tokens == _reference_prompt_tokens(model)
    assert out.usage.completion_tokens == 4


def test_models_lists_both_with_their_modalities_and_workers_show_their_model(gateway: str) -> None:
    data = httpx.get(gateway + "/v1/models", timeout=10).json()["data"]
    assert sorted((m["id"], tuple(m["modalities"])) for m in data) == [
        (QWEN, ("text", "image", "video")), (GEMMA, ("text", "image"))]  # sorted: upper case first
    workers = httpx.get(gateway + "/workers", timeout=10).json()["workers"]
    assert sorted((w["model_id"], w["status"], w["healthy"]) for w in workers) == [
        (QWEN, "ready", True), (GEMMA, "ready", True)]


def test_an_unknown_model_is_404_model_not_found_on_every_api(gateway: str) -> None:
    chat = httpx.post(gateway + "/v1/chat/completions", timeout=10,
                      json={"model": "no-such/model", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 404 and chat.headers["X-SMG-Error-Code"] == "model_not_found"
    assert chat.json()["error"]["code"] == "model_not_found" and chat.json()["error"]["param"] == "model"
    responses = httpx.post(gateway + "/v1/responses", timeout=10, json={"model": "no-such/model", "input": "hi"})
    assert responses.status_code == 404 and responses.json()["error"]["code"] == "model_not_found"
    messages = httpx.post(gateway + "/v1/messages", timeout=10, json={
        "model": "no-such/model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 404 and messages.headers["X-SMG-Error-Code"] == "model_not_found"
    body = messages.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    for resp in (chat, responses, messages):
        assert "no-such" not in resp.text


async def _refusing_source(worker: Worker) -> Path:
    raise ValueError("archive member escapes the bundle folder")


def test_a_worker_whose_bundle_cannot_be_had_is_shown_failed_and_gets_no_traffic(
        engines: dict[str, RunningEngine]) -> None:
    with tempfile.TemporaryDirectory(prefix="mmgate-no-bundles-") as empty:
        settings = parse_settings(["--worker-urls", f"grpc://{engines[GEMMA].address}", "--model-path", empty,
                                   "--worker-bundle-cache-dir", str(Path(empty, "never-written"))], {})
        with gateway_in_thread(settings, build_state(settings, bundles=_refusing_source)) as base:
            workers = httpx.get(base + "/workers", timeout=10).json()["workers"]
            assert [(w["model_id"], w["status"], w["reason"], w["healthy"]) for w in workers] == [
                (GEMMA, "failed", "ValueError: archive member escapes the bundle folder", True)]
            assert httpx.get(base + "/v1/models", timeout=10).json()["data"] == []
            resp = httpx.post(base + "/v1/chat/completions", timeout=10,
                              json={"model": GEMMA, "messages": [{"role": "user", "content": "hi"}]})
            assert (resp.status_code, resp.headers["X-SMG-Error-Code"]) == (404, "model_not_found")
