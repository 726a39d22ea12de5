"""Recording vLLM-wire workers for the routing benchmark: each simulates a prefix cache and counts its hits.

One process serves ``--workers`` independent ``vllm.grpc.engine.VllmEngine`` servers on loopback
(``smg_grpc_proto``; model info, server info and shm reading as ``null_worker.py``).  Each has its own
:class:`routing_sim.PrefixCache` of ``--capacity-blocks`` blocks of ``--block-tokens`` tokens.

``Generate``: the expanded prompt ``tokenized.input_ids`` and each media batch's ``mm_placeholders``
give the blocks (:func:`routing_sim.block_keys`); a media item's content key is the blake3 of its own
rows of the encoder input (``pixel_values``, split by the ``*grid_thw`` tensor: ``t*h*w`` rows per
item), so the key is the pixels' and not whatever hash a gateway sends.  The gateway's ``mm_hashes``
are checked against it (one hash per content key and back; a mismatch is counted).  The prompt is
served from the cache (counting prompt tokens and cached tokens), admitted, then answered after a
simulated service time ``--service-ms`` + uncached tokens / ``--prefill-tok-s`` with one token
("stop").  A request that carries ``media_refs`` (unexpanded, the engine would process the media) is
refused: the cache could not be simulated from it.

``GetLoads`` reports the requests in flight (``num_running_reqs``) and the KV blocks they hold
(``token_usage``, as vLLM's ``kv_cache_usage``: blocks of running requests, not the idle prefix
cache) so load-aware policies see something real.

Control, one line on stdin -> one JSON line on stdout: ``stats`` (per worker: requests, prompt and
cached tokens, media items, those keyed by their own rows, hashes sent, hash mismatches), ``log`` (per
request, in arrival order: time, worker, prompt tokens, cached tokens, block keys: the oracle's input),
``reset`` (empty every cache and counter).

Run:  python benchmarks/recording_worker.py --model <bundle> --ports 50051 50052 50053 50054
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import grpc
import numpy as np
from null_worker import NullEngine, default_served_name, read_shm_bytes
from routing_sim import BLOCK_TOKENS, PrefixCache, block_keys
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

_MAX_MESSAGE = 1024 * 1024 * 1024
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64,
              "int32": np.int32, "uint32": np.uint32, "uint8": np.uint8}


def tensor_bytes(td: Any) -> bytes:
    """The raw bytes of a ``TensorData`` (inline, or read from ``/dev/shm`` and unlinked)."""
    return read_shm_bytes(td.shm) if td.WhichOneof("payload") == "shm" else bytes(td.inline)


def item_keys(mm: Any) -> tuple[list[str], bool]:
    """One content key per placeholder of a ``MultimodalInputs`` batch (see the module docstring), and whether
    they are the items' own rows (else one key of the whole batch per index: no grid tensor to split by)."""
    primary = mm.pixel_values if mm.HasField("pixel_values") else None
    others = {name: tensor_bytes(td) for name, td in sorted(mm.model_specific_tensors.items())}
    raw = tensor_bytes(primary) if primary is not None else b""
    n = len(mm.mm_placeholders)
    grid_name = next((k for k in others if k.endswith("grid_thw")), None)
    if primary is not None and grid_name is not None and len(primary.shape) >= 1:
        td = mm.model_specific_tensors[grid_name]
        grid = np.frombuffer(others[grid_name], dtype=_NP_DTYPES.get(td.dtype, np.int64)).reshape(-1, 3)
        rows = [int(np.prod(g)) for g in grid]
        if len(rows) == n and sum(rows) == int(primary.shape[0]):
            row_bytes = len(raw) // int(primary.shape[0])
            keys, start = [], 0
            for r in rows:
                keys.append(blake3.blake3(raw[start * row_bytes:(start + r) * row_bytes]).hexdigest())
                start += r
            return keys, True
    whole = blake3.blake3(raw)
    for name in sorted(others):
        whole.update(others[name])
    return [f"{whole.hexdigest()}:{i}" for i in range(n)], False


