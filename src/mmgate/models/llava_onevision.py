"""The LLaVA-OneVision family (``model_type`` ``llava_onevision``): anyres-max tiles of 384 plus
the base image, and pooled video frames.

Stage: plan / preprocess / expand for images (here) and videos
(:mod:`mmgate.models.llava_onevision_video`).  In: a decoded RGB image; out: the item's share of
``pixel_values`` (float32 ``[1 + rows*cols, 3, 384, 384]``: the base image, then the tiles row by
row), of ``image_sizes`` (int64 ``[2]``, the original ``(height, width)``) and the ``<image>`` run
replacing its anchor.

Reference (transformers 5.24), both backends:
* ``models/llava_onevision/image_processing_llava_onevision.py`` ``LlavaOnevisionImageProcessor``
  (torchvision, what ``AutoProcessor`` picks) and ``image_processing_pil_llava_onevision.py``
  ``LlavaOnevisionImageProcessorPil``: the pixel path of LLaVA-NeXT (``_get_image_patches``:
  ``select_best_resolution`` over ``image_grid_pinpoints``, ``_resize_for_patching``, zero padding
  centred, ``divide_to_patches``, the original resized to ``size`` (384x384) first), so the pixels
  are :class:`mmgate.models.llava_next.AnyresImages`' with a 384 tile and mean = std = 0.5.
  ``crop_size`` is None there, so the tile is ``size["height"]``; every tile's own resize to
  ``size`` is an identity.
* tokens: ``models/llava_onevision/processing_llava_onevision.py``
  ``LlavaOnevisionProcessor._get_number_of_features``: ``num_image_tokens`` (729 = 27 x 27, the
  SigLIP grid; no CLS) for the base image, plus ``_get_unpadded_features``: the LLaVA-NeXT
  unpadded grid and one newline per feature row, then the *anyres_max* cap: with
  ``ratio = sqrt(h * w / (max_patches * 27**2))`` above 1.1 the grid is scaled down to
  ``int(h // ratio) x int(w // ratio)`` (``max_patches`` = 9 from ``vision_aspect_ratio``
  ``anyres_max_9``).  Ported with the same float operations in :func:`onevision_features`.

Multi-image requests: transformers tiles an image only when it is alone in its batch entry
(``batch_num_images == 1``); a nested ``[[a, b]]`` batch pads each image to a square instead
(``pad_to_square``, ``num_image_tokens + 1`` tokens).  vLLM 0.33 calls the processor with a flat
image list (``BaseMultiModalProcessor._call_hf_processor``), so every image is tiled; mmgate does
what vLLM does and ``processor(text=prompt, images=[a, b])`` (flat) does.  docs/parity.md.

Wire layout: vLLM 0.33 ``vllm/model_executor/models/llava_onevision.py``
``LlavaOnevisionMultiModalProcessor._get_mm_fields_config``: ``pixel_values`` and ``image_sizes``
``MultiModalFieldConfig.batched("image")``, ``pixel_values_videos`` ``batched("video")``, none
``keep_on_cpu``.  Prompt updates: images through ``BaseLlavaMultiModalProcessor._get_prompt_updates``
(``vllm/.../llava.py``), ``[image_token_index] * get_num_image_tokens``, the whole run embedded;
``LlavaOnevisionProcessingInfo._get_num_unpadded_features`` is the processor's formula.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import ImageVideoFamily
from mmgate.models.llava import DEFAULT_IMAGE_LIMIT, ClipParams, ImageTokens, clip_params, image_limit
from mmgate.models.llava_next import AnyresImages, select_best_resolution, unpadded_features
from mmgate.models.llava_onevision_video import OnevisionVideo, onevision_tokens, onevision_video_from_bundle
from mmgate.types import Modality

__all__ = ["LlavaOnevisionFamily", "OnevisionImages", "onevision_features"]

# transformers 5.24 LlavaOnevisionImageProcessor.image_grid_pinpoints: 384 * (1..6) squared grid
_DEFAULT_PINPOINTS = tuple((384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7))


def onevision_features(height: int, width: int, patches: int, scale_h: int, scale_w: int,
                       max_patches: int) -> tuple[int, int]:
    """(unpadded features, newline features) of an anyres-max tile grid.

    Port of transformers 5.24 ``LlavaOnevisionProcessor._get_unpadded_features`` (= vLLM 0.33
    ``LlavaOnevisionProcessingInfo._get_num_unpadded_features``): LLaVA-NeXT's unpadding
    (:func:`mmgate.models.llava_next.unpadded_features`), then the cap at ``max_patches`` tiles.
    Example: 1000x2000 (h x w), 27-patch tiles, pinpoint 1152x2304 (3x6): unpadded 81x162, ratio
    ``sqrt(81 * 162 / (9 * 729)) = 1.414 > 1.1`` -> ``int(81 // 1.414) * int(162 // 1.414)`` =
    ``57 * 114``, 57 newlines.
    """
    unpadded, current_h = unpadded_features(height, width, patches, patches, scale_h, scale_w)
    current_w = unpadded // current_h
    newlines = current_h
    ratio = math.sqrt(current_h * current_w / (max_patches * patches**2))
    if ratio > 1.1:
        unpadded = int(current_h // ratio) * int(current_w // ratio)
        newlines = int(current_h // ratio)
    return unpadded, newlines


class OnevisionImages(AnyresImages):
    """LLaVA-OneVision images: LLaVA-NeXT's tiles (384), OneVision's token count (module docstring).

    ``base_tokens``: the processor's ``num_image_tokens`` (729); ``max_patches``: from
    ``vision_aspect_ratio`` (``anyres_max_9`` -> 9).
    """

    def __init__(self, model_type: str, params: ClipParams, tile: int, pinpoints: tuple[tuple[int, int], ...],
                 tokens: ImageTokens, backend: ImageBackend, base_tokens: int, max_patches: int) -> None:
        super().__init__(model_type, params, tile, pinpoints, tokens, backend)
        self.base_tokens = base_tokens
        self.grid = int(math.sqrt(base_tokens))  # patches per tile side (27): int(math.sqrt(num_image_tokens))
        self.max_patches = max_patches

    @property
    def fingerprint(self) -> str:
        """The model and every preprocessing setting that shapes this processor's output (cache and hash key)."""
        return f"llava_onevision:{super().fingerprint}:{self.base_tokens}:{self.max_patches}"

    def num_tokens(self, height: int, width: int) -> int:
        """``LlavaOnevisionProcessor._get_number_of_features(height, width, tile, tile)``, less one
        for ``"default"`` (``replace_image_token``).  Example: 480x640 -> pinpoint 768x768 (2x2),
        unpadded 40x54 + 40 newlines + 729 = 2929."""
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        unpadded, newlines = onevision_features(height, width, self.grid, best_h // self.tile,
                                                best_w // self.tile, self.max_patches)
        n = unpadded + newlines + self.base_tokens
        return n - 1 if self.tokens.strategy == "default" else n


def max_patches_of(aspect: str, bundle_name: str) -> int:
    """``int(vision_aspect_ratio.strip("anyres_max_"))`` as the processor reads it.

    Raises:
        GatewayError(INTERNAL_ERROR): not of the ``anyres_max_<n>`` form.
    """
    digits = aspect.strip("anyres_max_")
    if not aspect.startswith("anyres_max_") or not digits.isdigit():
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle_name!r}: vision_aspect_ratio {aspect!r} is "
                           "not supported (anyres_max_<n> only)")
    return int(digits)


