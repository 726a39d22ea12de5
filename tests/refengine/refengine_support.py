"""Helpers for the reference-engine tests: bundles, real-processor requests, gRPC stubs.

Every multimodal input is produced by the real transformers processor
(``AutoProcessor.from_pretrained(bundle)``), never by mmgate gateway code; it
travels as SMG lays it out (``flat_keys {"pixel_values": "patches_per_image"}``,
``batched_keys ["image_grid_thw", "patches_per_image"]``,
``keep_on_cpu ["image_grid_thw"]``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.transport.inline import to_tensor_data

QWEN2_VL = "Qwen--Qwen2-VL-2B-Instruct"
QWEN2_5_VL = "Qwen--Qwen2.5-VL-7B-Instruct"
QWEN3_VL = "Qwen--Qwen3-VL-2B-Instruct"
QWEN_BUNDLES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)

_DEFAULT_ROOT = Path(__file__).resolve().parents[2].parent / "shared" / "models"


def model_roots() -> list[Path]:
    """``MMGATE_MODEL_PATH`` (os.pathsep-separated), else ``<repo>/../shared/models``."""
    raw = os.environ.get("MMGATE_MODEL_PATH", "")
    return [Path(p) for p in raw.split(os.pathsep) if p] or [_DEFAULT_ROOT]


def find_bundle(name: str) -> Path | None:
    """The first ``<root>/<name>`` folder with a config.json, or None."""
    for root in model_roots():
        if (root / name / "config.json").is_file():
            return root / name
    return None


def require_bundle(name: str) -> Path:
    """The bundle's folder; skips the calling test when it is not found."""
    path = find_bundle(name)
    if path is None:
        pytest.skip(f"model bundle {name} not found under MMGATE_MODEL_PATH")
    return path


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """What the real processor produced for one image + one text question."""

    input_ids: list[int]  # expanded: one image_token_id per merged patch
    pixel_values: np.ndarray  # [num_patches, C*T*P*P] float32
    image_grid_thw: np.ndarray  # [1, 3] int64
    image_token_id: int


def random_image(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


@cache
def processor_for(bundle: Path):  # noqa: ANN201 - a transformers ProcessorMixin
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(bundle)


@cache
def image_prompt(bundle: Path, question: str = "Describe the image.", size: tuple[int, int] = (64, 48)) -> ImagePrompt:
    """Run the bundle's own processor over a random image of ``size`` (width, height), 64x48 by default."""
    processor = processor_for(bundle)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    out = processor(text=[text], images=[random_image(*size)], return_tensors="np")
    image_token_id = json.loads((bundle / "config.json").read_text())["image_token_id"]
    return ImagePrompt(
        input_ids=[int(t) for t in out["input_ids"][0]],
        pixel_values=np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
        image_grid_thw=np.ascontiguousarray(out["image_grid_thw"], dtype=np.int64),
        image_token_id=int(image_token_id),
    )


def image_mm_inputs(prompt: ImagePrompt, input_ids: list[int] | None = None) -> vllm_engine_pb2.MultimodalInputs:
    """The SMG-shaped ``MultimodalInputs`` for one image."""
    ids = prompt.input_ids if input_ids is None else input_ids
    offset = ids.index(prompt.image_token_id)
    length = sum(1 for t in ids if t == prompt.image_token_id)
    return vllm_engine_pb2.MultimodalInputs(
        pixel_values=to_tensor_data(prompt.pixel_values),
        model_specific_tensors={
            "image_grid_thw": to_tensor_data(prompt.image_grid_thw),
            "patches_per_image": to_tensor_data(prompt.image_grid_thw.prod(-1)),
        },
        im_token_id=prompt.image_token_id,
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=offset, length=length)],
        batched_keys=["image_grid_thw", "patches_per_image"],
        flat_keys={"pixel_values": "patches_per_image"},
        keep_on_cpu_keys=["image_grid_thw"],
        modality=common_pb2.IMAGE,
    )


def generate_request(
    input_ids: list[int],
    mm: vllm_engine_pb2.MultimodalInputs | None = None,
    *,
    max_tokens: int | None = 4,
    stream: bool = False,
    request_id: str = "r",
    **sampling: object,
) -> vllm_engine_pb2.GenerateRequest:
    params = vllm_engine_pb2.SamplingParams(**sampling)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    request = vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=input_ids),
        sampling_params=params,
        stream=stream,
    )
    if mm is not None:
        request.mm_inputs.CopyFrom(mm)
    return request


def stub_for(address: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
    channel = grpc.insecure_channel(
        address,
        options=[("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)],
    )
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def write_text_only_bundle(dest: Path, tokenizer_source: Path) -> Path:
    """A tiny Qwen2 (text-only) bundle in ``dest``, with the tokenizer files copied from ``tokenizer_source``."""
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    }
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, dest / name)
    return dest
