"""OpenAI chat-completion request shapes (msgspec structs) and their value checks.

Stage: request (below api/; every endpoint's request becomes one).  In: the raw JSON body; out: a
decoded, value-checked :class:`ChatCompletionRequest` (:func:`mmgate.request.parse.parse_chat_request`
adds the constraint check).  Content parts are a tagged union on ``type``:
``text``, ``image_url``, ``video_url``, ``input_audio``, ``audio_url``, ``image_embeds`` (parsed so that it is
refused as ``multimodal_not_supported``: no engine wire takes embeddings, docs/engines.md); anything
else is a 400 ``invalid_request``.  An unknown top-level field is refused with 400
``invalid_request`` naming it in ``param`` (vLLM logs and drops such fields;
issue 14: refused, never dropped); unknown fields inside messages and parts
are skipped, never built, but still count towards the nesting bound.

Invariants: every value that reaches an engine fits its field on the wire
(``smg_grpc_proto`` ``vllm_engine.proto`` ``SamplingParams``) and the range
vLLM accepts; a refusal is a 400 ``invalid_request`` whose ``param`` names
the field and whose message never quotes the caller's value; parsing is
bounded: JSON nested deeper than :data:`MAX_JSON_DEPTH` is refused before it
is decoded.  The ranges are listed in ``docs/limits.md`` ("Request content").
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
import numpy as np

from mmgate.errors import ErrorCode, GatewayError


class ImageURL(msgspec.Struct, frozen=True):
    url: str
    detail: str | None = None
    max_long_side_pixel: int | None = None  # per-item hint (docs/video.md, "Hints")


#: bounds of the ``video_url.fps`` hint, frames per second
VIDEO_FPS_HINT_RANGE = (0.2, 5.0)


class VideoURL(msgspec.Struct, frozen=True):
    url: str
    fps: float | None = None  # per-item hint: frames per second to sample
    max_long_side_pixel: int | None = None  # per-item hint (docs/video.md, "Hints")


#: ``input_audio.format`` values taken, and the media type of the ``data:`` URL each becomes (the decoder sniffs
#: the bytes; the type only names the part in messages).  OpenAI documents ``wav`` and ``mp3``; vLLM's
#: ``chat_utils`` passes any format through to its loader, so the containers PyAV decodes are taken too.
AUDIO_FORMATS: dict[str, str] = {
    "wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg", "opus": "audio/ogg",
    "m4a": "audio/mp4", "aac": "audio/aac", "webm": "audio/webm",
}


class InputAudio(msgspec.Struct, frozen=True):
    """``input_audio`` of a chat part (openai-python ``InputAudio``): base64 bytes and their container."""

    data: str
    format: str = "wav"

    def data_url(self) -> str:
        """The clip as a ``data:`` URL (one media reference shape for every audio part, forwardable to a worker)."""
        return f"data:{AUDIO_FORMATS.get(self.format.lower(), 'audio/wav')};base64,{self.data}"


class AudioURL(msgspec.Struct, frozen=True):
    """``audio_url`` of a chat part (vLLM's ``ChatCompletionContentPartAudioParam``): http(s) or ``data:``."""

    url: str


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag_field="type", tag="image_url"):
    image_url: ImageURL


class VideoPart(msgspec.Struct, frozen=True, tag_field="type", tag="video_url"):
    video_url: VideoURL


class AudioPart(msgspec.Struct, frozen=True, tag_field="type", tag="input_audio"):
    input_audio: InputAudio


class AudioURLPart(msgspec.Struct, frozen=True, tag_field="type", tag="audio_url"):
    audio_url: AudioURL


class ImageEmbedsPart(msgspec.Struct, frozen=True, tag_field="type", tag="image_embeds"):
    """vLLM's ``image_embeds`` part (``ChatCompletionContentPartImageEmbedsParam``): precomputed embeddings.
    Refused before planning (:mod:`mmgate.routing.capability`): no engine wire carries them."""

    image_embeds: str | dict[str, str] | None = None
    uuid: str | None = None


