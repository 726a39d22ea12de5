"""The engine's decode loop against transformers' own ``model.generate`` on the same weights.

The engine builds its random model from the seed, so ``load_model`` with the
same config rebuilds identical weights; ``generate`` gets exactly what the
processor returned (including ``mm_token_type_ids``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmgate.refengine.bundle import LoadedModel, load_model
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine
from tests.refengine.refengine_support import (
    QWEN2_5_VL,
    QWEN_BUNDLES,
    generate_request,
    image_mm_inputs,
    image_prompt,
    processor_for,
    random_image,
    require_bundle,
    stub_for,
)

STEPS = 6


def _reference_model(bundle: Path) -> LoadedModel:
    return load_model(EngineConfig(model=bundle, port=0))


def _hf_greedy(loaded: LoadedModel, inputs: dict[str, torch.Tensor]) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _engine_greedy(engine: RunningEngine, request) -> list[int]:  # noqa: ANN001
    (response,) = list(stub_for(engine.address).Generate(request, timeout=120))
    return list(response.complete.output_ids)


@pytest.mark.parametrize("name", QWEN_BUNDLES)
def test_greedy_image_generation_equals_transformers_generate(
    name: str, engine_for: Callable[[Path], RunningEngine]
) -> None:
    bundle = require_bundle(name)
    processor = processor_for(bundle)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = dict(processor(text=[text], images=[random_image()], return_tensors="pt"))
    prompt = image_prompt(bundle)
    assert inputs["input_ids"][0].tolist() == prompt.input_ids
    expected = _hf_greedy(_reference_model(bundle), inputs)
    request = generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=STEPS, ignore_eos=True)
    assert _engine_greedy(engine_for(bundle), request) == expected


def test_a_text_request_after_an_image_request_is_not_offset_by_the_images_rope_deltas(
    engine_for: Callable[[Path], RunningEngine],
) -> None:
    bundle = require_bundle(QWEN2_5_VL)
    engine = engine_for(bundle)
    # 448x448 -> a 16x16 merged grid: 256 image tokens on 16 M-RoPE positions, rope_deltas = -240
    prompt = image_prompt(bundle, size=(448, 448))
    _engine_greedy(engine, generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=2))
    ids = processor_for(bundle).tokenizer("The quick brown fox jumps over")["input_ids"]
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.int64)}
    expected = _hf_greedy(_reference_model(bundle), inputs)
    assert _engine_greedy(engine, generate_request(ids, max_tokens=STEPS, ignore_eos=True)) == expected
