"""Frozen, slotted dataclasses shared across the pipeline stages.

A request flows forward as: ``ChatRequest`` (api) -> ``MediaRef`` per content
part (plan) -> ``DecodedImage`` / ``DecodedVideo`` / ``DecodedAudio`` (fetch+decode) -> ``ItemPlan``
(each modality's processor's ``plan``) -> ``EncoderBatch`` (its ``preprocess``)
-> ``Replacement`` (family.expand) -> ``PreparedRequest`` (pipeline) -> engine
message (engines/).

No ``dict[str, Any]`` crosses a module boundary; tensors are numpy arrays with
their shape and dtype documented where they are produced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, Protocol

import numpy as np
import numpy.typing as npt
from typing_extensions import TypeVar  # a type parameter with a default (PEP 696; typing has it from 3.13)


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
    ``size["longest_edge"]`` per item.  ``options``: the request's
    ``mm_processor_kwargs`` (as vLLM's ``mm_processor_kwargs`` request field), sorted
    ``(name, value)`` pairs; which names a family takes is its own
    (``MediaProcessor.check_hints``), e.g. Gemma 3's ``do_pan_and_scan``.  ``None`` / empty:
    the model's own setting.
    """

    fps: float | None = None
    max_long_side_pixel: int | None = None
    options: tuple[tuple[str, bool | int | float | str], ...] = ()

    def option(self, name: str, default: bool | int | float | str | None = None) -> bool | int | float | str | None:
        """The value of ``mm_processor_kwargs[name]``, or ``default``."""
        for key, value in self.options:
            if key == name:
                return value
        return default

    @property
    def key(self) -> str:
        """A stable text form for hashes and de-duplication ('' when no hint is set)."""
        if self.fps is None and self.max_long_side_pixel is None and not self.options:
            return ""
        base = f"fps={self.fps!r};long={self.max_long_side_pixel!r}"
        return base + "".join(f";{k}={v!r}" for k, v in self.options)


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
    #: the clip's audio track, decoded like an audio part, when its video processor asked for it
    #: (:class:`~mmgate.models.family.AudioTrackVideo`: Qwen-Omni's ``use_audio_in_video``) and the container
    #: has an audio stream; None otherwise (a silent clip, or not asked)
    audio: DecodedAudio | None = None

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    """One decoded audio clip, as a family's feature extractor takes it.

    ``samples``: float32 ``[n]`` mono (channels averaged), resampled to ``sampling_rate`` Hz (the rate the
    family's :class:`~mmgate.models.family.AudioProcessor` asks for).  The source fields are diagnostics
    (timing log, error messages); no preprocessing reads them.
    """

    samples: npt.NDArray[np.float32]
    sampling_rate: int  # Hz of ``samples``
    source_rate: int  # Hz of the decoded stream before resampling
    source_channels: int  # channels of the decoded stream before the downmix
    content_hash: str  # blake3 hex of the original (encoded) bytes
    num_bytes: int  # size of the original encoded bytes

    @property
    def num_samples(self) -> int:
        return int(self.samples.shape[0])

    @property
    def duration_s(self) -> float:
        """Seconds of audio (``num_samples / sampling_rate``)."""
        return self.num_samples / self.sampling_rate if self.sampling_rate else 0.0


