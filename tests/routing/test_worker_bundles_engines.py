"""Bundles from the workers, real engines: ``mmgate engine --wire vllm|sglang|tokenspeed`` serves its bundle
folder with ``GetTokenizer``; ``fetch_worker_bundle`` turns it into ``cache/<sha256>``, which loads and
tokenizes as the original folder does.

Expected values come from the reference: the archive is the one smg-grpc-servicer 0.14.1 builds for the same
folder (``smg_grpc_servicer.tokenizer_bundle.TokenizerBundle.build``: same bytes, same digest), its files are
the original's bytes, and the fetched folder's tokenizer is compared with transformers' ``AutoTokenizer`` on
the original folder.  One engine start per wire.
"""

from __future__ import annotations

import asyncio
import io
import zipfile
from pathlib import Path

import pytest
from smg_grpc_servicer.tokenizer_bundle import TokenizerBundle

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.cli.launch import start_engine
from mmgate.config.settings import BundleLimits
from mmgate.engines.client import WorkerClient
from mmgate.models.backend import ImageBackend
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import load_family
from mmgate.routing.bundles import fetch_worker_bundle
from tests.conftest import bundle_dir

TEXTS = ("Hello, world! Describe the picture in two words.",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
         "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
         "Unicode: 你好, émigré, 🙂 and tabs\tand  double  spaces.")


async def _fetch(port: int, cache: Path) -> Path:
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        return await fetch_worker_bundle(client, cache, BundleLimits())
    finally:
        await client.close()


@pytest.mark.parametrize(("wire", "model"), [("vllm", "Qwen--Qwen2.5-VL-7B-Instruct"),
                                             ("sglang", "google--gemma-3-4b-it"),
                                             ("tokenspeed", "Qwen--Qwen2-VL-2B-Instruct")])
def test_an_engines_bundle_round_trips_into_a_folder_that_loads_as_the_original(wire: str, model: str,
                                                                                tmp_path: Path) -> None:
    original = bundle_dir(model)
    engine = start_engine(str(original), extra=["--wire", wire], log_dir=tmp_path)
    try:
        fetched = asyncio.run(_fetch(engine.port, tmp_path / "cache"))
    finally:
        engine.stop()

    # the archive smg-grpc-servicer builds for this folder: its digest names the entry, its files are there
    reference, digest = TokenizerBundle.build(original)
    assert fetched == tmp_path / "cache" / digest
    with zipfile.ZipFile(io.BytesIO(reference)) as zf:
        names = sorted(zf.namelist())
    assert "config.json" in names and not any(n.endswith(".safetensors") for n in names)
    assert sorted(p.name for p in fetched.iterdir()) == names
    for name in names:
        assert (fetched / name).read_bytes() == (original / name).read_bytes(), name

    # mmgate's loaders read the fetched folder as they read the original
    got, want = load_bundle(fetched, name=model), load_bundle(original, name=model)
    assert (got.config, got.preprocessor_config, got.video_preprocessor_config, got.processor_config,
            got.tokenizer_config, got.generation_config, got.chat_template) == (
        want.config, want.preprocessor_config, want.video_preprocessor_config, want.processor_config,
        want.tokenizer_config, want.generation_config, want.chat_template)
    got_tok, want_tok = load_tokenizer(got), load_tokenizer(want)
    got_family = load_family(got, got_tok, ImageBackend.AUTO)
    want_family = load_family(want, want_tok, ImageBackend.AUTO)
    assert got_family is not None and want_family is not None and got_family.image is not None
    assert got_family.fingerprint == want_family.fingerprint
    assert got_family.image.expand(got_family.image.plan(480, 640)) == \
        want_family.image.expand(want_family.image.plan(480, 640))

    # ... and tokenize as the reference tokenizer of the original folder does
    from transformers import AutoTokenizer

    reference_tok = AutoTokenizer.from_pretrained(original)
    for text in TEXTS:
        assert got_tok.encode_prompt(text) == reference_tok(text)["input_ids"], text
