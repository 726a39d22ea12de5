"""The capability matrix: which media each engine wire takes from the gateway as preprocessed tensors.

Stage: select worker (and the refusal before any fetch).  In: a worker's wire and what its
GetModelInfo says about the model; out: the :class:`~mmgate.types.Modality` values the worker
takes (``Capabilities.modalities``), and for a request, whether any registered worker takes each
kind of media it carries.  One table, :data:`MATRIX`, read from the engine-side code that decodes
the gateway's message (smg-grpc-servicer 0.14.1, ``smg_grpc_servicer/<engine>/servicer.py``):

============  =====  =====  =====  ============
wire          image  video  audio  image embeds
============  =====  =====  =====  ============
vllm          yes    yes    no     no
sglang        yes    no     no     no
tokenspeed    yes    yes    yes    no
============  =====  =====  =====  ============

* **vllm** (``vllm/servicer.py`` ``_build_preprocessed_mm_inputs``, l. 1073-1195): one
  ``MultimodalInputs`` batch per modality; ``vllm/mm_keys.py`` ``modality_name`` (l. 57-59) names a
  batch ``video`` when its ``modality`` is VIDEO and ``image`` otherwise, so an AUDIO batch would
  be fed to the vision encoder as an image: audio is not taken.  The batch has ``pixel_values``
  and ``model_specific_tensors``, encoder *inputs*; there is no field for precomputed embeddings.
* **sglang** (``sglang/servicer.py`` ``_convert_generate_request`` l. 939-1010, ``_parse_mm_inputs``
  l. 1017-1049): ``mm_inputs`` is read only when ``pixel_values`` is set, and becomes ONE
  ``MultimodalDataItem`` with ``modality=Modality.IMAGE`` (l. 1038) whatever ``modalities`` says:
  a video's frames would be embedded as one image with the image token's layout, so only images
  are taken; ``input_embeds=None`` (l. 992): no embeddings.
* **tokenspeed** (``tokenspeed/servicer.py`` ``_mm_inputs_from_itemized_proto`` l. 1394-1527,
  ``_modality_from_proto`` l. 1530-1537): one ``MultimodalItem`` per item, IMAGE, VIDEO or AUDIO
  (anything else is a ``ValueError``); ``encoder_input`` is "the primary input to the multimodal
  encoder" (``tokenspeed_scheduler.proto`` ``MultimodalItem``), not its output: no embeddings.
  The worker narrows the row per model with ``GetModelInfo.supported_modalities``
  (``_static_supported_modalities``, l. 584-644).

Audio, column by column: **tokenspeed** takes the gateway's features (``encoder_input`` per AUDIO item);
**vllm** cannot carry preprocessed audio (above), so router-side audio to a vLLM worker is refused with
``multimodal_not_supported`` (400, before any fetch), but audio reaches a vLLM worker as a *media reference*
(``--mm-processing worker|auto``: the worker fetches and processes it, :data:`REFS_MATRIX`); **sglang**:
refused.

Media references (``vllm_engine.proto`` ``MediaRefs``, ``--mm-processing worker|auto``) are a second row
per wire, :data:`REFS_MATRIX`: the worker's own processor decodes them, so what they carry is what that
processor takes, not what the preprocessed-tensor fields can hold.

============  =====  =====  =====
refs          image  video  audio
============  =====  =====  =====
vllm          yes    yes    yes
sglang        no     no     no
tokenspeed    no     no     no
============  =====  =====  =====

A worker takes a modality when its wire's row has it and the model it serves does
(``supports_vision`` for images and video; TokenSpeed's ``supported_modalities`` when reported).
"Image embeds" is vLLM's ``image_embeds`` content part: no wire carries it, so it is always
refused.

The matrix's second axis is how the model positions media (:class:`Positions`, asked of the model's
family: ``Family.mrope``).  :data:`POSITIONS` says which schemes a wire's engine positions correctly
from the gateway's preprocessed tensors:

============  ====  ======
wire          rope  mrope
============  ====  ======
vllm          yes   yes
sglang        yes   **no**
tokenspeed    yes   yes
============  ====  ======

* **sglang** loses M-RoPE positions (read in SGLang 0.5.23's wheel and smg-grpc-servicer 0.14.1;
  docs/engines-sglang.md has the lines): ``_parse_mm_inputs`` builds a ``MultimodalProcessorOutput``
  without ``mrope_positions``; the scheduler (``Scheduler._handle_generate_request``) pads the image
  runs with the items' hash values (``pad_input_ids`` -> ``mm_utils.pad_mm_tokens``) and only then
  ``_maybe_compute_mrope_positions`` runs ``QwenVLImageProcessor.compute_mrope_positions`` on the
  *padded* ids, where ``get_rope_index`` finds no image token after ``<|vision_start|>``: text-only
  positions, delta 0.  The wire has no positions field, so the gateway cannot send them.  Media of an
  M-RoPE model is therefore not taken by an SGLang worker unless ``--sglang-allow-mrope-media``.
* **vllm** computes M-RoPE positions in its model runner from the prompt and the batch's
  ``image_grid_thw`` / ``video_grid_thw`` (``get_mrope_input_positions``), which the wire carries.
  **tokenspeed** carries the grids per item (``model_specific_tensors``); its scheduler was not read for
  this, and it stays as it was: taken.

The third axis is which ids a family's clip placeholders are (:class:`VideoIds`, asked of the family:
``Family.vllm_video_ids``).  :data:`VIDEO_IDS` says which a wire's engine embeds:

============  =====  ====
wire          model  vllm
============  =====  ====
vllm          yes    yes
sglang        yes    no
tokenspeed    yes    **no**
============  =====  ====

* **vllm** rewrites some families' clip context ids to a token of its own, past the checkpoint's embedding
  table (which family and why: that family's module, e.g. :mod:`mmgate.models.internvl_video`): its model
  runner reads them as embedding positions and never looks them up, so the gateway sends vLLM's ids.
* **tokenspeed** (and **sglang**, which takes no video at all) embeds the prompt's ids with the model's
  table and finds the media positions from the item's own token: vLLM's rewritten ids are outside the
  vocabulary there (the reference engine's TokenSpeed servicer refuses them, ``invalid_request``).  A clip
  of such a family is therefore not taken by a TokenSpeed worker (``multimodal_not_supported``, 400,
  before any fetch); its images are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from mmgate.engines.base import Capabilities, Wire
from mmgate.types import Modality


class MediaKind(StrEnum):
    """What a request's content part carries, as the matrix's columns name it."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"
    IMAGE_EMBEDS = "image_embeds"  # precomputed embeddings (vLLM's ``image_embeds`` part): no pipeline stage


