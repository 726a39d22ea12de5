"""The reference engine on every wire and in every role: the same greedy ids whatever the split.

Requests: two images and a question prepared by mmgate's pipeline, encoded for each wire and leg
by the gateway-side encoders (``tests/refengine/roles_support.py``).  The reference for every
comparison is the single vLLM-wire engine's answer to the same request (same bundle, same seeded
shrunken weights).  What is shown:

* a single engine of each wire answers the vLLM single engine's ids (Qwen2.5-VL, Qwen3-VL);
* a prefill/decode pair of each wire answers them too, the first token coming from the prefill
  (docs/refengine-roles.md), the decode leg carrying no pixels;
* TokenSpeed encode + prefill + decode answers them, the prefill carrying no pixels either;
* seeded sampling and logprobs survive the handoff bit for bit;
* each wire's response shape (streams, stop trimming), its labels as the gateway probes them,
  the standard health service;
* a prefill never claimed frees its KV after ``--handoff-timeout``; an unknown room, an
  unreachable bootstrap port, a failed encoder and a prompt mismatch are refused cleanly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import tokenspeed_encoder_pb2, tokenspeed_scheduler_pb2

from mmgate.engines import sglang, tokenspeed
from mmgate.engines.base import Bootstrap, Role, Wire
from mmgate.engines.client import WorkerClient
from mmgate.refengine.handoff import HandoffError, HandoffServer, fetch
from mmgate.refengine.health import HealthCheckRequest, HealthCheckResponse
from mmgate.transport.dtypes import EncoderDtype
from mmgate.transport.policy import WirePlan
from mmgate.transport.shm import ShmLease, shm_namespace_id
from mmgate.types import Modality
from tests.refengine.roles_support import (
    MODELS,
    QWEN2_5,
    QWEN3,
    Engines,
    completes,
    encoder_stub,
    epd_messages,
    generate,
    in_background,
    next_room,
    output_ids,
    request,
    rpc_error,
    run_epd,
    run_pd,
    single_message,
    streamed_ids,
    vllm_decode_message,
)

WIRES = (Wire.VLLM, Wire.SGLANG, Wire.TOKENSPEED)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    pool = Engines()
    yield pool
    pool.stop()


def vllm_single_ids(engines: Engines, model: str, request_id: str = "reference", **sampling: object) -> list[int]:
    prep = request(model, request_id, **sampling)
    return output_ids(generate(engines.get(model, Wire.VLLM), Wire.VLLM, single_message(Wire.VLLM, prep)))


# ---- equality across wires and roles ---------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
def test_a_single_engine_of_each_wire_answers_the_vllm_single_engines_ids(engines: Engines, model: str,
                                                                           wire: Wire) -> None:
    want = vllm_single_ids(engines, model)
    assert len(want) == 8
    prep = request(model, f"single-{wire}")
    assert output_ids(generate(engines.get(model, wire), wire, single_message(wire, prep))) == want


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("wire", WIRES)
def test_a_prefill_decode_pair_answers_the_single_engines_ids(engines: Engines, model: str, wire: Wire) -> None:
    want = vllm_single_ids(engines, model)
    prefill, decode = run_pd(engines, model, wire, request(model, f"pd-{wire}"))
    assert output_ids(prefill) == want[:1]  # the prefill samples the first token and hands it over
    assert completes(prefill)[0].finish_reason == "length"
    assert output_ids(decode) == want
    assert engines.get(model, wire, Role.PREFILL).core.handoff.store.rooms() == 0  # claimed: freed


@pytest.mark.parametrize("model", MODELS)
def test_encode_prefill_decode_answers_the_single_engines_ids(engines: Engines, model: str) -> None:
    want = vllm_single_ids(engines, model)
    prep = request(model, "epd")
    encodes, p_msg, d_msg, _ = epd_messages(engines, model, prep)
    # only the encode leg carries pixels: the prefill and decode items have none
    assert all(m.mm_inputs.items[0].HasField("encoder_input") for m in encodes)
    assert not any(i.HasField("encoder_input") for m in (p_msg, d_msg) for i in m.mm_inputs.items)
    answers, prefill, decode = run_epd(engines, model, prep)
    assert [a.accepted for a in answers] == [True, True]
    assert output_ids(prefill) == want[:1]
    assert output_ids(decode) == want
    assert engines.get(model, Wire.TOKENSPEED, Role.ENCODE).core.handoff.store.rooms() == 0


def test_tokenspeed_tensors_in_shared_memory_give_the_same_ids_and_are_unlinked(engines: Engines) -> None:
    want = vllm_single_ids(engines, QWEN2_5)
    plan = WirePlan(shm=True, shm_min_bytes=0, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)
    lease = ShmLease()
    message = tokenspeed.build_generate_request(request(QWEN2_5, "shm"), Role.SINGLE, plan, lease)
    assert all(i.encoder_input.WhichOneof("payload") == "shm" for i in message.mm_inputs.items)
    assert len(lease.names) == 2 * 3  # per item: encoder input, grid, patch count
    assert output_ids(generate(engines.get(QWEN2_5, Wire.TOKENSPEED), Wire.TOKENSPEED, message)) == want
    assert lease.release() == 0  # the engine read every segment and unlinked it (mm_shm.py)


def test_the_decode_leg_of_each_wire_carries_no_pixels() -> None:
    prep = request(QWEN2_5, "identity")
    boot = Bootstrap("127.0.0.1", 1, 1)
    assert not sglang.build_generate_request(prep, Role.DECODE, boot).HasField("mm_inputs")
    items = tokenspeed.build_generate_request(prep, Role.DECODE, kv_bootstrap=boot).mm_inputs.items
    assert len(items) == 2 and not any(i.HasField("encoder_input") for i in items)


@pytest.mark.parametrize("wire", (Wire.VLLM, Wire.TOKENSPEED))
def test_seeded_sampling_of_two_choices_and_logprobs_survive_the_handoff(engines: Engines, wire: Wire) -> None:
    sampling = {"temperature": 1.5, "seed": 11, "n": 2, "logprobs": 3}
    prep = request(QWEN3, f"seeded-{wire}", **sampling)
    single = completes(generate(engines.get(QWEN3, wire), wire, single_message(wire, prep)))
    _, decode = run_pd(engines, QWEN3, wire, request(QWEN3, f"seeded-pd-{wire}", **sampling))
    paired = completes(decode)
    assert [c.index for c in paired] == [0, 1]
    assert [list(c.output_ids) for c in paired] == [list(c.output_ids) for c in single]
    assert list(paired[0].output_ids) != list(paired[1].output_ids)  # two draws, not one
    assert [list(c.output_logprobs.token_logprobs) for c in paired] == \
        [list(c.output_logprobs.token_logprobs) for c in single]


# ---- each wire's answer shape ------------------------------------------------------------------------

@pytest.mark.parametrize("wire", WIRES)
def test_a_streamed_decode_leg_streams_the_single_engines_ids(engines: Engines, wire: Wire) -> None:
    want = vllm_single_ids(engines, QWEN2_5)
    _, decode = run_pd(engines, QWEN2_5, wire, replace(request(QWEN2_5, f"stream-{wire}"), stream=True))
    chunks = [r.chunk for r in decode if r.HasField("chunk")]
    assert [len(c.token_ids) for c in chunks] == [1] * 8
    assert streamed_ids(decode) == want
    (done,) = completes(decode)
    # vLLM's Complete repeats every id; SGLang's and TokenSpeed's carry the finishing output's delta
    assert list(done.output_ids) == (want if wire is Wire.VLLM else want[-1:])
    assert done.completion_tokens == 8


@pytest.mark.parametrize("wire", WIRES)
def test_a_matched_stop_token_is_trimmed_on_tokenspeed_only(engines: Engines, wire: Wire) -> None:
    want = vllm_single_ids(engines, QWEN2_5)
    stop = want[3]
    prep = request(QWEN2_5, f"stop-{wire}", stop_token_ids=(stop,), ignore_eos=False)
    (done,) = completes(generate(engines.get(QWEN2_5, wire), wire, single_message(wire, prep)))
    kept = want[:want.index(stop) + 1]
    assert done.finish_reason == "stop" and done.matched_token_id == stop
    assert list(done.output_ids) == (kept[:-1] if wire is Wire.TOKENSPEED else kept)
    assert done.completion_tokens == len(kept)


# ---- labels and health -------------------------------------------------------------------------------

@pytest.mark.parametrize(("wire", "role"), [(Wire.VLLM, Role.SINGLE), (Wire.VLLM, Role.PREFILL),
                                            (Wire.VLLM, Role.DECODE), (Wire.SGLANG, Role.PREFILL),
                                            (Wire.SGLANG, Role.DECODE), (Wire.TOKENSPEED, Role.SINGLE),
                                            (Wire.TOKENSPEED, Role.DECODE), (Wire.TOKENSPEED, Role.ENCODE)])
def test_the_gateway_detects_each_engines_wire_and_role_without_a_flag(engines: Engines, wire: Wire,
                                                                       role: Role) -> None:
    engine = engines.get(QWEN2_5, wire, role)

    async def probe() -> object:
        client = WorkerClient(engine.address)
        try:
            return await client.probe(timeout_s=10)
        finally:
            await client.close()

    found = asyncio.run(probe())
    caps = found.capabilities  # type: ignore[attr-defined]
    assert found.wire is wire and caps is not None  # type: ignore[attr-defined]
    assert caps.role is role and caps.model_type == "qwen2_5_vl" and caps.supports_vision
    assert Modality.IMAGE in caps.modalities
    if wire is not Wire.SGLANG:  # SGLang's TensorData has no shm; the others report the namespace
        assert caps.shm_namespace == shm_namespace_id() and caps.encoder_dtype == "float32"
    if wire is Wire.TOKENSPEED:
        assert caps.modalities == {Modality.IMAGE, Modality.VIDEO}
        assert caps.labels["disaggregation_mode"] == ("null" if role is Role.SINGLE else role.value)
    if wire is Wire.SGLANG:
        assert caps.labels["disaggregation_mode"] == role.value and caps.labels["server_type"] == "grpc"
    if wire is Wire.VLLM:
        assert caps.labels["kv_role"] == {Role.SINGLE: "", Role.PREFILL: "kv_producer",
                                          Role.DECODE: "kv_consumer"}[role]


@pytest.mark.parametrize("wire", WIRES)
def test_the_standard_health_service_names_the_wires_engine_service(engines: Engines, wire: Wire) -> None:
    engine = engines.get(QWEN2_5, wire)
    channel = grpc.insecure_channel(engine.address)
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=HealthCheckRequest.SerializeToString,
                                response_deserializer=HealthCheckResponse.FromString)
    service = {Wire.VLLM: "vllm.grpc.engine.VllmEngine", Wire.SGLANG: "sglang.grpc.scheduler.SglangScheduler",
               Wire.TOKENSPEED: "tokenspeed.grpc.scheduler.TokenSpeedScheduler"}[wire]
    assert check(HealthCheckRequest(service=""), timeout=5).status == 1  # SERVING
    assert check(HealthCheckRequest(service=service), timeout=5).status == 1
    with pytest.raises(grpc.RpcError) as refused:
        check(HealthCheckRequest(service="vllm.grpc.engine.Nope"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


# ---- faults --------------------------------------------------------------------------------------------

def test_a_prefill_never_claimed_frees_its_kv_after_the_handoff_timeout(engines: Engines) -> None:
    prefill = engines.get(QWEN2_5, Wire.SGLANG, Role.PREFILL, handoff_timeout_s=1.0)
    decode = engines.get(QWEN2_5, Wire.SGLANG, Role.DECODE, handoff_wait_s=0.3)
    boot = Bootstrap("127.0.0.1", prefill.bootstrap_port, next_room())
    prep = request(QWEN2_5, "unclaimed")
    store = prefill.core.handoff.store
    expired = store.expired
    assert output_ids(generate(prefill, Wire.SGLANG, sglang.build_generate_request(prep, Role.PREFILL, boot)))
    rooms, nbytes = store.held()
    assert rooms == 1 and nbytes > 0  # the KV waits for its decode
    deadline = time.monotonic() + 5
    while store.held()[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.held() == (0, 0) and store.expired == expired + 1
    late = rpc_error(lambda: generate(decode, Wire.SGLANG, sglang.build_generate_request(prep, Role.DECODE, boot)))
    assert late.code() == grpc.StatusCode.UNAVAILABLE and f"room kv/{boot.room}" in late.details()


@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
def test_a_decode_for_an_unknown_room_is_refused_and_the_engine_keeps_serving(engines: Engines, wire: Wire) -> None:
    prefill = engines.get(QWEN2_5, wire, Role.PREFILL)
    decode = engines.get(QWEN2_5, wire, Role.DECODE, handoff_wait_s=0.3)
    prep = request(QWEN2_5, f"unknown-{wire}")
    boot = Bootstrap("127.0.0.1", prefill.bootstrap_port, next_room())
    build = (lambda b: sglang.build_generate_request(prep, Role.DECODE, b)) if wire is Wire.SGLANG else \
        (lambda b: tokenspeed.build_generate_request(prep, Role.DECODE, kv_bootstrap=b))
    started = time.monotonic()
    unknown = rpc_error(lambda: generate(decode, wire, build(boot)))
    assert unknown.code() == grpc.StatusCode.UNAVAILABLE
    assert "unknown_room" in unknown.details() and str(boot.room) in unknown.details()
    assert time.monotonic() - started < 5
    nobody = rpc_error(lambda: generate(decode, wire, build(Bootstrap("127.0.0.1", 1, boot.room))))
    assert nobody.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in nobody.details()
    # the same decode engine then serves a pair (prefill first: its room is published before the short wait)
    _, paired = run_pd(engines, QWEN2_5, wire, request(QWEN2_5, f"after-{wire}"), together=False, handoff_wait_s=0.3)
    assert output_ids(paired) == vllm_single_ids(engines, QWEN2_5)
    assert decode.core.counts() == (0, 0)


def test_a_decode_for_another_prompt_is_refused(engines: Engines) -> None:
    prefill = engines.get(QWEN2_5, Wire.TOKENSPEED, Role.PREFILL)
    decode = engines.get(QWEN2_5, Wire.TOKENSPEED, Role.DECODE)
    boot = Bootstrap("127.0.0.1", prefill.bootstrap_port, next_room())
    prep = request(QWEN2_5, "mismatch")
    other = replace(prep, input_ids=prep.input_ids[:-1] + (9707,))
    p = in_background(lambda: generate(prefill, Wire.TOKENSPEED,
                                       tokenspeed.build_generate_request(prep, Role.PREFILL, kv_bootstrap=boot)))
    refused = rpc_error(lambda: generate(decode, Wire.TOKENSPEED,
                                         tokenspeed.build_generate_request(other, Role.DECODE, kv_bootstrap=boot)))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "another prompt" in refused.details()
    assert output_ids(p.result(timeout=60))
    assert prefill.core.handoff.store.rooms() == 0  # the refused decode still claimed (and so freed) the KV


def test_a_failed_encoder_fails_its_prefill_which_fails_its_decode(engines: Engines) -> None:
    prep = request(QWEN2_5, "bad-encode")
    encodes, p_msg, d_msg, _ = epd_messages(engines, QWEN2_5, prep, handoff_timeout_s=0.5)
    bad = tokenspeed_encoder_pb2.EncodeRequest()
    bad.CopyFrom(encodes[0])
    bad.mm_inputs.items[0].placeholders[0].length -= 1  # one embedding too many for its placeholders
    prefill, decode = (engines.get(QWEN2_5, Wire.TOKENSPEED, Role.PREFILL),
                       engines.get(QWEN2_5, Wire.TOKENSPEED, Role.DECODE))
    d = in_background(lambda: rpc_error(lambda: generate(decode, Wire.TOKENSPEED, d_msg)))
    p = in_background(lambda: rpc_error(lambda: generate(prefill, Wire.TOKENSPEED, p_msg)))
    encode = engines.get(QWEN2_5, Wire.TOKENSPEED, Role.ENCODE, handoff_timeout_s=0.5)
    encoder = encoder_stub(encode)
    refused = rpc_error(lambda: encoder.Encode(bad, timeout=60))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "placeholder positions" in refused.details()
    assert encoder.Encode(encodes[1], timeout=60).accepted
    p_err, d_err = p.result(timeout=60), d.result(timeout=60)
    assert p_err.code() == grpc.StatusCode.INVALID_ARGUMENT and "placeholder positions" in p_err.details()
    assert d_err.code() == grpc.StatusCode.INVALID_ARGUMENT and "the prefill refused" in d_err.details()
    assert prefill.core.handoff.store.rooms() == 0
    # the second item's embeddings, never pulled by the failed prefill, expire with the handoff timeout
    deadline = time.monotonic() + 5
    while encode.core.handoff.store.rooms() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert encode.core.handoff.store.rooms() == 0


@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
@pytest.mark.parametrize("role", (Role.PREFILL, Role.DECODE))
def test_a_disaggregated_engine_refuses_a_request_without_bootstrap(engines: Engines, wire: Wire,
                                                                     role: Role) -> None:
    refused = rpc_error(lambda: generate(engines.get(QWEN2_5, wire, role), wire,
                                         single_message(wire, request(QWEN2_5, "no-boot"))))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "bootstrap" in refused.details()


def test_a_vllm_engine_refuses_a_pixel_less_leg_without_kv_transfer_params(engines: Engines) -> None:
    message = vllm_decode_message(request(QWEN2_5, "pixel-less"), "{}")
    message.ClearField("kv_transfer_params_json")
    refused = rpc_error(lambda: generate(engines.get(QWEN2_5, Wire.VLLM, Role.DECODE), Wire.VLLM, message))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "requires remote KV" in refused.details()


def test_an_encode_engine_takes_one_item_per_rpc_and_no_generate(engines: Engines) -> None:
    encode = engines.get(QWEN2_5, Wire.TOKENSPEED, Role.ENCODE)
    encodes, _, _, _ = epd_messages(engines, QWEN2_5, request(QWEN2_5, "two-items"))
    both = tokenspeed_encoder_pb2.EncodeRequest()
    both.CopyFrom(encodes[0])
    both.mm_inputs.items.append(encodes[1].mm_inputs.items[0])
    refused = rpc_error(lambda: encoder_stub(encode).Encode(both, timeout=10))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one mm item" in refused.details()
    no_generate = rpc_error(lambda: generate(encode, Wire.TOKENSPEED, tokenspeed_scheduler_pb2.GenerateRequest()))
    assert no_generate.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_the_handoff_carries_a_tree_bit_for_bit_once() -> None:
    import torch

    server = HandoffServer("127.0.0.1", 0, claim_timeout_s=5)
    try:
        tree: dict[str, Any] = {"a": (torch.randn(3, 4), torch.arange(5)), "c": torch.ByteTensor([1, 2, 3]),
                "b": [torch.randn(2).to(torch.bfloat16), None, 1.5, "x"]}
        server.store.reserve("kv/1")
        server.store.publish("kv/1", tree)
        back = fetch("127.0.0.1", server.port, "kv/1", wait_s=1)
        assert isinstance(back["a"], tuple) and isinstance(back["b"], list)
        assert torch.equal(back["a"][0], tree["a"][0]) and torch.equal(back["a"][1], tree["a"][1])
        assert torch.equal(back["b"][0], tree["b"][0]) and back["b"][0].dtype == torch.bfloat16
        assert back["b"][1:] == [None, 1.5, "x"] and torch.equal(back["c"], tree["c"])
        with pytest.raises(HandoffError) as again:  # one claim per room
            fetch("127.0.0.1", server.port, "kv/1", wait_s=0.1)
        assert again.value.reason == "unknown_room"
        server.store.reserve("kv/2")
        with pytest.raises(HandoffError) as pending:
            fetch("127.0.0.1", server.port, "kv/2", wait_s=0.1)
        assert pending.value.reason == "timeout"
        with pytest.raises(HandoffError) as twice:
            server.store.reserve("kv/2")
        assert twice.value.reason == "duplicate"
    finally:
        server.close()


def test_the_command_line_names_wire_role_and_handoff() -> None:
    from mmgate.refengine.config import parse_args

    config = parse_args(["--model", "m", "--wire", "tokenspeed", "--role", "encode", "--bootstrap-port", "8999",
                         "--handoff-timeout", "2.5", "--handoff-wait", "4"], environ={})
    assert (config.wire, config.role, config.bootstrap_port) == (Wire.TOKENSPEED, Role.ENCODE, 8999)
    assert (config.handoff_timeout_s, config.handoff_wait_s) == (2.5, 4.0)
    assert (parse_args(["--model", "m"], environ={}).wire, parse_args(["--model", "m"], environ={}).role) == \
        (Wire.VLLM, Role.SINGLE)
    with pytest.raises(SystemExit):  # the encoder service is TokenSpeed's
        parse_args(["--model", "m", "--wire", "sglang", "--role", "encode"], environ={})


# ---- the gateway's vLLM PD legs (engines/vllm.py) and a language-model-only engine -----------------------

def test_the_gateways_vllm_legs_pair_on_the_engines_and_carry_pixels_on_the_prefill_only(engines: Engines) -> None:
    import json

    from smg_grpc_proto.generated import vllm_engine_pb2

    from mmgate.engines import vllm
    from mmgate.engines.adapter import ADAPTERS
    from mmgate.transport.policy import INLINE_FLOAT32

    want = vllm_single_ids(engines, QWEN3)
    adapter = ADAPTERS[Wire.VLLM]
    prep = request(QWEN3, "gateway-legs", stop_token_ids=(1,), min_tokens=2)
    p_msg = vllm_engine_pb2.GenerateRequest.FromString(adapter.encode(prep, Role.PREFILL, INLINE_FLOAT32, None).data)
    # SMG's sanitize_sampling_for_prefill(1) + set_stream(false) + NIXL_PREFILL_KV_PARAMS
    s = p_msg.sampling_params
    assert (s.max_tokens, s.min_tokens, s.n, list(s.stop_token_ids), s.ignore_eos) == (1, 0, 1, [], True)
    assert json.loads(p_msg.kv_transfer_params_json) == {"do_remote_decode": True, "do_remote_prefill": False}
    assert p_msg.mm_inputs.HasField("pixel_values") and not p_msg.stream
    prefill = generate(engines.get(QWEN3, Wire.VLLM, Role.PREFILL), Wire.VLLM, p_msg)
    params = completes(prefill)[-1].kv_transfer_params_json
    assert json.loads(params)["do_remote_prefill"] is True
    prep = request(QWEN3, "gateway-legs")
    d_msg = vllm_engine_pb2.GenerateRequest.FromString(
        adapter.encode(prep, Role.DECODE, INLINE_FLOAT32, None, kv_transfer_params=params).data)
    assert d_msg.kv_transfer_params_json == params and d_msg.sampling_params.max_tokens == 8
    # identity only: hashes, placeholders, the grids; no pixels, nothing in shared memory
    mm = d_msg.mm_inputs
    assert not mm.HasField("pixel_values") and set(mm.model_specific_tensors) == {"image_grid_thw", "patches_per_image"}
    assert list(mm.mm_hashes) == list(prep.batches[0].mm_hashes) and len(mm.mm_placeholders) == 2
    assert all(t.WhichOneof("payload") != "shm" for t in mm.model_specific_tensors.values())
    assert "pixel_values" not in mm.flat_keys and "pixel_values" not in mm.batched_keys
    assert output_ids(generate(engines.get(QWEN3, Wire.VLLM, Role.DECODE), Wire.VLLM, d_msg)) == want
    # a language-model-only decode worker gets the hashes and placeholders alone
    lm = vllm_engine_pb2.GenerateRequest.FromString(
        adapter.encode(prep, Role.DECODE, INLINE_FLOAT32, None, kv_transfer_params=params,
                       language_model_only=True).data).mm_inputs
    assert not lm.HasField("pixel_values") and not lm.model_specific_tensors and list(lm.mm_hashes) == list(mm.mm_hashes)
    assert vllm.PREFILL_KV_TRANSFER_PARAMS == '{"do_remote_decode":true,"do_remote_prefill":false}'


@pytest.mark.parametrize("wire", WIRES)
def test_a_language_model_only_engine_reports_it_and_refuses_media_tensors(engines: Engines, wire: Wire) -> None:
    engine = engines.get(QWEN2_5, wire, Role.SINGLE, language_model_only=True)

    async def probe() -> object:
        client = WorkerClient(engine.address)
        try:
            return await client.probe(timeout_s=10)
        finally:
            await client.close()

    caps = asyncio.run(probe()).capabilities  # type: ignore[attr-defined]
    assert caps.language_model_only and caps.role is Role.SINGLE
    if wire is Wire.SGLANG:
        assert caps.labels["language_only"] == "true"
    else:
        assert not caps.supports_vision and not caps.modalities
    refused = rpc_error(lambda: generate(engine, wire, single_message(wire, request(QWEN2_5, f"lm-only-{wire}"))))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "language model only" in refused.details()


def test_the_command_line_takes_language_model_only() -> None:
    from mmgate.refengine.config import parse_args

    assert parse_args(["--model", "m", "--role", "decode", "--language-model-only"], environ={}).language_model_only
    assert not parse_args(["--model", "m"], environ={}).language_model_only
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--wire", "tokenspeed", "--role", "encode", "--language-model-only"], environ={})
