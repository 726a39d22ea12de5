"""The family seam: what a model family provides, and the generic assembly of its tensors.

A family (one module per model line in ``mmgate/models/``) maps each modality it takes to one
*media processor* (:attr:`Family.processors`, ``Mapping[Modality, MediaProcessor]``): an
:class:`ImageProcessor`, a :class:`VideoProcessor` or an :class:`AudioProcessor`.  Each one can

* **plan** an item from its size (images), its header and decoded frames (videos) or its decoded
  samples (audio) alone:
  an :class:`~mmgate.types.ItemPlan`, the one plan type of every modality, with the token count and
  the shape of the item's share of every tensor (:class:`~mmgate.types.TensorSpec` says each
  tensor's dtype, layout and placement) and the modality's specifics in its ``detail`` (a tuple of
  the family's geometry; a clip's :class:`~mmgate.types.VideoDetail`);
* **write** the item's tensors: :meth:`ImageProcessor.plan_tensors` (the ones known from the
  plan: grids, sizes, crop counts) and :meth:`ImageProcessor.preprocess` (the primary encoder
  input from the pixels); a processor whose primary tensor is a flat 2-D row tensor may also
  offer :class:`RowWriter` (computed block by block straight into a transport buffer);
* **expand** the item's anchor into a prompt update (:class:`~mmgate.types.Replacement`):
  token-level ids, or text-level text that the pipeline tokenizes with its neighbours.

Generic code (the pipeline, the transport, the engine adapters, the reference engine) reads
only these objects and the specs: it knows no family's tensor names or formulas.
:func:`assemble` stacks per-item shares into an :class:`~mmgate.types.EncoderBatch` by layout
(``batched``: stacked, zero-padded to the largest share when shapes differ, as transformers'
``_pad_for_batching``; ``flat``: concatenated; ``shared``: the first).

How to add a family: docs/families.md (worked example: LLaVA-1.5).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.bundle import ModelBundle

#: ``sink(first_row, rows)``: receives each finished block ``[b, width]`` (a reused buffer: copy it)
from mmgate.models.image_rows import RowSink  # noqa: E402  (re-exported for families)
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.types import (
    DecodedAudio,
    DecodedImage,
    DecodedVideo,
    EncoderBatch,
    ItemHints,
    ItemPlan,
    Modality,
    PendingTensor,
    Replacement,
    TensorLayout,
    TensorSpec,
    VideoDetail,
    VideoMeta,
)

__all__ = ["AudioProcessor", "AudioTrackVideo", "BatchPlanner", "Family", "FamilyClass", "ImageOnlyFamily",
           "ImageProcessor", "ImageVideoFamily",
           "MediaProcessor", "RowSink", "RowWriter", "Transcriber", "TranscriptStream", "VideoProcessor",
           "VideoRowWriter", "assemble", "combine", "deferrable", "primary_spec", "processor", "processor_map"]


class _Processor(Protocol):
    """What every modality's processor has."""

    #: the modality it handles
    modality: Modality
    #: the tensors it produces, the primary (encoder input) first
    specs: tuple[TensorSpec, ...]
    #: whether a worker that normalizes on its device (``raw`` uint8 pixels) reproduces the reference's
    #: values; False keeps the normalization in the gateway whatever the worker offers
    device_normalizable: bool

    @property
    def anchor_token_id(self) -> int:
        """The token the chat template leaves once per item (``<|image_pad|>``, ``<image>``,
        ``<start_of_image>``)."""
        ...

    @property
    def placeholder_token_id(self) -> int:
        """The token that receives the encoder output (vLLM ``im_token_id``); may differ from the anchor."""
        ...

    @property
    def fingerprint(self) -> str:
        """Identifies the model and every preprocessing setting of this modality (cache and hash key)."""
        ...

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Refuse hints or ``mm_processor_kwargs`` this modality does not take, before any fetch.

        Raises:
            GatewayError(INVALID_REQUEST): naming ``param``.
        """
        ...


@runtime_checkable
class ImageProcessor(_Processor, Protocol):
    """The image side of a family."""

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """The item's share of every tensor but the primary, from its plan alone (shapes as
        ``plan.shapes``); also what the decode leg of a prefill/decode pair receives."""
        ...

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """Plan one image from its decoded size (pixels) and hints.

        Raises:
            GatewayError(INVALID_REQUEST): a size the reference processor refuses.
        """
        ...

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """The item's share of the primary tensor, shape ``plan.primary_shape``: float32 normalized
        values as the reference processor's, or with ``raw`` the resized uint8 pixels in the same
        layout (a worker that normalizes on device; only families whose specs allow it)."""
        ...

    def expand(self, plan: ItemPlan) -> Replacement:
        """The prompt update replacing this item's anchor."""
        ...