class RecordingEngine(NullEngine):
    """A :class:`NullEngine` whose ``Generate`` simulates a prefix cache (module docstring)."""

    def __init__(self, index: int, bundle: Path, served_name: str, args: argparse.Namespace, t0: float,
                 log: list[list[Any]]) -> None:
        super().__init__(bundle, served_name, args.token_id, describe_max_tokens=0)
        self.index = index
        self.block = args.block_tokens
        self.cache = PrefixCache(args.capacity_blocks)
        self.service_s = args.service_ms / 1000.0
        self.prefill_tok_s = args.prefill_tok_s
        self.t0 = t0
        self.log = log  # shared by the workers of this process: the arrival order across them
        self.inflight = 0
        self.inflight_blocks = 0
        self.reset()

    def reset(self) -> None:
        self.cache.clear()
        self.stats = {"worker": self.index, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "mm_items": 0, "mm_items_keyed_by_rows": 0, "mm_hashes_sent": 0, "hash_mismatches": 0}
        self.hash_to_key: dict[str, str] = {}
        self.key_to_hash: dict[str, str] = {}

    def _check_hashes(self, hashes: list[str], keys: list[str]) -> None:
        for h, k in zip(hashes, keys):
            self.stats["mm_hashes_sent"] += 1
            if self.hash_to_key.setdefault(h, k) != k or self.key_to_hash.setdefault(k, h) != h:
                self.stats["hash_mismatches"] += 1

    async def GetLoads(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC API
        capacity = self.cache.capacity
        return vllm_engine_pb2.GetLoadsResponse(dp_rank_count=1, loads=[vllm_engine_pb2.SchedulerLoad(
            num_running_reqs=self.inflight, num_total_reqs=self.inflight,
            num_used_tokens=self.inflight_blocks * self.block, max_total_num_tokens=capacity * self.block,
            token_usage=min(0.999, self.inflight_blocks / capacity))])

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC API
        if request.HasField("media_refs"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "recording worker: media_refs (unexpanded prompt) cannot be cached; "
                                "run the gateway with router-side media processing")
        ids = list(request.tokenized.input_ids)
        batches = ([request.mm_inputs] if request.HasField("mm_inputs") else []) + list(request.extra_mm_inputs)
        items: list[tuple[int, int, str]] = []
        try:
            for mm in batches:
                keys, by_rows = item_keys(mm)
                self.stats["mm_items_keyed_by_rows"] += len(keys) if by_rows else 0
                if mm.mm_hashes:
                    self._check_hashes(list(mm.mm_hashes), keys)
                items += [(p.offset, p.length, k) for p, k in zip(mm.mm_placeholders, keys)]
        except (OSError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"recording worker: {exc}")
        bkeys = block_keys(ids, items, self.block)
        n = len(ids)
        cached = self.cache.serve(bkeys, n, self.block)
        st = self.stats
        st["requests"] += 1
        st["prompt_tokens"] += n
        st["cached_tokens"] += cached
        st["mm_items"] += len(items)
        self.log.append([round(time.monotonic() - self.t0, 6), self.index, n, cached, bkeys])
        held = -(-n // self.block)
        self.inflight += 1
        self.inflight_blocks += held
        try:
            await asyncio.sleep(self.service_s + (n - cached) / self.prefill_tok_s)
        finally:
            self.inflight -= 1
            self.inflight_blocks -= held
        if request.stream:
            yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                token_ids=[self.token_id], prompt_tokens=n, completion_tokens=1, cached_tokens=cached))
        yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
            output_ids=[self.token_id], finish_reason="stop", prompt_tokens=n, completion_tokens=1,
            cached_tokens=cached))


async def _control(engines: list[RecordingEngine], log: list[list[Any]], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while not stop.is_set():
        line = (await reader.readline()).decode().strip()
        if not line:  # EOF: the benchmark went away
            stop.set()
            return
        if line == "reset":
            for e in engines:
                e.reset()
            log.clear()
            out: Any = {"ok": True}
        elif line == "stats":
            out = [e.stats for e in engines]
        elif line == "log":
            out = log
        else:
            out = {"error": f"unknown command {line!r}"}
        sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
        sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    bundle = Path(args.model).resolve()
    served = args.served_model_name or default_served_name(bundle)
    t0 = time.monotonic()
    log: list[list[Any]] = []
    engines, servers = [], []
    for i, port in enumerate(args.ports):
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                          ("grpc.max_send_message_length", _MAX_MESSAGE)])
        engine = RecordingEngine(i, bundle, served, args, t0, log)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(engine, server)
        server.add_insecure_port(f"{args.host}:{port}")
        await server.start()
        engines.append(engine)
        servers.append(server)
    print(f"recording workers listening on {args.host}:{' '.join(map(str, args.ports))}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    control = asyncio.create_task(_control(engines, log, stop))
    await stop.wait()
    control.cancel()
    await asyncio.gather(*(s.stop(grace=0.5) for s in servers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="recording vLLM-wire workers with a simulated prefix cache")
    ap.add_argument("--model", required=True, help="model bundle folder (config.json, generation_config.json)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--ports", type=int, nargs="+", required=True, help="one port per worker")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--token-id", type=int, default=9707, help="the one output token (9707 = 'Hello' in Qwen2 vocab)")
    ap.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    ap.add_argument("--capacity-blocks", type=int, default=256, help="prefix-cache capacity of each worker, in blocks")
    ap.add_argument("--service-ms", type=float, default=10.0, help="simulated time per request besides prefill")
    ap.add_argument("--prefill-tok-s", type=float, default=50_000.0, help="simulated prefill rate of uncached tokens")
    args = ap.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