class TensorLayout(StrEnum):
    """How one tensor of an :class:`EncoderBatch` splits into items (vLLM ``MultiModalFieldConfig``,
    ``vllm/multimodal/inputs.py``).

    ``batched``: first dimension = items (``MultiModalFieldConfig.batched``); items whose shares
    differ in shape are zero-padded to the largest, as the reference processor pads them
    (LLaVA-NeXT tiles). ``flat``: the items' shares concatenated along the first dimension, each
    item's length in the batched tensor ``sizes_key`` (``flat_from_sizes``). ``shared``: one
    tensor for every item (``shared``).
    """

    BATCHED = "batched"
    FLAT = "flat"
    SHARED = "shared"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor a modality of a family produces: name, dtype, layout, placement.

    ``dtype``: numpy dtype name of the reference values (``float32`` pixel values, ``int64``
    grids and sizes); the primary tensor (the encoder input, ``primary``) is float32 normalized
    values, or uint8 pixels for a worker that normalizes on device, and may be converted to the
    wire's encoder dtype by the engine adapter.  ``sizes_key``: for ``flat``, the batched tensor
    holding each item's first-dimension length.  ``keep_on_cpu``: vLLM ``keep_on_cpu``.  The
    per-item shape (any rank) is the plan's (:attr:`ItemPlan.shapes`).
    """

    name: str
    dtype: str
    layout: TensorLayout
    sizes_key: str | None = None
    keep_on_cpu: bool = False
    primary: bool = False


#: an :class:`ItemPlan`'s ``detail`` type: hashable, a family's tuple of ints unless a modality says otherwise
DetailT = TypeVar("DetailT", bound=Hashable, covariant=True, default=tuple[int, ...])


@dataclass(frozen=True, slots=True)
class ItemPlan(Generic[DetailT]):
    """One item of any modality planned from its size alone: token count and the shape of its share of each tensor.

    ``shapes``: ``(name, shape)`` per tensor of the modality's specs, the primary tensor first: a
    ``flat`` tensor's share is ``[rows, ...]`` (its rows in the concatenation), a ``batched``
    one's the item's slice without the item dimension. ``num_tokens``: the embedding positions
    (tokens that receive encoder output) this item expands to. ``detail``: the modality's and the
    family's specifics, hashable, read only by the processor that planned the item (generic code
    reads the other fields).  Images and audio: a tuple of ints, the family's own geometry (Qwen-VL:
    grid ``(t, h, w)`` in patches; LLaVA-NeXT: tile grid and unpadded size; Gemma 3: ``(num_crops,
    rows, cols, crop_h, crop_w)``), so a bare ``ItemPlan`` is ``ItemPlan[tuple[int, ...]]``.  Video:
    a :class:`VideoDetail` (``ItemPlan[VideoDetail]``), the clip's sampling and the family's geometry.
    Generic code that takes plans of every modality reads ``ItemPlan[Hashable]``.

    Example (Qwen2.5-VL, 640x480 image): ``resized_hw`` (476, 644), ``shapes``
    ``(("pixel_values", (1564, 1176)), ("image_grid_thw", (3,)), ("patches_per_image", ()))``,
    ``num_tokens`` 391, ``detail`` (1, 34, 46).
    """

    modality: Modality
    original_hw: tuple[int, int]
    resized_hw: tuple[int, int]
    num_tokens: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    detail: DetailT

    def shape(self, name: str) -> tuple[int, ...]:
        """The item's share of tensor ``name``.

        Raises:
            KeyError: the plan has no such tensor.
        """
        for key, shape in self.shapes:
            if key == name:
                return shape
        raise KeyError(name)

    @property
    def primary_shape(self) -> tuple[int, ...]:
        """The item's share of the primary (encoder input) tensor."""
        return self.shapes[0][1]

    @property
    def primary_values(self) -> int:
        """Values of the item's share of the primary tensor (bytes = this x the element size)."""
        return int(np.prod(self.primary_shape, dtype=np.int64))


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
class VideoDetail:
    """A clip's :attr:`ItemPlan.detail`: its sampling (chosen from the header, before decoding) and the
    family's geometry of it (from the decoded frames).  Hashable and compared by value.

    Qwen-VL: ``geometry`` = ``(grid_t, grid_h, grid_w)`` with ``grid_t`` =
    ``ceil(len(frame_indices) / temporal_patch_size)`` (the reference pads the last temporal patch
    with copies of the last frame); LLaVA-OneVision, InternVL3: ``(num_frames,)``.
    """

    geometry: tuple[int, ...]  # the family's own geometry of the clip, read only by that family
    frame_indices: tuple[int, ...]  # sampled stream frame indices, in order
    total_frames: int  # VideoMeta.total_frames
    source_fps: float  # VideoMeta.fps
    max_pixels: int  # the size["longest_edge"] this clip was resized under (hint applied)

    @classmethod
    def sampled(cls, video: DecodedVideo, geometry: tuple[int, ...], max_pixels: int) -> VideoDetail:
        """The detail of ``video`` (its sampled indices and header facts) with the family's ``geometry``."""
        return cls(geometry=geometry, frame_indices=tuple(video.frame_indices), total_frames=video.meta.total_frames,
                   source_fps=video.meta.fps, max_pixels=max_pixels)

    @property
    def sampled_fps(self) -> float:
        """transformers 5.24 ``VideoMetadata.sampled_fps`` (same operation order)."""
        return len(self.frame_indices) / self.total_frames * self.source_fps


