"""A recording TokenSpeed worker on loopback: the scheduler and the encoder service, no model.

Written from ``smg_grpc_proto`` ``tokenspeed_scheduler.proto`` / ``tokenspeed_encoder.proto``
and the reading code of the real servicer (smg-grpc-servicer 0.14.1, the ``test`` extra's pin),
so a test sees what the engine would be handed.  Tensors are decoded by the installed
servicer's own ``_tensor_from_proto`` / ``_torch_dtype_from_proto`` and ``mm_shm``
(:mod:`tests.support.servicer_code`); the rest is ported:

* ``tokenspeed/servicer.py`` ``_build_generate_req`` (tokenized ids, ``mm_inputs`` also without
  encoder inputs, ``encode_bootstrap_info`` item-index check and ``encode_handshake``,
  ``kv_bootstrap_info``, logprob fields), ``_sampling_params_from_proto`` (without the
  reasoning-parser wrapping), ``_mm_inputs_from_itemized_proto`` (placeholders -> offsets,
  content hash -> ``int.from_bytes(hash[:8], "little")``, ``placeholder_token_id`` merge),
  ``_validate_item_tensor_consistency``, ``_feature_from_proto``'s dtype check;
* ``tokenspeed/encoder_servicer.py`` ``Encode`` (exactly one item and one room) and
  ``_items_from_proto`` (the encoder input is required there).

A request the servicer would refuse (its ``ValueError``) is aborted with INVALID_ARGUMENT, as
the servicer does.  Tensors are recorded as they arrive on the wire: bfloat16 as uint16 bits.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import (
    common_pb2,
    tokenspeed_encoder_pb2,
    tokenspeed_encoder_pb2_grpc,
    tokenspeed_scheduler_pb2,
    tokenspeed_scheduler_pb2_grpc,
)

from mmgate.transport.shm import shm_namespace_id
from tests.support.servicer_code import to_numpy, tokenspeed_dtype_from_proto, tokenspeed_tensor_from_proto

pb = tokenspeed_scheduler_pb2
_MODALITIES = {common_pb2.IMAGE: "IMAGE", common_pb2.VIDEO: "VIDEO", common_pb2.AUDIO: "AUDIO"}


def tensor_from_proto(td: pb.TensorData) -> tuple[np.ndarray, str]:
    """The installed servicer's ``_tensor_from_proto`` without the cast (payload bytes through its
    ``mm_shm.tensor_payload_bytes``: inline, or ``/dev/shm`` read with ``O_NOFOLLOW`` and unlinked):
    (array, payload kind); bfloat16 as uint16 bits.  A segment that cannot be opened is refused
    as a ``ValueError`` here (the servicer answers INTERNAL for it)."""
    payload = td.WhichOneof("payload")
    try:
        tensor = tokenspeed_tensor_from_proto(td)
    except OSError as error:
        raise ValueError(f"TensorData.shm unreadable: {td.shm.name!r} ({error.strerror})") from None
    return to_numpy(tensor), payload


def feature_from_proto(td: pb.TensorData) -> tuple[np.ndarray, str]:
    """``_feature_from_proto``: a shm feature's dtype must be one ``_torch_dtype_from_proto`` names
    (the installed one); then it is read as every tensor is."""
    if td.WhichOneof("payload") == "shm":
        tokenspeed_dtype_from_proto(td.dtype)
    return tensor_from_proto(td)


@dataclass
class Item:
    """One ``MultimodalItem`` as the engine receives it."""

    modality: str
    content_hash: bytes
    hash: int | None  # the engine's item hash: first 8 bytes, little-endian
    encoder_input: np.ndarray | None
    encoder_dtype: str | None
    encoder_payload: str | None  # "inline" | "shm" | None (no encoder input)
    tensors: dict[str, np.ndarray]
    tensor_dtypes: dict[str, str]
    tensor_payloads: dict[str, str]
    placeholders: list[tuple[int, int]]  # (offset, length) as sent
    offsets: list[tuple[int, int]]  # the engine's (first, last) positions
    placeholder_token_id: int | None
    encode_handshake: dict[str, Any] | None = None


def _item(proto: pb.MultimodalItem, require_input: bool = False) -> Item:
    if proto.modality not in _MODALITIES:
        raise ValueError(f"Unsupported multimodal item modality: {proto.modality}")
    modality = _MODALITIES[proto.modality]
    feature = dtype = payload = None
    if proto.HasField("encoder_input") or require_input:
        feature, payload = feature_from_proto(proto.encoder_input)
        dtype = proto.encoder_input.dtype
    tensors, dtypes, payloads = {}, {}, {}
    for name, td in proto.model_specific_tensors.items():
        tensors[name], payloads[name] = tensor_from_proto(td)
        dtypes[name] = td.dtype
    has_image_grid, has_video_grid = "image_grid_thw" in tensors, "video_grid_thw" in tensors
    if modality == "IMAGE" and has_video_grid:
        raise ValueError("IMAGE MultimodalItem must not carry video_grid_thw")
    if modality == "VIDEO" and (has_image_grid or not has_video_grid):
        raise ValueError("VIDEO MultimodalItem must carry video_grid_thw and no image_grid_thw")
    if not proto.placeholders or any(p.length <= 0 for p in proto.placeholders):
        raise ValueError("MultimodalItem placeholders missing or empty")
    digest = bytes(proto.content_hash)
    return Item(modality=modality, content_hash=digest,
                hash=int.from_bytes(digest[:8], "little") if digest else None,
                encoder_input=feature, encoder_dtype=dtype, encoder_payload=payload, tensors=tensors,
                tensor_dtypes=dtypes, tensor_payloads=payloads,
                placeholders=[(p.offset, p.length) for p in proto.placeholders],
                offsets=[(p.offset, p.offset + p.length - 1) for p in proto.placeholders],
                placeholder_token_id=proto.placeholder_token_id if proto.HasField("placeholder_token_id") else None)


def sampling_from_proto(params: pb.SamplingParams) -> dict[str, Any]:
    """``_sampling_params_from_proto``: the dict the engine's ``SamplingParams`` is built from."""
    out: dict[str, Any] = {}
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty"):
        if params.HasField(name):
            out[name] = getattr(params, name)
    if params.HasField("sampling_seed"):
        out["seed"] = params.sampling_seed
    if params.min_new_tokens:
        out["min_new_tokens"] = params.min_new_tokens
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    out["skip_special_tokens"] = bool(params.skip_special_tokens)
    out["spaces_between_special_tokens"] = bool(params.spaces_between_special_tokens)
    out["ignore_eos"] = bool(params.ignore_eos)
    out["no_stop_trim"] = bool(params.no_stop_trim)
    if params.n:
        out["n"] = params.n
    if params.logit_bias:
        out["logit_bias"] = dict(params.logit_bias)
    constraint = params.WhichOneof("constraint")
    if constraint is not None:
        out["ebnf" if constraint == "ebnf_grammar" else constraint] = getattr(params, constraint)
    return out


