"""Model-family registry: ``config.json`` ``model_type`` -> family class.

Dispatch is on the exact ``model_type`` (no substring matching on names).
The registry refuses duplicate claims and fails loudly at import time.

A bundle that shows no sign of taking media (:func:`media_markers` finds
nothing: no ``vision_config`` / ``audio_config`` / media token ids at the top
of ``config.json`` or one level down in a nested config such as
``thinker_config``, no image/video processor or feature-extractor files) is a
text-only model and gets no family: its requests may carry text only.  A bundle
that does take media but whose ``model_type`` no family claims is refused at
start-up (``mmgate serve``, ``mmgate engine``, ``mmgate sidecar``) with a
message naming its ``model_type`` and the registered families
(:func:`check_servable`), never loaded as text-only.
"""

from __future__ import annotations

import importlib

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import Family, FamilyClass
from mmgate.models.backend import FrameSampling, ImageBackend

__all__ = ["FAMILY_BY_MODEL_TYPE", "FAMILY_MODULES", "Family", "FamilyClass", "check_servable", "load_family",
           "media_markers", "registered_families", "supports_vision"]

#: the family modules of ``mmgate.models``, each exporting ``FAMILY`` (its family class); adding a
#: family = one module + its name here + its golden file + its row in the contract test
FAMILY_MODULES: tuple[str, ...] = ("qwen_vl", "gemma3", "llava", "llava_next", "llava_onevision", "llama4", "internvl",
                                     "qwen_omni", "qwen3_asr")

_FAMILIES: tuple[type, ...] = tuple(importlib.import_module(f"mmgate.models.{name}").FAMILY
                                    for name in FAMILY_MODULES)


def _build_table() -> dict[str, type]:
    table: dict[str, type] = {}
    for cls in _FAMILIES:
        for model_type in cls.model_types:  # type: ignore[attr-defined]
            if model_type in table:
                raise RuntimeError(f"model_type {model_type!r} claimed by {table[model_type].__name__} and {cls.__name__}")
            table[model_type] = cls
    return table


FAMILY_BY_MODEL_TYPE: dict[str, type] = _build_table()


#: config.json keys that say a model takes media (looked for at the top and one level down)
MEDIA_CONFIG_KEYS = (
    "vision_config", "audio_config", "visual", "vision_tower", "speech_config",
    "image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id",
    "audio_token_index",
)
#: keys of a processor file that name a media processor
_PROCESSOR_KEYS = ("image_processor_type", "video_processor_type", "feature_extractor_type", "image_processor",
                   "video_processor", "feature_extractor", "audio_processor")


def supports_vision(bundle: ModelBundle) -> bool:
    """Whether the model has a vision tower (``vision_config`` in config.json)."""
    return isinstance(bundle.config.get("vision_config"), dict)


def media_markers(bundle: ModelBundle) -> tuple[str, ...]:
    """What in ``bundle`` says the model takes media; empty for a text-only model.

    Returns:
        Sorted marker names, each a config key (``vision_config``), a nested one
        (``thinker_config.vision_config``: vLLM and transformers keep the Omni models'
        towers under ``thinker_config``) or a processor file
        (``preprocessor_config.json``, ``video_preprocessor_config.json``,
        ``processor_config.json``) that names an image, video or audio processor.
    """
    found: set[str] = set()
    for key, value in bundle.config.items():
        if key in MEDIA_CONFIG_KEYS and value is not None:
            found.add(key)
        elif isinstance(value, dict):
            found.update(f"{key}.{k}" for k in MEDIA_CONFIG_KEYS if value.get(k) is not None)
    files = {"preprocessor_config.json": bundle.preprocessor_config,
             "video_preprocessor_config.json": bundle.video_preprocessor_config,
             "processor_config.json": bundle.processor_config}
    for name, data in files.items():
        if any(k in data for k in _PROCESSOR_KEYS) or (name == "video_preprocessor_config.json" and data):
            found.add(name)
    return tuple(sorted(found))


def registered_families() -> str:
    """The families that exist, for messages: ``QwenVLFamily (qwen2_vl, qwen2_5_vl, qwen3_vl)``."""
    claims: dict[str, list[str]] = {}
    for model_type, cls in FAMILY_BY_MODEL_TYPE.items():
        claims.setdefault(cls.__name__, []).append(model_type)
    return "; ".join(f"{name} ({', '.join(types)})" for name, types in claims.items())


def check_servable(bundle: ModelBundle) -> None:
    """Refuse, at start-up, a media model no family serves (text-only models and served ones pass).

    Reads only ``bundle`` (no tokenizer, no weights), so the reference engine can call it
    before it builds the model.

    Raises:
        GatewayError(MODEL_NOT_FOUND): ``bundle`` takes media (:func:`media_markers`) but its
            ``model_type`` is not registered; the message names the ``model_type``, the markers
            and the registered families.
    """
    from mmgate.errors import ErrorCode, GatewayError

    if bundle.model_type in FAMILY_BY_MODEL_TYPE:
        return
    markers = media_markers(bundle)
    if markers:
        raise GatewayError(
            ErrorCode.MODEL_NOT_FOUND,
            f"model_type {bundle.model_type!r} takes media ({', '.join(markers)}) but no mmgate family supports "
            f"it yet; registered families: {registered_families()}")


def load_family(bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                video_backend: ImageBackend | None = None,
                video_sampling: FrameSampling = FrameSampling.VLLM) -> Family | None:
    """The family serving ``bundle``, or None for a text-only model (``video_backend``: the video
    path's backend; the gateway passes ``torchvision``: the reference video processors,
    ``Qwen2VLVideoProcessor`` and kin, are torchvision-only whatever backend the images follow, and
    their resize needs no torch here, :mod:`mmgate.media.tv_resize`; ``video_sampling``:
    ``--video-frame-sampling``).

    Raises:
        GatewayError(MODEL_NOT_FOUND): a media model whose ``model_type`` no family serves
            (:func:`check_servable`).
    """
    check_servable(bundle)
    cls = FAMILY_BY_MODEL_TYPE.get(bundle.model_type)
    if cls is None:
        return None
    family: Family = cls.from_bundle(bundle, tokenizer, backend, video_backend,  # type: ignore[attr-defined]
                                     video_sampling=video_sampling)
    return family
