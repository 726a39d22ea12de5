"""A clip's ``pixel_values`` written straight into the transport buffer (issue 26) equal the array path's.

When the request's first item is a clip, ``Pipeline.prepare(..., defer_pixels=True)`` returns its
``pixel_values`` as a :class:`~mmgate.types.PendingTensor`; the vLLM adapter computes it into the
serialized request (inline) or a new shared-memory segment, a temporal patch at a time.  Per model,
wire dtype and transport the bytes must equal ``build_generate_request`` of the same request prepared
with arrays (itself equal to the reference: ``test_video_parity.py``), with a clip repeated (written
at both of its places), a second clip, and raw uint8 pixels for a device-normalizing worker.  A fill
after a successful one is refused (the decoded frames are gone once written).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines.vllm import build_generate_request, encode_generate_request
from mmgate.errors import GatewayError
from mmgate.request.parse import parse_chat_request
from mmgate.transport import shm
from mmgate.transport.dtypes import EncoderDtype
from mmgate.transport.policy import WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import PendingTensor, PreparedRequest
from tests.video.video_support import QWEN2_5, QWEN3, ClipSpec, make_clip, pipeline, video_part


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("deferred-clips")
    return (make_clip(ClipSpec("d17_25fps", 17, 25, 160, 96), folder),
            make_clip(ClipSpec("d9_10fps", 9, 10, 96, 64), folder))


def _prepare(model: str, clips: tuple[Path, Path], raw: bool, defer: bool) -> PreparedRequest:
    a, b = clips
    body = {"model": model, "messages": [{"role": "user", "content": [
        video_part(a), video_part(b), video_part(a), {"type": "text", "text": "What happens?"}]}]}
    req = parse_chat_request(json.dumps(body).encode())
    return asyncio.run(pipeline(model).prepare(req, request_id="r", choose_worker=lambda m, key: raw,
                                               defer_pixels=defer))


@pytest.mark.parametrize("model", [QWEN3, QWEN2_5])
@pytest.mark.parametrize("raw", [False, True], ids=["normalized", "raw-uint8"])
def test_deferred_clip_pixels_equal_the_array_path(model: str, raw: bool, clips: tuple[Path, Path]) -> None:
    arrays = _prepare(model, clips, raw, defer=False)
    dtypes = [EncoderDtype.FLOAT32] if raw else list(EncoderDtype)
    for dtype in dtypes:
        inline = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=dtype, device_normalize=raw)
        deferred = _prepare(model, clips, raw, defer=True)
        pending = deferred.batches[0].tensors["pixel_values"]
        assert isinstance(pending, PendingTensor)
        assert pending.shape == arrays.batches[0].tensors["pixel_values"].shape
        assert deferred.input_ids == arrays.input_ids
        encoded = encode_generate_request(deferred, inline)
        asyncio.run(encoded.fill())
        assert vllm_engine_pb2.GenerateRequest.FromString(encoded.data) == build_generate_request(arrays, inline)
        with pytest.raises(GatewayError, match="written already"):
            asyncio.run(encode_generate_request(deferred, inline).fill())

        via_shm = WirePlan(shm=True, shm_min_bytes=1024, encoder_dtype=dtype, device_normalize=raw)
        deferred = _prepare(model, clips, raw, defer=True)
        with ShmLease() as lease_a, ShmLease() as lease_b:
            expected = build_generate_request(arrays, via_shm, lease_a)
            encoded = encode_generate_request(deferred, via_shm, lease_b)
            asyncio.run(encoded.fill())
            parsed = vllm_engine_pb2.GenerateRequest.FromString(encoded.data)
            got, want = parsed.mm_inputs.pixel_values, expected.mm_inputs.pixel_values
            assert got.WhichOneof("payload") == want.WhichOneof("payload") == "shm"
            assert (list(got.shape), got.dtype) == (list(want.shape), want.dtype)
            assert shm.read_segment(got.shm.name, 0, got.shm.nbytes) == \
                shm.read_segment(want.shm.name, 0, want.shm.nbytes)
            assert parsed.mm_inputs.model_specific_tensors == expected.mm_inputs.model_specific_tensors
            assert parsed.mm_inputs.mm_hashes == expected.mm_inputs.mm_hashes
