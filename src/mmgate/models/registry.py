"""Model-family registry: ``config.json`` ``model_type`` -> family class.

Dispatch is on the exact ``model_type`` (no substring matching on names).
The registry refuses duplicate claims and fails loudly at import time.
A bundle whose config has no ``vision_config`` (a text-only model) gets no
family: its requests may carry text only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.models.bundle import ModelBundle
from mmgate.models.image_rows import RowSink
from mmgate.models.qwen_vl import QwenVLFamily
from mmgate.settings import ImageBackend
from mmgate.types import (
    DecodedImage,
    DecodedVideo,
    EncoderBatch,
    ItemHints,
    ItemPlan,
    Modality,
    PendingTensor,
    Replacement,
    VideoMeta,
    VideoPlan,
)


class Family(Protocol):
    """What a model family provides (see ARCHITECTURE.md, "The family interface")."""

    model_types: tuple[str, ...]
    limits: Mapping[Modality, int]

    @property
    def fingerprint(self) -> str: ...

    def anchor_token_id(self, modality: Modality) -> int: ...

    def check_hints(self, modality: Modality, hints: ItemHints, param: str) -> None: ...

    def plan(self, modality: Modality, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan: ...

    def preprocess_one(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray: ...

    def resized(self, image: DecodedImage, plan: ItemPlan) -> DecodedImage: ...

    def write_one(self, image: DecodedImage, plan: ItemPlan, raw: bool, sink: RowSink,
                  band: tuple[int, int] = (0, 1)) -> int: ...

    @property
    def row_width(self) -> int: ...

    def assemble(self, rows: Sequence[np.ndarray], plans: Sequence[ItemPlan],
                 pixel_values: PendingTensor | None = None) -> EncoderBatch: ...

    def expand(self, plan: ItemPlan) -> Replacement: ...

    # Video (families whose ``limits`` hold Modality.VIDEO): sample before decoding, plan after.
    @property
    def video_fingerprint(self) -> str: ...

    def sample_video(self, meta: VideoMeta, hints: ItemHints) -> list[int]: ...

    def plan_video(self, video: DecodedVideo, hints: ItemHints) -> VideoPlan: ...

    def preprocess_video(self, video: DecodedVideo, plan: VideoPlan, raw: bool = False) -> np.ndarray: ...

    def assemble_video(self, rows: Sequence[np.ndarray], plans: Sequence[VideoPlan]) -> EncoderBatch: ...

    def expand_video(self, plan: VideoPlan) -> Replacement: ...


class FamilyClass(Protocol):
    model_types: tuple[str, ...]

    def from_bundle(self, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None) -> Family: ...


_FAMILIES: tuple[type, ...] = (QwenVLFamily,)


def _build_table() -> dict[str, type]:
    table: dict[str, type] = {}
    for cls in _FAMILIES:
        for model_type in cls.model_types:  # type: ignore[attr-defined]
            if model_type in table:
                raise RuntimeError(f"model_type {model_type!r} claimed by {table[model_type].__name__} and {cls.__name__}")
            table[model_type] = cls
    return table


FAMILY_BY_MODEL_TYPE: dict[str, type] = _build_table()


def supports_vision(bundle: ModelBundle) -> bool:
    """Whether the model has a vision tower (``vision_config`` in config.json)."""
    return isinstance(bundle.config.get("vision_config"), dict)


def load_family(bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                video_backend: ImageBackend | None = None) -> Family | None:
    """The family serving ``bundle``, or None for a text-only model (``video_backend``: see
    ``QwenVLFamily.from_bundle``).

    Raises:
        GatewayError(MODEL_NOT_FOUND): a vision model whose ``model_type`` no family serves.
    """
    from mmgate.errors import ErrorCode, GatewayError

    cls = FAMILY_BY_MODEL_TYPE.get(bundle.model_type)
    if cls is None:
        if supports_vision(bundle):
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no mmgate family serves model_type {bundle.model_type!r}")
        return None
    family: Family = cls.from_bundle(bundle, tokenizer, backend, video_backend)  # type: ignore[attr-defined]
    return family