ContentPart = TextPart | ImagePart | VideoPart | AudioPart | AudioURLPart | ImageEmbedsPart


class FunctionCall(msgspec.Struct, frozen=True):
    """``tool_calls[j].function`` (openai-python ``ChatCompletionMessageToolCallParam.Function``).

    ``arguments`` is a JSON string in the OpenAI API; an object is taken too,
    as vLLM's ``_postprocess_messages`` (``vllm/entrypoints/chat_utils.py``) does.
    """

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(msgspec.Struct, frozen=True):
    """One ``tool_calls`` entry of an assistant message."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"


#: the OpenAI chat roles (openai-python ``ChatCompletionMessageParam``: system, developer,
#: user, assistant, tool, and the deprecated function)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Message(msgspec.Struct, frozen=True):
    role: str  # one of ROLES
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


# ---- structured outputs and tools (H-C2; checked in mmgate.request.structured) ----------------------


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    """``response_format.json_schema`` (vLLM ``JsonSchemaResponseFormat``; ``schema`` is the JSON schema)."""

    name: str | None = None
    schema: Any = None  # the JSON schema; must be a JSON object (checked)
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": ...}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True):
    """vLLM's ``structured_outputs`` (``vllm/sampling_params.py`` ``StructuredOutputsParams``): one of them."""

    json: Any = None  # a JSON schema (object, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class FunctionDefinition(msgspec.Struct, frozen=True):
    """``tools[i].function`` (OpenAI ``FunctionDefinition``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True):
    """``tools[i]``: ``{"type": "function", "function": {...}}``."""

    function: FunctionDefinition
    type: str = "function"


class NamedFunction(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    function: NamedFunction
    type: str = "function"


class ChatCompletionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The chat completions body; a field not declared here is refused (400 naming it), never dropped."""

    model: str
    messages: list[Message]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 and 0: disabled (normalized to 0 by parse_chat_request)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    #: vLLM's chat request field (``ChatCompletionRequest.continue_final_message``): the prompt ends inside the
    #: last message, which it continues (transformers ``apply_chat_template(continue_final_message=True)``,
    #: :func:`mmgate.chat.template.render_chat`); not with ``add_generation_prompt`` (vLLM refuses both)
    continue_final_message: bool = False
    #: vLLM's chat request field (``vllm/entrypoints/openai/chat_completion/protocol.py``
    #: ``ChatCompletionRequest.add_special_tokens``, passed to ``tokenizer.encode`` by its renderer):
    #: true, the tokenizer's post-processor adds its special tokens (BOS) to the rendered prompt, even
    #: one that starts with BOS; false, none are added.  Absent (or null): the reference's rule,
    #: transformers ``apply_chat_template(tokenize=True)``: BOS unless the template wrote it.  vLLM's
    #: own default is false (docs/parity.md "BOS and special tokens").
    add_special_tokens: bool | None = None
    #: per-request processor options, as vLLM's request field (e.g. Gemma 3 ``do_pan_and_scan``):
    #: scalar values only; which names a model takes is its family's (refused otherwise)
    mm_processor_kwargs: dict[str, bool | int | float | str] | None = None
    # structured outputs and tools (H-C2): at most one constraint; checked by mmgate.request.structured
    response_format: ResponseFormat | None = None
    guided_json: Any = None  # vLLM's guided fields: a JSON schema (object or its JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required" | named function
    parallel_tool_calls: bool | None = None
    # sampling, n and logprobs (H-C1): vLLM ``ChatCompletionRequest`` "chat-completion-sampling-params";
    # checked by _check_sampling / _check_more_sampling, mapped in Pipeline._sampling
    logprobs: bool = False
    top_logprobs: int | None = None  # 0 .. MAX_TOP_LOGPROBS, with logprobs=true
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in LOGIT_BIAS_RANGE
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None  # accepted and unused, as vLLM


