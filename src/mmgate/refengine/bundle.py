"""Load a model bundle into a transformers model plus the facts the engine reports.

Stage: engine start-up.  In: an :class:`EngineConfig` naming a bundle folder
(``config.json``, tokenizer files, ``preprocessor_config.json``, optional
``*.safetensors``); out: a :class:`LoadedModel` (a float32 model in eval mode
and frozen :class:`ModelFacts`).

The model class is the one ``config.architectures`` names (e.g.
``Qwen2_5_VLForConditionalGeneration``, ``LlavaForConditionalGeneration``,
``LlavaNextForConditionalGeneration``, ``Gemma3ForConditionalGeneration``: the
same classes ``AutoModelForImageTextToText`` maps their configs to), else
``AutoModelForImageTextToText`` for a config with ``vision_config`` and
``AutoModelForCausalLM`` otherwise; a family row that names its own class and
sub-config (Qwen2.5-Omni / Qwen3-Omni: the thinker class on ``thinker_config``;
Qwen3-ASR) overrides that.  A bundle with weights is loaded with
``from_pretrained``; a bundle without is built from ``torch.manual_seed(seed)``
at the size :mod:`.shrink` gives from the family's row of
:mod:`.families` (which keeps every token id and the vision geometry), then
the row's ``redraw`` parameters are drawn from a generator seeded the same way,
so the same seed always builds the same weights.

The model's own ``generation_config`` is replaced by a neutral one: like the
vLLM gRPC servicer (``_sampling_params_from_proto``), every sampling field is
taken from the request, never from the bundle's ``generation_config.json``.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedModel

from mmgate.refengine.config import EngineConfig
from mmgate.refengine.families import ENGINE_FAMILIES, EngineFamily, engine_family
from mmgate.refengine.model_fixes import apply_model_fixes
from mmgate.refengine.shrink import redraw_parameters, shrink_config, shrink_spec

logger = logging.getLogger(__name__)

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What GetModelInfo reports and what generation needs besides the model."""

    model_path: str
    served_model_name: str
    model_type: str  # config.model_type, e.g. "qwen2_5_vl"
    architectures: tuple[str, ...]
    vocab_size: int
    max_context_length: int  # text max_position_embeddings, else tokenizer model_max_length
    supports_vision: bool  # the config has a vision_config
    eos_token_ids: tuple[int, ...]  # the config's own eos ids (what vLLM advertises)
    stop_token_ids: tuple[int, ...]  # config eos then generation_config extras: what a request stops on
    pad_token_id: int  # -1 when the bundle declares none
    bos_token_id: int  # -1 when the bundle declares none
    image_token_id: int | None
    video_token_id: int | None
    random_weights: bool  # no weights in the bundle: shrunken random model
    audio_token_id: int | None = None
    supports_audio: bool = False  # the model has an audio tower and an audio token (and its row says how to feed it)
    audio_frame_multiple: int = 1  # the audio frame axis is padded to a multiple of this (Qwen3-ASR: 2 * n_window)

    @property
    def takes_media(self) -> bool:
        """Whether the model takes any multimodal input (a vision or an audio tower)."""
        return self.supports_vision or self.supports_audio


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model: call only from the engine's model thread(s)."""

    model: PreTrainedModel
    facts: ModelFacts
    forward_params: frozenset[str]  # keyword names model.forward accepts
    family: EngineFamily  # the engine's row for facts.model_type (GENERIC when the table has none)


def token_ids(value: Any) -> list[int]:
    """The ids in an HF config field: one id or a list; negatives and bools are not ids.

    Mirrors ``smg_grpc_servicer/vllm/config_view.py`` ``token_ids``.
    """
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value] if value >= 0 else []
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return []


def has_weights(path: Path) -> bool:
    """Whether the bundle folder holds weight files."""
    return any(any(path.glob(pattern)) for pattern in _WEIGHT_GLOBS)


def model_class(config: PretrainedConfig, name: str | None = None) -> type[PreTrainedModel]:
    """The transformers class for ``config``: ``name`` (the family row's ``model_class``) when given,
    else ``config.architectures[0]`` first.

    Raises:
        ValueError: no class for the architecture and no Auto fallback fits.
    """
    if name is not None:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
        raise ValueError(f"transformers {transformers.__version__} has no model class {name!r}")
    for name in config.architectures or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    auto = (
        transformers.AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else transformers.AutoModelForCausalLM
    )
    mapping = auto._model_mapping  # type: ignore[attr-defined]
    entry = mapping.get(type(config), None)  # _LazyAutoMapping.get needs its default
    found = entry[0] if isinstance(entry, tuple) else entry
    if isinstance(found, type) and issubclass(found, PreTrainedModel):
        return found
    raise ValueError(f"no transformers model class for architectures {config.architectures!r}")


def _first_id(*values: Any) -> int:
    for value in values:
        ids = token_ids(value)
        if ids:
            return ids[0]
    return -1


def _generation_config(path: Path) -> GenerationConfig | None:
    if not (path / "generation_config.json").is_file():
        return None
    return GenerationConfig.from_pretrained(path)


def _tokenizer_max_length(path: Path) -> int:
    try:
        data = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return 0
    value = data.get("model_max_length")
    return int(value) if isinstance(value, (int, float)) and 0 < value < 2**31 else 0