#: wire -> the kinds of media its servicer takes from the gateway (see the module docstring)
MATRIX: dict[Wire, frozenset[MediaKind]] = {
    Wire.VLLM: frozenset({MediaKind.IMAGE, MediaKind.VIDEO}),
    Wire.SGLANG: frozenset({MediaKind.IMAGE}),
    Wire.TOKENSPEED: frozenset({MediaKind.IMAGE, MediaKind.VIDEO, MediaKind.AUDIO}),
}

#: wire -> the kinds of media its engine takes as media references that it fetches and processes itself
#: (``GenerateRequest.media_refs``: vLLM's wire only; ``VllmServicer`` hands each ref to the model's own
#: multimodal processor, audio included: module docstring)
REFS_MATRIX: dict[Wire, frozenset[MediaKind]] = {
    Wire.VLLM: frozenset({MediaKind.IMAGE, MediaKind.VIDEO, MediaKind.AUDIO}),
    Wire.SGLANG: frozenset(),
    Wire.TOKENSPEED: frozenset(),
}


class Positions(StrEnum):
    """How a model positions its media tokens: the matrix's second axis (asked of the family)."""

    ROPE = "rope"  # one position per token, counted from the ids (LLaVA, Gemma 3, ...)
    MROPE = "mrope"  # 3-D (t, h, w) positions from each item's grid (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)


#: wire -> the position schemes its engine computes correctly from preprocessed tensors (module docstring)
POSITIONS: dict[Wire, frozenset[Positions]] = {
    Wire.VLLM: frozenset({Positions.ROPE, Positions.MROPE}),
    Wire.SGLANG: frozenset({Positions.ROPE}),
    Wire.TOKENSPEED: frozenset({Positions.ROPE, Positions.MROPE}),
}


def positions_kept(wire: Wire, positions: Positions, *, sglang_allow_mrope_media: bool = False) -> bool:
    """Whether a ``wire`` worker positions media of a ``positions`` model as the model expects.

    ``sglang_allow_mrope_media`` (``--sglang-allow-mrope-media``): count SGLang as keeping M-RoPE positions,
    i.e. send such media anyway, knowing it is positioned as text there.
    """
    if wire is Wire.SGLANG and positions is Positions.MROPE and sglang_allow_mrope_media:
        return True
    return positions in POSITIONS[wire]


