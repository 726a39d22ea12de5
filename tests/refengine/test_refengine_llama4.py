"""The reference engine runs Llama 4 (shrunken, seeded random weights), around a bug of transformers 5.24.

Requests come from the bundle's own processor (``processor.apply_chat_template(conversation,
add_generation_prompt=True)`` then ``processor(text=[prompt], images=[...])``) and travel as vLLM
0.33 lays Llama 4 out (``vllm/model_executor/models/mllama4.py`` ``_get_mm_fields_config``):
``pixel_values`` flat ``[sum(tiles), 3, 336, 336]`` sized by ``patches_per_image`` (batched), and
``aspect_ratios`` batched; the placeholder range of each image is its whole ``_prompt_split_image``
run and ``im_token_id`` = ``<|patch|>`` (200092), so the separators inside it are not embedded.
The engine's greedy ids must equal ``model.generate(do_sample=False)`` of the same shrunken model.

``Llama4ForConditionalGeneration.forward`` (transformers 5.24) raises ``AttributeError`` on its last
statement on every call; :mod:`mmgate.refengine.model_fixes` works around it with hooks while the
installed source has the bug.  The tests below show the bug on a model built without the fix, and
that the fix changes nothing but the missing attribute.
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

from mmgate.refengine.bundle import LazyTokenizer, LoadedModel, load_model, model_class
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.families import ENGINE_FAMILIES
from mmgate.refengine.mm_inputs import build_model_inputs
from mmgate.refengine.model_fixes import LLAMA4_BUGGY_LINE, apply_model_fixes, llama4_forward_is_buggy
from mmgate.refengine.server import RunningEngine
from mmgate.refengine.shrink import shrink_config
from mmgate.transport.inline import to_tensor_data
from tests.refengine.refengine_support import generate_request, processor_for, random_image, require_bundle, stub_for

LLAMA4 = "meta-llama--Llama-4-Scout-17B-16E-Instruct"
PATCH, IMAGE_START, IMAGE_END = 200092, 200080, 200081
STEPS = 4


def _outputs(images: list) -> dict[str, torch.Tensor]:
    processor = processor_for(require_bundle(LLAMA4))
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe the image."}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    out = dict(processor(text=[prompt], images=images, return_tensors="pt"))
    out["aspect_ratios"] = processor.image_processor(images=images, return_tensors="pt")["aspect_ratios"]
    return out


def _td(tensor: torch.Tensor) -> vllm_engine_pb2.TensorData:
    return to_tensor_data(np.ascontiguousarray(tensor.numpy()))


def wire_batch(out: dict[str, torch.Tensor]) -> vllm_engine_pb2.MultimodalInputs:
    """The processor's outputs in vLLM's Llama 4 layout: one range per ``<|image_start|>`` ..
    ``<|image_end|>`` run (vLLM's ``PromptReplacement`` output); pixels as float32."""
    ids = out["input_ids"][0].tolist()
    mm = vllm_engine_pb2.MultimodalInputs(pixel_values=_td(out["pixel_values"].float()), im_token_id=PATCH,
                                          modality=common_pb2.IMAGE)
    starts = [i for i, t in enumerate(ids) if t == IMAGE_START]
    ends = [i for i, t in enumerate(ids) if t == IMAGE_END]
    mm.mm_placeholders.extend(vllm_engine_pb2.PlaceholderRange(offset=s, length=e - s + 1)
                              for s, e in zip(starts, ends, strict=True))
    ar = out["aspect_ratios"]
    tiles = torch.tensor([1 if int(h) * int(w) == 1 else 1 + int(h) * int(w) for h, w in ar.tolist()])
    mm.model_specific_tensors["patches_per_image"].CopyFrom(_td(tiles))
    mm.model_specific_tensors["aspect_ratios"].CopyFrom(_td(ar.to(torch.int64)))
    mm.flat_keys["pixel_values"] = "patches_per_image"
    mm.batched_keys.extend(["patches_per_image", "aspect_ratios"])
    return mm


@cache
def _reference_model() -> LoadedModel:
    return load_model(EngineConfig(model=require_bundle(LLAMA4), port=0))


def _hf_greedy(out: dict[str, torch.Tensor], steps: int = STEPS) -> list[int]:
    inputs = {k: (v.float() if k == "pixel_values" else v) for k, v in out.items() if k != "aspect_ratios"}
    with torch.inference_mode():
        seq = _reference_model().model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    return seq[0, inputs["input_ids"].shape[1]:].tolist()


def _engine_greedy(engine: RunningEngine, out: dict[str, torch.Tensor], steps: int = STEPS) -> list[int]:
    request = generate_request(out["input_ids"][0].tolist(), wire_batch(out), max_tokens=steps, ignore_eos=True)
    (response,) = list(stub_for(engine.address).Generate(request, timeout=120))
    assert response.complete.prompt_tokens == out["input_ids"].shape[1]
    return list(response.complete.output_ids)


# ---- the shrink row ---------------------------------------------------------------------------


def test_llama4_shrinks_to_two_layers_one_chunked_one_nope_with_every_id_and_the_tile_geometry() -> None:
    original = AutoConfig.from_pretrained(require_bundle(LLAMA4))
    shrunk = shrink_config(original)
    assert (shrunk.image_token_index, shrunk.boi_token_index, shrunk.eoi_token_index) == (PATCH, IMAGE_START,
                                                                                           IMAGE_END)
    text, vision = shrunk.text_config, shrunk.vision_config
    # Scout: 48 layers, every fourth a NoPE full-attention layer, all 48 MoE (interleave step 1)
    assert original.text_config.layer_types[:4] == ["chunked_attention"] * 3 + ["full_attention"]
    assert text.layer_types == ["chunked_attention", "full_attention"]
    assert text.no_rope_layers == [1, 0] and text.moe_layers == [0, 1]
    assert (text.num_hidden_layers, text.hidden_size, text.num_local_experts, text.vocab_size) == (2, 64, 4, 202048)
    assert text.attention_chunk_size == 8192
    assert (vision.image_size, vision.patch_size, vision.pixel_shuffle_ratio) == (336, 14, 0.5)
    assert vision.intermediate_size == 4 * vision.hidden_size  # the pixel-shuffled width Llama4VisionMLP2 takes
    assert vision.projector_input_dim == vision.projector_output_dim == vision.vision_output_dim
    assert model_class(original).__name__ == "Llama4ForConditionalGeneration"
    assert ENGINE_FAMILIES["llama4"].token_types is None and ENGINE_FAMILIES["llama4"].raw_layout is None


# ---- the forward bug and its fix -------------------------------------------------------------


def _unfixed_model() -> torch.nn.Module:
    config = shrink_config(AutoConfig.from_pretrained(require_bundle(LLAMA4)))
    torch.manual_seed(0)
    return model_class(config)(config).float().eval()


def test_transformers_llama4_forward_raises_on_its_last_line_without_the_fix() -> None:
    """The bug as shipped: every ``return_dict`` call fails on ``image_outputs=outputs.image_outputs``
    (the language model's output has no such field), text-only calls included."""
    if not llama4_forward_is_buggy(model_class(AutoConfig.from_pretrained(require_bundle(LLAMA4)))):
        pytest.skip("the installed transformers no longer has the Llama 4 forward bug: the fix is not applied")
    model = _unfixed_model()
    with torch.inference_mode(), pytest.raises(AttributeError, match="image_outputs"):
        model(input_ids=torch.tensor([[200000, 15, 16]]))


def test_the_fix_changes_nothing_but_the_missing_image_outputs() -> None:
    """Fixed: the call returns the logits the unfixed forward computed before its last line raised
    (caught from the language model's output; ``return_dict=False`` raises too: the output
    decorators ask the forward for a dict) and the image encoder's output as ``image_outputs``."""
    if not llama4_forward_is_buggy(model_class(AutoConfig.from_pretrained(require_bundle(LLAMA4)))):
        pytest.skip("the installed transformers no longer has the Llama 4 forward bug")
    model = _unfixed_model()
    out = _outputs([random_image(400, 300)])
    inputs = {"input_ids": out["input_ids"], "pixel_values": out["pixel_values"].float()}
    caught: list[torch.Tensor] = []
    hook = model.language_model.register_forward_hook(lambda _m, _a, o: caught.append(o.logits.clone()))
    with torch.inference_mode():
        with pytest.raises(AttributeError, match="image_outputs"):
            model(**inputs)
        hook.remove()
        assert apply_model_fixes(model) == ("llama4_image_outputs",)
        fixed = model(**inputs)
    assert len(caught) == 1 and torch.equal(fixed.logits, caught[0])
    tiles = out["pixel_values"].shape[0]
    assert fixed.image_outputs is not None and fixed.image_outputs.last_hidden_state.shape[0] == tiles
    with torch.inference_mode():
        assert model(input_ids=out["input_ids"][:, :5]).image_outputs is None  # text only: no encoder output


def test_the_fix_is_applied_only_while_the_installed_source_has_the_bug() -> None:
    class Fixed(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # no buggy line here
            return input_ids

    Fixed.__name__ = "Llama4ForConditionalGeneration"
    assert LLAMA4_BUGGY_LINE == "image_outputs=outputs.image_outputs"
    assert not llama4_forward_is_buggy(Fixed)
    assert apply_model_fixes(Fixed()) == ()
    assert "llama4_image_outputs" in apply_model_fixes(_unfixed_model()) or not llama4_forward_is_buggy(
        model_class(AutoConfig.from_pretrained(require_bundle(LLAMA4))))


# ---- generation through the engine ------------------------------------------------------------


def test_llama4_inputs_are_the_flat_tiles_and_the_bookkeeping_keys_are_dropped() -> None:
    bundle = require_bundle(LLAMA4)
    out = _outputs([random_image(700, 400)])  # a 2x3 canvas (six tiles) + the global tile
    request = generate_request(out["input_ids"][0].tolist(), wire_batch(out))
    inputs = build_model_inputs(request, _reference_model(), LazyTokenizer(bundle))
    assert set(inputs.mm_kwargs) == {"pixel_values"}
    assert set(inputs.dropped_keys) == {"patches_per_image", "aspect_ratios"}
    assert torch.equal(inputs.mm_kwargs["pixel_values"], out["pixel_values"].float())


@pytest.mark.parametrize("sizes", [((64, 48),), ((700, 400), (30, 500))], ids=["one-tile", "two-tiled-images"])
def test_greedy_image_generation_equals_transformers_generate(
    sizes: tuple, engine_for: Callable[[Path], RunningEngine]
) -> None:
    out = _outputs([random_image(w, h, seed=k) for k, (w, h) in enumerate(sizes)])
    assert int((out["input_ids"] == PATCH).sum()) == 144 * out["pixel_values"].shape[0]
    assert _engine_greedy(engine_for(require_bundle(LLAMA4)), out) == _hf_greedy(out)


def test_the_output_depends_on_the_pixels(engine_for: Callable[[Path], RunningEngine]) -> None:
    out = _outputs([random_image(700, 400)])
    other = dict(out, pixel_values=torch.roll(out["pixel_values"], shifts=37, dims=-1) * 0.5)
    engine = engine_for(require_bundle(LLAMA4))
    assert _engine_greedy(engine, out, steps=4) != _engine_greedy(engine, other, steps=4)
