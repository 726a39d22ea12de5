"""Shrink a model config to a CPU-sized model that keeps the wire contract.

Stage: engine start-up, for bundles without weights.  In: the bundle's
``PretrainedConfig`` (as ``AutoConfig.from_pretrained`` reads it); out: a deep
copy with few, narrow layers.

Invariants (what a gateway can observe must not change):
  * every token id: ``vocab_size``, ``image_token_id``, ``video_token_id``,
    ``vision_start_token_id`` / ``vision_end_token_id``, eos/bos/pad ids;
  * the vision patch geometry: ``patch_size``, ``temporal_patch_size``,
    ``spatial_merge_size``, ``in_channels``, ``window_size``,
    ``num_position_embeddings``, ``tokens_per_second``.  So the same pixel
    tensor ``[num_patches, C*T*P*P]`` and ``image_grid_thw`` that the full model
    takes are accepted, and yield the same number of merged image tokens.

What changes besides size: ``dtype`` is float32 everywhere (a bundle's
``bfloat16`` would otherwise make transformers build some modules in bf16), and
``initializer_range`` is widened to 0.2 (both towers): at the reference 0.02 a
two-layer random model ignores its input and repeats the last prompt token,
which would hide position and pixel mistakes from any output comparison.

What shrinks: depth, widths and head counts, plus the fields that index into
them, which are rescaled so they stay valid:
  * M-RoPE ``mrope_section`` must sum to ``head_dim / 2``
    (transformers ``modeling_qwen2_vl.apply_multimodal_rotary_pos_emb``) and is
    rescaled proportionally (largest remainder), e.g. Qwen2-VL ``[16, 24, 24]``
    (head_dim 128) -> ``[2, 3, 3]`` (head_dim 16);
  * Qwen2.5-VL ``fullatt_block_indexes`` -> the last block only (the rest stay
    windowed, as in the reference where every eighth block is full);
  * Qwen3-VL ``deepstack_visual_indexes`` -> the first blocks, at most as many
    as there are text layers to receive them.
"""

from __future__ import annotations

import copy
from typing import Any, Final

import torch
from transformers import PretrainedConfig

#: text decoder size after shrinking (head_dim = hidden / heads = 16)
TEXT_LAYERS: Final = 2
TEXT_HIDDEN: Final = 64
TEXT_HEADS: Final = 4
TEXT_KV_HEADS: Final = 2
TEXT_INTERMEDIATE: Final = 128

#: vision tower size after shrinking (head_dim = 32 / 2 = 16)
VISION_DEPTH: Final = 2
VISION_HIDDEN: Final = 32
VISION_HEADS: Final = 2
VISION_INTERMEDIATE: Final = 64

#: init std for the random weights (reference checkpoints use 0.02)
INITIALIZER_RANGE: Final = 0.2


def rescale_sections(sections: list[int], total: int) -> list[int]:
    """Rescale integer ``sections`` proportionally so they sum to ``total``.

    Largest-remainder rounding; ties go to the earlier section.
    Example: ``rescale_sections([24, 20, 20], 8) == [3, 3, 2]``.

    Raises:
        ValueError: empty sections, a non-positive sum, or ``total < len(sections)``
            would leave a section empty.
    """
    current = sum(sections)
    if not sections or current <= 0:
        raise ValueError(f"cannot rescale sections {sections!r}")
    raw = [s * total / current for s in sections]
    out = [int(r) for r in raw]
    by_remainder = sorted(range(len(sections)), key=lambda i: raw[i] - out[i], reverse=True)
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    if min(out) < 1:
        raise ValueError(f"sections {sections!r} cannot be rescaled to {total} without an empty section")
    return out


def _set_if_present(cfg: PretrainedConfig, name: str, value: Any) -> None:
    if getattr(cfg, name, None) is not None:
        setattr(cfg, name, value)


def _shrink_rope(cfg: PretrainedConfig, head_dim: int) -> None:
    """Rescale ``mrope_section`` in ``rope_parameters`` (transformers 5; ``rope_scaling`` is its alias)."""
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("mrope_section"):
        rope = dict(rope)
        rope["mrope_section"] = rescale_sections(list(rope["mrope_section"]), head_dim // 2)
        cfg.rope_parameters = rope


def _shrink_text(text: PretrainedConfig) -> None:
    text.num_hidden_layers = TEXT_LAYERS
    text.hidden_size = TEXT_HIDDEN
    text.num_attention_heads = TEXT_HEADS
    _set_if_present(text, "num_key_value_heads", TEXT_KV_HEADS)
    _set_if_present(text, "intermediate_size", TEXT_INTERMEDIATE)
    head_dim = TEXT_HIDDEN // TEXT_HEADS
    _set_if_present(text, "head_dim", head_dim)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        text.layer_types = list(layer_types[:TEXT_LAYERS])
    if getattr(text, "max_window_layers", None) is not None:
        text.max_window_layers = min(text.max_window_layers, TEXT_LAYERS)
    _shrink_rope(text, head_dim)


def _shrink_vision(vision: PretrainedConfig, text_hidden: int, text_layers: int) -> None:
    if hasattr(vision, "depth"):
        vision.depth = VISION_DEPTH
    else:
        vision.num_hidden_layers = VISION_DEPTH
    if hasattr(vision, "num_heads"):
        vision.num_heads = VISION_HEADS
    else:
        vision.num_attention_heads = VISION_HEADS
    if hasattr(vision, "out_hidden_size"):  # Qwen2.5-VL, Qwen3-VL: hidden = tower width
        vision.hidden_size = VISION_HIDDEN
        vision.out_hidden_size = text_hidden
    elif hasattr(vision, "embed_dim"):  # Qwen2-VL: embed_dim = tower width, hidden = merger output
        vision.embed_dim = VISION_HIDDEN
        vision.hidden_size = text_hidden
    else:
        vision.hidden_size = VISION_HIDDEN
    _set_if_present(vision, "intermediate_size", VISION_INTERMEDIATE)
    if getattr(vision, "fullatt_block_indexes", None):
        vision.fullatt_block_indexes = [VISION_DEPTH - 1]
    deepstack = getattr(vision, "deepstack_visual_indexes", None)
    if deepstack:
        vision.deepstack_visual_indexes = list(range(min(len(deepstack), VISION_DEPTH, text_layers)))


def shrink_config(config: PretrainedConfig) -> PretrainedConfig:
    """A shrunken deep copy of ``config`` (see the module docstring for what is kept).

    Args:
        config: the bundle's config, multimodal (with ``vision_config``) or text-only.

    Returns:
        A new config; ``config`` is not modified.
    """
    shrunk = copy.deepcopy(config)
    text = shrunk.get_text_config()
    _shrink_text(text)
    vision = getattr(shrunk, "vision_config", None)
    if vision is not None:
        _shrink_vision(vision, text.hidden_size, text.num_hidden_layers)
    for cfg in (shrunk, text, vision):
        if cfg is not None:
            cfg.dtype = torch.float32
            _set_if_present(cfg, "initializer_range", INITIALIZER_RANGE)
    return shrunk
