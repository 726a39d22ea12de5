"""Clips of a model whose transformers class embeds video frames as images (InternVL3).

Stage: engine request intake (vLLM wire), for a family row with ``video_as_images``
(:class:`mmgate.refengine.families.EngineFamily`).  In: the ``GenerateRequest`` vLLM's layout
produced and the :class:`~mmgate.refengine.mm_inputs.MediaBatch` values read from it; out: the
same request with each clip's context ids read as the image token, and one IMAGE batch whose
``pixel_values`` hold every item's rows (image patches and clip frames) in prompt order.

Why: vLLM 0.33 (``vllm/model_executor/models/interns1.py`` ``_call_hf_processor``) rewrites a
clip's ``<IMG_CONTEXT>`` ids to ``<video>`` (151674, past the checkpoint's embedding table) and
sends its frames as ``pixel_values_videos``; transformers 5.24 ``InternVLForConditionalGeneration``
takes ``pixel_values`` only and finds every embedding position by ``image_token_id``, and
``InternVLProcessor.__call__`` concatenates images and clip frames in the order the prompt names
them.  The reference engine turns the first form into the second, so the model code runs as is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.mm_inputs import DEFAULT_ENCODER_INPUT_KEY, MediaBatch, mm_batches, modality_key
from mmgate.types import Modality

__all__ = ["merge_batches", "rewrite_ids"]


def _video_protos(request: vllm_engine_pb2.GenerateRequest) -> list[vllm_engine_pb2.MultimodalInputs]:
    return [mm for mm in mm_batches(request) if mm.modality == common_pb2.VIDEO]


def rewrite_ids(request: vllm_engine_pb2.GenerateRequest, image_token_id: int) -> vllm_engine_pb2.GenerateRequest:
    """``request`` with every clip's ``im_token_id`` inside its placeholder ranges replaced by
    ``image_token_id`` (a copy; the request itself when it carries no clip)."""
    videos = _video_protos(request)
    if not videos or request.WhichOneof("input") != "tokenized":
        return request
    out = vllm_engine_pb2.GenerateRequest()
    out.CopyFrom(request)
    ids = list(out.tokenized.input_ids)
    for mm in videos:
        if not mm.HasField("im_token_id"):
            continue
        for r in mm.mm_placeholders:
            for i in range(r.offset, min(r.offset + r.length, len(ids))):
                if ids[i] == mm.im_token_id:
                    ids[i] = image_token_id
    del out.tokenized.input_ids[:]
    out.tokenized.input_ids.extend(ids)
    return out


def _items(mm: vllm_engine_pb2.MultimodalInputs, batch: MediaBatch) -> list[tuple[int, torch.Tensor]]:
    """``(placeholder offset, the item's rows of the primary tensor)`` per item of one batch."""
    is_video = batch.modality is Modality.VIDEO
    rows = batch.tensors[batch.primary]
    sizes_key = mm.flat_keys.get(mm.encoder_input_key or DEFAULT_ENCODER_INPUT_KEY)
    if sizes_key is None:
        sizes = [1] * len(mm.mm_placeholders)  # batched: one row per item
        parts: Sequence[torch.Tensor] = [rows[i:i + 1].flatten(0, 1) if rows.ndim > 4 else rows[i:i + 1]
                                         for i in range(len(sizes))]
    else:
        sizes = [int(v) for v in batch.tensors[modality_key(sizes_key, is_video)].flatten().tolist()]
        parts = list(torch.split(rows, sizes))
    if len(parts) != len(mm.mm_placeholders):
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{batch.modality.value} batch: {len(parts)} items for "
                                                      f"{len(mm.mm_placeholders)} placeholders")
    return [(int(r.offset), part) for r, part in zip(mm.mm_placeholders, parts)]


def merge_batches(request: vllm_engine_pb2.GenerateRequest, batches: list[MediaBatch]) -> list[MediaBatch]:
    """One IMAGE batch with ``pixel_values`` = every image's and clip's rows in prompt order (the
    batches unchanged when the request carries no clip, or a batch carries no encoder input)."""
    protos = mm_batches(request)
    if not any(b.modality is Modality.VIDEO for b in batches) or len(protos) != len(batches) \
            or any(b.primary not in b.tensors for b in batches):
        return batches
    items: list[tuple[int, torch.Tensor]] = []
    for mm, batch in zip(protos, batches):
        items += _items(mm, batch)
    items.sort(key=lambda item: item[0])
    pixels = torch.cat([part for _, part in items])
    return [MediaBatch(Modality.IMAGE, {DEFAULT_ENCODER_INPUT_KEY: pixels}, DEFAULT_ENCODER_INPUT_KEY)]
