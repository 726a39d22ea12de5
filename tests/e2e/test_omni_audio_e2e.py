"""Audio (and video) end to end for Qwen2.5-Omni and Qwen3-Omni: the official ``openai`` client -> gateway (loopback,
real app) -> reference engine on the TokenSpeed wire (in process, recording what the model received).

Per model, one request with one ``input_audio`` (base64 wav), one ``audio_url`` (served by a loopback HTTP
origin) and one image:

* the engine's model code accepts it (a completion comes back);
* ``usage.prompt_tokens`` equals the length of the transformers 5.24 processor's ``input_ids`` for the same
  conversation (``processor(text=apply_chat_template(...), images=[image], audio=clips)``, the clips loaded
  by transformers' own ``load_audio``), and the prompt the engine recorded *is* those ids;
* the audio tensors the engine's model received are the processor's one call on the clips (valid frames).

A video with an ``input_audio`` likewise (the clip's tensors as the processor's, frames sampled as a vLLM worker
samples them).  Worker path: the same image + audio request as media references on the vLLM wire to an engine
that processes them itself (``--mm-processing worker``; the reference engine's worker-side processor is
mmgate's own pipeline, a real vLLM worker runs its HF processor).

A clip with its audio track under ``use_audio_in_video: true``: the interleaved prompt, the track's features
and the thinker's ``use_audio_in_video`` flag.

Refusals through HTTP with the real Omni family: a non-bool ``use_audio_in_video`` (400 ``invalid_request``),
a corrupt clip (400 ``audio_decode_failed``), a clip over ``--audio-max-duration`` (413
``audio_too_long``), an ``audio_url`` over ``--audio-max-input-bytes`` (413 ``media_too_large``), and
router-side audio to a vLLM or an SGLang worker (400 ``multimodal_not_supported``, no fetch).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mmgate.config.settings import parse_settings
from mmgate.engines.base import Wire
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.audio.clips import encode
from tests.conftest import bundle_dir
from tests.support.fake_engines import FakeEngine
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin

BUNDLES = {"qwen2_5_omni": "Qwen--Qwen2.5-Omni-7B", "qwen3_omni_moe": "Qwen--Qwen3-Omni-30B-A3B-Instruct"}
SR = 16000


def tone(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * SR))
    t = np.arange(n) / SR
    sig = 0.3 * np.sin(2 * np.pi * (250 + 70 * seed) * t) + 0.05 * rng.standard_normal(n)
    return np.clip(sig, -0.9, 0.9).astype(np.float32)[None, :]


CLIP_A = encode(tone(1.21, 1), "wav", SR)  # input_audio
CLIP_B = encode(tone(0.83, 2), "wav", SR)  # audio_url


def png(width: int = 64, height: int = 48) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(5).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@cache
def processor(folder: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(bundle_dir(folder)))


def reference_ids(folder: str, image: bytes, clips: list[bytes]) -> list[int]:
    """The processor's ``input_ids`` for [image, audio, audio, text]: clips loaded by transformers'
    ``load_audio`` (16 kHz wav: no resampling), the image by PIL."""
    from PIL import Image
    from transformers.audio_utils import load_audio

    proc = processor(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "audio"},
                                             {"type": "text", "text": "Describe both."}]}]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    audio = [load_audio(b64(c), sampling_rate=SR, backend="soundfile") for c in clips]
    out = proc(text=text, images=[Image.open(io.BytesIO(image)).convert("RGB")], audio=audio, return_tensors="np")
    return out["input_ids"][0].tolist(), out


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


@pytest.fixture(scope="module", params=sorted(BUNDLES), ids=str)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(model_type, gateway base URL, record dir) for a TokenSpeed reference engine of the bundle."""
    model_type = request.param
    record = tmp_path_factory.mktemp(f"rec-{model_type}")
    engine: RunningEngine = start_engine(EngineConfig(model=bundle_dir(BUNDLES[model_type]), port=0,
                                                      wire=Wire.TOKENSPEED, record_dir=record))
    try:
        settings = parse_settings(["--model", str(bundle_dir(BUNDLES[model_type])), "--served-model-name", model_type,
                                   "--worker-urls", f"grpc://127.0.0.1:{engine.port}",
                                   "--mm-allow-private-media-hosts", "--audio-max-duration", "5",
                                   "--audio-max-input-bytes", "200000"], {})
        with gateway_in_thread(settings) as base:
            yield model_type, base, record
    finally:
        engine.server.stop(0)