#: largest ``max_long_side_pixel`` hint (int32, so pixel arithmetic stays in numpy's integer range)
MAX_LONG_SIDE_HINT = 2**31 - 1
#: deepest JSON nesting accepted anywhere in a body (the body object itself is level 1)
MAX_JSON_DEPTH = 64
#: largest ``max_tokens``: the wire's ``optional uint32 max_tokens`` (the cap to the context is applied later)
MAX_TOKENS_LIMIT = 2**32 - 1
#: largest ``top_k``: the wire's ``uint32 top_k``
TOP_K_LIMIT = 2**32 - 1
#: ``seed`` range: the wire's ``optional int32 seed`` (vLLM itself takes int64)
SEED_RANGE = (-(2**31), 2**31 - 1)
#: ``temperature`` range (OpenAI's; vLLM requires >= 0)
TEMPERATURE_RANGE = (0.0, 2.0)
#: ``frequency_penalty`` and ``presence_penalty`` range (vLLM ``SamplingParams._verify_args``)
PENALTY_RANGE = (-2.0, 2.0)
#: most ``stop`` strings, and the longest one in characters
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
#: ``n`` range (OpenAI's documented 1..128; the wire's ``uint32 n``)
N_RANGE = (1, 128)
#: largest ``top_logprobs`` (OpenAI's 20; vLLM's default ``--max-logprobs``)
MAX_TOP_LOGPROBS = 20
#: ``logit_bias`` values (OpenAI's range) and the most entries
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 1024
#: most ``stop_token_ids``; each must fit the wire's ``repeated uint32``
MAX_STOP_TOKEN_IDS = 64
#: token ids on the wire: ``uint32`` stop ids, ``int32`` logit-bias keys
TOKEN_ID_LIMIT = 2**31 - 1
#: decimal digits of the largest token id (a longer ``logit_bias`` key is refused before ``int()``, which
#: refuses strings of more than 4,300 digits itself)
_TOKEN_ID_DIGITS = len(str(TOKEN_ID_LIMIT))
#: largest ``repetition_penalty`` (vLLM requires > 0 and sets no upper bound; a finite float32 here)
MAX_REPETITION_PENALTY = 1e6
#: ``chat_template_kwargs`` keys that name what the renderer passes itself (vLLM refuses
#: ``chat_template`` and ``tokenize``; the others would collide with the render call)
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                      "chat_template", "tokenize", "conversation"})

