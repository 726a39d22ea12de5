"""Every gateway flag and its environment fallback, parsed once.

``parse_settings(argv, environ)`` returns a frozen :class:`Settings` that is
passed down explicitly; no other module reads the environment.  Precedence:
flag, then environment variable, then built-in default (:mod:`mmgate.config.options`
resolves it; a deprecated variable warns once, an unreadable one stops start-up).

The media-intake and video option groups (:func:`add_media_options`,
:func:`add_video_options`) are defined here once and used by ``mmgate engine``
and ``mmgate sidecar`` as well (:mod:`mmgate.sidecar.config`).  ``--help``
groups every option by topic; docs/configuration.md is rendered from these
definitions (:mod:`mmgate.config.docs`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from mmgate.config.auth import AuthSettings, add_auth_options, auth_settings
from mmgate.config.cores import AUTO, auto_workers, count_or_auto
from mmgate.config.options import add_option, resolve
from mmgate.models.backend import FrameSampling, ImageBackend


ENV_MODEL_PATH = "MMGATE_MODEL_PATH"
ENV_WORKERS = "MMGATE_WORKERS"  # --workers: gateway processes serving the port
ENV_IMAGE_BACKEND = "MMGATE_IMAGE_BACKEND"
ENV_IMAGE_MAX_BYTES = "SMG_IMAGE_MAX_INPUT_BYTES"
ENV_VIDEO_MAX_BYTES = "SMG_VIDEO_MAX_INPUT_BYTES"
ENV_AUDIO_MAX_BYTES = "SMG_AUDIO_MAX_INPUT_BYTES"
ENV_ALLOW_PRIVATE = "MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS"
ENV_VIDEO_APPLY_ROTATION = "MMGATE_VIDEO_APPLY_ROTATION"
ENV_VIDEO_FRAME_SAMPLING = "MMGATE_VIDEO_FRAME_SAMPLING"
ENV_VIDEO_DECODE_TIMEOUT = "SMG_VIDEO_PROCESS_TIMEOUT_SECS"  # SMG: timeout of one ffmpeg video decode
ENV_MAX_COUNT = {"image": "SMG_IMAGE_MAX_COUNT", "video": "SMG_VIDEO_MAX_COUNT", "audio": "SMG_AUDIO_MAX_COUNT"}


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
    frame_sampling: FrameSampling = FrameSampling.VLLM  # frames kept where the bundle does not say (FrameSampling)


DEFAULT_AUDIO_MAX_DURATION_S = 600.0  # ten minutes of audio per clip
DEFAULT_AUDIO_DECODE_TIMEOUT_S = 30.0  # as video's


@dataclass(frozen=True, slots=True)
class AudioSettings:
    """Limits of audio decoding (the audio source's decoder, ``mmgate.media.audio``; docs/media-intake.md,
    "Audio").  The byte cap is :attr:`FetchSettings.audio_max_bytes` (``--audio-max-input-bytes``)."""

    max_duration_s: float = DEFAULT_AUDIO_MAX_DURATION_S  # per clip: longer is refused (413 ``audio_too_long``)
    decode_timeout_s: float = DEFAULT_AUDIO_DECODE_TIMEOUT_S  # per clip, wall clock (413 ``audio_decode_timeout``)
    #: a request's clips padded to the longest as the reference processor's one extractor call does (Qwen3-Omni:
    #: :class:`~mmgate.models.family.BatchPlanner`); False: each clip's features as alone
    batch_padding: bool = True


GROUP_MEDIA = "media intake"
GROUP_VIDEO = "video"
GROUP_AUDIO = "audio"


def add_media_options(parser: argparse.ArgumentParser) -> None:
    """The media-intake option group: one definition for ``mmgate serve``, ``engine`` and ``sidecar``.

    Reference image backend, per-request item limits, fetch policy and limits,
    per-modality byte caps and image decoding (docs/media-intake.md).  Read back,
    after :func:`mmgate.config.options.resolve`, with :func:`fetch_settings`,
    :func:`item_limits` and ``ImageBackend(ns.image_backend)``.
    """
    g = parser.add_argument_group(GROUP_MEDIA)
    add_option(g, "--image-backend", choices=[b.value for b in ImageBackend], default=ImageBackend.AUTO.value,
               env=(ENV_IMAGE_BACKEND,),
               help="transformers image-processor backend to be exact to (auto: torchvision, transformers' default; no torch needed)")
    add_option(g, "--mm-limit", action="append", default=[], metavar="MODALITY=COUNT",
               env_doc=tuple(ENV_MAX_COUNT.values()),
               help="per-request item limit override, e.g. image=4; repeat per modality")
    add_option(g, "--mm-per-request-image-limit", type=int, default=None, minimum=1, metavar="COUNT",
               help="per-request image limit for every model (as smg; --mm-limit image=N wins)")
    add_option(g, "--mm-allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
               help="fetch allow-list: a host or a subdomain of an entry (empty: any public host)")
    add_option(g, "--mm-allow-private-media-hosts", action="store_true", default=False, env=(ENV_ALLOW_PRIVATE,),
               help="allow loopback/private/link-local media hosts (trusted setups and tests)")
    add_option(g, "--mm-fetch-timeout", type=float, default=20.0,
               help="whole media fetch (every hop, headers and body), seconds")
    add_option(g, "--mm-fetch-connect-timeout", type=float, default=5.0, help="one connection attempt, seconds")
    add_option(g, "--mm-fetch-read-timeout", type=float, default=10.0, help="one read of a media response, seconds")
    add_option(g, "--mm-max-redirects", type=int, default=3, minimum=0, help="redirect hops a media fetch may follow")
    for modality, env, cap in (("image", ENV_IMAGE_MAX_BYTES, DEFAULT_IMAGE_MAX_BYTES),
                               ("video", ENV_VIDEO_MAX_BYTES, DEFAULT_VIDEO_MAX_BYTES),
                               ("audio", ENV_AUDIO_MAX_BYTES, DEFAULT_AUDIO_MAX_BYTES)):
        add_option(g, f"--{modality}-max-input-bytes", type=int, default=cap, env=(env,), minimum=1,
                   help=f"largest {modality} item in bytes, fetched or data: URL")
    add_option(g, "--mm-image-max-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, minimum=1,
               help="refuse images whose header declares more pixels (decompression bombs)")
    add_option(g, "--mm-image-apply-exif-orientation", action="store_true", default=False,
               help="apply the EXIF orientation tag before preprocessing (the reference processors do not)")


def fetch_settings(ns: argparse.Namespace) -> FetchSettings:
    """The :class:`FetchSettings` of a namespace parsed with :func:`add_media_options` and resolved.

    Raises:
        SystemExit: a fetch timeout that is not positive.
    """
    fetch = FetchSettings(
        allowed_domains=tuple(d.strip().strip(".").lower() for d in ns.mm_allowed_media_domains if d.strip(". ")),
        allow_private_hosts=bool(ns.mm_allow_private_media_hosts),
        connect_timeout_s=ns.mm_fetch_connect_timeout, read_timeout_s=ns.mm_fetch_read_timeout,
        total_timeout_s=ns.mm_fetch_timeout, max_redirects=ns.mm_max_redirects,
        image_max_bytes=ns.image_max_input_bytes, video_max_bytes=ns.video_max_input_bytes,
        audio_max_bytes=ns.audio_max_input_bytes, max_image_pixels=ns.mm_image_max_pixels,
        image_apply_exif_orientation=bool(ns.mm_image_apply_exif_orientation),
    )
    if min(fetch.connect_timeout_s, fetch.read_timeout_s, fetch.total_timeout_s) <= 0:
        raise SystemExit("--mm-fetch-timeout, --mm-fetch-connect-timeout and --mm-fetch-read-timeout must be positive")
    return fetch


def item_limits(ns: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, int]:
    """Per-modality item limits: ``--mm-limit``, else ``--mm-per-request-image-limit`` (images),
    else ``SMG_IMAGE_MAX_COUNT`` / ``SMG_VIDEO_MAX_COUNT`` / ``SMG_AUDIO_MAX_COUNT`` (as smg reads them).

    Raises:
        SystemExit: an unreadable count (the message names the flag or the variable).
    """
    limits: dict[str, int] = {}
    for modality, name in ENV_MAX_COUNT.items():
        raw = environ.get(name, "").strip()
        if raw:
            if not raw.isdigit():
                raise SystemExit(f"unreadable {name}={raw!r}: expected a count (0 or more)")
            limits[modality] = int(raw)
    if ns.mm_per_request_image_limit is not None:
        limits["image"] = ns.mm_per_request_image_limit
    limits.update(_parse_limits(ns.mm_limit))
    return limits


def add_video_options(parser: argparse.ArgumentParser) -> None:
    """The video-decode option group, one definition for ``mmgate serve``, ``engine`` and ``sidecar``
    (docs/video.md, "Limits"); read back with :func:`video_settings`."""
    g = parser.add_argument_group(GROUP_VIDEO)
    add_option(g, "--video-max-decoded-pixels", type=int, default=DEFAULT_VIDEO_MAX_DECODED_PIXELS, minimum=1,
               help="per request: sampled video frames x height x width, checked before decoding")
    add_option(g, "--video-decode-timeout", type=float, default=DEFAULT_VIDEO_DECODE_TIMEOUT_S,
               env=(ENV_VIDEO_DECODE_TIMEOUT,), help="wall-clock limit of decoding one clip, seconds")
    add_option(g, "--video-apply-rotation", action=argparse.BooleanOptionalAction, default=True,
               env=(ENV_VIDEO_APPLY_ROTATION,),
               help="turn rotated clips upright by their display matrix, as ffmpeg/OpenCV; "
                    "--no-video-apply-rotation: the stored orientation, as the transformers pyav loader")
    add_option(g, "--video-frame-sampling", choices=[m.value for m in FrameSampling],
               default=FrameSampling.VLLM.value, env=(ENV_VIDEO_FRAME_SAMPLING,),
               help="frames kept of a clip whose bundle does not set do_sample_frames: vllm = as a vLLM worker "
                    "(Qwen2-VL / Qwen2.5-VL at 2 fps), transformers = the processor's default (Qwen2-VL / "
                    "Qwen2.5-VL: every frame); docs/video.md")


def video_settings(ns: argparse.Namespace) -> VideoSettings:
    """The :class:`VideoSettings` of a namespace parsed with :func:`add_video_options` and resolved.

    Raises:
        SystemExit: a decode timeout that is not positive.
    """
    if ns.video_decode_timeout <= 0:
        raise SystemExit("--video-decode-timeout must be positive")
    return VideoSettings(max_decoded_pixels=ns.video_max_decoded_pixels, decode_timeout_s=ns.video_decode_timeout,
                         apply_rotation=bool(ns.video_apply_rotation),
                         frame_sampling=FrameSampling(ns.video_frame_sampling))


def add_audio_options(parser: argparse.ArgumentParser) -> None:
    """The audio-decode option group, one definition for ``mmgate serve``, ``engine`` and ``sidecar``
    (docs/media-intake.md, "Audio"); read back with :func:`audio_settings`.  Named as the video group's."""
    g = parser.add_argument_group(GROUP_AUDIO)
    add_option(g, "--audio-max-duration", type=float, default=DEFAULT_AUDIO_MAX_DURATION_S,
               help="longest audio clip in seconds (from the header where it says, else from the decoded samples)")
    add_option(g, "--audio-decode-timeout", type=float, default=DEFAULT_AUDIO_DECODE_TIMEOUT_S,
               help="wall-clock limit of decoding (and resampling) one audio clip, seconds")
    add_option(g, "--audio-batch-padding", action=argparse.BooleanOptionalAction, default=True,
               help="a request's clips padded to its longest, as the reference processor's one feature-extractor "
                    "call (Qwen3-Omni: shorter clips get ceil(n/hop) frames, zeros after their end); "
                    "--no-audio-batch-padding: each clip as alone, floor(n/hop) frames (docs/parity.md, Audio)")


