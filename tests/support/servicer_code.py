"""The real servicer's decoding code (smg-grpc-servicer 0.14.1, the ``test`` extra's pin) for the
recording fakes.

Stage: test support.  In: a wire's ``TensorData``; out: the tensor the engine's servicer would
hand its engine, or the ``ValueError`` it would refuse the request with.

* vLLM: ``vllm/mm_tensors.py`` ``tensor_from_proto`` (``mm_shm.tensor_payload_bytes`` then
  ``tensor_wire.tensor_from_parts``), imported as it is: the module needs torch, not vLLM.
* SGLang: ``tensor_wire.tensor_from_parts`` over ``TensorData.data`` (``sglang/servicer.py``
  ``_decode_tensor_data``); the servicer module itself imports sglang, so only its helper is used.
* vLLM's kwargs: ``vllm/servicer.py`` ``VllmEngineServicer._build_preprocessed_mm_inputs`` (what
  turns a request's batches into vLLM's ``MultiModalFieldConfig`` per key and ``PlaceholderRange``
  with ``is_embed``), compiled from the installed file with vLLM's types stood in (:func:`vllm_input`).
* TokenSpeed: ``tokenspeed/servicer.py`` imports tokenspeed at module level, so the two static
  methods that decode a tensor (``_tensor_from_proto``, ``_torch_dtype_from_proto``) are taken
  from the installed file's source (``ast``) and run with the module's own names (numpy, torch,
  ``mm_shm``): the installed code runs, not a copy of it.

Invariant: nothing here re-implements a dtype table or a byte-count check; a change in the
installed package changes what the fakes accept.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from smg_grpc_servicer import mm_shm, tensor_wire
from smg_grpc_servicer.tensor_wire import PROTO_DTYPE_MAP, tensor_from_parts
from smg_grpc_servicer.vllm.mm_tensors import tensor_from_proto

#: the version the ``test`` extra pins (pyproject.toml); the fakes are written against it
PINNED = "0.14.1"
PACKAGE_DIR = Path(inspect.getfile(tensor_wire)).parent

__all__ = ["PACKAGE_DIR", "PINNED", "PROTO_DTYPE_MAP", "FieldConfig", "VllmInput", "VllmPlaceholder",
           "installed_version", "mm_shm", "sglang_tensor", "tensor_from_parts", "tensor_from_proto", "to_numpy",
           "tokenspeed_dtype_from_proto", "tokenspeed_tensor_from_proto", "vllm_input"]


def installed_version() -> str:
    return metadata.version("smg-grpc-servicer")


def _static_methods(path: Path, cls: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Callable]:
    """The static methods ``names`` of class ``cls`` in the source file ``path``, compiled there
    (their line numbers point into the installed file) with ``namespace`` as their globals."""
    tree = ast.parse(path.read_text(), str(path))
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    found = {n.name: n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name in names}
    missing = set(names) - found.keys()
    assert not missing, f"{path}: {cls} no longer has {sorted(missing)}"
    out: dict[str, Callable] = {}
    for name in names:
        fn = found[name]
        fn.decorator_list = []  # @staticmethod: compiled as a plain function
        fn.returns = None
        for arg in fn.args.args:
            arg.annotation = None  # the proto / tokenspeed types they name are not importable here
        module = ast.Module(body=[fn], type_ignores=[])
        exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - the installed package's own code
        out[name] = namespace[name]
    return out


class _ServicerName:
    """Stands for ``TokenSpeedSchedulerServicer`` inside the extracted methods (they call each other
    through the class name)."""

    _tensor_from_proto: Callable[..., torch.Tensor]
    _torch_dtype_from_proto: Callable[[str], torch.dtype]


_TS_NAMESPACE: dict[str, Any] = {"np": np, "torch": torch, "mm_shm": mm_shm,
                                 "TokenSpeedSchedulerServicer": _ServicerName}
_TS = _static_methods(PACKAGE_DIR / "tokenspeed" / "servicer.py", "TokenSpeedSchedulerServicer",
                      ("_tensor_from_proto", "_torch_dtype_from_proto"), _TS_NAMESPACE)
_ServicerName._tensor_from_proto = staticmethod(_TS["_tensor_from_proto"])  # type: ignore[assignment]
_ServicerName._torch_dtype_from_proto = staticmethod(_TS["_torch_dtype_from_proto"])  # type: ignore[assignment]

#: ``TokenSpeedSchedulerServicer._tensor_from_proto(tensor_data, cast_to=None)``: inline or shm
#: payload (``mm_shm.tensor_payload_bytes``), any numpy dtype name plus ``bfloat16``
tokenspeed_tensor_from_proto: Callable[..., torch.Tensor] = _TS["_tensor_from_proto"]
#: ``TokenSpeedSchedulerServicer._torch_dtype_from_proto``: the dtypes a shared-memory feature may have
tokenspeed_dtype_from_proto: Callable[[str], torch.dtype] = _TS["_torch_dtype_from_proto"]


def sglang_tensor(td: Any) -> torch.Tensor:
    """``sglang/servicer.py`` ``_decode_tensor_data``: ``tensor_from_parts(td.data, td.shape, td.dtype)``."""
    return tensor_from_parts(td.data, td.shape, td.dtype)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A decoded tensor as the fakes record it: bfloat16 as its uint16 bits, anything else as is."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


# ---------------------------------------------------------------- vLLM's kwargs from a GenerateRequest


@dataclass(frozen=True)
class FieldConfig:
    """Stands for vLLM ``MultiModalFieldConfig`` (``vllm/multimodal/inputs.py``): what the servicer
    declared for one key.  ``kind``: ``batched`` / ``flat`` / ``shared``; ``sizes``: a flat key's
    per-item lengths (the tensor vLLM's ``flat_from_sizes`` receives); ``keep_on_cpu``."""

    modality: str
    kind: str
    sizes: tuple[int, ...] | None = None
    keep_on_cpu: bool = False
    batch_size: int | None = None

    @staticmethod
    def batched(modality: str, keep_on_cpu: bool = False) -> FieldConfig:
        return FieldConfig(modality, "batched", keep_on_cpu=keep_on_cpu)

    @staticmethod
    def flat_from_sizes(modality: str, size_per_item: torch.Tensor, keep_on_cpu: bool = False) -> FieldConfig:
        return FieldConfig(modality, "flat", tuple(int(v) for v in size_per_item.tolist()), keep_on_cpu)

    @staticmethod
    def shared(modality: str, batch_size: int, keep_on_cpu: bool = False) -> FieldConfig:
        return FieldConfig(modality, "shared", keep_on_cpu=keep_on_cpu, batch_size=batch_size)


@dataclass(frozen=True)
class VllmPlaceholder:
    """Stands for vLLM ``PlaceholderRange(offset, length, is_embed)``."""

    offset: int
    length: int
    is_embed: torch.Tensor | None = None


class _KwargsItems:
    """Stands for vLLM ``MultiModalKwargsItems``: ``from_hf_inputs`` keeps what it is given."""

    @staticmethod
    def from_hf_inputs(hf_inputs: Any, config_by_key: dict[str, FieldConfig]) -> tuple[dict[str, torch.Tensor],
                                                                                      dict[str, FieldConfig]]:
        return dict(hf_inputs), dict(config_by_key)


@dataclass(frozen=True)
class VllmInput:
    """What ``VllmEngineServicer._build_preprocessed_mm_inputs`` hands vLLM (``mm_input(...)``):
    the tensors by key (renamed per modality), each key's field config, hashes and placeholders."""

    prompt_token_ids: list[int]
    tensors: dict[str, torch.Tensor]
    fields: dict[str, FieldConfig]
    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[VllmPlaceholder]]


