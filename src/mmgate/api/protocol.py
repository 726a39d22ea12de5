"""OpenAI chat-completion request shapes (msgspec structs) and their value checks.

Stage: api.  In: the raw JSON body; out: a validated
:class:`ChatCompletionRequest`.  Content parts are a tagged union on ``type``:
``text``, ``image_url``, ``video_url``, ``input_audio``; anything else is a
400 ``invalid_request``.  Unknown top-level fields are ignored, as vLLM and
SMG ignore them (they are skipped, never built, but still count towards the
nesting bound).

Invariants: every value that reaches an engine fits its field on the wire
(``smg_grpc_proto`` ``vllm_engine.proto`` ``SamplingParams``) and the range
vLLM accepts; a refusal is a 400 ``invalid_request`` whose ``param`` names
the field and whose message never quotes the caller's value; parsing is
bounded: JSON nested deeper than :data:`MAX_JSON_DEPTH` is refused before it
is decoded.  The ranges are listed in ``docs/limits.md`` ("Request content").
"""

from __future__ import annotations

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


class InputAudio(msgspec.Struct, frozen=True):
    data: str
    format: str = "wav"


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag_field="type", tag="image_url"):
    image_url: ImageURL


class VideoPart(msgspec.Struct, frozen=True, tag_field="type", tag="video_url"):
    video_url: VideoURL


class AudioPart(msgspec.Struct, frozen=True, tag_field="type", tag="input_audio"):
    input_audio: InputAudio


ContentPart = TextPart | ImagePart | VideoPart | AudioPart


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


class ChatCompletionRequest(msgspec.Struct, frozen=True):
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
#: ``chat_template_kwargs`` keys that name what the renderer passes itself (vLLM refuses
#: ``chat_template`` and ``tokenize``; the others would collide with the render call)
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                      "chat_template", "tokenize", "conversation"})

_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat-completion body.

    Returns the request with ``top_k`` normalized: ``-1`` (vLLM's "disabled",
    as vLLM users write it) and ``0`` both become ``0``, the wire's "off".

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
    _check_sampling(req)
    _check_messages(req)
    _check_template_kwargs(req.chat_template_kwargs)
    _check_hints(req)
    if req.top_k == -1:
        req = msgspec.structs.replace(req, top_k=0)
    return req


_TOO_DEEP = f"request JSON is nested more than {MAX_JSON_DEPTH} levels deep"


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
    if req.n != 1:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "only n=1 is supported", "n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    for i, stop in enumerate(stops):
        param = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"a stop string must have 1 to {MAX_STOP_CHARS} characters", param)


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
            ``max_long_side_pixel`` not within 1 .. ``MAX_LONG_SIDE_HINT``.
    """
    for mi, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for pi, part in enumerate(message.content):
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


def _validation_message(text: str) -> tuple[str, str | None]:
    """(message, param) for a msgspec ``ValidationError`` text, without any caller value.

    msgspec names the JSON path (``... - at `$.messages[0].role```) and, for an
    invalid tag or enum, quotes the value (``Invalid value 'x'``); only the
    path and openings from :data:`_SAFE_OPENINGS` are kept.
    """
    match = _AT_PATH.search(text)
    path = match.group("path").lstrip(".") if match else ""
    what = text[: match.start()] if match else text
    if path.endswith(".type") and ".content[" in path:
        what = "unknown content part type (expected text, image_url, video_url or input_audio)"
    elif not what.startswith(_SAFE_OPENINGS) or len(what) > 120:
        what = "invalid value"
    where = f" at {path}" if path else ""
    return f"invalid request{where}: {what}", path or None