@dataclass(frozen=True, slots=True)
class Replacement:
    """The prompt update for one anchor: token-level (ids) or text-level (text), with its placeholder range.

    Token-level (``text`` None): ``token_ids`` replace the anchor token; the placeholder range is
    ``embed_length`` tokens from ``embed_offset`` within them.  Text-level (``text`` set): the
    reference processor replaces the anchor's *text* before tokenizing (Gemma 3
    ``Gemma3Processor.__call__``), so the ids depend on the text around the anchor: the pipeline
    substitutes ``text`` for the anchor in the rendered prompt and tokenizes the result
    (``token_ids`` is empty).  The range then runs from ``embed_offset`` tokens before the item's
    first embedding token (the batch's ``placeholder_token_id``) to ``trail`` tokens after its
    last, and the item must hold exactly ``embed_length`` embedding tokens.

    The range may hold tokens that receive no embedding: for a Qwen3-VL clip it spans the whole
    replacement (timestamp text, per-frame ``<|vision_start|>``/``<|vision_end|>``) and the engine
    embeds only the positions holding the batch's ``placeholder_token_id`` (vLLM's ``is_embed``;
    the SMG servicer derives it from ``im_token_id``).
    """

    token_ids: tuple[int, ...]
    embed_offset: int  # offset of the placeholder range within ``token_ids`` (text-level: lead tokens)
    embed_length: int
    text: str | None = None
    trail: int = 0


#: ``write(first_row, rows)``: store ``rows`` (``[b, width]``) at row ``first_row`` of a tensor
RowWrite = Callable[[int, np.ndarray], None]


class RowArray:
    """A :data:`RowWrite` over rows a writer can also compute in place.

    ``array``: the destination rows ``[rows, width]`` themselves, in the values' dtype
    (float32 normalized, uint8 raw), C-contiguous and writable, at any byte address (the
    payload of a serialized request is not float-aligned); ``owner`` keeps the memory
    behind it alive.  A row writer that can compute into an array
    (``mmgate.models.patch_native.fill_rows``) writes :meth:`rows` directly instead of
    handing over blocks, which saves the copy of every block; calling it copies a block
    in, as any :data:`RowWrite` does.  A target offers one only where it stores the values
    unconverted in addressable memory (``BufferTarget`` given the values' dtype, with the
    identity conversion).
    """

    __slots__ = ("array", "_bytes", "_owner")

    def __init__(self, array: np.ndarray, owner: object = None) -> None:
        if array.ndim != 2 or not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError(f"RowArray needs a writable C-contiguous [rows, width] array, got {array.shape}")
        self.array = array
        self._bytes = array.reshape(-1).view(np.uint8)  # byte copies: no unaligned float loop
        self._owner = owner

    def __call__(self, first_row: int, rows: np.ndarray) -> None:
        """Copy ``rows`` (``[b, width]``, the array's dtype) to rows ``first_row .. first_row + b``.

        Raises:
            ValueError: another dtype or width, or rows outside the array.
        """
        if rows.dtype != self.array.dtype or rows.ndim != 2 or rows.shape[1] != self.array.shape[1]:
            raise ValueError(f"rows {rows.dtype}{list(rows.shape)} do not fit "
                             f"{self.array.dtype}{list(self.array.shape)}")
        row_bytes = self.array.shape[1] * self.array.itemsize
        span = self._span(first_row, len(rows), row_bytes)
        self._bytes[span] = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)

    def rows(self, first_row: int, count: int) -> np.ndarray:
        """The destination rows ``first_row .. first_row + count`` (a view ``[count, width]``) to compute into.

        Raises:
            ValueError: rows outside the array (a plan and its writer that disagree on the row count).
        """
        return self.array[self._span(first_row, count, 1)]

    def shifted(self, first_row: int) -> RowArray:
        """The rows from ``first_row`` on (row 0 of the result is row ``first_row`` of this one).

        Raises:
            ValueError: ``first_row`` outside ``0 .. len(array)``.
        """
        self._span(first_row, 0, 1)
        return RowArray(self.array[first_row:], self._owner)

    def _span(self, first_row: int, count: int, scale: int) -> slice:
        if not 0 <= first_row <= first_row + count <= len(self.array):
            raise ValueError(f"rows [{first_row}, {first_row + count}) outside the {len(self.array)} rows")
        return slice(first_row * scale, (first_row + count) * scale)


