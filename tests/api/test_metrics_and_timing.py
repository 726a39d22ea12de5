"""``--log-mm-timing`` lines, the metric names of docs/metrics.md, the Grafana dashboard and /workers labels.

One reference engine (``--mm-processor inprocess``, so it can also process media itself) and two
gateway processes with ``--log-mm-timing``: one forced to router-side processing, one to
worker-side.  Requests go over real HTTP; the gateways' log files are read back and their
``smg_mm_timing`` lines parsed here (a ``key=value`` parser written in this file, not the code under
test).  Expected token counts come from the transformers processor of the same bundle.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine, start_gateway
from mmgate.config.settings import parse_settings
from tests.conftest import REPO, bundle_dir
from tests.video.video_support import ClipSpec, make_clip

MODEL = "Qwen/Qwen2-VL-2B-Instruct"
DOCS = REPO / "docs"
REQUEST_KEYS = ("request_id", "model", "mode", "transport", "image_count", "video_count", "audio_count",
                "video_frame_count", "media_fetch_decode_ms", "preprocess_ms", "token_expand_ms", "total_ms",
                "original_tokens", "expanded_tokens", "plan_ms", "render_ms", "assemble_ms",
                "engine_first_response_ms")
#: rounding of the printed milliseconds (3 decimals, 4 values summed)
EPSILON_MS = 0.01


@dataclass
class Stacks:
    engine: Child
    router: Child
    worker: Child

    def base(self, gateway: Child) -> str:
        return f"http://127.0.0.1:{gateway.port}"


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    logs = tmp_path_factory.mktemp("logs")
    bundle = str(bundle_dir(MODEL))
    engine = start_engine(bundle, extra=["--mm-processor", "inprocess"], log_dir=logs)
    gateways: list[Child] = []
    try:
        for mode in ("router", "worker"):
            gateways.append(start_gateway(bundle, [engine.port], log_dir=logs, extra=[
                "--served-model-name", MODEL, "--mm-processing", mode, "--log-mm-timing"]))
        yield Stacks(engine, *gateways)
    finally:
        for gateway in gateways:
            gateway.stop()
        engine.stop()


def _png(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _image_body(image: bytes, text: str = "Describe it.", stream: bool = False) -> dict[str, object]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"model": MODEL, "max_tokens": 2, "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]}


def _parse(line: str) -> tuple[str, dict[str, str]]:
    """``... smg_mm_timing <event> k=v k="quoted v" ...`` -> (event, {k: v})."""
    words = shlex.split(line[line.index("smg_mm_timing"):])
    assert words[0] == "smg_mm_timing"
    fields = {}
    for word in words[2:]:
        key, sep, value = word.partition("=")
        assert sep and key and re.fullmatch(r"[a-z_]+", key), word
        fields[key] = value
    return words[1], fields


def _events(gateway: Child, request_id: str) -> list[tuple[str, dict[str, str]]]:
    assert gateway.log_path is not None
    lines = [ln for ln in gateway.log_path.read_text(errors="replace").splitlines() if "smg_mm_timing" in ln]
    return [ev for ev in map(_parse, lines) if ev[1].get("request_id") == request_id]


def _reference_tokens(images: list[bytes], text: str) -> tuple[int, int]:
    """(prompt tokens with one anchor per image, expanded prompt tokens) from the transformers processor."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(bundle_dir(MODEL))
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    expanded = processor(text=[prompt], images=pil, return_tensors="np")["input_ids"].shape[1]
    return len(processor.tokenizer(prompt)["input_ids"]), int(expanded)


