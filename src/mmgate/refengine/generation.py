"""Decode one request: a prefill forward with the media, then cached one-token steps.

Stage: engine model thread.  In: a :class:`LoadedModel`, the request's
:class:`ModelInputs` and :class:`GenerationPlan`, a token callback and a cancel
flag; out: a :class:`GenerationResult`.

The prefill is one call of the model's own ``forward`` with ``input_ids``,
``attention_mask`` and the pixel tensors, so the model's own checks run first
(``get_placeholder_mask``: ``ValueError("Image features and image tokens do
not match, tokens: N, features: M")``) and the model computes its own M-RoPE
positions and ``rope_deltas``.  Each later step feeds the chosen token with
the KV cache and no mask; the model then places it at
``cache_length + rope_deltas`` (transformers 5.24
``Qwen2VLModel.compute_3d_position_ids``); a model without M-RoPE (LLaVA,
LLaVA-NeXT, Gemma 3) counts plain 1-D positions from the cache length and keeps
no ``rope_deltas``.  Gemma 3's ``token_type_ids`` ride only on the prefill, as
``Gemma3ForConditionalGeneration.prepare_inputs_for_generation`` passes them
(the bidirectional image-token mask matters only there).  ``model.generate`` is not used
because it computes M-RoPE positions before the first forward, where a
placeholder mismatch surfaces as an opaque indexing error instead of the
model's own message.  Greedy output equals ``model.generate(do_sample=False)``
(a test checks it).

Token choice mirrors vLLM's V1 sampler (:func:`.sampler.sample_next`: min-tokens,
``logit_bias``, penalties, then argmax, or temperature, min-p, top-k/top-p and
exponential-noise sampling with the request's own ``torch.Generator`` when
seeded), on the float32 last-position logits.  A structured-output constraint
masks the logits before the processors and ends the generation once its grammar
is complete (:mod:`.constraints`).

Not thread-safe: Qwen-VL models keep per-request state (``rope_deltas``) on the
module, so the engine runs one generation at a time per model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch
from transformers import DynamicCache

from mmgate.refengine.bundle import LazyTokenizer, LoadedModel
from mmgate.refengine.constraints import grammar_guide
from mmgate.refengine.mm_inputs import ModelInputs
from mmgate.refengine.sampler import TokenLogprobs, sample_next
from mmgate.refengine.sampling import GenerationPlan


class FinishReason(StrEnum):
    """``GenerateComplete.finish_reason`` values (vLLM's names)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished generation."""

    output_ids: tuple[int, ...]  # every generated token, a final stop token included
    finish_reason: FinishReason
    matched_token_id: int | None  # the stop token that ended it
    matched_stop_str: str | None  # the stop string that ended it


def clear_rope_state(model: torch.nn.Module) -> None:
    """Forget the previous request's M-RoPE offsets.

    transformers Qwen-VL models store ``rope_deltas`` at each multimodal
    prefill and add them at every cached step; a text-only prefill leaves them
    unchanged, so without this a text request after an image request would be
    positioned with the image request's offset.
    """
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            setattr(module, "rope_deltas", None)  # noqa: B010 - any module type


def _forward(loaded: LoadedModel, cache: DynamicCache, **kwargs: torch.Tensor | None) -> torch.Tensor:
    """One forward; the float32 logits of the last position, ``[1, vocab]``."""
    params = loaded.forward_params
    extra: dict[str, object] = {"cache" if "cache" in params else "past_key_values": cache}
    if "use_cache" in params:
        extra["use_cache"] = True
    if "logits_to_keep" in params:
        extra["logits_to_keep"] = 1
    out = loaded.model(**kwargs, **extra)
    return out.logits[:, -1, :].to(torch.float32)


class _StopStrings:
    """Whether the decoded completion contains a stop string (decodes only when there are some)."""

    def __init__(self, stop_strings: tuple[str, ...], tokenizer: LazyTokenizer) -> None:
        self._stop_strings = stop_strings
        self._tokenizer = tokenizer

    def match(self, output: list[int]) -> str | None:
        if not self._stop_strings:
            return None
        text = self._tokenizer.get().decode(output)
        return next((s for s in self._stop_strings if s in text), None)


def run_generation(
    loaded: LoadedModel,
    inputs: ModelInputs,
    plan: GenerationPlan,
    on_token: Callable[[int, TokenLogprobs | None], None],
    cancelled: threading.Event,
    tokenizer: LazyTokenizer,
) -> GenerationResult:
    """Generate for one request.

    Args:
        loaded: the model (call from the model thread only).
        inputs: ``input_ids`` ``[1, seq]`` int64, attention mask, forward kwargs.
        plan: sampling and stop rules.
        on_token: called with each new token id and its logprobs (None unless the plan asks
            for them), in order, from this thread.
        cancelled: set by Abort or a client disconnect; checked after every token.
        tokenizer: decodes the completion for stop strings (loaded only if the plan has any).

    Returns:
        The :class:`GenerationResult`: ``stop`` on a stop token or string, ``abort``
        when cancelled first, else ``length``.

    Raises:
        Whatever the model code raises (ValueError for inputs it refuses).
    """
    if cancelled.is_set():  # aborted while queued
        return GenerationResult((), FinishReason.ABORT, None, None)
    clear_rope_state(loaded.model)
    generator = torch.Generator().manual_seed(plan.seed) if plan.do_sample and plan.seed is not None else None
    stop_strings = _StopStrings(plan.stop_strings, tokenizer)
    guide = grammar_guide(plan.constraint, tokenizer, loaded.facts.vocab_size, plan.stop_token_ids)
    cache = DynamicCache(config=loaded.model.config)
    output: list[int] = []
    with torch.inference_mode():
        logits = _forward(
            loaded, cache, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, **inputs.mm_kwargs
        )
        while True:
            if guide is not None:  # structured output: only the tokens the grammar allows
                guide.mask(logits)
            token, logprobs = sample_next(plan, logits, inputs.input_ids, output, generator)
            output.append(token)
            on_token(token, logprobs)
            if guide is not None:
                guide.advance(token)
                if guide.terminated:  # the grammar is complete (its stop token, when it has one, chosen)
                    matched_id = token if token in plan.stop_token_ids else None
                    return GenerationResult(tuple(output), FinishReason.STOP, matched_id, None)
            ended = len(output) >= plan.min_new_tokens
            if ended and token in plan.stop_token_ids:
                return GenerationResult(tuple(output), FinishReason.STOP, token, None)
            # vLLM checks stop strings only past min_tokens (v1/engine/detokenizer.py ``update``)
            matched = stop_strings.match(output) if len(output) > plan.min_new_tokens else None
            if matched is not None:
                return GenerationResult(tuple(output), FinishReason.STOP, None, matched)
            if len(output) >= plan.max_new_tokens:
                return GenerationResult(tuple(output), FinishReason.LENGTH, None, None)
            if cancelled.is_set():
                return GenerationResult(tuple(output), FinishReason.ABORT, None, None)
            step = torch.tensor([[token]], dtype=torch.int64)
            logits = _forward(loaded, cache, input_ids=step)
