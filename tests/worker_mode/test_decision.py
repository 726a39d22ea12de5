"""Where media is processed: the ``--mm-processing`` decision table, reason by reason.

Model-free vLLM-wire workers (:class:`FakeEngine`) advertise the labels each
row needs; the real gateway decides, and each decision is read back from
``smg_mm_processing_total{model,mode,reason}`` on ``/metrics``.  What the
worker received shows the decision was acted on: ``media_refs`` (worker mode)
or tensors in ``mm_inputs`` (router mode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import msgspec
import pytest

from mmgate.media.ref_sizes import data_url_bytes
from mmgate.routing.mm_processing import Decision, Mode, Reason, decide, forwardable, struct_hints
from mmgate.config.settings import FetchSettings, MmProcessing, Settings, parse_settings
from tests.conftest import bundle_dir
from tests.worker_mode.support import (
    MODEL,
    FakeEngine,
    Gateway,
    chat,
    data_url,
    delta,
    gateway,
    image_bytes,
    image_part,
    wait_for,
)

TEXT = {"type": "text", "text": "What is this?"}


def settings(*engines: FakeEngine, **kw: object) -> Settings:
    return Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL,
                    worker_urls=tuple(e.url for e in engines), fetch=FetchSettings(allow_private_hosts=True), **kw)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, FakeEngine]]:
    fleet = {
        "capable": FakeEngine("inprocess", "data,http,https").start(),
        "capable2": FakeEngine("redis", "data,http,https").start(),
        "plain": FakeEngine().start(),
        "plain2": FakeEngine().start(),
        "http_only": FakeEngine("inprocess", "http,https").start(),
    }
    yield fleet
    for engine in fleet.values():
        engine.stop()


@pytest.fixture(autouse=True)
def fresh(engines: dict[str, FakeEngine]) -> None:
    for engine in engines.values():
        engine.requests.clear()
        engine.fail_with = None
        engine.healthy = True


@pytest.fixture(scope="module")
def uniform(engines: dict[str, FakeEngine]) -> Iterator[Gateway]:
    with gateway(settings(engines["capable"], engines["capable2"])) as gw:
        yield gw


@pytest.fixture(scope="module")
def mixed(engines: dict[str, FakeEngine]) -> Iterator[Gateway]:
    with gateway(settings(engines["capable"], engines["plain"])) as gw:
        yield gw


@pytest.fixture(scope="module")
def plain(engines: dict[str, FakeEngine]) -> Iterator[Gateway]:
    with gateway(settings(engines["plain2"])) as gw:
        yield gw


def one_image() -> dict:
    return chat([image_part(data_url(image_bytes(40, 60, 1, "PNG"), "image/png")), TEXT])


def configured(gw: Gateway, **changes: object) -> None:
    """Change the running gateway's settings (the decision reads them per request, from the served model)."""
    gw.state.settings = dataclasses.replace(gw.state.settings, **changes)
    for served in gw.state.models.values():
        served.settings = gw.state.settings


@pytest.fixture(autouse=True)
def auto_defaults(uniform: Gateway, mixed: Gateway, plain: Gateway) -> Iterator[None]:
    yield
    for gw in (uniform, mixed, plain):
        configured(gw, mm_processing=MmProcessing.AUTO, mm_processing_models=None,
                   fetch=FetchSettings(allow_private_hosts=True))


def sent_refs(engine: FakeEngine) -> list[int]:
    """Per request the engine got: the number of media references (-1: tensors instead)."""
    return [len(r.media_refs.items) if r.media_refs.items else -1 for r in engine.requests]


# ---- the table, row by row ---------------------------------------------------------------


