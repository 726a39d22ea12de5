"""The TokenSpeed wire against a recording fake of the real servicer (``tokenspeed_fake``).

Requests are prepared by mmgate's own pipeline (``tests/video/video_support.py``: torchvision
image backend, pyav clips, stored orientation) and compared with the transformers 5.24
reference: ``AutoProcessor.from_pretrained(bundle)``, ``apply_chat_template(...,
add_generation_prompt=True, tokenize=False)``, then ``processor(text=[prompt], images=...,
videos=..., video_metadata=...)`` on the same bytes.  What the fake decodes from the items
(each item's own slice, concatenated back in prompt order) must equal the processor's tensors
bit for bit; placeholders, hashes, dtypes, payload kinds and the PD / EPD fields follow
docs/engines-tokenspeed.md.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import os
import warnings
from functools import cache
from pathlib import Path

import blake3
import grpc
import numpy as np
import pytest
import torch
from PIL import Image
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from mmgate.request.parse import parse_chat_request
from mmgate.engines.adapter import TokenSpeedAdapter
from mmgate.engines.base import Bootstrap, Role
from mmgate.engines.tokenspeed import (
    build_encode_request,
    SPAN_WHEN_NO_RUN,
    build_generate_request,
    events,
    materialize,
)
from mmgate.errors import ErrorCode, GatewayError
from mmgate.engines.wire_values import embedding_runs
from mmgate.config.settings import TensorTransport, TransportSettings, parse_settings, tokenspeed_encoder_dtypes
from mmgate.transport.dtypes import EncoderDtype
from mmgate.transport.policy import INLINE_FLOAT32, wire_plan
from mmgate.transport.shm import ShmLease
from mmgate.types import (
    Constraint,
    ConstraintKind,
    Modality,
    PendingTensor,
    PlaceholderRange,
    PreparedRequest,
    SamplingParams,
)
from tests.engines.tokenspeed_fake import FakeState, FakeTokenSpeedWorker, Generate
from tests.video.video_support import (
    QWEN2_5,
    QWEN3,
    ClipSpec,
    load,
    make_clip,
    pipeline,
    processor,
)

KV = Bootstrap(host="10.0.0.7", port=8998, room=(1 << 62) + 17)


# --- fixtures and helpers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker() -> FakeTokenSpeedWorker:
    fake = FakeTokenSpeedWorker(FakeState(encoder_dtype="bfloat16"))
    yield fake
    fake.stop()


@pytest.fixture(autouse=True)
def no_leftover_segments() -> None:
    yield
    assert own_segments() == set(), "a shared-memory segment outlived its request"


def own_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"mmgate-{os.getpid()}-")}


def png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(h * 7 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def video_part(path: Path) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(
        path.read_bytes()).decode()}}


def prepare(model: str, parts: list[dict], text: str, defer: bool = False) -> PreparedRequest:
    body = {"model": model, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    return asyncio.run(pipeline(model).prepare(parse_chat_request(json.dumps(body).encode()), request_id="req-1",
                                                defer_pixels=defer))


def reference(model: str, kinds: list[str], images: list[bytes], clips: list[Path], text: str) -> dict[str, np.ndarray]:
    proc = processor(model)
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": text}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    kwargs: dict = {}
    if images:
        kwargs["images"] = [Image.open(io.BytesIO(b)) for b in images]
    if clips:
        loaded = [load(c) for c in clips]
        kwargs.update(videos=[f for f, _ in loaded], video_metadata=[copy.deepcopy(m) for _, m in loaded],
                      videos_kwargs={"cap_pixels_per_frame": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(proc(text=[prompt], return_tensors="np", **kwargs))


IMAGES = (png(90, 130), png(40, 52))


@cache
def image_case(model: str) -> tuple[PreparedRequest, dict[str, np.ndarray]]:
    """Two images of different sizes (a large and a small item), then text."""
    prepared = prepare(model, [image_part(b) for b in IMAGES], "Compare them.")
    return prepared, reference(model, ["image", "image"], list(IMAGES), [], "Compare them.")


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("ts_clips")
    return (make_clip(ClipSpec("ts_a", 5, 4, 64, 48), folder),
            make_clip(ClipSpec("ts_b", 9, 6, 70, 46, codec="mpeg4"), folder))


def send(fake: FakeTokenSpeedWorker, msg: pb.GenerateRequest) -> tuple[Generate, list[pb.GenerateResponse]]:
    responses = list(fake.scheduler.Generate(msg))
    return fake.state.generates[-1], responses


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 (the servicer's and the model's conversion), as uint16 bits."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def token_positions(ids: np.ndarray, token: int) -> set[int]:
    return {i for i, t in enumerate(ids.tolist()) if t == token}


def covered(items: list) -> set[int]:
    return {p for it in items for off, n in it.placeholders for p in range(off, off + n)}


def assert_identity(got: Generate, prepared: PreparedRequest, ref: dict[str, np.ndarray]) -> None:
    """Ids, order, hashes and placeholders of every item (what every leg carries)."""
    assert got.input_ids == ref["input_ids"][0].tolist() == list(prepared.input_ids)
    assert got.items is not None
    order = sorted(((b, i) for b in prepared.batches for i in range(len(b.placeholders))),
                   key=lambda bi: bi[0].placeholders[bi[1]].offset)
    assert [it.modality for it in got.items] == [b.modality.value.upper() for b, _ in order]
    for it, (batch, i) in zip(got.items, order):
        assert it.content_hash == blake3.blake3(batch.mm_hashes[i].encode()).digest()
        assert it.hash == int.from_bytes(it.content_hash[:8], "little")
        assert it.placeholder_token_id == batch.placeholder_token_id
        span = batch.placeholders[i]
        assert all(span.offset <= off and off + n <= span.offset + span.length for off, n in it.placeholders)
        assert all(got.input_ids[p] == batch.placeholder_token_id for off, n in it.placeholders
                   for p in range(off, off + n))
    starts = [it.placeholders[0][0] for it in got.items]
    assert starts == sorted(starts)
    proc = processor(prepared.model)
    for modality, token in (("IMAGE", proc.image_token_id), ("VIDEO", proc.video_token_id)):
        mine = [it for it in got.items if it.modality == modality]
        assert covered(mine) == (token_positions(ref["input_ids"][0], token) if mine else set())


# --- single worker: ids and every tensor equal the processor's ---------------------------------------

@pytest.mark.parametrize("model", [QWEN2_5, QWEN3])
def test_image_items_carry_their_own_slices_of_the_processor_tensors(worker, model: str) -> None:
    prepared, ref = image_case(model)
    got, _ = send(worker, build_generate_request(prepared, Role.SINGLE))

    assert_identity(got, prepared, ref)
    assert got.im_token_id == processor(model).image_token_id and got.video_token_id is None
    assert got.kv_bootstrap is None and not got.has_encode_bootstrap
    items = got.items
    assert [(it.encoder_dtype, it.encoder_payload) for it in items] == [("float32", "inline")] * 2
    assert np.array_equal(np.concatenate([it.encoder_input for it in items]), ref["pixel_values"])
    assert np.array_equal(np.concatenate([it.tensors["image_grid_thw"] for it in items]), ref["image_grid_thw"])
    for it in items:
        rows = int(np.prod(it.tensors["image_grid_thw"]))
        assert it.encoder_input.shape[0] == rows and it.tensors["patches_per_image"].tolist() == [rows]
        assert it.tensor_dtypes == {"image_grid_thw": "int64", "patches_per_image": "int64"}
        # Qwen merges 2x2 patches into one embedding: one run of rows / 4 image tokens.
        assert [n for _, n in it.placeholders] == [rows // 4]


def test_qwen3_video_items_follow_a_bfloat16_label_and_place_each_frame_run(worker, clip_files) -> None:
    prepared = prepare(QWEN3, [video_part(c) for c in clip_files], "What happens?")
    ref = reference(QWEN3, ["video", "video"], [], list(clip_files), "What happens?")
    assert worker.scheduler.HealthCheck(pb.HealthCheckRequest()).healthy
    labels = worker.labels()
    assert labels["multimodal_encoder_dtype"] == "bfloat16"
    plan = wire_plan(TransportSettings(), labels)
    got, _ = send(worker, build_generate_request(prepared, Role.SINGLE, plan))

    assert_identity(got, prepared, ref)
    assert got.video_token_id == processor(QWEN3).video_token_id and got.im_token_id is None
    items = got.items
    assert {(it.encoder_dtype, it.encoder_payload) for it in items} == {("bfloat16", "inline")}
    assert np.array_equal(np.concatenate([it.encoder_input for it in items]), bf16_bits(ref["pixel_values_videos"]))
    assert np.array_equal(np.concatenate([it.tensors["video_grid_thw"] for it in items]), ref["video_grid_thw"])
    for it in items:
        t, h, w = it.tensors["video_grid_thw"][0].tolist()
        assert it.tensors["patches_per_video"].tolist() == [t * h * w] == [it.encoder_input.shape[0]]
        # Qwen3-VL: one run per temporal patch, between that frame's timestamp and <|vision_end|>.
        assert [n for _, n in it.placeholders] == [h * w // 4] * t
        assert it.tensor_dtypes["video_grid_thw"] == "int64"


def test_env_overrides_pick_each_modality_dtype_and_items_follow_prompt_order(worker, clip_files) -> None:
    small, large = IMAGES[1], IMAGES[0]
    parts = [image_part(small), video_part(clip_files[0]), image_part(large)]
    prepared = prepare(QWEN3, parts, "Order?")
    ref = reference(QWEN3, ["image", "video", "image"], [small, large], [clip_files[0]], "Order?")
    settings = TransportSettings(tokenspeed_encoder_dtypes=tokenspeed_encoder_dtypes(
        {"SMG_TOKENSPEED_ENCODER_INPUT_DTYPE": "float16", "SMG_TOKENSPEED_IMAGE_ENCODER_INPUT_DTYPE": "torch.float32"}))
    plan = TokenSpeedAdapter().plan(settings, worker.labels())  # the label says bfloat16; the overrides win
    assert dict(plan.modality_encoder_dtypes) == {Modality.IMAGE: EncoderDtype.FLOAT32,
                                                  Modality.VIDEO: EncoderDtype.FLOAT16,
                                                  Modality.AUDIO: EncoderDtype.FLOAT16}
    got, _ = send(worker, build_generate_request(prepared, Role.SINGLE, plan))

    assert_identity(got, prepared, ref)
    assert [it.modality for it in got.items] == ["IMAGE", "VIDEO", "IMAGE"]
    first, clip, last = got.items
    assert (first.encoder_dtype, clip.encoder_dtype, last.encoder_dtype) == ("float32", "float16", "float32")
    assert np.array_equal(np.concatenate([first.encoder_input, last.encoder_input]), ref["pixel_values"])
    assert np.array_equal(clip.encoder_input, ref["pixel_values_videos"].astype(np.float16))
    assert np.array_equal(np.concatenate([first.tensors["image_grid_thw"], last.tensors["image_grid_thw"]]),
                          ref["image_grid_thw"])
    assert np.array_equal(clip.tensors["video_grid_thw"], ref["video_grid_thw"])


def test_an_invalid_dtype_override_names_its_variable() -> None:
    with pytest.raises(ValueError, match="SMG_TOKENSPEED_VIDEO_ENCODER_INPUT_DTYPE"):
        tokenspeed_encoder_dtypes({"SMG_TOKENSPEED_VIDEO_ENCODER_INPUT_DTYPE": "int8"})
    assert tokenspeed_encoder_dtypes({}) == ()


# --- shared memory ------------------------------------------------------------------------------------

def _shm_plan(worker, prepared: PreparedRequest):
    """``auto`` transport (the fake shares our /dev/shm) with the threshold between the two items' sizes."""
    sizes = sorted(p.primary_values * 4 for p in prepared.plans)
    return wire_plan(TransportSettings(tensor_transport=TensorTransport.AUTO, shm_min_bytes=sum(sizes) // 2,
                                       encoder_dtype="float32"), worker.labels())