def audio_parts(origin: MediaOrigin, tag: str) -> list[dict[str, Any]]:
    url = origin.add(f"/{tag}.wav", CLIP_B, "audio/wav")
    return [{"type": "input_audio", "input_audio": {"data": b64(CLIP_A), "format": "wav"}},
            {"type": "audio_url", "audio_url": {"url": url}}]


def test_input_audio_audio_url_and_image_reach_the_thinker_with_the_processor_s_prompt(
        stack: tuple[str, str, Path], origin: MediaOrigin) -> None:
    model_type, base, record = stack
    image = png()
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}},
               *audio_parts(origin, f"ok-{model_type}"), {"type": "text", "text": "Describe both."}]
    completion = client.chat.completions.create(model=model_type, messages=[{"role": "user", "content": content}],
                                                max_tokens=2, temperature=0)
    ids, ref = reference_ids(BUNDLES[model_type], image, [CLIP_A, CLIP_B])
    assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)
    assert completion.usage.completion_tokens == 2
    recorded = sorted(record.glob("*.npz"))
    assert len(recorded) == 1
    with np.load(recorded[0], allow_pickle=False) as rec:
        keys = set(rec.files)
        prompt_key = next(k for k in ("input_ids", "prompt_ids") if k in keys)
        assert rec[prompt_key].reshape(-1).tolist() == ids, sorted(keys)
        assert np.array_equal(rec["pixel_values"], ref["pixel_values"])
        lengths = rec["feature_attention_mask"].sum(-1).tolist()
        assert lengths == ref["feature_attention_mask"].sum(-1).tolist()
        features = rec["input_features"]
    # per clip, its valid frames as the processor's one call on the request's clips computes them (the shorter clip
    # zero-padded to the longer: docs/parity.md "Several clips in one request")
    for k in range(2):
        valid = lengths[k]
        assert np.array_equal(features[k, :, :valid], ref["input_features"][k][:, :valid]), f"clip {k}"


def test_a_clip_with_its_audio_track_reaches_the_thinker_with_the_processor_s_prompt(
        stack: tuple[str, str, Path], tmp_path: Path) -> None:
    """``use_audio_in_video: true`` with an mp4 carrying frames and an aac track: the thinker runs the interleaved
    prompt (``usage.prompt_tokens`` and the recorded ids are the processor's, given the same frames and the
    waveform mmgate decoded from the track), the track's features as the processor's, and the engine sets the
    thinker's ``use_audio_in_video`` (read from the prompt: no wire carries it) so its M-RoPE positions are the
    interleaved ones."""
    import copy
    import warnings

    from tests.support.av_clips import av_clip, track
    from tests.video.video_support import load, vllm_sampling_kwargs

    model_type, base, record = stack
    path = av_clip(tmp_path, "track", 2.6)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(path.read_bytes())}},
               {"type": "text", "text": "What do you see and hear?"}]
    before = set(record.glob("*.npz"))
    completion = client.chat.completions.create(model=model_type, messages=[{"role": "user", "content": content}],
                                                max_tokens=2, temperature=0,
                                                extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    proc = processor(BUNDLES[model_type])
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What do you see and hear?"}]}]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames, meta = load(path)
    wave = track(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = proc(text=text, videos=[frames], video_metadata=[copy.deepcopy(meta)], audio=[wave],
                   audio_from_video_indices=[0], use_audio_in_video=True, return_tensors="np",
                   videos_kwargs={"cap_pixels_per_frame": False, **vllm_sampling_kwargs(proc)})
    ids = ref["input_ids"][0].tolist()
    assert proc.audio_token_id in ids
    assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)
    (recorded,) = set(record.glob("*.npz")) - before
    with np.load(recorded, allow_pickle=False) as rec:
        assert rec["input_ids"].reshape(-1).tolist() == ids
        assert bool(rec["use_audio_in_video"])
        assert np.array_equal(rec["pixel_values_videos"], ref["pixel_values_videos"])
        assert np.array_equal(rec["video_grid_thw"], ref["video_grid_thw"])
        valid = int(ref["feature_attention_mask"][0].sum())
        assert rec["feature_attention_mask"].sum(-1).tolist() == [valid]
        assert np.array_equal(rec["input_features"][0, :, :valid], ref["input_features"][0, :, :valid])


def test_a_non_bool_use_audio_in_video_is_refused(stack: tuple[str, str, Path], origin: MediaOrigin) -> None:
    model_type, base, _ = stack
    body = {"model": model_type, "max_tokens": 1, "mm_processor_kwargs": {"use_audio_in_video": "yes"},
            "messages": [{"role": "user", "content": [audio_parts(origin, f"uav-{model_type}")[0],
                                                      {"type": "text", "text": "?"}]}]}
    resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "invalid_request", resp.text
    assert resp.json()["error"]["param"] == "mm_processor_kwargs.use_audio_in_video"


@pytest.mark.parametrize(("data", "status", "code"), [
    (b"RIFF" + b"\x13" * 300, 400, "audio_decode_failed"),
    (encode(tone(6.0, 3), "wav", SR), 413, "audio_too_long"),  # 192 kB, over --audio-max-duration 5
], ids=["corrupt", "over_long"])
def test_bad_clips_are_refused_with_stable_codes(stack: tuple[str, str, Path], data: bytes, status: int,
                                                 code: str) -> None:
    model_type, base, _ = stack
    body = {"model": model_type, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}, {"type": "text", "text": "?"}]}]}
    resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == status and resp.headers["X-SMG-Error-Code"] == code, resp.text
    assert b64(data)[:40] not in resp.text


