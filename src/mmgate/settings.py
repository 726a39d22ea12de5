"""Every gateway flag and its environment fallback, parsed once.

``parse_settings(argv, environ)`` returns a frozen :class:`Settings` that is
passed down explicitly; no other module reads the environment.  Precedence:
flag, then environment variable, then built-in default.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class ImageBackend(StrEnum):
    """Which transformers image-processor backend mmgate is exact to.

    ``torchvision``: the ``Qwen2VLImageProcessor`` class (transformers 5.24
    default whenever torchvision is importable); resizes with torch's uint8
    antialiased kernel, so mmgate needs the optional ``torch`` extra.
    ``pil``: the ``*ImageProcessorPil`` class; resizes with Pillow.
    ``auto``: ``torchvision`` when torch and torchvision import, else ``pil``.
    """

    AUTO = "auto"
    PIL = "pil"
    TORCHVISION = "torchvision"


ENV_MODEL_PATH = "MMGATE_MODEL_PATH"
ENV_IMAGE_BACKEND = "MMGATE_IMAGE_BACKEND"
ENV_IMAGE_MAX_BYTES = "SMG_IMAGE_MAX_INPUT_BYTES"
ENV_VIDEO_MAX_BYTES = "SMG_VIDEO_MAX_INPUT_BYTES"
ENV_AUDIO_MAX_BYTES = "SMG_AUDIO_MAX_INPUT_BYTES"
ENV_ALLOW_PRIVATE = "MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS"
ENV_VIDEO_APPLY_ROTATION = "MMGATE_VIDEO_APPLY_ROTATION"


DEFAULT_IMAGE_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_VIDEO_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_AUDIO_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970  # Pillow's own decompression-bomb error limit (2 x MAX_IMAGE_PIXELS)


@dataclass(frozen=True, slots=True)
class FetchSettings:
    """Limits of media intake: the fetcher (``mmgate.media.fetch``) and the image decoder
    (``mmgate.media.image``).  docs/media-intake.md describes each one."""

    allowed_domains: tuple[str, ...] = ()  # empty: any public host; else the host or a subdomain of an entry
    allow_private_hosts: bool = False  # loopback/private/link-local targets allowed (trusted setups, tests)
    connect_timeout_s: float = 5.0  # per connection attempt
    read_timeout_s: float = 10.0  # per read of the response (a stalled origin)
    total_timeout_s: float = 20.0  # whole fetch: every hop, headers and body (a slow drip)
    max_redirects: int = 3
    image_max_bytes: int = DEFAULT_IMAGE_MAX_BYTES
    video_max_bytes: int = DEFAULT_VIDEO_MAX_BYTES
    audio_max_bytes: int = DEFAULT_AUDIO_MAX_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # checked from the header, before any pixel is decoded
    image_apply_exif_orientation: bool = False  # False: as the reference processors (no EXIF transpose)

    def max_input_bytes(self, modality: str) -> int:
        """Byte cap of one item of ``modality`` (``"image"``, ``"video"``, ``"audio"``)."""
        caps = {"image": self.image_max_bytes, "video": self.video_max_bytes, "audio": self.audio_max_bytes}
        return caps[str(modality)]


DEFAULT_VIDEO_MAX_DECODED_PIXELS = 1 << 28  # ~0.8 GB of RGB frames per request
DEFAULT_VIDEO_DECODE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class VideoSettings:
    """Limits of video decoding (``mmgate.media.video``; docs/video.md, "Limits")."""

    max_decoded_pixels: int = DEFAULT_VIDEO_MAX_DECODED_PIXELS  # per request: sum of sampled frames x H x W
    decode_timeout_s: float = DEFAULT_VIDEO_DECODE_TIMEOUT_S  # per clip, wall clock
    apply_rotation: bool = True  # display-matrix rotation applied (upright, as ffmpeg/OpenCV); False: as the reference


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Limits of the HTTP server itself (``mmgate.api.server``; docs/limits.md, "HTTP connection")."""

    header_timeout_s: float = 10.0  # request line + headers, from connect (or the first byte after a response)
    body_idle_timeout_s: float = 30.0  # longest wait for the next chunk of a request body
    body_timeout_s: float = 120.0  # whole request body, from the first receive
    max_connections: int = 1024  # open connections; past it a request gets 503 server_busy


_HTTP_DEFAULTS = HttpSettings()


