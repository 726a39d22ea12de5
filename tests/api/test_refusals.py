"""Refusals through the real HTTP API, each with its stable code and status.

The gateway runs under uvicorn on loopback; its worker address points at a
closed port, so every refusal here must happen before any engine is needed.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.api.app import create_app
from mmgate.gateway.state import build_state
from mmgate.cli.launch import free_port
from mmgate.config.settings import FetchSettings, Settings
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread, media_origin


def png_bytes(h: int = 40, w: int = 60) -> bytes:
    arr = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def settings_for(model: Path, **kw: object) -> Settings:
    fetch = FetchSettings(allow_private_hosts=True)
    return Settings(model=str(model), worker_urls=(f"grpc://127.0.0.1:{free_port()}",), fetch=fetch, **kw)


@pytest.fixture(scope="module")
def qwen3_gateway() -> Iterator[str]:
    settings = settings_for(bundle_dir("Qwen/Qwen3-VL-2B-Instruct"), item_limits={"image": 2})
    with gateway_in_thread(settings) as base:
        yield base


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


def assert_refused(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["X-SMG-Error-Code"] == code
    err = resp.json()["error"]
    assert err["code"] == code
    assert set(err) == {"type", "code", "message", "param"}
    assert "Traceback" not in err["message"]


def test_undecodable_image_is_400_media_decode_failed(qwen3_gateway: str) -> None:
    body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "messages": [{"role": "user", "content": [
        image_part(data_url(b"this is not an image at all" * 10)), {"type": "text", "text": "hi"}]}]}
    resp = post(qwen3_gateway, body)
    assert_refused(resp, 400, "media_decode_failed")
    assert "this is not an image" not in resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[0]"


def test_unknown_model_is_404_model_not_found(qwen3_gateway: str) -> None:
    body = {"model": "no-such/model", "messages": [{"role": "user", "content": "hi"}]}
    assert_refused(post(qwen3_gateway, body), 404, "model_not_found")


def test_more_images_than_anchors_is_400_media_count_mismatch(qwen3_gateway: str) -> None:
    # The Qwen3-VL template renders only the text of a system message: its image gets no anchor.
    body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "messages": [
        {"role": "system", "content": [image_part(data_url(png_bytes())), {"type": "text", "text": "sys"}]},
        {"role": "user", "content": [image_part(data_url(png_bytes(30, 30))), {"type": "text", "text": "hi"}]}]}
    assert_refused(post(qwen3_gateway, body), 400, "media_count_mismatch")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x.png", "gopher://127.0.0.1/x"])
def test_unsupported_url_scheme_is_400(qwen3_gateway: str, url: str) -> None:
    body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "messages": [{"role": "user", "content": [image_part(url)]}]}
    assert_refused(post(qwen3_gateway, body), 400, "unsupported_media_url_scheme")


def test_item_limit_is_400_before_any_fetch(qwen3_gateway: str) -> None:
    with media_origin() as origin:
        urls = [origin.add(f"/img{i}.png", png_bytes(20 + i, 20), "image/png") for i in range(3)]
        body = {"model": "Qwen/Qwen3-VL-2B-Instruct",
                "messages": [{"role": "user", "content": [image_part(u) for u in urls]}]}
        assert_refused(post(qwen3_gateway, body), 400, "mm_item_limit_exceeded")
        assert sum(origin.settled().values()) == 0


def test_malformed_body_is_400_invalid_request(qwen3_gateway: str) -> None:
    resp = httpx.post(qwen3_gateway + "/v1/chat/completions", content=b"{not json", timeout=10,
                      headers={"content-type": "application/json"})
    assert_refused(resp, 400, "invalid_request")
    resp = post(qwen3_gateway, {"model": "m", "messages": [{"role": "user", "content": [{"type": "bogus"}]}]})
    assert_refused(resp, 400, "invalid_request")


def test_no_healthy_worker_is_retryable_503(qwen3_gateway: str) -> None:
    body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
    resp = post(qwen3_gateway, body)
    assert_refused(resp, 503, "no_healthy_worker")
    assert resp.headers["Retry-After"] == "1"


def test_refusals_are_counted_by_code_in_metrics(qwen3_gateway: str) -> None:
    post(qwen3_gateway, {"model": "no-such/model", "messages": [{"role": "user", "content": "hi"}]})
    text = httpx.get(qwen3_gateway + "/metrics", timeout=10).text
    assert 'mmgate_errors_total{code="model_not_found"}' in text


def test_an_unknown_route_is_404_not_found_in_the_error_shape(qwen3_gateway: str) -> None:
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/completions"), ("GET", "/")):
        resp = httpx.request(method, qwen3_gateway + path, timeout=10)
        assert_refused(resp, 404, "not_found")
        assert "nothing" not in resp.text  # the caller's path is not quoted


def test_a_wrong_method_is_405_method_not_allowed_with_allow(qwen3_gateway: str) -> None:
    for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/responses", "POST"),
                                ("POST", "/health", "GET"), ("DELETE", "/v1/models", "GET")):
        resp = httpx.request(method, qwen3_gateway + path, timeout=10)
        assert_refused(resp, 405, "method_not_allowed")
        assert resp.headers["Allow"] == allow
        assert resp.json()["error"]["message"] == f"method not allowed on this path (allowed: {allow})"


def test_a_body_that_is_not_json_is_415_on_every_post_route(qwen3_gateway: str) -> None:
    for path in ("/v1/chat/completions", "/v1/responses"):
        resp = httpx.post(qwen3_gateway + path, content=b"model=m", timeout=10,
                          headers={"content-type": "application/x-www-form-urlencoded"})
        assert_refused(resp, 415, "unsupported_media_type")


def _anthropic_refused(resp: httpx.Response, status: int, kind: str, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["X-SMG-Error-Code"] == code
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}


def test_framework_refusals_under_v1_messages_take_anthropic_shape(qwen3_gateway: str) -> None:
    resp = httpx.get(qwen3_gateway + "/v1/messages", timeout=10)
    _anthropic_refused(resp, 405, "invalid_request_error", "method_not_allowed")
    assert resp.headers["Allow"] == "POST"
    resp = httpx.post(qwen3_gateway + "/v1/messages/count_tokens", json={}, timeout=10)
    _anthropic_refused(resp, 404, "not_found_error", "not_found")
    resp = httpx.post(qwen3_gateway + "/v1/messages", content=b"x", timeout=10, headers={"content-type": "text/plain"})
    _anthropic_refused(resp, 415, "invalid_request_error", "unsupported_media_type")
    # /v1/messagesX is not under /v1/messages: the gateway's own shape
    assert_refused(httpx.get(qwen3_gateway + "/v1/messagesX", timeout=10), 404, "not_found")


def test_a_validation_error_of_the_framework_is_400_invalid_request() -> None:
    """FastAPI's 422 (a route with typed parameters; the gateway's routes take the raw request, so a test
    route stands in) is answered 400 ``invalid_request``, as vLLM's server answers it."""
    settings = settings_for(bundle_dir("Qwen/Qwen3-VL-2B-Instruct"))
    app = create_app(build_state(settings))

    @app.get("/typed")
    async def typed(n: int) -> dict[str, int]:
        return {"n": n}

    with gateway_in_thread(settings, app=app) as base:
        assert httpx.get(base + "/typed", params={"n": "3"}, timeout=10).json() == {"n": 3}
        resp = httpx.get(base + "/typed", params={"n": "three"}, timeout=10)
        assert_refused(resp, 400, "invalid_request")
        assert "three" not in resp.text


