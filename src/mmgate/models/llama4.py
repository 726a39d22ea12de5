"""The Llama 4 family (``model_type`` ``llama4``): 336-px tiles on a best-fit canvas plus a global tile.

Stage: plan / preprocess / expand for images (no video).  In: a decoded RGB image; out: the
item's share of ``pixel_values`` (float32 ``[tiles, 3, 336, 336]``: the canvas tiles row by row,
then, when there is more than one, the global tile), ``patches_per_image`` (int64 ``[]``, the
share's tile count) and ``aspect_ratios`` (int64 ``[2]``, the canvas in tiles ``(rows, cols)``),
and the token run replacing the item's ``<|image|>`` anchor.

Reference (transformers 5.24), one backend: ``models/llama4/image_processing_llama4.py``
``Llama4ImageProcessor`` is a ``TorchvisionBackend`` and there is no ``*Pil`` class, so mmgate is
exact to it whatever ``--image-backend`` says (``pil`` included; docs/parity.md, "Llama 4"):
* ``find_supported_resolutions(max_patches, size)``: every ``(h, w)`` tile grid of at most
  ``max_patches`` tiles, in the reference's order (:func:`supported_resolutions`);
* ``get_best_fit``: the canvas needing the least upscaling, else the least downscaling; ties to
  the smallest area (scales in float32 as torch computes them: :func:`best_fit`);
* the image is resized without distortion to fit ``min(max(side, 336), canvas side)``
  (``get_max_res_without_distortion``, floor), torch's antialiased bilinear uint8 kernel
  (:mod:`mmgate.media.tv_resize`), zero-padded right / bottom to the canvas (``pad_to_best_fit``);
* ``rescale_and_normalize`` in **bfloat16**: ``x.to(bfloat16) * rescale_factor`` then
  ``tvF.normalize`` (``(x - mean) / std``, each step rounded to bfloat16).  A uint8 byte maps to one
  value, so the step is a ``[C, 256]`` table computed with the same roundings
  (:func:`bf16_normalize_lut`); the values are sent as float32 (exactly the bfloat16 values);
* ``split_to_tiles`` row by row; with more than one tile the global tile (the original image
  resized to 336x336, normalized the same way) is appended last.

Tokens: ``models/llama4/processing_llama4.py`` ``Llama4Processor._prompt_split_image``:
``<|image_start|>``, then for a canvas of more than one tile, per tile row, each tile's 144
``<|patch|>`` (``(336 // 14)**2 // 4``: pixel shuffle 0.5) with ``<|tile_x_separator|>`` between
tiles and ``<|tile_y_separator|>`` after the row; then ``<|image|>``, the global tile's 144
``<|patch|>`` and ``<|image_end|>``.  All are added special tokens, so the text-level replacement
the processor does tokenizes to the same ids as this token-level one.

Wire layout: vLLM ``vllm/model_executor/models/mllama4.py`` (0.33 line)
``Mllama4MultiModalProcessor._call_hf_processor`` adds ``aspect_ratios`` and
``patches_per_image`` (``1 if r_h * r_w == 1 else 1 + r_h * r_w``); ``_get_mm_fields_config``:
``pixel_values`` ``flat_from_sizes("image", patches_per_image)``, ``patches_per_image`` and
``aspect_ratios`` ``batched("image")``, none kept on CPU.  ``_get_prompt_updates`` replaces the
``<|image|>`` target with the whole ``_prompt_split_image`` run and
``PromptUpdateDetails.select_text(repl, "<|patch|>")``: the placeholder range is the whole run and
``is_embed`` marks the ``<|patch|>`` positions (``im_token_id`` = ``<|patch|>`` = config
``image_token_index``), so :meth:`Llama4Images.expand` returns the run with ``embed_length`` its
length while ``ItemPlan.num_tokens`` counts the ``<|patch|>`` tokens only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import ImageOnlyFamily
from mmgate.models.llava import DEFAULT_IMAGE_LIMIT, check_no_hints
from mmgate.types import DecodedImage, ItemHints, ItemPlan, Modality, Replacement, TensorLayout, TensorSpec

__all__ = ["FAMILY", "Llama4Family", "Llama4ImageParams", "Llama4Images", "Llama4Tokens", "best_fit",
           "bf16_normalize_lut", "bf16_round", "canvas_plan", "max_res_without_distortion",
           "supported_resolutions"]

#: transformers 5.24 ``Llama4Processor.__init__`` defaults (``processor_config.json`` may override)
_TOKEN_DEFAULTS = {"image_token": "<|image|>", "start_of_image_token": "<|image_start|>",
                   "end_of_image_token": "<|image_end|>", "patch_token": "<|patch|>",
                   "tile_x_separator_token": "<|tile_x_separator|>", "tile_y_separator_token": "<|tile_y_separator|>"}


@lru_cache(maxsize=8)
def supported_resolutions(max_num_chunks: int, tile: int) -> tuple[tuple[int, int], ...]:
    """Every canvas ``(height, width)`` in pixels of at most ``max_num_chunks`` tiles, in the reference's order.

    Port of transformers 5.24 ``find_supported_resolutions``: for ``chunks`` from the maximum down
    to 1, its factor pairs ``(f, chunks // f)`` in ascending ``f``, grouped by ``f / (chunks // f)``
    in first-seen order.  Example: 4 chunks of 224 -> ``(224, 896), (448, 448), (224, 224), (896,
    224), (224, 672), (672, 224), (224, 448), (448, 224)``.
    """
    groups: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for chunks in range(max_num_chunks, 0, -1):
        factors = sorted({f for i in range(1, int(chunks**0.5) + 1) if chunks % i == 0 for f in (i, chunks // i)})
        for f in factors:
            groups[f / (chunks // f)].append((f, chunks // f))
    return tuple((h * tile, w * tile) for pairs in groups.values() for h, w in pairs)


def best_fit(height: int, width: int, resolutions: tuple[tuple[int, int], ...],
             resize_to_max_canvas: bool = False) -> tuple[int, int]:
    """The canvas ``(height, width)`` an image of ``height x width`` goes on.

    Port of transformers 5.24 ``get_best_fit`` (torch computes ``target / original`` on an int64
    tensor in float32, so the scales here are float32 too): the limiting scale per canvas; the
    smallest one >= 1 (the largest with ``resize_to_max_canvas``), else the largest one < 1; among
    canvases with exactly that scale the first of the smallest area.  Example: 200x300 among
    ``224x672, 672x224, 224x448, 448x224, 224x224`` -> ``(224, 448)``.
    """
    res = np.asarray(resolutions, dtype=np.int64)
    scale_w = res[:, 1].astype(np.float32) / np.float32(width)
    scale_h = res[:, 0].astype(np.float32) / np.float32(height)
    scales = np.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up):
        selected = up.max() if resize_to_max_canvas else up.min()
    else:
        selected = scales[scales < 1].max()
    chosen = res[scales == selected]
    best = chosen[int(np.argmin(chosen[:, 0] * chosen[:, 1]))] if len(chosen) > 1 else chosen[0]
    return int(best[0]), int(best[1])


def max_res_without_distortion(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The largest ``(h, w)`` inside ``target`` keeping the aspect ratio (floor).

    Port of transformers 5.24 ``get_max_res_without_distortion``.  Examples: 200x300 into
    ``(450, 200)`` -> ``(133, 200)``; 800x600 into ``(450, 1300)`` -> ``(450, 337)``.
    """
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), th), tw
    return th, min(math.floor(width * scale_h), tw)