def test_an_over_size_audio_url_is_refused_413(stack: tuple[str, str, Path], origin: MediaOrigin) -> None:
    model_type, base, _ = stack
    url = origin.add(f"/big-{model_type}.wav", encode(tone(7.0, 4), "wav", SR), "audio/wav")  # 224 kB > 200 kB
    body = {"model": model_type, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
    resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 413 and resp.headers["X-SMG-Error-Code"] == "media_too_large", resp.text


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
def test_router_side_audio_to_a_vllm_or_sglang_worker_is_refused_before_any_fetch(origin: MediaOrigin,
                                                                                   wire: str) -> None:
    folder = BUNDLES["qwen3_omni_moe"]
    worker: Any = FakeWorker(FakeWorkerState(model_type="qwen3_omni_moe")) if wire == "vllm" else FakeEngine("sglang")
    try:
        settings = parse_settings(["--model", str(bundle_dir(folder)), "--served-model-name", "omni",
                                   "--worker-urls", worker.url, "--mm-allow-private-media-hosts",
                                   "--mm-processing", "router"], {})
        with gateway_in_thread(settings) as base:
            path = f"/matrix-omni-{wire}.wav"
            url = origin.add(path, CLIP_B, "audio/wav")
            body = {"model": "omni", "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
            resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported", \
                resp.text
            assert origin.settled()[path] == 0
    finally:
        worker.stop()


@pytest.mark.parametrize("model_type", sorted(BUNDLES))
def test_audio_goes_as_a_media_reference_to_a_worker_that_processes_media(model_type: str, origin: MediaOrigin,
                                                                           tmp_path: Path) -> None:
    """``--mm-processing worker``: the gateway forwards the unexpanded prompt and the audio (and image) as
    media references on the vLLM wire; the reference engine (``--mm-processor inprocess``) fetches and
    processes them itself and runs the thinker: ``usage.prompt_tokens`` is the processor's count."""
    from mmgate.refengine.config import parse_args

    folder = BUNDLES[model_type]
    config = parse_args(["--model", str(bundle_dir(folder)), "--port", "0", "--mm-processor", "inprocess",
                         "--mm-allow-private-media-hosts", "--record-dir", str(tmp_path)], {})
    engine = start_engine(config)
    try:
        settings = parse_settings(["--model", str(bundle_dir(folder)), "--served-model-name", model_type,
                                   "--worker-urls", f"grpc://127.0.0.1:{engine.port}",
                                   "--mm-allow-private-media-hosts", "--mm-processing", "worker"], {})
        with gateway_in_thread(settings) as base:
            image = png()
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}},
                       *audio_parts(origin, f"refs-{model_type}"), {"type": "text", "text": "Describe both."}]
            completion = client.chat.completions.create(model=model_type,
                                                        messages=[{"role": "user", "content": content}],
                                                        max_tokens=2, temperature=0)
            ids, ref = reference_ids(folder, image, [CLIP_A, CLIP_B])
            assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)
        # the engine expanded the references itself: the model got the processor's prompt and audio lengths
        recorded = sorted(tmp_path.glob("*.npz"))
        assert len(recorded) == 1
        with np.load(recorded[0], allow_pickle=False) as rec:
            assert rec["input_ids"].reshape(-1).tolist() == ids
            assert rec["feature_attention_mask"].sum(-1).tolist() == ref["feature_attention_mask"].sum(-1).tolist()
    finally:
        engine.server.stop(0)


