"""``add_special_tokens`` end to end for LLaVA-1.5: the official ``openai`` client -> gateway process ->
recording gRPC proxy -> reference engine process (vLLM wire, loopback).

LLaVA-1.5's template renders no ``<s>``: the reference (transformers ``apply_chat_template(tokenize=True)``)
adds it, vLLM's chat server (``add_special_tokens`` false by default) does not.  Expected ids come from
transformers: absent = ``processor.apply_chat_template(tokenize=True)``; false / true =
``processor(text=rendered, images=..., add_special_tokens=False/True)``.  ``usage.prompt_tokens`` is the
length of the ids the engine got, and absent - false is exactly the one BOS.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.cli.launch import start_engine, start_gateway
from tests.conftest import bundle_dir
from tests.corpus.stack import RecordingProxy
from tests.support.special_tokens import SETTINGS, reference_ids

BUNDLE = "llava-hf--llava-1.5-7b-hf"
SERVED = "llava"
TEXT = "Describe the picture in one word."


def _png() -> bytes:
    rng = np.random.default_rng(24)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


IMAGE = _png()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, RecordingProxy]]:
    bundle = bundle_dir(BUNDLE)
    logs = tmp_path_factory.mktemp("logs-bos")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    engine = start_engine(str(bundle), log_dir=logs, env=env)
    proxy = RecordingProxy(engine.port)
    try:
        gateway = start_gateway(str(bundle), [proxy.port], extra=["--served-model-name", SERVED], log_dir=logs, env=env)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", max_retries=0,
                                   timeout=120)
            yield client, proxy
        finally:
            gateway.stop()
    finally:
        proxy.close()
        engine.stop()


@pytest.fixture(scope="module")
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(bundle_dir(BUNDLE)))


def _send(client: openai.OpenAI, proxy: RecordingProxy, with_image: bool,
          extra: dict[str, Any]) -> tuple[int, list[int]]:
    """(usage.prompt_tokens, the prompt ids the engine got) of one request."""
    parts: list[dict[str, Any]] = []
    if with_image:
        parts.append({"type": "image_url",
                      "image_url": {"url": "data:image/png;base64," + base64.b64encode(IMAGE).decode()}})
    parts.append({"type": "text", "text": TEXT})
    messages: Any = [{"role": "user", "content": parts}]
    raw = client.chat.completions.with_raw_response.create(model=SERVED, messages=messages, max_tokens=1,
                                                           temperature=0, extra_body=extra)
    completion = raw.parse()
    wire = proxy.get(raw.headers["X-Request-Id"])
    assert wire is not None and completion.usage is not None
    return completion.usage.prompt_tokens, wire.input_ids


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_prompt_tokens_follow_the_setting(stack: tuple[openai.OpenAI, RecordingProxy], processor: Any,
                                          with_image: bool) -> None:
    client, proxy = stack
    got = {setting: _send(client, proxy, with_image, extra) for setting, extra in SETTINGS.items()}
    for setting, (prompt_tokens, wire_ids) in got.items():
        want = reference_ids(processor, IMAGE if with_image else None, TEXT, setting)
        assert wire_ids == want, setting
        assert prompt_tokens == len(want), setting
    assert got["absent"][0] - got["false"][0] == 1  # exactly the BOS vLLM's chat server leaves out
    assert got["absent"][1] == [processor.tokenizer.bos_token_id, *got["false"][1]]
    assert got["true"] == got["absent"]


def test_a_wrong_type_is_a_400_invalid_request(stack: tuple[openai.OpenAI, RecordingProxy]) -> None:
    client, _ = stack
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"add_special_tokens": "no"})
    body: Any = info.value.body
    assert (body["code"], body["param"]) == ("invalid_request", "add_special_tokens")
    assert "no" not in body["message"].split()