@dataclass
class Generate:
    """One Generate request as ``_build_generate_req`` turns it into the engine's input."""

    request_id: str
    input_ids: list[int]
    stream: bool
    sampling: dict[str, Any]
    return_logprob: bool
    top_logprobs_num: int
    items: list[Item] | None
    im_token_id: int | None
    video_token_id: int | None
    kv_bootstrap: tuple[str | None, int, int] | None  # (host, port, room)
    has_encode_bootstrap: bool


def build_generate(request: pb.GenerateRequest) -> Generate:
    if not request.HasField("tokenized") or not request.tokenized.input_ids:
        raise ValueError("GenerateRequest.tokenized.input_ids is required")
    items = im = video = None
    if request.HasField("mm_inputs"):
        items = [_item(p) for p in request.mm_inputs.items]
        if not items:
            raise ValueError("MultimodalInputs.items is empty")
        for it in items:
            if it.placeholder_token_id is None:
                continue
            current = im if it.modality == "IMAGE" else video if it.modality == "VIDEO" else None
            if current is not None and current != it.placeholder_token_id:
                raise ValueError(f"Conflicting placeholder_token_id for {it.modality}")
            if it.modality == "IMAGE":
                im = it.placeholder_token_id
            elif it.modality == "VIDEO":
                video = it.placeholder_token_id
    if request.HasField("encode_bootstrap_info"):
        if items is None:
            raise ValueError("GenerateRequest.encode_bootstrap_info present but mm_inputs is missing")
        for h in request.encode_bootstrap_info.items:
            if not 0 <= h.item_index < len(items):
                raise ValueError(f"EPD encode bootstrap item_index {h.item_index} out of range")
            items[h.item_index].encode_handshake = {"bootstrap_host": h.bootstrap_host,
                                                    "bootstrap_port": h.bootstrap_port,
                                                    "bootstrap_room": h.bootstrap_room}
    kv = None
    if request.HasField("kv_bootstrap_info"):
        k = request.kv_bootstrap_info
        kv = (k.bootstrap_host or None, k.bootstrap_port, k.bootstrap_room)
    return Generate(request_id=request.request_id, input_ids=list(request.tokenized.input_ids),
                    stream=request.stream, sampling=sampling_from_proto(request.sampling_params),
                    return_logprob=request.return_logprob, top_logprobs_num=request.top_logprobs_num, items=items,
                    im_token_id=im, video_token_id=video, kv_bootstrap=kv,
                    has_encode_bootstrap=request.HasField("encode_bootstrap_info"))


