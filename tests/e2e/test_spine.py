"""End to end: the official ``openai`` client -> gateway process -> reference engine process.

A Qwen2.5-VL request with two images (one ``data:`` URL, one ``http`` URL served
by a loopback origin) and text, streamed and not.  The engine runs the real
transformers model code on the tensors (random weights), so a completion means
the model's forward accepted them; ``usage.prompt_tokens`` must equal the length
of the transformers processor's ``input_ids`` for the same conversation.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine, start_gateway
from tests.conftest import bundle_dir
from tests.support.servers import MediaOrigin, media_origin

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def _jpeg(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], axis=-1)
    noise = rng.integers(0, 40, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, Child, MediaOrigin]]:
    logs = tmp_path_factory.mktemp("logs")
    bundle = str(bundle_dir(MODEL))
    env = dict(os.environ)
    engine = start_engine(bundle, log_dir=logs, env=env)
    try:
        gateway = start_gateway(bundle, [engine.port], extra=["--mm-allow-private-media-hosts",
                                                              "--served-model-name", MODEL], log_dir=logs, env=env)
        try:
            with media_origin() as origin:
                yield engine, gateway, origin
        finally:
            gateway.stop()
    finally:
        engine.stop()


def _reference_prompt_tokens(images: list[bytes], text: str) -> int:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(bundle_dir(MODEL))
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)) for b in images]
    out = processor(text=[prompt], images=pil, return_tensors="np")
    return int(out["input_ids"].shape[1])


def _messages(data_image: bytes, http_url: str, text: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(data_image).decode()}},
        {"type": "image_url", "image_url": {"url": http_url}},
        {"type": "text", "text": text}]}]


def test_two_image_request_non_stream_and_stream(stack: tuple[Child, Child, MediaOrigin]) -> None:
    _, gateway, origin = stack
    first, second = _jpeg(300, 420, 1), _jpeg(230, 170, 2)
    url = origin.add("/second.jpg", second, "image/jpeg")
    text = "Compare these two pictures."
    expected = _reference_prompt_tokens([first, second], text)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", max_retries=0)

    out = client.chat.completions.create(model=MODEL, messages=_messages(first, url, text), max_tokens=6,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None
    assert out.usage.prompt_tokens == expected
    assert 1 <= out.usage.completion_tokens <= 6
    assert origin.hits["/second.jpg"] == 1

    chunks = list(client.chat.completions.create(model=MODEL, messages=_messages(first, url, text), max_tokens=6,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == expected
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[-1] in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Greedy decoding on the same tensors: the streamed text equals the non-streamed answer.
    assert streamed == out.choices[0].message.content
    assert usage[0].completion_tokens == out.usage.completion_tokens


def test_models_and_workers_endpoints(stack: tuple[Child, Child, MediaOrigin]) -> None:
    import httpx

    _, gateway, _ = stack
    base = f"http://127.0.0.1:{gateway.port}"
    models = httpx.get(base + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    workers = httpx.get(base + "/workers", timeout=10).json()["workers"]
    assert len(workers) == 1 and workers[0]["healthy"] is True
    assert workers[0]["labels"]["model_type"] == "qwen2_5_vl"
    assert workers[0]["labels"]["supports_vision"] == "true"
    assert workers[0]["labels"]["server_type"] == "vllm-grpc"
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert "mmgate_stage_seconds_bucket" in metrics and 'stage="preprocess"' in metrics
