"""M-RoPE families on the SGLang wire, through HTTP: refused before any fetch unless the operator opts in.

Real parts: the gateway app on loopback (``gateway_in_thread``) over the reference engine speaking the
SGLang wire (``mmgate engine --wire sglang``), the ``openai`` client, and a loopback media origin whose
``settled()`` hits show whether anything was fetched.

The spec (docs/engines-sglang.md, "M-RoPE positions"): SGLang 0.5.23 fed preprocessed tensors through
smg-grpc-servicer 0.14.1 computes a Qwen-VL prompt's M-RoPE positions from ids whose image runs were
already replaced by pad values, i.e. text-only positions.  So an image request to Qwen2.5-VL on an SGLang
worker is 400 ``mrope_media_not_supported`` unless ``--sglang-allow-mrope-media``; text-only requests to it,
and image requests to a family that positions tokens 1-D (Gemma 3), are served as before.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine
from mmgate.config.settings import FetchSettings, Settings
from tests.conftest import bundle_dir
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin

QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"
GEMMA = "google/gemma-3-4b-it"


def png() -> bytes:
    arr = np.random.default_rng(11).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def image_chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def settings(model: str, port: int, allow: bool = False) -> Settings:
    return Settings(model=str(bundle_dir(model)), served_model_name=model, worker_urls=(f"grpc://127.0.0.1:{port}",),
                    fetch=FetchSettings(allow_private_hosts=True), worker_health_interval_s=0.2,
                    sglang_allow_mrope_media=allow)


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Child]]:
    logs: Path = tmp_path_factory.mktemp("sglang-mrope-engines")
    started: dict[str, Child] = {}
    try:
        for model in (QWEN, GEMMA):
            started[model] = start_engine(str(bundle_dir(model)), extra=["--wire", "sglang"], log_dir=logs)
        yield started
    finally:
        for child in started.values():
            child.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_qwen_image_on_sglang_is_refused_before_any_fetch(engines: dict[str, Child], origin: MediaOrigin) -> None:
    url = origin.add("/qwen-refused.png", png(), "image/png")
    with gateway_in_thread(settings(QWEN, engines[QWEN].port)) as base:
        with pytest.raises(openai.BadRequestError) as info:
            client(base).chat.completions.create(model=QWEN, messages=image_chat(url), max_tokens=1)
    assert info.value.status_code == 400
    assert info.value.response.headers["X-SMG-Error-Code"] == "mrope_media_not_supported"
    error = info.value.response.json()["error"]
    assert error["code"] == "mrope_media_not_supported" and error["param"] == "messages[0].content[0]"
    assert "--sglang-allow-mrope-media" in error["message"] and "sglang" in error["message"]
    assert "/qwen-refused.png" not in origin.settled()


def test_qwen_text_on_sglang_is_served(engines: dict[str, Child]) -> None:
    with gateway_in_thread(settings(QWEN, engines[QWEN].port)) as base:
        out = client(base).chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1


def test_qwen_image_on_sglang_is_sent_with_the_opt_in(engines: dict[str, Child], origin: MediaOrigin) -> None:
    url = origin.add("/qwen-allowed.png", png(), "image/png")
    with gateway_in_thread(settings(QWEN, engines[QWEN].port, allow=True)) as base:
        out = client(base).chat.completions.create(model=QWEN, messages=image_chat(url), max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    assert origin.settled()["/qwen-allowed.png"] == 1


def test_gemma3_image_on_sglang_is_served_without_the_opt_in(engines: dict[str, Child], origin: MediaOrigin) -> None:
    url = origin.add("/gemma-taken.png", png(), "image/png")
    with gateway_in_thread(settings(GEMMA, engines[GEMMA].port)) as base:
        out = client(base).chat.completions.create(model=GEMMA, messages=image_chat(url), max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    assert origin.settled()["/gemma-taken.png"] == 1
