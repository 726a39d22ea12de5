"""GetModelInfo / GetServerInfo / HealthCheck, and a text-only bundle."""

from __future__ import annotations

import os

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.refengine.refengine_support import (
    generate_request,
    image_mm_inputs,
    image_prompt,
    stub_for,
    write_text_only_bundle,
)


def test_model_info_reports_the_bundles_own_facts(qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    info = stub_for(qwen2_vl_engine.address).GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
    # values from Qwen--Qwen2-VL-2B-Instruct/config.json
    assert info.model_path == str(qwen2_vl_bundle)
    assert info.served_model_name == str(qwen2_vl_bundle)  # no --served-model-name: the path, as vLLM
    assert info.is_generation
    assert info.supports_vision
    assert info.model_type == "qwen2_vl"
    assert list(info.architectures) == ["Qwen2VLForConditionalGeneration"]
    assert info.vocab_size == 151936
    assert info.max_context_length == 32768
    assert list(info.eos_token_ids) == [151645]
    assert info.bos_token_id == 151643
    assert info.pad_token_id == 151643  # generation_config.json


def test_server_info_says_vllm_grpc_shm_namespace_and_float32(qwen2_vl_engine: RunningEngine) -> None:
    stub = stub_for(qwen2_vl_engine.address)
    assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10).healthy
    info = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=10)
    assert info.server_type == "vllm-grpc"
    assert info.uptime_seconds > 0
    assert info.active_requests == 0
    # <boot_id>:<st_dev of /dev/shm>, read here independently of the code under test.
    with open("/proc/sys/kernel/random/boot_id") as fh:
        assert info.shm_namespace_id == f"{fh.read().strip()}:{os.stat('/dev/shm').st_dev}"
    assert info.mm_device_do_normalize is False
    assert info.mm_processor == ""
    assert info.mm_item_limits == ""
    assert info.multimodal_encoder_dtype == "float32"


def test_served_model_name_flag_is_reported(qwen2_vl_bundle: Path) -> None:
    engine = start_engine(EngineConfig(model=qwen2_vl_bundle, port=0, served_model_name="qwen2-vl"))
    try:
        info = stub_for(engine.address).GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
        assert info.served_model_name == "qwen2-vl"
    finally:
        engine.stop(grace=0)


@pytest.fixture(scope="module")
def text_only_engine(
    tmp_path_factory: pytest.TempPathFactory,
    engine_for: Callable[[Path], RunningEngine],
    qwen2_vl_bundle: Path,
) -> RunningEngine:
    bundle = write_text_only_bundle(tmp_path_factory.mktemp("qwen2-text"), qwen2_vl_bundle)
    return engine_for(bundle)


def test_a_text_only_model_reports_no_vision_and_generates(text_only_engine: RunningEngine) -> None:
    stub = stub_for(text_only_engine.address)
    info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
    assert not info.supports_vision
    assert info.model_type == "qwen2"
    (response,) = list(stub.Generate(generate_request([9707, 11, 1879], max_tokens=3), timeout=60))
    assert response.complete.prompt_tokens == 3 and 1 <= response.complete.completion_tokens <= 3


def test_a_text_only_model_refuses_an_image(text_only_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    with pytest.raises(grpc.RpcError) as info:
        request = generate_request(prompt.input_ids, image_mm_inputs(prompt))
        list(stub_for(text_only_engine.address).Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multimodal" in info.value.details()


def test_a_text_prompt_is_tokenized_by_the_bundles_tokenizer(text_only_engine: RunningEngine) -> None:
    request = vllm_engine_pb2.GenerateRequest(
        request_id="t", text="Hello, world", sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2)
    )
    (response,) = list(stub_for(text_only_engine.address).Generate(request, timeout=60))
    assert response.complete.prompt_tokens == 3  # "Hello" "," " world" in the Qwen2 BPE
