"""Worker-side processing (``--mm-processing worker|auto``) of InternVL3: clips are processed by the gateway,
images on the worker.

An InternVL clip's prompt update is text-level (``Frame{i}: <img>...</img>`` text re-tokenized with the prompt,
``Family.text_updates``); media references carry only the unexpanded ids, so the worker would fetch the clip
and then fail ("they need the prompt text").  A request with such an item is not forwardable: it is decided
router / ``plan_not_forwardable`` and answered as in router mode.  Real parts: one reference engine (``--mm-processor inprocess``, loopback origins
allowed, recording its model inputs with ``--record-dir``), in-thread gateways in worker and router mode, a
loopback media origin.  Controls: an InternVL image in worker mode is served and reaches the model exactly as
in router mode.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine
from mmgate.config.settings import FetchSettings, MmProcessing, Settings
from mmgate.observe.metrics import REGISTRY
from tests.conftest import bundle_dir
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin
from tests.video.video_support import ClipSpec, load, make_clip, processor

MODEL = "OpenGVLab/InternVL3-1B-hf"
CONTEXT_ID = 151667  # <IMG_CONTEXT>


def png() -> bytes:
    arr = np.random.default_rng(3).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, Path]]:
    root = tmp_path_factory.mktemp("ivl-worker-mode")
    records = root / "records"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_WAIT_POLICY="PASSIVE")
    child = start_engine(str(bundle_dir(MODEL)), ["--mm-processor", "inprocess", "--mm-allow-private-media-hosts",
                                                  "--record-dir", str(records)], root, env)
    try:
        yield child, records
    finally:
        child.stop()


def settings(engine: Child, mode: MmProcessing) -> Settings:
    return Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, mm_processing=mode,
                    fetch=FetchSettings(allow_private_hosts=True), worker_urls=(f"grpc://127.0.0.1:{engine.port}",),
                    worker_health_interval_s=0.2)


def recorded(records: Path) -> set[Path]:
    return set(records.glob("*.npz")) if records.exists() else set()


def chat(part: dict) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
            "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def reference(content: list[dict], **media: list) -> tuple[list[int], np.ndarray]:
    """transformers' ids and ``pixel_values`` for one user turn of ``content`` parts (``InternVLProcessor``, the
    bundle's template)."""
    proc = processor(MODEL)
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    out = proc(text=[prompt], return_tensors="pt", **media)  # "np" fails in 5.24 for video
    return [int(t) for t in out["input_ids"][0]], out["pixel_values"].numpy()


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def test_internvl_clip_in_worker_mode_is_processed_by_the_gateway(
        engine: tuple[Child, Path], origin: MediaOrigin, tmp_path: Path) -> None:
    child, records = engine
    path = make_clip(ClipSpec("ivl-wm", 4, 8, 64, 48), tmp_path)
    url = origin.add("/ivl-wm-clip.mp4", path.read_bytes(), "video/mp4")
    labels = {"model": MODEL, "mode": "router", "reason": "plan_not_forwardable"}
    answers = {}
    for mode in (MmProcessing.WORKER, MmProcessing.AUTO, MmProcessing.ROUTER):
        before = REGISTRY.get_sample_value("smg_mm_processing_total", labels) or 0.0
        with gateway_in_thread(settings(child, mode)) as base:
            answers[mode] = post(base, chat({"type": "video_url", "video_url": {"url": url}}))
        assert answers[mode].status_code == 200, (mode, answers[mode].text)
        assert "X-Mmgate-Mm-Processing" not in answers[mode].headers, mode  # set only on the worker path
        # worker and auto (the engine advertises a media processor): the clip's update is text-level, so the
        # decision is router / plan_not_forwardable; router mode is decided by its setting
        want = 0.0 if mode is MmProcessing.ROUTER else 1.0
        assert (REGISTRY.get_sample_value("smg_mm_processing_total", labels) or 0.0) - before == want, mode
    # the reference: InternVLProcessor on the clip's 4 frames (vLLM keeps every frame of a clip of <= 32)
    frames, _ = load(path)
    want, _ = reference([{"type": "video"}, {"type": "text", "text": "What is it?"}], videos=[frames])
    usage = {m: a.json()["usage"]["prompt_tokens"] for m, a in answers.items()}
    assert set(usage.values()) == {len(want)}, (usage, len(want))
    texts = {m: a.json()["choices"][0]["message"]["content"] for m, a in answers.items()}
    assert len(set(texts.values())) == 1, texts


def test_internvl_image_in_worker_mode_reaches_the_model_as_in_router_mode(
        engine: tuple[Child, Path], origin: MediaOrigin) -> None:
    child, records = engine
    url = origin.add("/ivl-wm-image.png", png(), "image/png")
    answers: dict[str, httpx.Response] = {}
    for mode in (MmProcessing.ROUTER, MmProcessing.WORKER):
        with gateway_in_thread(settings(child, mode)) as base:
            answers[mode.value] = post(base, chat({"type": "image_url", "image_url": {"url": url}}))
    for mode, resp in answers.items():
        assert resp.status_code == 200, (mode, resp.text)
    assert answers["worker"].headers.get("X-Mmgate-Mm-Processing") == "worker"
    router, worker = (np.load(records / f"{answers[m].headers['X-Request-Id']}.npz") for m in ("router", "worker"))
    assert sorted(router.files) == sorted(worker.files)
    for key in router.files:
        assert router[key].dtype == worker[key].dtype and np.array_equal(router[key], worker[key]), key
    ids = router["input_ids"][0].tolist()
    # the reference: InternVLProcessor's ids and pixel values for the same image and turn
    image = Image.open(io.BytesIO(png()))
    want_ids, want_pixels = reference([{"type": "image"}, {"type": "text", "text": "What is it?"}], images=[image])
    assert ids == want_ids and np.array_equal(worker["pixel_values"], want_pixels)
    a, b = answers["router"].json(), answers["worker"].json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] == len(ids)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
