"""What the reference engine knows per model family: data, one table keyed by ``model_type``.

Stage: engine start-up (read once) and request intake.  In: a config's
``model_type``; out: an :class:`EngineFamily`, frozen, holding

  * ``shrink`` (:class:`ShrinkSpec`): how a weight-less bundle's config becomes a
    CPU-sized model: which fields take which small value, which named rescaling
    rules of :mod:`.shrink` run after that, which fields must come out unchanged
    (every token id and the vision geometry a gateway can observe), and which
    parameters the reference init leaves at zero and the engine re-draws;
  * ``token_types`` (:class:`TokenTypes`): the per-token modality tensor the
    model's forward takes, built from the placeholder ids as the model's own
    processor builds it (Qwen-VL ``mm_token_type_ids``, Gemma 3 ``token_type_ids``);
  * ``raw_layout`` (:class:`RawLayout`): where the channel axis of a raw uint8
    primary tensor is, for ``--mm-device-do-normalize``; None: the engine does
    not normalize this family's pixels on device (and does not advertise it);
  * ``model_class`` / ``sub_config``: the transformers class the engine runs and the
    sub-config it is built from, where the bundle's ``architectures`` name a larger
    model (Qwen2.5-Omni / Qwen3-Omni: the thinker of ``thinker_config``, not the
    talker and code2wav);
  * ``audio`` (:class:`AudioInputs`): how the forward takes log-mel features (the
    names and padding the model's processor hands it).

A ``model_type`` not in :data:`ENGINE_FAMILIES` gets :data:`GENERIC`: a text
model shrinks by :data:`TEXT_ONLY_SHRINK`, and a media model without a row is
refused when it has no weights (:func:`mmgate.refengine.shrink.shrink_config`).

The sizes (one table for every family): text decoder 2 layers x 64 wide, 4
heads of 16 (2 KV heads), MLP 128; vision tower 2 layers x 32 wide, 2 heads of
16, MLP 64.  A one-image request runs in well under a second on 2 cores even
at Gemma 3's 896x896 input (4096 patches) or a five-tile LLaVA-NeXT image.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

#: text decoder size after shrinking
TEXT_LAYERS: Final = 2
TEXT_HIDDEN: Final = 64
TEXT_HEADS: Final = 4
TEXT_KV_HEADS: Final = 2
TEXT_INTERMEDIATE: Final = 128
TEXT_HEAD_DIM: Final = TEXT_HIDDEN // TEXT_HEADS  # 16

#: vision tower size after shrinking (head_dim = 32 / 2 = 16)
VISION_DEPTH: Final = 2
VISION_HIDDEN: Final = 32
VISION_HEADS: Final = 2
VISION_INTERMEDIATE: Final = 64

#: audio tower size after shrinking (Whisper-style encoders: head_dim = 32 / 2 = 16)
AUDIO_LAYERS: Final = 2
AUDIO_HIDDEN: Final = 32
AUDIO_HEADS: Final = 2
AUDIO_FFN: Final = 64
AUDIO_DOWNSAMPLE: Final = 8  # Qwen3 audio towers' conv channels (480 in the bundles)

#: init std for the random weights (reference checkpoints use 0.02)
INITIALIZER_RANGE: Final = 0.2


def _frozen(values: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(values))


@dataclass(frozen=True, slots=True)
class ShrinkSpec:
    """How one family's config shrinks.

    ``text`` / ``vision``: field -> shrunken value, set only where the bundle's
    (text / vision) config has the field with a value (``head_dim`` of a config
    that derives it stays derived).  ``rules``: names of :data:`mmgate.refengine.shrink.RULES`,
    run in order after the sizes.  ``keep``: config paths that must come out
    unchanged (``text.`` = ``get_text_config()``, ``vision.`` = ``vision_config``,
    else the top level); :func:`~mmgate.refengine.shrink.shrink_config` checks them.
    ``redraw``: parameter names the transformers init fills with zeros, drawn
    from N(0, :data:`INITIALIZER_RANGE`) instead so the output depends on them.
    ``overrides``: config paths set to a value whatever the bundle says (structure
    a random model needs to answer with more than its last prompt token).
    """

    text: Mapping[str, int]
    vision: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    audio: Mapping[str, int] = field(default_factory=lambda: _frozen({}))  # ``audio_config`` fields (``audio.`` paths)
    rules: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    redraw: tuple[str, ...] = ()
    overrides: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))  # path -> value, set last


@dataclass(frozen=True, slots=True)
class TokenTypes:
    """A per-token modality tensor the forward takes: 0 text, ``image`` / ``video`` on placeholder ids."""

    kwarg: str  # forward keyword, e.g. "mm_token_type_ids"
    image: int | None = 1  # value on image placeholder tokens (config image_token_id)
    video: int | None = None  # value on video placeholder tokens (config video_token_id)


@dataclass(frozen=True, slots=True)
class AudioInputs:
    """How a model's forward takes log-mel features, as its processor hands them.

    The engine builds ``input_features`` ``[clips, num_mel_bins, frames]`` (each clip's valid
    frames, zero-padded to the longest) and a per-frame mask ``[clips, frames]`` (1 on valid
    frames, ``mask_dtype`` as the processor returns it: WhisperFeatureExtractor's int32).
    ``mask_kwarg``: the mask's forward keyword (Qwen2.5-Omni / Qwen3-Omni ``feature_attention_mask``,
    Qwen3-ASR ``input_features_mask``).  ``window_multiple``: the frame axis is padded to a
    multiple of ``2 * audio_config.n_window`` (``Qwen3ASRFeatureExtractor.__call__``; ``Qwen3ASREncoder``
    refuses any other length).
    """

    mask_kwarg: str = "feature_attention_mask"
    mask_dtype: str = "int32"
    window_multiple: bool = False
    #: the forward flag set when a clip of the prompt carries its audio track interleaved with its frames
    #: (``<vision start><audio start>``: the gateway's ``use_audio_in_video``); None: the model has none.
    #: Qwen2.5-Omni / Qwen3-Omni ``use_audio_in_video``: their ``get_rope_index`` positions the interleaved run
    #: by time only with it, and no wire carries it (the TokenSpeed and vLLM protos have no such field)
    in_video_kwarg: str | None = None


#: the Omni thinkers' audio inputs
_OMNI_AUDIO = AudioInputs(in_video_kwarg="use_audio_in_video")


class RawLayout(StrEnum):
    """The layout of a raw uint8 primary tensor, as far as normalizing it needs."""

    PATCH_ROWS = "patch_rows"  # [N, C*K]: rows of patches, channel-major columns (Qwen-VL C, T, P, P)
    CHANNELS_FIRST = "channels_first"  # [..., C, H, W]: images or tiles, channel axis third from last


@dataclass(frozen=True, slots=True)
class EngineFamily:
    """One family's row (see the module docstring)."""

    name: str
    shrink: ShrinkSpec  # the config rules for a weight-less bundle
    token_types: TokenTypes | None
    raw_layout: RawLayout | None
    #: the model class embeds clip frames as images (InternVL3): a clip's vLLM context ids are read as the
    #: image token and its frames join ``pixel_values`` in prompt order (:mod:`mmgate.refengine.frames_as_images`)
    video_as_images: bool = False
    #: the transformers class to run (None: ``config.architectures`` / the Auto mapping) and the
    #: config attribute it is built from (None: the bundle's config itself)
    model_class: str | None = None
    sub_config: str | None = None
    audio: AudioInputs | None = None  # None: the model takes no audio


