"""One token choice, as vLLM's V1 sampler makes it, for one sequence.

Stage: engine model thread.  In: the float32 last-position logits ``[1, vocab]``
of one sequence, its prompt ids, its output so far, the request's
:class:`~mmgate.refengine.sampling.GenerationPlan` and its ``torch.Generator``;
out: the chosen token id and, when the request asked for logprobs, a
:class:`TokenLogprobs`.

Mirrors ``vllm/v1/sample/sampler.py`` ``Sampler.forward`` (vLLM v0.11), in order:

1. logprobs, when requested, from the raw logits (``log_softmax``) before any
   processing: vLLM's default ``logprobs_mode="raw_logprobs"``;
2. the non-argmax-invariant logits processors (``vllm/v1/sample/logits_processor/builtin.py``):
   ``MinTokensLogitsProcessor`` (the stop ids at ``-inf`` while the output is
   shorter than ``min_tokens``), then ``LogitBiasLogitsProcessor`` (bias added);
3. penalties, ``vllm/model_executor/layers/utils.py`` ``apply_penalties``:
   repetition (over prompt and output tokens: positive logits divided, the
   others multiplied), then ``frequency * count`` and ``presence * seen``
   subtracted (output tokens only, OpenAI's definition);
4. greedy: argmax.  Random: temperature, then ``MinPLogitsProcessor`` (tokens whose
   probability is below ``min_p`` times the largest at ``-inf``), then top-k / top-p
   (``vllm/v1/sample/ops/topk_topp_sampler.py`` ``apply_top_k_top_p``), then
   ``random_sample``: ``probs / Exponential(1)`` noise, argmax, the noise drawn
   from the request's own generator when it is seeded;
5. the sampled token's logprob and the ``k`` largest (``Sampler.gather_logprobs``).

Logits are changed in place; pass a tensor the caller no longer needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgate.refengine.sampling import GenerationPlan

#: vLLM ``_SAMPLING_EPS``: a temperature below this is greedy
SAMPLING_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one output position (vLLM ``LogprobsTensors`` row for one token).

    ``top_ids`` / ``top_logprobs``: the ``k`` most likely tokens, most likely first
    (``torch.topk`` order); empty for ``logprobs=0``.
    """

    token_id: int
    logprob: float  # of the sampled token, float32 log-softmax of the raw logits
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def apply_penalties(logits: torch.Tensor, prompt_ids: torch.Tensor, output_ids: list[int], repetition: float,
                    frequency: float, presence: float) -> torch.Tensor:
    """vLLM ``apply_penalties`` (``vllm/model_executor/layers/utils.py``) for one sequence, in place.

    Args:
        logits: ``[1, vocab]`` float32.
        prompt_ids: ``[seq]`` or ``[1, seq]`` int64 prompt ids.
        output_ids: the generated ids so far.
        repetition: 1.0 is off; frequency, presence: 0.0 is off.

    Returns:
        ``logits``, penalized.
    """
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab)[:vocab].to(logits.dtype)
    output_mask = counts > 0
    if repetition != 1.0:
        prompt = prompt_ids.reshape(-1)
        prompt_mask = torch.zeros(vocab, dtype=torch.bool)
        prompt_mask[prompt[prompt < vocab]] = True
        seen = (prompt_mask | output_mask).unsqueeze(0)
        scale = torch.where(seen, torch.tensor(repetition, dtype=logits.dtype), torch.tensor(1.0, dtype=logits.dtype))
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if frequency:
        logits = logits - frequency * counts.unsqueeze(0)
    if presence:
        logits = logits - presence * output_mask.to(logits.dtype).unsqueeze(0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``) for one sequence.

    ``top_k`` 0 and ``top_p`` 1.0 are off; masked entries become ``-inf``.
    """
    if top_k <= 0 and top_p >= 1.0:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        threshold = logits_sort[:, logits_sort.shape[-1] - k].unsqueeze(1)
        logits_sort.masked_fill_(logits_sort < threshold, float("-inf"))
    if top_p < 1.0:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        top_p_mask = probs_sum <= 1 - top_p
        top_p_mask[:, -1] = False  # at least one
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM ``MinPLogitsProcessor.apply``: tokens less likely than ``min_p`` times the most likely, at ``-inf``."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def gather_logprobs(raw_logprobs: torch.Tensor, k: int, token: int) -> TokenLogprobs:
    """vLLM ``Sampler.gather_logprobs`` for one row: the token's logprob and the ``k`` largest."""
    row = raw_logprobs[0]
    top_values, top_ids = torch.topk(row, min(k, row.shape[-1])) if k > 0 else (row[:0], row[:0].long())
    return TokenLogprobs(token, float(row[token]), tuple(int(i) for i in top_ids),
                         tuple(float(v) for v in top_values))


def sample_next(plan: GenerationPlan, logits: torch.Tensor, prompt_ids: torch.Tensor, output: list[int],
                generator: torch.Generator | None) -> tuple[int, TokenLogprobs | None]:
    """The next token of one sequence (see the module docstring for the order of the steps).

    Args:
        plan: the request's sampling fields.
        logits: ``[1, vocab]`` float32 logits of the last position (changed in place).
        prompt_ids: the prompt's ids (repetition penalty).
        output: the ids generated so far.
        generator: the request's own generator when seeded, else None (the global RNG).

    Returns:
        (token id, its logprobs when ``plan.logprobs`` is set, else None)
    """
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32) if plan.logprobs is not None else None
    if len(output) < plan.min_new_tokens:
        held = [t for t in plan.stop_token_ids if t < logits.shape[-1]]
        logits[0, held] = float("-inf")
    for token_id, bias in plan.logit_bias:
        logits[0, token_id] += bias
    if plan.repetition_penalty != 1.0 or plan.frequency_penalty or plan.presence_penalty:
        logits = apply_penalties(logits, prompt_ids, output, plan.repetition_penalty, plan.frequency_penalty,
                                 plan.presence_penalty)
    if not plan.do_sample or plan.temperature < SAMPLING_EPS:
        token = int(torch.argmax(logits, dim=-1)[0])
    else:
        logits = logits / plan.temperature
        if plan.min_p > 0.0:
            logits = apply_min_p(logits, plan.min_p)
        logits = apply_top_k_top_p(logits, plan.top_k, plan.top_p)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        token = int(probs.div_(noise).argmax(dim=-1)[0])
    return token, (gather_logprobs(raw, plan.logprobs or 0, token) if raw is not None else None)
