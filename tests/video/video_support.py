"""Shared helpers of the video tests: clips made with PyAV, the reference path, the mmgate path.

* ``make_clip`` encodes a deterministic clip (every frame different, so a
  wrong frame index shows) with PyAV's bundled FFmpeg: libx264 (yuv420p, or
  yuv444p for odd sizes) or mpeg4; optional display-matrix rotation
  (``VideoStream.set_display_rotation``) and variable frame durations.
* ``reference`` runs the transformers 5.24 path on a file: its own pyav loader
  ``load_video(path, backend="pyav")`` (torchcodec is not installed here; the
  video processor's URL path would pick it), then ``AutoProcessor`` with the
  decoded frames and their ``VideoMetadata``; given ``indices``, the processor
  gets only those frames, with ``frames_indices`` in the metadata and no
  sampling of its own, as a vLLM worker hands them over after its video loader
  sampled them (vLLM 0.33 ``vllm/multimodal/video.py`` ``VideoLoader.create_hf_metadata``).
* ``vllm_video_kwargs`` are the video kwargs that make the transformers processor
  sample as a vLLM worker does (:mod:`tests.support.vllm_video`).
* ``prepare`` runs mmgate's pipeline in process on ``data:`` URLs, under either
  ``--video-frame-sampling``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

import av
import numpy as np

from mmgate.request.parse import parse_chat_request
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.cli.launch import free_port
from mmgate.media.fetch import MediaFetcher
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import load_family
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.prepare import Pipeline
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.config.settings import AudioSettings, FetchSettings, Settings, VideoSettings
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.types import PreparedRequest
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread
from tests.support.vllm_video import vllm_sampling_kwargs

QWEN2 = "Qwen/Qwen2-VL-2B-Instruct"
QWEN2_5 = "Qwen/Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen/Qwen3-VL-2B-Instruct"
MODELS = (QWEN2, QWEN2_5, QWEN3)


@dataclass(frozen=True)
class ClipSpec:
    name: str
    frames: int
    fps: int
    width: int
    height: int
    codec: str = "libx264"
    rotation: int | None = None
    durations_ms: tuple[int, ...] | None = None  # variable frame rate: per-frame durations
    container: str = "mp4"

    @property
    def pix_fmt(self) -> str:
        if self.codec == "libx264" and (self.width % 2 or self.height % 2):
            return "yuv444p"
        return "yuv420p"


def frame_pixels(i: int, height: int, width: int) -> np.ndarray:
    """Frame ``i``: gradients that move with ``i`` plus seeded noise (uint8 ``[H, W, 3]``)."""
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * 5 + i * 9) % 256, (yy * 7 + i * 13) % 256, ((xx + yy) * 3 + i * 29) % 256], axis=-1)
    noise = np.random.default_rng(i).integers(0, 24, (height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def make_clip(spec: ClipSpec, folder: Path) -> Path:
    path = folder / f"{spec.name}.{'webm' if spec.container == 'webm' else spec.container}"
    container = av.open(str(path), "w", format="webm" if spec.container == "webm" else None)
    stream = container.add_stream(spec.codec, rate=spec.fps)
    stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, spec.pix_fmt
    if spec.codec == "libx264":
        stream.options = {"preset": "ultrafast", "crf": "18"}
    if spec.rotation is not None:
        stream.set_display_rotation(spec.rotation)
    if spec.durations_ms is not None:
        stream.codec_context.time_base = Fraction(1, 1000)
        stream.time_base = Fraction(1, 1000)
    pts = 0
    for i in range(spec.frames):
        frame = av.VideoFrame.from_ndarray(frame_pixels(i, spec.height, spec.width), format="rgb24")
        if spec.durations_ms is not None:
            frame.pts, frame.time_base = pts, Fraction(1, 1000)
            pts += spec.durations_ms[i % len(spec.durations_ms)]
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


#: the parity corpus: 1, 2, 3, 5, 17, 60, 301 frames; 24, 25, 30, 60 fps; odd sizes; rotation; VFR
CLIPS = (
    ClipSpec("f1_24fps", 1, 24, 64, 48),
    ClipSpec("f2_25fps", 2, 25, 66, 50),
    ClipSpec("f3_30fps_odd", 3, 30, 65, 47),
    ClipSpec("f5_60fps", 5, 60, 96, 54),
    ClipSpec("f17_25fps_mpeg4", 17, 25, 70, 46, codec="mpeg4"),
    ClipSpec("f60_30fps", 60, 30, 160, 90),
    ClipSpec("f301_24fps_tiny", 301, 24, 48, 32),
    ClipSpec("f8_4fps_rot90", 8, 4, 64, 48, rotation=90),
    ClipSpec("f20_vfr", 20, 30, 63, 45, durations_ms=(33, 33, 100, 17, 250, 40, 66, 10)),
)


def data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


@cache
def processor(model: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(bundle_dir(model))


@dataclass(frozen=True)
class Reference:
    input_ids: list[int]
    frames: np.ndarray  # what load_video decoded (all frames), uint8 [T, H, W, 3]
    indices: list[int]  # frames the video processor kept
    fps: float
    out: dict[str, np.ndarray]


def load(path: Path) -> tuple[np.ndarray, Any]:
    from transformers.video_utils import load_video

    return load_video(str(path), backend="pyav")


def vllm_video_kwargs(model: str) -> dict[str, Any]:
    """:func:`tests.support.vllm_video.vllm_sampling_kwargs` of ``model``'s processor."""
    return vllm_sampling_kwargs(processor(model))


