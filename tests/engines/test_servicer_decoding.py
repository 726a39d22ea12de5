"""What mmgate sends, decoded by the real servicer's code (smg-grpc-servicer 0.14.1, issue 22).

Every leg of every wire that :mod:`tests.engines.test_wire_goldens` pins (the real adapters of
:data:`mmgate.engines.adapter.ADAPTERS`: single, prefill, decode, language-model-only decode,
TokenSpeed's encode and EPD-prefill legs; inline, bfloat16 and shared-memory plans) is parsed and
each ``TensorData`` in it decoded the way that wire's servicer decodes it
(:mod:`tests.support.servicer_code`).  The dtype table mmgate keeps
(:data:`mmgate.engines.wire_values.SERVICER_DTYPES`) is diffed against the installed package's,
and the int32 case is shown both ways: the vLLM servicer refuses an int32 tensor, and an int32
grid reaches every wire as int64.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf.message import Message
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines import sglang, wire_values
from mmgate.engines.base import Wire
from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine import mm_inputs as ref_mm_inputs
from mmgate.refengine.tensors import decode_tensor
from mmgate.transport.inline import to_tensor_data
from mmgate.transport.shm import ShmLease
from mmgate.types import EncoderBatch, Modality, PreparedRequest
from tests.engines import test_wire_goldens as goldens
from tests.support import servicer_code
from tests.support.servicer_code import PROTO_DTYPE_MAP, sglang_tensor, tensor_from_proto, tokenspeed_tensor_from_proto

ROOT = Path(__file__).resolve().parents[2]
#: how each wire's servicer turns one ``TensorData`` into a tensor
DECODERS: dict[Wire, Callable[[Any], torch.Tensor]] = {
    Wire.VLLM: tensor_from_proto, Wire.SGLANG: sglang_tensor, Wire.TOKENSPEED: tokenspeed_tensor_from_proto}


def _tensor_data(message: Message, path: str = "") -> Iterator[tuple[str, Message]]:
    """Every ``TensorData`` inside ``message`` (model_specific_tensors maps included), with its path."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            items = [(f"{path}{field.name}[{k}]", v) for k, v in value.items()]
        elif field.is_repeated:
            items = [(f"{path}{field.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(f"{path}{field.name}", value)]
        for where, sub in items:
            if not isinstance(sub, Message):
                continue
            if sub.DESCRIPTOR.name == "TensorData":
                yield where, sub
            else:
                yield from _tensor_data(sub, where + ".")


def _decoded_legs(prepare: Callable[[str], PreparedRequest]) -> Iterator[tuple[str, str, torch.Tensor, str]]:
    """(case, tensor path, tensor as the servicer decodes it, wire dtype name) for every golden case."""
    for wire_name, leg, request, plan in goldens.cases():
        wire = Wire(wire_name)
        case = f"{wire_name}/{leg}/{request}/{plan}"
        with ShmLease() as lease:
            try:
                data = goldens._encode(wire, leg, prepare(request), goldens.PLANS[plan], lease)
            except GatewayError:
                continue  # a refusal mmgate makes itself (pinned by the goldens): nothing reaches a servicer
            kind = (goldens.REQUEST_TYPES[wire] if not leg.startswith("encode-")
                    else goldens.tokenspeed_encoder_pb2.EncodeRequest)
            for where, td in _tensor_data(kind.FromString(data)):
                yield case, where, DECODERS[wire](td), td.dtype


def test_the_installed_servicer_is_the_pinned_one() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"smg-grpc-servicer=={servicer_code.PINNED}" in extra
    assert servicer_code.installed_version() == servicer_code.PINNED


def test_mmgates_dtype_tables_are_the_servicers() -> None:
    assert wire_values.SERVICER_DTYPES == set(PROTO_DTYPE_MAP)
    assert sglang.SERVICER_DTYPES == set(PROTO_DTYPE_MAP)


def test_the_refengines_mm_key_helpers_match_mm_keys() -> None:
    """``refengine/mm_inputs.py`` ports ``vllm/mm_keys.py``: same default key, same renames, same batches."""
    from smg_grpc_servicer.vllm import mm_keys

    assert ref_mm_inputs.DEFAULT_ENCODER_INPUT_KEY == mm_keys.DEFAULT_ENCODER_INPUT_KEY
    for key in ("pixel_values", "patches", "image_grid_thw", "video_grid_thw", "pixel_values_videos"):
        for is_video in (False, True):
            assert ref_mm_inputs.modality_key(key, is_video) == mm_keys.modality_key(key, is_video)
    image = vllm_engine_pb2.MultimodalInputs(modality=wire_values.PROTO_MODALITY[Modality.IMAGE])
    video = vllm_engine_pb2.MultimodalInputs(modality=wire_values.PROTO_MODALITY[Modality.VIDEO])
    for batches in ((), (image,), (image, video), (video, image)):
        req = vllm_engine_pb2.GenerateRequest()
        if batches:
            req.mm_inputs.CopyFrom(batches[0])
            req.extra_mm_inputs.extend(batches[1:])
        assert ref_mm_inputs.mm_batches(req) == mm_keys.mm_batches(req)
        for mm in batches:
            assert ref_mm_inputs.vllm_modality(mm).value == mm_keys.modality_name(mm)


def test_every_tensor_mmgate_sends_decodes_with_the_servicer() -> None:
    seen: set[tuple[str, str]] = set()
    for case, where, tensor, dtype in _decoded_legs(lambda name: goldens.requests()[name]()):
        assert dtype in PROTO_DTYPE_MAP, f"{case} {where}: {dtype}"
        assert tensor.dtype == PROTO_DTYPE_MAP[dtype], f"{case} {where}"
        seen.add((where.rsplit("[", 1)[-1].rstrip("]") if "[" in where else where.rsplit(".", 1)[-1], dtype))
    # the grids and sizes travel as int64; pixels as float32 or bfloat16
    assert {("image_grid_thw", "int64"), ("patches_per_image", "int64"), ("video_grid_thw", "int64"),
            ("second_per_grid_ts", "float32"), ("pixel_values", "float32"), ("pixel_values", "bfloat16")} <= seen


def test_the_vllm_servicer_refuses_an_int32_tensor() -> None:
    grid = np.array([[1, 4, 4]], dtype=np.int32)
    td = to_tensor_data(grid)  # the transport alone would name it int32 ...
    assert td.dtype == "int32"
    with pytest.raises(ValueError, match="Unsupported proto tensor dtype: 'int32'"):
        tensor_from_proto(td)  # ... which fails the whole request at the servicer
    with pytest.raises(GatewayError) as refused:  # and the reference engine refuses it the same way
        decode_tensor(td)
    assert refused.value.code is ErrorCode.INVALID_REQUEST


def _int32_grids(request: PreparedRequest) -> PreparedRequest:
    """``request`` with every int64 tensor (grids, sizes) computed as int32 instead."""
    def narrowed(batch: EncoderBatch) -> EncoderBatch:
        tensors = {k: v.astype(np.int32) if isinstance(v, np.ndarray) and v.dtype == np.int64 else v
                   for k, v in batch.tensors.items()}
        return EncoderBatch(batch.modality, tensors, batch.specs, batch.placeholder_token_id, batch.placeholders,
                            batch.mm_hashes)
    return PreparedRequest(request_id=request.request_id, model=request.model, prompt_text=request.prompt_text,
                           input_ids=request.input_ids, batches=tuple(narrowed(b) for b in request.batches),
                           sampling=request.sampling, stream=request.stream)


def test_an_int32_grid_reaches_every_servicer_as_int64() -> None:
    """int32 is never emitted: an int32 grid is widened to int64 (same values) on every wire and leg."""
    wide = {case + where: tensor for case, where, tensor, _ in
            _decoded_legs(lambda name: goldens.requests()[name]())}
    narrow = {case + where: (tensor, dtype) for case, where, tensor, dtype in
              _decoded_legs(lambda name: _int32_grids(goldens.requests()[name]()))}
    assert narrow.keys() == wide.keys()  # no leg refused, no tensor dropped
    int64 = [key for key, (_, dtype) in narrow.items() if dtype == "int64"]
    assert int64 and all(dtype != "int32" for _, dtype in narrow.values())
    for key in int64:
        assert torch.equal(narrow[key][0], wide[key]), key
