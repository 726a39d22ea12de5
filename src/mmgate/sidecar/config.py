"""The media-processing flags a worker and its sidecar share.

Stage: start-up of ``mmgate engine --mm-processor inprocess|redis`` and of
``mmgate sidecar``.  In: parsed ``argparse`` flags; out: a frozen
:class:`ProcessingConfig`.  Every setting here except the timeouts and the
thread count enters the processing fingerprint
(:func:`mmgate.sidecar.processor.processing_fingerprint`), so an engine and a
sidecar started with different values never work together.

The flags are spelled as ``mmgate serve`` spells them, so one set of values
configures the gateway (router mode) and the workers (worker mode) alike.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from mmgate.settings import (
    DEFAULT_AUDIO_MAX_BYTES,
    DEFAULT_IMAGE_MAX_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_VIDEO_MAX_BYTES,
    FetchSettings,
    ImageBackend,
)


@dataclass(frozen=True, slots=True)
class ProcessingConfig:
    """How a worker-side processor fetches and preprocesses media."""

    image_backend: ImageBackend = ImageBackend.AUTO
    fetch: FetchSettings = field(default_factory=FetchSettings)
    item_limits: Mapping[str, int] = field(default_factory=dict)  # per-modality overrides of the family's limits
    threads: int = 2  # preprocessing threads


def add_processing_arguments(parser: argparse.ArgumentParser) -> None:
    """The processing flags (one group), shared by ``mmgate engine`` and ``mmgate sidecar``."""
    g = parser.add_argument_group("worker-side media processing")
    g.add_argument("--image-backend", choices=[b.value for b in ImageBackend], default=ImageBackend.AUTO.value,
                   help="transformers image-processor backend to be exact to (as mmgate serve)")
    g.add_argument("--mm-allowed-media-domains", nargs="*", default=[],
                   help="fetch allow-list (empty: any public host)")
    g.add_argument("--mm-allow-private-media-hosts", action="store_true",
                   help="allow loopback/private media hosts (trusted setups and tests)")
    g.add_argument("--mm-fetch-timeout", type=float, default=20.0, help="total fetch timeout, seconds")
    g.add_argument("--mm-fetch-connect-timeout", type=float, default=5.0, help="connect timeout, seconds")
    g.add_argument("--mm-fetch-read-timeout", type=float, default=10.0, help="timeout of one read, seconds")
    g.add_argument("--mm-max-redirects", type=int, default=3)
    g.add_argument("--image-max-input-bytes", type=int, default=DEFAULT_IMAGE_MAX_BYTES)
    g.add_argument("--video-max-input-bytes", type=int, default=DEFAULT_VIDEO_MAX_BYTES)
    g.add_argument("--audio-max-input-bytes", type=int, default=DEFAULT_AUDIO_MAX_BYTES)
    g.add_argument("--mm-image-max-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS)
    g.add_argument("--mm-limit", action="append", default=[], metavar="MODALITY=COUNT",
                   help="per-request item limit override, e.g. image=4")
    g.add_argument("--mm-preprocess-threads", type=int, default=2)


def processing_config(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> ProcessingConfig:
    """The :class:`ProcessingConfig` of parsed flags (``parser.error`` on an unreadable one)."""
    limits: dict[str, int] = {}
    for item in ns.mm_limit:
        name, _, count = item.partition("=")
        if not count.isdigit():
            parser.error(f"--mm-limit expects MODALITY=COUNT, got {item!r}")
        limits[name.strip()] = int(count)
    fetch = FetchSettings(
        allowed_domains=tuple(d.strip().strip(".").lower() for d in ns.mm_allowed_media_domains if d.strip(". ")),
        allow_private_hosts=bool(ns.mm_allow_private_media_hosts),
        connect_timeout_s=ns.mm_fetch_connect_timeout, read_timeout_s=ns.mm_fetch_read_timeout,
        total_timeout_s=ns.mm_fetch_timeout, max_redirects=ns.mm_max_redirects,
        image_max_bytes=ns.image_max_input_bytes, video_max_bytes=ns.video_max_input_bytes,
        audio_max_bytes=ns.audio_max_input_bytes, max_image_pixels=ns.mm_image_max_pixels,
    )
    if min(fetch.connect_timeout_s, fetch.read_timeout_s, fetch.total_timeout_s) <= 0:
        parser.error("fetch timeouts must be positive")
    if min(fetch.image_max_bytes, fetch.video_max_bytes, fetch.audio_max_bytes, fetch.max_image_pixels) <= 0:
        parser.error("byte and pixel caps must be positive")
    if ns.mm_preprocess_threads < 1:
        parser.error("--mm-preprocess-threads must be at least 1")
    return ProcessingConfig(image_backend=ImageBackend(ns.image_backend), fetch=fetch, item_limits=limits,
                            threads=ns.mm_preprocess_threads)