def read_facts(path: Path, config: PretrainedConfig, served_model_name: str, random_weights: bool,
               model_config: PretrainedConfig | None = None, family: EngineFamily | None = None) -> ModelFacts:
    """Collect :class:`ModelFacts` from the bundle's own files (the unshrunken config).

    ``model_config``: the config the model is built from when it is not ``config`` (an Omni bundle's
    ``thinker_config``): token ids, towers and the text config are read there, the model type,
    architectures and eos ids from ``config``.
    """
    top, config = config, model_config if model_config is not None else config
    text = config.get_text_config()
    gen = _generation_config(path)
    # vLLM advertises hf_config.eos_token_id (smg_grpc_servicer/vllm/config_view.py hf_eos_token_ids): the top
    # level first (Gemma 3: [1, 106]; its text config says 1), else the text config's (transformers 5 keeps
    # Qwen-VL's and LLaVA's there only)
    eos = (token_ids(getattr(top, "eos_token_id", None)) or token_ids(getattr(config, "eos_token_id", None))
           or token_ids(getattr(text, "eos_token_id", None)))
    stop = list(eos)
    for extra in token_ids(gen.eos_token_id if gen else None):
        if extra not in stop:
            stop.append(extra)
    max_len = int(getattr(text, "max_position_embeddings", 0) or 0) or _tokenizer_max_length(path)
    audio_config = getattr(config, "audio_config", None)
    audio_token_id = getattr(config, "audio_token_id", None) if audio_config is not None else None
    audio = family.audio if family is not None else None
    window = int(getattr(audio_config, "n_window", 0) or 0)
    return ModelFacts(
        model_path=str(path),
        served_model_name=served_model_name,
        model_type=str(top.model_type),
        architectures=tuple(top.architectures or ()),
        vocab_size=int(text.vocab_size),
        max_context_length=max_len,
        supports_vision=getattr(config, "vision_config", None) is not None,
        eos_token_ids=tuple(eos),
        stop_token_ids=tuple(stop),
        pad_token_id=_first_id(
            getattr(text, "pad_token_id", None), getattr(config, "pad_token_id", None), gen and gen.pad_token_id
        ),
        bos_token_id=_first_id(
            getattr(text, "bos_token_id", None), getattr(config, "bos_token_id", None), gen and gen.bos_token_id
        ),
        image_token_id=getattr(config, "image_token_id", None),
        video_token_id=getattr(config, "video_token_id", None),
        random_weights=random_weights,
        audio_token_id=audio_token_id,
        supports_audio=audio is not None and audio_token_id is not None,
        audio_frame_multiple=2 * window if audio is not None and audio.window_multiple and window > 0 else 1,
    )


def check_engine_bundle(path: Path) -> None:
    """Refuse at start-up a bundle whose media mmgate cannot serve (before any model is built).

    A media model of a ``model_type`` neither the gateway's registry nor the engine's
    family table (:data:`~mmgate.refengine.families.ENGINE_FAMILIES`) names
    (GLM-4V, a renamed Omni copy's ``thinker_config`` towers, ...) would load here and then take
    no request anyone can prepare; a text-only bundle passes.  A ``model_type`` of the
    engine's table passes even before a gateway family serves it: its requests can come
    from any client that lays tensors out as vLLM does (the engine's own tests use the
    transformers processor).

    Raises:
        OSError: no ``config.json`` in ``path``.
        ValueError: see :func:`mmgate.models.registry.check_servable`.
    """
    from mmgate.errors import GatewayError
    from mmgate.models.bundle import load_bundle
    from mmgate.models.registry import check_servable

    try:
        bundle = load_bundle(path)
        if bundle.model_type in ENGINE_FAMILIES:
            return
        check_servable(bundle)
    except GatewayError as exc:
        if not (Path(path) / "config.json").is_file():
            raise OSError(exc.message) from None
        raise ValueError(exc.message) from None


def load_model(config: EngineConfig) -> LoadedModel:
    """Build the model for ``config.model``.

    Returns:
        A :class:`LoadedModel` in float32, eval mode, with a neutral generation config.

    Raises:
        OSError: the folder has no readable ``config.json``.
        ValueError: no transformers class serves the config's architecture; or the bundle takes
            media that no mmgate family serves (:func:`check_engine_bundle`, checked first: the
            message names the ``model_type`` and the registered families); or it has no weights
            and the engine has no shrink rules for it (:func:`mmgate.refengine.shrink.shrink_spec`).
    """
    path = config.model
    check_engine_bundle(path)
    hf_config = AutoConfig.from_pretrained(path)
    family = engine_family(str(hf_config.model_type))
    # the family's sub-config (an Omni bundle's thinker_config) is the model's own config
    model_config = getattr(hf_config, family.sub_config) if family.sub_config else hf_config
    cls = model_class(model_config, family.model_class)
    random_weights = not has_weights(path)
    if random_weights:
        shrink_spec(hf_config)  # refuses a media model the table does not name
        shrunk = shrink_config(model_config, family.shrink)
        torch.manual_seed(config.seed)
        model = cls(shrunk)
        redraw_parameters(model, family.shrink.redraw, config.seed)
    else:
        model = cls.from_pretrained(path, dtype=torch.float32)
    model = model.float().eval()
    for fix in apply_model_fixes(model):  # a bug of the installed transformers' class (model_fixes.py)
        logger.warning("reference engine: applied fix %s to %s", fix, type(model).__name__)
    model.generation_config = GenerationConfig()
    facts = read_facts(path, hf_config, config.model_name, random_weights, model_config, family)
    params = frozenset(inspect.signature(model.forward).parameters)
    return LoadedModel(model=model, facts=facts, forward_params=params, family=family)


class LazyTokenizer:
    """The bundle's tokenizer, loaded on first use (text prompts, stop strings).

    Loading a 150k-entry tokenizer takes seconds; most requests arrive
    pre-tokenized and never need it.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def get(self) -> Any:
        """The ``AutoTokenizer`` for the bundle.

        Raises:
            OSError / ValueError: the bundle has no usable tokenizer files.
        """
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(self._path)
            return self._tokenizer