_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode a chat-completion body and check its values (the constraint and ``top_k`` are
    :func:`mmgate.request.parse.parse_chat_request`'s).

    Raises:
        GatewayError(INVALID_REQUEST): not JSON, nested deeper than
            :data:`MAX_JSON_DEPTH`, not the OpenAI shape, or a value outside its
            range (``param`` names the JSON path; the message never quotes the value).
    """
    check_json_depth(body)
    try:
        req = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        message, param = _validation_message(str(exc))
        raise GatewayError(ErrorCode.INVALID_REQUEST, message, param) from None
    except msgspec.DecodeError:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "request body is not valid JSON") from None
    except RecursionError:
        raise GatewayError(ErrorCode.INVALID_REQUEST, _TOO_DEEP) from None
    if not req.messages:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "messages must not be empty", "messages")
    if req.continue_final_message and req.add_generation_prompt:
        # vLLM ChatCompletionRequest.check_generation_prompt
        raise GatewayError(ErrorCode.INVALID_REQUEST, "Cannot set both continue_final_message and "
                           "add_generation_prompt to true", "continue_final_message")
    _check_sampling(req)
    _check_more_sampling(req)
    _check_messages(req)
    _check_template_kwargs(req.chat_template_kwargs)
    _check_mm_processor_kwargs(req.mm_processor_kwargs)
    _check_hints(req)
    return req


_TOO_DEEP = f"request JSON is nested more than {MAX_JSON_DEPTH} levels deep"

#: most ``mm_processor_kwargs`` entries, and the longest name or string value
MAX_MM_PROCESSOR_KWARGS = 16
MAX_MM_PROCESSOR_KWARG_CHARS = 64


def _check_mm_processor_kwargs(kwargs: dict[str, bool | int | float | str] | None) -> None:
    """Bound ``mm_processor_kwargs`` (the model's processor refuses names it does not take later,
    before anything is fetched: ``MediaProcessor.check_hints``).

    Raises:
        GatewayError(INVALID_REQUEST): too many entries, a name or string too long, a non-finite number.
    """
    if not kwargs:
        return
    if len(kwargs) > MAX_MM_PROCESSOR_KWARGS:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"mm_processor_kwargs may hold at most {MAX_MM_PROCESSOR_KWARGS} entries", "mm_processor_kwargs")
    for name, value in kwargs.items():
        if len(name) > MAX_MM_PROCESSOR_KWARG_CHARS or (isinstance(value, str) and len(value) > MAX_MM_PROCESSOR_KWARG_CHARS):
            raise GatewayError(ErrorCode.INVALID_REQUEST, "mm_processor_kwargs names and values must be short",
                               "mm_processor_kwargs")
        if isinstance(value, float) and not math.isfinite(value):
            raise GatewayError(ErrorCode.INVALID_REQUEST, "mm_processor_kwargs numbers must be finite",
                               f"mm_processor_kwargs.{name}" if name.isidentifier() else "mm_processor_kwargs")


def _in_range(value: float, low: float, high: float, param: str, what: str) -> None:
    if not low <= value <= high:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{param} must be {what} within [{low}, {high}]", param)


def _check_sampling(req: ChatCompletionRequest) -> None:
    """Ranges of the sampling fields.

    Mirrors vLLM ``vllm/sampling_params.py`` ``SamplingParams._verify_args``
    (v0.11: ``max_tokens >= 1``, ``top_p`` in (0, 1], ``top_k`` -1/0 or >= 1,
    penalties in [-2, 2], no empty stop string) narrowed to what
    ``vllm_engine.proto`` ``SamplingParams`` carries (``uint32 max_tokens``,
    ``uint32 top_k``, ``int32 seed``, ``uint32 n``).

    Raises:
        GatewayError(INVALID_REQUEST): the first field out of range, named in ``param``.
    """
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, field)
        if value is not None:
            _in_range(value, 1, MAX_TOKENS_LIMIT, field, "an integer")
    if req.temperature is not None:
        _in_range(req.temperature, *TEMPERATURE_RANGE, "temperature", "a number")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "top_p must be a number within (0, 1]", "top_p")
    if req.top_k is not None and req.top_k not in (-1, 0):
        _in_range(req.top_k, 1, TOP_K_LIMIT, "top_k", "-1 or 0 (disabled), or an integer")
    if req.seed is not None:
        _in_range(req.seed, *SEED_RANGE, "seed", "an integer")
    _in_range(req.frequency_penalty, *PENALTY_RANGE, "frequency_penalty", "a number")
    _in_range(req.presence_penalty, *PENALTY_RANGE, "presence_penalty", "a number")
    _in_range(req.n, *N_RANGE, "n", "an integer")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    for i, stop in enumerate(stops):
        param = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"a stop string must have 1 to {MAX_STOP_CHARS} characters", param)


def _check_more_sampling(req: ChatCompletionRequest) -> None:
    """Ranges of the vLLM sampling extras and logprobs (H-C1 block of :class:`ChatCompletionRequest`).

    Mirrors vLLM v0.11 ``SamplingParams._verify_args`` (``min_p`` in [0, 1],
    ``repetition_penalty`` > 0, ``min_tokens`` >= 0 and <= ``max_tokens``) and
    ``ChatCompletionRequest.check_logprobs`` (``vllm/entrypoints/openai/protocol.py``:
    ``top_logprobs`` >= 0 and only with ``logprobs``), with OpenAI's bounds
    (``top_logprobs`` <= 20, ``logit_bias`` values in [-100, 100]) and the wire's
    field types (``map<int32, float> logit_bias``, ``repeated uint32 stop_token_ids``).

    Raises:
        GatewayError(INVALID_REQUEST): the first field out of range, named in ``param``
            (never quoting the value or a ``logit_bias`` key).
    """
    if req.top_logprobs is not None:
        _in_range(req.top_logprobs, 0, MAX_TOP_LOGPROBS, "top_logprobs", "an integer")
        if req.top_logprobs > 0 and not req.logprobs:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "top_logprobs requires logprobs=true", "top_logprobs")
    if req.min_p is not None:
        _in_range(req.min_p, 0.0, 1.0, "min_p", "a number")
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"repetition_penalty must be a number within (0, {MAX_REPETITION_PENALTY:g}]",
                           "repetition_penalty")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _in_range(req.min_tokens, 0, MAX_TOKENS_LIMIT, "min_tokens", "an integer")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "min_tokens must not exceed max_tokens", "min_tokens")
    ids = req.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids",
                           "stop_token_ids")
    for i, token in enumerate(ids):
        _in_range(token, 0, TOKEN_ID_LIMIT, f"stop_token_ids[{i}]", "a token id")
    bias = req.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= _TOKEN_ID_DIGITS and int(key) <= TOKEN_ID_LIMIT):
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"logit_bias keys must be token ids (decimal integers within [0, {TOKEN_ID_LIMIT}])",
                               "logit_bias")
        if not (math.isfinite(value) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]):
            low, high = LOGIT_BIAS_RANGE
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"logit_bias values must be within [{low}, {high}]",
                               "logit_bias")


def _check_messages(req: ChatCompletionRequest) -> None:
    """Roles from :data:`ROLES`; tool-call arguments that are JSON strings stay within the nesting bound.

    Raises:
        GatewayError(INVALID_REQUEST): an unknown role (``messages[i].role``), or
            tool-call arguments nested too deeply.
    """
    for mi, message in enumerate(req.messages):
        if message.role not in ROLES:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"role must be one of {', '.join(ROLES)}",
                               f"messages[{mi}].role")
        for ti, call in enumerate(message.tool_calls or ()):
            if isinstance(call.function.arguments, str):
                # parsed into an object at planning (vLLM _postprocess_messages): bound it as a body
                param = f"messages[{mi}].tool_calls[{ti}].function.arguments"
                check_json_depth(call.function.arguments.encode(), param)


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs`` may not name what the renderer passes itself.

    vLLM ``resolve_chat_template_kwargs`` (``vllm/entrypoints/chat_utils.py``)
    refuses ``chat_template`` and ``tokenize``; ``messages``, ``tools``,
    ``documents``, ``add_generation_prompt`` would collide with the render
    call.  Keys naming the tokenizer's special tokens are refused at planning.

    Raises:
        GatewayError(INVALID_REQUEST): a reserved key (the key is not quoted).
    """
    if kwargs and not RESERVED_TEMPLATE_KWARGS.isdisjoint(kwargs):
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           "chat_template_kwargs may not set " + ", ".join(sorted(RESERVED_TEMPLATE_KWARGS)),
                           "chat_template_kwargs")


