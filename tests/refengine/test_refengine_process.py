"""``python -m mmgate.refengine`` as a separate process: it comes up, answers, and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from tests.refengine.refengine_support import stub_for

START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(address: str, proc: subprocess.Popen[bytes]) -> None:
    stub = stub_for(address)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "engine exited before it was healthy"
        try:
            if stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=1).healthy:
                return
        except grpc.RpcError:
            time.sleep(0.25)
    raise AssertionError(f"engine at {address} not healthy after {START_TIMEOUT_S}s")


def test_engine_module_serves_as_a_separate_process(qwen2_vl_bundle: Path, tmp_path: Path) -> None:
    port = _free_port()
    stderr_path = tmp_path / "engine.stderr"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mmgate.refengine",
                "--model",
                str(qwen2_vl_bundle),
                "--port",
                str(port),
                "--served-model-name",
                "tiny-qwen2-vl",
                "--seed",
                "3",
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        try:
            _wait_healthy(f"127.0.0.1:{port}", proc)
            info = stub_for(f"127.0.0.1:{port}").GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
            assert info.served_model_name == "tiny-qwen2-vl"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = stderr_path.read_text()
    assert "random shrunken weights (seed 3)" in log
    assert f"127.0.0.1:{port}" in log
    assert str(qwen2_vl_bundle) in log


def test_a_missing_bundle_exits_with_status_1(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mmgate.refengine", "--model", str(tmp_path / "nope"), "--port", "0"],
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert result.returncode == 1
    assert b"cannot start" in result.stderr