@pytest.fixture(scope="module")
def text_only_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 text model: the Qwen2-VL tokenizer and template, a config without ``vision_config``."""
    src = bundle_dir("Qwen/Qwen2-VL-2B-Instruct")
    dst = tmp_path_factory.mktemp("bundles") / "test--qwen2-text"
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 4096, "eos_token_id": 151645,
              "bos_token_id": 151643, "tie_word_embeddings": True}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_image_to_model_without_vision_is_400_multimodal_not_supported(text_only_bundle: Path) -> None:
    with gateway_in_thread(settings_for(text_only_bundle)) as base:
        body = {"model": "test/qwen2-text", "messages": [{"role": "user", "content": [
            image_part(data_url(png_bytes())), {"type": "text", "text": "what is this?"}]}]}
        assert_refused(post(base, body), 400, "multimodal_not_supported")


def test_request_body_over_the_limit_is_413_request_too_large() -> None:
    settings = settings_for(bundle_dir("Qwen/Qwen3-VL-2B-Instruct"), max_request_body_bytes=10_000)
    with gateway_in_thread(settings) as base:
        body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "messages": [{"role": "user", "content": "x" * 20_000}]}
        assert_refused(post(base, body), 413, "request_too_large")
        # Without a Content-Length (chunked upload) the streamed body is cut at the limit too.
        chunks = (b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 4096, *[b"x" * 4096] * 4,
                  b'"}]}')
        resp = httpx.post(base + "/v1/chat/completions", content=iter(chunks), timeout=10,
                          headers={"content-type": "application/json"})
        assert_refused(resp, 413, "request_too_large")