def shifted(write: RowWrite, first_row: int) -> RowWrite:
    """``write`` with its row numbers offset by ``first_row`` (a :class:`RowArray` stays one)."""
    if isinstance(write, RowArray):
        return write.shifted(first_row)
    return lambda row, rows: write(first_row + row, rows)


class RowTarget(Protocol):
    """Where a :class:`PendingTensor`'s rows go: the buffer that carries them to the engine.

    ``writer()`` opens one writer per pool task (safe to use from several
    threads at once for disjoint rows); it converts each block to the wire dtype.
    """

    def writer(self) -> AbstractContextManager[RowWrite]: ...


@dataclass(frozen=True, slots=True)
class PendingTensor:
    """An encoder input whose values are computed straight into their transport buffer.

    ``shape``: the tensor's shape (any rank); it is written as ``rows = shape[0]`` rows of
    ``width = prod(shape[1:])`` values.  The pipeline returns it
    (``Pipeline.prepare(..., defer_pixels=True)``) with every refusal done and every size known;
    the engine adapter chooses the buffer (a shared-memory segment, or the tail of the
    serialized request) and ``await fill(target)`` computes the rows into it, so the full
    tensor is written once and never copied.  ``dtype``: float32 (normalized) or uint8 (raw).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Callable[[RowTarget], Awaitable[None]]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class EncoderBatch:
    """Preprocessed tensors of all items of one modality, in prompt order.

    ``tensors``: name -> array, one per spec of ``specs`` (:class:`TensorSpec`: layout, dtype,
    placement, which is the encoder input).  For Qwen-VL images: ``pixel_values`` float32
    ``[sum(t*h*w), C*T*P*P]`` (flat, sized by ``patches_per_image``), ``image_grid_thw`` int64
    ``[N, 3]`` and ``patches_per_image`` int64 ``[N]`` (batched).  With deferred pixels
    (gateway router path) the primary tensor is a :class:`PendingTensor`; on the decode leg of
    a prefill/decode pair it may be absent.
    """

    modality: Modality
    tensors: Mapping[str, np.ndarray | PendingTensor]
    specs: tuple[TensorSpec, ...]
    placeholder_token_id: int  # the token that receives embeddings (im_token_id)
    placeholders: tuple[PlaceholderRange, ...] = ()
    mm_hashes: tuple[str, ...] = ()

    @property
    def primary_key(self) -> str:
        """The encoder input's name (``pixel_values`` for every family so far)."""
        return next(s.name for s in self.specs if s.primary)

    @property
    def batched_keys(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.layout is TensorLayout.BATCHED)

    @property
    def flat_keys(self) -> dict[str, str]:
        return {s.name: s.sizes_key for s in self.specs if s.layout is TensorLayout.FLAT and s.sizes_key}

    @property
    def keep_on_cpu_keys(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.keep_on_cpu)

    def with_items(self, placeholders: tuple[PlaceholderRange, ...], mm_hashes: tuple[str, ...]) -> EncoderBatch:
        """This batch with its items' placeholder ranges and hashes."""
        return EncoderBatch(modality=self.modality, tensors=self.tensors, specs=self.specs,
                            placeholder_token_id=self.placeholder_token_id, placeholders=placeholders,
                            mm_hashes=mm_hashes)

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
    plans: tuple[ItemPlan[Hashable], ...] = ()  # each item's plan, in prompt order
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def modalities(self) -> frozenset[Modality]:
        return frozenset(b.modality for b in self.batches)