def reference(model: str, path: Path, text: str = "What happens?", images: list | None = None,
              video_kwargs: dict | None = None, image_kwargs: dict | None = None,
              indices: list[int] | None = None, flat: dict | None = None,
              loaded: tuple[np.ndarray, Any] | None = None) -> Reference:
    """The transformers processor on the frames its pyav loader decodes (video first, then images);
    with ``indices``, on those frames only (see the module docstring).  ``flat``: kwargs passed to the
    processor call itself, as a vLLM worker passes a request's ``mm_processor_kwargs`` (the processor
    hands each to every modality that declares it).  ``loaded``: what ``load(path)`` returned already."""
    proc = processor(model)
    frames, meta = loaded if loaded is not None else load(path)
    vk = {"cap_pixels_per_frame": False, **(video_kwargs or {})}
    given, given_meta = frames, meta
    if indices is not None:
        given = frames[indices]
        given_meta = copy.deepcopy(meta)
        given_meta.frames_indices = list(indices)
        vk["do_sample_frames"] = False
    content = [{"type": "video"}] + [{"type": "image"} for _ in images or ()] + [{"type": "text", "text": text}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Flat kwargs go alone: next to a videos_kwargs dict the processor would drop some of them.
        by_modality = {"videos_kwargs": vk, "images_kwargs": image_kwargs or {}} if flat is None else {**vk, **flat}
        out = dict(proc(text=[prompt], videos=[given], video_metadata=[copy.deepcopy(given_meta)], images=images,
                        return_tensors="np", return_metadata=True, **by_modality))  # metadata: the frames kept
    kept = out.pop("video_metadata")[0].frames_indices
    return Reference(input_ids=[int(t) for t in out["input_ids"][0]], frames=frames,
                     indices=[int(i) for i in (range(len(frames)) if kept is None else kept)], fps=float(meta.fps),
                     out=out)


def assert_same(prepared: PreparedRequest, ref: Reference) -> None:
    """mmgate's request equals the reference: ids, and per batch ``pixel_values`` (max |diff| 0, same shape),
    the grid and ``second_per_grid_ts``."""
    assert prepared.input_ids == tuple(ref.input_ids)
    for batch in prepared.batches:
        video = "video_grid_thw" in batch.tensors
        assert np.array_equal(batch.tensors["pixel_values"], ref.out["pixel_values_videos" if video else "pixel_values"])
        grid = "video_grid_thw" if video else "image_grid_thw"
        assert np.array_equal(batch.tensors[grid], ref.out[grid])
        if "second_per_grid_ts" in batch.tensors:
            assert np.array_equal(batch.tensors["second_per_grid_ts"],
                                  np.asarray(ref.out["second_per_grid_ts"], dtype=np.float32))


@cache
def pipeline(model: str, sampling: FrameSampling = FrameSampling.VLLM, audio: AudioSettings | None = None,
             pixel_cache: PixelCache | None = None) -> Pipeline:
    """``model``'s pipeline as the parity tests run it (``audio``: the audio settings, default ones if None)."""
    bundle = load_bundle(bundle_dir(model), name=model)
    tokenizer = load_tokenizer(bundle)
    family = load_family(bundle, tokenizer, ImageBackend.TORCHVISION, video_sampling=sampling)
    runtime = ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family, served_name=model)
    # The parity tests compare with the reference's pyav loader, which keeps the stored orientation.
    settings = Settings(model=model, video=VideoSettings(apply_rotation=False, frame_sampling=sampling),
                        audio=audio or AudioSettings())
    return Pipeline(runtime, settings, MediaFetcher(settings.fetch), ThreadPoolExecutor(2), cache=pixel_cache)


def chat_body(model: str, parts: list[dict], text: str = "What happens?", kwargs: dict | None = None) -> Any:
    """The parsed chat request of one user message: ``parts`` then the text (``kwargs``: ``mm_processor_kwargs``)."""
    body: dict[str, Any] = {"model": model,
                            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return parse_chat_request(json.dumps(body).encode())


def prepare(model: str, parts: list[dict], text: str = "What happens?",
            sampling: FrameSampling = FrameSampling.VLLM, kwargs: dict | None = None,
            audio: AudioSettings | None = None) -> PreparedRequest:
    """mmgate's pipeline on one user message: ``parts`` then the text (``kwargs``: ``mm_processor_kwargs``)."""
    return asyncio.run(pipeline(model, sampling, audio).prepare(chat_body(model, parts, text, kwargs)))


def video_part(path: Path, **hints: Any) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(path), **hints}}


@contextmanager
def loopback_gateway(model: str) -> Iterator[str]:
    """The real gateway serving ``model`` on loopback, allowed to fetch from the tests' loopback media origin;
    no worker listens (for refusals).  Yields its base URL."""
    settings = Settings(model=str(bundle_dir(model)), served_model_name=model,
                        worker_urls=(f"grpc://127.0.0.1:{free_port()}",), fetch=FetchSettings(allow_private_hosts=True))
    with gateway_in_thread(settings) as base:
        yield base
