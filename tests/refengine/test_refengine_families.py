"""The reference engine runs LLaVA-1.5, LLaVA-NeXT, Gemma 3 and InternVL3 (shrunken, seeded random weights).

Every request comes from the bundle's own transformers processor
(``processor.apply_chat_template(conversation, add_generation_prompt=True)``
then ``processor(text=[prompt], images=[...])``) and travels as vLLM lays that
model out (``_get_mm_fields_config`` of ``vllm/model_executor/models/llava.py``,
``llava_next.py``, ``gemma3_mm.py``, vLLM v0.11+):

  * LLaVA-1.5: ``pixel_values`` batched ``[N, 3, 336, 336]``;
  * LLaVA-NeXT: ``pixel_values`` batched ``[N, tiles, 3, 336, 336]`` + ``image_sizes`` batched;
  * Gemma 3: ``pixel_values`` flat ``[sum(num_patches), 3, 896, 896]`` sized by
    ``num_patches`` (= crops + 1, batched, in the batch as the servicer needs it);
  * InternVL3 (``interns1.py``): ``pixel_values`` flat ``[sum(image_num_patches), 3, 448, 448]``,
    ``image_num_patches`` batched, ``image_token_id`` shared;

``im_token_id`` = the embedding token (LLaVA ``<image>`` 32000, Gemma 3
``<image_soft_token>`` 262144).  The engine's greedy ids must equal
``model.generate(do_sample=False)`` of the same shrunken model (rebuilt by
``load_model`` from the same seed) on the processor's own outputs (Gemma 3's
``token_type_ids`` and LLaVA-NeXT's ``image_sizes`` included).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
import transformers
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2
from transformers import AutoConfig

from mmgate.refengine.bundle import LazyTokenizer, LoadedModel, load_model, model_class
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.families import ENGINE_FAMILIES, RawLayout, engine_family
from mmgate.refengine.mm_inputs import build_model_inputs
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.refengine.servicer import device_normalizer
from mmgate.refengine.shrink import rescale_feature_layer, shrink_config
from mmgate.transport.inline import to_tensor_data
from tests.refengine.refengine_support import (
    generate_request,
    processor_for,
    random_image,
    require_bundle,
    stub_for,
)

LLAVA = "llava-hf--llava-1.5-7b-hf"
LLAVA_NEXT = "llava-hf--llava-v1.6-mistral-7b-hf"
GEMMA3 = "google--gemma-3-4b-it"
LLAMA4 = "meta-llama--Llama-4-Scout-17B-16E-Instruct"  # its own tests: test_refengine_llama4.py
INTERNVL = "OpenGVLab--InternVL3-1B-hf"
FAMILY_BUNDLES = (LLAVA, LLAVA_NEXT, GEMMA3, INTERNVL)
STEPS = 6

# ---- requests from the real processors --------------------------------------------------------


def _processor_outputs(bundle: Path, images: list, **kwargs: object) -> dict[str, torch.Tensor]:
    processor = processor_for(bundle)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe the image."}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return dict(processor(text=[prompt], images=images, return_tensors="pt", **kwargs))


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of every maximal run of ``token``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _td(tensor: torch.Tensor) -> vllm_engine_pb2.TensorData:
    return to_tensor_data(np.ascontiguousarray(tensor.numpy()))


def wire_batch(name: str, out: dict[str, torch.Tensor]) -> vllm_engine_pb2.MultimodalInputs:
    """The processor's outputs as one IMAGE ``MultimodalInputs`` in vLLM's layout for ``name``.

    Placeholders: LLaVA / LLaVA-NeXT, each image's run of ``<image>`` tokens (vLLM's
    PromptReplacement output); Gemma 3 (one image per request here), from the image's first
    ``<start_of_image>`` to its last ``<end_of_image>``, so the pan-and-scan text between the crops
    is inside and not embedded (``is_embed`` from ``im_token_id``).  vLLM's own Gemma 3 range
    (``gemma3_mm.py`` ``get_image_repl``: ``PromptUpdateDetails.select_token_id(repl_full,
    image_token_id)``) also spans the newlines and the "Here is the original image" text; the
    engine reads only how many ranges there are, as the batched-key check needs.
    """
    ids = out["input_ids"][0].tolist()
    config = AutoConfig.from_pretrained(require_bundle(name))
    image_token = int(config.image_token_id)
    mm = vllm_engine_pb2.MultimodalInputs(
        pixel_values=_td(out["pixel_values"]), im_token_id=image_token, modality=common_pb2.IMAGE)
    if name == GEMMA3:
        boi, eoi = int(config.boi_token_index), int(config.eoi_token_index)
        start, end = ids.index(boi), len(ids) - 1 - ids[::-1].index(eoi)
        mm.mm_placeholders.append(vllm_engine_pb2.PlaceholderRange(offset=start, length=end - start + 1))
        num_patches = torch.tensor([out["pixel_values"].shape[0]], dtype=torch.int64)  # 1 + crops
        mm.model_specific_tensors["num_patches"].CopyFrom(_td(num_patches))
        mm.flat_keys["pixel_values"] = "num_patches"
        mm.batched_keys.append("num_patches")
        return mm
    if name == INTERNVL:  # vLLM interns1.py: flat by image_num_patches, image_token_id shared, <img>..</img> ranges
        start, end = ids.index(151665), len(ids) - 1 - ids[::-1].index(151666)  # <img>, </img> (one image)
        mm.mm_placeholders.append(vllm_engine_pb2.PlaceholderRange(offset=start, length=end - start + 1))
        mm.model_specific_tensors["image_num_patches"].CopyFrom(
            _td(torch.tensor([out["pixel_values"].shape[0]], dtype=torch.int64)))
        mm.model_specific_tensors["image_token_id"].CopyFrom(_td(torch.tensor(image_token, dtype=torch.int64)))
        mm.flat_keys["pixel_values"] = "image_num_patches"
        mm.batched_keys.append("image_num_patches")
        return mm
    mm.mm_placeholders.extend(vllm_engine_pb2.PlaceholderRange(offset=o, length=n) for o, n in _runs(ids, image_token))
    mm.batched_keys.append("pixel_values")
    if name == LLAVA_NEXT:
        mm.model_specific_tensors["image_sizes"].CopyFrom(_td(out["image_sizes"]))
        mm.batched_keys.append("image_sizes")
    return mm


@cache
def _reference_model(bundle: Path) -> LoadedModel:
    return load_model(EngineConfig(model=bundle, port=0))


def _hf_greedy_logprobs(bundle: Path, inputs: dict[str, torch.Tensor],
                        steps: int = STEPS) -> tuple[list[int], list[float]]:
    """``model.generate(do_sample=False)``'s ids and each chosen id's float32 log-softmax of the raw logits."""
    with torch.inference_mode():
        out = _reference_model(bundle).model.generate(**inputs, max_new_tokens=steps, do_sample=False,
                                                       output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, ids, strict=True)]
    return ids, logprobs


def _engine_greedy(engine: RunningEngine, name: str, out: dict[str, torch.Tensor],
                   steps: int = STEPS) -> list[int]:
    return _engine_greedy_logprobs(engine, name, out, steps)[0]


def _engine_greedy_logprobs(engine: RunningEngine, name: str, out: dict[str, torch.Tensor],
                            steps: int = STEPS) -> tuple[list[int], list[float]]:
    """The engine's greedy ids and their logprobs (``logprobs=0``: the sampled token's, vLLM raw logprobs)."""
    request = generate_request(out["input_ids"][0].tolist(), wire_batch(name, out), max_tokens=steps,
                               ignore_eos=True, logprobs=0)
    (response,) = list(stub_for(engine.address).Generate(request, timeout=120))
    assert response.complete.prompt_tokens == out["input_ids"].shape[1]
    return list(response.complete.output_ids), list(response.complete.output_logprobs.token_logprobs)


def _assert_same_generation(engine: RunningEngine, name: str, bundle: Path, out: dict[str, torch.Tensor],
                            steps: int = STEPS) -> None:
    """Same ids, and logprobs within float32 noise (so a mask or position slip shows before it flips an id)."""
    got_ids, got_logprobs = _engine_greedy_logprobs(engine, name, out, steps)
    want_ids, want_logprobs = _hf_greedy_logprobs(bundle, out, steps)
    assert len(got_ids) == steps
    assert got_ids == want_ids
    assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4)


# ---- the shrink table -----------------------------------------------------------------------


def test_llava_shrinks_to_a_tiny_model_with_every_token_id_and_the_336_geometry() -> None:
    original = AutoConfig.from_pretrained(require_bundle(LLAVA))
    shrunk = shrink_config(original)
    # llava-1.5-7b-hf/config.json and transformers' LlavaConfig defaults (image_seq_length 576 = (336/14)^2)
    assert (shrunk.image_token_index, shrunk.vocab_size, shrunk.pad_token_id) == (32000, 32064, 32001)
    assert (shrunk.vision_feature_layer, shrunk.vision_feature_select_strategy) == (-2, "default")
    assert shrunk.image_seq_length == 576
    text, vision = shrunk.text_config, shrunk.vision_config
    assert (text.vocab_size, text.bos_token_id, text.eos_token_id, text.max_position_embeddings) == (32064, 1, 2, 4096)
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim) == (2, 64, 4, 2, 16)
    assert (vision.image_size, vision.patch_size, vision.num_channels) == (336, 14, 3)
    assert (vision.num_hidden_layers, vision.hidden_size, vision.num_attention_heads) == (2, 32, 2)
    assert original.text_config.num_hidden_layers == 32 and original.vision_config.num_hidden_layers == 24


def test_llava_next_keeps_its_grid_pinpoints_and_newline() -> None:
    original = AutoConfig.from_pretrained(require_bundle(LLAVA_NEXT))
    shrunk = shrink_config(original)
    assert shrunk.image_grid_pinpoints == [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    assert shrunk.use_image_newline_parameter is True
    assert (shrunk.image_token_index, shrunk.vision_feature_layer) == (32000, -2)
    assert shrunk.text_config.sliding_window is None  # Mistral-7B-Instruct-v0.2 has none
    assert (shrunk.vision_config.image_size, shrunk.vision_config.patch_size) == (336, 14)


def test_gemma3_keeps_ids_pooling_geometry_and_one_layer_of_each_attention_kind() -> None:
    original = AutoConfig.from_pretrained(require_bundle(GEMMA3))
    shrunk = shrink_config(original)
    assert (shrunk.image_token_index, shrunk.boi_token_index, shrunk.eoi_token_index) == (262144, 255999, 256000)
    assert shrunk.eos_token_id == [1, 106]
    text, vision = shrunk.text_config, shrunk.vision_config
    assert (text.vocab_size, text.bos_token_id, text.eos_token_id, text.pad_token_id) == (262208, 2, 1, 0)
    # 34 layers, every sixth full -> one sliding then one full; the window and both ropes unchanged
    assert original.text_config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert text.layer_types == ["sliding_attention", "full_attention"]
    assert text._sliding_window_pattern == 2
    assert text.sliding_window == 1024
    assert text.rope_parameters == original.text_config.rope_parameters
    # the attention scale follows head_dim: 256 (= head_dim 256) -> 16
    assert (text.head_dim, text.query_pre_attn_scalar) == (16, 16)
    # projector pooling: (896 / 14) = 64 patches a side, pooled to sqrt(256) = 16 a side (kernel 4)
    assert (vision.image_size, vision.patch_size, shrunk.mm_tokens_per_image) == (896, 14, 256)
    assert shrunk.tie_word_embeddings is False and text.tie_word_embeddings is False


def test_vision_feature_layer_indexes_stay_valid_for_fewer_layers() -> None:
    assert rescale_feature_layer(-2, 24, 2) == -2  # the shrunken tower still has two layers
    assert rescale_feature_layer(-1, 24, 2) == -1
    assert rescale_feature_layer(-5, 24, 2) == -2  # no fifth-from-last layer: the first layer's output
    assert rescale_feature_layer(12, 24, 2) == 1  # halfway stays halfway
    assert rescale_feature_layer(0, 24, 2) == 0  # the embeddings
    cfg = copy.deepcopy(AutoConfig.from_pretrained(require_bundle(LLAVA)))
    cfg.vision_feature_layer = [-24, -12, -2]
    assert shrink_config(cfg, engine_family("llava").shrink).vision_feature_layer == [-2, -2, -2]


def test_a_media_model_type_without_a_row_is_not_shrunk() -> None:
    cfg = copy.deepcopy(AutoConfig.from_pretrained(require_bundle(LLAVA)))
    cfg.model_type = "llava_unknown"
    with pytest.raises(ValueError, match="no shrink rules for model_type 'llava_unknown'"):
        shrink_config(cfg)


@pytest.mark.parametrize(("name", "cls"), [(LLAVA, "LlavaForConditionalGeneration"),
                                           (LLAVA_NEXT, "LlavaNextForConditionalGeneration"),
                                           (GEMMA3, "Gemma3ForConditionalGeneration"),
                                           (LLAMA4, "Llama4ForConditionalGeneration")])
def test_the_model_class_is_the_architecture_which_auto_image_text_to_text_also_picks(name: str, cls: str) -> None:
    config = AutoConfig.from_pretrained(require_bundle(name))
    mapping = transformers.AutoModelForImageTextToText._model_mapping  # type: ignore[attr-defined]
    assert model_class(config).__name__ == cls
    assert mapping[type(config)] is model_class(config)


def test_every_family_row_is_named_by_its_model_type() -> None:
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "gemma3", "llama4", "internvl"} <= set(ENGINE_FAMILIES)
    assert all(row.name == model_type for model_type, row in ENGINE_FAMILIES.items())


# ---- generation against transformers ------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    # config.json + generation_config.json of each bundle; eos: the top-level config's, else the text config's
    (LLAVA, ("llava", 32064, 4096, [2], 1, 32001)),
    (LLAVA_NEXT, ("llava_next", 32064, 32768, [2], 1, -1)),
    (GEMMA3, ("gemma3", 262208, 131072, [1, 106], 2, 0)),
    ("llava-hf--llava-onevision-qwen2-0.5b-ov-hf", ("llava_onevision", 152000, 32768, [151645], 151643, -1)),
    (LLAMA4, ("llama4", 202048, 10485760, [200001, 200007, 200008], 200000, 200018)),
    (INTERNVL, ("internvl", 151674, 32768, [151645], 151643, -1)),
])
def test_model_info_reports_each_bundles_own_facts(
    name: str, expected: tuple, engine_for: Callable[[Path], RunningEngine]
) -> None:
    info = stub_for(engine_for(require_bundle(name)).address).GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(),
                                                                            timeout=10)
    assert info.supports_vision
    assert (info.model_type, info.vocab_size, info.max_context_length, list(info.eos_token_ids), info.bos_token_id,
            info.pad_token_id) == expected



@pytest.mark.parametrize("name", FAMILY_BUNDLES)
def test_greedy_image_generation_equals_transformers_generate(
    name: str, engine_for: Callable[[Path], RunningEngine]
) -> None:
    bundle = require_bundle(name)
    out = _processor_outputs(bundle, [random_image()])
    _assert_same_generation(engine_for(bundle), name, bundle, out)


def test_gemma3_pan_and_scan_crops_are_more_images_to_the_tower(
    engine_for: Callable[[Path], RunningEngine]
) -> None:
    bundle = require_bundle(GEMMA3)
    # 600x300: ratio 2 >= 1.2 activates pan-and-scan; min(600 // 256, round(2)) = 2 crops of 300x300
    out = _processor_outputs(bundle, [random_image(600, 300, seed=4)], do_pan_and_scan=True)
    assert out["pixel_values"].shape == (3, 3, 896, 896)
    assert int((out["input_ids"] == 255999).sum()) == 3  # one <start_of_image> per image and crop
    assert int((out["token_type_ids"] == 1).sum()) == 3 * 256
    _assert_same_generation(engine_for(bundle), GEMMA3, bundle, out)


def test_llava_next_images_of_different_tile_counts_travel_zero_padded(
    engine_for: Callable[[Path], RunningEngine]
) -> None:
    bundle = require_bundle(LLAVA_NEXT)
    # 64x48 -> pinpoint 336x672 (base + 2 tiles); 350x1000 -> 336x1008 (base + 3 tiles)
    out = _processor_outputs(bundle, [random_image(64, 48), random_image(350, 1000, seed=2)])
    assert out["pixel_values"].shape[:2] == (2, 4)
    assert not out["pixel_values"][0, 3].any()  # transformers _pad_for_batching: zeros
    _assert_same_generation(engine_for(bundle), LLAVA_NEXT, bundle, out, steps=3)


@pytest.mark.parametrize("name", FAMILY_BUNDLES)
def test_the_output_depends_on_the_pixels(name: str, engine_for: Callable[[Path], RunningEngine]) -> None:
    bundle = require_bundle(name)
    out = _processor_outputs(bundle, [random_image()])
    other = dict(out, pixel_values=torch.roll(out["pixel_values"], shifts=37, dims=-1) * 0.5)
    engine = engine_for(bundle)
    assert _engine_greedy(engine, name, out, steps=4) != _engine_greedy(engine, name, other, steps=4)


def test_gemma3_token_type_ids_are_built_from_the_image_token_as_the_processor_does() -> None:
    bundle = require_bundle(GEMMA3)
    out = _processor_outputs(bundle, [random_image()])
    request = generate_request(out["input_ids"][0].tolist(), wire_batch(GEMMA3, out))
    inputs = build_model_inputs(request, _reference_model(bundle), LazyTokenizer(bundle))
    assert set(inputs.mm_kwargs) == {"pixel_values", "token_type_ids"}  # num_patches: bookkeeping, dropped
    assert inputs.dropped_keys == ("num_patches",)
    assert torch.equal(inputs.mm_kwargs["token_type_ids"], out["token_type_ids"])
    assert torch.equal(inputs.mm_kwargs["pixel_values"], out["pixel_values"])


def test_llava_takes_no_token_types_and_next_gets_its_image_sizes() -> None:
    bundle = require_bundle(LLAVA_NEXT)
    out = _processor_outputs(bundle, [random_image()])
    request = generate_request(out["input_ids"][0].tolist(), wire_batch(LLAVA_NEXT, out))
    inputs = build_model_inputs(request, _reference_model(bundle), LazyTokenizer(bundle))
    assert set(inputs.mm_kwargs) == {"pixel_values", "image_sizes"}
    assert torch.equal(inputs.mm_kwargs["image_sizes"], out["image_sizes"])


def test_gemma3_pixel_rows_disagreeing_with_num_patches_are_invalid_argument(
    engine_for: Callable[[Path], RunningEngine]
) -> None:
    bundle = require_bundle(GEMMA3)
    out = _processor_outputs(bundle, [random_image()])
    mm = wire_batch(GEMMA3, out)
    mm.model_specific_tensors["num_patches"].CopyFrom(_td(torch.tensor([2])))
    request = generate_request(out["input_ids"][0].tolist(), mm)
    with pytest.raises(grpc.RpcError) as info:
        list(stub_for(engine_for(bundle).address).Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_patches" in info.value.details()


# ---- device normalization, per family --------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_BUNDLES)
def test_channels_first_normalization_equals_the_processor_bit_for_bit(name: str) -> None:
    bundle = require_bundle(name)
    images = [random_image(), random_image(350, 1000, seed=2)] if name == LLAVA_NEXT else [random_image()]
    floats = _processor_outputs(bundle, images)["pixel_values"]
    raw = _processor_outputs(bundle, images, do_rescale=False, do_normalize=False)["pixel_values"]
    assert torch.equal(raw, raw.round()) and raw.max() <= 255
    normalized = DeviceNormalizer.from_bundle(bundle, RawLayout.CHANNELS_FIRST).normalize(raw.to(torch.uint8))
    if name == LLAVA_NEXT:  # the padded tile is zeros in the float tensor; the model drops it by image_sizes
        assert torch.equal(normalized[0, :3], floats[0, :3]) and torch.equal(normalized[1], floats[1])
    else:
        assert torch.equal(normalized, floats)


def test_a_gemma3_engine_that_normalizes_on_device_answers_uint8_as_floats() -> None:
    bundle = require_bundle(GEMMA3)
    engine = start_engine(EngineConfig(model=bundle, port=0, device_normalize=True))
    try:
        stub = stub_for(engine.address)
        assert stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=10).mm_device_do_normalize
        out = _processor_outputs(bundle, [random_image()])
        raw = _processor_outputs(bundle, [random_image()], do_rescale=False, do_normalize=False)
        raw["pixel_values"] = raw["pixel_values"].to(torch.uint8)
        # bit-identical pixels: the same ids and the same logprobs, exactly
        assert _engine_greedy_logprobs(engine, GEMMA3, raw, 3) == _engine_greedy_logprobs(engine, GEMMA3, out, 3)
    finally:
        engine.stop(grace=0)


@pytest.mark.parametrize(("model_type", "vision", "advertised"), [
    ("llava", True, RawLayout.CHANNELS_FIRST), ("gemma3", True, RawLayout.CHANNELS_FIRST),
    ("qwen2_vl", True, RawLayout.PATCH_ROWS), ("qwen2", False, None), ("glm4v", True, None),
])
def test_device_normalization_is_advertised_only_for_a_known_raw_layout(
    model_type: str, vision: bool, advertised: RawLayout | None, tmp_path: Path
) -> None:
    loaded = SimpleNamespace(family=engine_family(model_type),
                             facts=SimpleNamespace(supports_vision=vision, model_type=model_type))
    normalizer = device_normalizer(EngineConfig(model=tmp_path, device_normalize=True), loaded)  # type: ignore[arg-type]
    assert (normalizer.layout if normalizer is not None else None) == advertised
    assert device_normalizer(EngineConfig(model=tmp_path), loaded) is None  # type: ignore[arg-type]