def _mm_input(*, prompt_token_ids: list[int], mm_kwargs: tuple[dict, dict], mm_hashes: dict,
              mm_placeholders: dict, prompt: str | None = None) -> VllmInput:
    return VllmInput(prompt_token_ids, mm_kwargs[0], mm_kwargs[1], mm_hashes, mm_placeholders)


def _vllm_builder() -> Callable[..., VllmInput]:
    """``vllm/servicer.py`` ``VllmEngineServicer._build_preprocessed_mm_inputs`` as installed (the
    module imports vLLM, so the method is compiled from the file's source with vLLM's three types
    stood in by the recorders above; ``BatchFeature`` is transformers' own)."""
    from smg_grpc_servicer.vllm import mm_keys
    from transformers import BatchFeature

    namespace: dict[str, Any] = {
        "torch": torch, "BatchFeature": BatchFeature, "MultiModalFieldConfig": FieldConfig,
        "MultiModalKwargsItems": _KwargsItems, "PlaceholderRange": VllmPlaceholder, "mm_input": _mm_input,
        "tensor_from_proto": tensor_from_proto, "modality_key": mm_keys.modality_key,
        "modality_name": mm_keys.modality_name, "primary_encoder_key": mm_keys.primary_encoder_key}
    return _static_methods(PACKAGE_DIR / "vllm" / "servicer.py", "VllmEngineServicer",
                           ("_build_preprocessed_mm_inputs",), namespace)["_build_preprocessed_mm_inputs"]


class _Engine:
    """``self.engine.model_config.dtype`` for the builder: float32 keeps every value as sent."""

    class model_config:  # noqa: N801 - vLLM's attribute name
        dtype = torch.float32


class _Self:
    engine = _Engine


def vllm_input(request: Any) -> VllmInput:
    """A vLLM-wire ``GenerateRequest`` (inline tensors) turned into what the real servicer hands vLLM."""
    from smg_grpc_servicer.vllm import mm_keys

    return _vllm_builder()(_Self(), request.tokenized, mm_keys.mm_batches(request))