def test_auto_with_every_worker_advertising_is_worker_mode_auto_uniform(
        uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    before = uniform.decisions()
    resp = uniform.post(one_image())
    assert resp.status_code == 200, resp.text
    assert delta(before, uniform.decisions()) == {("worker", "auto_uniform"): 1}
    got = engines["capable"].requests + engines["capable2"].requests
    assert len(got) == 1 and len(got[0].media_refs.items) == 1 and not got[0].HasField("mm_inputs")
    ref = got[0].media_refs.items[0]
    assert ref.url.startswith("data:image/png;base64,")
    # The prompt went unexpanded: exactly one anchor for the one image.
    assert list(got[0].tokenized.input_ids).count(151655) == 1
    # usage counts the expansion the engine reports, not the unexpanded ids we sent.
    assert resp.json()["usage"]["prompt_tokens"] == len(got[0].tokenized.input_ids) + FakeEngine.EXPANSION


def test_auto_with_a_mix_is_router_mode_auto_mixed(mixed: Gateway, engines: dict[str, FakeEngine]) -> None:
    before = mixed.decisions()
    for _ in range(2):
        assert mixed.post(one_image()).status_code == 200
    assert delta(before, mixed.decisions()) == {("router", "auto_mixed"): 2}
    assert sent_refs(engines["capable"]) + sent_refs(engines["plain"]) == [-1, -1]


def test_auto_with_no_worker_advertising_is_router_mode_auto_none(
        plain: Gateway, engines: dict[str, FakeEngine]) -> None:
    before = plain.decisions()
    assert plain.post(one_image()).status_code == 200
    assert delta(before, plain.decisions()) == {("router", "auto_none"): 1}
    assert sent_refs(engines["plain2"]) == [-1]


def test_auto_with_no_registered_worker_is_router_mode_auto_none() -> None:
    with gateway(Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL,
                          fetch=FetchSettings(allow_private_hosts=True))) as gw:
        before = gw.decisions()
        resp = gw.post(one_image())
        assert resp.status_code == 503 and resp.headers["X-SMG-Error-Code"] == "no_healthy_worker"
        assert delta(before, gw.decisions()) == {("router", "auto_none"): 1}


def test_a_health_flap_does_not_move_the_model_between_modes(
        uniform: Gateway, mixed: Gateway, engines: dict[str, FakeEngine]) -> None:
    engines["capable2"].healthy = False
    engines["plain"].healthy = False
    wait_for(lambda: uniform.healthy() == [True, False] and mixed.healthy() == [True, False], 10, "the flap")
    before = uniform.decisions()
    assert uniform.post(one_image()).status_code == 200
    assert mixed.post(one_image()).status_code == 200
    # Unhealthy workers still count: the uniform fleet stays worker, the mixed one router.
    assert delta(before, uniform.decisions()) == {("worker", "auto_uniform"): 1, ("router", "auto_mixed"): 1}
    assert sent_refs(engines["capable"]) == [1, -1]  # the one healthy worker took both
    assert engines["capable2"].requests == [] and engines["plain"].requests == []