def test_a_clip_with_audio_reaches_the_thinker_with_the_processor_s_prompt(
        stack: tuple[str, str, Path], tmp_path: Path) -> None:
    """A video (sampled as a vLLM worker samples it) with an ``input_audio``: the engine's thinker takes the clip's
    ``pixel_values_videos``, ``video_grid_thw`` and ``video_second_per_grid``; the prompt is the processor's."""
    import copy
    import warnings

    from tests.video.video_support import ClipSpec, load, make_clip, vllm_sampling_kwargs

    model_type, base, record = stack
    path = make_clip(ClipSpec("omni", 9, 6, 64, 48), tmp_path)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(path.read_bytes())}},
               {"type": "input_audio", "input_audio": {"data": b64(CLIP_A), "format": "wav"}},
               {"type": "text", "text": "Describe both."}]
    before = set(record.glob("*.npz"))
    completion = client.chat.completions.create(model=model_type, messages=[{"role": "user", "content": content}],
                                                max_tokens=2, temperature=0)
    from transformers.audio_utils import load_audio

    proc = processor(BUNDLES[model_type])
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "audio"},
                                             {"type": "text", "text": "Describe both."}]}]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames, meta = load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = proc(text=text, videos=[frames], video_metadata=[copy.deepcopy(meta)],
                   audio=[load_audio(b64(CLIP_A), sampling_rate=SR, backend="soundfile")], return_tensors="np",
                   videos_kwargs={"cap_pixels_per_frame": False, **vllm_sampling_kwargs(proc)})
    ids = ref["input_ids"][0].tolist()
    assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)
    (recorded,) = set(record.glob("*.npz")) - before
    with np.load(recorded, allow_pickle=False) as rec:
        assert rec["input_ids"].reshape(-1).tolist() == ids
        assert np.array_equal(rec["pixel_values_videos"], ref["pixel_values_videos"])
        assert np.array_equal(rec["video_grid_thw"], ref["video_grid_thw"])
        assert np.array_equal(rec["video_second_per_grid"], np.asarray(ref["video_second_per_grid"], np.float32))
        # a clip next to an audio part is not a clip carrying its track: the thinker's flag stays off
        assert "use_audio_in_video" not in rec.files


def test_a_clip_s_track_to_a_vllm_worker_is_refused_at_worker_selection(tmp_path: Path) -> None:
    """``use_audio_in_video: true`` with a clip that has a track makes the request carry audio: router-side audio
    goes to TokenSpeed only, so a gateway with only a vLLM worker refuses it (400 ``multimodal_not_supported``)
    once the clip is decoded (a silent clip would not bring audio: the fetch decides), and without the option the
    same clip goes through to the worker."""
    from tests.support.av_clips import av_clip

    folder = BUNDLES["qwen3_omni_moe"]
    worker = FakeWorker(FakeWorkerState(model_type="qwen3_omni_moe"))
    try:
        settings = parse_settings(["--model", str(bundle_dir(folder)), "--served-model-name", "omni",
                                   "--worker-urls", worker.url, "--mm-processing", "router"], {})
        path = av_clip(tmp_path, "to-vllm", 1.2)
        with gateway_in_thread(settings) as base:
            content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(path.read_bytes())}},
                       {"type": "text", "text": "?"}]
            body: dict[str, Any] = {"model": "omni", "max_tokens": 1,
                                    "messages": [{"role": "user", "content": content}]}
            resp = httpx.post(base + "/v1/chat/completions", json={
                **body, "mm_processor_kwargs": {"use_audio_in_video": True}}, timeout=60)
            assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported", \
                resp.text
            resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
    finally:
        worker.stop()
