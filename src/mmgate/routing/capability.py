"""Refuse, before any fetch, media that no registered worker of the model can take.

Stage: right after the processing-mode decision, before planning fetches anything (router mode).
In: the parsed chat request, the served model's family and the worker registry; out: nothing, or
``multimodal_not_supported`` (400) naming the first content part of the refused kind.

Each content part is one kind of media of the capability matrix
(:mod:`mmgate.engines.capabilities`): ``image_url`` image, ``video_url`` video, ``input_audio``
audio, ``image_embeds`` image embeds.  A kind the model's family does not take at all is left to
planning, which refuses it with its own message (``mmgate.pipeline.planning``); every other kind must be
taken by some registered worker: its wire's row of the matrix and its model
(:meth:`mmgate.routing.workers.WorkerRegistry.check_kinds`).  Image embeds have no pipeline stage
and no wire carries them: they are always refused here, so planning never sees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmgate.request.protocol import (
    AudioPart,
    ChatCompletionRequest,
    ImageEmbedsPart,
    ImagePart,
    VideoPart,
)
from mmgate.engines.capabilities import KIND_MODALITY, MediaKind

if TYPE_CHECKING:
    from mmgate.routing.context import DispatchContext

_PART_KIND: dict[type, MediaKind] = {ImagePart: MediaKind.IMAGE, VideoPart: MediaKind.VIDEO,
                                     AudioPart: MediaKind.AUDIO, ImageEmbedsPart: MediaKind.IMAGE_EMBEDS}


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


def check_capable(state: DispatchContext, req: ChatCompletionRequest) -> None:
    """See the module docstring.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): a kind of media no registered worker takes.
    """
    kinds = media_kinds(req)
    if not kinds:
        return
    family = state.runtime.family
    limits = family.limits if family is not None else {}
    checked = {kind: param for kind, param in kinds.items()
               if kind not in KIND_MODALITY or KIND_MODALITY[kind] in limits}
    state.workers.check_kinds(checked)
