"""Golden digests of every wire adapter's serialized requests: the codec core refactor (issue 22)
changes no output.

A fixed set of prepared requests (one image, two images, a Qwen3-VL-style clip whose span holds
frame markers, an image and a clip in one prompt, text only; arrays and pending pixels; inline
and shared memory; float32 and bfloat16 encoder input; each role of each wire, TokenSpeed's
encode and EPD-prefill legs too) goes through :data:`mmgate.engines.adapter.ADAPTERS` as the
gateway sends it (``materialize`` where the wire needs it, ``encode``, ``fill``).  Each case's
SHA-256 covers the serialized bytes and the contents of every shared-memory segment the leg
names; a refusal is pinned as its error code.  Segment names and the owner id are made
deterministic (fixed pid, counter instead of ``secrets.token_hex``) so the bytes are stable.

:data:`GOLDEN` was produced by commit 05281ae's encoders (``python tests/engines/test_wire_goldens.py``
run with ``PYTHONPATH`` at a checkout of 05281ae), before the codec core existed, except where
:data:`CHANGED` says why a case's bytes changed on purpose.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2,
    tokenspeed_encoder_pb2,
    tokenspeed_scheduler_pb2,
    vllm_engine_pb2,
)

from mmgate.engines.adapter import ADAPTERS
from mmgate.engines.base import Bootstrap, Role, Wire
from mmgate.errors import GatewayError
from mmgate.transport import shm
from mmgate.transport.dtypes import EncoderDtype
from mmgate.transport.policy import WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import (
    Constraint,
    ConstraintKind,
    EncoderBatch,
    Modality,
    PendingTensor,
    PlaceholderRange,
    PreparedRequest,
    RowTarget,
    SamplingParams,
    TensorLayout,
    TensorSpec,
)

P, V, S, E = 151655, 151656, 151652, 151653  # image pad, video pad, vision start, vision end
INLINE = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)
INLINE_BF16 = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=EncoderDtype.BFLOAT16, device_normalize=False)
SHM = WirePlan(shm=True, shm_min_bytes=64, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)
PLANS = {"inline": INLINE, "inline-bf16": INLINE_BF16, "shm": SHM}
KV = Bootstrap(host="10.0.0.7", port=8998, room=12345)
ENCODERS = (Bootstrap(host="10.0.0.8", port=9001, room=777), Bootstrap(host="10.0.0.9", port=9002, room=778))
SAMPLING = SamplingParams(max_tokens=16, temperature=0.5, top_p=0.9, top_k=20, stop=("END",), stop_token_ids=(7,),
                          n=1, logprobs=2, logit_bias=((11, 0.5),), min_tokens=1)
CHOICE = SamplingParams(max_tokens=4, constraint=Constraint(
    ConstraintKind.CHOICE, json.dumps(["plain", 'say "hi"', "back\\slash", "two\nlines", "tab\there", "bell\x07",
                                       "caf\u00e9"])))


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _pending(values: np.ndarray) -> PendingTensor:
    async def fill(target: RowTarget) -> None:
        with target.writer() as write:
            write(0, values.reshape(values.shape[0], -1))

    return PendingTensor(shape=values.shape, dtype=values.dtype, fill=fill)


def _image_batch(ranges: tuple[PlaceholderRange, ...], patches: tuple[int, ...], seed: int,
                 pending: bool) -> EncoderBatch:
    pixels = _values((sum(patches), 24), seed)
    specs = (TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="patches_per_image", primary=True),
             TensorSpec("image_grid_thw", "int64", TensorLayout.BATCHED, keep_on_cpu=True),
             TensorSpec("patches_per_image", "int64", TensorLayout.BATCHED))
    tensors = {"pixel_values": _pending(pixels) if pending else pixels,
               "image_grid_thw": np.array([[1, 2, n // 2] for n in patches], dtype=np.int64),
               "patches_per_image": np.array(patches, dtype=np.int64)}
    return EncoderBatch(Modality.IMAGE, tensors, specs, P, ranges, tuple(f"img{seed}-{i}" for i in range(len(ranges))))


def _video_batch(ranges: tuple[PlaceholderRange, ...], seed: int) -> EncoderBatch:
    patches = (16,) * len(ranges)
    specs = (TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="patches_per_video", primary=True),
             TensorSpec("video_grid_thw", "int64", TensorLayout.BATCHED, keep_on_cpu=True),
             TensorSpec("patches_per_video", "int64", TensorLayout.BATCHED),
             TensorSpec("second_per_grid_ts", "float32", TensorLayout.BATCHED))
    tensors = {"pixel_values": _values((sum(patches), 24), seed),
               "video_grid_thw": np.array([[2, 2, 4]] * len(ranges), dtype=np.int64),
               "patches_per_video": np.array(patches, dtype=np.int64),
               "second_per_grid_ts": np.array([1.0] * len(ranges), dtype=np.float32)}
    return EncoderBatch(Modality.VIDEO, tensors, specs, V, ranges, tuple(f"vid{seed}-{i}" for i in range(len(ranges))))


def _request(name: str, ids: list[int], batches: tuple[EncoderBatch, ...],
             sampling: SamplingParams = SAMPLING) -> PreparedRequest:
    return PreparedRequest(request_id=f"golden-{name}", model="m", prompt_text=f"<prompt {name}>",
                           input_ids=tuple(ids), batches=batches, sampling=sampling, stream=True)


def requests() -> dict[str, Callable[[], PreparedRequest]]:
    """The prepared requests, by name (built fresh per case: a pending tensor fills once)."""
    one = [1, 2, S, *[P] * 4, E, 3]  # one image of 16 patches -> 4 tokens at 3..6
    two = [1, S, *[P] * 4, E, 9, S, *[P] * 2, E, 4]  # 16 patches at 2..5, 8 patches at 9..10
    # a Qwen3-VL clip: per-frame timestamp text and markers inside the item's span
    clip = [1, 50, 51, S, V, V, E, 52, 53, S, V, V, E, 4]
    mixed = [1, 50, S, V, V, E, 52, S, V, V, E, 9, S, *[P] * 4, E, 4]
    return {
        "image": lambda: _request("image", one, (_image_batch((PlaceholderRange(3, 4),), (16,), 1, False),)),
        "image-pending": lambda: _request("image-pending", one,
                                          (_image_batch((PlaceholderRange(3, 4),), (16,), 1, True),)),
        "two-images": lambda: _request("two-images", two, (
            _image_batch((PlaceholderRange(2, 4), PlaceholderRange(9, 2)), (16, 8), 2, False),)),
        "two-images-pending": lambda: _request("two-images-pending", two, (
            _image_batch((PlaceholderRange(2, 4), PlaceholderRange(9, 2)), (16, 8), 2, True),)),
        "clip": lambda: _request("clip", clip, (_video_batch((PlaceholderRange(1, 12),), 3),)),
        "clip-and-image": lambda: _request("clip-and-image", mixed, (
            _image_batch((PlaceholderRange(13, 4),), (16,), 4, False), _video_batch((PlaceholderRange(1, 10),), 5))),
        "text": lambda: _request("text", [1, 2, 3], ()),
        "choice": lambda: _request("choice", [1, 2, 3], (), CHOICE),
    }


#: (wire, role, how the leg is encoded) of each leg kind
LEGS = {
    Wire.VLLM: ("single", "prefill", "decode", "decode-lm-only"),
    Wire.SGLANG: ("single", "prefill", "decode"),
    Wire.TOKENSPEED: ("single", "prefill", "decode", "encode-0", "encode-1", "epd-prefill"),
}


#: the message type each wire's ``Generate`` legs carry
REQUEST_TYPES = {Wire.VLLM: vllm_engine_pb2.GenerateRequest, Wire.SGLANG: sglang_scheduler_pb2.GenerateRequest,
                 Wire.TOKENSPEED: tokenspeed_scheduler_pb2.GenerateRequest}


@contextmanager
def deterministic_shm() -> Iterator[None]:
    """Segment names ``mmgate-4242-<counter>`` and owner id ``mmgate-4242`` for one case, in a private folder on
    the same tmpfs: a gateway starting in another pytest-xdist worker sweeps dead creators' segments (pid 4242)
    from ``/dev/shm`` itself."""
    counter = iter(range(1, 1 << 20))
    real_getpid, real_secrets, real_dir = os.getpid, shm.secrets, shm.SHM_DIR
    with tempfile.TemporaryDirectory(dir=real_dir, prefix="wire-goldens-") as folder:
        os.getpid = lambda: 4242  # type: ignore[assignment]
        shm.secrets = types.SimpleNamespace(  # type: ignore[assignment]
            token_hex=lambda n: f"golden{next(counter):0{2 * n - 6}x}")
        shm.SHM_DIR = folder
        try:
            yield
        finally:
            os.getpid, shm.secrets, shm.SHM_DIR = real_getpid, real_secrets, real_dir  # type: ignore[assignment]


def _encode(wire: Wire, leg: str, prepared: PreparedRequest, plan: WirePlan, lease: ShmLease) -> bytes:
    adapter = ADAPTERS[wire]
    if not adapter.places_pending:
        prepared = asyncio.run(adapter.materialize(prepared))
    if leg.startswith("encode-"):
        encoded = adapter.encode_item(prepared, int(leg[7:]), ENCODERS[int(leg[7:])], plan, lease)  # type: ignore[attr-defined]
    elif leg == "epd-prefill":
        items = len(adapter.item_hashes(prepared))  # type: ignore[attr-defined]
        encoded = adapter.encode_epd_prefill(prepared, plan, lease, KV, ENCODERS[:items])  # type: ignore[attr-defined]
    else:
        role = Role(leg.split("-")[0])
        bootstrap = None if role is Role.SINGLE or wire is Wire.VLLM else KV
        kv = '{"remote":"kv"}' if wire is Wire.VLLM and role is Role.DECODE else None
        encoded = adapter.encode(prepared, role, plan, lease, bootstrap, kv, language_model_only=leg.endswith("lm-only"))
    asyncio.run(encoded.fill())
    return encoded.data


def digest(wire: Wire, leg: str, request: str, plan: str) -> str:
    """SHA-256 of one leg's bytes and its segments' contents, or ``error:<code>`` for a refusal."""
    prepared = requests()[request]()
    with deterministic_shm(), ShmLease() as lease:
        try:
            data = _encode(wire, leg, prepared, PLANS[plan], lease)
        except GatewayError as exc:
            return f"error:{exc.code.value}"
        kind = REQUEST_TYPES[wire] if not leg.startswith("encode-") else tokenspeed_encoder_pb2.EncodeRequest
        h = hashlib.sha256(str(len(data)).encode() + b"\0")
        h.update(kind.FromString(data).SerializeToString(deterministic=True))
        for name in lease.names:
            with open(os.path.join(shm.SHM_DIR, name), "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read())
    return h.hexdigest()


def cases() -> list[tuple[str, str, str, str]]:
    out = []
    for wire, legs in LEGS.items():
        for leg in legs:
            for request in requests():
                if leg.startswith("encode-") and request in ("text", "choice"):
                    continue
                if leg == "encode-1" and request not in ("two-images", "two-images-pending", "clip-and-image"):
                    continue
                for plan in PLANS:
                    out.append((wire.value, leg, request, plan))
    return out


def compute() -> dict[str, str]:
    return {"/".join(case): digest(Wire(case[0]), *case[1:]) for case in cases()}


#: produced by commit 05281ae's encoders (see the module docstring)
GOLDEN: dict[str, str] = {
    "sglang/decode/choice/inline": "965b662d75bcdf0d31303d25c3893b861ef96c2036d6e1aec155b52054554582",
    "sglang/decode/choice/inline-bf16": "965b662d75bcdf0d31303d25c3893b861ef96c2036d6e1aec155b52054554582",
    "sglang/decode/choice/shm": "965b662d75bcdf0d31303d25c3893b861ef96c2036d6e1aec155b52054554582",
    "sglang/decode/clip-and-image/inline": "error:multimodal_not_supported",
    "sglang/decode/clip-and-image/inline-bf16": "error:multimodal_not_supported",
    "sglang/decode/clip-and-image/shm": "error:multimodal_not_supported",
    "sglang/decode/clip/inline": "error:multimodal_not_supported",
    "sglang/decode/clip/inline-bf16": "error:multimodal_not_supported",
    "sglang/decode/clip/shm": "error:multimodal_not_supported",
    "sglang/decode/image-pending/inline": "6e9e735992fe2df11c13c956fe7630f539ba8204e9fb80fe79d3394e54d1710a",
    "sglang/decode/image-pending/inline-bf16": "6e9e735992fe2df11c13c956fe7630f539ba8204e9fb80fe79d3394e54d1710a",
    "sglang/decode/image-pending/shm": "6e9e735992fe2df11c13c956fe7630f539ba8204e9fb80fe79d3394e54d1710a",
    "sglang/decode/image/inline": "0bd03f4fbae896f09e8dc115ee105899604607d313ea4db6c41f1ab10ab9012f",
    "sglang/decode/image/inline-bf16": "0bd03f4fbae896f09e8dc115ee105899604607d313ea4db6c41f1ab10ab9012f",
    "sglang/decode/image/shm": "0bd03f4fbae896f09e8dc115ee105899604607d313ea4db6c41f1ab10ab9012f",
    "sglang/decode/text/inline": "a7644a1d2cb811f06cd868eab01006e075b468892d9713cddb9a6691e01dc055",
    "sglang/decode/text/inline-bf16": "a7644a1d2cb811f06cd868eab01006e075b468892d9713cddb9a6691e01dc055",
    "sglang/decode/text/shm": "a7644a1d2cb811f06cd868eab01006e075b468892d9713cddb9a6691e01dc055",
    "sglang/decode/two-images-pending/inline": "4dab5dc503469cfc82c8ca8b39be6916c3383cad3da1c1ff626fad9fe63c11e0",
    "sglang/decode/two-images-pending/inline-bf16": "4dab5dc503469cfc82c8ca8b39be6916c3383cad3da1c1ff626fad9fe63c11e0",
    "sglang/decode/two-images-pending/shm": "4dab5dc503469cfc82c8ca8b39be6916c3383cad3da1c1ff626fad9fe63c11e0",
    "sglang/decode/two-images/inline": "87e61ad876fb72e57a0ed805728b31415faba8d81a9ba5f3ab488e63c6588b65",
    "sglang/decode/two-images/inline-bf16": "87e61ad876fb72e57a0ed805728b31415faba8d81a9ba5f3ab488e63c6588b65",
    "sglang/decode/two-images/shm": "87e61ad876fb72e57a0ed805728b31415faba8d81a9ba5f3ab488e63c6588b65",
    "sglang/prefill/choice/inline": "965b662d75bcdf0d31303d25c3893b861ef96c2036d6e1aec155b52054554582",
    "sglang/prefill/choice/inline-bf16": "965b662d75bcdf0d31303d25c3893b861ef96c2036d6e1aec155b52054554582",
    "sglang/prefill/choice/shm": "965b662d75bcdf0d31303d25c3893b861ef96c2036d6e1aec155b52054554582",
    "sglang/prefill/clip-and-image/inline": "error:multimodal_not_supported",
    "sglang/prefill/clip-and-image/inline-bf16": "error:multimodal_not_supported",
    "sglang/prefill/clip-and-image/shm": "error:multimodal_not_supported",
    "sglang/prefill/clip/inline": "error:multimodal_not_supported",
    "sglang/prefill/clip/inline-bf16": "error:multimodal_not_supported",
    "sglang/prefill/clip/shm": "error:multimodal_not_supported",
    "sglang/prefill/image-pending/inline": "65cc41393060f683afffb0466ba46297d4dd6ab0db17f50bb0c3d5f2474747a2",
    "sglang/prefill/image-pending/inline-bf16": "f686c765f9893756f3457abbc20618d097d4a54e2e0b15401a836d6a0c50a331",
    "sglang/prefill/image-pending/shm": "65cc41393060f683afffb0466ba46297d4dd6ab0db17f50bb0c3d5f2474747a2",
    "sglang/prefill/image/inline": "fe49963368dd4551f8b6908d416a6771565dd39331f51320b1c6f821e82af1aa",
    "sglang/prefill/image/inline-bf16": "3d7887f39075706d2e0226bbea0bc519a977f5889c7224a16a000d929f936af5",
    "sglang/prefill/image/shm": "fe49963368dd4551f8b6908d416a6771565dd39331f51320b1c6f821e82af1aa",
    "sglang/prefill/text/inline": "a7644a1d2cb811f06cd868eab01006e075b468892d9713cddb9a6691e01dc055",
    "sglang/prefill/text/inline-bf16": "a7644a1d2cb811f06cd868eab01006e075b468892d9713cddb9a6691e01dc055",
    "sglang/prefill/text/shm": "a7644a1d2cb811f06cd868eab01006e075b468892d9713cddb9a6691e01dc055",
    "sglang/prefill/two-images-pending/inline": "009547e90985d7a131af1ef1a01813c223d081851b9b68a0238196041028ec44",
    "sglang/prefill/two-images-pending/inline-bf16": "3a2977bda1eae65d7ab49179dd7c042172e8e2637494595f4df361574871e3c6",
    "sglang/prefill/two-images-pending/shm": "009547e90985d7a131af1ef1a01813c223d081851b9b68a0238196041028ec44",
    "sglang/prefill/two-images/inline": "0cf21a903ff8b6f11d76c5f51c16f1ea6e3a816c686d9b1511c0db5c5d743ed2",
    "sglang/prefill/two-images/inline-bf16": "5f06345264f70278c3c309c8163716170c7f39c9f4405fbfc951f5afd9be26fc",
    "sglang/prefill/two-images/shm": "0cf21a903ff8b6f11d76c5f51c16f1ea6e3a816c686d9b1511c0db5c5d743ed2",
    "sglang/single/choice/inline": "71951661232b480f36bca8a12194813ca5edbb6dd42e96467506ccb397ed90a8",
    "sglang/single/choice/inline-bf16": "71951661232b480f36bca8a12194813ca5edbb6dd42e96467506ccb397ed90a8",
    "sglang/single/choice/shm": "71951661232b480f36bca8a12194813ca5edbb6dd42e96467506ccb397ed90a8",
    "sglang/single/clip-and-image/inline": "error:multimodal_not_supported",
    "sglang/single/clip-and-image/inline-bf16": "error:multimodal_not_supported",
    "sglang/single/clip-and-image/shm": "error:multimodal_not_supported",
    "sglang/single/clip/inline": "error:multimodal_not_supported",
    "sglang/single/clip/inline-bf16": "error:multimodal_not_supported",
    "sglang/single/clip/shm": "error:multimodal_not_supported",
    "sglang/single/image-pending/inline": "00d90b1b93b29ea89cdb89e3731806063dd10097a92b149ac09e1556d031b1c3",
    "sglang/single/image-pending/inline-bf16": "759a6502f3f3cf7bda1ebd6223198d688ba0b9e3eca9c0d2e7d6d49b3a11cc3c",
    "sglang/single/image-pending/shm": "00d90b1b93b29ea89cdb89e3731806063dd10097a92b149ac09e1556d031b1c3",
    "sglang/single/image/inline": "e6b905ecf161b89ed140ea2ccdfcced2419559ba2bdc19ca6e67b96f5a27ea95",
    "sglang/single/image/inline-bf16": "e95e2f0d710f82165b0fbb1cbeb011f8e2980115de657fb6c12387e00ee5d1db",
    "sglang/single/image/shm": "e6b905ecf161b89ed140ea2ccdfcced2419559ba2bdc19ca6e67b96f5a27ea95",
    "sglang/single/text/inline": "b618f4384d825d2995efc01be764f3b54733b62de326754b31f224c288706fc4",
    "sglang/single/text/inline-bf16": "b618f4384d825d2995efc01be764f3b54733b62de326754b31f224c288706fc4",
    "sglang/single/text/shm": "b618f4384d825d2995efc01be764f3b54733b62de326754b31f224c288706fc4",
    "sglang/single/two-images-pending/inline": "cbe1cffb126473db5fc6a87a167dfd34550f2a81167d011c1983959fdbdccd66",
    "sglang/single/two-images-pending/inline-bf16": "c52ea7f11df5d2be65d42bb4b31a7fc51711fdc8a125c283620c5ce669858e4d",
    "sglang/single/two-images-pending/shm": "cbe1cffb126473db5fc6a87a167dfd34550f2a81167d011c1983959fdbdccd66",
    "sglang/single/two-images/inline": "27142e3dee57f94ce1434ecc5ef0c448622cbae5680194504b5fe012c131a870",
    "sglang/single/two-images/inline-bf16": "825d03147fdf879e836d1a7840b8c746f48de43c1a9c9782764d3963a433f879",
    "sglang/single/two-images/shm": "27142e3dee57f94ce1434ecc5ef0c448622cbae5680194504b5fe012c131a870",
    "tokenspeed/decode/choice/inline": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/decode/choice/inline-bf16": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/decode/choice/shm": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/decode/clip-and-image/inline": "b37155ea7bae30994fd66b5a85a60c9416dc74039a6bfa39411f8abe4bc58cf6",
    "tokenspeed/decode/clip-and-image/inline-bf16": "b37155ea7bae30994fd66b5a85a60c9416dc74039a6bfa39411f8abe4bc58cf6",
    "tokenspeed/decode/clip-and-image/shm": "b37155ea7bae30994fd66b5a85a60c9416dc74039a6bfa39411f8abe4bc58cf6",
    "tokenspeed/decode/clip/inline": "edb552a2f3ce8a322f93f180075f3941070c4a699a9903d30717154065fd87c5",
    "tokenspeed/decode/clip/inline-bf16": "edb552a2f3ce8a322f93f180075f3941070c4a699a9903d30717154065fd87c5",
    "tokenspeed/decode/clip/shm": "edb552a2f3ce8a322f93f180075f3941070c4a699a9903d30717154065fd87c5",
    "tokenspeed/decode/image-pending/inline": "7e7809578f4de45a6381709828c99932a620ac9f35c4f0104fc93cae7a64bd78",
    "tokenspeed/decode/image-pending/inline-bf16": "7e7809578f4de45a6381709828c99932a620ac9f35c4f0104fc93cae7a64bd78",
    "tokenspeed/decode/image-pending/shm": "7e7809578f4de45a6381709828c99932a620ac9f35c4f0104fc93cae7a64bd78",
    "tokenspeed/decode/image/inline": "0e3fd99c9fc6e187499fec5919572fd7bbc25aed40cc364dbb0e40a2eb762bb4",
    "tokenspeed/decode/image/inline-bf16": "0e3fd99c9fc6e187499fec5919572fd7bbc25aed40cc364dbb0e40a2eb762bb4",
    "tokenspeed/decode/image/shm": "0e3fd99c9fc6e187499fec5919572fd7bbc25aed40cc364dbb0e40a2eb762bb4",
    "tokenspeed/decode/text/inline": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/decode/text/inline-bf16": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/decode/text/shm": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/decode/two-images-pending/inline": "5c2ab57fa152bfde435fde41c2e2222a09102d350d7060ec032cd0c3bcf485c8",
    "tokenspeed/decode/two-images-pending/inline-bf16": "5c2ab57fa152bfde435fde41c2e2222a09102d350d7060ec032cd0c3bcf485c8",
    "tokenspeed/decode/two-images-pending/shm": "5c2ab57fa152bfde435fde41c2e2222a09102d350d7060ec032cd0c3bcf485c8",
    "tokenspeed/decode/two-images/inline": "668247b3c4dd8aaf15f0b38d6995438c4d90692ebd273e7e9a5c2994da35d88a",
    "tokenspeed/decode/two-images/inline-bf16": "668247b3c4dd8aaf15f0b38d6995438c4d90692ebd273e7e9a5c2994da35d88a",
    "tokenspeed/decode/two-images/shm": "668247b3c4dd8aaf15f0b38d6995438c4d90692ebd273e7e9a5c2994da35d88a",
    "tokenspeed/encode-0/clip-and-image/inline": "f72b332fbc41cc7ef16575e2c42952fbac03cea09616c9dd3bfc750640e2ab98",
    "tokenspeed/encode-0/clip-and-image/inline-bf16": "6735a208f167b862ba0a546f677bc55c4d39d7101b242f0452084ac7ed37d77b",
    "tokenspeed/encode-0/clip-and-image/shm": "574534b9f0213a90d9f6087a50c83d7fa3f706f5009d1c9d86e74adef72385c2",
    "tokenspeed/encode-0/clip/inline": "a6a510698b40151db3ecad974b4250ac58c404faca62a423a052e0dc400d8165",
    "tokenspeed/encode-0/clip/inline-bf16": "37d99df8cfce8c8915807460f08d681de3c0f02898d70717ec289f20951b23a8",
    "tokenspeed/encode-0/clip/shm": "1fb026e0e440ccf35e5102e8c0aa13093956f3772d8de390241a6afe4b8cf1c8",
    "tokenspeed/encode-0/image-pending/inline": "26fdfbb6323827ad00f64f42b714c2431d61e76ca67c0122954b8da7ca56c511",
    "tokenspeed/encode-0/image-pending/inline-bf16": "cb60384d2246aff4f1a2c5220ef39828af7253561c331671efa0cc5d293b307a",
    "tokenspeed/encode-0/image-pending/shm": "cb294da52142553876a71fd9434e1f198379687bfe789f8147f58498f9a8ed8d",
    "tokenspeed/encode-0/image/inline": "6a392b28bd2a665e1ebc15a353a96122c4832791707a284a9177bbcc4e997cbb",
    "tokenspeed/encode-0/image/inline-bf16": "3419dd7269ed9e705bb9802bc4a07d60cfb9d2ace9a097c872723b4254e4f7f5",
    "tokenspeed/encode-0/image/shm": "675f01e4ceac3500ea60d961b99bcf9a6e6cefa88ddf4c4125c5258bb419160e",
    "tokenspeed/encode-0/two-images-pending/inline": "175b8c4284e85c2f7d5548b678b1734de2524ccefe7d8fd15873b093e6bf7ed0",
    "tokenspeed/encode-0/two-images-pending/inline-bf16": "d8975261011e1ee65b2c275813d50cb9d2e7f6ce4efa3d0c614e683159faa8ad",
    "tokenspeed/encode-0/two-images-pending/shm": "44230da9ad38cc7d147f317df39a661ddcd028b766279c334a7eedb44d90ca27",
    "tokenspeed/encode-0/two-images/inline": "ca5d264aee38dd322ea5431898c2825abded17ba975ab7cf533df087f9c7a4f8",
    "tokenspeed/encode-0/two-images/inline-bf16": "e69f1a375cfca9b7d4575e73b40197e7d58e24647ce7f9e28994662d3a3ce5a4",
    "tokenspeed/encode-0/two-images/shm": "83d8da03ba3cce6142f392b08674b0ab7cc95639f1ece45e3b422610689f959b",
    "tokenspeed/encode-1/clip-and-image/inline": "5b65f1a9c7e44c86e865a97872f0d54d9c63ccd947e1304e00710848a1b15156",
    "tokenspeed/encode-1/clip-and-image/inline-bf16": "b769f52df720cd4a3e33133debb2f077138bec5504dcddff2f18e1a1d3c44f31",
    "tokenspeed/encode-1/clip-and-image/shm": "34214e87c1068593c0a86107e8bfc0147c0b302f3c8112a758cc924caad5571e",
    "tokenspeed/encode-1/two-images-pending/inline": "015fe98d851b481b265cb1401bd090c6173ab1d4a10ba68f39afaa1dc0985d1c",
    "tokenspeed/encode-1/two-images-pending/inline-bf16": "163c60c5dbe94bf218ecc7b71ce8a3c1f4cce9d78402e8b84b12917caa1c3791",
    "tokenspeed/encode-1/two-images-pending/shm": "184eb72937b683bcf79c487c81eb7e8e95f6855522f4dab9a1dcb035ad9a2123",
    "tokenspeed/encode-1/two-images/inline": "822899da41bd9d3cadc8b9cc839915a51d8afe79a5533530100fd7ee0098c33a",
    "tokenspeed/encode-1/two-images/inline-bf16": "ad517e6d08b367926d2e465676ac6b37dda5c514c8593905917106d484c2ccc1",
    "tokenspeed/encode-1/two-images/shm": "eb44369ff724b0c53bafaf1dd9707fdb198d82948b771f8cb4fb1745ae3f22f1",
    "tokenspeed/epd-prefill/choice/inline": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/epd-prefill/choice/inline-bf16": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/epd-prefill/choice/shm": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/epd-prefill/clip-and-image/inline": "3d418c50ec1f72b1d5f5df81e1cb034dbff1f2b3591db08c184839f808e46649",
    "tokenspeed/epd-prefill/clip-and-image/inline-bf16": "3d418c50ec1f72b1d5f5df81e1cb034dbff1f2b3591db08c184839f808e46649",
    "tokenspeed/epd-prefill/clip-and-image/shm": "3d418c50ec1f72b1d5f5df81e1cb034dbff1f2b3591db08c184839f808e46649",
    "tokenspeed/epd-prefill/clip/inline": "eab6153aaff08850fc36333d5979ac28b58e84749dbb5764d95a5a1300681ccd",
    "tokenspeed/epd-prefill/clip/inline-bf16": "eab6153aaff08850fc36333d5979ac28b58e84749dbb5764d95a5a1300681ccd",
    "tokenspeed/epd-prefill/clip/shm": "eab6153aaff08850fc36333d5979ac28b58e84749dbb5764d95a5a1300681ccd",
    "tokenspeed/epd-prefill/image-pending/inline": "18b2e71f6ef0e439120010b99bea43b190d6ee68f7fb87128ae8e82b338f8274",
    "tokenspeed/epd-prefill/image-pending/inline-bf16": "18b2e71f6ef0e439120010b99bea43b190d6ee68f7fb87128ae8e82b338f8274",
    "tokenspeed/epd-prefill/image-pending/shm": "18b2e71f6ef0e439120010b99bea43b190d6ee68f7fb87128ae8e82b338f8274",
    "tokenspeed/epd-prefill/image/inline": "e0240a20ea3becc4b2b5b6fc443ca08f69fa1cdac390a14a72776d66af568bc9",
    "tokenspeed/epd-prefill/image/inline-bf16": "e0240a20ea3becc4b2b5b6fc443ca08f69fa1cdac390a14a72776d66af568bc9",
    "tokenspeed/epd-prefill/image/shm": "e0240a20ea3becc4b2b5b6fc443ca08f69fa1cdac390a14a72776d66af568bc9",
    "tokenspeed/epd-prefill/text/inline": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/epd-prefill/text/inline-bf16": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/epd-prefill/text/shm": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/epd-prefill/two-images-pending/inline": "6e888893b4d05e863e74ad5b9e0b5d41e0dec8e146155fced81a4ca65de7f941",
    "tokenspeed/epd-prefill/two-images-pending/inline-bf16": "6e888893b4d05e863e74ad5b9e0b5d41e0dec8e146155fced81a4ca65de7f941",
    "tokenspeed/epd-prefill/two-images-pending/shm": "6e888893b4d05e863e74ad5b9e0b5d41e0dec8e146155fced81a4ca65de7f941",
    "tokenspeed/epd-prefill/two-images/inline": "e673051b9478ed819d6ed006e3b6ade2985dd76d3a08c91dc45735518658ac93",
    "tokenspeed/epd-prefill/two-images/inline-bf16": "e673051b9478ed819d6ed006e3b6ade2985dd76d3a08c91dc45735518658ac93",
    "tokenspeed/epd-prefill/two-images/shm": "e673051b9478ed819d6ed006e3b6ade2985dd76d3a08c91dc45735518658ac93",
    "tokenspeed/prefill/choice/inline": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/prefill/choice/inline-bf16": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/prefill/choice/shm": "0c1835194751b732facd4b14e6513942ddc64d73e4ff368813a898532b107192",  # CHANGED
    "tokenspeed/prefill/clip-and-image/inline": "4689e134f35276a02735fdc5b2519fe5cddb0583c8f1d65156a2b31784c5efeb",
    "tokenspeed/prefill/clip-and-image/inline-bf16": "b5874887478b3e1047870d4787a2b3f6ce8a645c0f87ceb392b5a9b5b7482beb",
    "tokenspeed/prefill/clip-and-image/shm": "66a79eac8491d3a0a82f5e778a49831b610ffbaeda645dcffbdd0e787fdd6ca2",
    "tokenspeed/prefill/clip/inline": "6ed5aadb5c6e70c037e38429d6b3357c990b4890955bd2104a45bfed34e718fe",
    "tokenspeed/prefill/clip/inline-bf16": "b48a04f5fafa0884185464f61b6b72736a5afda4f2d508aa4e2b714480dc005e",
    "tokenspeed/prefill/clip/shm": "8fe9cf6169e666bfe8833dd4042f4ea174aeb3032e1ca13641c9ce93800ae546",
    "tokenspeed/prefill/image-pending/inline": "ed47ebc34f66e1132517fbd91381444f54bdf315d2f26d3e22bb0451475ef4ea",
    "tokenspeed/prefill/image-pending/inline-bf16": "a1301cdc91d73a8a288a61253646c136709f02dce7f26e243f88827b19efb3c7",
    "tokenspeed/prefill/image-pending/shm": "8bbb4ab176568f3fd62f42f8c1bc5f18880f06a5e71910433d011b266595dfff",
    "tokenspeed/prefill/image/inline": "caa6abefad854acefbbcc03071bda6aa478049c7e54d12cf129f3ec1f2fa41ab",
    "tokenspeed/prefill/image/inline-bf16": "dacb187e264bd5cea751ea2e6ba41e372cd229cc7d801e0d7f3f268fe202f294",
    "tokenspeed/prefill/image/shm": "5112767f549ce5494ea80bcba5a8d89130e6044a62ae8e3d93dc4622a0665769",
    "tokenspeed/prefill/text/inline": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/prefill/text/inline-bf16": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/prefill/text/shm": "a00dc737612bb6796f9ae48a7930a73c9d0851074399a09b71356b6182a1f458",
    "tokenspeed/prefill/two-images-pending/inline": "a8dd745dfa344133d0031f51a3783c02d83a3224882d56ff59593a50f05abad9",
    "tokenspeed/prefill/two-images-pending/inline-bf16": "52003cc2087b3444b0c20f4ec9a1f72e99f5e6b80e9b038534395765752b2280",
    "tokenspeed/prefill/two-images-pending/shm": "add6db6c2814225082b343587d2697d0184ee78ed4c7c2a529c934a3d04333b8",
    "tokenspeed/prefill/two-images/inline": "d51dac4908635e6f9b1076fd49750e7b0b4765f8815a80aafe0416339dac67b1",
    "tokenspeed/prefill/two-images/inline-bf16": "98a2574b314e4d2a94da3ecbdc9b1febe0fd1108fc02c11c5f7e64d70685443d",
    "tokenspeed/prefill/two-images/shm": "502c3dad25e2817e930a41d728e5163ea8cdcd05936638a854b5cfbbf905039a",
    "tokenspeed/single/choice/inline": "e18c66102fdd8150c569d0192446c6c4eb8760ae1a0da6c514b74b99325084dd",  # CHANGED
    "tokenspeed/single/choice/inline-bf16": "e18c66102fdd8150c569d0192446c6c4eb8760ae1a0da6c514b74b99325084dd",  # CHANGED
    "tokenspeed/single/choice/shm": "e18c66102fdd8150c569d0192446c6c4eb8760ae1a0da6c514b74b99325084dd",  # CHANGED
    "tokenspeed/single/clip-and-image/inline": "03653f29f96527c93b790a0e5fa8af001545d378a5920e499d09447f50ca5ab6",
    "tokenspeed/single/clip-and-image/inline-bf16": "6676622245775846045530f6b9259b305bcdbc1638e101126d548087d3056eee",
    "tokenspeed/single/clip-and-image/shm": "df82f60af4e82f2867cc7d86b14b52f970f91cf7718fa0525b943e0116619f3c",
    "tokenspeed/single/clip/inline": "a1b090ae8d392f959060d2231f4233020407a82c66fa719e7199c85f99c5fc45",
    "tokenspeed/single/clip/inline-bf16": "26bf33c3e8ec27608bca5bb0cf2e826162a683e396f977cf7656cd5ef6c7d4c5",
    "tokenspeed/single/clip/shm": "0a8ce020b46ad5499bc93f251de303e293b0b3a8aa0d663ce0d63c3a89a259e3",
    "tokenspeed/single/image-pending/inline": "e9d62c68b200117b59e8752194be9b7c4552885783d2fb4dd6db4769d15f3e01",
    "tokenspeed/single/image-pending/inline-bf16": "311ed22d85863980cf579d8acd77a4d453c026ec90915ecbc905d4a77de724f2",
    "tokenspeed/single/image-pending/shm": "0cfa97fca6e8b95c390eb3bfd6ddd6fdfbeae1497ec9e46f21b86bdf6317b04f",
    "tokenspeed/single/image/inline": "ffe65e41c9d4cbba8d20fd33e5e50bfdf0290bb70922e65dda472ed06aee86ff",
    "tokenspeed/single/image/inline-bf16": "bd40bd0abe42e29b198da46e1a4f6f96229020a8c23ae8b5b152632c2938d52a",
    "tokenspeed/single/image/shm": "50823e5557f762eb264959c6b117401a07d72180322575b24bc7515cc2f1881c",
    "tokenspeed/single/text/inline": "ca1b1679566c61fa7a5fafd6e3db2aa43381c75e632f21cb076e4638482c7b97",
    "tokenspeed/single/text/inline-bf16": "ca1b1679566c61fa7a5fafd6e3db2aa43381c75e632f21cb076e4638482c7b97",
    "tokenspeed/single/text/shm": "ca1b1679566c61fa7a5fafd6e3db2aa43381c75e632f21cb076e4638482c7b97",
    "tokenspeed/single/two-images-pending/inline": "7f4731350e18773667b5c6b39054191526998dcb53ac7b19a79e33c6f1385375",
    "tokenspeed/single/two-images-pending/inline-bf16": "cabc79321d3ee1c3a8b21b08e2682a884498e6ead988b7efae3e5e3741f56396",
    "tokenspeed/single/two-images-pending/shm": "c8464704b83d7b07b68db94c63170f122c8bf015c8d35fe4b90c65a37cb23619",
    "tokenspeed/single/two-images/inline": "374e0d12dc053aa1657bd9dce06671829a2597cce6507a08f0ef77154a5b5dbd",
    "tokenspeed/single/two-images/inline-bf16": "5cf4d0a5df5a45255657c1ce697b0c7e1794a93ef86e7b1e619457302aac6932",
    "tokenspeed/single/two-images/shm": "717bfcf226347d803c9aa145b1f789366eb6ee1ebdad6850767aee8b6bb67e92",
    "vllm/decode-lm-only/choice/inline": "5546438ead00278b43aa3cc80eed067d4c93ffdbdb83aeb57e7c6562348f3f82",
    "vllm/decode-lm-only/choice/inline-bf16": "5546438ead00278b43aa3cc80eed067d4c93ffdbdb83aeb57e7c6562348f3f82",
    "vllm/decode-lm-only/choice/shm": "5546438ead00278b43aa3cc80eed067d4c93ffdbdb83aeb57e7c6562348f3f82",
    "vllm/decode-lm-only/clip-and-image/inline": "9444bc64cafc724cd08c98caba3dfcc7c27ba32af9f25685959bcf7e1eb41651",
    "vllm/decode-lm-only/clip-and-image/inline-bf16": "9444bc64cafc724cd08c98caba3dfcc7c27ba32af9f25685959bcf7e1eb41651",
    "vllm/decode-lm-only/clip-and-image/shm": "9444bc64cafc724cd08c98caba3dfcc7c27ba32af9f25685959bcf7e1eb41651",
    "vllm/decode-lm-only/clip/inline": "c1da933a0ab4ab9bc3c675256a5222e459371961e3a610c946a7892e6738dd99",
    "vllm/decode-lm-only/clip/inline-bf16": "c1da933a0ab4ab9bc3c675256a5222e459371961e3a610c946a7892e6738dd99",
    "vllm/decode-lm-only/clip/shm": "c1da933a0ab4ab9bc3c675256a5222e459371961e3a610c946a7892e6738dd99",
    "vllm/decode-lm-only/image-pending/inline": "9565c8497f9fb2d44e1742675a389bb8c927df8f1d81e502b057aa4a207b4a9c",
    "vllm/decode-lm-only/image-pending/inline-bf16": "9565c8497f9fb2d44e1742675a389bb8c927df8f1d81e502b057aa4a207b4a9c",
    "vllm/decode-lm-only/image-pending/shm": "9565c8497f9fb2d44e1742675a389bb8c927df8f1d81e502b057aa4a207b4a9c",
    "vllm/decode-lm-only/image/inline": "2f19aa30959d22cbba2cd10620edd5a6aad16c0a3bae1c4a818194ed46f0baf5",
    "vllm/decode-lm-only/image/inline-bf16": "2f19aa30959d22cbba2cd10620edd5a6aad16c0a3bae1c4a818194ed46f0baf5",
    "vllm/decode-lm-only/image/shm": "2f19aa30959d22cbba2cd10620edd5a6aad16c0a3bae1c4a818194ed46f0baf5",
    "vllm/decode-lm-only/text/inline": "647c8550042bdb85c81b79ee4fd3b9736d5a230dcdaa056dbd0bb8985be363bd",
    "vllm/decode-lm-only/text/inline-bf16": "647c8550042bdb85c81b79ee4fd3b9736d5a230dcdaa056dbd0bb8985be363bd",
    "vllm/decode-lm-only/text/shm": "647c8550042bdb85c81b79ee4fd3b9736d5a230dcdaa056dbd0bb8985be363bd",
    "vllm/decode-lm-only/two-images-pending/inline": "0c20c58be3a7278b500b2dd5cc36651fc3f86ebe64d6ab2744154f731a43d49f",
    "vllm/decode-lm-only/two-images-pending/inline-bf16": "0c20c58be3a7278b500b2dd5cc36651fc3f86ebe64d6ab2744154f731a43d49f",
    "vllm/decode-lm-only/two-images-pending/shm": "0c20c58be3a7278b500b2dd5cc36651fc3f86ebe64d6ab2744154f731a43d49f",
    "vllm/decode-lm-only/two-images/inline": "858483df0e056c3d17160ef776f04f0b38da4c3c7fc64ba5498fc72b242b85b1",
    "vllm/decode-lm-only/two-images/inline-bf16": "858483df0e056c3d17160ef776f04f0b38da4c3c7fc64ba5498fc72b242b85b1",
    "vllm/decode-lm-only/two-images/shm": "858483df0e056c3d17160ef776f04f0b38da4c3c7fc64ba5498fc72b242b85b1",
    "vllm/decode/choice/inline": "5546438ead00278b43aa3cc80eed067d4c93ffdbdb83aeb57e7c6562348f3f82",
    "vllm/decode/choice/inline-bf16": "5546438ead00278b43aa3cc80eed067d4c93ffdbdb83aeb57e7c6562348f3f82",
    "vllm/decode/choice/shm": "5546438ead00278b43aa3cc80eed067d4c93ffdbdb83aeb57e7c6562348f3f82",
    "vllm/decode/clip-and-image/inline": "bb6e0c717a8db41c8996f74b2112c20f8d9d35de5969a32e16ae27d6ad89443b",
    "vllm/decode/clip-and-image/inline-bf16": "bb6e0c717a8db41c8996f74b2112c20f8d9d35de5969a32e16ae27d6ad89443b",
    "vllm/decode/clip-and-image/shm": "bb6e0c717a8db41c8996f74b2112c20f8d9d35de5969a32e16ae27d6ad89443b",
    "vllm/decode/clip/inline": "105343c8e49196ce4b3aa650fe95d775dd4d99cf85021dfa81b1f6318e147977",
    "vllm/decode/clip/inline-bf16": "105343c8e49196ce4b3aa650fe95d775dd4d99cf85021dfa81b1f6318e147977",
    "vllm/decode/clip/shm": "105343c8e49196ce4b3aa650fe95d775dd4d99cf85021dfa81b1f6318e147977",
    "vllm/decode/image-pending/inline": "cfc9a7bc46c49c0f8c47b13f37e7cea0453a848422adddb7952b6b93f8b1d98b",
    "vllm/decode/image-pending/inline-bf16": "cfc9a7bc46c49c0f8c47b13f37e7cea0453a848422adddb7952b6b93f8b1d98b",
    "vllm/decode/image-pending/shm": "cfc9a7bc46c49c0f8c47b13f37e7cea0453a848422adddb7952b6b93f8b1d98b",
    "vllm/decode/image/inline": "71d5f9080fc2a2cfee82d6242825a5cd31f8b2c1ef72acbea9307980db31b6c3",
    "vllm/decode/image/inline-bf16": "71d5f9080fc2a2cfee82d6242825a5cd31f8b2c1ef72acbea9307980db31b6c3",
    "vllm/decode/image/shm": "71d5f9080fc2a2cfee82d6242825a5cd31f8b2c1ef72acbea9307980db31b6c3",
    "vllm/decode/text/inline": "647c8550042bdb85c81b79ee4fd3b9736d5a230dcdaa056dbd0bb8985be363bd",
    "vllm/decode/text/inline-bf16": "647c8550042bdb85c81b79ee4fd3b9736d5a230dcdaa056dbd0bb8985be363bd",
    "vllm/decode/text/shm": "647c8550042bdb85c81b79ee4fd3b9736d5a230dcdaa056dbd0bb8985be363bd",
    "vllm/decode/two-images-pending/inline": "6b0a6c30774698ff64b4836a52b17275db67c02576fc425a2be788a577f73a29",
    "vllm/decode/two-images-pending/inline-bf16": "6b0a6c30774698ff64b4836a52b17275db67c02576fc425a2be788a577f73a29",
    "vllm/decode/two-images-pending/shm": "6b0a6c30774698ff64b4836a52b17275db67c02576fc425a2be788a577f73a29",
    "vllm/decode/two-images/inline": "80fce4390aed8debcd59da840afcf89dacb172f374f00efd66943e8f26bf7b5c",
    "vllm/decode/two-images/inline-bf16": "80fce4390aed8debcd59da840afcf89dacb172f374f00efd66943e8f26bf7b5c",
    "vllm/decode/two-images/shm": "80fce4390aed8debcd59da840afcf89dacb172f374f00efd66943e8f26bf7b5c",
    "vllm/prefill/choice/inline": "50bfe751113bcd3cf92a3b3171e94017451af2b425200e49639e614f1ace0deb",
    "vllm/prefill/choice/inline-bf16": "50bfe751113bcd3cf92a3b3171e94017451af2b425200e49639e614f1ace0deb",
    "vllm/prefill/choice/shm": "50bfe751113bcd3cf92a3b3171e94017451af2b425200e49639e614f1ace0deb",
    "vllm/prefill/clip-and-image/inline": "b71c6f9db528a82b21951a7e1aff643dc8e74ac7c3cd4baa5b578a0b7ae45e5c",
    "vllm/prefill/clip-and-image/inline-bf16": "36aa4659153589d77d3baa5dcb20986e26f06af88387345effaee0bae8c46232",
    "vllm/prefill/clip-and-image/shm": "3a7deb5f40ec452f35be64253219474850e59940339c7f23758a88a4bdc0b26c",
    "vllm/prefill/clip/inline": "73f78401e361689e4e23a9ce198d10d44599417c2a49dc658010c9f0b2625659",
    "vllm/prefill/clip/inline-bf16": "9b3dc736c17203b7f2548b65c7976275facd8465ff33868eec4da6c42f917c9e",
    "vllm/prefill/clip/shm": "04e0c454cceaa2ca1ca3115d36a09a550fa0a5503b02d157f7fd38305329bcf1",
    "vllm/prefill/image-pending/inline": "95240a686fb1ee25627cc03930a4b301505ccd512b3f7eed650482dc73cf6a5b",
    "vllm/prefill/image-pending/inline-bf16": "b816a6f48632e90ce07c4643d8ad7cdd068b7061b7458fd2c6e09121eca7cbf5",
    "vllm/prefill/image-pending/shm": "4b64f0b0a9f496d6c4d7b02cec27b0942fe376a3cb926e6fec32e29e31049f17",
    "vllm/prefill/image/inline": "e30662e2f465fe91be52bb9c0a91ced878b75947c52a41fba0f9e16705f8cfe0",
    "vllm/prefill/image/inline-bf16": "5e6734b5115d5ec9f857c0829d567254ae8e07fa343434174201bd595ea2451b",
    "vllm/prefill/image/shm": "d8afac809b6c6caae9dc266a870eb72cd90cb5b5c792b87159a2ae4201f26f04",
    "vllm/prefill/text/inline": "2f72cb0dd0ed70ef52262d9ddb4d2625ecbc31ae9a238b7dbbb7d7b58d9b43aa",
    "vllm/prefill/text/inline-bf16": "2f72cb0dd0ed70ef52262d9ddb4d2625ecbc31ae9a238b7dbbb7d7b58d9b43aa",
    "vllm/prefill/text/shm": "2f72cb0dd0ed70ef52262d9ddb4d2625ecbc31ae9a238b7dbbb7d7b58d9b43aa",
    "vllm/prefill/two-images-pending/inline": "6e9aa41327e0cd3847c899fb0000b13d6b0612b391fa9c153286d3bfde03b983",
    "vllm/prefill/two-images-pending/inline-bf16": "1e0fa574eb6561470b10732ba6749fa79f588e917962eee5a08f7ac184a4741d",
    "vllm/prefill/two-images-pending/shm": "1bb2a8c2b2bea544bf7acf0aba734ee348bf6f563ebcca36e8ac5f3497f51c42",
    "vllm/prefill/two-images/inline": "f8787a08577b54ef02249134833147f682ec6c06331fc6a1c27812ccf496410c",
    "vllm/prefill/two-images/inline-bf16": "538538bfd9480160af8cf6ac643afc76c9f06d5b2593ccaa0edfd0487e81d873",
    "vllm/prefill/two-images/shm": "b58f672ff477ffe8a3441127645720bda532e5490b3aedb04f219a82c5715faa",
    "vllm/single/choice/inline": "797fafaa2a805fbd06910a982bbe1d4705547db65220717a7004588f4d1c1ffa",
    "vllm/single/choice/inline-bf16": "797fafaa2a805fbd06910a982bbe1d4705547db65220717a7004588f4d1c1ffa",
    "vllm/single/choice/shm": "797fafaa2a805fbd06910a982bbe1d4705547db65220717a7004588f4d1c1ffa",
    "vllm/single/clip-and-image/inline": "1ee13ca52bec96a1c1c378c696fab3c20052f3d2933eee1a1f5298d103f92524",
    "vllm/single/clip-and-image/inline-bf16": "f1a937db1bd822e074bf8e8a71045e5426749576fbd2a2926eb8206822cc366a",
    "vllm/single/clip-and-image/shm": "60f8e55cc4b8ac77213a18855b2252930e40505854660ad521b516d43fcb9295",
    "vllm/single/clip/inline": "9df64021e13a944becf4353f0333ba249a95f9d807de8d0ecec686e152ba30a5",
    "vllm/single/clip/inline-bf16": "d414cd1fae8d02f3dfbb43481bd82f351ebe0641d2331698b02d957cfee7764f",
    "vllm/single/clip/shm": "4c88e9f2f35031cc3fb6e89cdd0ec4f9cf35d08936a0fe968b8a706fc5970940",
    "vllm/single/image-pending/inline": "c4b10151720ac98d513e708322ed2c77f11decaadadc8abdd3eb705c26c1a52b",
    "vllm/single/image-pending/inline-bf16": "f3b03b61636cca3a1b595eb111bceb44d5510250eb5a416e6e4645a30fbe9590",
    "vllm/single/image-pending/shm": "ae0e64a4ab6ef94f6488ca07b4974b7b7a9c1773b04297387c3384583147ce14",
    "vllm/single/image/inline": "cef6d3d16b33c46661a6c70fe9bc4201bc28b92eeace85f79c208dd78244d5f1",
    "vllm/single/image/inline-bf16": "2bb2bcb5ead616af84c720451bfd32b89512628bba9546ea00783e0ba5e36266",
    "vllm/single/image/shm": "5adc1261e27c289c253501e7337d55503caa8796f0ddb2bcf99c64305d633762",
    "vllm/single/text/inline": "c7546d62df9db8176b143c41d29bd51cc139b804809c239082199a838bbdfd75",
    "vllm/single/text/inline-bf16": "c7546d62df9db8176b143c41d29bd51cc139b804809c239082199a838bbdfd75",
    "vllm/single/text/shm": "c7546d62df9db8176b143c41d29bd51cc139b804809c239082199a838bbdfd75",
    "vllm/single/two-images-pending/inline": "d2a4bb223643468d3bd92a2e9a2903052ac6c3bb7b79a837140a164664b78eb7",
    "vllm/single/two-images-pending/inline-bf16": "ecc3095ca9e9a8ffb4ac860da13df7f9f0a74cc59456f9bf0c3209710f75d3a0",
    "vllm/single/two-images-pending/shm": "e115f313450003f04d3a1d00fb4c9b9eb7bb68d5012621417b2c3c8021523e05",
    "vllm/single/two-images/inline": "629e000be922c0ad476b3fab1d05c17ccaee07e57addcfae408606d4e898bb8a",
    "vllm/single/two-images/inline-bf16": "f5e81d4cbb056b0335821ea213957d62a7b3afdee5e95477f5cfde382ba6add1",
    "vllm/single/two-images/shm": "5933d6aa6f9b5fb5421b28039f7acda1b54dfcf4f2afcabb44ebabe83db0ba3a",
}

#: why the cases marked ``# CHANGED`` in :data:`GOLDEN` differ from 05281ae's bytes (their value is the new one)
CHANGED = {
    "tokenspeed/*/choice/*": "the choice grammar is the codec core's (wire_values.choice_grammar, SGLang's "
                             "escaping): control characters as \\n, \\r, \\t, \\u00XX instead of \\xHH, which "
                             "xgrammar reads greedily (\\x0ab is U+0AB); test_wire_values.py shows the servicer's "
                             "engine reads the new text as exactly the choices",
}


def test_every_leg_of_every_wire_serializes_to_its_golden_bytes() -> None:
    got = compute()
    assert set(got) == set(GOLDEN)
    differ = sorted(k for k in got if got[k] != GOLDEN[k])
    # every other case is byte-identical to 05281ae
    assert not differ, f"{len(differ)} cases changed: {differ[:10]}"


if __name__ == "__main__":
    json.dump(compute(), sys.stdout, indent=0, sort_keys=True)
