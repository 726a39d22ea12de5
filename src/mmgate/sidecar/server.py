"""``mmgate sidecar``: a GPU-free media-processing sidecar serving workers over Redis.

Stage: worker-side processing, out of the engine's process.  In: jobs popped
from ``smg:mm:v1:{namespace}:jobs``; out: one result per job on
``:res:{job_id}`` (expires after 120 s): the expanded prompt and full tensors,
or a failure code (:mod:`mmgate.sidecar.protocol`).

Usage::

    mmgate sidecar --model M --redis-url URL [--namespace NS] [--concurrency 2] [processing flags]

The URL falls back to ``$SMG_VLLM_MM_REDIS_URL``, then ``redis://127.0.0.1:6379/0``;
the namespace defaults to the first 16 hex digits of the processing fingerprint,
which the engine derives the same way from the same flags.  Every
``--hello-refresh-s`` (5) seconds the hello HASH (fingerprint, schemes, result
limit) is rewritten with a ``--hello-ttl-s`` (15) second expiry; a stopped
sidecar deletes it, a crashed one lets it lapse.

Per job: a job whose deadline has passed is answered ``expired`` without being
fetched; one made under another fingerprint ``fingerprint_mismatch``;
processing is cut at the deadline (``deadline_exceeded``).  A result whose
encoding is at or above the result limit (``--max-result-bytes``, 512 MiB,
lowered to the server's ``proto-max-bulk-len``) is not pushed: a small
``result_too_large`` answer goes instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from mmgate.errors import GatewayError
from mmgate.config.options import add_option
from mmgate.config.settings import ENV_MODEL_PATH, add_model_options, split_search_path
from mmgate.sidecar.config import ProcessingConfig, add_processing_arguments, processing_config
from mmgate.sidecar.processor import MediaProcessor, item_index, load_runtime, refs_from_items
from mmgate.sidecar.protocol import (
    CODE_BAD_JOB,
    CODE_DEADLINE,
    CODE_EXPIRED,
    CODE_FINGERPRINT,
    CODE_PROCESSOR_ERROR,
    CODE_RESULT_TOO_LARGE,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_REDIS_URL,
    ENV_REDIS_URL,
    HELLO_REFRESH_S,
    HELLO_TTL_S,
    RESULT_TTL_S,
    SCHEMA_VERSION,
    Job,
    JobResult,
    Keys,
    batch_to_wire,
    decode_job,
    default_namespace,
    encode,
    failure,
)

log = logging.getLogger("mmgate.sidecar")

JOB_WAIT_S = 1.0  # one BRPOP; short, so a stop is prompt
CONTROL_TIMEOUT_S = 2.0  # bound on any other Redis round trip
PUSH_FLOOR_S = 5.0  # the least time a result push gets, even past the deadline
BULK_LIMIT = "proto-max-bulk-len"


async def learn_result_limit(client: aioredis.Redis, configured: int) -> int:
    """``configured``, lowered to the server's ``proto-max-bulk-len`` when that is smaller and readable."""
    try:
        reply = await asyncio.wait_for(client.config_get(BULK_LIMIT), CONTROL_TIMEOUT_S)
        server = int(str(next(iter(reply.values()))))
    except (RedisError, TimeoutError, StopIteration, ValueError) as exc:
        log.info("result limit %d bytes (%s not readable: %s)", configured, BULK_LIMIT, exc)
        return configured
    return min(configured, server)


