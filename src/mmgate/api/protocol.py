"""OpenAI chat-completion request shapes (msgspec structs).

Stage: api.  In: the raw JSON body; out: a validated
:class:`ChatCompletionRequest`.  Content parts are a tagged union on ``type``:
``text``, ``image_url``, ``video_url``, ``input_audio``; anything else is a
400 ``invalid_request``.  Unknown top-level fields are ignored, as vLLM and
SMG ignore them.
"""

from __future__ import annotations

from typing import Any

import msgspec

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


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
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
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat-completion body.

    Raises:
        GatewayError(INVALID_REQUEST): not JSON, or not the OpenAI shape (the
            message names the JSON path, never the payload).
    """
    try:
        req = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"invalid request: {_short(str(exc))}") from None
    except msgspec.DecodeError:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "request body is not valid JSON") from None
    if not req.messages:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "messages must not be empty", "messages")
    if req.n != 1:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "only n=1 is supported", "n")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "max_tokens must be at least 1", "max_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "temperature must be within [0, 2]", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "top_p must be within (0, 1]", "top_p")
    _check_hints(req)
    return req


def _check_hints(req: ChatCompletionRequest) -> None:
    """Model-independent checks of per-item hints (the model's resize factor is checked at planning).

    Raises:
        GatewayError(INVALID_REQUEST): ``fps`` outside ``VIDEO_FPS_HINT_RANGE``,
            ``max_long_side_pixel`` not positive.
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
            if long_side is not None and long_side <= 0:
                raise GatewayError(ErrorCode.INVALID_REQUEST, "max_long_side_pixel must be a positive integer",
                                   param + ".max_long_side_pixel")


def _short(text: str, limit: int = 160) -> str:
    """msgspec messages name the JSON path and expected type; keep them short."""
    return text if len(text) <= limit else text[:limit] + "..."
