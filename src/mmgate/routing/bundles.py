"""Bundles from the workers: a worker's ``GetTokenizer`` archive, checked, unpacked into the cache.

Stage: select worker (worker registration).  In: a worker's client, the cache folder, the bounds
(:class:`~mmgate.config.settings.BundleLimits`); out: ``cache_dir/<sha256>``, a bundle folder the
loaders read (:func:`mmgate.models.bundle.load_bundle`, :func:`mmgate.chat.tokenizer.load_tokenizer`,
:func:`mmgate.models.registry.load_family`), or :class:`BundleError` with a short reason for
``GET /workers``.

What the wire gives (smg-grpc-proto ``common.proto`` ``GetTokenizerChunk``; smg-grpc-servicer 0.14.1
``tokenizer_bundle.py``): the ZIP's bytes in chunks, its SHA-256 hex digest on the last chunk only.
So the digest is known only once the whole archive is read: a bundle already in the cache is reused
after the download (nothing is unpacked again), never instead of it.

The rules, those of the Rust gateway (lightseekorg/smg ``crates/grpc_client/src/tokenizer_bundle.rs``:
``collect_stream_bundle``, ``validate_bundle_sha256``, ``validate_zip_archive``) and more:

* the stream: at most ``max_archive_bytes`` (reading stops past it) within ``timeout_s``
  (:meth:`~mmgate.engines.client.WorkerClient.get_tokenizer`); no chunk, no digest on the last chunk
  (a truncated stream), or a digest that is not the archive's: refused;
* the archive, before anything is unpacked: its end record and central directory (where ``zipfile``
  would otherwise build an entry per record, however many) bounded by ``max_members``; every member
  stored or deflated, not encrypted, a regular file or a folder (the Unix mode in ``external_attr``:
  a symlink, device or pipe is refused), its name made of ``[A-Za-z0-9._+-]`` parts, none empty,
  ``.`` or ``..``, none starting with a dot, no absolute path, no backslash, no drive, no duplicate;
  the declared sizes within ``max_member_bytes`` each and ``max_unpacked_bytes`` together;
  ``config.json`` present (the loaders need it);
* unpacking: the bytes counted as they come out, against the same bounds and the declared size
  (a member that inflates past what it declared is a bomb, or a lie), CRCs checked by ``zipfile``.

Where it writes: only inside ``cache_dir``.  The archive and its unpacked files go to a fresh
``cache_dir/.partial-*`` folder (files created exclusively, folders made by this code, so nothing there
is a link); the unpacked folder is renamed into ``cache_dir/<sha256>`` in one ``rename`` (a partial
bundle is never visible under a digest), and the partial folder is removed whatever happened.
Two fetches of one digest race harmlessly: the second rename fails and the entry already there is used.
A ``.partial-*`` folder left by a killed process is not a bundle (no digest name) and may be deleted.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
import stat
import struct
import tempfile
import zipfile
import zlib
from pathlib import Path

from mmgate.config.settings import BundleLimits
from mmgate.engines.client import WorkerClient
from mmgate.errors import GatewayError

#: one part of a member's name: a letter, digit or underscore, then those, dots, plus and minus signs
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_DRIVE = re.compile(r"[A-Za-z]:")  # a Windows drive: C:...
_EOCD = b"PK\x05\x06"  # end of central directory record
_EOCD_SIZE = 22
_CENTRAL_RECORD_MAX = 46 + 255 + 1024  # a central-directory record: fixed part, name, room for extras
_COPY_BYTES = 1 << 16
_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)


class BundleError(Exception):
    """A worker's bundle could not be had; ``reason`` is short, for ``GET /workers`` (never the archive's
    content: members are named by index)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def fetch_worker_bundle(client: WorkerClient, cache_dir: Path, limits: BundleLimits) -> Path:
    """The worker's bundle, fetched with ``GetTokenizer``, checked and kept as ``cache_dir/<sha256>``.

    ``cache_dir`` is created when missing.  A bundle of the same digest already there is returned
    without unpacking again.  Unpacking runs in a worker thread.

    Returns:
        ``cache_dir/<sha256>``: the archive's files (config, tokenizer, processor), ``<sha256>`` its hex digest.

    Raises:
        BundleError: the RPC failed or ran out of time, the stream broke the rules, the archive is
            unsafe or too large (the module docstring lists each rule); nothing is left in the cache.
    """
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache_dir))
    except OSError as exc:
        raise BundleError(f"the bundle cache folder cannot be written ({exc.strerror})") from None
    unpacking: asyncio.Future[None] | None = None
    try:
        archive = work / "bundle.zip"
        digest = await _download(client, archive, limits)
        entry = cache_dir / digest
        if entry.is_dir():
            return entry
        unpacked = work / "bundle"
        unpacking = asyncio.ensure_future(asyncio.to_thread(unpack, archive, unpacked, limits))
        await asyncio.shield(unpacking)  # a cancelled fetch leaves the thread's task running (below)
        try:
            unpacked.rename(entry)
        except OSError:
            if not entry.is_dir():  # not a concurrent fetch of the same bundle
                raise BundleError("the bundle could not be moved into the cache") from None
        return entry
    except OSError as exc:  # the cache's disk (full, read-only), not the archive
        raise BundleError(f"the bundle cache folder cannot be written ({exc.strerror})") from None
    finally:
        if unpacking is not None and not unpacking.done():
            # cancelled while the thread unpacks: it cannot be stopped, so its folder goes when it ends
            unpacking.add_done_callback(lambda _: shutil.rmtree(work, ignore_errors=True))
        else:
            shutil.rmtree(work, ignore_errors=True)


