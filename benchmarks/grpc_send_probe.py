"""How long does grpc-python take to send one 29 MB pre-serialized GenerateRequest?

Starts benchmarks/null_worker.py, then sends the same 1280x960-sized request (float32
[4800, 1536] pixel_values, inline) 12 times per client variant and prints the medians:
grpc.aio and sync grpc, with default HTTP/2 options and with a 16 MiB frame size + 64 MiB
write buffer.  Used for the inline analysis in docs/performance.md.

Run:  python benchmarks/grpc_send_probe.py [--model BUNDLE]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mmgate.cli.launch import free_port  # noqa: E402

METHOD = "/vllm.grpc.engine.VllmEngine/Generate"
BASE = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
BIG = [("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1), ("grpc.http2.write_buffer_size", 64 * 1024 * 1024)]


def request_bytes() -> bytes:
    msg = vllm_engine_pb2.GenerateRequest(request_id="probe", stream=False,
                                          tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]))
    msg.sampling_params.max_tokens = 1
    pv = msg.mm_inputs.pixel_values
    pv.shape.extend([4800, 1536])
    pv.dtype = "float32"
    pv.inline = np.random.default_rng(0).random(4800 * 1536, dtype=np.float32).tobytes()
    return msg.SerializeToString()


async def aio_median(port: int, options: list, raw: bytes, n: int) -> float:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=BASE + options)
    call = channel.unary_stream(METHOD, request_serializer=None,
                                response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        async for _resp in call(raw):
            pass
        times.append(time.perf_counter() - start)
    await channel.close()
    return float(np.median(times)) * 1000


def sync_median(port: int, options: list, raw: bytes, n: int) -> float:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=BASE + options) as channel:
        call = channel.unary_stream(METHOD, request_serializer=None,
                                    response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            for _resp in call(raw):
                pass
            times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/Qwen--Qwen3-VL-2B-Instruct"))
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    port = free_port()
    worker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("null_worker.py")), "--model", args.model,
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        raw = request_bytes()
        print("| client | HTTP/2 options | median ms |\n|---|---|---|")
        print(f"| grpc.aio | default | {asyncio.run(aio_median(port, [], raw, args.repeats)):.1f} |")
        print(f"| grpc.aio | 16 MiB frames | {asyncio.run(aio_median(port, BIG, raw, args.repeats)):.1f} |")
        print(f"| sync grpc | default | {sync_median(port, [], raw, args.repeats):.1f} |")
        print(f"| sync grpc | 16 MiB frames | {sync_median(port, BIG, raw, args.repeats):.1f} |")
    finally:
        worker.terminate()
        worker.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
