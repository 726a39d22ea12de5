"""The one error table.

Every failure the gateway, the reference engine or the sidecar reports to a
caller is a :class:`GatewayError` carrying an :class:`ErrorCode`.  The table
below maps each code to its HTTP status, whether a client may retry, and the
OpenAI error ``type``.  The HTTP layer (``mmgate.api.errors``) is the single
place that turns a ``GatewayError`` into a response body
``{"error": {"type", "code", "message", "param"}}`` plus the
``X-SMG-Error-Code`` header.

Invariants: messages never echo request payloads (no URL bodies, no base64);
the caller's mistakes are 4xx, transient upstream faults are retryable 503,
bugs are 500 ``internal_error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    """Stable, machine-readable error codes (the ``code`` field and header)."""

    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"  # no route for the path (the framework's 404; a model not served is MODEL_NOT_FOUND)
    METHOD_NOT_ALLOWED = "method_not_allowed"  # the route exists, not for this method (the answer has ``Allow``)
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"  # headers or body did not arrive in time (the connection is closed)
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # a POST body that is not Content-Type: application/json
    CLIENT_DISCONNECTED = "client_disconnected"  # the client left before its request was read; never delivered
    SERVER_BUSY = "server_busy"  # past --max-connections open connections
    INVALID_API_KEY = "invalid_api_key"  # a guarded path (docs/security.md) without the right key: missing or wrong
    ADMIN_API_DISABLED = "admin_api_disabled"  # the admin API while no --admin-api-key is set
    MODEL_NOT_FOUND = "model_not_found"
    WORKER_NOT_FOUND = "worker_not_found"  # admin API: no registered worker has this id
    WORKER_EXISTS = "worker_exists"  # admin API: a worker with this URL is registered already
    MULTIMODAL_NOT_SUPPORTED = "multimodal_not_supported"
    # media for an M-RoPE model whose only workers lose its media positions (SGLang wire; docs/engines-sglang.md)
    MROPE_MEDIA_NOT_SUPPORTED = "mrope_media_not_supported"
    MEDIA_COUNT_MISMATCH = "media_count_mismatch"
    MM_ITEM_LIMIT_EXCEEDED = "mm_item_limit_exceeded"
    UNSUPPORTED_MEDIA_URL_SCHEME = "unsupported_media_url_scheme"
    INVALID_MEDIA_URL = "invalid_media_url"
    MEDIA_HOST_NOT_ALLOWED = "media_host_not_allowed"
    MEDIA_DECODE_FAILED = "media_decode_failed"
    MEDIA_TOO_LARGE = "media_too_large"
    AUDIO_TOO_SHORT = "audio_too_short"  # fewer samples than the model's feature extractor can frame
    MEDIA_REF_TOO_LARGE = "media_ref_too_large"  # an inline data: URL forwarded to a worker exceeds the byte cap
    IMAGE_ASPECT_RATIO_INVALID = "image_aspect_ratio_invalid"
    # audio intake (mmgate.media.audio raises them; docs/media-intake.md "Audio")
    AUDIO_DECODE_FAILED = "audio_decode_failed"  # bytes PyAV cannot open or decode (corrupt, unknown container)
    AUDIO_NO_STREAM = "audio_no_stream"  # a container without an audio stream (a video-only file, an image)
    AUDIO_EMPTY = "audio_empty"  # an audio stream that decodes to zero samples
    AUDIO_TOO_LONG = "audio_too_long"  # a clip longer than --audio-max-duration (header, else decoded samples)
    AUDIO_DECODE_TIMEOUT = "audio_decode_timeout"  # one clip's decode ran past --audio-decode-timeout
    MEDIA_FETCH_FAILED = "media_fetch_failed"
    MEDIA_FETCH_TIMEOUT = "media_fetch_timeout"
    MEDIA_FETCH_UNAVAILABLE = "media_fetch_unavailable"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    RESERVED_TOKEN_IN_TEXT = "reserved_token_in_text"  # caller text holds a special/media token string
    # a structured-output constraint whose compile ran past the engine's deadline or memory cap, or crashed it
    CONSTRAINT_TOO_COMPLEX = "constraint_too_complex"
    MULTIMODAL_PAYLOAD_TOO_LARGE = "multimodal_payload_too_large"
    MULTIMODAL_INFLIGHT_BUDGET = "multimodal_inflight_budget"
    NO_HEALTHY_WORKER = "no_healthy_worker"
    # a language-model-only decode worker cannot serve this request (docs/disaggregation.md)
    PD_DECODE_LANGUAGE_MODEL_ONLY_MROPE = "pd_decode_language_model_only_mrope"
    PD_DECODE_LANGUAGE_MODEL_ONLY_MEDIA_REFS = "pd_decode_language_model_only_media_refs"
    PD_DECODE_LANGUAGE_MODEL_ONLY_N_SAMPLES = "pd_decode_language_model_only_n_samples"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    ENGINE_REJECTED = "engine_rejected"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """How one code is reported."""

    status: int  # HTTP status
    retryable: bool  # a client may retry the same request later
    type: str  # OpenAI ``error.type``


_INVALID = "invalid_request_error"
_SERVER = "server_error"

ERROR_TABLE: dict[ErrorCode, ErrorSpec] = {
    ErrorCode.INVALID_REQUEST: ErrorSpec(400, False, _INVALID),
    ErrorCode.NOT_FOUND: ErrorSpec(404, False, _INVALID),
    ErrorCode.METHOD_NOT_ALLOWED: ErrorSpec(405, False, _INVALID),
    ErrorCode.REQUEST_TOO_LARGE: ErrorSpec(413, False, _INVALID),
    ErrorCode.REQUEST_TIMEOUT: ErrorSpec(408, False, _INVALID),
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: ErrorSpec(415, False, _INVALID),
    ErrorCode.CLIENT_DISCONNECTED: ErrorSpec(499, False, _INVALID),  # nginx's "client closed request"
    ErrorCode.SERVER_BUSY: ErrorSpec(503, True, _SERVER),
    ErrorCode.INVALID_API_KEY: ErrorSpec(401, False, _INVALID),  # OpenAI's code and type for a bad key
    ErrorCode.ADMIN_API_DISABLED: ErrorSpec(403, False, _INVALID),
    ErrorCode.MODEL_NOT_FOUND: ErrorSpec(404, False, _INVALID),
    ErrorCode.WORKER_NOT_FOUND: ErrorSpec(404, False, _INVALID),
    ErrorCode.WORKER_EXISTS: ErrorSpec(409, False, _INVALID),
    ErrorCode.MULTIMODAL_NOT_SUPPORTED: ErrorSpec(400, False, _INVALID),
    ErrorCode.MROPE_MEDIA_NOT_SUPPORTED: ErrorSpec(400, False, _INVALID),
    ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_MROPE: ErrorSpec(400, False, _INVALID),
    ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_MEDIA_REFS: ErrorSpec(400, False, _INVALID),
    ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_N_SAMPLES: ErrorSpec(400, False, _INVALID),
    ErrorCode.MEDIA_COUNT_MISMATCH: ErrorSpec(400, False, _INVALID),
    ErrorCode.MM_ITEM_LIMIT_EXCEEDED: ErrorSpec(400, False, _INVALID),
    ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME: ErrorSpec(400, False, _INVALID),
    ErrorCode.INVALID_MEDIA_URL: ErrorSpec(400, False, _INVALID),
    ErrorCode.MEDIA_HOST_NOT_ALLOWED: ErrorSpec(400, False, _INVALID),
    ErrorCode.MEDIA_DECODE_FAILED: ErrorSpec(400, False, _INVALID),
    ErrorCode.MEDIA_TOO_LARGE: ErrorSpec(413, False, _INVALID),
    ErrorCode.AUDIO_TOO_SHORT: ErrorSpec(400, False, _INVALID),
    ErrorCode.MEDIA_REF_TOO_LARGE: ErrorSpec(400, False, _INVALID),
    ErrorCode.IMAGE_ASPECT_RATIO_INVALID: ErrorSpec(400, False, _INVALID),
    ErrorCode.AUDIO_DECODE_FAILED: ErrorSpec(400, False, _INVALID),
    ErrorCode.AUDIO_NO_STREAM: ErrorSpec(400, False, _INVALID),
    ErrorCode.AUDIO_EMPTY: ErrorSpec(400, False, _INVALID),
    ErrorCode.AUDIO_TOO_LONG: ErrorSpec(413, False, _INVALID),  # as video's decoded-pixel allowance (413)
    ErrorCode.AUDIO_DECODE_TIMEOUT: ErrorSpec(413, False, _INVALID),  # as video's decode deadline (413)
    ErrorCode.MEDIA_FETCH_FAILED: ErrorSpec(400, False, _INVALID),
    ErrorCode.MEDIA_FETCH_TIMEOUT: ErrorSpec(503, True, _SERVER),
    ErrorCode.MEDIA_FETCH_UNAVAILABLE: ErrorSpec(503, True, _SERVER),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ErrorSpec(400, False, _INVALID),
    ErrorCode.RESERVED_TOKEN_IN_TEXT: ErrorSpec(400, False, _INVALID),
    ErrorCode.CONSTRAINT_TOO_COMPLEX: ErrorSpec(400, False, _INVALID),
    ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE: ErrorSpec(413, False, _INVALID),
    ErrorCode.MULTIMODAL_INFLIGHT_BUDGET: ErrorSpec(429, True, _SERVER),
    ErrorCode.NO_HEALTHY_WORKER: ErrorSpec(503, True, _SERVER),
    ErrorCode.ENGINE_UNAVAILABLE: ErrorSpec(503, True, _SERVER),
    ErrorCode.ENGINE_REJECTED: ErrorSpec(400, False, _INVALID),
    ErrorCode.ENGINE_ERROR: ErrorSpec(502, False, _SERVER),
    ErrorCode.INTERNAL_ERROR: ErrorSpec(500, False, _SERVER),
}

assert set(ERROR_TABLE) == set(ErrorCode), "every ErrorCode needs a row"


class GatewayError(Exception):
    """A failure with a stable code.

    Args:
        code: the :class:`ErrorCode`.
        message: human-readable text; must not contain request payload bytes.
        param: the request field at fault (``"messages[0].content[1]"``), if any.
    """

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @property
    def spec(self) -> ErrorSpec:
        return ERROR_TABLE[self.code]

    @property
    def status(self) -> int:
        return self.spec.status

    def body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI-shaped error body."""
        return {
            "error": {
                "type": self.spec.type,
                "code": self.code.value,
                "message": self.message,
                "param": self.param,
            }
        }

    def __repr__(self) -> str:
        return f"GatewayError({self.code.value!r}, {self.message!r})"