class VideoIds(StrEnum):
    """Which ids a family's clip placeholders are on the wire: the matrix's third axis (asked of the family)."""

    MODEL = "model"  # tokens the model's own embedding table has (every family but the one below)
    VLLM = "vllm"  # vLLM's rewrite, ids past the embedding table that only vLLM's runner reads (InternVL3)


#: wire -> the clip placeholder ids its engine embeds (module docstring)
VIDEO_IDS: dict[Wire, frozenset[VideoIds]] = {
    Wire.VLLM: frozenset({VideoIds.MODEL, VideoIds.VLLM}),
    Wire.SGLANG: frozenset({VideoIds.MODEL}),
    Wire.TOKENSPEED: frozenset({VideoIds.MODEL}),
}


def video_ids_read(wire: Wire, ids: VideoIds) -> bool:
    """Whether a ``wire`` worker embeds clips whose placeholder ids are ``ids``."""
    return ids in VIDEO_IDS[wire]


@dataclass(frozen=True, slots=True)
class MediaPositions:
    """What a served model asks of a worker that takes its media: its position scheme and the SGLang opt-in,
    and which ids its clip placeholders are."""

    positions: Positions = Positions.ROPE
    sglang_allow_mrope_media: bool = False  # --sglang-allow-mrope-media
    video_ids: VideoIds = VideoIds.MODEL

    def kept(self, wire: Wire) -> bool:
        """Whether a ``wire`` worker may take this model's media (:func:`positions_kept`)."""
        return positions_kept(wire, self.positions, sglang_allow_mrope_media=self.sglang_allow_mrope_media)

    def ids_read(self, wire: Wire, modality: Modality) -> bool:
        """Whether a ``wire`` worker embeds this model's ``modality`` items as the gateway lays out their ids
        (:func:`video_ids_read` for clips; images: always)."""
        return modality is not Modality.VIDEO or video_ids_read(wire, self.video_ids)

    def id_readers(self) -> frozenset[Wire]:
        """The wires whose engines embed this model's clip placeholder ids."""
        return frozenset(w for w in Wire if video_ids_read(w, self.video_ids))

    def all_read(self, wire: Wire, modalities: Iterable[Modality]) -> bool:
        """:meth:`ids_read` for every one of ``modalities``."""
        return all(self.ids_read(wire, m) for m in modalities)


#: the pipeline's modality of a kind; a kind without one (embeddings) has no pipeline stage at all
KIND_MODALITY: dict[MediaKind, Modality] = {
    MediaKind.IMAGE: Modality.IMAGE, MediaKind.VIDEO: Modality.VIDEO, MediaKind.AUDIO: Modality.AUDIO,
}

#: what ``supports_vision = true`` means: the model takes images and video
VISION = frozenset({Modality.IMAGE, Modality.VIDEO})


def wire_modalities(wire: Wire) -> frozenset[Modality]:
    """The modalities ``wire``'s row of :data:`MATRIX` takes."""
    return frozenset(KIND_MODALITY[k] for k in MATRIX[wire] if k in KIND_MODALITY)


def worker_modalities(wire: Wire, model_modalities: Iterable[Modality]) -> frozenset[Modality]:
    """What a worker takes: its wire's row of the matrix, narrowed to what its model takes."""
    return wire_modalities(wire) & frozenset(model_modalities)


def any_wire_takes(kind: MediaKind) -> bool:
    """Whether some wire's row has ``kind`` (the gateway can send it anywhere at all)."""
    return kind in KIND_MODALITY and any(kind in row for row in MATRIX.values())


def takes(caps: Capabilities, kind: MediaKind) -> bool:
    """Whether a worker with ``caps`` takes media of ``kind``."""
    modality = KIND_MODALITY.get(kind)
    return modality is not None and modality in caps.modalities


def takes_refs(caps: Capabilities, modalities: Iterable[Modality]) -> bool:
    """Whether a worker with ``caps`` takes every one of ``modalities`` as media references
    (:data:`REFS_MATRIX`).  A modality its wire also carries as tensors (images, video) must be one its model
    takes (``caps.modalities``: ``supports_vision``); one carried only as references (audio to vLLM) is the
    worker processor's to take, the gateway's family having taken it already."""
    row = frozenset(KIND_MODALITY[k] for k in REFS_MATRIX[caps.wire] if k in KIND_MODALITY)
    tensors = wire_modalities(caps.wire)
    return all(m in row and (m in caps.modalities or m not in tensors) for m in modalities)


def takes_all(caps: Capabilities, modalities: Iterable[Modality]) -> bool:
    """Whether a worker with ``caps`` takes every one of ``modalities`` (true for none)."""
    return frozenset(modalities) <= caps.modalities