# ---- the sizes, as the field names of each config class -----------------------------------

#: decoder fields shared by Qwen2/2.5/3-VL text, Llama, Mistral and Gemma 3 text configs
_DECODER = _frozen({
    "num_hidden_layers": TEXT_LAYERS,
    "hidden_size": TEXT_HIDDEN,
    "num_attention_heads": TEXT_HEADS,
    "num_key_value_heads": TEXT_KV_HEADS,
    "intermediate_size": TEXT_INTERMEDIATE,
    "head_dim": TEXT_HEAD_DIM,
})
#: CLIP / SigLIP vision towers (LLaVA, LLaVA-NeXT, Gemma 3)
_VIT = _frozen({
    "num_hidden_layers": VISION_DEPTH,
    "hidden_size": VISION_HIDDEN,
    "num_attention_heads": VISION_HEADS,
    "intermediate_size": VISION_INTERMEDIATE,
})

#: text rules every decoder gets (each is a no-op where its field is absent)
_TEXT_RULES = ("layer_types", "max_window_layers", "mrope_section")
_TEXT_IDS = ("text.vocab_size", "text.eos_token_id", "text.bos_token_id", "text.pad_token_id",
             "text.max_position_embeddings")

TEXT_ONLY_SHRINK: Final = ShrinkSpec(text=_DECODER, rules=_TEXT_RULES, keep=_TEXT_IDS)

_QWEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_QWEN_PATCHES = ("vision.patch_size", "vision.temporal_patch_size", "vision.spatial_merge_size",
                 "vision.in_channels", "vision.window_size", "vision.num_position_embeddings",
                 "vision.tokens_per_second")

QWEN2_VL_SHRINK: Final = ShrinkSpec(
    text=_DECODER,
    # embed_dim = tower width; hidden_size = the merger's output = the text width
    vision=_frozen({"depth": VISION_DEPTH, "embed_dim": VISION_HIDDEN, "hidden_size": TEXT_HIDDEN,
                    "num_heads": VISION_HEADS}),
    rules=_TEXT_RULES,
    keep=_QWEN_IDS + _TEXT_IDS + _QWEN_PATCHES,
)
QWEN2_5_VL_SHRINK: Final = ShrinkSpec(
    text=_DECODER,
    # hidden_size = tower width; out_hidden_size = the merger's output = the text width
    vision=_frozen({"depth": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "out_hidden_size": TEXT_HIDDEN,
                    "num_heads": VISION_HEADS, "intermediate_size": VISION_INTERMEDIATE}),
    rules=_TEXT_RULES + ("fullatt_block_indexes",),
    keep=_QWEN_IDS + _TEXT_IDS + _QWEN_PATCHES,
)
QWEN3_VL_SHRINK: Final = ShrinkSpec(
    text=_DECODER,
    vision=QWEN2_5_VL_SHRINK.vision,
    rules=_TEXT_RULES + ("deepstack_visual_indexes",),
    keep=_QWEN_IDS + _TEXT_IDS + _QWEN_PATCHES,
)

#: vision_feature_layer is not kept but rescaled (rule): -2 stays -2 in the two-layer tower
_LLAVA_KEEP = (
    "image_token_index", "vocab_size", "pad_token_id", "image_seq_length", "vision_feature_select_strategy",
    "vision.image_size", "vision.patch_size", "vision.num_channels",
) + _TEXT_IDS

LLAVA_SHRINK: Final = ShrinkSpec(
    text=_DECODER, vision=_VIT, rules=_TEXT_RULES + ("vision_feature_layer",), keep=_LLAVA_KEEP,
)
LLAVA_NEXT_SHRINK: Final = ShrinkSpec(
    text=_DECODER, vision=_VIT, rules=_TEXT_RULES + ("vision_feature_layer",),
    keep=_LLAVA_KEEP + ("image_grid_pinpoints", "use_image_newline_parameter", "text.sliding_window"),
)
GEMMA3_SHRINK: Final = ShrinkSpec(
    text=_DECODER,
    vision=_VIT,
    # layer_types keeps one full-attention layer after the sliding one; the pooling geometry
    # (image_size / patch_size = 64 patches a side, pooled to sqrt(mm_tokens_per_image) = 16) is kept
    rules=_TEXT_RULES + ("sliding_window_pattern", "query_pre_attn_scalar"),
    keep=("image_token_index", "boi_token_index", "eoi_token_index", "eos_token_id", "mm_tokens_per_image",
          "text.sliding_window", "text.rope_parameters", "text.final_logit_softcapping",
          "vision.image_size", "vision.patch_size", "vision.num_channels", "vision.vision_use_head") + _TEXT_IDS,
    # transformers 5.24 Gemma3PreTrainedModel._init_weights zeroes the projector: every image would embed to 0
    redraw=("model.multi_modal_projector.mm_input_projection_weight",),
    # Gemma scales embeddings by sqrt(hidden) and normalizes every sublayer's output to unit RMS, so with
    # the head tied to the embeddings a random model's argmax is always the last prompt token
    overrides=MappingProxyType({"tie_word_embeddings": False, "text.tie_word_embeddings": False}),
)
LLAVA_ONEVISION_SHRINK: Final = ShrinkSpec(
    text=_DECODER, vision=_VIT, rules=_TEXT_RULES + ("vision_feature_layer",),
    # the tile grid (image_size / patch_size = 27 patches a side), the pinpoints, the anyres-max cap and
    # the video pooling all read vision geometry and top-level fields that must not change
    keep=("image_token_index", "video_token_index", "vision_feature_select_strategy", "image_grid_pinpoints",
          "vision_aspect_ratio", "use_image_newline_parameter", "vision.image_size", "vision.patch_size",
          "vision.num_channels", "vision.vision_use_head") + _TEXT_IDS,
)