class LlavaOnevisionFamily(ImageVideoFamily[OnevisionImages, OnevisionVideo]):
    """LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``, SigLIP + Qwen2): images and videos.

    ``video`` is None (and ``limits`` has no video entry) when PyAV is missing.  One video per
    request is mmgate's own limit: vLLM 0.33 sets none (``get_supported_mm_limits`` -> ``None``) and
    runs its processor clip by clip (``LlavaOnevisionMultiModalProcessor._call_hf_processor``, because
    the transformers processor cannot batch clips of different lengths); one 32-frame clip is already
    6273 tokens, so the limit bounds decode work and context before any fetch.
    """

    model_types = ("llava_onevision",)
    limits: Mapping[Modality, int] = {Modality.IMAGE: DEFAULT_IMAGE_LIMIT, Modality.VIDEO: 1}

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> LlavaOnevisionFamily:
        """Read every parameter from the bundle; ``backend`` ``auto`` is resolved here.

        Raises:
            GatewayError(INTERNAL_ERROR): another image processor; a ``size`` that is not one square
                tile; a pinpoint not a multiple of the tile; ``num_image_tokens`` not a square; a
                ``vision_aspect_ratio`` other than ``anyres_max_<n>``; token ids that disagree
                with ``config.json``.
        """
        cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
        kind = str(cfg.get("image_processor_type", "LlavaOnevisionImageProcessor")).removesuffix("Fast")
        if kind.removesuffix("Pil") != "LlavaOnevisionImageProcessor":
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: image processor {kind} is not "
                               "supported for llava_onevision")
        size = cfg.get("size") or {"height": 384, "width": 384}
        if cfg.get("crop_size") or cfg.get("do_center_crop"):
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: crop_size is not supported")
        params = clip_params({**cfg, "size": size, "crop_size": size, "do_center_crop": False}, bundle.name)
        if params.size_hw is None or params.size_hw[0] != params.size_hw[1]:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: size {size} is not a square tile")
        tile = params.size_hw[0]  # _preprocess: patch_size = size.height (crop_size None)
        pinpoints = tuple((int(h), int(w)) for h, w in (cfg.get("image_grid_pinpoints") or _DEFAULT_PINPOINTS))
        if not pinpoints or any(h % tile or w % tile for h, w in pinpoints):
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: pinpoints {pinpoints} are not "
                               f"multiples of the {tile} tile")
        pc = bundle.processor_config
        base = int(pc.get("num_image_tokens") or 0)
        if base <= 0 or math.isqrt(base) ** 2 != base:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: num_image_tokens {base} is not a "
                               "square")
        aspect = str(pc.get("vision_aspect_ratio") or bundle.config.get("vision_aspect_ratio") or "anyres_max_9")
        strategy = str(pc.get("vision_feature_select_strategy")
                       or bundle.config.get("vision_feature_select_strategy") or "full")
        token, token_id = onevision_tokens(bundle, tokenizer, "image_token", "<image>", "image_token_index")
        patch = int((bundle.config.get("vision_config") or {}).get("patch_size") or 14)
        tokens = ImageTokens(token=token, token_id=token_id, patch_size=patch, additional=0, strategy=strategy)
        images = OnevisionImages(bundle.model_type, params, tile, pinpoints, tokens, geometry.resolve_backend(backend),
                                 base, max_patches_of(aspect, bundle.name))
        video = onevision_video_from_bundle(bundle, tokenizer, base, video_backend, video_sampling)
        reserved = (token, video.token if video is not None else str(pc.get("video_token") or "<video>"))
        return cls(images, video, image_limit(bundle, base), 1, reserved)


FAMILY = LlavaOnevisionFamily
