"""The media-processing flags a worker and its sidecar share.

Stage: start-up of ``mmgate engine --mm-processor inprocess|redis`` and of
``mmgate sidecar``.  In: parsed ``argparse`` flags; out: a frozen
:class:`ProcessingConfig`.  Every setting here except the timeouts and the
thread count enters the processing fingerprint
(:func:`mmgate.sidecar.processor.processing_fingerprint`), so an engine and a
sidecar started with different values never work together.

The media-intake and video flags are ``mmgate serve``'s own definitions
(:mod:`mmgate.config.settings`), environment fallbacks included, so one set of values
configures the gateway (router mode) and the workers (worker mode) alike.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from mmgate.config.options import add_option, resolve
from mmgate.config.settings import (
    AudioSettings,
    FetchSettings,
    VideoSettings,
    add_media_options,
    add_audio_options,
    add_video_options,
    audio_settings,
    fetch_settings,
    item_limits,
    video_settings,
)
from mmgate.models.backend import ImageBackend


@dataclass(frozen=True, slots=True)
class ProcessingConfig:
    """How a worker-side processor fetches and preprocesses media."""

    image_backend: ImageBackend = ImageBackend.AUTO
    fetch: FetchSettings = field(default_factory=FetchSettings)
    item_limits: Mapping[str, int] = field(default_factory=dict)  # per-modality overrides of the family's limits
    threads: int = 2  # preprocessing threads
    video: VideoSettings = field(default_factory=VideoSettings)  # video decode limits, as mmgate serve's
    audio: AudioSettings = field(default_factory=AudioSettings)  # audio decode limits, as mmgate serve's


def add_processing_arguments(parser: argparse.ArgumentParser) -> None:
    """The processing flags, shared by ``mmgate engine`` and ``mmgate sidecar``.

    The media-intake and video groups are ``mmgate serve``'s own definitions
    (:func:`mmgate.config.settings.add_media_options`, :func:`mmgate.config.settings.add_video_options`):
    same names, defaults and environment fallbacks; only the thread count is
    worker-side.
    """
    add_media_options(parser)
    add_video_options(parser)
    add_audio_options(parser)
    g = parser.add_argument_group("worker-side media processing")
    add_option(g, "--mm-preprocess-threads", type=int, default=2, minimum=1, help="media preprocessing threads")


def processing_config(ns: argparse.Namespace, parser: argparse.ArgumentParser,
                      environ: Mapping[str, str] | None = None) -> ProcessingConfig:
    """The :class:`ProcessingConfig` of parsed flags, with the environment fallbacks of ``environ``
    (``None``: none read) filled in first (:func:`mmgate.config.options.resolve`).

    Raises:
        SystemExit: an unreadable flag or environment value (the message names it).
    """
    env: Mapping[str, str] = {} if environ is None else environ
    resolve(parser, ns, env)
    return ProcessingConfig(image_backend=ImageBackend(ns.image_backend), fetch=fetch_settings(ns),
                            item_limits=item_limits(ns, env), threads=ns.mm_preprocess_threads,
                            video=video_settings(ns), audio=audio_settings(ns))
