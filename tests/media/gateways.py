"""The real gateway app in a thread under the *default* fetch policy, its fetcher's lower layers replaced.

Test names resolve from a table (``localhost`` through the system resolver,
which answers loopback without any network); the socket layer is the test's
(one that fails if called, or one that routes a "public" test address to a
loopback origin).  Nothing else is changed: the request goes through the
real HTTP API, pipeline and fetch policy.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from mmgate.media.addresses import system_resolver
from mmgate.media.fetch import MediaFetcher
from mmgate.config.settings import FetchSettings, Settings
from tests.support.servers import gateway_in_thread


class RoutedResolver:
    """Test names from ``table``; ``localhost`` through the system resolver (loopback only); else NXDOMAIN."""

    def __init__(self, table: Mapping[str, list[str]]) -> None:
        self.table = dict(table)
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if host in self.table:
            return list(self.table[host])
        if host == "localhost":
            return await system_resolver(host, port)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@contextmanager
def ssrf_gateway(model: Path, served_name: str, worker_port: int, network_backend: Any,
                 resolver: RoutedResolver) -> Iterator[str]:
    """The real gateway app under the *default* fetch policy, its fetcher's lower layers replaced."""
    settings = Settings(model=str(model), served_model_name=served_name,
                        worker_urls=(f"grpc://127.0.0.1:{worker_port}",),
                        fetch=FetchSettings(total_timeout_s=5.0, read_timeout_s=3.0, connect_timeout_s=2.0))

    def fetcher(fetch_settings: FetchSettings, *args: Any, **kwargs: Any) -> MediaFetcher:
        return MediaFetcher(fetch_settings, resolver=resolver, network_backend=network_backend)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mmgate.gateway.state.MediaFetcher", fetcher)
        with gateway_in_thread(settings) as base:
            mp.undo()
            yield base
