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
seeded), on the float32 last-position logits.  A structured-output constraint, compiled
before the request reaches the model thread (:mod:`.constraint_pool`; each function takes
its ``grammar``), masks the logits before the processors and ends the generation once its
grammar is complete (:mod:`.constraints`).

Disaggregated legs (:mod:`.kv_state` says what crosses between them): :func:`run_prefill` runs
the prompt forward once and samples each choice's first token from its logits;
:func:`run_decode` restores that KV cache and position state, takes the first token and steps
exactly as :func:`run_generation` does after its own first token, so a prefill/decode pair
computes the same numbers as a single engine.  An EPD prefill passes the encode leg's
embeddings as ``mm_encoder_outputs`` (:class:`ModelInputs.encoder_outputs`), the model's own
replacement for running its vision tower.

Not thread-safe: Qwen-VL models keep per-request state (``rope_deltas``) on the
module, so the engine runs one generation at a time per model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch
import xgrammar as xgr
from transformers import DynamicCache

from mmgate.refengine.bundle import LazyTokenizer, LoadedModel
from mmgate.refengine.constraints import grammar_guide
from mmgate.refengine.kv_state import (
    FirstToken,
    PrefillState,
    clear_rope_state,
    restore_cache,
    rope_state,
    set_rope_state,
    snapshot_cache,
)
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


def _generator(plan: GenerationPlan) -> torch.Generator | None:
    """The choice's own generator: only for seeded sampling (vLLM: a per-request generator)."""
    return torch.Generator().manual_seed(plan.seed) if plan.do_sample and plan.seed is not None else None


