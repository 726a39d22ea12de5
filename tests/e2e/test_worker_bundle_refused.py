"""A worker serving a bad ``GetTokenizer`` archive, behind a gateway started with only ``--worker-urls``
(issue 25, item 1): the gateway's own bundle source (``GetTokenizer`` through :mod:`mmgate.routing.bundles`)
refuses it, the worker is shown ``failed`` with the reason and gets no traffic, nothing lands in the bundle
cache or next to it.

The worker is a real gRPC server on loopback serving the vLLM wire's ``HealthCheck``, ``GetModelInfo``,
``GetServerInfo`` and ``GetTokenizer`` (the generated servicer of smg-grpc-proto); its archive holds a member
whose path escapes the bundle folder.  The full set of archive rules is tests/routing/test_worker_bundles.py's.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.config.settings import parse_settings
from tests.support.servers import gateway_in_thread

MODEL = "crafted/escaping-bundle"


def _archive() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("config.json", b'{"model_type": "qwen2_vl"}')
        zf.writestr("../outside.json", b"{}")
    return buf.getvalue()


class _Worker(vllm_engine_pb2_grpc.VllmEngineServicer):
    def HealthCheck(self, request, context):  # noqa: N802 - the generated servicer's names
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    def GetModelInfo(self, request, context):  # noqa: N802
        return vllm_engine_pb2.GetModelInfoResponse(model_path="/models/escaping", served_model_name=MODEL,
                                                    is_generation=True, max_context_length=4096)

    def GetServerInfo(self, request, context):  # noqa: N802
        return vllm_engine_pb2.GetServerInfoResponse()

    def GetTokenizer(self, request, context):  # noqa: N802
        data = _archive()
        yield common_pb2.GetTokenizerChunk(data=data, sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(_Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"grpc://127.0.0.1:{port}"
    server.stop(0).wait()


def test_a_worker_whose_archive_escapes_is_failed_with_the_reason_and_nothing_is_written(worker: str) -> None:
    with tempfile.TemporaryDirectory(prefix="mmgate-bundle-refused-") as root:
        empty, cache = Path(root, "models"), Path(root, "cache", "bundles")
        empty.mkdir()
        settings = parse_settings(["--worker-urls", worker, "--model-path", str(empty),
                                   "--worker-bundle-cache-dir", str(cache)], {})
        with gateway_in_thread(settings) as base:
            (shown,) = httpx.get(base + "/workers", timeout=10).json()["workers"]
            assert (shown["model_id"], shown["status"], shown["healthy"]) == (MODEL, "failed", True)
            # the member is named by its index, never by its name
            assert shown["reason"] == "the worker's bundle (GetTokenizer) cannot be had: member 1 escapes the folder (..)"
            health = httpx.get(base + "/health", timeout=10)
            assert (health.status_code, health.json()["healthy_workers"]) == (503, 0)
            resp = httpx.post(base + "/v1/chat/completions", timeout=10,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert (resp.status_code, resp.headers["X-SMG-Error-Code"]) == (404, "model_not_found")
        written = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))
        assert written in (["cache", "cache/bundles", "models"], ["models"])  # no entry, no partial folder
