"""Issue 24 item 4 for a LLaVA-OneVision *video*: what the gateway sends, decoded by the real servicer.

A real gateway (in a thread, the OneVision bundle) sends a one-clip request to a recording vLLM-wire
worker; the installed smg-grpc-servicer 0.14.1 ``_build_preprocessed_mm_inputs``
(:func:`tests.support.servicer_code.vllm_input`) turns it into vLLM's kwargs.  vLLM 0.33
``vllm/model_executor/models/llava_onevision.py`` ``_get_mm_fields_config`` declares
``pixel_values_videos=MultiModalFieldConfig.batched("video")`` and nothing else for a video; its
``_get_prompt_updates`` replaces the ``<video>`` anchor with ``[video_token_index] *
get_num_video_tokens`` (frames x 196 + 1), all of it embedded.  The pixels and the ids are the
transformers 5.24 processor's on the frames its pyav loader decodes (a 5-frame clip: vLLM keeps all).
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from mmgate.config.settings import Settings
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import gateway_in_thread
from tests.support.servicer_code import vllm_input

pytest.importorskip("av")

MODEL = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"
VIDEO_TOKEN = 151647


def test_a_clip_is_one_batched_pixel_values_videos_with_every_run_position_embedded(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    from tests.video.video_support import ClipSpec, load, make_clip

    path = make_clip(ClipSpec("ov_wire", 5, 10, 64, 48), tmp_path)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    worker = FakeWorker(FakeWorkerState(model_type="llava_onevision"))
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, worker_urls=(worker.url,))
    try:
        with gateway_in_thread(settings) as base:
            body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]}]}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        (got,) = worker.state.received
        vin = vllm_input(got.request)
    finally:
        worker.stop()
    assert set(vin.fields) == {"pixel_values_videos"}
    field = vin.fields["pixel_values_videos"]
    assert (field.modality, field.kind, field.keep_on_cpu) == ("video", "batched", False)
    (rng,) = vin.mm_placeholders["video"]
    ids = torch.tensor(vin.prompt_token_ids)
    mask = rng.is_embed if rng.is_embed is not None else torch.ones(rng.length, dtype=torch.bool)
    assert torch.equal(mask, ids[rng.offset:rng.offset + rng.length] == VIDEO_TOKEN)
    assert int(mask.sum()) == rng.length == 5 * 196 + 1

    processor = AutoProcessor.from_pretrained(bundle_dir(MODEL))
    frames, _ = load(path)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "What happens?"}]}], add_generation_prompt=True, tokenize=False)
    ref = processor(text=[prompt], videos=[frames], return_tensors="pt")
    assert vin.prompt_token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(vin.tensors["pixel_values_videos"], ref["pixel_values_videos"])
    assert np.asarray(vin.tensors["pixel_values_videos"]).shape == (1, 5, 3, 384, 384)