@dataclass
class Encode:
    request_id: str
    room: int
    item: Item


@dataclass
class FakeState:
    """What the fake reports and what it received."""

    model_type: str = "qwen2_5_vl"
    encoder_dtype: str = "bfloat16"  # GetModelInfo multimodal_encoder_dtype (the model's dtype)
    disaggregation_mode: str = "null"
    output_ids: tuple[int, ...] = (9707, 11, 151645)
    generates: list[Generate] = field(default_factory=list)
    encodes: list[Encode] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Scheduler(tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    def Generate(self, request, context):
        try:
            record = build_generate(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self.state.lock:
            self.state.generates.append(record)
        ids, n = list(self.state.output_ids), len(request.tokenized.input_ids)
        logprobs = None
        if request.return_logprob:
            logprobs = pb.OutputLogProbs(token_logprobs=[-0.5] * (len(ids) - 1), token_ids=ids[:-1],
                                         top_logprobs=[pb.TopLogProbs(values=[-0.5], token_ids=[t]) for t in ids[:-1]])
        if request.stream:
            for i, token in enumerate(ids[:-1]):
                yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
                    token_ids=[token], prompt_tokens=n, completion_tokens=i + 1))
        # The matched EOS is trimmed from output_ids (``_generated_output_ids``) and rides in matched_token_id.
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
            output_ids=ids[:-1], finish_reason="stop", prompt_tokens=n, completion_tokens=len(ids),
            cached_tokens=0, output_logprobs=logprobs, matched_token_id=ids[-1]))

    def HealthCheck(self, request, context):
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(
            model_path="fake", served_model_name="fake", model_type=self.state.model_type, max_context_length=32768,
            supports_vision=True, supports_multimodal=True, supported_modalities=[common_pb2.IMAGE, common_pb2.VIDEO],
            model_dtype=self.state.encoder_dtype, multimodal_encoder_dtype=self.state.encoder_dtype,
            eos_token_ids=[151645])

    def GetServerInfo(self, request, context):
        server_args, scheduler_info = Struct(), Struct()
        server_args.update({"disaggregation_mode": self.state.disaggregation_mode})
        scheduler_info.update({"shm_namespace_id": shm_namespace_id()})
        return pb.GetServerInfoResponse(server_args=server_args, scheduler_info=scheduler_info,
                                        tokenspeed_version="fake")


class _Encoder(tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    def Encode(self, request, context):
        if not request.HasField("mm_inputs"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "EncodeRequest.mm_inputs is required")
        if len(request.mm_inputs.items) != 1 or len(request.items) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "EncodeRequest must contain exactly one mm item and one room assignment")
        try:
            item = _item(request.mm_inputs.items[0], require_input=True)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self.state.lock:
            self.state.encodes.append(Encode(request.request_id, request.items[0].bootstrap_room, item))
        return tokenspeed_encoder_pb2.EncodeResponse(accepted=True)


class FakeTokenSpeedWorker:
    """Both services on one loopback port; ``scheduler`` / ``encoder`` are stubs to it."""

    def __init__(self, state: FakeState | None = None) -> None:
        self.state = state or FakeState()
        limit = 512 * 1024 * 1024
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
        tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server(_Scheduler(self.state), self.server)
        tokenspeed_encoder_pb2_grpc.add_TokenSpeedEncoderServicer_to_server(_Encoder(self.state), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=options)
        self.scheduler = tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerStub(self.channel)
        self.encoder = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(self.channel)

    def labels(self) -> dict[str, str]:
        """The labels a gateway reads off GetModelInfo / GetServerInfo (the two the wire plan uses)."""
        info = self.scheduler.GetModelInfo(pb.GetModelInfoRequest())
        server = self.scheduler.GetServerInfo(pb.GetServerInfoRequest())
        return {"multimodal_encoder_dtype": info.multimodal_encoder_dtype,
                "shm_namespace_id": server.scheduler_info["shm_namespace_id"]}

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=0)