class Sidecar:
    """Heartbeat + ``concurrency`` job loops over one Redis namespace."""

    def __init__(self, processor: MediaProcessor, client: aioredis.Redis, keys: Keys, *, concurrency: int = 2,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES, hello_ttl_s: float = HELLO_TTL_S,
                 hello_refresh_s: float = HELLO_REFRESH_S) -> None:
        self.processor = processor
        self.client = client
        self.keys = keys
        self.concurrency = max(1, concurrency)
        self.max_result_bytes = max_result_bytes
        self.hello_ttl_s = hello_ttl_s
        self.hello_refresh_s = hello_refresh_s
        self._stop = asyncio.Event()
        self._started = time.time()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self.max_result_bytes = await learn_result_limit(self.client, self.max_result_bytes)
        log.info("media sidecar for %s under %s: fingerprint %s, concurrency %d, result limit %d bytes",
                 self.processor.runtime.bundle.name, self.keys.prefix, self.processor.fingerprint[:16],
                 self.concurrency, self.max_result_bytes)
        tasks = [asyncio.create_task(self._heartbeat())]
        tasks += [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]
        try:
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await asyncio.wait_for(self.client.delete(self.keys.hello), CONTROL_TIMEOUT_S)
            except (RedisError, TimeoutError):
                pass
            await self.processor.aclose()

    def hello_mapping(self) -> dict[str, str]:
        return {
            "schema": str(SCHEMA_VERSION), "fingerprint": self.processor.fingerprint,
            "schemes": self.processor.schemes_label, "max_result_bytes": str(self.max_result_bytes),
            "model": self.processor.runtime.bundle.name, "started_at": str(int(self._started)),
            "settings": msgspec.json.encode(self.processor.description).decode(),
        }

    async def _heartbeat(self) -> None:
        mapping: dict[Any, Any] = self.hello_mapping()
        while True:
            try:  # one transaction: the hello never lives without its expiry
                pipe = self.client.pipeline(transaction=True)
                pipe.hset(self.keys.hello, mapping=mapping)
                pipe.pexpire(self.keys.hello, int(self.hello_ttl_s * 1000))
                await asyncio.wait_for(pipe.execute(), self.hello_ttl_s)
            except (RedisError, TimeoutError) as exc:
                log.warning("hello refresh failed: %s", exc)
            await asyncio.sleep(self.hello_refresh_s)

    async def _worker(self, index: int) -> None:
        while True:
            try:
                popped = await asyncio.wait_for(self.client.brpop([self.keys.jobs], timeout=JOB_WAIT_S),
                                                JOB_WAIT_S + CONTROL_TIMEOUT_S)
            except (RedisError, TimeoutError) as exc:
                log.warning("worker %d: waiting for a job failed: %s", index, exc)
                await asyncio.sleep(1.0)
                continue
            if popped is None:
                continue
            try:
                job = decode_job(cast(bytes, popped[1]))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("worker %d: undecodable job dropped: %s", index, exc)
                continue
            try:
                result = await self.handle(job)
            except Exception as exc:  # noqa: BLE001 - one bad job must not end the loop
                log.exception("worker %d: job %s failed", index, job.job_id)
                result = failure(job.job_id, CODE_PROCESSOR_ERROR, f"{type(exc).__name__}: {exc}")
            await self._deliver(job, result)

    async def handle(self, job: Job) -> JobResult:
        """Process one job into its result (never raises for the job's own faults)."""
        started = time.time()
        if job.v != SCHEMA_VERSION:
            return failure(job.job_id, CODE_BAD_JOB, f"job schema v{job.v}, sidecar speaks v{SCHEMA_VERSION}")
        remaining = job.deadline_ms / 1000 - started
        if remaining <= 0:
            return failure(job.job_id, CODE_EXPIRED, "the job's deadline passed before processing began")
        if job.fingerprint != self.processor.fingerprint:
            return failure(job.job_id, CODE_FINGERPRINT, "the job was made for other processing settings")
        try:
            refs = refs_from_items([(i.modality, i.url) for i in job.items])
        except ValueError as exc:
            return failure(job.job_id, CODE_BAD_JOB, str(exc))
        try:
            done = await asyncio.wait_for(self.processor.process(job.prompt_token_ids, refs), remaining)
        except TimeoutError:
            return failure(job.job_id, CODE_DEADLINE, f"processing passed the job's deadline ({remaining:.1f} s)")
        except GatewayError as exc:
            index = item_index(exc.param)
            return failure(job.job_id, exc.code.value, exc.message, -1 if index is None else index)
        timing = dict(done.timings_ms)
        timing["queue"] = max(0.0, started * 1000 - job.enqueued_ms)
        return JobResult(v=SCHEMA_VERSION, job_id=job.job_id, ok=True, fingerprint=self.processor.fingerprint,
                         prompt_token_ids=list(done.input_ids), batches=[batch_to_wire(b) for b in done.batches],
                         timing_ms=timing)

    async def _deliver(self, job: Job, result: JobResult) -> None:
        raw = encode(result)
        if len(raw) >= self.max_result_bytes:
            log.warning("result of job %s is %d bytes, at or above the %d-byte limit: not pushed",
                        job.job_id, len(raw), self.max_result_bytes)
            raw = encode(failure(job.job_id, CODE_RESULT_TOO_LARGE,
                                 f"the processed media is {len(raw)} bytes, at or above the sidecar's "
                                 f"{self.max_result_bytes}-byte result limit; send fewer or smaller items"))
        key = self.keys.result(job.job_id)
        budget = max(PUSH_FLOOR_S, job.deadline_ms / 1000 - time.time())
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.lpush(key, raw)
            pipe.expire(key, RESULT_TTL_S)
            await asyncio.wait_for(pipe.execute(), budget)
        except (RedisError, TimeoutError) as exc:
            log.error("result push failed for job %s: %s", job.job_id, exc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmgate sidecar",
                                description="GPU-free media-processing sidecar for workers (Redis lists).")
    g = p.add_argument_group("sidecar")
    add_model_options(g)
    add_option(g, "--redis-url", default=DEFAULT_REDIS_URL, env=(ENV_REDIS_URL,), metavar="URL",
               help="Redis the jobs and results travel through")
    add_option(g, "--namespace", metavar="NS", help="key namespace (default: derived from the fingerprint)")
    add_option(g, "--concurrency", type=int, default=2, help="jobs processed at once")
    add_option(g, "--max-result-bytes", type=int, default=DEFAULT_MAX_RESULT_BYTES,
               help="results at or above this are not pushed (lowered to redis proto-max-bulk-len)")
    add_option(g, "--hello-ttl-s", type=float, default=HELLO_TTL_S, help="expiry of the hello key, seconds")
    add_option(g, "--hello-refresh-s", type=float, default=HELLO_REFRESH_S,
               help="how often the hello is rewritten, seconds")
    add_processing_arguments(p)
    return p


