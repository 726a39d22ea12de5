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

A worker takes a modality when its wire's row has it and the model it serves does
(``supports_vision`` for images and video; TokenSpeed's ``supported_modalities`` when reported).
"Image embeds" is vLLM's ``image_embeds`` content part: no wire carries it, so it is always
refused.
"""

from __future__ import annotations

from collections.abc import Iterable
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


def takes_all(caps: Capabilities, modalities: Iterable[Modality]) -> bool:
    """Whether a worker with ``caps`` takes every one of ``modalities`` (true for none)."""
    return frozenset(modalities) <= caps.modalities