async def _download(client: WorkerClient, path: Path, limits: BundleLimits) -> str:
    """Stream the archive into ``path``; its SHA-256 hex digest, checked against the wire's."""
    hasher = hashlib.sha256()
    claimed, chunks = "", 0
    try:
        with path.open("xb") as out:
            async for chunk in client.get_tokenizer(limits.timeout_s, limits.max_archive_bytes):
                chunks += 1
                claimed = chunk.sha256  # the digest rides on the last chunk only
                hasher.update(chunk.data)
                out.write(chunk.data)
    except GatewayError as exc:
        raise BundleError(f"GetTokenizer failed: {exc.message}") from None
    if chunks == 0:
        raise BundleError("GetTokenizer streamed no chunk")
    if not claimed:
        raise BundleError("GetTokenizer ended without the archive's sha256 (a truncated stream)")
    digest = hasher.hexdigest()
    if claimed.lower() != digest:
        raise BundleError("the archive's sha256 differs from the one the worker sent")
    assert _SHA256_HEX.fullmatch(digest)
    return digest


def unpack(archive: Path, dest: Path, limits: BundleLimits) -> None:
    """Check ``archive`` and unpack it into ``dest`` (which must not exist; created here).

    Raises:
        BundleError: the archive breaks a rule of the module docstring (``dest`` may hold part of it).
    """
    _check_directory_size(archive, limits)
    try:
        with zipfile.ZipFile(archive) as zf:
            members = zf.infolist()
            _check_members(members, limits)
            dest.mkdir()
            total = 0
            for index, info in enumerate(members):
                total = _extract(zf, index, info, dest, total, limits)
    except zipfile.BadZipFile:
        raise BundleError("the archive is not a readable ZIP") from None
    except (zlib.error, EOFError, NotImplementedError, RuntimeError, ValueError, struct.error):
        raise BundleError("the archive is corrupt") from None  # zipfile's other complaints about its records


