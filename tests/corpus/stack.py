"""The running system the corpus and soak tests talk to, all on loopback.

* :func:`profile_bundle` copies a shared model bundle into a temporary folder
  and rewrites its processor configs to a corpus profile's values (the
  transformers class defaults the expected numbers assume; for ``llava_1_5``
  the CLIP resize and crop sizes);
* :class:`RecordingProxy` is a transparent gRPC proxy between a gateway and
  its reference engine that keeps the last ``GenerateRequest`` messages and
  the ids each one generated, so a test can check the tensors that went over
  the wire, and what came back, for a request id;
* the SSRF cases use :func:`tests.media.gateways.ssrf_gateway` (default
  policy; test names resolve to a "public" address that the test socket
  layer routes to a loopback origin; anything else is recorded and refused).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines.client import CHANNEL_OPTIONS
from mmgate.config.settings import build_parser
from mmgate.transport.inline import from_parts

ALLOWED_TEST_HOST = "allowed.test"

#: corpus profile -> the shared bundle it is built from
PROFILE_BASE = {"qwen2_vl": "Qwen--Qwen2-VL-2B-Instruct", "qwen3_vl": "Qwen--Qwen3-VL-2B-Instruct",
                "llava_1_5": "llava-hf--llava-1.5-7b-hf"}
#: profiles whose images are one shortest-edge resize + centre crop each (CLIPImageProcessor, LLaVA-1.5)
CROP_PROFILES = ("llava_1_5",)
_RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3}


def _image_config(p: Mapping[str, Any], processor: str) -> dict[str, Any]:
    return {
        "size": {"shortest_edge": p["image_min_pixels"], "longest_edge": p["image_max_pixels"]},
        "patch_size": p["patch_size"], "temporal_patch_size": p["temporal_patch_size"],
        "merge_size": p["merge_size"], "image_mean": p["image_mean"], "image_std": p["image_std"],
        "resample": _RESAMPLE[p.get("resample", "bicubic")], "do_convert_rgb": True,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
    }


def _video_config(p: Mapping[str, Any], video_processor: str) -> dict[str, Any]:
    # do_sample_frames always written: a bundle that leaves it unset samples 2 fps under the gateway's default
    # --video-frame-sampling vllm, where the BH-14 cases expect Qwen2-VL frames passed as-is
    cfg: dict[str, Any] = {
        "size": {"shortest_edge": p["video_min_pixels"], "longest_edge": p["video_max_pixels"]},
        "patch_size": p["patch_size"], "temporal_patch_size": p["temporal_patch_size"],
        "merge_size": p["merge_size"], "image_mean": p["image_mean"], "image_std": p["image_std"],
        "do_sample_frames": p["video_do_sample_frames"], "video_processor_type": video_processor,
    }
    for key in ("fps", "min_frames", "max_frames"):
        if f"video_{key}" in p:
            cfg[key] = p[f"video_{key}"]
    return cfg


def _crop_profile_files(dst: Path, p: Mapping[str, Any]) -> None:
    """LLaVA-1.5: the bundle's ``CLIPImageProcessor`` config with the profile's resize / crop sizes, and its
    processor's ``patch_size`` (the rest, bicubic and the CLIP mean / std, is the bundle's own, as the
    profile's note says)."""
    image = json.loads((dst / "preprocessor_config.json").read_text())
    image.update(size={"shortest_edge": p["shortest_edge"]}, crop_size={"height": p["crop"], "width": p["crop"]},
                 do_resize=True, do_center_crop=True)
    (dst / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    processor = json.loads((dst / "processor_config.json").read_text())
    processor["patch_size"] = p["patch_size"]
    (dst / "processor_config.json").write_text(json.dumps(processor, indent=1))


def profile_bundle(shared_models: Path, dest_root: Path, profile: str, values: Mapping[str, Any]) -> Path:
    """A copy of the profile's base bundle whose image/video processor configs hold ``values``."""
    src = shared_models / PROFILE_BASE[profile]
    dst = dest_root / f"corpus--{profile}"
    shutil.copytree(src, dst)
    for child in dst.iterdir():
        child.chmod(0o644)
    if profile in CROP_PROFILES:
        _crop_profile_files(dst, values)
        return dst
    config = json.loads((dst / "config.json").read_text())
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[config["model_type"]]
    video_processor = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}[config["model_type"]]
    (dst / "preprocessor_config.json").write_text(json.dumps(_image_config(values, processor), indent=1))
    (dst / "video_preprocessor_config.json").write_text(json.dumps(_video_config(values, video_processor), indent=1))
    return dst