def test_router_config_is_router_mode_config(uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    configured(uniform, mm_processing=MmProcessing.ROUTER)
    before = uniform.decisions()
    assert uniform.post(one_image()).status_code == 200
    assert delta(before, uniform.decisions()) == {("router", "config"): 1}
    assert sent_refs(engines["capable"]) + sent_refs(engines["capable2"]) == [-1]


def test_worker_config_is_worker_mode_config(mixed: Gateway, engines: dict[str, FakeEngine]) -> None:
    configured(mixed, mm_processing=MmProcessing.WORKER)
    before = mixed.decisions()
    for _ in range(3):
        assert mixed.post(one_image()).status_code == 200
    assert delta(before, mixed.decisions()) == {("worker", "config"): 3}
    # A worker without the capability never gets references.
    assert sent_refs(engines["capable"]) == [1, 1, 1] and engines["plain"].requests == []


def test_worker_config_without_a_capable_worker_is_503(plain: Gateway, engines: dict[str, FakeEngine]) -> None:
    configured(plain, mm_processing=MmProcessing.WORKER)
    before = plain.decisions()
    resp = plain.post(one_image())
    assert resp.status_code == 503 and resp.headers["X-SMG-Error-Code"] == "no_healthy_worker"
    assert resp.headers["Retry-After"]
    assert delta(before, plain.decisions()) == {("worker", "config"): 1}
    assert engines["plain2"].requests == []


def test_a_model_not_opted_in_is_router_mode_model_not_opted_in(
        uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    configured(uniform, mm_processing=MmProcessing.WORKER, mm_processing_models=("someone/else",))
    before = uniform.decisions()
    assert uniform.post(one_image()).status_code == 200
    configured(uniform, mm_processing_models=(MODEL,))
    assert uniform.post(one_image()).status_code == 200
    assert delta(before, uniform.decisions()) == {("router", "model_not_opted_in"): 1, ("worker", "config"): 1}
    assert sorted(sent_refs(engines["capable"]) + sent_refs(engines["capable2"])) == [-1, 1]


def test_audio_is_forwardable_but_a_model_without_audio_refuses_it_before_sending(
        uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    """Issue 23: audio reaches workers as media references (the worker path decides as for images); this
    model's family takes no audio, so planning refuses it before any reference is sent."""
    before = uniform.decisions()
    body = chat([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, TEXT])
    resp = uniform.post(body)
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported"
    assert delta(before, uniform.decisions()) == {("worker", "auto_uniform"): 1}
    assert engines["capable"].requests == [] and engines["capable2"].requests == []


def test_a_per_item_hint_is_never_forwarded_plan_not_forwardable(
        uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    hinted = {"type": "image_url", "image_url": {"url": data_url(image_bytes(40, 60, 1, "PNG"), "image/png"),
                                                 "max_long_side_pixel": 28}}
    before = uniform.decisions()
    assert uniform.post(chat([hinted, TEXT])).status_code == 200
    assert delta(before, uniform.decisions()) == {("router", "plan_not_forwardable"): 1}
    assert sent_refs(engines["capable"]) + sent_refs(engines["capable2"]) == [-1]


def test_mm_processor_kwargs_are_never_forwarded_plan_not_forwardable(
        uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    """Media references carry no processor kwargs: a request with them (Qwen2-VL's ``min_pixels`` here) is
    processed by the gateway, which applies them."""
    part = {"type": "image_url", "image_url": {"url": data_url(image_bytes(40, 60, 1, "PNG"), "image/png")}}
    before = uniform.decisions()
    assert uniform.post({**chat([part, TEXT]), "mm_processor_kwargs": {"min_pixels": 6272}}).status_code == 200
    assert delta(before, uniform.decisions()) == {("router", "plan_not_forwardable"): 1}
    assert sent_refs(engines["capable"]) + sent_refs(engines["capable2"]) == [-1]


def test_a_text_only_request_is_not_a_media_decision(uniform: Gateway) -> None:
    before = uniform.decisions()
    assert uniform.post(chat([TEXT])).status_code == 200
    assert delta(before, uniform.decisions()) == {}


# ---- the worker path's own checks ---------------------------------------------------------


def test_an_inline_payload_over_the_cap_is_400_media_ref_too_large_before_sending(
        uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    configured(uniform, fetch=FetchSettings(allow_private_hosts=True, image_max_bytes=1000))
    body = chat([TEXT, image_part(data_url(image_bytes(64, 64, 2, "PNG"), "image/png"))])
    resp = uniform.post(body)
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "media_ref_too_large"
    assert resp.json()["error"]["param"] == "messages[0].content[1]"
    assert engines["capable"].requests == [] and engines["capable2"].requests == []


def test_a_scheme_the_worker_does_not_fetch_is_400(engines: dict[str, FakeEngine]) -> None:
    with gateway(settings(engines["http_only"], mm_processing=MmProcessing.WORKER)) as gw:
        resp = gw.post(one_image())
        assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "unsupported_media_url_scheme"
        assert "http,https" in resp.json()["error"]["message"]
        assert engines["http_only"].requests == []
        assert gw.post(chat([image_part("http://127.0.0.1:9/x.png"), TEXT])).status_code == 200
        assert sent_refs(engines["http_only"]) == [1]


def test_typed_anchor_text_is_forwarded_as_plain_text(uniform: Gateway, engines: dict[str, FakeEngine]) -> None:
    # Prompt integrity (docs/media-intake.md): the typed <|image_pad|> is text; the worker gets one anchor.
    body = chat([image_part(data_url(image_bytes(40, 60, 1, "PNG"))), {"type": "text", "text": "<|image_pad|>"}])
    resp = uniform.post(body)
    assert resp.status_code == 200, resp.text
    (sent,) = engines["capable"].requests + engines["capable2"].requests
    from transformers import AutoTokenizer

    anchor = AutoTokenizer.from_pretrained(str(bundle_dir(MODEL))).convert_tokens_to_ids("<|image_pad|>")
    assert list(sent.tokenized.input_ids).count(anchor) == 1
    assert len(sent.media_refs.items) == 1


@pytest.mark.parametrize("status,details,http,code", [
    (grpc.StatusCode.INVALID_ARGUMENT, "[code=media_host_not_allowed item=1] media host is not on the allow-list",
     400, "media_host_not_allowed"),
    (grpc.StatusCode.UNAVAILABLE, "[code=media_fetch_timeout item=1] media fetch timed out", 503,
     "media_fetch_timeout"),
    # A code that contradicts its status is not trusted: the status decides.
    (grpc.StatusCode.INVALID_ARGUMENT, "[code=media_fetch_timeout item=1] media fetch timed out", 400,
     "engine_rejected"),
    (grpc.StatusCode.UNAVAILABLE, "media sidecar: sidecar_overloaded: 9 jobs queued", 503, "engine_unavailable"),
])
def test_a_worker_media_error_keeps_its_code_status_and_part(
        uniform: Gateway, engines: dict[str, FakeEngine], status: grpc.StatusCode, details: str, http: int,
        code: str) -> None:
    engines["capable"].fail_with = engines["capable2"].fail_with = (status, details)
    body = chat([TEXT, image_part("http://127.0.0.1:9/a.png"), TEXT, image_part("http://127.0.0.1:9/b.png")])
    resp = uniform.post(body)
    assert resp.status_code == http and resp.headers["X-SMG-Error-Code"] == code
    if http == 503:
        assert resp.headers["Retry-After"]
    if code.startswith("media_"):
        assert resp.json()["error"]["param"] == "messages[0].content[3]"  # media_refs[1]


def test_streaming_usage_in_worker_mode_is_the_engines_count(uniform: Gateway) -> None:
    import json

    resp = uniform.post(one_image() | {"stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["prompt_tokens"] > FakeEngine.EXPANSION


# ---- pieces ------------------------------------------------------------------------------


def test_decide_is_the_table() -> None:
    class W:  # the one attribute decide reads
        def __init__(self, processor: str) -> None:
            self.labels = {"mm_processor": processor}

    yes, no = W("inprocess"), W("")
    auto, worker, router = MmProcessing.AUTO, MmProcessing.WORKER, MmProcessing.ROUTER
    assert decide(router, True, True, [yes]) == Decision(Mode.ROUTER, Reason.CONFIG)
    assert decide(worker, False, True, [yes]) == Decision(Mode.ROUTER, Reason.MODEL_NOT_OPTED_IN)
    assert decide(worker, True, False, [yes]) == Decision(Mode.ROUTER, Reason.PLAN_NOT_FORWARDABLE)
    assert decide(worker, True, True, [no]) == Decision(Mode.WORKER, Reason.CONFIG)
    assert decide(auto, True, True, []) == Decision(Mode.ROUTER, Reason.AUTO_NONE)
    assert decide(auto, True, True, [no, no]) == Decision(Mode.ROUTER, Reason.AUTO_NONE)
    assert decide(auto, True, True, [yes, yes]) == Decision(Mode.WORKER, Reason.AUTO_UNIFORM)
    assert decide(auto, True, True, [yes, no]) == Decision(Mode.ROUTER, Reason.AUTO_MIXED)


def test_any_non_default_field_of_a_media_part_is_a_hint() -> None:
    class HintedURL(msgspec.Struct, frozen=True):
        url: str
        detail: str | None = None
        max_long_side_pixel: int | None = None
        fps: float | None = None

    class HintedPart(msgspec.Struct, frozen=True, tag_field="type", tag="video_url"):
        video_url: HintedURL

    assert struct_hints(HintedPart(HintedURL("http://x/v.mp4", detail="high"))) == []
    assert struct_hints(HintedPart(HintedURL("http://x/v.mp4", fps=2.0))) == ["video_url.fps"]
    assert struct_hints(HintedPart(HintedURL("u", max_long_side_pixel=512))) == ["video_url.max_long_side_pixel"]
    assert not forwardable([HintedPart(HintedURL("u", fps=1.0))])  # not an ImagePart/VideoPart of ours either


def test_data_url_size_is_computed_without_decoding() -> None:
    payload = bytes(range(256)) * 7
    assert data_url_bytes(data_url(payload)) == len(payload)
    assert data_url_bytes("http://x/y.png") is None


def test_the_flag_wins_the_env_is_deprecated_and_garbage_stops_start_up(caplog: pytest.LogCaptureFixture) -> None:
    assert parse_settings(["--model", "m"], {}).mm_processing is MmProcessing.AUTO
    assert parse_settings(["--model", "m", "--mm-processing", "router"],
                          {"SMG_MM_PROCESSING": "worker"}).mm_processing is MmProcessing.ROUTER
    with caplog.at_level("WARNING"):
        assert parse_settings(["--model", "m"], {"SMG_MM_PROCESSING": "worker"}).mm_processing is MmProcessing.WORKER
    assert "deprecated" in caplog.text
    with pytest.raises(SystemExit):
        parse_settings(["--model", "m"], {"SMG_MM_PROCESSING": "sometimes"})
    with pytest.raises(SystemExit):
        parse_settings(["--model", "m", "--mm-processing", "sometimes"], {})
    assert parse_settings(["--model", "m", "--mm-processing-models", "a/b"], {}).mm_processing_models == ("a/b",)
