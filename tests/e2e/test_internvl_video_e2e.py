"""End to end for an InternVL3 clip: ``openai`` client -> gateway -> recording proxy -> reference engine.

The gateway sends vLLM's layout (``<video>`` context ids, ``pixel_values_videos`` flat by
``video_num_patches``, ``video_token_id`` shared: ``mmgate.models.internvl_video``); the reference
engine reads the clip's frames as images (``mmgate.refengine.frames_as_images``), as
``InternVLForConditionalGeneration`` takes them.  Expected values come from transformers:
``InternVLProcessor`` on the frames vLLM's loader keeps (7 of a 7-frame clip) plus an image,
``usage.prompt_tokens`` its ``input_ids`` length, the wire ids those ids with the clip's
``<IMG_CONTEXT>`` as ``<video>``, the frames and image patches its ``pixel_values``, and the
generated ids ``model.generate(do_sample=False)`` of the same shrunken model.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mmgate.models.frame_sampling import vllm_frame_indices
from mmgate.models.internvl_video import reference_ids
from tests.e2e.test_families_e2e import STEPS, Stack, _model, _png, stack  # noqa: F401  (the fixture)
from tests.video.video_support import ClipSpec, data_url, load, make_clip, processor

MODEL = "OpenGVLab/InternVL3-1B-hf"
VIDEO_ID, CONTEXT_ID = 151674, 151667


@pytest.mark.parametrize("stack", ["internvl"], indirect=True)
def test_internvl_clip_and_image_equal_the_processor_and_generate(stack: Stack, tmp_path) -> None:  # noqa: F811
    import torch

    clip = make_clip(ClipSpec("ivl7", 7, 25, 66, 50), tmp_path)
    png = _png(300, 200, 13)
    content = [{"type": "video_url", "video_url": {"url": data_url(clip)}},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
               {"type": "text", "text": "What happens?"}]
    raw = stack.client.chat.completions.with_raw_response.create(
        model=stack.family, messages=[{"role": "user", "content": content}], max_tokens=STEPS, temperature=0,
        extra_body={"ignore_eos": True})
    assert raw.http_response.status_code == 200
    completion = raw.parse()
    request_id = raw.headers["X-Request-Id"]

    proc = processor(MODEL)
    frames, _ = load(clip)
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "image"},
                                                 {"type": "text", "text": "What happens?"}]}]
    prompt = proc.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=[prompt], videos=[frames[vllm_frame_indices(7)]], images=[Image.open(io.BytesIO(png))],
                       return_tensors="pt"))
    want = inputs["input_ids"][0].tolist()
    assert completion.usage is not None and completion.usage.prompt_tokens == len(want)
    wire = stack.proxy.get(request_id)
    assert wire is not None
    assert VIDEO_ID in wire.input_ids and reference_ids(wire.input_ids, VIDEO_ID, CONTEXT_ID) == want
    video, image = wire.batch("video_num_patches"), wire.batch("image_num_patches")
    assert video is not None and image is not None and video.im_token_id == VIDEO_ID
    want_pixels = inputs["pixel_values"].numpy()  # the clip's frames, then the image, in prompt order
    assert np.array_equal(np.concatenate([video.tensors["pixel_values"].array, image.tensors["pixel_values"].array]),
                          want_pixels)
    with torch.inference_mode():
        out = _model(stack.bundle).generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    assert stack.proxy.output_ids(request_id) == out[0, len(want):].tolist()
    assert np.asarray(inputs["pixel_values"]).shape[0] == 7 + 7  # 7 frames, then the image: 3:2 -> 3x2 + thumbnail