def audio_settings(ns: argparse.Namespace) -> AudioSettings:
    """The :class:`AudioSettings` of a namespace parsed with :func:`add_audio_options` and resolved.

    Raises:
        SystemExit: a duration cap or decode timeout that is not positive.
    """
    if ns.audio_max_duration <= 0:
        raise SystemExit("--audio-max-duration must be positive")
    if ns.audio_decode_timeout <= 0:
        raise SystemExit("--audio-decode-timeout must be positive")
    return AudioSettings(max_duration_s=ns.audio_max_duration, decode_timeout_s=ns.audio_decode_timeout,
                         batch_padding=bool(ns.audio_batch_padding))


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Limits of the HTTP server itself (``mmgate.api.server``; docs/limits.md, "HTTP connection")."""

    header_timeout_s: float = 10.0  # request line + headers, from connect (or the first byte after a response)
    body_idle_timeout_s: float = 30.0  # longest wait for the next chunk of a request body
    body_timeout_s: float = 120.0  # whole request body, from the first receive
    max_connections: int = 1024  # open connections; past it a request gets 503 server_busy
    loop: str = "asyncio"  # the event loop: asyncio or uvloop (HTTP_LOOPS; docs/performance.md, "Event loop")
    parser: str = "h11"  # the HTTP/1.1 parser: h11 or httptools (HTTP_PARSERS), both with the guards above


_HTTP_DEFAULTS = HttpSettings()
#: ``--http-loop`` / ``--http-parser`` choices (mmgate.api.server falls back to asyncio / h11 when the library is absent)
HTTP_LOOPS = ("asyncio", "uvloop")
HTTP_PARSERS = ("h11", "httptools")


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    """Bounds on one structured-output or tool-choice constraint, checked by the gateway before anything is
    sent (:mod:`mmgate.request.constraint_limits`; docs/limits.md, "Structured outputs and tools").

    Each bound is a property of the constraint's shape that xgrammar's compile time or stack depth grows
    with (measured in docs/limits.md), so a request that could freeze or crash a worker is refused with a
    400 naming the field and the limit, and nothing is ever compiled in the gateway.
    """

    max_chars: int = 128 * 1024  # characters of the constraint's text: schema JSON, regex, grammar, tag, choices
    max_depth: int = 64  # JSON nesting of a schema or structural tag, given as an object or as its JSON text
    max_schema_nodes: int = 8192  # JSON objects in a schema (every subschema, property and definition)
    max_values: int = 1024  # choices, or enum / const values across a schema
    max_optional_weight: int = 65536  # sum over a schema's objects of (optional properties)**2
    max_regex_depth: int = 64  # nested groups in a regex (a schema pattern, guided_regex) or grammar
    max_regex_repeat: int = 4096  # atoms a regex's counted repetitions add: [a-z]{1000} adds 999


_CONSTRAINT_DEFAULTS = ConstraintLimits()
#: the deepest JSON nesting ``--constraint-max-depth`` may allow (the JSON decoder recurses per level)
CONSTRAINT_DEPTH_CEILING = 512


#: the routing policies (``--policy``; :mod:`mmgate.routing.policies`), SMG's ``--policy`` choices that mmgate has
POLICIES = ("random", "round_robin", "least_load", "power_of_two", "consistent_hashing", "prefix_hash", "cache_aware")


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """How workers are chosen (docs/routing.md).  Flag names, aliases and defaults are the Rust gateway's
    ``smg launch`` ones as of smg 1.13.0 (PyPI; ``smg launch --help``, "Routing Policy"); SMG's GetLoads poll
    is ``--load-monitor-interval`` there (10 s), ``--load-check-interval`` (5 s) here.

    ``prefill_policy`` / ``decode_policy``: the PD legs' policies (None: ``policy``).
    """

    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 67108864
    block_size: int = 16
    prefix_token_count: int = 256
    prefix_hash_load_factor: float = 1.25
    prefix_hash_balance_abs_threshold: int = 10
    load_check_interval_s: float = 5.0
    least_load_kv_pressure_weight: float = 0.15
    least_load_default_throughput: float = 2000.0
    least_load_mean_prefill_tokens: int = 1024
    least_load_max_waiting_requests: int = 0


@dataclass(frozen=True, slots=True)
class KeepaliveSettings:
    """HTTP/2 keepalive of the gateway's engine channels (:func:`mmgate.engines.client.channel_options`;
    docs/engines.md, "Liveness").

    A connection that carried nothing for ``interval_s`` seconds is pinged; a ping not acknowledged within
    ``timeout_s`` seconds closes the connection and fails every call on it (``UNAVAILABLE``: 503
    ``engine_unavailable``), so an engine that goes silent without closing (a frozen process, a partition)
    ends its requests within about ``interval_s + timeout_s`` seconds.  The defaults are SMG's engine channel
    profile (lightseekorg/smg ``crates/grpc_client/src/channel.rs`` ``connect_channel``:
    ``http2_keep_alive_interval(30 s)``, ``keep_alive_timeout(10 s)``, ``keep_alive_while_idle(true)``).
    """

    interval_s: float = 30.0
    timeout_s: float = 10.0


_KEEPALIVE_DEFAULTS = KeepaliveSettings()


@dataclass(frozen=True, slots=True)
class BundleLimits:
    """Bounds on a bundle fetched from a worker (``GetTokenizer``; :mod:`mmgate.routing.bundles`;
    docs/engines.md, "Bundles from the workers").

    The Rust gateway's bounds where it has them (lightseekorg/smg ``crates/grpc_client/src/tokenizer_bundle.rs``:
    ``MAX_STREAM_BUNDLE_SIZE`` 200 MiB, ``MAX_ZIP_ENTRIES`` 50, ``MAX_UNCOMPRESSED_SIZE`` 500 MiB; ``lib.rs``
    ``impl_get_tokenizer``: 120 s for the call and the stream); SMG has no per-file bound: 256 MiB here,
    eight times the largest tokenizer file of the shared bundles (Gemma 3's 33 MB ``tokenizer.json``).
    """

    timeout_s: float = 120.0  # the whole GetTokenizer call: connect, every chunk, the end
    max_archive_bytes: int = 200 * 1024 * 1024  # the archive as streamed (compressed)
    max_members: int = 50  # files and folders in the archive
    max_member_bytes: int = 256 * 1024 * 1024  # one file, uncompressed
    max_unpacked_bytes: int = 500 * 1024 * 1024  # every file together, uncompressed


_BUNDLE_DEFAULTS = BundleLimits()
ENV_BUNDLE_CACHE_DIR = "MMGATE_BUNDLE_CACHE_DIR"


def default_bundle_cache_dir(environ: Mapping[str, str]) -> Path:
    """Where fetched bundles are kept when ``--worker-bundle-cache-dir`` is not given:
    ``$XDG_CACHE_HOME/mmgate/bundles``, else ``$HOME/.cache/mmgate/bundles`` (the XDG base directory rule
    Hugging Face and vLLM caches follow), else ``./.cache/mmgate/bundles``."""
    root = environ.get("XDG_CACHE_HOME") or (str(Path(environ["HOME"]) / ".cache") if environ.get("HOME") else ".cache")
    return Path(root) / "mmgate" / "bundles"


class TensorTransport(StrEnum):
    """How encoder tensors travel to a worker (per tensor)."""

    INLINE = "inline"  # bytes in the gRPC message
    SHM = "shm"  # POSIX shared memory for tensors >= shm_min_bytes
    AUTO = "auto"  # shm only when the worker's shm_namespace_id label equals ours


ENV_TENSOR_TRANSPORT = "SMG_MM_TENSOR_TRANSPORT"
ENV_SHM_MIN_BYTES = "SMG_MM_SHM_MIN_BYTES"
ENV_ENCODER_DTYPE = "MMGATE_MM_ENCODER_DTYPE"
ENV_TENSOR_TRANSPORT_LEGACY = "SMG_TOKENSPEED_MM_TENSOR_TRANSPORT"  # smg's legacy spelling (deprecated there too)
ENV_SHM_MIN_BYTES_LEGACY = "SMG_TOKENSPEED_MM_SHM_MIN_BYTES"
ENV_VLLM_ENCODER_DTYPE = "SMG_VLLM_ENCODER_INPUT_DTYPE"  # smg: wire dtype of encoder inputs sent to vLLM workers
ENV_PIXEL_CACHE_MB = "SMG_MM_PIXEL_CACHE_MB"  # deprecated in smg (replaced by --mm-pixel-cache-mb)
ENCODER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """Encoder-tensor transport, dtype, in-flight budget and pixel cache (issue 3)."""

    tensor_transport: TensorTransport = TensorTransport.INLINE
    shm_min_bytes: int = 65536
    encoder_dtype: str = "auto"  # auto (worker label multimodal_encoder_dtype, else float32) | float32 | bfloat16 | float16
    max_inflight_bytes: int | None = None  # None: unbounded
    budget_wait_s: float = 2.0  # how long a request waits for room before 429
    pixel_cache_bytes: int = 0  # 0: off
    #: a request at least this large has its pages given back once grpc has copied it for sending (0: never)
    release_sent_min_bytes: int = 32 * 1024 * 1024
    #: TokenSpeed workers: (modality, encoder dtype) pairs from SMG's environment overrides
    #: (:func:`tokenspeed_encoder_dtypes`), ahead of ``encoder_dtype`` and the worker's label
    tokenspeed_encoder_dtypes: tuple[tuple[str, str], ...] = ()


#: SMG's TokenSpeed encoder-input dtype overrides (``transport.rs`` ``mm_modality_encoder_input_dtype_from_env``,
#: ``mm_default_encoder_input_dtype_from_env``): per modality first, then the TokenSpeed-wide one
ENV_TOKENSPEED_ENCODER_DTYPE = "SMG_TOKENSPEED_ENCODER_INPUT_DTYPE"
ENV_TOKENSPEED_MODALITY_ENCODER_DTYPE = (("image", "SMG_TOKENSPEED_IMAGE_ENCODER_INPUT_DTYPE"),
                                         ("video", "SMG_TOKENSPEED_VIDEO_ENCODER_INPUT_DTYPE"),
                                         ("audio", "SMG_TOKENSPEED_AUDIO_ENCODER_INPUT_DTYPE"))


def tokenspeed_encoder_dtypes(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The per-modality encoder-input dtypes for TokenSpeed workers set in ``environ``: (modality, dtype) pairs.

    SMG's precedence (``transport.rs`` ``resolve_mm_encoder_input_dtype``): the modality's variable, then
    ``SMG_TOKENSPEED_ENCODER_INPUT_DTYPE``, then the worker's ``multimodal_encoder_dtype`` label (or an explicit
    ``--multimodal-encoder-dtype``, which mmgate puts in the label's place).  A ``torch.`` prefix is accepted.

    Raises:
        ValueError: a value that is not float32, bfloat16 or float16 (names the variable).
    """
    def read(name: str) -> str | None:
        raw = environ.get(name, "").strip().removeprefix("torch.")
        if not raw:
            return None
        if raw not in ENCODER_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, not {raw!r}")
        return raw

    default = read(ENV_TOKENSPEED_ENCODER_DTYPE)
    return tuple((modality, value) for modality, name in ENV_TOKENSPEED_MODALITY_ENCODER_DTYPE
                 if (value := read(name) or default) is not None)


def _transport_settings(ns: argparse.Namespace, environ: Mapping[str, str]) -> TransportSettings:
    """The :class:`TransportSettings` of a resolved ``mmgate serve`` namespace (bounds checked by
    :func:`mmgate.config.options.resolve`) and the environment's TokenSpeed dtype overrides.

    Raises:
        SystemExit: an unreadable TokenSpeed dtype override.
    """
    try:
        tokenspeed = tokenspeed_encoder_dtypes(environ)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return TransportSettings(tensor_transport=TensorTransport(ns.multimodal_tensor_transport),
                             shm_min_bytes=ns.multimodal_shm_min_bytes, encoder_dtype=ns.multimodal_encoder_dtype,
                             max_inflight_bytes=ns.multimodal_max_inflight_bytes,
                             pixel_cache_bytes=int(ns.mm_pixel_cache_mb * 1024 * 1024),
                             release_sent_min_bytes=ns.multimodal_release_sent_min_bytes,
                             tokenspeed_encoder_dtypes=tokenspeed)


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


ENV_LOG_MM_TIMING = "SMG_LOG_MM_TIMING"  # deprecated spelling of --log-mm-timing


@dataclass(frozen=True, slots=True)
class Settings:
    """Gateway settings (``mmgate serve``)."""

    #: bundle folder, ``org/name`` on the search path or hub; None: each worker's model (GetModelInfo), its bundle
    #: from the search path or the worker (mmgate.gateway.state)
    model: str | None
    model_search_path: tuple[Path, ...] = ()
    served_model_name: str | None = None
    worker_urls: tuple[str, ...] = ()
    #: prefill/decode disaggregation (``--pd-disaggregation``; docs/disaggregation.md)
    pd_disaggregation: bool = False
    #: ``--prefill URL [BOOTSTRAP_PORT]``: (url, bootstrap port or None: the one the worker reports)
    prefill_workers: tuple[tuple[str, int | None], ...] = ()
    decode_workers: tuple[str, ...] = ()  # ``--decode URL``
    #: encode disaggregation (``--epd-disaggregation``, TokenSpeed wire): ``--encode URL [BOOTSTRAP_PORT]``
    epd_disaggregation: bool = False
    encode_workers: tuple[tuple[str, int | None], ...] = ()
    encode_policy: str = "consistent_hashing"  # consistent_hashing | round_robin | random
    routing: RoutingSettings = field(default_factory=RoutingSettings)  # --policy and its knobs
    host: str = "127.0.0.1"
    port: int = 30000
    #: ``--workers``: gateway processes serving the port (:mod:`mmgate.api.multiproc`); 1: this process alone
    processes: int = 1
    image_backend: ImageBackend = ImageBackend.AUTO
    item_limits: Mapping[str, int] = field(default_factory=dict)  # per-modality overrides
    default_max_tokens: int = 64
    max_model_len: int = 0  # context length in tokens; 0: from the bundle's config (mmgate.pipeline.prepare.context_length)
    #: how string message content reaches the chat template: ``auto`` (vLLM's detection), ``string``, ``openai``
    chat_template_content_format: str = "auto"
    fetch: FetchSettings = field(default_factory=FetchSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    audio: AudioSettings = field(default_factory=AudioSettings)  # audio decode limits
    transport: TransportSettings = field(default_factory=TransportSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)  # --api-key, --admin-api-key, --protect-ops
    constraints: ConstraintLimits = field(default_factory=ConstraintLimits)  # structured outputs and tools
    mm_processing: MmProcessing = MmProcessing.AUTO
    mm_processing_models: tuple[str, ...] | None = None  # opted in to worker-side processing; None: every model
    #: ``--sglang-allow-mrope-media``: send media of M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) to SGLang
    #: workers although they position it as text (docs/engines-sglang.md); off: refused before any fetch
    sglang_allow_mrope_media: bool = False
    preprocess_threads: int = 0  # 0: os.cpu_count()
    max_request_body_bytes: int = 0  # 0: derived from the per-item byte caps (api.app.body_limit_for)
    log_level: str = "info"
    log_mm_timing: bool = False  # one smg_mm_timing INFO line per media request (mmgate.observe.timing_log)
    worker_health_interval_s: float = 5.0  # seconds between worker health probes (routing.workers.HealthPolicy)
    worker_health_timeout_s: float = 2.0  # deadline of one health probe RPC
    worker_unhealthy_after: int = 3  # consecutive failed probes (busy timeouts excluded) before a worker is unhealthy
    engine_keepalive: KeepaliveSettings = field(default_factory=KeepaliveSettings)  # engine channels' HTTP/2 pings
    memory_trim_min_bytes: int = 1024 * 1024  # a request this large makes the idle gateway malloc_trim; 0: off
    malloc_mmap_threshold: int = 32 * 1024 * 1024  # bytes: fixed glibc M_MMAP_THRESHOLD; 0: glibc's dynamic default
    malloc_trim_threshold: int = 64 * 1024 * 1024  # bytes: fixed glibc M_TRIM_THRESHOLD; 0: glibc's dynamic default
    malloc_arena_max: int = 1  # glibc M_ARENA_MAX; 0: glibc's default (8 per core)
    #: bounds on a bundle fetched from a worker (``GetTokenizer``; :mod:`mmgate.routing.bundles`)
    bundle_limits: BundleLimits = field(default_factory=BundleLimits)
    #: folder of fetched bundles, ``<dir>/<sha256>``; ``parse_settings`` always sets it
    #: (:func:`default_bundle_cache_dir`), None only in settings built by hand
    bundle_cache_dir: Path | None = None


def split_search_path(value: str | None) -> tuple[Path, ...]:
    """Split an ``os.pathsep``-separated list of folders."""
    if not value:
        return ()
    return tuple(Path(p) for p in value.split(os.pathsep) if p)


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


def _trim_threshold(value: int) -> int:
    if not 0 <= value < 2**31:
        raise SystemExit("--malloc-trim-threshold must be 0..2147483647 bytes")
    return value


def _url_ports(entries: Sequence[Sequence[str]] | None, flag: str) -> tuple[tuple[str, int | None], ...]:
    out: list[tuple[str, int | None]] = []
    for entry in entries or []:
        if len(entry) > 2 or (len(entry) == 2 and not (entry[1].isdigit() and 0 < int(entry[1]) < 65536)):
            raise SystemExit(f"{flag} expects URL [BOOTSTRAP_PORT], got {' '.join(entry)!r}")
        out.append((entry[0], int(entry[1]) if len(entry) == 2 else None))
    return tuple(out)


def _pd_settings(ns: argparse.Namespace) -> tuple[bool, tuple[tuple[str, int | None], ...], tuple[str, ...]]:
    """(PD on: ``--pd-disaggregation`` or ``--epd-disaggregation``, ``--prefill`` entries, ``--decode`` URLs),
    checked."""
    prefill = _url_ports(ns.prefill, "--prefill")
    decode = tuple(e[0] for e in ns.decode or [])
    encode = _url_ports(ns.encode, "--encode")
    enabled = bool(ns.pd_disaggregation) or bool(ns.epd_disaggregation)
    if enabled and (not prefill or not decode):
        raise SystemExit("--pd-disaggregation / --epd-disaggregation need at least one --prefill and one --decode "
                         "worker")
    if not enabled and (prefill or decode):
        raise SystemExit("--prefill / --decode need --pd-disaggregation")
    if bool(ns.epd_disaggregation) != bool(encode):
        raise SystemExit("--epd-disaggregation needs at least one --encode worker, and --encode needs it")
    return enabled, prefill, decode


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_model_options(container: argparse._ActionsContainer, *, search_path: bool = True,
                      log_level: bool = True, model_required: bool = True) -> None:
    """``--model``, ``--model-path`` and ``--log-level``: the one definition ``mmgate serve``,
    ``mmgate engine`` and ``mmgate sidecar`` share.

    ``search_path``: ``--model`` may name ``org/name`` found on ``--model-path`` (serve, sidecar);
    False: ``--model`` is a bundle folder and there is no ``--model-path`` (engine).  ``log_level``
    False: the caller lists ``--log-level`` in another group (:func:`add_log_level_option`).
    ``model_required`` False (serve): without ``--model`` each worker's model is the one it reports.
    """
    if search_path:
        add_option(container, "--model", required=model_required, default=None,
                   help="model bundle: a folder, or org/name found on the model search path"
                   + ("" if model_required else "; unset: each worker's model as its GetModelInfo reports it, its "
                      "bundle from the model search path, else from the worker (GetTokenizer)"))
        add_option(container, "--model-path", env=(ENV_MODEL_PATH,), metavar="DIRS",
                   help="search path of bundle folders, os.pathsep-separated")
    else:
        add_option(container, "--model", required=True, type=Path, metavar="DIR",
                   help="model bundle folder (config.json, tokenizer, optional weights)")
    if log_level:
        add_log_level_option(container)


def add_log_level_option(container: argparse._ActionsContainer) -> None:
    """``--log-level``, part of :func:`add_model_options`'s group."""
    add_option(container, "--log-level", default="info", choices=list(LOG_LEVELS), type=str.lower,
               help="log level of the process's loggers")


def build_parser() -> argparse.ArgumentParser:
    """The ``mmgate serve`` parser, its options grouped by topic (``--help``; docs/configuration.md)."""
    p = argparse.ArgumentParser(prog="mmgate serve", description="Run the mmgate OpenAI-compatible gateway "
                                "(every option with its default and environment variable: docs/configuration.md).")
    g = p.add_argument_group("model and server")
    add_model_options(g, log_level=False, model_required=False)
    add_option(g, "--served-model-name", help="model name clients send and /v1/models lists (default: --model)")
    add_option(g, "--host", default="127.0.0.1", help="address the HTTP server listens on")
    add_option(g, "--port", type=int, default=30000, minimum=0, help="port the HTTP server listens on")
    add_option(g, "--workers", type=count_or_auto, default=1, minimum=1, env=(ENV_WORKERS,), metavar="N|auto",
               help="gateway processes serving the port, each a full gateway (SO_REUSEPORT; docs/performance.md, "
                    "\"Many cores\"); 1: this process alone; auto: one per available core (affinity, cgroup "
                    "quota) that the available memory allows; --preprocess-threads 0 shares the cores among them")
    add_option(g, "--default-max-tokens", type=int, default=64, help="completion budget when a request sets none")
    add_option(g, "--max-model-len", type=int, default=0,
               help="context length in tokens (prompt + completion); 0: the bundle's max_position_embeddings")
    add_option(g, "--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
               help="string message content as the template gets it: auto = as vLLM detects (parts when the "
                    "template loops over content), string = as given (transformers), openai = always parts")
    add_media_options(p)
    add_video_options(p)
    add_audio_options(p)
    g = p.add_argument_group("tensor transport")
    add_option(g, "--multimodal-tensor-transport", choices=[t.value for t in TensorTransport],
               default=TensorTransport.INLINE.value, env=(ENV_TENSOR_TRANSPORT, ENV_TENSOR_TRANSPORT_LEGACY),
               deprecated=(ENV_TENSOR_TRANSPORT_LEGACY,),
               help="how encoder tensors travel: inline, shm, or auto (shm when the worker shares /dev/shm)")
    add_option(g, "--multimodal-shm-min-bytes", type=int, default=65536, minimum=0,
               env=(ENV_SHM_MIN_BYTES, ENV_SHM_MIN_BYTES_LEGACY), deprecated=(ENV_SHM_MIN_BYTES_LEGACY,),
               help="smallest tensor sent through shared memory, bytes")
    add_option(g, "--multimodal-encoder-dtype", choices=["auto", *ENCODER_DTYPES], default="auto",
               env=(ENV_ENCODER_DTYPE, ENV_VLLM_ENCODER_DTYPE),
               help="wire dtype of float encoder inputs; auto: the worker's multimodal_encoder_dtype label, else float32")
    add_option(g, "--multimodal-release-sent-min-bytes", type=int, default=32 * 1024 * 1024, minimum=0,
               help="a serialized Generate request at least this large gives its pages back to the system once "
                    "grpc has copied it for sending, so it is not held twice while it travels (0: never; only on "
                    "grpcio versions verified to copy first)")
    add_option(g, "--multimodal-max-inflight-bytes", type=int, default=None, minimum=1,
               help="bound on preprocessed bytes held for engines: 429 past it, 413 above it (unset: unbounded)")
    add_option(g, "--mm-pixel-cache-mb", type=float, default=0.0, minimum=0, env=(ENV_PIXEL_CACHE_MB,),
               deprecated=(ENV_PIXEL_CACHE_MB,), help="preprocessed-item LRU cache size, MiB (0: off)")
    g = p.add_argument_group("processing mode")
    add_option(g, "--mm-processing", choices=[m.value for m in MmProcessing], default=MmProcessing.AUTO.value,
               env=(ENV_MM_PROCESSING,), deprecated=(ENV_MM_PROCESSING,),
               help="where media is processed: router, worker, or auto (worker when every worker of the model can)")
    add_option(g, "--mm-processing-models", nargs="*", default=None, metavar="MODEL",
               help="models opted in to worker-side processing (served or bundle name); unset: every model")
    add_option(g, "--sglang-allow-mrope-media", action="store_true", default=False,
               help="send images of M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) to SGLang workers anyway; they "
                    "position them as text (docs/engines-sglang.md). Off: such requests get 400 "
                    "mrope_media_not_supported before any fetch")
    add_option(g, "--preprocess-threads", type=int, default=0, minimum=0,
               help="threads preprocessing media in the gateway (0: os.cpu_count(); with --workers N: ceil(cores / N) per process)")
    g = p.add_argument_group("workers")
    add_option(g, "--worker-urls", nargs="*", default=[], metavar="URL", help="grpc://HOST:PORT of engine workers")
    add_option(g, "--worker-health-interval", type=float, default=5.0, help="seconds between worker health probes")
    add_option(g, "--worker-health-timeout", type=float, default=2.0, help="deadline of one health probe, seconds")
    add_option(g, "--worker-unhealthy-after", type=int, default=3,
               help="consecutive failed probes before a worker is unhealthy (nothing listening: at once; "
                    "a timeout while the worker is busy does not count)")
    add_option(g, "--engine-keepalive-interval", type=float, default=_KEEPALIVE_DEFAULTS.interval_s, minimum=1,
               help="seconds an engine connection may carry nothing before the gateway pings it (HTTP/2 keepalive, "
                    "as SMG's engine channels)")
    add_option(g, "--engine-keepalive-timeout", type=float, default=_KEEPALIVE_DEFAULTS.timeout_s, minimum=1,
               help="seconds to wait for a keepalive ping's ack; past it the connection is closed and its requests "
                    "end with 503 engine_unavailable (a frozen or partitioned engine; docs/engines.md, \"Liveness\")")
    add_option(g, "--pd-disaggregation", action="store_true", default=False,
               help="split each request into a prefill leg and a decode leg (docs/disaggregation.md)")
    add_option(g, "--prefill", action="append", nargs="+", default=None, metavar="URL [BOOTSTRAP_PORT]",
               help="a prefill worker grpc://HOST:PORT and optionally its bootstrap port (repeatable)")
    add_option(g, "--decode", action="append", nargs=1, default=None, metavar="URL",
               help="a decode worker grpc://HOST:PORT (repeatable)")
    add_option(g, "--epd-disaggregation", action="store_true", default=False,
               help="also send each media item to an encode worker (TokenSpeed wire; docs/disaggregation.md)")
    add_option(g, "--encode", action="append", nargs="+", default=None, metavar="URL [BOOTSTRAP_PORT]",
               help="an encode worker grpc://HOST:PORT and optionally its bootstrap port (repeatable)")
    add_option(g, "--encode-policy", choices=["consistent_hashing", "round_robin", "random"],
               default="consistent_hashing", help="how an item's encode worker is picked (consistent_hashing: "
               "by the item's content hash)")
    add_option(g, "--worker-bundle-cache-dir", type=Path, env=(ENV_BUNDLE_CACHE_DIR,), env_doc=("XDG_CACHE_HOME",),
               metavar="DIR", help="folder keeping the bundles fetched from workers (GetTokenizer), one <sha256> "
                                   "folder each (unset: $XDG_CACHE_HOME/mmgate/bundles, else ~/.cache/mmgate/bundles)")
    add_option(g, "--worker-bundle-timeout", type=float, default=_BUNDLE_DEFAULTS.timeout_s, minimum=1,
               help="seconds a worker's GetTokenizer may take, from the call to its last chunk (as SMG)")
    add_option(g, "--worker-bundle-max-bytes", type=int, default=_BUNDLE_DEFAULTS.max_archive_bytes, minimum=1,
               help="largest bundle archive a worker may stream, bytes (as SMG); reading stops past it")
    add_option(g, "--worker-bundle-max-files", type=int, default=_BUNDLE_DEFAULTS.max_members, minimum=1,
               help="most files and folders in a bundle archive (as SMG)")
    add_option(g, "--worker-bundle-max-file-bytes", type=int, default=_BUNDLE_DEFAULTS.max_member_bytes, minimum=1,
               help="largest file of a bundle archive, uncompressed bytes (declared and counted while extracting)")
    add_option(g, "--worker-bundle-max-unpacked-bytes", type=int, default=_BUNDLE_DEFAULTS.max_unpacked_bytes, minimum=1,
               help="all files of a bundle archive together, uncompressed bytes (as SMG)")
    g = p.add_argument_group("routing policy")
    r = RoutingSettings()
    add_option(g, "--policy", choices=list(POLICIES), default=r.policy,
               help="how a worker is chosen (docs/routing.md); SMG's default")
    add_option(g, "--prefill-policy", choices=list(POLICIES), default=None,
               help="the prefill leg's policy under --pd-disaggregation (unset: --policy)")
    add_option(g, "--decode-policy", choices=list(POLICIES), default=None,
               help="the decode leg's policy under --pd-disaggregation (unset: --policy)")
    add_option(g, "--cache-threshold", "--cache-match-threshold", type=float, default=r.cache_threshold, minimum=0,
               help="cache_aware: the matched share of a request's key above which the workers holding that match "
                    "are its candidates")
    add_option(g, "--balance-abs-threshold", "--spill-abs-threshold", type=int, default=r.balance_abs_threshold,
               minimum=0, help="cache_aware spill gate: a matched worker is skipped when its requests in flight "
                               "exceed the mean by this many (capped at max(4, 2 x sqrt(mean))) and by "
                               "--balance-rel-threshold")
    add_option(g, "--balance-rel-threshold", "--spill-rel-threshold", type=float, default=r.balance_rel_threshold,
               minimum=1, help="cache_aware spill gate: ... and exceed this multiple of the mean")
    add_option(g, "--eviction-interval-secs", "--eviction-interval", type=float, default=r.eviction_interval_s,
               minimum=0, help="cache_aware: seconds between trims of the approximate tree (0: never)")
    add_option(g, "--max-tree-size", type=int, default=r.max_tree_size, minimum=1,
               help="cache_aware: key values (tokens) kept per worker in the approximate tree; older ones are evicted")
    add_option(g, "--block-size", type=int, default=r.block_size, minimum=1,
               help="cache_aware: tokens per page of the approximate tree (an engine caches whole blocks)")
    add_option(g, "--prefix-token-count", type=int, default=r.prefix_token_count, minimum=1,
               help="prefix_hash: leading key values hashed onto the ring")
    add_option(g, "--prefix-hash-load-factor", type=float, default=r.prefix_hash_load_factor, minimum=1,
               help="prefix_hash: the ring's worker is skipped past this multiple of the mean load (and past "
                    "--prefix-hash-balance-abs-threshold)")
    add_option(g, "--prefix-hash-balance-abs-threshold", type=int, default=r.prefix_hash_balance_abs_threshold,
               minimum=0, help="prefix_hash: requests over the mean load the ring's worker must also exceed to be "
                               "skipped")
    add_option(g, "--load-check-interval", type=float, default=r.load_check_interval_s, minimum=0.01,
               help="least_load, power_of_two: seconds between GetLoads polls of every worker")
    add_option(g, "--least-load-kv-pressure-weight", type=float, default=r.least_load_kv_pressure_weight, minimum=0,
               help="least_load: weight (seconds) of the KV-usage barrier")
    add_option(g, "--least-load-default-throughput", type=float, default=r.least_load_default_throughput,
               minimum=0.001, help="least_load: tokens/s assumed for a worker that reports none")
    add_option(g, "--least-load-mean-prefill-tokens", type=int, default=r.least_load_mean_prefill_tokens,
               minimum=1, help="least_load: tokens counted per request in flight when a request's length is unknown")
    add_option(g, "--least-load-max-waiting-requests", type=int, default=r.least_load_max_waiting_requests,
               minimum=0, help="least_load: workers whose reported waiting requests plus those sent since their "
                               "last poll reach this are skipped while another is under it (0: off)")
    g = p.add_argument_group("HTTP limits")
    add_option(g, "--max-request-body-bytes", type=int, default=0,
               help="413 request_too_large past this body size (0: largest per-item cap in base64 + 1 MiB)")
    add_option(g, "--http-header-timeout", type=float, default=_HTTP_DEFAULTS.header_timeout_s,
               help="seconds for a request's line and headers to arrive; past it 408 request_timeout and close")
    add_option(g, "--http-body-timeout", type=float, default=_HTTP_DEFAULTS.body_timeout_s,
               help="seconds for a whole request body to arrive; past it 408 request_timeout and close")
    add_option(g, "--http-body-idle-timeout", type=float, default=_HTTP_DEFAULTS.body_idle_timeout_s,
               help="seconds between two chunks of a request body; past it 408 request_timeout and close")
    add_option(g, "--max-connections", type=int, default=_HTTP_DEFAULTS.max_connections,
               help="open HTTP connections served; a request on one past it gets 503 server_busy")
    add_option(g, "--http-loop", choices=list(HTTP_LOOPS), default=_HTTP_DEFAULTS.loop,
               help="event loop of the HTTP server (uvloop: asyncio when not installed)")
    add_option(g, "--http-parser", choices=list(HTTP_PARSERS), default=_HTTP_DEFAULTS.parser,
               help="HTTP/1.1 parser (httptools: h11 when not installed); the header deadline and the "
                    "connection cap apply with either")
    add_auth_options(p)
    g = p.add_argument_group("structured outputs and tools")
    c = _CONSTRAINT_DEFAULTS
    add_option(g, "--constraint-max-chars", type=int, default=c.max_chars, minimum=1,
               help="characters of one constraint (JSON schema text, regex, grammar, structural tag, the choices "
                    "together); past it 400 invalid_request")
    add_option(g, "--constraint-max-depth", type=int, default=c.max_depth, minimum=1,
               help=f"JSON nesting of a schema or structural tag, also when given as JSON text (at most "
                    f"{CONSTRAINT_DEPTH_CEILING}); past it 400 invalid_request")
    add_option(g, "--constraint-max-schema-nodes", type=int, default=c.max_schema_nodes, minimum=1,
               help="JSON objects in one schema (subschemas, properties, definitions); past it 400 invalid_request")
    add_option(g, "--constraint-max-values", type=int, default=c.max_values, minimum=1,
               help="choices of guided_choice, or enum and const values of one schema; past it 400 invalid_request")
    add_option(g, "--constraint-max-optional-weight", type=int, default=c.max_optional_weight, minimum=1,
               help="sum over a schema's objects of the square of their optional properties (xgrammar's compile "
                    "time grows with it); past it 400 invalid_request")
    add_option(g, "--constraint-max-regex-depth", type=int, default=c.max_regex_depth, minimum=1,
               help="nested groups of a regex (guided_regex, a schema pattern) or parentheses of a grammar; past "
                    "it 400 invalid_request")
    add_option(g, "--constraint-max-regex-repeat", type=int, default=c.max_regex_repeat, minimum=0,
               help="atoms the counted repetitions of one regex or grammar add ([a-z]{1000} adds 999); past it "
                    "400 invalid_request")
    g = p.add_argument_group("memory")
    add_option(g, "--memory-trim-min-bytes", type=int, default=1024 * 1024,
               help="after a request holding this many encoder or body bytes, malloc_trim once the gateway is idle "
                    "(0: off)")
    add_option(g, "--malloc-mmap-threshold", type=int, default=32 * 1024 * 1024,
               help="fixed glibc M_MMAP_THRESHOLD in bytes, up to 32 MiB: blocks below it are reused from the heap "
                    "instead of mapped and faulted in per request (0: glibc's dynamic default)")
    add_option(g, "--malloc-trim-threshold", type=int, default=64 * 1024 * 1024,
               help="fixed glibc M_TRIM_THRESHOLD in bytes: free memory kept at the heap's top between requests "
                    "(0: glibc's dynamic default)")
    add_option(g, "--malloc-arena-max", type=int, default=1, minimum=0,
               help="glibc M_ARENA_MAX: malloc arenas the gateway's threads share, so the idle trim returns all "
                    "free memory (0: glibc's default, 8 per core)")
    g = p.add_argument_group("logging and metrics")
    add_log_level_option(g)
    add_option(g, "--log-mm-timing", action="store_true", default=False, env=(ENV_LOG_MM_TIMING,),
               deprecated=(ENV_LOG_MM_TIMING,),
               help="log one smg_mm_timing line per media request, plus video decode and tensor transport "
                    "events, at INFO (docs/metrics.md)")
    return p


def bundle_limits(ns: argparse.Namespace) -> BundleLimits:
    """The :class:`BundleLimits` of a ``mmgate serve`` namespace, resolved."""
    return BundleLimits(timeout_s=ns.worker_bundle_timeout, max_archive_bytes=ns.worker_bundle_max_bytes,
                        max_members=ns.worker_bundle_max_files, max_member_bytes=ns.worker_bundle_max_file_bytes,
                        max_unpacked_bytes=ns.worker_bundle_max_unpacked_bytes)


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse ``mmgate serve`` arguments with environment fallbacks.

    Raises:
        SystemExit: an unreadable flag or environment value (start-up stops).
    """
    parser = build_parser()
    ns = resolve(parser, parser.parse_args(list(argv)), environ)
    http = HttpSettings(header_timeout_s=ns.http_header_timeout, body_idle_timeout_s=ns.http_body_idle_timeout,
                        body_timeout_s=ns.http_body_timeout, max_connections=ns.max_connections,
                        loop=ns.http_loop, parser=ns.http_parser)
    if min(http.header_timeout_s, http.body_idle_timeout_s, http.body_timeout_s, http.max_connections) <= 0:
        raise SystemExit("--http-*-timeout and --max-connections must be positive")
    pd_enabled, prefill_workers, decode_workers = _pd_settings(ns)
    constraints = ConstraintLimits(
        max_chars=ns.constraint_max_chars, max_depth=ns.constraint_max_depth,
        max_schema_nodes=ns.constraint_max_schema_nodes, max_values=ns.constraint_max_values,
        max_optional_weight=ns.constraint_max_optional_weight, max_regex_depth=ns.constraint_max_regex_depth,
        max_regex_repeat=ns.constraint_max_regex_repeat)
    if constraints.max_depth > CONSTRAINT_DEPTH_CEILING:
        raise SystemExit(f"--constraint-max-depth must be at most {CONSTRAINT_DEPTH_CEILING}")
    return Settings(
        model=ns.model,
        pd_disaggregation=pd_enabled,
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        epd_disaggregation=bool(ns.epd_disaggregation),
        encode_workers=_url_ports(ns.encode, "--encode"),
        encode_policy=ns.encode_policy,
        routing=RoutingSettings(
            policy=ns.policy, prefill_policy=ns.prefill_policy, decode_policy=ns.decode_policy,
            cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
            balance_rel_threshold=ns.balance_rel_threshold, eviction_interval_s=ns.eviction_interval_secs,
            max_tree_size=ns.max_tree_size, block_size=ns.block_size, prefix_token_count=ns.prefix_token_count,
            prefix_hash_load_factor=ns.prefix_hash_load_factor,
            prefix_hash_balance_abs_threshold=ns.prefix_hash_balance_abs_threshold,
            load_check_interval_s=ns.load_check_interval,
            least_load_kv_pressure_weight=ns.least_load_kv_pressure_weight,
            least_load_default_throughput=ns.least_load_default_throughput,
            least_load_mean_prefill_tokens=ns.least_load_mean_prefill_tokens,
            least_load_max_waiting_requests=ns.least_load_max_waiting_requests),
        model_search_path=split_search_path(ns.model_path),
        served_model_name=ns.served_model_name,
        worker_urls=tuple(ns.worker_urls),
        host=ns.host,
        port=ns.port,
        processes=(auto_workers(ns.multimodal_max_inflight_bytes) if ns.workers == AUTO else ns.workers),
        image_backend=ImageBackend(ns.image_backend),
        item_limits=item_limits(ns, environ),
        default_max_tokens=ns.default_max_tokens,
        max_model_len=max(0, ns.max_model_len),
        chat_template_content_format=ns.chat_template_content_format,
        fetch=fetch_settings(ns),
        video=video_settings(ns),
        audio=audio_settings(ns),
        transport=_transport_settings(ns, environ),
        http=http,
        auth=auth_settings(ns),
        constraints=constraints,
        mm_processing=MmProcessing(ns.mm_processing),
        mm_processing_models=None if ns.mm_processing_models is None else tuple(ns.mm_processing_models),
        sglang_allow_mrope_media=bool(ns.sglang_allow_mrope_media),
        preprocess_threads=ns.preprocess_threads,
        max_request_body_bytes=max(0, ns.max_request_body_bytes),
        log_level=ns.log_level,
        log_mm_timing=bool(ns.log_mm_timing),
        worker_health_interval_s=_positive(ns.worker_health_interval, "--worker-health-interval"),
        worker_health_timeout_s=_positive(ns.worker_health_timeout, "--worker-health-timeout"),
        worker_unhealthy_after=int(_positive(ns.worker_unhealthy_after, "--worker-unhealthy-after")),
        engine_keepalive=KeepaliveSettings(interval_s=ns.engine_keepalive_interval,
                                           timeout_s=ns.engine_keepalive_timeout),
        memory_trim_min_bytes=max(0, ns.memory_trim_min_bytes),
        malloc_mmap_threshold=_mmap_threshold(ns.malloc_mmap_threshold),
        malloc_trim_threshold=_trim_threshold(ns.malloc_trim_threshold),
        malloc_arena_max=ns.malloc_arena_max,
        bundle_limits=bundle_limits(ns),
        bundle_cache_dir=ns.worker_bundle_cache_dir or default_bundle_cache_dir(environ),
    )
