"""Refuse, before any fetch, media that no registered worker of the model can take.

Stage: right after the processing-mode decision, before planning fetches anything (router mode).
In: the parsed chat request, the served model's family and the worker registry; out: nothing, or
``multimodal_not_supported`` (400) naming the first content part of the refused kind.

Each content part is one kind of media of the capability matrix
(:mod:`mmgate.engines.capabilities`): ``image_url`` image, ``video_url`` video, ``input_audio`` and
``audio_url`` audio, ``image_embeds`` image embeds.  A kind the model's family does not take at all is left to
planning, which refuses it with its own message (``mmgate.pipeline.planning``); every other kind must be
taken by some registered worker: its wire's row of the matrix and its model
(:meth:`mmgate.routing.workers.WorkerRegistry.check_kinds`).  Image embeds have no pipeline stage
and no wire carries them: they are always refused here, so planning never sees them.

The matrix's second axis is asked of the family (:func:`media_positions`): media of an M-RoPE family
(``Family.mrope``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is not taken by an SGLang worker, which would
position it as text (``mrope_media_not_supported``, 400; docs/engines-sglang.md), unless
``--sglang-allow-mrope-media``.  Its third axis too: the clips of a family whose placeholder ids are vLLM's
rewrite (``Family.vllm_video_ids``) are taken only by workers whose wire embeds those ids
(:data:`mmgate.engines.capabilities.VIDEO_IDS`); with only other workers
registered they are ``multimodal_not_supported`` (400), before any fetch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmgate.request.protocol import (
    AudioPart,
    AudioURLPart,
    ChatCompletionRequest,
    ImageEmbedsPart,
    ImagePart,
    VideoPart,
)
from mmgate.engines.capabilities import KIND_MODALITY, MediaKind, MediaPositions, Positions, VideoIds

if TYPE_CHECKING:
    from mmgate.routing.context import DispatchContext

_PART_KIND: dict[type, MediaKind] = {ImagePart: MediaKind.IMAGE, VideoPart: MediaKind.VIDEO,
                                     AudioPart: MediaKind.AUDIO, AudioURLPart: MediaKind.AUDIO,
                                     ImageEmbedsPart: MediaKind.IMAGE_EMBEDS}


def media_kinds(req: ChatCompletionRequest) -> dict[MediaKind, str]:
    """Each kind of media the request carries -> the ``param`` of its first content part, in prompt order."""
    kinds: dict[MediaKind, str] = {}
    for mi, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for pi, part in enumerate(message.content):
            kind = _PART_KIND.get(type(part))
            if kind is not None and kind not in kinds:
                kinds[kind] = f"messages[{mi}].content[{pi}]"
    return kinds


def media_positions(state: DispatchContext) -> MediaPositions:
    """How the served model positions media, asked of its family (``Family.mrope``; no family: text only, 1-D),
    with ``--sglang-allow-mrope-media``, and which ids its clip placeholders are (``Family.vllm_video_ids``)."""
    family = state.runtime.family
    mrope = family is not None and family.mrope
    vllm_ids = family is not None and family.vllm_video_ids
    return MediaPositions(Positions.MROPE if mrope else Positions.ROPE,
                          sglang_allow_mrope_media=state.settings.sglang_allow_mrope_media,
                          video_ids=VideoIds.VLLM if vllm_ids else VideoIds.MODEL)


def check_capable(state: DispatchContext, req: ChatCompletionRequest) -> None:
    """See the module docstring.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): a kind of media no registered worker takes.
        GatewayError(MROPE_MEDIA_NOT_SUPPORTED): media of an M-RoPE family whose only takers are SGLang workers.
    """
    kinds = media_kinds(req)
    if not kinds:
        return
    family = state.runtime.family
    limits = family.limits if family is not None else {}
    checked = {kind: param for kind, param in kinds.items()
               if kind not in KIND_MODALITY or KIND_MODALITY[kind] in limits}
    state.workers.check_kinds(checked, media_positions(state))
