"""The reference engine takes mmgate's video batches into the real transformers model code.

For each Qwen-VL bundle, a request with a clip and an image is prepared by
mmgate, put on the vLLM wire (``build_generate_request``), read back by the
engine's intake (``refengine.mm_inputs.build_model_inputs``: ``pixel_values``
of the VIDEO batch renamed ``pixel_values_videos``; ``video_grid_thw``,
``second_per_grid_ts`` kept; ``mm_token_type_ids`` rebuilt from the ids) and
run through the model's ``forward`` (shrunken random weights).  The kwargs
equal the transformers processor's for the same conversation.
"""

from __future__ import annotations

import base64
import copy
import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgate.engines.vllm import build_generate_request
from mmgate.refengine.bundle import LazyTokenizer, load_model
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.mm_inputs import build_model_inputs
from tests.conftest import bundle_dir
from tests.video.video_support import (
    MODELS,
    QWEN2_5,
    data_url,
    load,
    prepare,
    processor,
    vllm_video_kwargs,
)


@pytest.mark.parametrize("model", MODELS)
def test_engine_intake_gives_the_model_the_processor_kwargs_and_forward_runs(model: str,
                                                                             clips: dict[str, Path]) -> None:
    clip = clips["f17_25fps_mpeg4"]
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (70, 90, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
             {"type": "video_url", "video_url": {"url": data_url(clip)}}]
    prepared = prepare(model, parts)
    request = build_generate_request(prepared)
    path = bundle_dir(model)
    loaded = load_model(EngineConfig(model=path))
    inputs = build_model_inputs(request, loaded, LazyTokenizer(path))

    proc = processor(model)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    frames, meta = load(clip)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = proc(text=[prompt], images=[Image.open(io.BytesIO(buf.getvalue()))], videos=[frames],
                   video_metadata=[copy.deepcopy(meta)], return_tensors="pt",
                   videos_kwargs={"cap_pixels_per_frame": False, **vllm_video_kwargs(model)})
    expected = {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"}
    if model == QWEN2_5:
        expected.add("second_per_grid_ts")
    assert set(inputs.mm_kwargs) == expected
    assert torch.equal(inputs.input_ids, ref["input_ids"])
    for key in expected:
        assert torch.equal(inputs.mm_kwargs[key], ref[key].to(inputs.mm_kwargs[key].dtype)), key
        assert inputs.mm_kwargs[key].dtype == ref[key].dtype, key

    with torch.no_grad():
        out = loaded.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, **inputs.mm_kwargs)
    assert out.logits.shape[:2] == inputs.input_ids.shape
    assert torch.isfinite(out.logits).all()