def test_shm_is_chosen_per_item_tensor_and_the_engine_unlinks_what_it_reads(worker) -> None:
    prepared, ref = image_case(QWEN2_5)
    plan = _shm_plan(worker, prepared)
    assert plan.shm
    with ShmLease() as lease:
        msg = build_generate_request(prepared, Role.SINGLE, plan, lease)
        assert len(lease.names) == 1 and own_segments() == set(lease.names)
        got, _ = send(worker, msg)
        assert own_segments() == set()  # read and unlinked by the engine side
        assert lease.release() == 0
    large, small = got.items
    assert (large.encoder_payload, small.encoder_payload) == ("shm", "inline")
    assert {p for it in got.items for p in it.tensor_payloads.values()} == {"inline"}
    assert np.array_equal(np.concatenate([large.encoder_input, small.encoder_input]), ref["pixel_values"])


def test_a_request_that_never_reaches_the_engine_leaves_no_segment(worker) -> None:
    prepared, _ = image_case(QWEN3)
    lease = ShmLease()
    build_generate_request(prepared, Role.SINGLE, _shm_plan(worker, prepared), lease)
    assert len(own_segments()) == 1
    assert lease.release() == 1 and own_segments() == set()


# --- prefill / decode ----------------------------------------------------------------------------------

def _carries_no_shm(msg: pb.GenerateRequest) -> bool:
    return all(td.WhichOneof("payload") != "shm" for it in msg.mm_inputs.items
               for td in [*it.model_specific_tensors.values(), *([it.encoder_input] if it.HasField("encoder_input")
                                                                 else [])])