LLAMA4_SHRINK: Final = ShrinkSpec(
    # the MoE decoder keeps 4 experts (top-1 routing, a shared expert) at the table's widths
    text=_frozen({**_DECODER, "intermediate_size_mlp": TEXT_INTERMEDIATE, "num_local_experts": 4}),
    # pixel shuffle 0.5 turns the tower width into 4x the channels: intermediate_size = 4 x hidden_size
    # (Llama4VisionMLP2.fc1's input); the projector's dims (input = output = vision_output_dim) stay equal
    vision=_frozen({"num_hidden_layers": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "num_attention_heads": VISION_HEADS,
                    "intermediate_size": 4 * VISION_HIDDEN, "vision_output_dim": 2 * VISION_HIDDEN,
                    "projector_input_dim": 2 * VISION_HIDDEN, "projector_output_dim": 2 * VISION_HIDDEN}),
    # layer_types keeps one chunked (RoPE) and one full (NoPE) layer; no_rope_layers and moe_layers follow
    rules=_TEXT_RULES + ("no_rope_layers", "moe_layers"),
    keep=("image_token_index", "boi_token_index", "eoi_token_index", "text.attention_chunk_size",
          "text.rope_parameters", "vision.image_size", "vision.patch_size", "vision.num_channels",
          "vision.pixel_shuffle_ratio") + _TEXT_IDS,
)

#: InternVL3 (HF format): InternVLVisionConfig names its sizes as CLIP does; the pixel-shuffle projector
#: reads vision.hidden_size * (1 / downsample_ratio)^2, so the tile geometry (448 / 14 = 32 patches a side,
#: 256 context tokens per tile) is kept
INTERNVL_SHRINK: Final = ShrinkSpec(
    text=_DECODER, vision=_VIT, rules=_TEXT_RULES + ("vision_feature_layer",),
    keep=("image_token_id", "image_seq_length", "downsample_ratio", "vision_feature_select_strategy",
          "vision.image_size", "vision.patch_size", "vision.num_channels") + _TEXT_IDS,
)

# ---- audio models (the thinker of Qwen2.5-Omni / Qwen3-Omni, Qwen3-ASR) ---------------------------

#: Whisper-style audio encoders: transformers 5.24 Qwen2_5OmniAudioEncoderConfig, Qwen3OmniMoeAudioEncoderConfig,
#: Qwen3ASREncoderConfig; output_dim = the projection into the text width
_AUDIO = _frozen({"encoder_layers": AUDIO_LAYERS, "d_model": AUDIO_HIDDEN, "encoder_attention_heads": AUDIO_HEADS,
                  "encoder_ffn_dim": AUDIO_FFN, "output_dim": TEXT_HIDDEN, "downsample_hidden_size": AUDIO_DOWNSAMPLE,
                  "num_key_value_heads": AUDIO_HEADS})
#: the feature geometry a gateway observes (mel bins, chunking into 2 * n_window frames) and the tower's
#: attention windows / position table; n_window_infer and conv_chunksize change no shape but the numbers
_AUDIO_KEEP = ("audio.num_mel_bins", "audio.n_window", "audio.n_window_infer", "audio.conv_chunksize",
               "audio.max_source_positions", "audio.max_position_embeddings")
_OMNI_IDS = ("audio_token_id", "audio_start_token_id", "audio_end_token_id", "position_id_per_seconds",
             "seconds_per_chunk") + _QWEN_IDS

