"""Helpers of the role tests: prepared requests, engines per (model, wire, role), the three wires' stubs.

Requests are prepared by mmgate's own pipeline (``tests/video/video_support.py``: the torchvision
image backend) from two PNG images and a question, then encoded for each wire and leg by the
gateway-side encoders (``mmgate.engines.vllm`` / ``sglang`` / ``tokenspeed``), so what reaches an
engine is exactly what the gateway sends it.  Engines run in process on 127.0.0.1 (port 0, a free
bootstrap port) and are kept for the module.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cache, partial
from typing import Any

import grpc
import numpy as np
from PIL import Image
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2_grpc,
    tokenspeed_encoder_pb2_grpc,
    tokenspeed_scheduler_pb2_grpc,
    vllm_engine_pb2_grpc,
)

from mmgate.request.parse import parse_chat_request
from mmgate.engines import sglang, tokenspeed, vllm
from mmgate.engines.base import Bootstrap, Role, Wire
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.types import PreparedRequest
from tests.conftest import bundle_dir

QWEN2_5 = "Qwen/Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen/Qwen3-VL-2B-Instruct"
MODELS = (QWEN2_5, QWEN3)
SIZES = ((50, 70), (90, 40))  # (height, width) of the two images
_ROOMS = itertools.count(1000)
_POOL = ThreadPoolExecutor(8)
_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def next_room() -> int:
    return next(_ROOMS)


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@cache
def prepared(model: str) -> PreparedRequest:
    """Two images and a question, greedy, eight tokens (EOS ignored so every run has eight)."""
    from tests.video.video_support import pipeline

    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(h, w, i))
                                                 .decode()}} for i, (h, w) in enumerate(SIZES)]
    body = {"model": model, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare the pictures."}]}]}
    return asyncio.run(pipeline(model).prepare(parse_chat_request(json.dumps(body).encode()), "roles"))


def request(model: str, request_id: str, **sampling: Any) -> PreparedRequest:
    base = prepared(model)
    return replace(base, request_id=request_id, sampling=replace(base.sampling, **sampling))


class Engines:
    """Engines started on demand, one per (model, wire, role, options), stopped together."""

    def __init__(self) -> None:
        self._engines: dict[tuple[Any, ...], RunningEngine] = {}

    def get(self, model: str, wire: Wire, role: Role = Role.SINGLE, **options: Any) -> RunningEngine:
        key = (model, wire, role, tuple(sorted(options.items())))
        if key not in self._engines:
            self._engines[key] = start_engine(EngineConfig(model=bundle_dir(model), port=0, wire=wire, role=role,
                                                           **options))
        return self._engines[key]

    def stop(self) -> None:
        for engine in self._engines.values():
            engine.stop(grace=0)


@cache
def _channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=_OPTIONS)


def stub(engine: RunningEngine, wire: Wire) -> Any:
    """The engine's scheduler stub of ``wire``."""
    kind = {Wire.VLLM: vllm_engine_pb2_grpc.VllmEngineStub, Wire.SGLANG: sglang_scheduler_pb2_grpc.SglangSchedulerStub,
            Wire.TOKENSPEED: tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerStub}[wire]
    return kind(_channel(engine.address))


def encoder_stub(engine: RunningEngine) -> tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub:
    return tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(_channel(engine.address))


def generate(engine: RunningEngine, wire: Wire, message: Any, timeout: float = 60) -> list[Any]:
    """Every response of one Generate call."""
    return list(stub(engine, wire).Generate(message, timeout=timeout))


def in_background(fn: Callable[[], Any]) -> Any:
    """``fn`` on another thread (the legs of a pair are sent together); a future."""
    return _POOL.submit(fn)


def completes(responses: list[Any]) -> list[Any]:
    return [r.complete for r in responses if r.HasField("complete")]


def output_ids(responses: list[Any]) -> list[int]:
    """A non-streamed answer's ids (its one Complete)."""
    (done,) = completes(responses)
    return list(done.output_ids)


def streamed_ids(responses: list[Any]) -> list[int]:
    """A streamed answer's ids, from its chunks."""
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def single_message(wire: Wire, prep: PreparedRequest) -> Any:
    if wire is Wire.VLLM:
        return vllm.build_generate_request(prep)
    if wire is Wire.SGLANG:
        return sglang.build_generate_request(prep, Role.SINGLE)
    return tokenspeed.build_generate_request(prep, Role.SINGLE)