@pytest.mark.parametrize("model", [QWEN2_5, QWEN3])
def test_prefill_gets_pixels_and_decode_only_identity_with_one_bootstrap(worker, model: str) -> None:
    prepared, ref = image_case(model)
    plan = _shm_plan(worker, prepared)
    plan = type(plan)(shm=True, shm_min_bytes=0, encoder_dtype=plan.encoder_dtype,
                      device_normalize=False)  # every tensor would go through shm where allowed
    with ShmLease() as lease:
        prefill_msg = build_generate_request(prepared, Role.PREFILL, plan, lease, kv_bootstrap=KV)
        decode_msg = build_generate_request(prepared, Role.DECODE, plan, lease, kv_bootstrap=KV)
        assert _carries_no_shm(decode_msg) and not _carries_no_shm(prefill_msg)
        prefill, _ = send(worker, prefill_msg)
        decode, _ = send(worker, decode_msg)
    assert prefill.kv_bootstrap == decode.kv_bootstrap == (KV.host, KV.port, KV.room)
    assert_identity(prefill, prepared, ref)
    assert_identity(decode, prepared, ref)
    assert np.array_equal(np.concatenate([it.encoder_input for it in prefill.items]), ref["pixel_values"])
    assert all(it.encoder_input is None and it.encoder_payload is None for it in decode.items)
    assert {p for it in decode.items for p in it.tensor_payloads.values()} == {"inline"}
    for p, d in zip(prefill.items, decode.items):
        assert (p.placeholders, p.content_hash, p.placeholder_token_id) == (d.placeholders, d.content_hash,
                                                                            d.placeholder_token_id)
        assert p.tensors.keys() == d.tensors.keys()
        assert all(np.array_equal(p.tensors[k], d.tensors[k]) for k in p.tensors)


