"""Pure pieces of the engine: config shrinking, tensor decoding, sampling plans, CLI parsing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from smg_grpc_proto.generated import vllm_engine_pb2
from transformers import AutoConfig

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import ModelFacts, read_facts
from mmgate.refengine.config import parse_args
from mmgate.refengine.sampling import plan_generation
from mmgate.refengine.shrink import rescale_sections, shrink_config
from mmgate.refengine.tensors import decode_tensor
from mmgate.transport.inline import to_tensor_data
from tests.refengine.refengine_support import QWEN2_5_VL, QWEN2_VL, QWEN3_VL, QWEN_BUNDLES, require_bundle

# ---- shrink ---------------------------------------------------------------------------

KEPT_TOP = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
KEPT_TEXT = ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id", "max_position_embeddings")
KEPT_VISION = (
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "in_channels",
    "window_size",
    "num_position_embeddings",
    "tokens_per_second",
)


def test_rescale_sections_keeps_proportions_and_the_total() -> None:
    assert rescale_sections([16, 24, 24], 8) == [2, 3, 3]  # Qwen2-VL, head_dim 128 -> 16
    assert rescale_sections([24, 20, 20], 8) == [3, 3, 2]  # Qwen3-VL: 3, 2.5, 2.5; tie to the earlier
    with pytest.raises(ValueError):
        rescale_sections([1, 1, 1], 2)


@pytest.mark.parametrize("name", QWEN_BUNDLES)
def test_shrinking_keeps_token_ids_and_patch_geometry(name: str) -> None:
    original = AutoConfig.from_pretrained(require_bundle(name))
    shrunk = shrink_config(original)
    for key in KEPT_TOP:
        assert getattr(shrunk, key, None) == getattr(original, key, None), key
    for key in KEPT_TEXT:
        assert getattr(shrunk.get_text_config(), key, None) == getattr(original.get_text_config(), key, None), key
    for key in KEPT_VISION:
        assert getattr(shrunk.vision_config, key, None) == getattr(original.vision_config, key, None), key
    text = shrunk.get_text_config()
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads) == (2, 64, 4)
    assert sum(text.rope_parameters["mrope_section"]) == (64 // 4) // 2
    assert original.get_text_config().num_hidden_layers == 28  # the original is untouched


def test_shrunken_vision_towers_stay_valid_for_their_depth() -> None:
    qwen2 = shrink_config(AutoConfig.from_pretrained(require_bundle(QWEN2_VL))).vision_config
    assert (qwen2.depth, qwen2.embed_dim, qwen2.hidden_size) == (2, 32, 64)  # hidden = merger output = text hidden
    qwen25 = shrink_config(AutoConfig.from_pretrained(require_bundle(QWEN2_5_VL))).vision_config
    assert qwen25.fullatt_block_indexes == [1] and qwen25.out_hidden_size == 64
    qwen3 = shrink_config(AutoConfig.from_pretrained(require_bundle(QWEN3_VL))).vision_config
    assert qwen3.deepstack_visual_indexes == [0, 1] and qwen3.out_hidden_size == 64


# ---- tensors ----------------------------------------------------------------------------


def test_decode_tensor_reads_float32_and_widens_uint32_grids() -> None:
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert torch.equal(decode_tensor(to_tensor_data(pixels)), torch.from_numpy(pixels))
    grid = decode_tensor(to_tensor_data(np.array([[1, 4, 6]], dtype=np.uint32)))
    assert grid.dtype == torch.int64 and grid.tolist() == [[1, 4, 6]]


def test_decode_tensor_reads_bfloat16_bit_patterns() -> None:
    values = torch.tensor([1.0, -2.5, 0.15625], dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    decoded = decode_tensor(to_tensor_data(bits, dtype_name="bfloat16"))
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded, values)


def test_decode_tensor_refuses_a_short_payload() -> None:
    td = to_tensor_data(np.zeros((2, 3), dtype=np.float32))
    td.inline = td.inline[:-1]
    with pytest.raises(GatewayError) as info:
        decode_tensor(td)
    assert info.value.code == ErrorCode.INVALID_REQUEST


# ---- sampling ---------------------------------------------------------------------------

FACTS = ModelFacts(
    model_path="m",
    served_model_name="m",
    model_type="qwen2_vl",
    architectures=("X",),
    vocab_size=100,
    max_context_length=50,
    supports_vision=True,
    eos_token_ids=(7,),
    stop_token_ids=(7, 8),
    pad_token_id=8,
    bos_token_id=8,
    image_token_id=9,
    video_token_id=10,
    random_weights=True,
)


def test_an_empty_sampling_params_is_greedy_with_the_default_budget_and_eos_stops() -> None:
    plan = plan_generation(vllm_engine_pb2.SamplingParams(), FACTS, prompt_len=10, max_tokens_default=16)
    assert not plan.do_sample
    assert plan.max_new_tokens == 16
    assert plan.stop_token_ids == (7, 8)
    assert plan.top_p == 1.0 and plan.top_k == 0 and plan.repetition_penalty == 1.0


def test_ignore_eos_keeps_only_the_requests_stop_token_ids() -> None:
    params = vllm_engine_pb2.SamplingParams(ignore_eos=True, stop_token_ids=[42])
    assert plan_generation(params, FACTS, 10, 16).stop_token_ids == (42,)


def test_max_tokens_is_clamped_to_the_context_left() -> None:
    params = vllm_engine_pb2.SamplingParams(max_tokens=100)
    assert plan_generation(params, FACTS, prompt_len=45, max_tokens_default=16).max_new_tokens == 5  # 50 - 45


def test_a_prompt_filling_the_context_is_refused() -> None:
    with pytest.raises(GatewayError) as info:
        plan_generation(vllm_engine_pb2.SamplingParams(), FACTS, prompt_len=50, max_tokens_default=16)
    assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED


def test_a_positive_temperature_samples_with_the_requests_seed() -> None:
    params = vllm_engine_pb2.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)
    plan = plan_generation(params, FACTS, 10, 16)
    assert plan.do_sample and plan.seed == 3
    assert plan.top_k == 5 and (plan.temperature, plan.top_p) == pytest.approx((0.7, 0.9))  # float32 wire


# ---- facts and CLI -------------------------------------------------------------------------


def test_stop_ids_are_the_config_eos_then_the_generation_config_extras() -> None:
    bundle = require_bundle(QWEN2_VL)
    facts = read_facts(bundle, AutoConfig.from_pretrained(bundle), "m", random_weights=True)
    assert facts.eos_token_ids == (151645,)
    assert facts.stop_token_ids == (151645, 151643)  # generation_config.json eos_token_id


def test_cli_arguments_become_a_frozen_config() -> None:
    config = parse_args(
        ["--model", "/m", "--port", "5", "--seed", "2", "--served-model-name", "x", "--max-tokens-default", "8"]
    )
    assert (config.model, config.port, config.seed, config.model_name, config.max_tokens_default) == (
        Path("/m"),
        5,
        2,
        "x",
        8,
    )
    assert config.host == "127.0.0.1"
    with pytest.raises(SystemExit):
        parse_args(["--port", "5"])