def _check_directory_size(archive: Path, limits: BundleLimits) -> None:
    """Bound the member count and the central directory from the end record, before ``zipfile`` reads it."""
    size = archive.stat().st_size
    with archive.open("rb") as fh:
        tail_len = min(size, _EOCD_SIZE + 0xFFFF)  # the record, then a comment of up to 64 KiB
        fh.seek(size - tail_len)
        tail = fh.read(tail_len)
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < _EOCD_SIZE:
        raise BundleError("the archive is not a readable ZIP")
    _, _, _, entries, directory_bytes, _, _ = struct.unpack("<4HIIH", tail[at + 4:at + _EOCD_SIZE])
    if entries > limits.max_members or directory_bytes > limits.max_members * _CENTRAL_RECORD_MAX:
        raise BundleError(f"the archive has more than {limits.max_members} members")


def _check_members(members: list[zipfile.ZipInfo], limits: BundleLimits) -> None:
    if len(members) > limits.max_members:
        raise BundleError(f"the archive has more than {limits.max_members} members")
    seen: set[str] = set()
    declared = 0
    for index, info in enumerate(members):
        _check_name(index, info.filename)
        name = info.filename.rstrip("/")
        if name in seen:
            raise BundleError(f"member {index} repeats another member's name")
        seen.add(name)
        _check_kind(index, info)
        if info.file_size > limits.max_member_bytes:
            raise BundleError(f"member {index} declares more than {limits.max_member_bytes} bytes")
        declared += info.file_size
        if declared > limits.max_unpacked_bytes:
            raise BundleError(f"the archive declares more than {limits.max_unpacked_bytes} bytes unpacked")
    if "config.json" not in seen:
        raise BundleError("the archive has no config.json")


def _check_name(index: int, name: str) -> None:
    if name.startswith(("/", "\\")) or _DRIVE.match(name):
        raise BundleError(f"member {index} has an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise BundleError(f"member {index} escapes the folder (..)")
    parts = (name[:-1] if name.endswith("/") else name).split("/")
    if len(name) > 1024 or not all(_NAME_PART.fullmatch(part) for part in parts):
        raise BundleError(f"member {index} has an unsafe name")


def _check_kind(index: int, info: zipfile.ZipInfo) -> None:
    """Stored or deflated, not encrypted, and a regular file or a folder: the Unix file type in
    ``external_attr`` (none when the archiver set no Unix mode) agrees with the name's trailing slash."""
    if info.flag_bits & 0x1:
        raise BundleError(f"member {index} is encrypted")
    if info.compress_type not in _METHODS:
        raise BundleError(f"member {index} uses an unsupported compression")
    kind = stat.S_IFMT(info.external_attr >> 16)
    if kind == stat.S_IFLNK:
        raise BundleError(f"member {index} is a symbolic link")
    expected = stat.S_IFDIR if info.is_dir() else stat.S_IFREG
    if kind not in (0, expected) or (info.is_dir() and info.file_size):
        raise BundleError(f"member {index} is not a regular file or folder")


def _extract(zf: zipfile.ZipFile, index: int, info: zipfile.ZipInfo, dest: Path, total: int,
             limits: BundleLimits) -> int:
    """Write one checked member under ``dest``, counting its bytes; the unpacked total so far."""
    target = dest.joinpath(*info.filename.rstrip("/").split("/"))
    try:
        if info.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            return total
        target.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        with zf.open(info) as src, target.open("xb") as out:
            while piece := src.read(_COPY_BYTES):
                written += len(piece)
                total += len(piece)
                if written > min(info.file_size, limits.max_member_bytes):
                    raise BundleError(f"member {index} unpacks past its declared size")
                if total > limits.max_unpacked_bytes:
                    raise BundleError(f"the archive unpacks past {limits.max_unpacked_bytes} bytes")
                out.write(piece)
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        raise BundleError(f"member {index} clashes with another member") from None
    except (zipfile.BadZipFile, zlib.error, EOFError):
        # zipfile stops a member at its declared size and then checks the CRC: bytes past the declared
        # size (a bomb declaring little) end here, as do damaged ones
        raise BundleError(f"member {index} does not unpack to its declared size and CRC") from None
    if written != info.file_size:
        raise BundleError(f"member {index} unpacks to fewer bytes than it declares")
    return total