def _check_hints(req: ChatCompletionRequest) -> None:
    """Model-independent checks of per-item hints (the model's resize factor is checked at planning).

    Raises:
        GatewayError(INVALID_REQUEST): ``fps`` outside ``VIDEO_FPS_HINT_RANGE``,
            ``max_long_side_pixel`` not within 1 .. ``MAX_LONG_SIDE_HINT``, an ``input_audio.format``
            not in :data:`AUDIO_FORMATS`.
    """
    for mi, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for pi, part in enumerate(message.content):
            if isinstance(part, AudioPart):
                if part.input_audio.format.lower() not in AUDIO_FORMATS:
                    raise GatewayError(ErrorCode.INVALID_REQUEST, "input_audio.format must be one of "
                                       + ", ".join(AUDIO_FORMATS), f"messages[{mi}].content[{pi}].input_audio.format")
                continue
            if isinstance(part, ImagePart):
                fps, long_side, field = None, part.image_url.max_long_side_pixel, "image_url"
            elif isinstance(part, VideoPart):
                fps, long_side, field = part.video_url.fps, part.video_url.max_long_side_pixel, "video_url"
            else:
                continue
            param = f"messages[{mi}].content[{pi}].{field}"
            low, high = VIDEO_FPS_HINT_RANGE
            if fps is not None and not low <= fps <= high:
                raise GatewayError(ErrorCode.INVALID_REQUEST, f"fps must be within [{low}, {high}]", param + ".fps")
            if long_side is not None and not 0 < long_side <= MAX_LONG_SIDE_HINT:
                raise GatewayError(ErrorCode.INVALID_REQUEST,
                                   f"max_long_side_pixel must be a positive integer up to {MAX_LONG_SIDE_HINT}",
                                   param + ".max_long_side_pixel")