@runtime_checkable
class RowWriter(Protocol):
    """Optional for an :class:`ImageProcessor` whose primary tensor is flat ``[rows, width]``:
    compute an item's rows block by block into a sink (a shared-memory segment, the tail of the
    serialized request), in horizontal bands on several threads."""

    def resized(self, image: DecodedImage, plan: ItemPlan) -> DecodedImage:
        """``image`` resized as the plan says (itself when unchanged)."""
        ...

    def write_rows(self, image: DecodedImage, plan: ItemPlan, raw: bool, sink: RowSink,
                   band: tuple[int, int] = (0, 1)) -> int:
        """:meth:`ImageProcessor.preprocess`'s rows handed to ``sink(first_row, rows)``; ``band``
        ``(k, parts)``: only the k-th of ``parts`` horizontal bands.  Returns the rows written."""
        ...


@runtime_checkable
class VideoRowWriter(Protocol):
    """Optional for a :class:`VideoProcessor` whose primary tensor is flat ``[rows, width]``: compute a
    clip's rows block by block into a sink (the tail of the serialized request, a shared-memory
    segment), so the clip's ``pixel_values`` are written once, into the buffer that carries them."""

    def write_rows(self, video: DecodedVideo, plan: ItemPlan[VideoDetail], raw: bool, sink: RowSink) -> int:
        """:meth:`VideoProcessor.preprocess`'s rows handed to ``sink(first_row, rows)`` in order, a
        block at a time; returns the rows written."""
        ...


@runtime_checkable
class VideoProcessor(_Processor, Protocol):
    """The video side of a family: frames chosen from the header, planned after decoding.

    A clip's plan is an :class:`~mmgate.types.ItemPlan` whose ``detail`` is a
    :class:`~mmgate.types.VideoDetail`: the sampled frames and header facts, with the family's geometry.
    """

    def plan_tensors(self, plan: ItemPlan[VideoDetail]) -> dict[str, np.ndarray]:
        """The clip's share of every tensor but the primary (shapes as ``plan.shapes``)."""
        ...

    def sample(self, meta: VideoMeta, hints: ItemHints) -> list[int]:
        """Stream frame indices to decode, from the container header alone."""
        ...

    def plan(self, video: DecodedVideo, hints: ItemHints) -> ItemPlan[VideoDetail]:
        """Plan one decoded clip."""
        ...

    def preprocess(self, video: DecodedVideo, plan: ItemPlan[VideoDetail], raw: bool = False) -> np.ndarray:
        """The clip's share of the primary tensor (``plan.primary_shape``)."""
        ...

    def expand(self, plan: ItemPlan[VideoDetail]) -> Replacement:
        """The prompt update replacing this clip's anchor."""
        ...


@runtime_checkable
class AudioTrackVideo(Protocol):
    """Optional for a :class:`VideoProcessor` whose model hears a clip's audio track with its frames (Qwen-Omni's
    ``use_audio_in_video``): the clip's audio becomes an item of the family's audio processor with no anchor of its
    own (a *companion* of the clip), planned, hashed and preprocessed as an audio part; the clip's prompt update
    interleaves both runs, and the companion's placeholder range is the span of the audio placeholder token inside
    the clip's range (vLLM ``_derive_audio_from_video_placeholders``: the audio shares the video's span)."""

    def audio_track_rate(self, hints: ItemHints) -> int | None:
        """The rate (Hz) the clip's audio track is wanted at for an item with ``hints``; None: not wanted."""
        ...

    def expand_with_audio(self, plan: ItemPlan[VideoDetail], audio: ItemPlan) -> Replacement:
        """The prompt update of a clip whose audio track is planned as ``audio`` (the family's audio plan)."""
        ...


