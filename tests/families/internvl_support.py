"""InternVL3's golden replay (``golden/internvl.json``, written by ``scripts/gen_golden.py --family internvl``).

Two replay functions for ``replay.FAMILIES``: a pixel row (grid, patch count, token count, the
batch, sha256 and probe) and a conversation (rendered + tokenized by mmgate, each
``<IMG_CONTEXT>`` anchor spliced with ``expand(plan).token_ids``; the ranges are the whole
``<img> ... </img>`` runs, as vLLM's ``select_text`` places them).
"""

from __future__ import annotations

import numpy as np
from parity_support import collapse_runs, probe8, sha256_f32le, sha256_ids, template_messages

from mmgate.chat.template import render_chat
from mmgate.models.family import assemble
from mmgate.pipeline.planning import splice_all

INTERNVL_GOLDEN = "internvl"


def internvl_row(name: str, row: dict) -> None:
    """Grid ``(cols, rows)``, ``num_patches``, token count, the batch's keys, shape, probe and sha256."""
    from replay import decoded, family_for, row_label, versions_note

    proc = family_for(row["bundle"], row["backend"]).image
    label = row_label(name, row)
    image = decoded(name, row["image"])
    plan = proc.plan(image.height, image.width)
    assert list(plan.detail) == row["grid"], label
    assert plan.primary_shape[0] == row["num_patches"], label
    assert plan.num_tokens == row["num_image_tokens"], label
    batch = assemble(proc, [plan], [proc.preprocess(image, plan)])
    pv = batch.tensors["pixel_values"]
    assert set(batch.tensors) == {"pixel_values", "image_num_patches", "image_token_id"}, label  # vLLM's keys
    assert batch.tensors["image_num_patches"].tolist() == [row["num_patches"]], label
    assert int(batch.tensors["image_token_id"]) == proc.placeholder_token_id, label
    assert pv.dtype == np.float32 and list(pv.shape) == row["pixel_values_shape"], label
    assert probe8(pv) == row["probe"], f"{label}: probe values differ {versions_note(name)}"
    assert sha256_f32le(pv) == row["pixel_values_sha256"], f"{label}: pixel_values differ {versions_note(name)}"


def internvl_conversation(name: str, conv: dict, backend: str) -> None:
    """Rendered prompt, ids, each range the whole ``<img>`` ... ``</img>`` run, the batch."""
    from replay import bundle_and_tokenizer, decoded, family_for

    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    proc = family_for(conv["bundle"], backend).image
    prompt = render_chat(bundle.chat_template, template_messages(conv["turns"]), tok.special_tokens)
    assert prompt == conv["prompt"]
    anchored = tok.encode_prompt(prompt)
    images = [decoded(name, n) for n in conv["images"]]
    plans = [proc.plan(im.height, im.width) for im in images]
    reps = [proc.expand(pl) for pl in plans]
    ids, ranges = splice_all(anchored, {proc.anchor_token_id: reps})
    assert collapse_runs(ids, proc.placeholder_token_id) == (conv["input_ids_collapsed"], conv["context_runs"])
    assert len(ids) == conv["input_ids_len"] and ids.count(proc.placeholder_token_id) == conv["num_image_tokens"]
    assert sha256_ids(ids) == conv["input_ids_sha256"]
    start, end = proc.expand(plans[0]).token_ids[0], proc.expand(plans[0]).token_ids[-1]
    for r, pl in zip(ranges[proc.anchor_token_id], plans):
        run = ids[r.offset:r.offset + r.length]
        assert run[0] == start and run[-1] == end and run[1:-1] == [proc.placeholder_token_id] * pl.num_tokens
    batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(images, plans)])
    assert list(batch.tensors["pixel_values"].shape) == conv["pixel_values_shape"]
    if backend == "torchvision":  # the recorded batch is the torchvision processor's
        assert sha256_f32le(batch.tensors["pixel_values"]) == conv["pixel_values_sha256"]