def test_legs_are_refused_against_their_contract() -> None:
    prepared, _ = image_case(QWEN2_5)
    for role, kv, boots in ((Role.SINGLE, KV, None), (Role.PREFILL, None, None), (Role.DECODE, None, None),
                            (Role.ENCODE, None, None), (Role.DECODE, KV, [KV, KV]), (Role.PREFILL, KV, [KV])):
        with pytest.raises(GatewayError) as err:
            build_generate_request(prepared, role, kv_bootstrap=kv, encode_bootstrap=boots)
        assert err.value.code is ErrorCode.INTERNAL_ERROR, (role, kv, boots)


# --- encode disaggregation ---------------------------------------------------------------------------

def test_epd_prefill_names_each_items_room_and_each_item_gets_its_own_encode(worker) -> None:
    prepared, ref = image_case(QWEN3)
    second = FakeTokenSpeedWorker(FakeState(encoder_dtype="bfloat16"))  # items fan out over two encode workers
    try:
        boots = [Bootstrap("10.0.0.5", 9001, 1234567890123), Bootstrap("10.0.0.6", 9002, (1 << 63) - 1)]
        plan = _shm_plan(worker, prepared)
        with ShmLease() as lease:
            msg = build_generate_request(prepared, Role.PREFILL, plan, lease, kv_bootstrap=KV, encode_bootstrap=boots)
            assert all(not it.HasField("encoder_input") for it in msg.mm_inputs.items)
            prefill, _ = send(worker, msg)
            for i, (boot, encoder) in enumerate(zip(boots, (worker, second))):
                accepted = encoder.encoder.Encode(build_encode_request(prepared, i, boot, plan, lease))
                assert accepted.accepted
            assert own_segments() == set() and lease.release() == 0
        assert_identity(prefill, prepared, ref)
        assert prefill.has_encode_bootstrap and prefill.kv_bootstrap == (KV.host, KV.port, KV.room)
        assert all(it.encoder_input is None for it in prefill.items)
        assert [it.encode_handshake for it in prefill.items] == [
            {"bootstrap_host": b.host, "bootstrap_port": b.port, "bootstrap_room": b.room} for b in boots]
        encodes = [*worker.state.encodes[-1:], *second.state.encodes]
        assert [e.room for e in encodes] == [b.room for b in boots]
        assert len({e.request_id for e in encodes}) == 2
        for e, p in zip(encodes, prefill.items):
            assert (e.item.placeholders, e.item.content_hash) == (p.placeholders, p.content_hash)
            assert e.item.encoder_payload == ("shm" if e.item.encoder_input.nbytes >= plan.shm_min_bytes else "inline")
        assert np.array_equal(np.concatenate([e.item.encoder_input for e in encodes]), ref["pixel_values"])
        assert np.array_equal(np.concatenate([e.item.tensors["image_grid_thw"] for e in encodes]),
                              ref["image_grid_thw"])
    finally:
        second.stop()


