"""The reference engine runs LLaVA-OneVision (shrunken, seeded random weights): images and a video.

Requests come from the bundle's own transformers 5.24 processor
(``processor.apply_chat_template(conversation, add_generation_prompt=True)`` then
``processor(text=[prompt], images=[...])`` / ``videos=[clip]``) and travel as vLLM 0.33 lays the
model out (``vllm/model_executor/models/llava_onevision.py`` ``_get_mm_fields_config``):
``pixel_values`` batched ``[N, tiles, 3, 384, 384]`` + ``image_sizes`` batched for images; for a
video, ``pixel_values`` ``[1, frames, 3, 384, 384]`` batched on a VIDEO batch (the servicer's
``pixel_values_videos``).  ``im_token_id``: ``<image>`` 151646 / ``<video>`` 151647; each item's
range is its whole run.  The engine's greedy ids must equal ``model.generate(do_sample=False)`` of
the same shrunken model on the processor's own outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2
from transformers import AutoConfig

from mmgate.refengine.bundle import LoadedModel, load_model
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.families import ENGINE_FAMILIES
from mmgate.refengine.server import RunningEngine
from mmgate.refengine.shrink import shrink_config
from mmgate.transport.inline import to_tensor_data
from tests.refengine.refengine_support import (
    generate_request,
    processor_for,
    random_image,
    require_bundle,
    stub_for,
)

ONEVISION = "llava-hf--llava-onevision-qwen2-0.5b-ov-hf"
STEPS = 4


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if runs and sum(runs[-1]) == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def _td(tensor: torch.Tensor) -> vllm_engine_pb2.TensorData:
    return to_tensor_data(np.ascontiguousarray(tensor.numpy()))


def _outputs(bundle: Path, images: list | None = None, video: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    processor = processor_for(bundle)
    content = [{"type": "image"} for _ in images or []] + ([{"type": "video"}] if video is not None else [])
    content.append({"type": "text", "text": "Describe it."})
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    kwargs: dict = {"images": images} if images else {}
    if video is not None:
        kwargs["videos"] = [video]
    return dict(processor(text=[prompt], return_tensors="pt", **kwargs))


def _wire(bundle: Path, out: dict[str, torch.Tensor]) -> vllm_engine_pb2.MultimodalInputs:
    """One batch as vLLM 0.33 lays it out (module docstring)."""
    config = AutoConfig.from_pretrained(bundle)
    ids = out["input_ids"][0].tolist()
    if "pixel_values_videos" in out:
        token = int(config.video_token_index)
        mm = vllm_engine_pb2.MultimodalInputs(pixel_values=_td(out["pixel_values_videos"]), im_token_id=token,
                                              modality=common_pb2.VIDEO)
    else:
        token = int(config.image_token_index)
        mm = vllm_engine_pb2.MultimodalInputs(pixel_values=_td(out["pixel_values"]), im_token_id=token,
                                              modality=common_pb2.IMAGE)
        mm.model_specific_tensors["image_sizes"].CopyFrom(_td(out["image_sizes"]))
        mm.batched_keys.append("image_sizes")
    mm.batched_keys.append("pixel_values")
    mm.mm_placeholders.extend(vllm_engine_pb2.PlaceholderRange(offset=o, length=n) for o, n in _runs(ids, token))
    return mm


@cache
def _reference_model(bundle: Path) -> LoadedModel:
    return load_model(EngineConfig(model=bundle, port=0))


def _assert_same_generation(engine: RunningEngine, bundle: Path, out: dict[str, torch.Tensor]) -> None:
    request = generate_request(out["input_ids"][0].tolist(), _wire(bundle, out), max_tokens=STEPS,
                               ignore_eos=True, logprobs=0)
    (response,) = list(stub_for(engine.address).Generate(request, timeout=300))
    assert response.complete.prompt_tokens == out["input_ids"].shape[1]
    inputs = {k: v for k, v in out.items() if k != "batch_num_images"}
    with torch.inference_mode():
        ref = _reference_model(bundle).model.generate(**inputs, max_new_tokens=STEPS, do_sample=False,
                                                      output_logits=True, return_dict_in_generate=True)
    want = ref.sequences[0, out["input_ids"].shape[1]:].tolist()
    want_lp = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(ref.logits, want, strict=True)]
    assert list(response.complete.output_ids) == want
    assert list(response.complete.output_logprobs.token_logprobs) == pytest.approx(want_lp, abs=1e-4)


def test_onevision_row_keeps_ids_pinpoints_and_the_anyres_max_cap() -> None:
    assert ENGINE_FAMILIES["llava_onevision"].name == "llava_onevision"
    original = AutoConfig.from_pretrained(require_bundle(ONEVISION))
    small = shrink_config(original)
    assert small.vision_config.num_hidden_layers == 2 and small.text_config.num_hidden_layers == 2
    for key in ("image_token_index", "video_token_index", "image_grid_pinpoints", "vision_aspect_ratio"):
        assert getattr(small, key) == getattr(original, key), key
    assert (small.vision_config.image_size, small.vision_config.patch_size) == (384, 14)
    assert small.vision_feature_layer == -1


def test_two_images_of_different_tile_counts_generate_as_transformers(
    engine_for: Callable[[Path], RunningEngine]
) -> None:
    bundle = require_bundle(ONEVISION)
    # 64x48 -> pinpoint 384x384 (base + 1 tile); 350x1000 -> 1152x384 (base + 3 tiles): zero-padded to 4
    out = _outputs(bundle, [random_image(64, 48), random_image(350, 1000, seed=2)])
    assert out["pixel_values"].shape[:2] == (2, 4)
    _assert_same_generation(engine_for(bundle), bundle, out)


def test_a_video_generates_as_transformers(engine_for: Callable[[Path], RunningEngine]) -> None:
    bundle = require_bundle(ONEVISION)
    clip = np.random.RandomState(5).randint(0, 255, (3, 48, 64, 3), dtype=np.uint8)
    out = _outputs(bundle, video=clip)
    assert out["pixel_values_videos"].shape == (1, 3, 3, 384, 384)
    assert int((out["input_ids"] == 151647).sum()) == 3 * 196 + 1
    _assert_same_generation(engine_for(bundle), bundle, out)


def test_the_output_depends_on_the_pixels(engine_for: Callable[[Path], RunningEngine]) -> None:
    """The shrunken tower is not bypassed: other pixels (same ids and layout) change the logprobs."""
    bundle = require_bundle(ONEVISION)
    out = _outputs(bundle, [random_image(500, 300)])
    other = dict(out, pixel_values=torch.roll(out["pixel_values"], shifts=37, dims=-1) * 0.5)
    stub = stub_for(engine_for(bundle).address)
    answers = []
    for inputs in (out, other):
        request = generate_request(inputs["input_ids"][0].tolist(), _wire(bundle, inputs), max_tokens=2,
                                   ignore_eos=True, logprobs=0)
        (response,) = list(stub.Generate(request, timeout=300))
        answers.append(list(response.complete.output_logprobs.token_logprobs))
    assert answers[0] != answers[1]


def test_channels_first_normalization_equals_the_processor_bit_for_bit() -> None:
    """``--mm-device-do-normalize``: raw uint8 tiles normalized by the engine equal the processor's floats
    (the batch-padding tile aside: zeros in the float tensor, dropped by the model through ``image_sizes``)."""
    from mmgate.refengine.device_normalize import DeviceNormalizer
    from mmgate.refengine.families import RawLayout

    bundle = require_bundle(ONEVISION)
    images = [random_image(), random_image(350, 1000, seed=2)]
    floats = _outputs(bundle, images)["pixel_values"]
    processor = processor_for(bundle)
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                                           add_generation_prompt=True)
    raw = processor(text=[prompt], images=images, do_rescale=False, do_normalize=False,
                    return_tensors="pt")["pixel_values"]
    assert torch.equal(raw, raw.round()) and raw.max() <= 255
    normalized = DeviceNormalizer.from_bundle(bundle, RawLayout.CHANNELS_FIRST).normalize(raw.to(torch.uint8))
    assert floats.shape[:2] == (2, 4)  # 64x48: base + 1 tile, padded to 4; 350x1000: base + 3 tiles
    assert torch.equal(normalized[0, :2], floats[0, :2]) and torch.equal(normalized[1], floats[1])