@runtime_checkable
class BatchPlanner(Protocol):
    """Optional for a processor whose reference processes all of a request's items of its modality in one call,
    so that an item's share depends on the others: Qwen3-Omni audio, whose extractor zero-pads the
    shorter clips to the longest (``padding=True``), which gives them zeros instead of a reflection at their end and
    ``ceil(n / hop)`` feature frames instead of ``floor(n / hop)``.

    The modality's source asks for the batch (:meth:`mmgate.pipeline.sources.MediaSource.batch_context`, where a
    setting can turn it off: ``--no-audio-batch-padding``); the pipeline then plans each item with
    :meth:`plan_in_batch` and appends :meth:`batch_fingerprint` to its fingerprint, so the content-hash cache and
    the item hash (``mm_hashes``) tell the item's batched share from its share alone."""

    def batch_context(self, items: Sequence[DecodedAudio]) -> int:
        """What the request's decoded items of this modality (prompt order, companions included) pass to each
        item's plan (Qwen3-Omni: the length, in samples, the batch is padded to)."""
        ...

    def plan_in_batch(self, item: DecodedAudio, hints: ItemHints, context: int) -> ItemPlan:
        """:meth:`AudioProcessor.plan` of ``item`` in the batch ``context`` describes (the plan's ``detail`` holds
        what ``preprocess`` needs of it)."""
        ...

    def batch_fingerprint(self, plan: ItemPlan) -> str:
        """What the item's share owes to its batch, as a fingerprint suffix; ``""`` when nothing (the share equals
        the item's share alone, and so does its cache key)."""
        ...


