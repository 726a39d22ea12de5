"""Encode disaggregation (EPD): the encode leg runs the model's own vision tower on one item; the
prefill leg uses those embeddings instead of running its tower.

Stage: engine model thread (the encode leg) and request intake (the prefill leg).  In: one
item's tensors as a :class:`~mmgate.refengine.mm_inputs.MediaBatch` (the encoder input and the
item's side tensors, e.g. ``image_grid_thw``); out: a handoff tree (:mod:`.handoff`) holding what
the model's ``get_<modality>_features`` returned for it, and on the prefill side the model's own
``mm_encoder_outputs`` value built from every item's tree (:func:`combine`).

transformers 5.24 multimodal models take ``mm_encoder_outputs={"image": <output of
get_image_features>, "video": ...}`` in ``forward`` and then skip their tower
(``Qwen2_5_VLModel.forward``, ``Qwen3VLModel.forward``: ``pooler_output`` scattered onto the
placeholder positions, Qwen3-VL's ``deepstack_features`` added at the deepstack layers); the
grids still ride in the prefill's own request (TokenSpeed items keep their side tensors without
the encoder input) for M-RoPE.  Because Qwen-VL towers attend within each image only (block
attention over ``cu_seqlens``), an item encoded alone gives the rows the whole batch gives it,
so EPD, PD and a single engine compute the same numbers (tested for Qwen2.5-VL and Qwen3-VL).

Per item the tree keeps every field of the tower's output except the whole-call hidden states
(``last_hidden_state``, ``hidden_states``, ``attentions``, which the forward does not read):
a tuple is a per-image split (concatenated across items), a list a per-layer list (joined layer
by layer), a tensor a batch-first tensor (concatenated on dim 0).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers.utils import ModelOutput

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import LoadedModel
from mmgate.refengine.mm_inputs import MediaBatch
from mmgate.types import Modality

#: fields of a tower's output that describe the whole call, not its per-item embeddings
_NOT_EMBEDDINGS = frozenset({"last_hidden_state", "hidden_states", "attentions"})


def tower(loaded: LoadedModel, modality: Modality) -> Any:
    """The model's ``get_<modality>_features`` method.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): the model has no tower for ``modality``, or it is audio.
    """
    if modality is Modality.AUDIO:
        # the Omni thinkers take precomputed embeddings (``mm_encoder_outputs``) for images and video only;
        # their forward always runs the audio tower on ``input_features``
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           "the reference engine encodes no audio on an encode worker: send audio items with "
                           "their features to the prefill")
    method = getattr(loaded.model, f"get_{modality.value}_features", None)
    if method is None or not loaded.facts.supports_vision:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           f"model {loaded.facts.model_type!r} has no {modality.value} tower to encode with")
    return method


def _rows(value: Any) -> int:
    """Embedding rows in a field value (every leaf tensor's elements over its last dimension)."""
    if isinstance(value, torch.Tensor):
        return value.numel() // value.shape[-1] if value.ndim else 0
    if isinstance(value, tuple):
        return sum(_rows(v) for v in value)
    return 0


def encode_item(loaded: LoadedModel, item: MediaBatch, embedding_rows: int) -> dict[str, Any]:
    """Run the tower on one item; the handoff tree of its embeddings (call from the model thread).

    ``embedding_rows``: the item's placeholder positions (the sum of its runs); the tower's
    ``pooler_output`` must fill exactly that many.

    Raises:
        GatewayError(INVALID_REQUEST): no encoder input, or embeddings that do not fit the placeholders.
        ValueError / RuntimeError: what the model code raises on the tensors.
    """
    method = tower(loaded, item.modality)
    if item.primary not in item.tensors:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "the encode item carries no encoder_input")
    params = inspect.signature(method).parameters
    kwargs = {name: t for name, t in item.tensors.items() if name in params}
    if item.primary not in kwargs:  # a tower whose first parameter has another name
        first = next(iter(params))
        kwargs[first] = item.tensors[item.primary]
    with torch.inference_mode():
        out = method(**kwargs, return_dict=True)
    fields = {k: v for k, v in out.items() if k not in _NOT_EMBEDDINGS and v is not None}
    rows = _rows(fields.get("pooler_output"))
    if rows != embedding_rows:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"the item's {item.modality.value} tower gives {rows} embeddings for "
                           f"{embedding_rows} placeholder positions")
    return {"class": f"{type(out).__module__}:{type(out).__qualname__}", "modality": item.modality.value,
            "fields": fields}


def _output_class(name: str) -> type[ModelOutput]:
    """The tower output class named ``module:qualname``: a transformers ``ModelOutput`` only.

    Raises:
        TypeError: any other name.
    """
    module, _, qualname = name.partition(":")
    if not module.startswith("transformers."):
        raise TypeError(f"encoder output class {name!r} is not a transformers class")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, ModelOutput)):
        raise TypeError(f"encoder output class {name!r} is not a ModelOutput")
    return cls


def _join(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(values), dim=0)
    if isinstance(first, tuple):
        return tuple(x for v in values for x in v)
    if isinstance(first, list):
        if any(len(v) != len(first) for v in values):
            raise ValueError("encode items disagree on their layer count")
        return [_join([v[i] for v in values]) for i in range(len(first))]
    return first


def combine(trees: Sequence[dict[str, Any]]) -> Any:
    """One modality's ``mm_encoder_outputs`` value from its items' trees, in prompt order.

    Raises:
        ValueError: trees of different classes or fields.
        TypeError: a class that is not a transformers output.
    """
    if not trees:
        raise ValueError("no encode items to combine")
    names = {t["class"] for t in trees}
    keys = {tuple(sorted(t["fields"])) for t in trees}
    if len(names) != 1 or len(keys) != 1:
        raise ValueError("encode items of one modality came from different towers")
    cls = _output_class(trees[0]["class"])
    return cls(**{k: _join([t["fields"][k] for t in trees]) for k in trees[0]["fields"]})
