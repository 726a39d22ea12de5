"""End to end for LLaVA-OneVision beyond one image: the official ``openai`` client -> gateway process
-> recording gRPC proxy -> reference engine process (vLLM wire), as ``test_families_e2e.py`` (its
stack and helpers; its one-image test is there).

* Two images: transformers' ``apply_chat_template`` hands the processor a nested image list, and the
  OneVision image processor then pads each image of a multi-image entry to a square instead of tiling
  it.  vLLM 0.33 calls the processor with a flat list (every image tiled) and mmgate follows vLLM, so
  the reference here is ``processor(text=rendered, images=[a, b])`` (flat) on the template's prompt.
* A video: the clip's frames decoded by transformers' pyav loader, the 32 uniform frames vLLM 0.33
  keeps (all of them for a short clip), ``processor(text=rendered, videos=[frames])``.
* A video and an image in one request: two batches on the wire (``<image>`` and ``<video>`` runs), the
  model given ``pixel_values`` and ``pixel_values_videos`` together, as ``processor(images=, videos=)``.

Every expected value comes from transformers: prompt ids, ``pixel_values`` /
``pixel_values_videos`` bit for bit on the wire, the generated ids of ``model.generate`` on the
processor's outputs and their logprobs within float32 noise.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmgate.models.frame_sampling import vllm_frame_indices
from tests.e2e.test_families_e2e import (  # noqa: F401  (stack: the module-scoped fixture)
    LOGPROB_TOLERANCE,
    STEPS,
    Stack,
    _messages,
    _png,
    _processor,
    _reference_generation,
    stack,
)

pytest.importorskip("av")


def _ask(stack: Stack, messages: Any) -> tuple[Any, str]:
    raw = stack.client.chat.completions.with_raw_response.create(
        model=stack.family, messages=messages, max_tokens=STEPS, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True})
    assert raw.http_response.status_code == 200
    return raw.parse(), raw.headers["X-Request-Id"]


def _judge(stack: Stack, completion: Any, request_id: str, inputs: dict[str, Any], key: str) -> None:
    want_prompt = inputs["input_ids"][0].tolist()
    assert completion.usage.prompt_tokens == len(want_prompt)
    wire = stack.proxy.get(request_id)
    assert wire is not None and wire.input_ids == want_prompt
    batch = wire.batch("pixel_values")
    assert batch is not None and batch.tensors["pixel_values"].dtype == "float32"
    assert np.array_equal(batch.tensors["pixel_values"].array, inputs[key].numpy())
    want_ids, want_logprobs = _reference_generation(stack.bundle, inputs)
    assert stack.proxy.output_ids(request_id) == want_ids
    assert completion.usage.completion_tokens == len(want_ids) == STEPS
    content = completion.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE)


def _prompt(stack: Stack, content: list[dict[str, Any]]) -> str:
    return _processor(stack.bundle).apply_chat_template([{"role": "user", "content": content}],
                                                        add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("stack", ["llava_onevision"], indirect=True)
def test_two_images_are_each_tiled_as_vllm_calls_the_processor(stack: Stack) -> None:
    import io

    images = [_png(64, 48, 11), _png(350, 1000, 12)]
    completion, request_id = _ask(stack, _messages(images, "Compare the two pictures."))
    text = "Compare the two pictures."
    prompt = _prompt(stack, [{"type": "image"}, {"type": "image"}, {"type": "text", "text": text}])
    pil = [Image.open(io.BytesIO(b)) for b in images]
    inputs = dict(_processor(stack.bundle)(text=[prompt], images=pil, return_tensors="pt"))
    inputs.pop("batch_num_images", None)
    # 64x48 -> base + 1 tile, 350x1000 -> base + 3 tiles: zero-padded to 4 (transformers _pad_for_batching)
    assert tuple(inputs["pixel_values"].shape) == (2, 4, 3, 384, 384)
    _judge(stack, completion, request_id, inputs, "pixel_values")


@pytest.mark.parametrize("stack", ["llava_onevision"], indirect=True)
def test_a_video_equals_the_processor_and_generates(stack: Stack, tmp_path) -> None:  # noqa: ANN001
    from tests.video.video_support import ClipSpec, load, make_clip

    path = make_clip(ClipSpec("ov_e2e", 5, 10, 64, 48), tmp_path)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens?"}]}]
    completion, request_id = _ask(stack, messages)
    frames, _ = load(path)
    prompt = _prompt(stack, [{"type": "video"}, {"type": "text", "text": "What happens?"}])
    inputs = dict(_processor(stack.bundle)(text=[prompt], videos=[frames[vllm_frame_indices(len(frames))]],
                                           return_tensors="pt"))
    assert tuple(inputs["pixel_values_videos"].shape) == (1, 5, 3, 384, 384)
    assert int((inputs["input_ids"] == 151647).sum()) == 5 * 196 + 1
    _judge(stack, completion, request_id, inputs, "pixel_values_videos")


@pytest.mark.parametrize("stack", ["llava_onevision"], indirect=True)
def test_an_image_and_a_video_in_one_request_equal_the_processor_and_generate(stack: Stack, tmp_path) -> None:  # noqa: ANN001
    """Two batches on the wire (image, then video: the template renders images first); the model gets both."""
    import io

    from tests.video.video_support import ClipSpec, load, make_clip

    path = make_clip(ClipSpec("ov_mixed", 3, 10, 64, 48), tmp_path)
    png = _png(300, 200, 13)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    image_url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": "Same scene?"}]}]
    completion, request_id = _ask(stack, messages)
    frames, _ = load(path)
    prompt = _prompt(stack, [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "Same scene?"}])
    inputs = dict(_processor(stack.bundle)(text=[prompt], images=[Image.open(io.BytesIO(png))], videos=[frames],
                                           return_tensors="pt"))
    inputs.pop("batch_num_images", None)
    wire = stack.proxy.get(request_id)
    assert wire is not None and wire.input_ids == inputs["input_ids"][0].tolist()
    assert completion.usage.prompt_tokens == inputs["input_ids"].shape[1]
    by_token = {b.im_token_id: b for b in wire.batches}
    assert set(by_token) == {151646, 151647}
    assert np.array_equal(by_token[151646].tensors["pixel_values"].array, inputs["pixel_values"].numpy())
    assert np.array_equal(by_token[151647].tensors["pixel_values"].array, inputs["pixel_values_videos"].numpy())
    want_ids, want_logprobs = _reference_generation(stack.bundle, inputs)
    assert stack.proxy.output_ids(request_id) == want_ids
    assert [e.logprob for e in completion.choices[0].logprobs.content] == pytest.approx(want_logprobs,
                                                                                       abs=LOGPROB_TOLERANCE)