class TensorTransport(StrEnum):
    """How encoder tensors travel to a worker (per tensor)."""

    INLINE = "inline"  # bytes in the gRPC message
    SHM = "shm"  # POSIX shared memory for tensors >= shm_min_bytes
    AUTO = "auto"  # shm only when the worker's shm_namespace_id label equals ours


ENV_TENSOR_TRANSPORT = "SMG_MM_TENSOR_TRANSPORT"
ENV_SHM_MIN_BYTES = "SMG_MM_SHM_MIN_BYTES"
ENV_ENCODER_DTYPE = "MMGATE_MM_ENCODER_DTYPE"


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """Encoder-tensor transport, dtype, in-flight budget and pixel cache (issue 3)."""

    tensor_transport: TensorTransport = TensorTransport.INLINE
    shm_min_bytes: int = 65536
    encoder_dtype: str = "auto"  # auto (worker label multimodal_encoder_dtype, else float32) | float32 | bfloat16 | float16
    max_inflight_bytes: int | None = None  # None: unbounded
    budget_wait_s: float = 2.0  # how long a request waits for room before 429
    pixel_cache_bytes: int = 0  # 0: off


def _transport_settings(ns: argparse.Namespace, environ: Mapping[str, str]) -> TransportSettings:
    mode = ns.multimodal_tensor_transport or environ.get(ENV_TENSOR_TRANSPORT) or TensorTransport.INLINE.value
    try:
        transport = TensorTransport(mode)
    except ValueError:
        raise SystemExit(f"unreadable tensor transport {mode!r} (inline, shm or auto)") from None
    min_bytes = ns.multimodal_shm_min_bytes
    if min_bytes is None:
        try:
            min_bytes = int(environ.get(ENV_SHM_MIN_BYTES, "65536"))
        except ValueError:
            raise SystemExit(f"{ENV_SHM_MIN_BYTES} must be an integer") from None
    if min_bytes < 0:
        raise SystemExit("--multimodal-shm-min-bytes must be 0 or more")
    dtype = ns.multimodal_encoder_dtype or environ.get(ENV_ENCODER_DTYPE) or "auto"
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise SystemExit(f"unreadable encoder dtype {dtype!r}")
    budget = ns.multimodal_max_inflight_bytes
    if budget is not None and budget <= 0:
        raise SystemExit("--multimodal-max-inflight-bytes must be positive (leave it unset for no bound)")
    if ns.mm_pixel_cache_mb < 0:
        raise SystemExit("--mm-pixel-cache-mb must be 0 or more")
    return TransportSettings(tensor_transport=transport, shm_min_bytes=min_bytes, encoder_dtype=dtype,
                             max_inflight_bytes=budget, pixel_cache_bytes=int(ns.mm_pixel_cache_mb * 1024 * 1024))


class MmProcessing(StrEnum):
    """Where media is processed (docs/media-processing.md has the decision table).

    ``router``: always here, in the gateway.  ``worker``: forward media
    references to a worker that advertises a media processor (503 when none
    can take them).  ``auto``: worker when every registered worker of the model
    advertises one, else router.
    """

    ROUTER = "router"
    WORKER = "worker"
    AUTO = "auto"


ENV_MM_PROCESSING = "SMG_MM_PROCESSING"  # deprecated spelling of --mm-processing


def _mm_processing(flag: str | None, environ: Mapping[str, str]) -> MmProcessing:
    """``--mm-processing``, else the deprecated ``SMG_MM_PROCESSING`` (with a warning), else auto."""
    value = flag
    if value is None and environ.get(ENV_MM_PROCESSING):
        value = environ[ENV_MM_PROCESSING].strip().lower()
        logging.getLogger("mmgate.settings").warning(
            "%s is deprecated; use --mm-processing %s", ENV_MM_PROCESSING, value)
    try:
        return MmProcessing(value or MmProcessing.AUTO.value)
    except ValueError:
        raise SystemExit(f"unreadable mm processing mode {value!r} (router, worker or auto)") from None