def test_the_encoder_refuses_an_item_without_encoder_input(worker) -> None:
    """The fake is as strict as ``encoder_servicer.py``: an identity-only item is not encodable."""
    from smg_grpc_proto.generated import tokenspeed_encoder_pb2

    prepared, _ = image_case(QWEN2_5)
    decode_item = build_generate_request(prepared, Role.DECODE, kv_bootstrap=KV).mm_inputs.items[0]
    bad = tokenspeed_encoder_pb2.EncodeRequest(request_id="x", mm_inputs=pb.MultimodalInputs(items=[decode_item]),
                                               items=[tokenspeed_encoder_pb2.EncodeItemAssignment(bootstrap_room=1)])
    with pytest.raises(grpc.RpcError) as err:
        worker.encoder.Encode(bad)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


# --- deferred pixels -----------------------------------------------------------------------------------

def test_pending_pixels_are_materialized_for_pixel_legs_and_not_needed_for_decode() -> None:
    parts = [image_part(b) for b in IMAGES]
    deferred = prepare(QWEN2_5, parts, "Compare them.", defer=True)
    assert isinstance(deferred.batches[0].tensors["pixel_values"], PendingTensor)
    with pytest.raises(GatewayError) as err:
        build_generate_request(deferred, Role.SINGLE)
    assert err.value.code is ErrorCode.INTERNAL_ERROR
    plain, _ = image_case(QWEN2_5)
    assert build_generate_request(deferred, Role.DECODE, kv_bootstrap=KV) == \
        build_generate_request(plain, Role.DECODE, kv_bootstrap=KV)
    assert build_generate_request(asyncio.run(materialize(deferred)), Role.SINGLE) == \
        build_generate_request(plain, Role.SINGLE)


# --- text, sampling, responses -----------------------------------------------------------------------