def test_image_request_writes_one_timing_line_whose_stages_fit_its_total(stacks: Stacks) -> None:
    image = _png(90, 120, 1)
    r = httpx.post(stacks.base(stacks.router) + "/v1/chat/completions", json=_image_body(image), timeout=120)
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    events = _events(stacks.router, request_id)
    plans = [f for ev, f in events if ev == "process_multimodal_plan"]
    assert len(plans) == 1
    line = plans[0]
    assert set(REQUEST_KEYS) <= set(line)
    ms = {k: float(line[k]) for k in REQUEST_KEYS if k.endswith("_ms")}
    assert all(v >= 0 for v in ms.values())
    assert ms["media_fetch_decode_ms"] + ms["preprocess_ms"] + ms["token_expand_ms"] <= ms["total_ms"] + EPSILON_MS
    assert ms["media_fetch_decode_ms"] > 0 and ms["preprocess_ms"] > 0
    original, expanded = _reference_tokens([image], "Describe it.")
    assert int(line["expanded_tokens"]) == r.json()["usage"]["prompt_tokens"] == expanded
    assert int(line["original_tokens"]) == original
    assert (line["image_count"], line["video_count"], line["audio_count"], line["video_frame_count"]) == (
        "1", "0", "0", "0")
    assert (line["model"], line["mode"], line["transport"]) == (MODEL, "router", "inline")
    # One transport event per tensor, before the request line.
    sent = {f["name"]: f for ev, f in events if ev == "mm_tensor_payload_inline"}
    assert {"pixel_values", "image_grid_thw"} <= set(sent)
    assert all(f["path"] == "inline" and f["runtime"] == "vllm" for f in sent.values())
    assert int(sent["image_grid_thw"]["nbytes"]) == 3 * 8  # one (t, h, w) row of int64
    assert [ev for ev, _ in events][-1] == "process_multimodal_plan"


