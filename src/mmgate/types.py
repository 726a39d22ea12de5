"""Frozen, slotted dataclasses shared across the pipeline stages.

A request flows forward as: ``ChatRequest`` (api) -> ``MediaRef`` per content
part (plan) -> ``DecodedImage`` / ``DecodedVideo`` (fetch+decode) -> ``ItemPlan``
/ ``VideoPlan`` (family.plan, family.plan_video) -> ``EncoderBatch`` (family.preprocess)
-> ``Replacement`` (family.expand) -> ``PreparedRequest`` (pipeline) -> engine
message (engines/).

No ``dict[str, Any]`` crosses a module boundary; tensors are numpy arrays with
their shape and dtype documented where they are produced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import numpy as np
import numpy.typing as npt


class Modality(StrEnum):
    """A media item's kind, named as vLLM names its modalities."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


@dataclass(frozen=True, slots=True)
class ItemHints:
    """Per-item preprocessing hints of one content part (docs/video.md, "Hints").

    ``fps``: frames per second to sample (``video_url.fps``; the reference video
    processor's ``fps`` kwarg).  ``max_long_side_pixel``: bound on the resized
    long side (``image_url`` / ``video_url``), mapped to an area bound
    ``size["longest_edge"]`` per item.  ``None``: the model's own setting.
    """

    fps: float | None = None
    max_long_side_pixel: int | None = None

    @property
    def key(self) -> str:
        """A stable text form for hashes and de-duplication ('' when no hint is set)."""
        if self.fps is None and self.max_long_side_pixel is None:
            return ""
        return f"fps={self.fps!r};long={self.max_long_side_pixel!r}"


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media content part of a chat request, before anything is fetched."""

    modality: Modality
    url: str  # http(s):// or data: URL, verbatim from the request
    part_index: int  # position among all media parts of the request (prompt order)
    param: str  # request path of the part, for error messages (``messages[0].content[1]``)
    hints: ItemHints = ItemHints()


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
class VideoMeta:
    """What a clip's container header says, read as the reference's pyav loader reads it.

    transformers 5.24 ``video_utils.read_video_pyav``: ``total_frames`` =
    ``streams.video[0].frames``, ``fps`` = ``float(average_rate)``, size from
    the stream.  ``frames_counted``: the header had no frame count and the
    frames were counted by decoding (docs/video.md).
    """

    total_frames: int
    fps: float
    height: int
    width: int
    codec: str  # decoder name, e.g. ``h264``
    container: str  # demuxer name, e.g. ``mov,mp4,m4a,3gp,3g2,mj2``
    frames_counted: bool = False


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    """The sampled frames of one clip, RGB, upright or in the stored orientation.

    ``frames``: uint8 ``[N, H, W, 3]`` C-contiguous, ``frames[k]`` is frame
    ``frame_indices[k]`` of the stream (PyAV ``to_ndarray(format="rgb24")``), turned
    upright by the container's display rotation when ``decode_video(apply_rotation=True)``
    (the gateway's default, ``--video-apply-rotation``; docs/video.md "Rotation"), else as
    stored, as the transformers pyav loader returns them.
    ``rotation``: the display-matrix rotation in degrees (counter-clockwise) of the stream.
    """

    frames: npt.NDArray[np.uint8]
    meta: VideoMeta
    frame_indices: tuple[int, ...]
    rotation: int
    content_hash: str  # blake3 hex of the original (encoded) bytes
    num_bytes: int

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


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
class VideoPlan:
    """Sampling (chosen from the header, before decoding) and geometry (from the decoded frames) of one clip.

    ``item.grid_thw`` = ``(grid_t, grid_h, grid_w)`` with ``grid_t`` =
    ``ceil(len(frame_indices) / temporal_patch_size)`` (the reference pads the
    last temporal patch with copies of the last frame).
    """

    item: ItemPlan
    frame_indices: tuple[int, ...]  # sampled stream frame indices, in order
    total_frames: int  # VideoMeta.total_frames
    source_fps: float  # VideoMeta.fps
    max_pixels: int  # the size["longest_edge"] this clip was resized under (hint applied)

    @property
    def sampled_fps(self) -> float:
        """transformers 5.24 ``VideoMetadata.sampled_fps`` (same operation order)."""
        return len(self.frame_indices) / self.total_frames * self.source_fps


@dataclass(frozen=True, slots=True)
class Replacement:
    """What replaces one anchor token: the token ids and the embedding range inside them.

    The embedding range may hold tokens that receive no embedding: for a
    Qwen3-VL clip it spans the whole replacement (timestamp text, per-frame
    ``<|vision_start|>``/``<|vision_end|>``) and the engine embeds only the
    positions holding the batch's ``placeholder_token_id`` (vLLM's
    ``is_embed``; the SMG servicer derives it from ``im_token_id``).
    """

    token_ids: tuple[int, ...]
    embed_offset: int  # offset of the placeholder range within ``token_ids``
    embed_length: int


#: ``write(first_row, rows)``: store ``rows`` (``[b, width]``) at row ``first_row`` of a tensor
RowWrite = Callable[[int, np.ndarray], None]


class RowTarget(Protocol):
    """Where a :class:`PendingTensor`'s rows go: the buffer that carries them to the engine.

    ``writer()`` opens one writer per pool task (safe to use from several
    threads at once for disjoint rows); it converts each block to the wire dtype.
    """

    def writer(self) -> AbstractContextManager[RowWrite]: ...


@dataclass(frozen=True, slots=True)
class PendingTensor:
    """A ``[rows, width]`` encoder input whose values are computed straight into their transport buffer.

    The pipeline returns it (``Pipeline.prepare(..., defer_pixels=True)``) with every
    refusal done and every size known; the engine adapter chooses the buffer
    (a shared-memory segment, or the tail of the serialized request) and
    ``await fill(target)`` computes the rows into it, so the full tensor is
    written once and never copied.  ``dtype``: float32 (normalized) or uint8 (raw).
    """

    shape: tuple[int, int]
    dtype: np.dtype
    fill: Callable[[RowTarget], Awaitable[None]]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class EncoderBatch:
    """Preprocessed tensors of all items of one modality, in prompt order.

    ``tensors``: name -> array.  For Qwen-VL images: ``pixel_values`` float32
    ``[sum(t*h*w), C*T*P*P]`` (flat over items), ``image_grid_thw`` int64
    ``[N, 3]`` and ``patches_per_image`` int64 ``[N]`` (batched).
    Layout follows vLLM ``MultiModalFieldConfig``: ``flat_keys`` maps a flat
    tensor to the batched tensor holding per-item sizes; ``batched_keys`` have
    first dimension N; ``keep_on_cpu_keys`` stay on the host.  With deferred
    pixels (gateway router path) ``pixel_values`` is a :class:`PendingTensor`.
    """

    modality: Modality
    tensors: Mapping[str, np.ndarray | PendingTensor]
    batched_keys: tuple[str, ...]
    flat_keys: dict[str, str]
    keep_on_cpu_keys: tuple[str, ...]
    placeholder_token_id: int  # the token that receives embeddings (im_token_id)
    placeholders: tuple[PlaceholderRange, ...] = ()
    mm_hashes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.tensors.values())


class ConstraintKind(StrEnum):
    """What a :class:`Constraint` holds: the cases of the wire's ``SamplingParams.constraint`` oneof
    (``smg_grpc_proto`` ``vllm_engine.proto``), named as there."""

    JSON_SCHEMA = "json_schema"  # value: the schema as JSON text
    REGEX = "regex"  # value: a regular expression the whole output must match
    GRAMMAR = "grammar"  # value: an EBNF grammar (GBNF, as xgrammar and llama.cpp read it)
    JSON_OBJECT = "json_object"  # value: "" (any JSON object)
    CHOICE = "choice"  # value: the choices as a JSON array of strings
    STRUCTURAL_TAG = "structural_tag"  # value: the structural-tag JSON text


@dataclass(frozen=True, slots=True)
class Constraint:
    """A structured-output constraint on the generated text (at most one per request).

    Mirrors vLLM ``StructuredOutputsParams`` (``vllm/sampling_params.py``), one
    field set; ``value`` is text exactly as the wire carries it (see :class:`ConstraintKind`).
    """

    kind: ConstraintKind
    value: str


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
    # sampling extras, n and logprobs (H-C1), as vLLM ``SamplingParams`` names them
    n: int = 1  # choices generated from the one prompt
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    min_tokens: int = 0  # stop tokens and strings are held off until this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    constraint: Constraint | None = None  # structured output (response_format, guided_*, tool_choice)


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
