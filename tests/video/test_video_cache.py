"""Video through the generic content-hash cache (issue 23: the cache was image-only): a clip seen before is
not preprocessed again, the hit is counted under ``modality="video"``, and the cached batch equals the
uncached one value for value (vLLM's differential rule: cached run == uncached run)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np

from mmgate.observe import metrics
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.prepare import Pipeline
from mmgate.request.parse import parse_chat_request
from mmgate.types import Modality, PendingTensor
from tests.video.video_support import QWEN3, assert_same, pipeline, reference, video_part, vllm_video_kwargs


class CountingVideo:
    """The family's clip processor, counting ``preprocess`` calls."""

    def __init__(self, real: object) -> None:
        self.real = real
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def preprocess(self, video, plan, raw=False):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.real.preprocess(video, plan, raw)  # type: ignore[attr-defined]


def counting_pipeline() -> tuple[Pipeline, CountingVideo]:
    base = pipeline(QWEN3)
    family = base.runtime.family
    spy = CountingVideo(family.processors[Modality.VIDEO])

    class Family:
        processors = {**family.processors, Modality.VIDEO: spy}

        def __getattr__(self, name: str) -> object:
            return getattr(family, name)

    runtime = type(base.runtime)(bundle=base.runtime.bundle, tokenizer=base.runtime.tokenizer, family=Family(),
                                 served_name="video-cache-test")
    return Pipeline(runtime, base.settings, base.fetcher, base.executor, cache=PixelCache(256 << 20)), spy


def run(pipe: Pipeline, clip: Path, defer: bool = False):  # type: ignore[no-untyped-def]
    body = {"model": QWEN3, "messages": [{"role": "user", "content": [video_part(clip),
                                                                      {"type": "text", "text": "What happens?"}]}]}
    return asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode()), defer_pixels=defer))


def hits(modality: str) -> float:
    return metrics.CACHE_HITS.labels("video-cache-test", modality)._value.get()


def test_a_second_identical_clip_is_served_from_the_cache_not_preprocessed_again(clips: dict[str, Path]) -> None:
    pipe, spy = counting_pipeline()
    clip = clips["f20_vfr"]
    first = run(pipe, clip)
    assert spy.calls == 1
    before = hits("video")
    second = run(pipe, clip)
    assert spy.calls == 1, "the cached clip was preprocessed again"
    assert hits("video") == before + 1
    (a,), (b,) = first.batches, second.batches
    assert a.mm_hashes == b.mm_hashes and first.input_ids == second.input_ids
    for name, tensor in a.tensors.items():
        assert np.array_equal(np.asarray(tensor), np.asarray(b.tensors[name])), name
    # and what the cache served is the reference's: transformers' processor on the same clip
    assert_same(second, reference(QWEN3, clip, video_kwargs=vllm_video_kwargs(QWEN3)))


def test_a_clip_first_in_the_prompt_is_deferred_like_images(clips: dict[str, Path]) -> None:
    """Deferral is generic: the first modality's primary tensor comes back pending, and filling it gives the
    values the undeferred run computes."""
    from mmgate.transport.placement import BufferTarget

    pipe = pipeline(QWEN3)
    assert pipe.cache is None  # no pixel cache: the clip's rows are written by its row writer into the target
    clip = clips["f20_vfr"]
    ref = reference(QWEN3, clip, video_kwargs=vllm_video_kwargs(QWEN3))
    for in_place in (True, False):  # rows computed in place (a RowArray), then copied in block by block
        deferred = run(pipe, clip, defer=True)
        (batch,) = deferred.batches
        pending = batch.tensors["pixel_values"]
        assert isinstance(pending, PendingTensor)
        assert deferred.input_ids == tuple(ref.input_ids)
        values = np.full(pending.shape, np.nan, dtype=pending.dtype)
        width = int(np.prod(pending.shape[1:]))
        asyncio.run(pending.fill(BufferTarget(values.reshape(-1).view(np.uint8), width, values.itemsize,
                                              owner=values, values=pending.dtype if in_place else None)))
        assert np.array_equal(values, ref.out["pixel_values_videos"])