def vllm_decode_message(prep: PreparedRequest, kv_transfer_params: str) -> Any:
    """The vLLM decode leg: identity only (hashes, placeholders, grids), no pixels, and the prefill's params."""
    message = vllm.build_generate_request(prep)
    for batch in [message.mm_inputs, *message.extra_mm_inputs]:
        batch.ClearField("pixel_values")
    message.kv_transfer_params_json = kv_transfer_params
    return message


def run_pd(engines: Engines, model: str, wire: Wire, prep: PreparedRequest, together: bool = True,
           **decode_options: Any) -> tuple[list[Any], list[Any]]:
    """One request through a prefill/decode pair of ``wire``: (prefill responses, decode responses).

    vLLM: the prefill first (``do_remote_decode``), then the decode with the params it answered;
    SGLang / TokenSpeed: both legs together with one minted room (the gateway's order), or the
    prefill first when ``together`` is False.
    """
    prefill, decode = engines.get(model, wire, Role.PREFILL), engines.get(model, wire, Role.DECODE, **decode_options)
    if wire is Wire.VLLM:
        first = vllm.build_generate_request(prep)
        first.kv_transfer_params_json = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})
        p = generate(prefill, wire, first)
        params = completes(p)[-1].kv_transfer_params_json
        return p, generate(decode, wire, vllm_decode_message(prep, params))
    boot = Bootstrap("127.0.0.1", prefill.bootstrap_port, next_room())
    if wire is Wire.SGLANG:
        p_msg, d_msg = (sglang.build_generate_request(prep, Role.PREFILL, boot),
                        sglang.build_generate_request(prep, Role.DECODE, boot))
    else:
        p_msg, d_msg = (tokenspeed.build_generate_request(prep, Role.PREFILL, kv_bootstrap=boot),
                        tokenspeed.build_generate_request(prep, Role.DECODE, kv_bootstrap=boot))
    if not together:
        return generate(prefill, wire, p_msg), generate(decode, wire, d_msg)
    d = in_background(lambda: generate(decode, wire, d_msg))
    return generate(prefill, wire, p_msg), d.result(timeout=60)


def epd_messages(engines: Engines, model: str, prep: PreparedRequest,
                 **encode_options: Any) -> tuple[list[Any], Any, Any, Bootstrap]:
    """The TokenSpeed EPD legs: (one Encode per item, the prefill's and the decode's Generate, the KV bootstrap)."""
    encode = engines.get(model, Wire.TOKENSPEED, Role.ENCODE, **encode_options)
    prefill = engines.get(model, Wire.TOKENSPEED, Role.PREFILL)
    items = len(tokenspeed.prompt_items(prep))
    rooms = [Bootstrap("127.0.0.1", encode.bootstrap_port, next_room()) for _ in range(items)]
    kv = Bootstrap("127.0.0.1", prefill.bootstrap_port, next_room())
    encodes = [tokenspeed.build_encode_request(prep, i, rooms[i]) for i in range(items)]
    p_msg = tokenspeed.build_generate_request(prep, Role.PREFILL, kv_bootstrap=kv, encode_bootstrap=rooms)
    d_msg = tokenspeed.build_generate_request(prep, Role.DECODE, kv_bootstrap=kv)
    return encodes, p_msg, d_msg, kv


def run_epd(engines: Engines, model: str, prep: PreparedRequest) -> tuple[list[Any], list[Any], list[Any]]:
    """Encode, prefill and decode legs sent together: (encode answers, prefill responses, decode responses)."""
    encode = engines.get(model, Wire.TOKENSPEED, Role.ENCODE)
    prefill, decode = (engines.get(model, Wire.TOKENSPEED, Role.PREFILL),
                       engines.get(model, Wire.TOKENSPEED, Role.DECODE))
    encodes, p_msg, d_msg, _ = epd_messages(engines, model, prep)
    d = in_background(lambda: generate(decode, Wire.TOKENSPEED, d_msg))
    p = in_background(lambda: generate(prefill, Wire.TOKENSPEED, p_msg))
    e = [in_background(partial(encoder_stub(encode).Encode, m, timeout=60)) for m in encodes]
    return [f.result(timeout=60) for f in e], p.result(timeout=60), d.result(timeout=60)


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    """The RpcError ``call`` ends with (fails the test if it succeeds)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