class _Choice:
    """One choice's token loop: pick a token from logits, take it (emit, stop rules)."""

    def __init__(self, loaded: LoadedModel, plan: GenerationPlan, prompt_ids: torch.Tensor,
                 on_token: Callable[[int, TokenLogprobs | None], None], tokenizer: LazyTokenizer,
                 grammar: xgr.CompiledGrammar | None) -> None:
        self.plan = plan
        self.prompt_ids = prompt_ids
        self.on_token = on_token
        self.generator = _generator(plan)
        self.stop_strings = _StopStrings(plan.stop_strings, tokenizer)
        assert (grammar is None) == (plan.constraint is None), "a constrained plan needs its compiled grammar"
        self.guide = grammar_guide(grammar, plan.stop_token_ids, loaded.facts.vocab_size)
        self.output: list[int] = []

    def pick(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The next token from the last position's logits (changed in place)."""
        if self.guide is not None:  # structured output: only the tokens the grammar allows
            self.guide.mask(logits)
        return sample_next(self.plan, logits, self.prompt_ids, self.output, self.generator)

    def take(self, token: int, logprobs: TokenLogprobs | None) -> GenerationResult | None:
        """Emit ``token``; the result when it ends the choice, else None."""
        plan, output = self.plan, self.output
        output.append(token)
        self.on_token(token, logprobs)
        if self.guide is not None:
            self.guide.advance(token)
            if self.guide.terminated:  # the grammar is complete (its stop token, when it has one, chosen)
                matched_id = token if token in plan.stop_token_ids else None
                return GenerationResult(tuple(output), FinishReason.STOP, matched_id, None)
        ended = len(output) >= plan.min_new_tokens
        if ended and token in plan.stop_token_ids:
            return GenerationResult(tuple(output), FinishReason.STOP, token, None)
        # vLLM checks stop strings only past min_tokens (v1/engine/detokenizer.py ``update``)
        matched = self.stop_strings.match(output) if len(output) > plan.min_new_tokens else None
        if matched is not None:
            return GenerationResult(tuple(output), FinishReason.STOP, None, matched)
        if len(output) >= plan.max_new_tokens:
            return GenerationResult(tuple(output), FinishReason.LENGTH, None, None)
        return None

    def abort(self) -> GenerationResult:
        return GenerationResult(tuple(self.output), FinishReason.ABORT, None, None)


def _prefill(loaded: LoadedModel, inputs: ModelInputs) -> tuple[DynamicCache, torch.Tensor]:
    """The prompt forward with the media (or their precomputed embeddings): (cache, last logits)."""
    clear_rope_state(loaded.model)
    cache = DynamicCache(config=loaded.model.config)
    extra: dict[str, object] = dict(inputs.flags)
    if inputs.encoder_outputs:
        extra["mm_encoder_outputs"] = dict(inputs.encoder_outputs)
    logits = _forward(loaded, cache, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                      **inputs.mm_kwargs, **extra)  # type: ignore[arg-type]
    return cache, logits


def _steps(loaded: LoadedModel, cache: DynamicCache, choice: _Choice, token: int,
           cancelled: threading.Event) -> GenerationResult:
    """Cached one-token steps after ``token`` (already taken) until the choice ends."""
    while True:
        if cancelled.is_set():
            return choice.abort()
        logits = _forward(loaded, cache, input_ids=torch.tensor([[token]], dtype=torch.int64))
        token, logprobs = choice.pick(logits)
        end = choice.take(token, logprobs)
        if end is not None:
            return end


def run_generation(
    loaded: LoadedModel,
    inputs: ModelInputs,
    plan: GenerationPlan,
    on_token: Callable[[int, TokenLogprobs | None], None],
    cancelled: threading.Event,
    tokenizer: LazyTokenizer,
    grammar: xgr.CompiledGrammar | None,
) -> GenerationResult:
    """Generate for one request (a single engine: the prefill and every step here).

    Args:
        loaded: the model (call from the model thread only).
        inputs: ``input_ids`` ``[1, seq]`` int64, attention mask, forward kwargs.
        plan: sampling and stop rules.
        on_token: called with each new token id and its logprobs (None unless the plan asks
            for them), in order, from this thread.
        cancelled: set by Abort or a client disconnect; checked after every token.
        tokenizer: decodes the completion for stop strings (loaded only if the plan has any).
        grammar: the plan's constraint, compiled (None: unconstrained).

    Returns:
        The :class:`GenerationResult`: ``stop`` on a stop token or string, ``abort``
        when cancelled first, else ``length``.

    Raises:
        Whatever the model code raises (ValueError for inputs it refuses).
    """
    choice = _Choice(loaded, plan, inputs.input_ids, on_token, tokenizer, grammar)
    if cancelled.is_set():  # aborted while queued
        return choice.abort()
    with torch.inference_mode():
        cache, logits = _prefill(loaded, inputs)
        token, logprobs = choice.pick(logits)
        end = choice.take(token, logprobs)
        return end if end is not None else _steps(loaded, cache, choice, token, cancelled)


def run_prefill(
    loaded: LoadedModel,
    inputs: ModelInputs,
    plan: GenerationPlan,
    on_token: Callable[[int, int, TokenLogprobs | None], None],
    tokenizer: LazyTokenizer,
    grammar: xgr.CompiledGrammar | None,
) -> tuple[PrefillState, list[GenerationResult]]:
    """The prefill leg: the prompt forward once, then each choice's first token from its logits.

    ``on_token(choice, token, logprobs)`` is called for each first token.  Returns the state the
    decode leg continues from (:mod:`.kv_state`) and each choice's result as the prefill leg reports
    it: its one token, ``stop`` when that token ends the choice, else ``length`` (the prefill's
    one-token budget, as a vLLM prefill leg runs with ``max_tokens=1``).
    """
    firsts: list[FirstToken] = []
    results: list[GenerationResult] = []
    with torch.inference_mode():
        cache, logits = _prefill(loaded, inputs)
        for index in range(plan.n):
            def emit(token: int, lp: TokenLogprobs | None, index: int = index) -> None:
                on_token(index, token, lp)

            choice = _Choice(loaded, plan.for_choice(index), inputs.input_ids, emit, tokenizer, grammar)
            token, logprobs = choice.pick(logits.clone())  # each choice samples the same logits
            end = choice.take(token, logprobs)
            state = choice.generator.get_state() if choice.generator is not None else None
            firsts.append(FirstToken(token, logprobs, state))
            results.append(end or GenerationResult((token,), FinishReason.LENGTH, None, None))
        state_ = PrefillState(prompt_ids=tuple(int(t) for t in inputs.input_ids[0].tolist()),
                              layers=snapshot_cache(cache), rope=rope_state(loaded.model), first=tuple(firsts))
    return state_, results


def run_decode(
    loaded: LoadedModel,
    state: PrefillState,
    index: int,
    plan: GenerationPlan,
    on_token: Callable[[int, TokenLogprobs | None], None],
    cancelled: threading.Event,
    tokenizer: LazyTokenizer,
    grammar: xgr.CompiledGrammar | None,
) -> GenerationResult:
    """The decode leg of choice ``index``: restore the prefill's KV and position state, take the
    prefill's first token, then step as :func:`run_generation` does after its own first token.

    Raises:
        ValueError: a state this model cannot continue (another model's KV).
    """
    prompt = torch.tensor([state.prompt_ids], dtype=torch.int64)
    choice = _Choice(loaded, plan, prompt, on_token, tokenizer, grammar)
    if cancelled.is_set():
        return choice.abort()
    first = state.first[index]
    if choice.generator is not None and first.generator_state is not None:
        choice.generator.set_state(first.generator_state)
    with torch.inference_mode():
        set_rope_state(loaded.model, state.rope)
        cache = restore_cache(loaded.model.config, state.layers)
        end = choice.take(first.token, first.logprobs)
        return end if end is not None else _steps(loaded, cache, choice, first.token, cancelled)