def bf16_round(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """float32 values rounded to the nearest bfloat16 (ties to even), as torch's ``to(bfloat16)``
    and every bfloat16 op's result; returned as float32 (NaN not handled: none arise here)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


@lru_cache(maxsize=16)
def bf16_normalize_lut(rescale_factor: float, mean: tuple[float, ...], std: tuple[float, ...],
                       do_rescale: bool, do_normalize: bool) -> npt.NDArray[np.float32]:
    """``[C, 256]`` float32: the bfloat16 value byte ``v`` of channel ``c`` becomes.

    transformers 5.24 ``Llama4ImageProcessor.rescale_and_normalize``: ``x.to(bfloat16) *
    rescale_factor`` (torch multiplies by the Python scalar in float32, then rounds to bfloat16),
    then ``tvF.normalize``: ``mean`` / ``std`` as bfloat16 tensors, ``(x - mean) / std``, each op
    rounded to bfloat16.  (Rescale or normalize switched off is refused by
    :meth:`Llama4Family.from_bundle`: the reference then computes in float32.)
    """
    x = np.arange(256, dtype=np.float32)
    if do_rescale:
        x = bf16_round(x * np.float32(rescale_factor))
    m = bf16_round(np.asarray(mean, dtype=np.float32))
    s = bf16_round(np.asarray(std, dtype=np.float32))
    table = np.empty((len(mean), 256), dtype=np.float32)
    for c in range(len(mean)):
        table[c] = bf16_round(bf16_round(x - m[c]) / s[c]) if do_normalize else x
    return table


@dataclass(frozen=True, slots=True)
class Llama4ImageParams:
    """``Llama4ImageProcessor`` settings as the reference resolves them from ``preprocessor_config.json``."""

    tile: int  # size["height"] = size["width"] (336)
    max_patches: int  # canvas tiles at most (16)
    resize_to_max_canvas: bool
    resample: int  # PILImageResampling (2: bilinear)
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    tokens_per_tile: int  # (tile // patch_size)**2 // downsample_ratio (144)


@dataclass(frozen=True, slots=True)
class Llama4Tokens:
    """The token ids of ``_prompt_split_image`` (``processor_config.json`` names, tokenizer ids)."""

    image: int  # <|image|>: the template's anchor and the global tile's marker
    start: int  # <|image_start|>
    end: int  # <|image_end|>
    patch: int  # <|patch|>: the embedding token (config image_token_index)
    tile_x: int  # <|tile_x_separator|>
    tile_y: int  # <|tile_y_separator|>
    strings: tuple[str, ...]  # the six token strings (reserved: caller text may not hold them)


def canvas_plan(height: int, width: int, p: Llama4ImageParams) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(canvas (h, w), resized (h, w))`` of an image: :func:`best_fit`, then
    ``_preprocess``'s ``max_upscaling_size`` bound and :func:`max_res_without_distortion` (each
    side at least 1)."""
    canvas = best_fit(height, width, supported_resolutions(p.max_patches, p.tile), p.resize_to_max_canvas)
    target = canvas if p.resize_to_max_canvas else (min(max(height, p.tile), canvas[0]),
                                                    min(max(width, p.tile), canvas[1]))
    rh, rw = max_res_without_distortion(height, width, target)
    return canvas, (max(rh, 1), max(rw, 1))


class Llama4Images:
    """Llama 4 images (module docstring).  ``ItemPlan.detail``: ``(rows, cols)`` of the canvas in tiles."""

    modality = Modality.IMAGE
    #: the reference normalizes in bfloat16 (a table here): a worker's float32 device normalize would differ,
    #: so Llama 4 always sends the normalized values
    device_normalizable = False
    specs = (TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="patches_per_image", primary=True),
             TensorSpec("patches_per_image", "int64", TensorLayout.BATCHED),
             TensorSpec("aspect_ratios", "int64", TensorLayout.BATCHED))

    def __init__(self, model_type: str, params: Llama4ImageParams, tokens: Llama4Tokens) -> None:
        self.model_type = model_type
        self.params = params
        self.tokens = tokens
        self._lut = bf16_normalize_lut(params.rescale_factor, params.image_mean, params.image_std, True, True)
        # one table for every channel (mean = std = 0.5 in the shipped bundle): one gather for the whole share
        self._one_table = bool((self._lut == self._lut[0]).all())

    @property
    def anchor_token_id(self) -> int:
        """The token the chat template leaves once per item (the processor protocol's ``anchor_token_id``)."""
        return self.tokens.image

    @property
    def placeholder_token_id(self) -> int:
        """The token that receives the encoder output (vLLM ``im_token_id``)."""
        return self.tokens.patch

    @property
    def fingerprint(self) -> str:
        """The model and every preprocessing setting that shapes this processor's output (cache and hash key)."""
        return f"llama4:{self.model_type}:torchvision:{self.params!r}:{self.tokens.strings!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Refuse every per-item hint and ``mm_processor_kwargs`` (:func:`mmgate.models.llava.check_no_hints`).

        Raises:
            GatewayError(INVALID_REQUEST): naming ``param``.
        """
        check_no_hints(hints, param, self.model_type)

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """Canvas, resize size and token count from the size alone.

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a zero-sized side.
        """
        if min(height, width) <= 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
        p = self.params
        (ch, cw), resized = canvas_plan(height, width, p)
        rows, cols = ch // p.tile, cw // p.tile
        tiles = rows * cols + (1 if rows * cols > 1 else 0)
        return ItemPlan(modality=Modality.IMAGE, original_hw=(height, width), resized_hw=resized,
                        num_tokens=tiles * p.tokens_per_tile,
                        shapes=(("pixel_values", (tiles, 3, p.tile, p.tile)), ("patches_per_image", ()),
                                ("aspect_ratios", (2,))),
                        detail=(rows, cols))

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """``patches_per_image`` (vLLM ``_call_hf_processor``) and ``aspect_ratios`` ``(rows, cols)``."""
        return {"patches_per_image": np.array(plan.primary_shape[0], dtype=np.int64),
                "aspect_ratios": np.array(plan.detail, dtype=np.int64)}

    def tiles_u8(self, image: DecodedImage, plan: ItemPlan) -> npt.NDArray[np.uint8]:
        """uint8 ``[tiles, tile, tile, 3]``: the zero-padded canvas cut row by row, then the global tile."""
        p, t = self.params, self.params.tile
        rows, cols = plan.detail
        pixels = image.pixels
        resized = pixels if plan.resized_hw == pixels.shape[:2] else geometry.resize_uint8(
            pixels, plan.resized_hw, p.resample, ImageBackend.TORCHVISION)
        out = np.zeros(plan.primary_shape[:1] + (t, t, 3), dtype=np.uint8)
        canvas = np.zeros((rows * t, cols * t, 3), dtype=np.uint8)
        canvas[:resized.shape[0], :resized.shape[1]] = resized
        out[:rows * cols] = canvas.reshape(rows, t, cols, t, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, t, t, 3)
        if rows * cols > 1:
            out[-1] = pixels if pixels.shape[:2] == (t, t) else geometry.resize_uint8(
                pixels, (t, t), p.resample, ImageBackend.TORCHVISION)
        return out

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """``[tiles, 3, tile, tile]`` float32, the reference's bfloat16 values (uint8 with ``raw``;
        padding is byte 0 there, as the reference pads before normalizing)."""
        chw = np.ascontiguousarray(np.moveaxis(self.tiles_u8(image, plan), -1, -3))
        if raw:
            return chw
        if self._one_table:
            return self._lut[0].take(chw)
        out = np.empty(chw.shape, dtype=np.float32)
        for c in range(chw.shape[1]):
            np.take(self._lut[c], chw[:, c], out=out[:, c], mode="clip")
        return out

    def token_run(self, rows: int, cols: int) -> tuple[int, ...]:
        """``Llama4Processor._prompt_split_image((rows, cols), tokens_per_tile)`` as ids."""
        tok, patches = self.tokens, (self.tokens.patch,) * self.params.tokens_per_tile
        run: list[int] = [tok.start]
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    run += patches
                    if x < cols - 1:
                        run.append(tok.tile_x)
                run.append(tok.tile_y)
        run += (tok.image, *patches, tok.end)
        return tuple(run)

    def expand(self, plan: ItemPlan) -> Replacement:
        """The whole ``_prompt_split_image`` run; the placeholder range is all of it and the engine
        embeds its ``<|patch|>`` positions only (vLLM ``select_text(repl, "<|patch|>")``)."""
        run = self.token_run(*plan.detail)
        return Replacement(token_ids=run, embed_offset=0, embed_length=len(run))


def _token(tokenizer: BundleTokenizer, text: str, bundle: ModelBundle) -> int:
    found = tokenizer.token_id(text)
    if found is None:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: the tokenizer has no {text!r}")
    return found


class Llama4Family(ImageOnlyFamily[Llama4Images]):
    """Llama 4 (``Llama4ForConditionalGeneration``): images only."""

    model_types = ("llama4",)
    limits: Mapping[Modality, int] = {Modality.IMAGE: DEFAULT_IMAGE_LIMIT}

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> Llama4Family:
        """Read every parameter from the bundle.  ``backend`` is not consulted: the reference has
        the torchvision backend only (module docstring).

        Raises:
            GatewayError(INTERNAL_ERROR): another image processor, a non-square ``size``, rescale or
                normalize switched off, or ``patch_token`` ids the tokenizer lacks; the config's
                ``image_token_index`` other than ``<|patch|>``.
        """
        cfg: dict[str, Any] = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
        kind = str(cfg.get("image_processor_type", "Llama4ImageProcessor")).removesuffix("Fast")
        size = cfg.get("size") or {"height": 336, "width": 336}
        if (kind != "Llama4ImageProcessor" or not isinstance(size, dict) or not isinstance(size.get("height"), int)
                or size.get("height") != size.get("width")
                or cfg.get("do_rescale", True) is False or cfg.get("do_normalize", True) is False
                or cfg.get("do_resize", True) is False or cfg.get("do_convert_rgb") is False):
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: unsupported Llama 4 image "
                               f"processor settings ({kind}, size {size})")
        proc_cfg = bundle.processor_config
        vision = bundle.config.get("vision_config") or {}
        patch_size = int(proc_cfg.get("patch_size", vision.get("patch_size", 14)))
        shuffle = float(proc_cfg.get("pixel_shuffle_ratio", vision.get("pixel_shuffle_ratio", 0.5)))
        tile = int(size["height"])
        params = Llama4ImageParams(
            tile=tile, max_patches=int(cfg.get("max_patches", 16)),
            resize_to_max_canvas=bool(cfg.get("resize_to_max_canvas", False)),
            resample=int(cfg.get("resample", geometry.RESAMPLE_BILINEAR)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(v) for v in cfg.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(v) for v in cfg.get("image_std", (0.5, 0.5, 0.5))),
            # Llama4Processor.replace_image_token: (h // patch) * (w // patch) // int(round(1 / ratio**2))
            tokens_per_tile=(tile // patch_size) * (tile // patch_size) // int(round(1.0 / shuffle**2)))
        names = {k: str(proc_cfg.get(k, v)) for k, v in _TOKEN_DEFAULTS.items()}
        strings = tuple(names.values())
        ids = {k: _token(tokenizer, v, bundle) for k, v in names.items()}
        tokens = Llama4Tokens(image=ids["image_token"], start=ids["start_of_image_token"],
                              end=ids["end_of_image_token"], patch=ids["patch_token"],
                              tile_x=ids["tile_x_separator_token"], tile_y=ids["tile_y_separator_token"],
                              strings=strings)
        configured = bundle.config.get("image_token_index")
        if configured is not None and int(configured) != tokens.patch:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: image_token_index {configured} is "
                               f"not {names['patch_token']} ({tokens.patch})")
        return cls(Llama4Images(bundle.model_type, params, tokens), DEFAULT_IMAGE_LIMIT, strings)


FAMILY = Llama4Family