# ---- bounded parsing -------------------------------------------------------------------------

_KEEP_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_SCAN_CHUNK = 1 << 20


def check_json_depth(data: bytes, param: str | None = None, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON text nested more than ``limit`` levels deep, before any decoder recurses into it.

    A linear scan at C speed: escaped backslashes and quotes are removed
    (JSON escapes pair left to right), then every byte but ``"[]{}``; a
    bracket after an odd number of quotes is inside a string and is dropped;
    the nesting depth is the largest running sum of opens (+1) and closes
    (-1), computed with numpy in chunks of ``_SCAN_CHUNK`` bytes.  Bodies with
    at most ``limit`` brackets are not scanned.  Malformed JSON may be
    misjudged here; the decoder refuses it right after.

    Raises:
        GatewayError(INVALID_REQUEST): deeper than ``limit`` (``param`` as given).
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    skeleton = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, delete=_KEEP_STRUCTURE)
    quotes_before, depth = 0, 0
    for start in range(0, len(skeleton), _SCAN_CHUNK):
        chunk = np.frombuffer(skeleton, dtype=np.uint8, count=min(_SCAN_CHUNK, len(skeleton) - start), offset=start)
        is_quote = chunk == ord('"')
        parity = (np.cumsum(is_quote, dtype=np.int64) + quotes_before) & 1
        outside = (parity == 0) & ~is_quote
        step = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int64) * outside
        running = np.cumsum(step) + depth
        if running.size and int(running.max()) > limit:
            raise GatewayError(ErrorCode.INVALID_REQUEST, _TOO_DEEP if param is None else
                               f"value nested more than {limit} levels deep", param)
        quotes_before += int(is_quote.sum())
        depth = int(running[-1]) if running.size else depth


# ---- msgspec's messages without the caller's values --------------------------------------------

_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
#: msgspec message openings built from the schema and JSON type names only (never from values)
_SAFE_OPENINGS = ("Expected `", "Object missing required field `", "Number out of range")
#: msgspec's refusal of a field a ``forbid_unknown_fields`` struct does not declare
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.*)`", re.S)
#: a field name that may be echoed (names from the OpenAI / vLLM vocabulary look like this)
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _validation_message(text: str) -> tuple[str, str | None]:
    """(message, param) for a msgspec ``ValidationError`` text, without any caller value.

    msgspec names the JSON path (``... - at `$.messages[0].role```) and, for an
    invalid tag or enum, quotes the value (``Invalid value 'x'``); only the
    path and openings from :data:`_SAFE_OPENINGS` are kept.
    """
    match = _AT_PATH.search(text)
    path = match.group("path").lstrip(".") if match else ""
    what = text[: match.start()] if match else text
    unknown = _UNKNOWN_FIELD.fullmatch(what)
    if unknown is not None:
        # a field name is the schema's vocabulary, not a value: named when it looks like one
        name = unknown.group(1)
        if not _FIELD_NAME.fullmatch(name):
            return "invalid request: unknown field" + (f" at {path}" if path else ""), path or None
        param = f"{path}.{name}" if path else name
        return f"unknown field {param}: not a field of this API (refused, never ignored)", param
    if path.endswith(".type") and ".content[" in path:
        what = "unknown content part type (expected text, image_url, video_url, input_audio, audio_url or image_embeds)"
    elif not what.startswith(_SAFE_OPENINGS) or len(what) > 120:
        what = "invalid value"
    where = f" at {path}" if path else ""
    return f"invalid request{where}: {what}", path or None
