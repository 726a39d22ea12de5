"""Generate over gRPC against the in-process reference engine, inputs from the real processors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from mmgate.refengine.server import RunningEngine
from mmgate.transport.inline import to_tensor_data
from tests.refengine.refengine_support import (
    QWEN_BUNDLES,
    generate_request,
    image_mm_inputs,
    image_prompt,
    processor_for,
    require_bundle,
    stub_for,
)


def _complete(stub, request) -> vllm_engine_pb2.GenerateComplete:  # noqa: ANN001
    responses = list(stub.Generate(request, timeout=120))
    assert len(responses) == 1 and responses[0].HasField("complete")
    return responses[0].complete


@pytest.mark.parametrize("name", QWEN_BUNDLES)
def test_every_qwen_bundle_accepts_an_image_request(name: str, engine_for: Callable[[Path], RunningEngine]) -> None:
    bundle = require_bundle(name)
    prompt = image_prompt(bundle)
    stub = stub_for(engine_for(bundle).address)
    complete = _complete(stub, generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=4))
    assert complete.prompt_tokens == len(prompt.input_ids)
    assert 1 <= complete.completion_tokens <= 4
    assert len(complete.output_ids) == complete.completion_tokens
    assert complete.finish_reason in ("stop", "length")


def test_streaming_yields_one_chunk_per_token_then_the_totals(
    qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path
) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    request = generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=5, stream=True, ignore_eos=True)
    responses = list(stub.Generate(request, timeout=120))
    *chunks, last = responses
    assert all(r.HasField("chunk") for r in chunks) and last.HasField("complete")
    assert [len(r.chunk.token_ids) for r in chunks] == [1] * 5
    assert all(r.chunk.prompt_tokens == len(prompt.input_ids) for r in chunks)
    assert [t for r in chunks for t in r.chunk.token_ids] == list(last.complete.output_ids)
    assert last.complete.completion_tokens == 5
    assert last.complete.finish_reason == "length"


def test_greedy_is_deterministic_and_streaming_matches_non_streaming(
    qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path
) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    request = generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=6, ignore_eos=True)
    first, second = _complete(stub, request), _complete(stub, request)
    assert list(first.output_ids) == list(second.output_ids)
    request.stream = True
    streamed = [t for r in stub.Generate(request, timeout=120) if r.HasField("chunk") for t in r.chunk.token_ids]
    assert streamed == list(first.output_ids)


def test_seeded_sampling_repeats_its_draw(qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    request = generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=6, temperature=1.5, seed=7)
    assert list(_complete(stub, request).output_ids) == list(_complete(stub, request).output_ids)


def test_a_stop_token_ends_generation_with_stop(qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    greedy = _complete(stub, generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=3, ignore_eos=True))
    first = greedy.output_ids[0]
    stopped = _complete(
        stub, generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=3, stop_token_ids=[first])
    )
    assert list(stopped.output_ids) == [first]
    assert stopped.finish_reason == "stop"
    assert stopped.matched_token_id == first


def test_max_tokens_default_applies_when_unset(qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    complete = _complete(
        stub, generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=None, ignore_eos=True)
    )
    assert complete.completion_tokens == 16  # EngineConfig(max_tokens_default=16) in conftest


def test_one_image_token_too_few_is_refused_with_the_models_message_and_the_server_keeps_serving(
    qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path
) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    short_ids = list(prompt.input_ids)
    short_ids.remove(prompt.image_token_id)
    n_tokens = short_ids.count(prompt.image_token_id)
    with pytest.raises(grpc.RpcError) as info:
        _complete(stub, generate_request(short_ids, image_mm_inputs(prompt, short_ids)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # transformers modeling_qwen2_vl.Qwen2VLModel.get_placeholder_mask
    assert f"Image features and image tokens do not match, tokens: {n_tokens}, features: {n_tokens + 1}" in (
        info.value.details()
    )
    assert _complete(stub, generate_request(prompt.input_ids, image_mm_inputs(prompt))).completion_tokens >= 1


def test_a_truncated_pixel_payload_is_invalid_argument(qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    mm = image_mm_inputs(prompt)
    mm.pixel_values.inline = mm.pixel_values.inline[:-4]
    with pytest.raises(grpc.RpcError) as info:
        _complete(stub_for(qwen2_vl_engine.address), generate_request(prompt.input_ids, mm))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes" in info.value.details()


def test_pixel_rows_disagreeing_with_patches_per_image_are_invalid_argument(
    qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path
) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    mm = image_mm_inputs(prompt)
    mm.pixel_values.CopyFrom(to_tensor_data(prompt.pixel_values[:-1]))
    with pytest.raises(grpc.RpcError) as info:
        _complete(stub_for(qwen2_vl_engine.address), generate_request(prompt.input_ids, mm))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "patches_per_image" in info.value.details()


def test_unsupported_sampling_features_are_refused(qwen2_vl_engine: RunningEngine) -> None:
    stub = stub_for(qwen2_vl_engine.address)
    with pytest.raises(grpc.RpcError) as info:
        _complete(stub, generate_request([9707, 11, 1879], prompt_logprobs=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in info.value.details()


def test_a_text_only_request_to_a_vision_model_generates(qwen2_vl_engine: RunningEngine) -> None:
    complete = _complete(stub_for(qwen2_vl_engine.address), generate_request([9707, 11, 1879], max_tokens=3))
    assert complete.prompt_tokens == 3 and 1 <= complete.completion_tokens <= 3


def test_a_video_batch_reaches_the_model_as_pixel_values_videos(
    qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path
) -> None:
    processor = processor_for(qwen2_vl_bundle)
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    frames = np.random.RandomState(1).randint(0, 255, (4, 56, 56, 3), dtype=np.uint8)
    out = processor(text=[text], videos=[frames], return_tensors="np")
    ids = [int(t) for t in out["input_ids"][0]]
    grid = np.ascontiguousarray(out["video_grid_thw"], dtype=np.int64)
    video_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    mm = vllm_engine_pb2.MultimodalInputs(
        pixel_values=to_tensor_data(np.ascontiguousarray(out["pixel_values_videos"], dtype=np.float32)),
        model_specific_tensors={
            "video_grid_thw": to_tensor_data(grid),
            "patches_per_video": to_tensor_data(grid.prod(-1)),
        },
        mm_placeholders=[
            vllm_engine_pb2.PlaceholderRange(offset=ids.index(video_token_id), length=ids.count(video_token_id))
        ],
        batched_keys=["video_grid_thw", "patches_per_video"],
        flat_keys={"pixel_values": "patches_per_video"},
        modality=common_pb2.VIDEO,
    )
    complete = _complete(stub_for(qwen2_vl_engine.address), generate_request(ids, mm, max_tokens=2))
    assert complete.prompt_tokens == len(ids) and 1 <= complete.completion_tokens <= 2


def test_health_check_answers_while_a_generation_runs_and_abort_stops_it(
    qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path
) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    request = generate_request(
        prompt.input_ids, image_mm_inputs(prompt), max_tokens=5000, stream=True, ignore_eos=True, request_id="long"
    )
    stream = stub.Generate(request, timeout=120)
    first = next(stream)
    assert first.HasField("chunk")
    assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=5).healthy
    assert stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=5).active_requests == 1
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["long"]), timeout=5)
    rest = list(stream)
    assert rest[-1].HasField("complete")
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 5000


def test_the_output_depends_on_the_pixels(qwen2_vl_engine: RunningEngine, qwen2_vl_bundle: Path) -> None:
    prompt = image_prompt(qwen2_vl_bundle)
    stub = stub_for(qwen2_vl_engine.address)
    flipped = image_mm_inputs(prompt)
    flipped.pixel_values.CopyFrom(to_tensor_data(np.ascontiguousarray(prompt.pixel_values[::-1])))
    original = _complete(
        stub, generate_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=4, ignore_eos=True)
    )
    changed = _complete(stub, generate_request(prompt.input_ids, flipped, max_tokens=4, ignore_eos=True))
    assert list(original.output_ids) != list(changed.output_ids)
