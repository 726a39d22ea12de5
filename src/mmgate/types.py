"""Frozen, slotted dataclasses shared across the pipeline stages.

A request flows forward as: ``ChatRequest`` (api) -> ``MediaRef`` per content
part (plan) -> ``DecodedImage`` (fetch+decode) -> ``ItemPlan`` (family.plan)
-> ``EncoderBatch`` (family.preprocess) -> ``Replacement`` (family.expand)
-> ``PreparedRequest`` (pipeline) -> engine message (engines/).

No ``dict[str, Any]`` crosses a module boundary; tensors are numpy arrays with
their shape and dtype documented where they are produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt


class Modality(StrEnum):
    """A media item's kind, named as vLLM names its modalities."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media content part of a chat request, before anything is fetched."""

    modality: Modality
    url: str  # http(s):// or data: URL, verbatim from the request
    part_index: int  # position among all media parts of the request (prompt order)
    param: str  # request path of the part, for error messages (``messages[0].content[1]``)


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """An image decoded and converted to RGB as the reference does.

    ``pixels``: uint8 ``[H, W, 3]`` C-contiguous, RGB, alpha composited on white
    (transformers ``image_transforms.convert_to_rgb``, 5.24).
    """

    pixels: npt.NDArray[np.uint8]
    content_hash: str  # blake3 hex of the original (encoded) bytes
    num_bytes: int  # size of the original encoded bytes

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """Geometry of one preprocessed item, computed from sizes alone.

    For Qwen-VL images: ``resized_hw`` from ``smart_resize``, ``grid_thw`` =
    ``(1, resized_h / patch_size, resized_w / patch_size)``, ``num_tokens`` =
    ``t*h*w / merge_size**2``.
    """

    modality: Modality
    original_hw: tuple[int, int]
    resized_hw: tuple[int, int]
    grid_thw: tuple[int, int, int]
    num_patches: int  # rows of this item in the flat ``pixel_values``
    num_tokens: int  # placeholder tokens this item expands to


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where one item's placeholder run sits in the expanded ``input_ids``.

    Mirrors vLLM ``vllm/multimodal/inputs.py`` ``PlaceholderRange`` (offset, length).

    Example: prompt ids ``[10, A, 11]`` with anchor ``A`` expanded to four pad
    tokens ``P`` gives ``[10, P, P, P, P, 11]`` and ``PlaceholderRange(1, 4)``.
    """

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Replacement:
    """What replaces one anchor token: the token ids and the embedding range inside them."""

    token_ids: tuple[int, ...]
    embed_offset: int  # offset of the placeholder range within ``token_ids``
    embed_length: int


@dataclass(frozen=True, slots=True)
class EncoderBatch:
    """Preprocessed tensors of all items of one modality, in prompt order.

    ``tensors``: name -> array.  For Qwen-VL images: ``pixel_values`` float32
    ``[sum(t*h*w), C*T*P*P]`` (flat over items), ``image_grid_thw`` int64
    ``[N, 3]`` and ``patches_per_image`` int64 ``[N]`` (batched).
    Layout follows vLLM ``MultiModalFieldConfig``: ``flat_keys`` maps a flat
    tensor to the batched tensor holding per-item sizes; ``batched_keys`` have
    first dimension N; ``keep_on_cpu_keys`` stay on the host.
    """

    modality: Modality
    tensors: dict[str, np.ndarray]
    batched_keys: tuple[str, ...]
    flat_keys: dict[str, str]
    keep_on_cpu_keys: tuple[str, ...]
    placeholder_token_id: int  # the token that receives embeddings (im_token_id)
    placeholders: tuple[PlaceholderRange, ...] = ()
    mm_hashes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.tensors.values())


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """OpenAI sampling fields the gateway forwards to engines."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """An engine-neutral, fully preprocessed request.

    ``input_ids`` is the expanded prompt (every anchor replaced by its
    placeholder run); ``batches`` holds one :class:`EncoderBatch` per modality.
    """

    request_id: str
    model: str
    prompt_text: str  # the rendered chat template, anchors unexpanded
    input_ids: tuple[int, ...]
    batches: tuple[EncoderBatch, ...]
    sampling: SamplingParams
    stream: bool
    plans: tuple[ItemPlan, ...] = ()
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def modalities(self) -> frozenset[Modality]:
        return frozenset(b.modality for b in self.batches)
