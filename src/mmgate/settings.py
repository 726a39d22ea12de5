"""Every gateway flag and its environment fallback, parsed once.

``parse_settings(argv, environ)`` returns a frozen :class:`Settings` that is
passed down explicitly; no other module reads the environment.  Precedence:
flag, then environment variable, then built-in default.
"""

from __future__ import annotations

import argparse
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
ENV_ALLOW_PRIVATE = "MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS"


DEFAULT_IMAGE_MAX_BYTES = 20 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FetchSettings:
    """Limits of the media fetcher (``mmgate.media.fetch``)."""

    allowed_domains: tuple[str, ...] = ()  # empty: any public host
    allow_private_hosts: bool = False  # loopback/private/link-local targets allowed
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    total_timeout_s: float = 20.0
    max_redirects: int = 3
    image_max_bytes: int = DEFAULT_IMAGE_MAX_BYTES
    max_image_pixels: int = 178_956_970  # Pillow's own decompression-bomb limit (2 x MAX_IMAGE_PIXELS)


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
    fetch: FetchSettings = field(default_factory=FetchSettings)
    preprocess_threads: int = 0  # 0: os.cpu_count()
    log_level: str = "info"


def _env_bool(value: str | None) -> bool:
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


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
    p.add_argument("--mm-allowed-media-domains", nargs="*", default=[])
    p.add_argument("--mm-allow-private-media-hosts", action="store_true", default=None,
                   help=f"allow loopback/private media hosts (env {ENV_ALLOW_PRIVATE}); for trusted setups and tests")
    p.add_argument("--mm-fetch-timeout", type=float, default=20.0, help="total fetch timeout, seconds")
    p.add_argument("--image-max-input-bytes", type=int, default=None, help=f"env {ENV_IMAGE_MAX_BYTES}")
    p.add_argument("--preprocess-threads", type=int, default=0)
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
    max_bytes = ns.image_max_input_bytes
    if max_bytes is None and environ.get(ENV_IMAGE_MAX_BYTES):
        try:
            max_bytes = int(environ[ENV_IMAGE_MAX_BYTES])
        except ValueError:
            raise SystemExit(f"{ENV_IMAGE_MAX_BYTES} must be an integer") from None
    allow_private = ns.mm_allow_private_media_hosts
    if allow_private is None:
        allow_private = _env_bool(environ.get(ENV_ALLOW_PRIVATE))
    fetch = FetchSettings(
        allowed_domains=tuple(d.lower() for d in ns.mm_allowed_media_domains),
        allow_private_hosts=allow_private,
        total_timeout_s=ns.mm_fetch_timeout,
        image_max_bytes=max_bytes if max_bytes is not None else DEFAULT_IMAGE_MAX_BYTES,
    )
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
        fetch=fetch,
        preprocess_threads=ns.preprocess_threads,
        log_level=ns.log_level,
    )
