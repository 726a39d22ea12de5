"""Several clips and images in one request: one EncoderBatch per modality, exact to the processor,
clips decoded once per distinct (URL, fps) and preprocessed in parallel in the pipeline's pool."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmgate.request.parse import parse_chat_request
from mmgate.pipeline.prepare import Pipeline
from mmgate.types import Modality
from tests.video.video_support import (
    QWEN2_5,
    QWEN3,
    data_url,
    load,
    pipeline,
    prepare,
    processor,
    vllm_video_kwargs,
)


def png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(h + w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("model", [QWEN2_5, QWEN3])
def test_clip_image_clip_request_matches_the_processor_batch_by_batch(model: str, clips: dict[str, Path]) -> None:
    first, second = clips["f17_25fps_mpeg4"], clips["f20_vfr"]
    image = png(90, 130)
    parts = [{"type": "video_url", "video_url": {"url": data_url(first)}},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
             {"type": "video_url", "video_url": {"url": data_url(second)}}]
    prepared = prepare(model, parts, text="Compare.")

    proc = processor(model)
    content = [{"type": "video"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    (fa, ma), (fb, mb) = load(first), load(second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = proc(text=[prompt], videos=[fa, fb], video_metadata=[copy.deepcopy(ma), copy.deepcopy(mb)],
                   images=[Image.open(io.BytesIO(image))], return_tensors="np",
                   videos_kwargs={"cap_pixels_per_frame": False, **vllm_video_kwargs(model)})

    assert prepared.input_ids == tuple(int(t) for t in ref["input_ids"][0])
    video, picture = prepared.batches
    assert (video.modality.value, picture.modality.value) == ("video", "image")
    assert np.array_equal(video.tensors["pixel_values"], ref["pixel_values_videos"])
    assert np.array_equal(video.tensors["video_grid_thw"], ref["video_grid_thw"])
    assert np.array_equal(picture.tensors["pixel_values"], ref["pixel_values"])
    assert np.array_equal(picture.tensors["image_grid_thw"], ref["image_grid_thw"])
    if model == QWEN2_5:
        assert np.array_equal(video.tensors["second_per_grid_ts"],
                              np.asarray(ref["second_per_grid_ts"], dtype=np.float32))
    assert len(video.placeholders) == 2 and len(set(video.mm_hashes)) == 2
    assert video.placeholders[0].offset < picture.placeholders[0].offset < video.placeholders[1].offset
    assert [p.modality.value for p in prepared.plans] == ["video", "image", "video"]


def test_distinct_clips_are_preprocessed_concurrently_and_a_repeated_clip_once(clips: dict[str, Path]) -> None:
    """Two clips meet at a barrier inside preprocessing (it would time out if they ran one after the
    other); the same clip twice (same URL, same hints) is decoded and preprocessed once."""
    import mmgate.pipeline.sources as sources_module

    base = pipeline(QWEN3)
    family = base.runtime.family
    barrier = threading.Barrier(2, timeout=20)
    calls: list[str] = []
    decodes: list[int] = []

    class VideoSpy:
        def __getattr__(self, name: str):
            return getattr(family.video, name)

        def preprocess(self, video, plan, raw=False):
            calls.append(video.content_hash)
            barrier.wait()
            return family.video.preprocess(video, plan, raw)

        def write_rows(self, video, plan, raw, sink):  # the row writer (a clip written straight into its rows)
            calls.append(video.content_hash)
            barrier.wait()
            return family.video.write_rows(video, plan, raw, sink)

    class Spy:
        video = VideoSpy()
        processors = {**family.processors, Modality.VIDEO: video}

        def __getattr__(self, name: str):
            return getattr(family, name)

    real_decode = sources_module.decode_video

    def counting_decode(*args, **kwargs):
        decodes.append(1)
        return real_decode(*args, **kwargs)

    runtime = type(base.runtime)(bundle=base.runtime.bundle, tokenizer=base.runtime.tokenizer, family=Spy(),
                                 served_name=base.runtime.served_name)
    pipe = Pipeline(runtime, base.settings, base.fetcher, base.executor)
    a, b = data_url(clips["f60_30fps"]), data_url(clips["f20_vfr"])
    parts = [{"type": "video_url", "video_url": {"url": u}} for u in (a, b, a)]
    body = {"model": QWEN3, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}
    sources_module.decode_video = counting_decode
    try:
        prepared = asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))
    finally:
        sources_module.decode_video = real_decode
    assert len(calls) == 2 and len(decodes) == 2
    (batch,) = prepared.batches
    assert len(batch.placeholders) == 3 and batch.mm_hashes[0] == batch.mm_hashes[2] != batch.mm_hashes[1]