def test_text_only_request_writes_no_timing_line(stacks: Stacks) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Say one word."}]}
    r = httpx.post(stacks.base(stacks.router) + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert _events(stacks.router, r.headers["x-request-id"]) == []


def test_video_request_writes_a_decode_event_per_clip(stacks: Stacks, tmp_path: Path) -> None:
    clip = make_clip(ClipSpec("t8", 8, 4, 64, 48), tmp_path)
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]}]}
    r = httpx.post(stacks.base(stacks.router) + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    events = _events(stacks.router, r.headers["x-request-id"])
    decodes = [f for ev, f in events if ev == "video_decode_backend"]
    assert len(decodes) == 1
    decode = decodes[0]
    assert (decode["width"], decode["height"], decode["ok"]) == ("64", "48", "true")
    assert int(decode["input_bytes"]) == clip.stat().st_size
    assert 0 < int(decode["frames"]) <= 8 and float(decode["elapsed_ms"]) > 0
    (plan,) = [f for ev, f in events if ev == "process_multimodal_plan"]
    assert (plan["video_count"], plan["image_count"]) == ("1", "0")
    assert plan["video_frame_count"] == decode["frames"]
    assert int(plan["expanded_tokens"]) == r.json()["usage"]["prompt_tokens"]


def test_worker_mode_line_has_the_engine_prompt_count(stacks: Stacks) -> None:
    image = _png(64, 64, 2)
    r = httpx.post(stacks.base(stacks.worker) + "/v1/chat/completions", json=_image_body(image), timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-mmgate-mm-processing"] == "worker"
    (plan,) = [f for ev, f in _events(stacks.worker, r.headers["x-request-id"]) if ev == "process_multimodal_plan"]
    original, expanded = _reference_tokens([image], "Describe it.")
    assert (plan["mode"], plan["transport"], plan["image_count"]) == ("worker", "none", "1")
    assert int(plan["original_tokens"]) == original
    assert int(plan["expanded_tokens"]) == r.json()["usage"]["prompt_tokens"] == expanded
    assert float(plan["media_fetch_decode_ms"]) == 0.0 and float(plan["total_ms"]) > 0


def _documented() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's table: metric -> (type, labels)."""
    table: dict[str, tuple[str, set[str]]] = {}
    for row in (DOCS / "metrics.md").read_text().splitlines():
        m = re.match(r"\| `((?:smg|mmgate)_[a-z0-9_]+)` \|\s*(counter|gauge|histogram)\s*\|([^|]*)\|", row)
        if m:
            table[m.group(1)] = (m.group(2), set(re.findall(r"`([a-z_]+)`", m.group(3))))
    return table


def _exported(text: str) -> dict[str, tuple[str, set[str]]]:
    """/metrics: family -> (type, label names seen on its samples)."""
    families: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m and not m.group(1).endswith("_created"):
            families[m.group(1)] = (m.group(2), set())
    for line in text.splitlines():
        m = re.match(r"([a-z_0-9]+)\{([^}]*)\}", line)
        if not m:
            continue
        name = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        if name in families:
            families[name][1].update(k for k in re.findall(r'([a-z_]+)="', m.group(2)) if k != "le")
    return families


def test_docs_table_and_metrics_endpoint_name_the_same_metrics(stacks: Stacks) -> None:
    base = stacks.base(stacks.router)
    assert httpx.post(base + "/v1/chat/completions", json=_image_body(_png(40, 40, 3), stream=True),
                      timeout=120).status_code == 200
    exported = _exported(httpx.get(base + "/metrics", timeout=10).text)
    documented = _documented()
    assert set(documented) == set(exported)
    for name, (kind, seen) in exported.items():
        assert kind == documented[name][0], name
        assert seen <= documented[name][1], name  # every label a series carries is documented
    for name in ("smg_mm_tensors_total", "smg_mm_tensor_bytes_total", "mmgate_request_duration_seconds",
                 "mmgate_stage_seconds", "smg_mm_processing_total", "mmgate_time_to_first_token_seconds"):
        assert exported[name][1] == documented[name][1], name  # these have series by now: all labels seen


def test_request_duration_and_ttft_are_observed(stacks: Stacks) -> None:
    base = stacks.base(stacks.router)

    def count(text: str, prefix: str) -> float:
        return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix))

    duration = 'mmgate_request_duration_seconds_count{endpoint="/v1/chat/completions",status="200"}'
    ttft = "mmgate_time_to_first_token_seconds_count"
    before = httpx.get(base + "/metrics", timeout=10).text
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    body["stream"] = False
    assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    bad = httpx.post(base + "/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=60)
    after = httpx.get(base + "/metrics", timeout=10).text
    assert count(after, duration) - count(before, duration) == 2
    assert count(after, ttft) - count(before, ttft) == 1  # the streamed one only
    bad_series = f'mmgate_request_duration_seconds_count{{endpoint="/v1/chat/completions",status="{bad.status_code}"}}'
    assert count(after, bad_series) - count(before, bad_series) == 1


def test_dashboard_queries_name_only_exported_metrics(stacks: Stacks) -> None:
    exported = _exported(httpx.get(stacks.base(stacks.router) + "/metrics", timeout=10).text)
    dashboard = json.loads((DOCS / "grafana-mmgate.json").read_text())
    used: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = re.findall(r"\b((?:smg|mmgate)_[a-z0-9_]+)", target["expr"])
            assert names, target["expr"]
            for name in names:
                family = name if name in exported else re.sub(r"_(bucket|sum|count)$", "", name)
                assert family in exported, name
                if family != name:
                    assert exported[family][0] == "histogram", name
                used.add(family)
    # the panels the issue asks for: request rate / latency, errors by code, stages, transport, shm
    # failures, processing mode, worker health, in-flight bytes, cache hit ratio
    assert {"mmgate_request_duration_seconds", "mmgate_errors_total", "mmgate_stage_seconds",
            "smg_mm_tensor_bytes_total", "smg_mm_shm_write_failures_total", "smg_mm_processing_total",
            "mmgate_worker_healthy", "mmgate_mm_inflight_bytes", "mmgate_mm_pixel_cache_hits_total",
            "mmgate_mm_pixel_cache_misses_total", "mmgate_time_to_first_token_seconds"} <= used


def test_workers_show_the_seed_labels_plus_wire_and_role(stacks: Stacks) -> None:
    (worker,) = httpx.get(stacks.base(stacks.router) + "/workers", timeout=10).json()["workers"]
    labels = worker["labels"]
    assert {"mm_processor", "mm_processor_source", "mm_media_ref_schemes", "supports_vision",
            "shm_namespace_id"} <= set(labels)
    assert (labels["mm_processor"], labels["supports_vision"]) == ("inprocess", "true")
    assert (labels["wire"], labels["role"]) == ("vllm", "single")


def test_log_mm_timing_flag_and_its_deprecated_variable(caplog: pytest.LogCaptureFixture) -> None:
    assert parse_settings(["--model", "m"], {}).log_mm_timing is False
    assert parse_settings(["--model", "m", "--log-mm-timing"], {}).log_mm_timing is True
    with caplog.at_level(logging.WARNING, logger="mmgate.settings"):
        assert parse_settings(["--model", "m"], {"SMG_LOG_MM_TIMING": "yes"}).log_mm_timing is True
        assert parse_settings(["--model", "m"], {"SMG_LOG_MM_TIMING": "off"}).log_mm_timing is False
    assert sum("SMG_LOG_MM_TIMING is deprecated" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(SystemExit, match="SMG_LOG_MM_TIMING"):
        parse_settings(["--model", "m"], {"SMG_LOG_MM_TIMING": "sometimes"})


def test_tensors_sent_through_shared_memory_are_logged_as_shm_writes(caplog: pytest.LogCaptureFixture) -> None:
    """In process: a request prepared and encoded inside a timing scope with shm on for tensors of 1 KiB or
    more; ``pixel_values`` (float32, the reference processor's shape) goes by shm, ``image_grid_thw`` inline."""
    import asyncio

    from transformers import AutoProcessor

    from mmgate.observe import timing_log
    from mmgate.gateway.state import build_state
    from mmgate.request.parse import parse_chat_request
    from mmgate.engines.vllm import encode_generate_request
    from mmgate.config.settings import Settings
    from mmgate.transport.dtypes import EncoderDtype
    from mmgate.transport.policy import WirePlan
    from mmgate.transport.shm import ShmLease

    image = _png(56, 84, 4)
    state = build_state(Settings(model=str(bundle_dir(MODEL)), preprocess_threads=1))
    req = parse_chat_request(json.dumps(_image_body(image)).encode())
    wire = WirePlan(shm=True, shm_min_bytes=1024, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)

    async def run() -> None:
        with timing_log.request_scope(True, "req-shm", MODEL):
            prepared = await state.pipeline.prepare(req, "req-shm", choose_worker=lambda m, key: False, defer_pixels=True)
            with ShmLease() as lease:
                await encode_generate_request(prepared, wire, lease).fill()

    try:
        with caplog.at_level(logging.INFO, logger="mmgate.timing"):
            asyncio.run(run())
    finally:
        state.executor.shutdown(wait=True)
    events = [_parse(r.getMessage()) for r in caplog.records if r.name == "mmgate.timing"]
    shm = {f["name"]: f for ev, f in events if ev == "mm_shm_write"}
    inline = {f["name"]: f for ev, f in events if ev == "mm_tensor_payload_inline"}
    processor = AutoProcessor.from_pretrained(bundle_dir(MODEL))
    pil = Image.open(io.BytesIO(image))
    pixel_values = processor.image_processor(images=[pil], return_tensors="np")["pixel_values"]
    assert set(shm) == {"pixel_values"}
    assert (shm["pixel_values"]["path"], int(shm["pixel_values"]["nbytes"])) == ("shm", pixel_values.size * 4)
    assert inline["image_grid_thw"]["nbytes"] == "24"
    assert all(f["request_id"] == "req-shm" for _, f in events)


def test_budget_refusals_count_under_smg_admission_reasons() -> None:
    import asyncio

    from mmgate.observe import metrics
    from mmgate.pipeline.budget import InflightBudget
    from mmgate.errors import ErrorCode, GatewayError

    def value() -> float:
        return metrics.REGISTRY.get_sample_value("smg_admission_queue_rejected_total",
                                                 {"reason": "multimodal_too_large"}) or 0.0

    before = value()
    with pytest.raises(GatewayError) as refused:
        asyncio.run(InflightBudget(1000).acquire(1001))
    assert refused.value.code is ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE
    assert value() - before == 1