async def serve(runtime_model: str, search_path: Sequence[Path], config: ProcessingConfig, redis_url: str,
                namespace: str | None, ns: argparse.Namespace) -> None:
    processor = MediaProcessor(load_runtime(runtime_model, search_path, config), config)
    keys = Keys.for_namespace(namespace or default_namespace(processor.fingerprint))
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=CONTROL_TIMEOUT_S, socket_timeout=None)
    sidecar = Sidecar(processor, client, keys, concurrency=ns.concurrency, max_result_bytes=ns.max_result_bytes,
                      hello_ttl_s=ns.hello_ttl_s, hello_refresh_s=ns.hello_refresh_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sidecar.stop)
    try:
        await sidecar.run()
    finally:
        await client.aclose()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the sidecar until SIGTERM/SIGINT; 2 when the model cannot be loaded."""
    env = os.environ if environ is None else environ
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.concurrency < 1 or ns.max_result_bytes < 1 or ns.hello_ttl_s <= 0 or ns.hello_refresh_s <= 0:
        parser.error("--concurrency, --max-result-bytes, --hello-ttl-s and --hello-refresh-s must be positive")
    if ns.hello_refresh_s >= ns.hello_ttl_s:
        parser.error("--hello-refresh-s must be shorter than --hello-ttl-s")
    config = processing_config(ns, parser, env)
    logging.basicConfig(stream=sys.stderr, level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redis_url = ns.redis_url or env.get(ENV_REDIS_URL) or DEFAULT_REDIS_URL
    search_path = split_search_path(ns.model_path or env.get(ENV_MODEL_PATH))
    try:
        asyncio.run(serve(ns.model, search_path, config, redis_url, ns.namespace, ns))
    except GatewayError as exc:
        log.error("mmgate sidecar: %s", exc.message)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
