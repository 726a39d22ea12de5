"""Shrink a model config to a CPU-sized model that keeps the wire contract.

Stage: engine start-up, for bundles without weights.  In: the bundle's
``PretrainedConfig`` (as ``AutoConfig.from_pretrained`` reads it) and its
family's :class:`~mmgate.refengine.families.ShrinkSpec` (data: which fields
take which small value, which rules below run, which fields must not change);
out: a deep copy with few, narrow layers.

Invariants (what a gateway can observe must not change), listed per family in
``ShrinkSpec.keep`` and checked after shrinking: every token id (``vocab_size``,
image / video / boi / eoi / vision-start ids, eos/bos/pad) and the vision
geometry (patch size, image size, merge size, grid pinpoints,
``mm_tokens_per_image``, ...) and the audio feature geometry (mel bins, the
``n_window`` chunking, the tower's position table).  So the pixel tensors, grids
and log-mel features the full model takes are accepted and yield the same number
of image and audio tokens.  Audio towers (``audio_config``) shrink by the row's
``audio`` sizes as vision towers do by ``vision``.

What changes besides size: ``dtype`` is float32 everywhere (a bundle's
``bfloat16`` would otherwise make transformers build some modules in bf16), and
``initializer_range`` is widened to 0.2 (every config that has one): at the
reference 0.02 a two-layer random model ignores its input and repeats the last
prompt token, which would hide position and pixel mistakes from any output
comparison.  Parameters the transformers init sets to zero that would cut the
image out of the output (Gemma 3's projector) are re-drawn
(:func:`redraw_parameters`), and a family's ``overrides`` are set last (Gemma 3:
the LM head is not tied to the embeddings).

The rules (:data:`RULES`), each rescaling a field that indexes into what shrank;
each is a no-op where its field is absent:
  * ``layer_types``: the first ``num_hidden_layers`` entries, then the last ones
    replaced by any attention kind they lost, in first-seen order, so every kind
    stays exercised: Gemma 3's five sliding + one full -> ``[sliding, full]``;
    Qwen's all-full list is just cut;
  * ``sliding_window_pattern``: Gemma 3's period follows the new ``layer_types``
    (first full layer's index + 1, so 2); ``sliding_window`` itself is kept;
  * ``max_window_layers``: at most the new depth;
  * ``mrope_section``: M-RoPE sections must sum to ``head_dim / 2``
    (transformers ``modeling_qwen2_vl.apply_multimodal_rotary_pos_emb``),
    rescaled proportionally (largest remainder): Qwen2-VL ``[16, 24, 24]``
    (head_dim 128) -> ``[2, 3, 3]`` (head_dim 16);
  * ``query_pre_attn_scalar``: Gemma's attention scale follows ``head_dim`` in
    proportion (256 for head_dim 256 -> 16 for 16);
  * ``fullatt_block_indexes``: Qwen2.5-VL -> the last block only (the rest stay
    windowed, as in the reference where every eighth block is full);
  * ``deepstack_visual_indexes``: Qwen3-VL -> the first blocks, at most as many
    as there are text layers to receive them;
  * ``vision_feature_layer``: LLaVA's index into the tower's hidden states stays
    valid: a negative index is kept while the tower has that many layers (-2
    stays -2), else it names the first layer; a positive one is rescaled in
    proportion (0, the embeddings, stays 0);
  * ``no_rope_layers``: Llama 4's per-layer RoPE flags follow the new ``layer_types``
    (1 on ``chunked_attention``, 0 on ``full_attention``);
  * ``moe_layers``: Llama 4's MoE layer indices below the new depth (at least the last).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PretrainedConfig

from mmgate.refengine.families import (
    ENGINE_FAMILIES,
    INITIALIZER_RANGE,
    ShrinkSpec,
    engine_family,
)


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


def rescale_feature_layer(index: int, old_depth: int, new_depth: int) -> int:
    """A ``vision_feature_layer`` index for a tower cut from ``old_depth`` to ``new_depth`` layers.

    ``hidden_states`` has ``depth + 1`` entries (the embeddings first).  Examples:
    ``rescale_feature_layer(-2, 24, 2) == -2``; ``(-5, 24, 2) == -2``; ``(12, 24, 2) == 1``.
    """
    if index < 0:
        return index if -index <= new_depth else -new_depth
    if index == 0:
        return 0
    return max(1, min(new_depth, round(index * new_depth / old_depth)))


# ---- config access ------------------------------------------------------------------------


def _vision(cfg: PretrainedConfig) -> PretrainedConfig | None:
    vision = getattr(cfg, "vision_config", None)
    return vision if isinstance(vision, PretrainedConfig) else None


def _audio(cfg: PretrainedConfig) -> PretrainedConfig | None:
    audio = getattr(cfg, "audio_config", None)
    return audio if isinstance(audio, PretrainedConfig) else None


def _part(cfg: PretrainedConfig, name: str) -> PretrainedConfig | None:
    if name == "text":
        return cfg.get_text_config()
    if name == "vision":
        return _vision(cfg)
    if name == "audio":
        return _audio(cfg)
    return cfg


def _read(cfg: PretrainedConfig, path: str) -> Any:
    part, _, name = path.rpartition(".")
    obj = _part(cfg, part)
    return None if obj is None else getattr(obj, name, None)


def _depth(vision: PretrainedConfig) -> int:
    return int(getattr(vision, "depth", None) or vision.num_hidden_layers)


def _head_dim(text: PretrainedConfig) -> int:
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def _set_sizes(cfg: PretrainedConfig, sizes: Mapping[str, int]) -> None:
    for name, value in sizes.items():
        if getattr(cfg, name, None) is not None:
            setattr(cfg, name, value)


# ---- the rules: (shrunken config, original config) -> None, in place -------------------------


def _layer_types(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    text = shrunk.get_text_config()
    types = getattr(text, "layer_types", None)
    if not types:
        return
    n = int(text.num_hidden_layers)
    head = list(types[:n])
    lost = [kind for kind in dict.fromkeys(types) if kind not in head]
    if len(lost) > n:
        raise ValueError(f"{len(set(types))} attention kinds do not fit in {n} layers")
    text.layer_types = head[: n - len(lost)] + lost


def _sliding_window_pattern(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    text = shrunk.get_text_config()
    types = list(getattr(text, "layer_types", None) or ())
    if "full_attention" not in types:
        return
    for name in ("_sliding_window_pattern", "sliding_window_pattern"):
        if getattr(text, name, None) is not None:
            setattr(text, name, types.index("full_attention") + 1)


def _max_window_layers(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    text = shrunk.get_text_config()
    if getattr(text, "max_window_layers", None) is not None:
        text.max_window_layers = min(text.max_window_layers, text.num_hidden_layers)


def _mrope_section(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    """``rope_parameters`` (transformers 5; ``rope_scaling`` is its alias)."""
    text = shrunk.get_text_config()
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("mrope_section"):
        rope = dict(rope)
        rope["mrope_section"] = rescale_sections(list(rope["mrope_section"]), _head_dim(text) // 2)
        text.rope_parameters = rope


def _query_pre_attn_scalar(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    text, before = shrunk.get_text_config(), original.get_text_config()
    scalar = getattr(before, "query_pre_attn_scalar", None)
    if scalar is None:
        return
    new, old = _head_dim(text), _head_dim(before)
    text.query_pre_attn_scalar = scalar * new // old if (scalar * new) % old == 0 else scalar * new / old


def _fullatt_block_indexes(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    vision = _vision(shrunk)
    if vision is not None and getattr(vision, "fullatt_block_indexes", None):
        vision.fullatt_block_indexes = [_depth(vision) - 1]


def _deepstack_visual_indexes(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    vision = _vision(shrunk)
    deepstack = getattr(vision, "deepstack_visual_indexes", None) if vision is not None else None
    if vision is not None and deepstack:
        layers = shrunk.get_text_config().num_hidden_layers
        vision.deepstack_visual_indexes = list(range(min(len(deepstack), _depth(vision), layers)))


def _vision_feature_layer(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    value = getattr(shrunk, "vision_feature_layer", None)
    vision, before = _vision(shrunk), _vision(original)
    if value is None or vision is None or before is None:
        return
    old, new = _depth(before), _depth(vision)
    if isinstance(value, int):
        shrunk.vision_feature_layer = rescale_feature_layer(value, old, new)
    else:
        shrunk.vision_feature_layer = [rescale_feature_layer(int(v), old, new) for v in value]


def _no_rope_layers(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    """Llama 4: ``no_rope_layers[i]`` (1: the layer uses RoPE and chunked attention) follows the
    shrunken ``layer_types`` as ``Llama4TextConfig.__post_init__`` derives one from the other."""
    text = shrunk.get_text_config()
    flags = getattr(text, "no_rope_layers", None)
    if not flags:
        return
    types = list(getattr(text, "layer_types", None) or ())
    if types and getattr(text, "attention_chunk_size", None) is not None:
        text.no_rope_layers = [int(t == "chunked_attention") for t in types]
    else:
        text.no_rope_layers = list(flags[:text.num_hidden_layers])


def _moe_layers(shrunk: PretrainedConfig, original: PretrainedConfig) -> None:
    """Llama 4: the MoE layer indices that still exist (at least the last layer, so the experts
    stay exercised)."""
    text = shrunk.get_text_config()
    layers = getattr(text, "moe_layers", None)
    if layers is None:
        return
    n = int(text.num_hidden_layers)
    text.moe_layers = [i for i in layers if i < n] or [n - 1]


#: rule name -> rule; ``ShrinkSpec.rules`` names them
RULES: dict[str, Callable[[PretrainedConfig, PretrainedConfig], None]] = {
    "layer_types": _layer_types,
    "sliding_window_pattern": _sliding_window_pattern,
    "max_window_layers": _max_window_layers,
    "mrope_section": _mrope_section,
    "query_pre_attn_scalar": _query_pre_attn_scalar,
    "fullatt_block_indexes": _fullatt_block_indexes,
    "deepstack_visual_indexes": _deepstack_visual_indexes,
    "vision_feature_layer": _vision_feature_layer,
    "no_rope_layers": _no_rope_layers,
    "moe_layers": _moe_layers,
}


# ---- entry points ---------------------------------------------------------------------------


def shrink_spec(config: PretrainedConfig) -> ShrinkSpec:
    """The family's :class:`ShrinkSpec` for ``config.model_type``.

    Raises:
        ValueError: a media model (vision config or nested sub-configs) whose ``model_type``
            the engine's family table does not name: no rule says how its towers shrink.
    """
    model_type = str(config.model_type)
    media = (_vision(config) is not None or _audio(config) is not None
             or getattr(config, "thinker_config", None) is not None or config.get_text_config() is not config)
    if media and model_type not in ENGINE_FAMILIES:
        raise ValueError(f"the reference engine has no shrink rules for model_type {model_type!r} "
                         f"(known: {', '.join(ENGINE_FAMILIES)}); give the bundle weights")
    return engine_family(model_type).shrink


def shrink_config(config: PretrainedConfig, spec: ShrinkSpec | None = None) -> PretrainedConfig:
    """A shrunken deep copy of ``config`` (see the module docstring for what is kept).

    Args:
        config: the config the model is built from (the bundle's, or its ``thinker_config`` where the
            family names one): multimodal (``vision_config`` / ``audio_config``) or text-only.
        spec: the rules; default: the family table's row for ``config.model_type`` (:func:`shrink_spec`).

    Returns:
        A new config; ``config`` is not modified.

    Raises:
        ValueError: no rules for this media model (:func:`shrink_spec`), or a rule cannot apply.
        RuntimeError: a field the spec keeps came out changed (a table error).
    """
    spec = spec if spec is not None else shrink_spec(config)
    shrunk = copy.deepcopy(config)
    text, vision, audio = shrunk.get_text_config(), _vision(shrunk), _audio(shrunk)
    _set_sizes(text, spec.text)
    if vision is not None:
        _set_sizes(vision, spec.vision)
    if audio is not None:
        _set_sizes(audio, spec.audio)
    for name in spec.rules:
        RULES[name](shrunk, config)
    for path, value in spec.overrides.items():
        part, _, name = path.rpartition(".")
        setattr(_part(shrunk, part), name, value)
    for cfg in (shrunk, text, vision, audio):
        if cfg is not None:
            cfg.dtype = torch.float32
            if getattr(cfg, "initializer_range", None) is not None:
                cfg.initializer_range = INITIALIZER_RANGE
    changed = [p for p in spec.keep if _read(shrunk, p) != _read(config, p)]
    if changed:
        raise RuntimeError(f"shrinking {config.model_type!r} changed kept fields {changed}")
    return shrunk


def redraw_parameters(model: torch.nn.Module, names: tuple[str, ...], seed: int) -> None:
    """Fill the named parameters from N(0, INITIALIZER_RANGE) with a generator seeded by ``seed``.

    Raises:
        KeyError: a name the model does not have (a table error).
    """
    if not names:
        return
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in names:
            params[name].normal_(0.0, INITIALIZER_RANGE, generator=generator)