def text_request(sampling: SamplingParams, stream: bool = False) -> PreparedRequest:
    return PreparedRequest(request_id="t-1", model="m", prompt_text="hi", input_ids=(9707, 11, 1879), batches=(),
                           sampling=sampling, stream=stream)


def test_sampling_fields_reach_the_engine_as_its_servicer_reads_them(worker) -> None:
    sampling = SamplingParams(max_tokens=7, temperature=0.0, top_p=0.9, top_k=0, seed=2**40, stop=("END",),
                              stop_token_ids=(151643,), ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.25,
                              n=2, min_p=0.125, repetition_penalty=1.5, min_tokens=2, logit_bias=((5, 1.5),),
                              logprobs=3, include_stop_str_in_output=True, skip_special_tokens=False,
                              constraint=Constraint(ConstraintKind.REGEX, "[a-z]+"))
    got, _ = send(worker, build_generate_request(text_request(sampling), Role.SINGLE))
    assert got.items is None and got.return_logprob and got.top_logprobs_num == 3
    assert got.sampling == {
        "max_new_tokens": 7, "temperature": 0.0, "top_p": pytest.approx(0.9), "top_k": -1, "min_p": 0.125,
        "frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.5, "seed": 2**40,
        "min_new_tokens": 2, "stop": ["END"], "stop_token_ids": [151643], "skip_special_tokens": False,
        "spaces_between_special_tokens": True, "ignore_eos": True, "no_stop_trim": True, "n": 2,
        "logit_bias": {"5": 1.5}, "regex": "[a-z]+"}
    default, _ = send(worker, build_generate_request(text_request(SamplingParams()), Role.SINGLE))
    assert "temperature" not in default.sampling and "seed" not in default.sampling
    assert not default.return_logprob


@pytest.mark.parametrize(("constraint", "expected"), [
    (Constraint(ConstraintKind.JSON_OBJECT, ""), {"json_schema": '{"type": "object"}'}),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "string"}'), {"json_schema": '{"type": "string"}'}),
    (Constraint(ConstraintKind.GRAMMAR, 'root ::= "x"'), {"ebnf": 'root ::= "x"'}),
    (Constraint(ConstraintKind.CHOICE, '["yes", "a \\"b\\"\\n"]'), {"ebnf": 'root ::= "yes" | "a \\"b\\"\\n"'}),
    (Constraint(ConstraintKind.STRUCTURAL_TAG, '{"type": "tag"}'), {"structural_tag": '{"type": "tag"}'}),
])
def test_each_constraint_kind_lands_in_its_oneof_case(worker, constraint: Constraint, expected: dict) -> None:
    got, _ = send(worker, build_generate_request(text_request(SamplingParams(constraint=constraint)), Role.SINGLE))
    keys = {"json_schema", "regex", "ebnf", "structural_tag"}
    assert {k: v for k, v in got.sampling.items() if k in keys} == expected


@pytest.mark.parametrize(("field", "sampling"), [
    ("seed", SamplingParams(seed=-1)), ("top_k", SamplingParams(top_k=2**31)),
    ("max_tokens", SamplingParams(max_tokens=2**32)), ("stop_token_ids", SamplingParams(stop_token_ids=(-3,))),
    ("n", SamplingParams(n=2**32)), ("logprobs", SamplingParams(logprobs=2**31)),
])
def test_values_the_wire_cannot_carry_are_refused_naming_the_field(field: str, sampling: SamplingParams) -> None:
    with pytest.raises(GatewayError) as err:
        build_generate_request(text_request(sampling), Role.SINGLE)
    assert (err.value.code, err.value.param) == (ErrorCode.INVALID_REQUEST, field)


def test_a_text_only_request_has_no_mm_inputs_and_no_encode_leg() -> None:
    req = text_request(SamplingParams())
    msg = build_generate_request(req, Role.PREFILL, kv_bootstrap=KV, encode_bootstrap=[])
    assert not msg.HasField("mm_inputs") and not msg.HasField("encode_bootstrap_info")
    with pytest.raises(GatewayError):
        build_generate_request(req, Role.PREFILL, kv_bootstrap=KV, encode_bootstrap=[KV])


