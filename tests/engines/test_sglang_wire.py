"""The SGLang wire, end to end through a real gRPC channel to a recording scheduler.

The recording fake (``tests/engines/sglang_fake.py``) reads each ``GenerateRequest`` as the SMG
servicer does (smg-grpc-servicer 0.14.1 ``sglang/servicer.py`` ``_convert_generate_request``,
``_parse_mm_inputs``, ``_convert_sampling_params``; ``tensor_wire.tensor_from_parts``).  The
requests are prepared by mmgate's own :class:`~mmgate.pipeline.prepare.Pipeline`; the expected ids and
tensors are the transformers 5.24 processor's (``AutoProcessor`` of the bundle, torchvision
backend, on the chat-templated prompt: ``tests/worker_mode/reference.py`` ``reference_inputs``
for images, ``tests/video/video_support.py`` ``reference`` for the clip).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from mmgate.observe import metrics
from mmgate.request.parse import parse_chat_request
from mmgate.engines.base import Bootstrap, Role
from mmgate.engines.sglang import (
    JSON_OBJECT_SCHEMA,
    SPAN_WHEN_NO_RUN,
    build_generate_request,
    encode_generate_request,
    events,
    map_rpc_error,
)
from mmgate.engines.wire_values import embedding_runs
from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport.dtypes import EncoderDtype
from mmgate.types import (
    Constraint,
    ConstraintKind,
    PendingTensor,
    PreparedRequest,
    SamplingParams,
)
from tests.conftest import bundle_dir
from tests.engines.sglang_fake import ANSWER, FakeWorker, Received, start
from tests.video.video_support import (
    QWEN2_5,
    QWEN3,
    ClipSpec,
    make_clip,
    pipeline,
    processor,
    video_part,
)
from tests.video.video_support import reference as video_reference
from tests.worker_mode.reference import Conversation, reference_inputs

TEXT = "Compare the pictures."
SIZES = ((50, 70), (90, 40))  # (height, width) of the two images
BOOT = Bootstrap(host="10.0.0.7", port=8998, room=0)  # room 0 is a room (the servicer keeps 0)


@pytest.fixture(scope="module")
def worker() -> Iterator[FakeWorker]:
    fake = start()
    yield fake
    fake.close()


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


IMAGES = tuple(png(h, w, i) for i, (h, w) in enumerate(SIZES))


def _prepare(model: str, parts: list[dict], request_id: str, defer: bool = False, text: str = TEXT) -> PreparedRequest:
    body = {"model": model, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    return asyncio.run(pipeline(model).prepare(parse_chat_request(json.dumps(body).encode()), request_id,
                                               defer_pixels=defer))


def image_parts() -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
            for b in IMAGES]


def image_reference(model: str) -> dict[str, np.ndarray]:
    conversation = Conversation()
    for data in IMAGES:
        conversation.image(data, "image/png")
    return reference_inputs(bundle_dir(model), conversation.say(TEXT))


def runs_of(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of ``token`` in ``ids``, written out plainly."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def received(worker: FakeWorker, request_id: str) -> Received:
    return next(r for r in worker.scheduler.received if r.message.request_id == request_id)


def same_bytes(got: torch.Tensor, want: np.ndarray) -> bool:
    return tuple(got.shape) == want.shape and got.numpy().tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("model", [QWEN2_5, QWEN3])
def test_image_request_reaches_the_scheduler_exactly_as_the_processor_made_it(worker: FakeWorker, model: str) -> None:
    rid = f"img-{model}"
    prepared = _prepare(model, image_parts(), rid)
    ref = image_reference(model)
    msg = build_generate_request(prepared, Role.SINGLE)
    answer = [e for resp in worker.stub.Generate(msg) for e in events(resp)]
    got = received(worker, rid)

    ids = ref["input_ids"][0].tolist()
    assert got.input_ids == ids
    assert got.mm is not None and got.mm.modality == "IMAGE"
    assert got.mm.feature.dtype == torch.float32 and same_bytes(got.mm.feature, ref["pixel_values"])
    assert set(got.mm.model_specific_data) == {"image_grid_thw"}  # patches_per_image (vLLM's sizes helper) stays home
    grid = got.mm.model_specific_data["image_grid_thw"]
    assert grid.dtype == torch.int64 and same_bytes(grid, ref["image_grid_thw"])
    image_token = processor(model).image_token_id
    assert got.mm.im_token_id == image_token
    # offsets: the embedding runs, one per image, and exactly the rows the vision tower emits (merge 2x2)
    runs = runs_of(ids, image_token)
    assert got.mm.offsets == [(o, o + n - 1) for o, n in runs]
    assert [n for _, n in runs] == [int(t * h * w) // 4 for t, h, w in ref["image_grid_thw"]]
    # no content hash, no original bytes, no URLs: the scheduler hashes the feature itself
    assert list(msg.mm_inputs.modalities) == ["image"]
    assert not msg.mm_inputs.image_data and not msg.mm_inputs.video_data and not msg.mm_inputs.image_urls
    wire = msg.SerializeToString()
    assert all(h.encode() not in wire for h in prepared.batches[0].mm_hashes)
    assert not msg.HasField("disaggregated_params")
    assert [(e.kind, e.token_ids, e.finish_reason, e.prompt_tokens) for e in answer] == [
        ("complete", ANSWER, "length", len(ids))]


def test_prefill_leg_carries_the_media_and_decode_leg_only_ids_and_the_bootstrap(worker: FakeWorker) -> None:
    prepared = _prepare(QWEN2_5, image_parts(), "pd")
    prefill = build_generate_request(replace(prepared, request_id="pd-prefill"), Role.PREFILL, BOOT)
    decode = build_generate_request(replace(prepared, request_id="pd-decode"), Role.DECODE, BOOT)
    for msg in (prefill, decode):
        list(worker.stub.Generate(msg))
    p, d = received(worker, "pd-prefill"), received(worker, "pd-decode")
    for leg in (p, d):
        assert (leg.bootstrap_host, leg.bootstrap_port, leg.bootstrap_room) == ("10.0.0.7", 8998, 0)
    assert p.mm is not None and same_bytes(p.mm.feature, image_reference(QWEN2_5)["pixel_values"])
    assert d.mm is None and not decode.HasField("mm_inputs")
    assert d.input_ids == p.input_ids == list(prepared.input_ids)
    assert d.sampling == p.sampling
    pixels = prepared.batches[0].tensors["pixel_values"]
    assert isinstance(pixels, np.ndarray)
    assert len(decode.SerializeToString()) < pixels.nbytes  # no pixel byte on the decode leg


@pytest.mark.parametrize("encoder_dtype", [EncoderDtype.FLOAT32, EncoderDtype.BFLOAT16])
def test_pending_pixels_are_computed_into_the_request_bytes(worker: FakeWorker, encoder_dtype: EncoderDtype) -> None:
    rid = f"pending-{encoder_dtype.value}"
    deferred = _prepare(QWEN3, image_parts(), rid, defer=True)
    assert isinstance(deferred.batches[0].tensors["pixel_values"], PendingTensor)
    encoded = encode_generate_request(deferred, Role.SINGLE, encoder_dtype=encoder_dtype)
    asyncio.run(encoded.fill())
    worker.generate_bytes(encoded.data)
    got = received(worker, rid)
    assert got.message == build_generate_request(_prepare(QWEN3, image_parts(), rid), Role.SINGLE,
                                                 encoder_dtype=encoder_dtype)
    want = torch.from_numpy(image_reference(QWEN3)["pixel_values"])
    assert got.mm is not None and got.mm.feature.dtype == {EncoderDtype.FLOAT32: torch.float32,
                                                           EncoderDtype.BFLOAT16: torch.bfloat16}[encoder_dtype]
    assert torch.equal(got.mm.feature, want.to(got.mm.feature.dtype))


def test_arrays_encoded_to_bytes_parse_to_the_built_message() -> None:
    prepared = _prepare(QWEN2_5, image_parts(), "bytes")
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    for role in (Role.SINGLE, Role.PREFILL, Role.DECODE):
        boot = None if role is Role.SINGLE else BOOT
        encoded = encode_generate_request(prepared, role, boot)
        assert not encoded.pending
        assert pb.GenerateRequest.FromString(encoded.data) == build_generate_request(prepared, role, boot)


def test_qwen3_video_placeholders_are_its_frame_runs_and_the_sglang_wire_refuses_video(
        worker: FakeWorker, tmp_path: Path) -> None:
    clip = make_clip(ClipSpec("sglang_clip", 6, 2, 64, 48), tmp_path)
    prepared = _prepare(QWEN3, [video_part(clip)], "video", text="What happens?")
    ref = video_reference(QWEN3, clip)
    assert list(prepared.input_ids) == ref.input_ids
    batch = prepared.batches[0]
    video_token = processor(QWEN3).video_token_id
    runs = embedding_runs(prepared.input_ids, batch.placeholder_token_id, batch.placeholders,
                          whole_span_when_empty=SPAN_WHEN_NO_RUN)
    assert [(r.offset, r.length) for r in runs] == runs_of(ref.input_ids, video_token)
    (t, h, w), = ref.out["video_grid_thw"].tolist()
    assert [r.length for r in runs] == [h * w // 4] * t  # one run per frame, the markers and timestamps left out
    (structural,) = batch.placeholders
    assert structural.length > sum(r.length for r in runs)
    before = len(worker.scheduler.received)
    for role, boot in ((Role.SINGLE, None), (Role.PREFILL, BOOT), (Role.DECODE, BOOT)):
        with pytest.raises(GatewayError) as err:
            build_generate_request(prepared, role, boot)
        assert err.value.code is ErrorCode.MULTIMODAL_NOT_SUPPORTED
    assert len(worker.scheduler.received) == before


def _text_request(request_id: str, sampling: SamplingParams, stream: bool = False) -> PreparedRequest:
    return PreparedRequest(request_id=request_id, model="m", prompt_text="hi", input_ids=(1, 2, 3), batches=(),
                           sampling=sampling, stream=stream)


#: what SGLang's SamplingParams gets for ``SamplingParams()`` (servicer zero rules applied)
DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "repetition_penalty": 1.0, "max_new_tokens": None, "min_new_tokens": 0,
            "stop": None, "stop_token_ids": None, "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "no_stop_trim": False, "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None, "n": 1,
            "ignore_eos": False, "stream_interval": None, "logit_bias": None, "custom_params": None}


def test_default_sampling_reaches_sglang_as_its_own_defaults(worker: FakeWorker) -> None:
    list(worker.stub.Generate(build_generate_request(_text_request("defaults", SamplingParams()), Role.SINGLE)))
    got = received(worker, "defaults")
    assert got.sampling == DEFAULTS
    assert (got.return_logprob, got.logprob_start_len, got.top_logprobs_num, got.mm) == (False, -1, 0, None)


def test_every_sampling_field_reaches_sglang_and_the_stream_becomes_events(worker: FakeWorker) -> None:
    s = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=20, stop=("\n\n",), stop_token_ids=(7,),
                       ignore_eos=True, frequency_penalty=0.5, presence_penalty=-0.5, n=2, min_p=0.05,
                       repetition_penalty=1.1, min_tokens=2, logit_bias=((5, -1.5),), logprobs=3,
                       include_stop_str_in_output=True, skip_special_tokens=False,
                       spaces_between_special_tokens=False, constraint=Constraint(ConstraintKind.REGEX, "[a-z]+"))
    answer = [e for r in worker.stub.Generate(build_generate_request(_text_request("all", s, True), Role.SINGLE))
              for e in events(r)]
    got = received(worker, "all")
    assert got.sampling == {**DEFAULTS, "temperature": pytest.approx(0.7), "top_p": pytest.approx(0.9), "top_k": 20,
                            "min_p": pytest.approx(0.05), "frequency_penalty": 0.5, "presence_penalty": -0.5,
                            "repetition_penalty": pytest.approx(1.1), "max_new_tokens": 16, "min_new_tokens": 2,
                            "stop": ["\n\n"], "stop_token_ids": [7], "skip_special_tokens": False,
                            "spaces_between_special_tokens": False, "no_stop_trim": True, "regex": "[a-z]+", "n": 2,
                            "ignore_eos": True, "logit_bias": {"5": -1.5}}
    assert (got.return_logprob, got.logprob_start_len, got.top_logprobs_num, got.stream) == (True, -1, 3, True)
    tokens = ANSWER[:-1] + (7,)
    for index in (0, 1):
        mine = [e for e in answer if e.index == index]
        assert [e.token_ids for e in mine if not e.is_complete] == [(t,) for t in tokens]
        (done,) = [e for e in mine if e.is_complete]
        # streamed: the completion repeats the last chunk's token (as both servicers send it)
        assert (done.token_ids, done.finish_reason, done.matched_token_id, done.matched_stop_str) == (
            (7,), "stop", 7, None)
        assert (done.completion_tokens, done.prompt_tokens) == (len(tokens), 3)
        assert done.logprobs is not None and done.logprobs.token_ids == (7,)
        assert [len(t.token_ids) for t in done.logprobs.top_logprobs] == [3]
        chunk_lp = [e.logprobs for e in mine if not e.is_complete]
        assert all(lp is not None and lp.token_logprobs == (-0.5,) for lp in chunk_lp)


@pytest.mark.parametrize(("kind", "value", "key", "sent"), [
    (ConstraintKind.JSON_SCHEMA, '{"type": "string"}', "json_schema", '{"type": "string"}'),
    (ConstraintKind.JSON_OBJECT, "", "json_schema", JSON_OBJECT_SCHEMA),
    (ConstraintKind.GRAMMAR, 'root ::= "a"', "ebnf", 'root ::= "a"'),
    (ConstraintKind.STRUCTURAL_TAG, '{"type": "structural_tag"}', "structural_tag", '{"type": "structural_tag"}'),
    (ConstraintKind.CHOICE, json.dumps(["yes", 'say "no"\n']), "ebnf", 'root ::= "yes" | "say \\"no\\"\\n"'),
])
def test_each_constraint_reaches_its_sglang_field(worker: FakeWorker, kind: ConstraintKind, value: str, key: str,
                                                  sent: str) -> None:
    rid = f"constraint-{kind.value}"
    msg = build_generate_request(_text_request(rid, SamplingParams(constraint=Constraint(kind, value))), Role.SINGLE)
    list(worker.stub.Generate(msg))
    assert {k: v for k, v in received(worker, rid).sampling.items()
            if k in ("regex", "json_schema", "ebnf", "structural_tag") and v is not None} == {key: sent}


@pytest.mark.parametrize(("sampling", "field"), [
    (SamplingParams(seed=1), "seed"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(max_tokens=2**32), "max_tokens"),
    (SamplingParams(top_k=2**31), "top_k"),
    (SamplingParams(logprobs=2**31), "logprobs"),
    (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
])
def test_what_the_wire_cannot_carry_is_refused_by_name(sampling: SamplingParams, field: str) -> None:
    with pytest.raises(GatewayError) as err:
        build_generate_request(_text_request("refused", sampling), Role.SINGLE)
    assert (err.value.code, err.value.param) == (ErrorCode.INVALID_REQUEST, field)


@pytest.mark.parametrize(("role", "boot"), [
    (Role.ENCODE, None), (Role.PREFILL, None), (Role.DECODE, None), (Role.SINGLE, BOOT),
    (Role.PREFILL, Bootstrap("h", 8998, 2**31)), (Role.DECODE, Bootstrap("h", 0, 1)), (Role.PREFILL, Bootstrap("", 1, 1)),
])
def test_a_role_and_bootstrap_that_do_not_fit_are_internal_errors(role: Role, boot: Bootstrap | None) -> None:
    with pytest.raises(GatewayError) as err:
        build_generate_request(_text_request("role", SamplingParams()), role, boot)
    assert err.value.code is ErrorCode.INTERNAL_ERROR


def test_raw_uint8_pixels_are_refused_sglang_does_not_normalize_on_device() -> None:
    prepared = _prepare(QWEN2_5, image_parts(), "raw")
    batch = prepared.batches[0]
    raw = dict(batch.tensors, pixel_values=np.zeros((16, 1176), dtype=np.uint8))
    with pytest.raises(GatewayError) as err:
        build_generate_request(replace(prepared, batches=(replace(batch, tensors=raw),)), Role.SINGLE)
    assert err.value.code is ErrorCode.INTERNAL_ERROR


class _Error:
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_sglang_refusal_of_a_long_prompt_is_context_length_exceeded(worker: FakeWorker) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(worker.stub.Generate(build_generate_request(_text_request("too-long", SamplingParams()), Role.SINGLE)))
    assert map_rpc_error(err.value).code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert map_rpc_error(_Error(grpc.StatusCode.INVALID_ARGUMENT, "bad schema")).code is ErrorCode.ENGINE_REJECTED
    assert map_rpc_error(_Error(grpc.StatusCode.UNAVAILABLE, "")).code is ErrorCode.ENGINE_UNAVAILABLE
    assert map_rpc_error(_Error(grpc.StatusCode.INTERNAL, "boom")).code is ErrorCode.ENGINE_ERROR


def test_the_fake_answers_the_probe_rpcs(worker: FakeWorker) -> None:
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    assert worker.stub.HealthCheck(pb.HealthCheckRequest()).healthy
    info = worker.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_type, info.supports_vision) == ("qwen2_5_vl", True)
    server = worker.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_args["disaggregation_mode"] == "null"


def test_each_leg_counts_its_encoder_tensors_in_the_metrics() -> None:
    """``smg_mm_tensors_total`` / ``smg_mm_tensor_bytes_total`` with ``runtime="sglang"``, ``path="inline"``:
    a prefill leg counts ``pixel_values`` and ``image_grid_thw`` at their wire sizes (pending pixels too), a
    decode leg nothing."""
    def counted() -> tuple[float, float]:
        return (metrics.REGISTRY.get_sample_value("smg_mm_tensors_total", {"runtime": "sglang", "path": "inline"})
                or 0.0,
                metrics.REGISTRY.get_sample_value("smg_mm_tensor_bytes_total", {"runtime": "sglang", "path": "inline"})
                or 0.0)

    want = image_reference(QWEN2_5)
    want_bytes = float(want["pixel_values"].astype(np.float32).nbytes + want["image_grid_thw"].astype(np.int64).nbytes)
    for defer in (False, True):
        prepared = _prepare(QWEN2_5, image_parts(), f"metrics-{defer}", defer=defer)
        before = counted()
        encode_generate_request(prepared, Role.PREFILL, BOOT)
        after = counted()
        assert (after[0] - before[0], after[1] - before[1]) == (2.0, want_bytes)
        encode_generate_request(prepared, Role.DECODE, BOOT)
        assert counted() == after
