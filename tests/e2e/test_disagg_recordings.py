"""Single workers of every wire, and which leg received the pixels, through the gateway, on the SGLang and TokenSpeed pairs and the EPD trio
(issue 12 acceptance; the vLLM pair is in tests/e2e/test_disagg_vllm.py).

Every engine records what it was sent (``mmgate engine --record-dir``, :mod:`mmgate.refengine.recording`): a
leg the model runs from its own inputs as its final model inputs, a decode leg as it arrived (ids and the
tensors of its media identity).  Greedy, EOS ignored, the same two-image Qwen2.5-VL request as
tests/e2e/test_disaggregation.py:

* A single worker of the SGLang and of the TokenSpeed wire behind a plain gateway answers the single
  vLLM-wire worker's completion (Qwen2.5-VL and Qwen3-VL).
* PD (SGLang, TokenSpeed): the completion equals the single vLLM-wire worker's; the prefill engine's
  recorded ``pixel_values`` are the transformers processor's, bit for bit; the decode engine got the same
  prompt ids and no ``pixel_values``.
* EPD (TokenSpeed): the completion equals the single worker's; neither the prefill engine (which used the
  encode engine's embeddings) nor the decode engine got ``pixel_values``, so the encode engine, the only
  other leg, computed the image embeddings from them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from mmgate.engines.base import Role, Wire
from mmgate.cli.launch import Child, start_gateway, wait_http_health
from tests.conftest import bundle_dir
from tests.e2e.test_disagg_vllm import Stack, _recorded
from tests.e2e.test_disaggregation import MODELS, QWEN2_5, _body, _tokens
from tests.worker_mode.reference import Conversation, reference_inputs


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("records"))
    yield s
    s.stop()


def _post(child: Child, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{child.port}/v1/chat/completions", json=body, timeout=120)


def _reference_pixels(body: dict) -> np.ndarray:
    """The processor's ``pixel_values`` for the request's two images (transformers, tests.worker_mode.reference)."""
    conversation = Conversation()
    parts = body["messages"][0]["content"]
    for part in parts[:-1]:
        data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
        conversation.image(data, "image/png")
    return reference_inputs(bundle_dir(QWEN2_5), conversation.say(parts[-1]["text"]))["pixel_values"]


@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
def test_only_the_prefill_leg_of_a_pair_receives_pixels(stack: Stack, wire: Wire) -> None:
    body = _body(QWEN2_5)
    want = _tokens(_post(stack.single(QWEN2_5), body))
    resp = _post(stack.pd(QWEN2_5, wire, record=True), body)
    assert _tokens(resp) == want
    request_id = resp.headers["X-Request-Id"]
    prefill = _recorded(stack.record_dir(QWEN2_5, wire, Role.PREFILL), request_id)
    decode = _recorded(stack.record_dir(QWEN2_5, wire, Role.DECODE), request_id)
    assert np.array_equal(prefill["pixel_values"], _reference_pixels(body))
    assert "pixel_values" not in decode
    assert np.array_equal(decode["input_ids"], prefill["input_ids"])


def test_only_the_encode_leg_of_epd_receives_pixels(stack: Stack) -> None:
    body = _body(QWEN2_5)
    want = _tokens(_post(stack.single(QWEN2_5), body))
    wire = Wire.TOKENSPEED
    prefill = stack.engine(QWEN2_5, wire, Role.PREFILL, record_dir=stack.record_dir(QWEN2_5, wire, Role.PREFILL))
    decode = stack.engine(QWEN2_5, wire, Role.DECODE, record_dir=stack.record_dir(QWEN2_5, wire, Role.DECODE))
    encode = stack.engine(QWEN2_5, wire, Role.ENCODE)
    gateway = start_gateway(str(bundle_dir(QWEN2_5)), [], extra=[
        "--served-model-name", QWEN2_5, "--epd-disaggregation",
        "--prefill", f"grpc://127.0.0.1:{prefill.port}", "--decode", f"grpc://127.0.0.1:{decode.port}",
        "--encode", f"grpc://127.0.0.1:{encode.port}", str(encode.bootstrap_port)])
    stack.gateways[("epd-recorded",)] = gateway
    wait_http_health(gateway, want_workers=3)
    resp = _post(gateway, body)
    assert _tokens(resp) == want
    request_id = resp.headers["X-Request-Id"]
    got_prefill = _recorded(stack.record_dir(QWEN2_5, wire, Role.PREFILL), request_id)
    got_decode = _recorded(stack.record_dir(QWEN2_5, wire, Role.DECODE), request_id)
    assert "pixel_values" not in got_prefill and "pixel_values" not in got_decode
    assert np.array_equal(got_decode["input_ids"], got_prefill["input_ids"])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
def test_a_single_worker_of_each_wire_answers_the_single_vllm_workers_tokens(stack: Stack, model: str,
                                                                             wire: Wire) -> None:
    body = _body(model)
    assert _tokens(_post(stack.single(model, wire), body)) == _tokens(_post(stack.single(model), body))