@runtime_checkable
class AudioProcessor(_Processor, Protocol):
    """The audio side of a family: one decoded clip (mono float32 at :attr:`sampling_rate`) -> features.

    The audio source (:mod:`mmgate.media.sources`) decodes, downmixes and resamples each clip to
    :attr:`sampling_rate` before :meth:`plan` sees it; the plan's ``detail`` carries the family's
    specifics (valid feature frames, the encoder's output length), ``shapes`` every tensor's share.
    """

    #: the rate (Hz) the feature extractor expects (``WhisperFeatureExtractor.sampling_rate``: 16000)
    sampling_rate: int

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """The clip's share of every tensor but the primary, from its plan alone (feature masks, lengths)."""
        ...

    def plan(self, audio: DecodedAudio, hints: ItemHints) -> ItemPlan:
        """Plan one decoded clip: token count (the placeholder run) and every tensor's share.

        Raises:
            GatewayError(INVALID_REQUEST | AUDIO_TOO_LONG): a clip the reference processor refuses.
        """
        ...

    def preprocess(self, audio: DecodedAudio, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """The clip's share of the primary tensor, shape ``plan.primary_shape`` (e.g. the valid frames of
        ``input_features``, never a clip padded to the extractor's window); ``raw`` is never set for audio
        (``device_normalizable`` is False)."""
        ...

    def expand(self, plan: ItemPlan) -> Replacement:
        """The prompt update replacing this clip's anchor (audio start, the pad run, audio end)."""
        ...


MediaProcessor = ImageProcessor | VideoProcessor | AudioProcessor


class Family(Protocol):
    """What a model family provides: one processor per modality it takes (:attr:`processors`).

    Generic code reaches a modality's processor only through :attr:`processors` (or :func:`processor`);
    the ``image`` / ``video`` properties of the base classes below are conveniences for family modules and
    tests.  ``limits`` has an entry for exactly the modalities of :attr:`processors`.
    """

    model_types: tuple[str, ...]
    #: items per request, per modality it takes
    limits: Mapping[Modality, int]
    #: whether its language model positions media with M-RoPE (3-D positions from each item's grid), so an
    #: engine must see the grids and the media tokens together to position them (Qwen2-VL, Qwen2.5-VL,
    #: Qwen3-VL): the decode leg of a prefill/decode pair needs the grid tensors; False: plain 1-D positions,
    #: one per token
    mrope: bool
    #: whether its clips' placeholder ids are vLLM's rewrite of them (a token past the checkpoint's embedding
    #: table that only vLLM's model runner reads as an embedding position, never looks up: InternVL3's
    #: ``<video>``), so only an engine that reads that rewrite embeds them; False: the clip's ids are tokens of
    #: the model's own vocabulary (or the family takes no video)
    vllm_video_ids: bool
    #: the modalities whose prompt updates are text-level (the prompt text re-tokenized with the update in
    #: place: Gemma 3 images, InternVL3 clips), so they cannot be expanded from ids alone (media references
    #: forwarded to a worker carry no prompt text)
    text_updates: frozenset[Modality]

    @property
    def processors(self) -> Mapping[Modality, MediaProcessor]:
        """The media processor of each modality this family takes here (a modality absent: not taken, e.g.
        video without PyAV)."""
        ...

    @property
    def fingerprint(self) -> str:
        """Identifies the model and every preprocessing setting (cache and hash key)."""
        ...

    @property
    def reserved_tokens(self) -> tuple[str, ...]:
        """Token strings this family uses as anchors, placeholders or media-structure markers; caller
        text may never contain them (:mod:`mmgate.chat.integrity`)."""
        ...


P = TypeVar("P", bound=ImageProcessor)
V = TypeVar("V", bound=VideoProcessor)


def processor_map(*procs: MediaProcessor | None) -> dict[Modality, MediaProcessor]:
    """``{proc.modality: proc}`` of the given processors, None skipped (a family's :attr:`Family.processors`)."""
    return {p.modality: p for p in procs if p is not None}


class ImageOnlyFamily(Generic[P]):
    """The part every images-only family shares: its image processor, its per-request image limit
    and the token strings caller text may not hold; no video.  A subclass sets ``model_types`` and
    writes ``from_bundle`` (LLaVA-1.5, LLaVA-NeXT, Gemma 3)."""

    model_types: tuple[str, ...] = ()
    limits: Mapping[Modality, int] = {}
    mrope = False  # LLaVA-1.5, LLaVA-NeXT and Gemma 3 position every token 1-D
    vllm_video_ids = False  # no video
    text_updates: frozenset[Modality] = frozenset()  # token-level image updates (Gemma 3 overrides)

    def __init__(self, images: P, limit: int, reserved: tuple[str, ...]) -> None:
        self._images = images
        self.limits = {Modality.IMAGE: limit}
        self._reserved = reserved
        self._processors: Mapping[Modality, MediaProcessor] = processor_map(images)

    @property
    def processors(self) -> Mapping[Modality, MediaProcessor]:
        """``{IMAGE: the image processor}``."""
        return self._processors

    @property
    def fingerprint(self) -> str:
        return self._images.fingerprint

    @property
    def reserved_tokens(self) -> tuple[str, ...]:
        return self._reserved

    @property
    def image(self) -> P:
        return self._images

    @property
    def video(self) -> None:
        return None


class ImageVideoFamily(Generic[P, V]):
    """The part every family with images and an optional clip processor shares: both processors, the
    per-request item limits (no video entry when ``video`` is None, e.g. PyAV missing) and the token strings
    caller text may not hold.  A subclass sets ``model_types`` (and the family properties where they differ)
    and writes ``from_bundle`` (LLaVA-OneVision, InternVL3)."""

    model_types: tuple[str, ...] = ()
    limits: Mapping[Modality, int] = {}
    mrope = False  # 1-D positions, one per token
    vllm_video_ids = False  # the clip's ids are tokens of the model's own vocabulary
    text_updates: frozenset[Modality] = frozenset()  # token-level images and clips

    def __init__(self, images: P, video: V | None, image_limit: int, video_limit: int,
                 reserved: tuple[str, ...]) -> None:
        self._images = images
        self._video = video
        self.limits = {Modality.IMAGE: image_limit, **({Modality.VIDEO: video_limit} if video is not None else {})}
        self._reserved = reserved
        self._processors: Mapping[Modality, MediaProcessor] = processor_map(images, video)

    @property
    def processors(self) -> Mapping[Modality, MediaProcessor]:
        """The image processor, and the clip processor when there is one."""
        return self._processors

    @property
    def fingerprint(self) -> str:
        """Both processors' fingerprints (the image one alone when there is no clip processor)."""
        video = f"|{self._video.fingerprint}" if self._video is not None else ""
        return self._images.fingerprint + video

    @property
    def reserved_tokens(self) -> tuple[str, ...]:
        """The media tokens user text may never produce (the prompt-integrity check)."""
        return self._reserved

    @property
    def image(self) -> P:
        """The image processor."""
        return self._images

    @property
    def video(self) -> V | None:
        """The clip processor (None: no video here, e.g. PyAV missing)."""
        return self._video


class FamilyClass(Protocol):
    """A family class: the ``model_type`` values it claims and how it reads a bundle."""

    model_types: tuple[str, ...]

    def from_bundle(self, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> Family: ...


def processor(family: Family, modality: Modality) -> MediaProcessor:
    """``family``'s processor for ``modality`` (:attr:`Family.processors`).

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): the family does not take ``modality`` here.
    """
    found = family.processors.get(modality)
    if found is None:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           f"{family.model_types[0]} does not take {modality.value} input here")
    return found


def primary_spec(specs: Sequence[TensorSpec]) -> TensorSpec:
    """The encoder input of ``specs`` (exactly one is primary)."""
    found = [s for s in specs if s.primary]
    if len(found) != 1:
        raise ValueError(f"a modality needs exactly one primary tensor, found {len(found)}")
    return found[0]


def combine(spec: TensorSpec, parts: Sequence[np.ndarray]) -> np.ndarray:
    """Items' shares of one tensor -> the batch tensor, by ``spec.layout``.

    ``batched``: ``[N, *share]`` (shares of different shapes zero-padded to the largest in each
    dimension, as transformers ``LlavaNextImageProcessor._pad_for_batching``); ``flat``: shares
    concatenated along the first dimension; ``shared``: the first share.
    """
    dtype = np.dtype(spec.dtype) if not parts else parts[0].dtype
    if spec.layout is TensorLayout.SHARED:
        return parts[0] if parts else np.empty(0, dtype=dtype)
    if spec.layout is TensorLayout.FLAT:
        if not parts:
            return np.empty(0, dtype=dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if not parts:
        return np.empty((0,), dtype=dtype)
    shapes = {p.shape for p in parts}
    if len(shapes) == 1:
        return np.stack(parts)
    rank = {len(s) for s in shapes}
    if len(rank) != 1:
        raise ValueError(f"{spec.name}: item shares of different ranks cannot be batched")
    biggest = tuple(max(dims) for dims in zip(*shapes))
    out = np.zeros((len(parts), *biggest), dtype=dtype)
    for i, p in enumerate(parts):
        out[i][tuple(slice(0, d) for d in p.shape)] = p
    return out


def deferrable(spec: TensorSpec, plans: Sequence[ItemPlan[Hashable]]) -> bool:
    """Whether the primary tensor can be a :class:`PendingTensor` written row by row: flat, or
    batched with every item's share the same shape (no padding to place)."""
    if spec.layout is TensorLayout.FLAT:
        return True
    return spec.layout is TensorLayout.BATCHED and len({pl.primary_shape for pl in plans}) <= 1


def primary_layout(spec: TensorSpec, plans: Sequence[ItemPlan[Hashable]]) -> tuple[tuple[int, ...], list[int]]:
    """Shape of the whole primary tensor and each item's first row in its ``[rows, width]`` view
    (:func:`deferrable` layouts only): flat ``[sum(rows), *share[1:]]``; batched ``[N, *share]``,
    one row per item."""
    if spec.layout is TensorLayout.FLAT:
        firsts = [0]
        for pl in plans:
            firsts.append(firsts[-1] + pl.primary_shape[0])
        tail = plans[0].primary_shape[1:] if plans else ()
        return (firsts[-1], *tail), firsts[:-1]
    share = plans[0].primary_shape if plans else ()
    return (len(plans), *share), list(range(len(plans)))


def item_rows(spec: TensorSpec, plan: ItemPlan[Hashable]) -> int:
    """Rows of one item in the primary tensor's ``[rows, width]`` view (flat: its first dimension;
    batched: one)."""
    return plan.primary_shape[0] if spec.layout is TensorLayout.FLAT else 1


def assemble(proc: MediaProcessor, plans: Sequence[ItemPlan[Hashable]],
             primaries: Sequence[np.ndarray] | np.ndarray | PendingTensor | None) -> EncoderBatch:
    """The batch of one modality, in prompt order (no placeholders or hashes yet).

    ``primaries``: each item's share of the primary tensor (:meth:`ImageProcessor.preprocess`),
    the whole primary tensor already laid out (an array), a :class:`PendingTensor` for all of them (values still to be computed), or None (a decode
    leg that carries no encoder input).  The other tensors come from ``proc.plan_tensors``.
    """
    tensors: dict[str, np.ndarray | PendingTensor] = {}
    shares = [proc.plan_tensors(pl) for pl in plans]  # type: ignore[arg-type]
    for spec in proc.specs:
        if spec.primary:
            if isinstance(primaries, (PendingTensor, np.ndarray)):
                tensors[spec.name] = primaries
            elif primaries is not None:
                tensors[spec.name] = combine(spec, list(primaries))
            continue
        parts = [np.asarray(s[spec.name]) for s in shares]
        tensors[spec.name] = combine(spec, parts).astype(spec.dtype, copy=False)
    return EncoderBatch(modality=proc.modality, tensors=tensors, specs=proc.specs,
                        placeholder_token_id=proc.placeholder_token_id)


@runtime_checkable
class Transcriber(Protocol):
    """Optional for a family with an audio processor whose model transcribes (``POST /v1/audio/transcriptions``):
    the conversation of a transcription request, rendered with ``continue_final_message``, and the reading of
    what the model generated (smg's ``TranscriptionFamily``: prompt, assistant prefill, parse)."""

    def transcription_messages(self, audio_part: Mapping[str, object], language: str | None,
                               prompt: str | None) -> list[dict[str, object]]:
        """Chat messages (``audio_part`` an ``input_audio`` chat part) whose last one is continued.

        Raises:
            GatewayError(INVALID_REQUEST): a ``language`` the model does not take (param ``language``).
        """
        ...

    def language_name(self, language: str) -> str:
        """The name the model knows ``language`` (a code or a name) by.

        Raises:
            GatewayError(INVALID_REQUEST): a language the model does not take (param ``language``).
        """
        ...

    def transcript(self, generated: str) -> tuple[str | None, str]:
        """``(language name or None, transcript)`` of the generated text (prefix markers removed)."""
        ...

    def transcript_stream(self) -> TranscriptStream:
        """A fresh incremental reader of one generation's text."""
        ...

    def clip_seconds(self, plan: ItemPlan[Hashable]) -> float:
        """The duration of the clip ``plan`` (this family's audio plan, from a request's
        :attr:`~mmgate.types.PreparedRequest.plans`) was made for (its samples over the extractor's rate)."""
        ...


class TranscriptStream(Protocol):
    """Turns the text deltas of one generation into transcript deltas (markers held back and removed)."""

    def feed(self, delta: str, finished: bool) -> str:
        """The transcript text that ``delta`` makes safe to send (the rest when ``finished``)."""
        ...