#: Qwen2.5-Omni thinker: a Qwen2.5-VL tower and decoder (M-RoPE [16, 24, 24]) plus the audio tower
QWEN2_5_OMNI_SHRINK: Final = ShrinkSpec(
    text=_DECODER, vision=QWEN2_5_VL_SHRINK.vision, audio=_AUDIO,
    rules=_TEXT_RULES + ("fullatt_block_indexes",),
    keep=_OMNI_IDS + _TEXT_IDS + _QWEN_PATCHES + _AUDIO_KEEP,
)
#: Qwen3-Omni thinker: a Qwen3-VL tower (deepstack), a Qwen3-MoE decoder (4 experts, top-2, interleaved
#: M-RoPE [24, 20, 20]) plus the audio tower
QWEN3_OMNI_SHRINK: Final = ShrinkSpec(
    text=_frozen({**_DECODER, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": TEXT_INTERMEDIATE}),
    vision=QWEN2_5_VL_SHRINK.vision, audio=_AUDIO,
    rules=_TEXT_RULES + ("deepstack_visual_indexes",),
    keep=_OMNI_IDS + _TEXT_IDS + _QWEN_PATCHES + _AUDIO_KEEP + ("vision.image_size",),
)
#: Qwen3-ASR (transformers-native ``-hf`` layout: flat, no thinker_config): a Qwen3 decoder plus the audio tower
QWEN3_ASR_SHRINK: Final = ShrinkSpec(
    text=_DECODER, audio=_AUDIO, rules=_TEXT_RULES,
    keep=("audio_token_id", "timestamp_token_id", "eos_token_id", "pad_token_id") + _TEXT_IDS + _AUDIO_KEEP,
)

# ---- the table ------------------------------------------------------------------------------

#: transformers 5.24 ``ProcessorMixin.create_mm_token_type_ids``: 1 image, 2 video (Qwen-VL's M-RoPE reads it)
MM_TOKEN_TYPES: Final = TokenTypes("mm_token_type_ids", image=1, video=2)

GENERIC: Final = EngineFamily("generic", shrink=TEXT_ONLY_SHRINK, token_types=MM_TOKEN_TYPES, raw_layout=None)

ENGINE_FAMILIES: Final[Mapping[str, EngineFamily]] = MappingProxyType({
    "qwen2_vl": EngineFamily("qwen2_vl", QWEN2_VL_SHRINK, MM_TOKEN_TYPES, RawLayout.PATCH_ROWS),
    "qwen2_5_vl": EngineFamily("qwen2_5_vl", QWEN2_5_VL_SHRINK, MM_TOKEN_TYPES, RawLayout.PATCH_ROWS),
    "qwen3_vl": EngineFamily("qwen3_vl", QWEN3_VL_SHRINK, MM_TOKEN_TYPES, RawLayout.PATCH_ROWS),
    # transformers 5.24 LlavaForConditionalGeneration / LlavaNextForConditionalGeneration take no token types
    "llava": EngineFamily("llava", LLAVA_SHRINK, None, RawLayout.CHANNELS_FIRST),
    "llava_next": EngineFamily("llava_next", LLAVA_NEXT_SHRINK, None, RawLayout.CHANNELS_FIRST),
    # Gemma3ForConditionalGeneration.forward: token_type_ids == 1 marks the image tokens that attend
    # bidirectionally (get_block_sequence_ids_for_mask); Gemma3Processor sets 1 on image_token_id
    "gemma3": EngineFamily("gemma3", GEMMA3_SHRINK, TokenTypes("token_type_ids", image=1),
                           RawLayout.CHANNELS_FIRST),
    # transformers 5.24 LlavaOnevisionForConditionalGeneration takes no token types
    "llava_onevision": EngineFamily("llava_onevision", LLAVA_ONEVISION_SHRINK, None, RawLayout.CHANNELS_FIRST),
    # Llama4ForConditionalGeneration takes no token types; its pixels are bfloat16 values the engine
    # does not reproduce on device (raw_layout None); forward's last line needs a fix (model_fixes.py)
    "llama4": EngineFamily("llama4", LLAMA4_SHRINK, None, None),
    # InternVLForConditionalGeneration.forward takes no token types; pixel_values [patches, 3, 448, 448]
    "internvl": EngineFamily("internvl", INTERNVL_SHRINK, None, RawLayout.CHANNELS_FIRST, video_as_images=True),
    # the thinkers take no token types (their get_rope_index reads the placeholder ids themselves); the
    # bundles name the whole model (thinker + talker + token2wav / code2wav): the engine runs the thinker,
    # the text-output model TokenSpeed runs for Qwen3-Omni (models/qwen3_omni.py: "thinker only")
    "qwen2_5_omni": EngineFamily("qwen2_5_omni", QWEN2_5_OMNI_SHRINK, None, RawLayout.PATCH_ROWS,
                                 model_class="Qwen2_5OmniThinkerForConditionalGeneration",
                                 sub_config="thinker_config", audio=_OMNI_AUDIO),
    "qwen3_omni_moe": EngineFamily("qwen3_omni_moe", QWEN3_OMNI_SHRINK, None, RawLayout.PATCH_ROWS,
                                   model_class="Qwen3OmniMoeThinkerForConditionalGeneration",
                                   sub_config="thinker_config", audio=_OMNI_AUDIO),
    "qwen3_asr": EngineFamily("qwen3_asr", QWEN3_ASR_SHRINK, None, None,
                              model_class="Qwen3ASRForConditionalGeneration",
                              audio=AudioInputs(mask_kwarg="input_features_mask", window_multiple=True)),
})


def engine_family(model_type: str) -> EngineFamily:
    """The row for ``model_type``; :data:`GENERIC` for one the table does not name."""
    return ENGINE_FAMILIES.get(model_type, GENERIC)
