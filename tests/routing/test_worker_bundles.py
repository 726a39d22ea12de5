"""Bundles from the workers, crafted archives: ``fetch_worker_bundle`` against a real gRPC server on loopback
serving the vLLM wire's ``GetTokenizer`` (the generated servicer of smg-grpc-proto) with the bytes each test
hands it.

Every refused archive is refused with its reason, leaves nothing in the cache (no entry, no partial folder)
and writes nothing anywhere else: the whole folder around the cache is snapshot before and after.  A good
archive lands at ``cache/<sha256>`` and a second fetch of it reuses that folder.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import stat
import struct
import threading
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.config.settings import BundleLimits
from mmgate.engines.client import WorkerClient
from mmgate.routing.bundles import BundleError, fetch_worker_bundle

CHUNK = 64 * 1024  # smg-grpc-servicer's CHUNK_SIZE
CONFIG = b'{"model_type": "qwen2_vl"}'


@dataclass
class Served:
    """What the crafted worker streams next, and what it saw."""

    chunks: list[common_pb2.GetTokenizerChunk] = field(default_factory=list)
    abort_after: int | None = None  # end the stream with UNAVAILABLE after this many chunks
    repeat_last: int = 0  # stream the last chunk this many more times (a long stream)
    calls: int = 0
    sent: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)


class _Worker(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, served: Served) -> None:
        self.served = served

    def HealthCheck(self, request, context):  # noqa: N802 - the generated servicer's names
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    def GetTokenizer(self, request, context):  # noqa: N802
        served = self.served
        served.calls += 1
        context.add_callback(served.cancelled.set)
        chunks = served.chunks + served.chunks[-1:] * served.repeat_last
        for i, chunk in enumerate(chunks):
            if served.abort_after is not None and i == served.abort_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
            served.sent += 1
            yield chunk


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, Served]]:
    served = Served()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(_Worker(served), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", served
    server.stop(0).wait()


def chunks_of(data: bytes, sha256: str | None = None) -> list[common_pb2.GetTokenizerChunk]:
    """``data`` as the servicer streams it (``tokenizer_chunks``): the digest on the last chunk only."""
    digest = hashlib.sha256(data).hexdigest() if sha256 is None else sha256
    pieces = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    return [common_pb2.GetTokenizerChunk(data=p, sha256=digest if i == len(pieces) - 1 else "")
            for i, p in enumerate(pieces)]


def archive(members: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for info, data in members:
            zf.writestr(info, data)
    return buf.getvalue()


def member(name: str, mode: int = stat.S_IFREG | 0o644) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
    info.external_attr = mode << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def tree(root: Path) -> set[str]:
    """Every path under ``root`` (links not followed), relative."""
    out = set()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            out.add(str(Path(folder, name).relative_to(root)))
    return out


def fetch(target: str, cache: Path, limits: BundleLimits = BundleLimits()) -> Path:
    async def run() -> Path:
        client = WorkerClient(target)
        try:
            return await fetch_worker_bundle(client, cache, limits)
        finally:
            await client.close()

    return asyncio.run(run())


def refused(worker: tuple[str, Served], tmp_path: Path, chunks: list[common_pb2.GetTokenizerChunk],
            limits: BundleLimits = BundleLimits(), **serve: int) -> str:
    """Serve ``chunks``, fetch, and return the refusal's reason, after checking that nothing was written
    outside the cache and nothing stayed in it."""
    target, served = worker
    served.chunks, served.abort_after, served.repeat_last = chunks, serve.get("abort_after"), serve.get("repeat_last", 0)
    served.sent, served.cancelled = 0, threading.Event()
    cache = tmp_path / "cache"
    before = tree(tmp_path)
    with pytest.raises(BundleError) as caught:
        fetch(target, cache, limits)
    assert tree(tmp_path) - {"cache"} == before  # nothing written outside the cache folder
    assert list(cache.iterdir()) == []  # no entry, no partial extraction
    return caught.value.reason


def test_a_member_climbing_out_with_dotdot_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("../x"), b"escaped")])
    assert refused(worker, tmp_path, chunks_of(data)) == "member 1 escapes the folder (..)"


def test_a_member_climbing_out_deeper_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("sub/../../x"), b"escaped")])
    assert refused(worker, tmp_path, chunks_of(data)) == "member 1 escapes the folder (..)"


def test_an_absolute_member_path_is_refused(worker, tmp_path: Path) -> None:
    outside = tmp_path / "abs.txt"
    data = archive([("config.json", CONFIG), (member(str(outside)), b"absolute")])
    assert refused(worker, tmp_path, chunks_of(data)) == "member 1 has an absolute path"
    assert not outside.exists()


def test_a_symlink_member_is_refused(worker, tmp_path: Path) -> None:
    # a link named tokenizer.json pointing out of the cache, then a file written "through" it
    data = archive([("config.json", CONFIG), (member("tokenizer.json", stat.S_IFLNK | 0o777), b"../../victim")])
    assert refused(worker, tmp_path, chunks_of(data)) == "member 1 is a symbolic link"


def test_a_device_or_fifo_member_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("pipe", stat.S_IFIFO | 0o644), b"")])
    assert refused(worker, tmp_path, chunks_of(data)) == "member 1 is not a regular file or folder"


@pytest.mark.parametrize("name", ["to\\ken.json", "tok en.json", "tok\u00e9n.json", ".hidden", "a//b", "C:evil"])
def test_member_names_with_odd_characters_are_refused(worker, tmp_path: Path, name: str) -> None:
    data = archive([("config.json", CONFIG), (member(name), b"x")])
    assert refused(worker, tmp_path, chunks_of(data)) == ("member 1 has an absolute path" if name.startswith("C:") else "member 1 has an unsafe name")


def test_a_member_declaring_more_than_the_file_bound_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("tokenizer.json"), b"\0" * 5000)])
    limits = BundleLimits(max_member_bytes=4096)
    assert refused(worker, tmp_path, chunks_of(data), limits) == "member 1 declares more than 4096 bytes"


def test_members_declaring_more_than_the_unpacked_bound_together_are_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("a.json"), b"\0" * 3000), (member("b.json"), b"\0" * 3000)])
    limits = BundleLimits(max_member_bytes=4096, max_unpacked_bytes=4096)
    assert refused(worker, tmp_path, chunks_of(data), limits) == "the archive declares more than 4096 bytes unpacked"


def _lie_about_size(data: bytes, name: bytes, declared: int) -> bytes:
    """Rewrite the uncompressed size of member ``name`` to ``declared`` in its local header and in the
    central directory (a bomb that declares little and inflates to much)."""
    out = bytearray(data)
    # (signature, offset of the name's length, fixed size before the name, offset of the size):
    # the local file header, then the central-directory record (APPNOTE 4.3.7, 4.3.12)
    for signature, name_len_at, fixed, size_at in ((b"PK\x03\x04", 26, 30, 22), (b"PK\x01\x02", 28, 46, 24)):
        at = out.find(signature)
        while at >= 0:
            name_len = struct.unpack_from("<H", out, at + name_len_at)[0]
            if bytes(out[at + fixed:at + fixed + name_len]) == name:
                struct.pack_into("<I", out, at + size_at, declared)
            at = out.find(signature, at + 4)
    return bytes(out)


def test_a_member_inflating_past_its_declared_size_is_refused(worker, tmp_path: Path) -> None:
    honest = archive([("config.json", CONFIG), (member("tokenizer.json"), b"\0" * 1_000_000)])
    bomb = _lie_about_size(honest, b"tokenizer.json", 100)
    reason = refused(worker, tmp_path, chunks_of(bomb))
    assert reason == "member 1 does not unpack to its declared size and CRC"


def test_too_many_members_are_refused_before_the_directory_is_read(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG)] + [(member(f"f{i}.txt"), b"x") for i in range(50)])  # 51 members
    assert refused(worker, tmp_path, chunks_of(data)) == "the archive has more than 50 members"  # SMG's bound


def test_a_wrong_sha256_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG)])
    other = hashlib.sha256(b"another archive").hexdigest()
    assert refused(worker, tmp_path, chunks_of(data, other)) == "the archive's sha256 differs from the one the worker sent"


def test_a_stream_ending_before_its_last_chunk_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("vocab.json"), os.urandom(200_000))])
    whole = chunks_of(data)
    assert len(whole) == 4
    reason = refused(worker, tmp_path, whole[:2])  # the stream closes cleanly, without the digest's chunk
    assert reason == "GetTokenizer ended without the archive's sha256 (a truncated stream)"


def test_a_stream_broken_by_the_worker_is_refused(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("vocab.json"), os.urandom(200_000))])
    reason = refused(worker, tmp_path, chunks_of(data), abort_after=2)
    assert reason == "GetTokenizer failed: engine unavailable (UNAVAILABLE)"


def test_an_empty_stream_is_refused(worker, tmp_path: Path) -> None:
    assert refused(worker, tmp_path, []) == "GetTokenizer streamed no chunk"


def test_an_archive_without_config_json_is_refused(worker, tmp_path: Path) -> None:
    data = archive([(member("tokenizer.json"), b"{}")])
    assert refused(worker, tmp_path, chunks_of(data)) == "the archive has no config.json"


def test_bytes_that_are_no_zip_are_refused(worker, tmp_path: Path) -> None:
    assert refused(worker, tmp_path, chunks_of(b"not a zip at all")) == "the archive is not a readable ZIP"


def test_reading_stops_past_the_archive_bound(worker, tmp_path: Path) -> None:
    data = archive([("config.json", CONFIG), (member("vocab.json"), os.urandom(300_000))])
    limits = BundleLimits(max_archive_bytes=256 * 1024)
    # 4 chunks of the archive, then its last chunk 4096 more times: a 256 MiB stream if read to the end
    reason = refused(worker, tmp_path, chunks_of(data), limits, repeat_last=4096)
    assert reason == f"GetTokenizer failed: the bundle archive exceeds {256 * 1024} bytes"
    _, served = worker
    assert served.cancelled.wait(10)  # the gateway cancelled the call ...
    assert served.sent < 4096  # ... long before the worker got to the end


def test_a_good_archive_lands_at_its_digest_and_a_second_fetch_reuses_it(worker, tmp_path: Path) -> None:
    target, served = worker
    data = archive([("config.json", CONFIG), (member("sub/", stat.S_IFDIR | 0o755), b""), (member("sub/vocab.json"), b'{"a": 0}'),
                    ("tokenizer_config.json", b"{}")])
    digest = hashlib.sha256(data).hexdigest()
    served.chunks, served.abort_after, served.repeat_last, served.calls = chunks_of(data), None, 0, 0
    cache = tmp_path / "cache"
    before = tree(tmp_path)

    path = fetch(target, cache)
    assert path == cache / digest
    assert tree(path) == {"config.json", "sub", "sub/vocab.json", "tokenizer_config.json"}
    assert (path / "config.json").read_bytes() == CONFIG
    assert (path / "sub" / "vocab.json").read_bytes() == b'{"a": 0}'
    assert tree(tmp_path) - before == {"cache", f"cache/{digest}"} | {f"cache/{digest}/{p}" for p in tree(path)}
    inode = (path / "config.json").stat().st_ino

    again = fetch(target, cache)
    assert again == path
    assert (path / "config.json").stat().st_ino == inode  # the entry kept, not unpacked again
    assert [p.name for p in cache.iterdir()] == [digest]
    # the wire says the digest on the last chunk only: the archive is streamed again, never unpacked again
    assert served.calls == 2


def test_the_digest_of_the_wire_is_taken_in_upper_case_too(worker, tmp_path: Path) -> None:
    target, served = worker  # SMG's validate_bundle_sha256 compares ignoring case
    data = archive([("config.json", CONFIG)])
    digest = hashlib.sha256(data).hexdigest()
    served.chunks, served.abort_after, served.repeat_last = chunks_of(data, digest.upper()), None, 0
    assert fetch(target, tmp_path / "cache") == tmp_path / "cache" / digest


def test_a_cache_folder_that_cannot_be_written_is_a_bundle_error(worker, tmp_path: Path) -> None:
    target, served = worker
    served.chunks, served.abort_after, served.repeat_last = chunks_of(archive([("config.json", CONFIG)])), None, 0
    blocker = tmp_path / "cache"
    blocker.write_bytes(b"a file where the cache folder should be")
    with pytest.raises(BundleError) as caught:
        fetch(target, blocker)
    assert caught.value.reason == "the bundle cache folder cannot be written (File exists)"
    assert tree(tmp_path) == {"cache"}


def test_a_fetch_cancelled_midway_leaves_nothing_in_the_cache(worker, tmp_path: Path) -> None:
    target, served = worker
    data = archive([("config.json", CONFIG), (member("vocab.json"), os.urandom(300_000))])
    served.chunks, served.abort_after, served.repeat_last = chunks_of(data), None, 4096  # a 256 MiB stream
    served.sent, served.cancelled = 0, threading.Event()
    cache = tmp_path / "cache"

    async def run() -> None:
        client = WorkerClient(target)
        try:
            task = asyncio.create_task(fetch_worker_bundle(client, cache, BundleLimits()))
            while served.sent < 8 and not task.done():  # the download is under way
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await client.close()

    asyncio.run(run())
    assert served.cancelled.wait(10)
    assert list(cache.iterdir()) == []