@dataclass(frozen=True, slots=True)
class Settings:
    """Gateway settings (``mmgate serve``)."""

    model: str  # bundle folder, ``org/name`` on the search path or hub
    model_search_path: tuple[Path, ...] = ()
    served_model_name: str | None = None
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    image_backend: ImageBackend = ImageBackend.AUTO
    item_limits: Mapping[str, int] = field(default_factory=dict)  # per-modality overrides
    default_max_tokens: int = 64
    max_model_len: int = 0  # context length in tokens; 0: from the bundle's config (mmgate.pipeline.context_length)
    fetch: FetchSettings = field(default_factory=FetchSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    mm_processing: MmProcessing = MmProcessing.AUTO
    mm_processing_models: tuple[str, ...] | None = None  # opted in to worker-side processing; None: every model
    preprocess_threads: int = 0  # 0: os.cpu_count()
    max_request_body_bytes: int = 0  # 0: derived from the per-item byte caps (api.app.body_limit_for)
    log_level: str = "info"
    worker_health_interval_s: float = 5.0  # seconds between worker health probes (routing.workers.HealthPolicy)
    worker_health_timeout_s: float = 2.0  # deadline of one health probe RPC
    worker_unhealthy_after: int = 3  # consecutive failed probes (busy timeouts excluded) before a worker is unhealthy
    memory_trim_min_bytes: int = 8 * 1024 * 1024  # a request this large makes the idle gateway malloc_trim; 0: off
    malloc_mmap_threshold: int = 0  # bytes: fixed glibc M_MMAP_THRESHOLD; 0: glibc's dynamic default


def _env_bool(value: str | None) -> bool:
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


def split_search_path(value: str | None) -> tuple[Path, ...]:
    """Split an ``os.pathsep``-separated list of folders."""
    if not value:
        return ()
    return tuple(Path(p) for p in value.split(os.pathsep) if p)


def _byte_cap(flag: int | None, environ: Mapping[str, str], env_name: str, default: int) -> int:
    """A per-modality byte cap: the flag, else the environment variable, else ``default``."""
    value = flag
    if value is None and environ.get(env_name):
        try:
            value = int(environ[env_name])
        except ValueError:
            raise SystemExit(f"{env_name} must be an integer") from None
    if value is None:
        return default
    if value <= 0:
        raise SystemExit(f"{env_name} (or its flag) must be a positive number of bytes")
    return value


def _parse_limits(values: Sequence[str]) -> dict[str, int]:
    limits: dict[str, int] = {}
    for item in values:
        name, _, count = item.partition("=")
        if not count.isdigit():
            raise SystemExit(f"--mm-limit expects MODALITY=COUNT, got {item!r}")
        limits[name.strip()] = int(count)
    return limits


def _positive(value: float, flag: str) -> float:
    if value <= 0:
        raise SystemExit(f"{flag} must be positive")
    return value


def _mmap_threshold(value: int) -> int:
    if not 0 <= value <= 32 * 1024 * 1024:
        raise SystemExit("--malloc-mmap-threshold must be 0..33554432 bytes")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmgate serve", description="Run the mmgate OpenAI-compatible gateway.")
    p.add_argument("--model", required=True, help="model bundle: a folder, or org/name found on the model search path")
    p.add_argument("--model-path", default=None, help=f"search path of bundle folders (env {ENV_MODEL_PATH})")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--worker-urls", nargs="*", default=[], help="grpc://HOST:PORT of engine workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--image-backend", choices=[b.value for b in ImageBackend], default=None,
                   help=f"reference backend to be exact to (env {ENV_IMAGE_BACKEND}; default auto)")
    p.add_argument("--mm-limit", action="append", default=[], metavar="MODALITY=COUNT",
                   help="per-request item limit override, e.g. image=4")
    p.add_argument("--default-max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context length in tokens (prompt + completion); 0: the bundle's max_position_embeddings")
    p.add_argument("--mm-allowed-media-domains", nargs="*", default=[])
    p.add_argument("--mm-allow-private-media-hosts", action="store_true", default=None,
                   help=f"allow loopback/private media hosts (env {ENV_ALLOW_PRIVATE}); for trusted setups and tests")
    p.add_argument("--mm-fetch-timeout", type=float, default=20.0, help="total fetch timeout, seconds")
    p.add_argument("--mm-fetch-connect-timeout", type=float, default=5.0, help="connect timeout, seconds")
    p.add_argument("--mm-fetch-read-timeout", type=float, default=10.0, help="timeout of one read, seconds")
    p.add_argument("--mm-max-redirects", type=int, default=3, help="redirect hops a media fetch may follow")
    p.add_argument("--image-max-input-bytes", type=int, default=None, help=f"env {ENV_IMAGE_MAX_BYTES}")
    p.add_argument("--video-max-input-bytes", type=int, default=None, help=f"env {ENV_VIDEO_MAX_BYTES}")
    p.add_argument("--video-max-decoded-pixels", type=int, default=DEFAULT_VIDEO_MAX_DECODED_PIXELS,
                   help="per request: sampled video frames x height x width, checked before decoding")
    p.add_argument("--video-decode-timeout", type=float, default=DEFAULT_VIDEO_DECODE_TIMEOUT_S,
                   help="wall-clock limit of decoding one clip, seconds")
    p.add_argument("--video-apply-rotation", action=argparse.BooleanOptionalAction, default=None,
                   help=f"turn rotated clips upright by their display matrix, as ffmpeg/OpenCV (env "
                        f"{ENV_VIDEO_APPLY_ROTATION}; default on); --no-video-apply-rotation: the stored "
                        "orientation, as the transformers pyav loader")
    p.add_argument("--audio-max-input-bytes", type=int, default=None, help=f"env {ENV_AUDIO_MAX_BYTES}")
    p.add_argument("--mm-image-max-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="refuse images whose header declares more pixels (decompression bombs)")
    p.add_argument("--mm-image-apply-exif-orientation", action="store_true",
                   help="apply the EXIF orientation tag before preprocessing (the reference processors do not)")
    p.add_argument("--multimodal-tensor-transport", choices=[t.value for t in TensorTransport], default=None,
                   help=f"encoder tensor transport (env {ENV_TENSOR_TRANSPORT}; default inline)")
    p.add_argument("--multimodal-shm-min-bytes", type=int, default=None,
                   help=f"smallest tensor sent through shared memory (env {ENV_SHM_MIN_BYTES}; default 65536)")
    p.add_argument("--multimodal-encoder-dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help=f"wire dtype of float encoder inputs (env {ENV_ENCODER_DTYPE}); auto follows the worker label")
    p.add_argument("--multimodal-max-inflight-bytes", type=int, default=None,
                   help="bound on preprocessed bytes held for engines (unset: unbounded; 0 is refused)")
    p.add_argument("--mm-pixel-cache-mb", type=float, default=0.0, help="preprocessed-item LRU cache size (0: off)")
    p.add_argument("--mm-processing", choices=[m.value for m in MmProcessing], default=None,
                   help=f"where media is processed: router, worker or auto (default; env {ENV_MM_PROCESSING}, deprecated)")
    p.add_argument("--mm-processing-models", nargs="*", default=None, metavar="MODEL",
                   help="models opted in to worker-side processing (served or bundle name); unset: every model")
    p.add_argument("--max-request-body-bytes", type=int, default=0,
                   help="413 request_too_large past this body size (0: largest per-item cap in base64 + 1 MiB)")
    p.add_argument("--http-header-timeout", type=float, default=_HTTP_DEFAULTS.header_timeout_s,
                   help="seconds for a request's line and headers to arrive; past it 408 request_timeout and close")
    p.add_argument("--http-body-timeout", type=float, default=_HTTP_DEFAULTS.body_timeout_s,
                   help="seconds for a whole request body to arrive; past it 408 request_timeout and close")
    p.add_argument("--http-body-idle-timeout", type=float, default=_HTTP_DEFAULTS.body_idle_timeout_s,
                   help="seconds between two chunks of a request body; past it 408 request_timeout and close")
    p.add_argument("--max-connections", type=int, default=_HTTP_DEFAULTS.max_connections,
                   help="open HTTP connections served; a request on one past it gets 503 server_busy")
    p.add_argument("--preprocess-threads", type=int, default=0)
    p.add_argument("--worker-health-interval", type=float, default=5.0, help="seconds between worker health probes")
    p.add_argument("--worker-health-timeout", type=float, default=2.0, help="deadline of one health probe, seconds")
    p.add_argument("--worker-unhealthy-after", type=int, default=3,
                   help="consecutive failed probes before a worker is unhealthy (nothing listening: at once; "
                        "a timeout while the worker is busy does not count)")
    p.add_argument("--memory-trim-min-bytes", type=int, default=8 * 1024 * 1024,
                   help="after a request holding this many encoder bytes, malloc_trim once the gateway is idle (0: off)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=0,
                   help="fixed glibc M_MMAP_THRESHOLD in bytes, up to 32 MiB (0: glibc's dynamic default)")
    p.add_argument("--log-level", default="info")
    return p


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse ``mmgate serve`` arguments with environment fallbacks.

    Raises:
        SystemExit: an unreadable flag or environment value (start-up stops).
    """
    ns = build_parser().parse_args(list(argv))
    backend = ns.image_backend or environ.get(ENV_IMAGE_BACKEND) or ImageBackend.AUTO.value
    try:
        image_backend = ImageBackend(backend)
    except ValueError:
        raise SystemExit(f"unreadable image backend {backend!r}") from None
    allow_private = ns.mm_allow_private_media_hosts
    if allow_private is None:
        allow_private = _env_bool(environ.get(ENV_ALLOW_PRIVATE))
    fetch = FetchSettings(
        allowed_domains=tuple(d.strip().strip(".").lower() for d in ns.mm_allowed_media_domains if d.strip(". ")),
        allow_private_hosts=allow_private,
        connect_timeout_s=ns.mm_fetch_connect_timeout,
        read_timeout_s=ns.mm_fetch_read_timeout,
        total_timeout_s=ns.mm_fetch_timeout,
        max_redirects=ns.mm_max_redirects,
        image_max_bytes=_byte_cap(ns.image_max_input_bytes, environ, ENV_IMAGE_MAX_BYTES, DEFAULT_IMAGE_MAX_BYTES),
        video_max_bytes=_byte_cap(ns.video_max_input_bytes, environ, ENV_VIDEO_MAX_BYTES, DEFAULT_VIDEO_MAX_BYTES),
        audio_max_bytes=_byte_cap(ns.audio_max_input_bytes, environ, ENV_AUDIO_MAX_BYTES, DEFAULT_AUDIO_MAX_BYTES),
        max_image_pixels=ns.mm_image_max_pixels,
        image_apply_exif_orientation=ns.mm_image_apply_exif_orientation,
    )
    for name, value in (("fetch timeouts", min(fetch.connect_timeout_s, fetch.read_timeout_s, fetch.total_timeout_s)),
                        ("--mm-image-max-pixels", fetch.max_image_pixels)):
        if value <= 0:
            raise SystemExit(f"{name} must be positive")
    if fetch.max_redirects < 0:
        raise SystemExit("--mm-max-redirects must be 0 or more")
    apply_rotation = ns.video_apply_rotation
    if apply_rotation is None:
        apply_rotation = _env_bool(environ.get(ENV_VIDEO_APPLY_ROTATION, "1"))
    video = VideoSettings(max_decoded_pixels=ns.video_max_decoded_pixels, decode_timeout_s=ns.video_decode_timeout,
                          apply_rotation=apply_rotation)
    if video.max_decoded_pixels <= 0 or video.decode_timeout_s <= 0:
        raise SystemExit("--video-max-decoded-pixels and --video-decode-timeout must be positive")
    http = HttpSettings(header_timeout_s=ns.http_header_timeout, body_idle_timeout_s=ns.http_body_idle_timeout,
                        body_timeout_s=ns.http_body_timeout, max_connections=ns.max_connections)
    if min(http.header_timeout_s, http.body_idle_timeout_s, http.body_timeout_s, http.max_connections) <= 0:
        raise SystemExit("--http-*-timeout and --max-connections must be positive")
    return Settings(
        model=ns.model,
        model_search_path=split_search_path(ns.model_path or environ.get(ENV_MODEL_PATH)),
        served_model_name=ns.served_model_name,
        worker_urls=tuple(ns.worker_urls),
        host=ns.host,
        port=ns.port,
        image_backend=image_backend,
        item_limits=_parse_limits(ns.mm_limit),
        default_max_tokens=ns.default_max_tokens,
        max_model_len=max(0, ns.max_model_len),
        fetch=fetch,
        video=video,
        transport=_transport_settings(ns, environ),
        http=http,
        mm_processing=_mm_processing(ns.mm_processing, environ),
        mm_processing_models=None if ns.mm_processing_models is None else tuple(ns.mm_processing_models),
        preprocess_threads=ns.preprocess_threads,
        max_request_body_bytes=max(0, ns.max_request_body_bytes),
        log_level=ns.log_level,
        worker_health_interval_s=_positive(ns.worker_health_interval, "--worker-health-interval"),
        worker_health_timeout_s=_positive(ns.worker_health_timeout, "--worker-health-timeout"),
        worker_unhealthy_after=int(_positive(ns.worker_unhealthy_after, "--worker-unhealthy-after")),
        memory_trim_min_bytes=max(0, ns.memory_trim_min_bytes),
        malloc_mmap_threshold=_mmap_threshold(ns.malloc_mmap_threshold),
    )