def test_streamed_and_whole_answers_become_neutral_events(worker) -> None:
    _, responses = send(worker, build_generate_request(text_request(SamplingParams(logprobs=1), stream=True),
                                                       Role.SINGLE))
    evs = [e for r in responses for e in events(r)]
    assert [(e.kind, e.token_ids) for e in evs] == [("chunk", (9707,)), ("chunk", (11,)), ("complete", (9707, 11))]
    done = evs[-1]
    assert (done.finish_reason, done.matched_token_id, done.matched_stop_str) == ("stop", 151645, None)
    assert (done.prompt_tokens, done.completion_tokens) == (3, 3)
    assert done.logprobs is not None and done.logprobs.token_ids == (9707, 11)
    assert done.logprobs.token_logprobs == (-0.5, -0.5) and done.logprobs.top_logprobs[1].token_ids == (11,)
    assert evs[0].logprobs is None
    _, whole = send(worker, build_generate_request(text_request(SamplingParams()), Role.SINGLE))
    assert [e.kind for r in whole for e in events(r)] == ["complete"]
    stopped = pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[1], finish_reason="stop", index=1,
                                                               matched_stop_str="END"))
    (event,) = events(stopped)
    assert (event.index, event.matched_token_id, event.matched_stop_str) == (1, None, "END")
    assert events(pb.GenerateResponse()) == []


def test_embedding_runs_split_a_span_at_non_embedding_tokens() -> None:
    ids = [1, 8, 5, 5, 9, 8, 5, 9]
    def runs(span: PlaceholderRange) -> tuple[PlaceholderRange, ...]:
        return embedding_runs(ids, 5, (span,), whole_span_when_empty=SPAN_WHEN_NO_RUN)

    assert runs(PlaceholderRange(1, 7)) == (PlaceholderRange(2, 2), PlaceholderRange(6, 1))
    assert runs(PlaceholderRange(0, 2)) == (PlaceholderRange(0, 2),)  # none inside: the span


def test_inline_plan_is_the_default() -> None:
    prepared, _ = image_case(QWEN2_5)
    assert build_generate_request(prepared, Role.SINGLE) == build_generate_request(prepared, Role.SINGLE,
                                                                                   INLINE_FLOAT32, ShmLease())


def test_the_overrides_reach_the_wire_from_serve_settings_through_the_adapter_plan(worker, clip_files) -> None:
    """``mmgate serve`` reads the SMG variables once (``parse_settings``); the TokenSpeed adapter's plan
    carries them, so the item dtypes follow them without the caller passing anything."""
    parts = [image_part(IMAGES[1]), video_part(clip_files[0])]
    prepared = prepare(QWEN3, parts, "Which?")
    settings = parse_settings(["--model", "m"], {"SMG_TOKENSPEED_ENCODER_INPUT_DTYPE": "bfloat16",
                                                 "SMG_TOKENSPEED_VIDEO_ENCODER_INPUT_DTYPE": "float16"})
    assert settings.transport.tokenspeed_encoder_dtypes == (("image", "bfloat16"), ("video", "float16"),
                                                            ("audio", "bfloat16"))
    plan = TokenSpeedAdapter().plan(settings.transport, {"multimodal_encoder_dtype": "float32"})
    got, _ = send(worker, build_generate_request(prepared, Role.SINGLE, plan))
    assert [(it.modality, it.encoder_dtype) for it in got.items] == [("IMAGE", "bfloat16"), ("VIDEO", "float16")]
    plain = TokenSpeedAdapter().plan(parse_settings(["--model", "m"], {}).transport, {"multimodal_encoder_dtype": "float32"})
    got, _ = send(worker, build_generate_request(prepared, Role.SINGLE, plain))
    assert [it.encoder_dtype for it in got.items] == ["float32", "float32"]
    with pytest.raises(SystemExit, match="SMG_TOKENSPEED_IMAGE_ENCODER_INPUT_DTYPE"):
        parse_settings(["--model", "m"], {"SMG_TOKENSPEED_IMAGE_ENCODER_INPUT_DTYPE": "int4"})