def known_flags(*flags: str) -> list[str]:
    """``flags`` (pairs of ``--flag value`` or single switches) that ``mmgate serve`` knows today."""
    options = {s for a in build_parser()._actions for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flag in options:
            out.extend(flags[i:i + 2] if takes_value else flags[i:i + 1])
        i += 2 if takes_value else 1
    return out


# ---------------------------------------------------------------- wire recording


@dataclass(frozen=True)
class WireTensor:
    name: str
    dtype: str
    array: np.ndarray


@dataclass(frozen=True)
class WireBatch:
    modality: int
    tensors: dict[str, WireTensor]
    placeholders: list[tuple[int, int]]
    im_token_id: int = 0  # the embedding token of the placeholder runs


@dataclass(frozen=True)
class WireRequest:
    request_id: str
    input_ids: list[int]
    batches: list[WireBatch]

    def batch(self, tensor_name: str) -> WireBatch | None:
        return next((b for b in self.batches if tensor_name in b.tensors), None)


def _tensor(name: str, td: vllm_engine_pb2.TensorData) -> WireTensor:
    if td.WhichOneof("payload") == "shm":
        from mmgate.transport.shm import read_segment

        raw = read_segment(td.shm.name, int(td.shm.offset), int(td.shm.nbytes), unlink_after=False)
    else:
        raw = td.inline
    return WireTensor(name, td.dtype, np.array(from_parts(raw, tuple(td.shape), td.dtype)))


def _wire_request(msg: vllm_engine_pb2.GenerateRequest) -> WireRequest:
    batches = []
    mms = ([msg.mm_inputs] if msg.HasField("mm_inputs") else []) + list(msg.extra_mm_inputs)
    for mm in mms:
        tensors = {name: _tensor(name, td) for name, td in mm.model_specific_tensors.items()}
        if mm.HasField("pixel_values"):
            tensors["pixel_values"] = _tensor("pixel_values", mm.pixel_values)
        batches.append(WireBatch(int(mm.modality), tensors, [(p.offset, p.length) for p in mm.mm_placeholders],
                                 int(mm.im_token_id)))
    return WireRequest(msg.request_id, list(msg.tokenized.input_ids), batches)


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The caller's remaining time (grpc reports ~9.2e18 s when the caller set no deadline)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e6 else None


class RecordingProxy:
    """Forwards every VllmEngine RPC to ``upstream`` unchanged; decodes and keeps recent Generate requests."""

    SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]

    def __init__(self, upstream_port: int, keep: int = 64) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{upstream_port}", options=CHANNEL_OPTIONS)
        self._keep = keep
        self._lock = threading.Lock()
        self.requests: OrderedDict[str, WireRequest] = OrderedDict()
        self.outputs: OrderedDict[tuple[str, int], list[int]] = OrderedDict()  # (request id, choice) -> output ids
        self.generate_calls = 0
        handlers = {}
        for method in self.SERVICE.methods:
            path = f"/{self.SERVICE.full_name}/{method.name}"
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self._streaming(self._channel.unary_stream(path), method.name == "Generate"))
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(self._unary(self._channel.unary_unary(path)))
        self._server = grpc.server(ThreadPoolExecutor(max_workers=16), options=CHANNEL_OPTIONS)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.SERVICE.full_name, handlers),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def _record(self, raw: bytes) -> str:
        wire = _wire_request(vllm_engine_pb2.GenerateRequest.FromString(raw))
        with self._lock:
            self.generate_calls += 1
            self.requests[wire.request_id] = wire
            while len(self.requests) > self._keep:
                self.requests.popitem(last=False)
        return wire.request_id

    def _record_output(self, request_id: str, raw: bytes) -> None:
        """Keep a ``GenerateComplete``'s ``output_ids`` (every generated id, in both stream modes)."""
        response = vllm_engine_pb2.GenerateResponse.FromString(raw)
        if response.WhichOneof("response") != "complete":
            return
        with self._lock:
            self.outputs[(request_id, int(response.complete.index))] = [int(t) for t in response.complete.output_ids]
            while len(self.outputs) > self._keep:
                self.outputs.popitem(last=False)

    @staticmethod
    def _unary(call: Callable[..., bytes]) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                return call(raw, timeout=_deadline(context), metadata=context.invocation_metadata())
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")
                raise

        return handle

    def _streaming(self, call: Callable[..., Any], record: bool) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
        def handle(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            request_id = self._record(raw) if record else None
            responses = call(raw, timeout=_deadline(context), metadata=context.invocation_metadata())
            context.add_callback(responses.cancel)
            try:
                for response in responses:
                    if request_id is not None:
                        self._record_output(request_id, response)
                    yield response
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.CANCELLED:
                    context.abort(exc.code(), exc.details() or "")

        return handle

    def get(self, request_id: str) -> WireRequest | None:
        with self._lock:
            return self.requests.get(request_id)

    def output_ids(self, request_id: str, index: int = 0) -> list[int] | None:
        """The engine's generated ids for choice ``index`` of ``request_id`` (None until it completed)."""
        with self._lock:
            return self.outputs.get((request_id, index))

    def close(self) -> None:
        self._server.stop(grace=1).wait(5)
        self._channel.close()
