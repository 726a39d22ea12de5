"""A null vLLM-wire worker: answers every RPC at once, so a benchmark measures the gateway.

Implements ``vllm.grpc.engine.VllmEngine`` (``smg_grpc_proto``) on loopback:

* ``HealthCheck``: healthy.
* ``GetModelInfo``: read from the bundle's ``config.json`` / ``generation_config.json``
  (``model_type``, ``supports_vision``, eos ids, max context, vocab size, path, name).
* ``GetServerInfo``: ``server_type`` ``"vllm-grpc"`` and ``shm_namespace_id``
  ``"<boot_id>:<st_dev of /dev/shm>"`` (as ``smg_grpc_servicer/mm_shm.py``
  ``shm_namespace_id``, smg-grpc-servicer 0.14.1), so a gateway's ``auto`` /
  ``shm`` tensor transport sees a shared ``/dev/shm``.
* ``Generate``: every tensor sent through shared memory is read (``os.pread``)
  and its segment unlinked, as the real servicer does (nothing leaks, and the
  read cost is the worker's, the same for every gateway); then, for a stream
  request, one ``chunk`` with one token, and one ``complete`` (``finish_reason``
  ``"stop"``, ``prompt_tokens`` = ``len(input_ids)``, ``completion_tokens`` 1).
* ``GetLoads``: an empty load report; ``Abort``: acknowledged.

Nothing is recorded.  The one exception is the validation probe: a request
whose ``max_tokens`` equals ``--describe-max-tokens`` gets a one-line summary
(prompt length, each tensor's name, shape, dtype, transport, bytes) on stdout,
so a benchmark can check that two gateways sent the same thing.

Run:  python benchmarks/null_worker.py --model /path/to/bundle --port 50051
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.transport.shm import shm_namespace_id  # <boot_id>:<st_dev of /dev/shm>, as smg_grpc_servicer mm_shm

SHM_DIR = "/dev/shm"
_MAX_MESSAGE = 1024 * 1024 * 1024


def read_and_unlink_shm(handle: Any) -> int:
    """Read ``nbytes`` at ``offset`` of ``/dev/shm/<name>`` and unlink it; returns the bytes read.

    Raises:
        ValueError: a bad name, not a regular file, or a short read.
    """
    return len(read_shm_bytes(handle))


def read_shm_bytes(handle: Any) -> bytes:
    """The ``nbytes`` at ``offset`` of ``/dev/shm/<name>`` (the segment is unlinked); errors as
    :func:`read_and_unlink_shm`."""
    name = handle.name.lstrip("/")
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad shm name {handle.name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"shm {name!r} is not a regular file")
        raw = os.pread(fd, int(handle.nbytes), int(handle.offset))
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if len(raw) != int(handle.nbytes):
        raise ValueError(f"shm {name!r}: read {len(raw)} of {int(handle.nbytes)} bytes")
    return raw


def default_served_name(bundle: Path) -> str:
    """``org/name`` for an ``org--name`` bundle folder (mmgate's bundle name), else the folder name."""
    org, sep, name = bundle.name.partition("--")
    return f"{org}/{name}" if sep else bundle.name


def _tensors(mm: Any) -> list[tuple[str, Any]]:
    out = [("pixel_values", mm.pixel_values)] if mm.HasField("pixel_values") else []
    return out + sorted(mm.model_specific_tensors.items())


def consume_tensors(req: Any, describe: bool) -> str:
    """Read (and unlink) every shm payload of ``req``; a summary line when ``describe``."""
    batches = ([req.mm_inputs] if req.HasField("mm_inputs") else []) + list(req.extra_mm_inputs)
    parts: list[dict[str, Any]] = []
    for mm in batches:
        for name, td in _tensors(mm):
            payload = td.WhichOneof("payload")
            nbytes = read_and_unlink_shm(td.shm) if payload == "shm" else len(td.inline)
            if describe:
                parts.append({"name": name, "shape": list(td.shape), "dtype": td.dtype, "transport": payload,
                              "bytes": nbytes})
    if not describe:
        return ""
    mm0 = batches[0] if batches else None
    return json.dumps({
        "prompt_tokens": len(req.tokenized.input_ids), "tensors": parts,
        "placeholders": [[p.offset, p.length] for p in mm0.mm_placeholders] if mm0 else [],
        "batched_keys": sorted(mm0.batched_keys) if mm0 else [],
        "flat_keys": dict(mm0.flat_keys) if mm0 else {},
        "keep_on_cpu_keys": sorted(mm0.keep_on_cpu_keys) if mm0 else [],
    }, sort_keys=True)


class NullEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Answers at once; see the module docstring."""

    def __init__(self, bundle: Path, served_name: str, token_id: int, describe_max_tokens: int) -> None:
        config = json.loads((bundle / "config.json").read_text())
        gen_path = bundle / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        text = config.get("text_config") or {}
        eos = gen.get("eos_token_id", config.get("eos_token_id", text.get("eos_token_id")))
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        self.model_info = vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(bundle), is_generation=True,
            max_context_length=int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 32768),
            vocab_size=int(config.get("vocab_size") or text.get("vocab_size") or 0),
            supports_vision=isinstance(config.get("vision_config"), dict),
            served_model_name=served_name, tokenizer_path=str(bundle), model_type=str(config.get("model_type", "")),
            architectures=list(config.get("architectures") or []), eos_token_ids=eos_ids,
            pad_token_id=int(gen.get("pad_token_id", -1) if gen.get("pad_token_id") is not None else -1),
            bos_token_id=int(gen.get("bos_token_id", config.get("bos_token_id", -1)) or -1),
        )
        self.server_info = vllm_engine_pb2.GetServerInfoResponse(
            server_type="vllm-grpc", shm_namespace_id=shm_namespace_id(), data_parallel_size=1, max_num_seqs=256)
        self.token_id = token_id
        self.describe_max_tokens = describe_max_tokens

    async def HealthCheck(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC API
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.model_info

    async def GetServerInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.server_info

    async def GetLoads(self, request: Any, context: Any) -> Any:  # noqa: N802
        return vllm_engine_pb2.GetLoadsResponse(dp_rank_count=1, loads=[vllm_engine_pb2.SchedulerLoad()])

    async def Abort(self, request: Any, context: Any) -> Any:  # noqa: N802
        return vllm_engine_pb2.AbortResponse()

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
        describe = request.sampling_params.HasField("max_tokens") and \
            request.sampling_params.max_tokens == self.describe_max_tokens
        try:
            line = consume_tensors(request, describe)
        except (OSError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"null worker: {exc}")
        if line:
            print(f"DESCRIBE {line}", flush=True)
        n = len(request.tokenized.input_ids)
        if request.stream:
            yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                token_ids=[self.token_id], prompt_tokens=n, completion_tokens=1))
        yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
            output_ids=[self.token_id], finish_reason="stop", prompt_tokens=n, completion_tokens=1))


async def serve(args: argparse.Namespace) -> None:
    bundle = Path(args.model).resolve()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                      ("grpc.max_send_message_length", _MAX_MESSAGE)])
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
        NullEngine(bundle, args.served_model_name or default_served_name(bundle), args.token_id,
                   args.describe_max_tokens), server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    print(f"null worker listening on {args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="null vLLM-wire gRPC worker (answers at once)")
    ap.add_argument("--model", required=True, help="model bundle folder (config.json, generation_config.json)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", default=None,
                    help="reported served_model_name (default: org/name from an org--name bundle folder)")
    ap.add_argument("--token-id", type=int, default=9707, help="the one output token (9707 = 'Hello' in Qwen2 vocab)")
    ap.add_argument("--describe-max-tokens", type=int, default=2,
                    help="requests with exactly this max_tokens are summarised on stdout (0: none)")
    args = ap.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
