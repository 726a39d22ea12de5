"""Sampling parameters -> a generation plan for ``model.generate``.

Stage: engine request intake.  In: the proto ``SamplingParams``, the model's
facts, the prompt length, the engine's ``--max-tokens-default``; out: a frozen
:class:`GenerationPlan` and, from it, transformers logits processors.

Field reading mirrors ``smg_grpc_servicer/vllm/servicer.py``
``_sampling_params_from_proto`` (smg-grpc-servicer 0.14.1): ``top_p`` 0 means
1.0, ``top_k`` 0 means off, ``repetition_penalty`` 0 means 1.0,
``n`` 0 means 1.  One deliberate difference: an unset ``temperature`` means
greedy here (vLLM: 1.0), so the reference engine is deterministic unless a
request asks for sampling.

Stopping: the model's stop ids (config eos, then generation_config extras)
unless ``ignore_eos``, plus ``stop_token_ids`` always (vLLM keeps those under
``ignore_eos`` too), plus ``stop`` strings.  Features transformers has no
equivalent for (``n > 1``, logprobs, structured output, frequency/presence
penalties, ``logit_bias``) are refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from smg_grpc_proto.generated import vllm_engine_pb2
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import ModelFacts


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """How one request is decoded (batch size 1, one choice)."""

    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool  # False: greedy argmax
    temperature: float  # used only when do_sample
    top_p: float  # 1.0 = off
    top_k: int  # 0 = off
    min_p: float  # 0.0 = off
    repetition_penalty: float  # 1.0 = off
    seed: int | None  # seeds this request's own torch.Generator, when set
    stop_token_ids: tuple[int, ...]  # generation ends after emitting one of these
    stop_strings: tuple[str, ...]  # generation ends once the decoded completion contains one

    def logits_processors(self, prompt_len: int) -> LogitsProcessorList:
        """The transformers processors, in ``GenerationMixin._get_logits_processor``'s order.

        Penalties first (repetition, min-new-tokens), then, when sampling, the
        warpers: temperature, top-k, top-p, min-p.  Applied to ``[1, vocab]``
        float32 logits with the ``[1, seq]`` ids so far.
        """
        processors = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(penalty=self.repetition_penalty))
        if self.min_new_tokens > 0 and self.stop_token_ids:
            processors.append(
                MinNewTokensLengthLogitsProcessor(prompt_len, self.min_new_tokens, list(self.stop_token_ids))
            )
        if self.do_sample:
            if self.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k > 0:
                processors.append(TopKLogitsWarper(top_k=self.top_k))
            if self.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=self.top_p))
            if self.min_p > 0.0:
                processors.append(MinPLogitsWarper(min_p=self.min_p))
        return processors


def _refuse_unsupported(params: vllm_engine_pb2.SamplingParams) -> None:
    def refuse(what: str) -> GatewayError:
        return GatewayError(ErrorCode.INVALID_REQUEST, f"{what} is not supported by the reference engine")

    if params.n > 1:
        raise refuse("n > 1")
    if params.HasField("logprobs") or params.HasField("prompt_logprobs"):
        raise refuse("logprobs")
    if params.WhichOneof("constraint"):
        raise refuse(f"structured output ({params.WhichOneof('constraint')})")
    if params.frequency_penalty or params.presence_penalty:
        raise refuse("frequency/presence penalty")
    if params.logit_bias:
        raise refuse("logit_bias")


def plan_generation(
    params: vllm_engine_pb2.SamplingParams,
    facts: ModelFacts,
    prompt_len: int,
    max_tokens_default: int,
) -> GenerationPlan:
    """Read ``params`` into a :class:`GenerationPlan`.

    ``max_new_tokens`` is ``max_tokens`` (else ``max_tokens_default``), clamped
    to the room left in the context window.

    Raises:
        GatewayError(INVALID_REQUEST): an unsupported feature or an out-of-range value.
        GatewayError(CONTEXT_LENGTH_EXCEEDED): the prompt fills the context window.
    """
    _refuse_unsupported(params)
    room = facts.max_context_length - prompt_len if facts.max_context_length else None
    if room is not None and room < 1:
        raise GatewayError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"prompt has {prompt_len} tokens; the model's context is {facts.max_context_length}",
        )
    requested = params.max_tokens if params.HasField("max_tokens") else max_tokens_default
    if requested < 1:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "max_tokens must be at least 1")
    max_new = min(requested, room) if room is not None else requested
    temperature = params.temperature if params.HasField("temperature") else 0.0
    if temperature < 0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "temperature must be >= 0")
    top_p = params.top_p if params.top_p != 0.0 else 1.0
    if not 0.0 < top_p <= 1.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "top_p must be in (0, 1]")
    if not 0.0 <= params.min_p <= 1.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "min_p must be in [0, 1]")
    repetition_penalty = params.repetition_penalty if params.repetition_penalty != 0.0 else 1.0
    if repetition_penalty < 0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "repetition_penalty must be > 0")
    stop_ids = [] if params.ignore_eos else list(facts.stop_token_ids)
    stop_ids += [t for t in params.stop_token_ids if t not in stop_ids]
    return GenerationPlan(
        max_new_tokens=max_new,
        min_new_tokens=min(params.min_tokens, max_new),
        do_sample=temperature > 0.0,
        temperature=temperature,
        top_p=top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=repetition_penalty,
        seed=params.seed if params.HasField("seed") else None,
        stop_token_ids=tuple(stop_ids),
        stop_strings=tuple(s for s in params.stop if s),
    )
