"""``GetTokenizer`` on every wire: the engine's bundle folder as a ZIP streamed in chunks.

Stage: engine (management RPC, all three wires).  In: the tokenizer folder the engine reports as
``tokenizer_path`` (its ``--model`` folder); out: ``GetTokenizerChunk`` messages (smg-grpc-proto
``common.proto``: ``data`` = the next bytes of the archive, ``sha256`` = the SHA-256 hex digest of the
whole archive on the last chunk only, empty before).

A port of smg-grpc-servicer 0.14.1 ``smg_grpc_servicer/tokenizer_bundle.py`` (the reference engine's
extra does not install that package): :func:`build_tokenizer_zip` writes the same files in the same
order with the same ``zipfile`` calls, so for one folder the archive's bytes and digest equal the
servicer's (``tests/routing/test_worker_bundles.py`` checks that); :class:`TokenizerBundle` builds it
once, on the first call, and serves it from memory after that (the folder is the model's, fixed for
the engine's lifetime; a failed build is not kept); :func:`serve_tokenizer` is the servicers'
``GetTokenizer`` (``vllm/servicer.py``, ``sglang/servicer.py``, ``tokenspeed/servicer.py``): no folder
-> ``FAILED_PRECONDITION`` "Tokenizer path is not configured on this server."; a build failure ->
``INTERNAL`` with its message.  The reference engine's servicers are synchronous (a thread per RPC),
so the build runs on the calling RPC thread, under a lock, where the servicers' asyncio code awaits a
worker thread; health checks keep their own threads (``MANAGEMENT_THREADS``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2

logger = logging.getLogger("mmgate.refengine")

#: bytes per ``GetTokenizerChunk`` (``CHUNK_SIZE``, "aligned with Rust grpc_client limits")
CHUNK_SIZE = 64 * 1024
#: files taken by exact name, in this order (``TOKENIZER_FILES``: SMG ``crates/tokenizer/src/hub.rs``
#: ``is_tokenizer_file`` plus the model and processor configs); never weights
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
#: then every file matching these, by glob order (``TOKENIZER_GLOBS``)
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja", "*.model")


def build_tokenizer_zip(tokenizer_dir: Path) -> bytes:
    """The ZIP (deflated) of ``tokenizer_dir``'s tokenizer, config and processor files, flat, as
    ``build_tokenizer_zip`` writes it.

    Raises:
        FileNotFoundError: none of the files is in the folder.
    """
    buf = io.BytesIO()
    added: set[str] = set()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            path = tokenizer_dir / name
            if path.is_file():
                zf.write(path, name)
                added.add(name)
        for pattern in TOKENIZER_GLOBS:
            for match in tokenizer_dir.glob(pattern):
                if match.is_file() and match.name not in added:
                    zf.write(match, match.name)
                    added.add(match.name)
    if not added:
        raise FileNotFoundError(f"No tokenizer files found in {tokenizer_dir}")
    return buf.getvalue()


def tokenizer_chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    """``data`` as chunks of at most :data:`CHUNK_SIZE` bytes, in order; ``sha256`` on the last one only."""
    for offset in range(0, len(data), CHUNK_SIZE):
        end = min(offset + CHUNK_SIZE, len(data))
        yield common_pb2.GetTokenizerChunk(data=data[offset:end], sha256=sha256 if end == len(data) else "")


class TokenizerBundle:
    """One folder's archive and its SHA-256 hex digest, built on first use and kept (``TokenizerBundle``)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir  # "" when the engine has none
        self._archive: tuple[bytes, str] | None = None
        self._lock = threading.Lock()

    def archive(self) -> tuple[bytes, str]:
        """(archive bytes, SHA-256 hex digest); callers during a build wait for it.

        Raises:
            FileNotFoundError / OSError: the build failed (the next call tries again).
        """
        with self._lock:
            if self._archive is None:
                data = build_tokenizer_zip(Path(self.tokenizer_dir))
                self._archive = data, hashlib.sha256(data).hexdigest()
            return self._archive


def serve_tokenizer(bundle: TokenizerBundle, context: grpc.ServicerContext) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The body of every wire's ``GetTokenizer``: the bundle's chunks, or the RPC ended with a status."""
    logger.info("Receive GetTokenizer request")
    if not bundle.tokenizer_dir:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Tokenizer path is not configured on this server.")
    try:
        data, sha256 = bundle.archive()
    except Exception as exc:  # noqa: BLE001 - the servicers end the RPC with INTERNAL and the message
        logger.exception("Failed to build tokenizer ZIP")
        context.abort(grpc.StatusCode.INTERNAL, str(exc))
    logger.info("Streaming tokenizer bundle: %d bytes, sha256=%s", len(data), sha256)
    yield from tokenizer_chunks(data, sha256)


class ServesTokenizer:
    """The ``GetTokenizer`` RPC of a wire's servicer (listed first among its bases, so it answers
    instead of the generated ``UNIMPLEMENTED`` stub); the servicer sets ``_tokenizer``."""

    _tokenizer: TokenizerBundle

    def GetTokenizer(self, request: Any, context: grpc.ServicerContext) -> Iterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer folder as a ZIP in chunks, its SHA-256 on the last (:func:`serve_tokenizer`)."""
        yield from serve_tokenizer(self._tokenizer, context)
