"""The request pipeline: plan -> render+tokenize -> fetch+decode -> preprocess -> expand.

Stage: everything between the HTTP layer and worker selection.  In: a
validated :class:`~mmgate.request.protocol.ChatCompletionRequest`; out: an
engine-neutral :class:`~mmgate.types.PreparedRequest`.

Order of refusals (cheap first, nothing fetched before all of them pass):
unknown model -> modality the model cannot take -> per-request item limit ->
URL scheme (:mod:`mmgate.pipeline.planning`) -> chat template -> one anchor per item.  Then each *distinct*
URL is fetched once (concurrently) and decoded, images are preprocessed in a
bounded thread pool (numpy, Pillow and the resize extension release the GIL), and every
anchor is replaced by its placeholder run.

Videos (docs/video.md) take the same path with one more step: each distinct
clip is sampled from its header (the family's frame sampler), checked against
the request's decoded-pixel allowance, decoded and preprocessed in the pool,
one clip per task.  Images and videos become one :class:`EncoderBatch` each,
in the order their modality first appears in the prompt.

A clip whose processor asked for its audio track (:class:`~mmgate.models.family.AudioTrackVideo`) brings
an audio item with no anchor (:mod:`mmgate.pipeline.companions`): it joins the audio batch at the clip's
prompt position, the clip's update carries both runs, and the request's modalities include audio from
then on (worker selection sees it).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, NamedTuple

import numpy as np

from mmgate.observe import metrics
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.companions import add_companions, anchored, companion_ranges, expand_hosts, in_prompt_order
from mmgate.chat.template import render_chat
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.media.hashing import item_hash
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import (
    BatchPlanner,
    MediaProcessor,
    RowWriter,
    VideoProcessor,
    VideoRowWriter,
    assemble,
    deferrable,
    item_rows,
    primary_layout,
    primary_spec,
    processor,
)
from mmgate.pipeline.planning import (
    RequestPlan,
    check_anchors,
    hinted,
    locate_text_items,
    plan_request,
    splice_all,
    splice_text,
)
from mmgate.pipeline.routing_key import RoutingKey, expanded_key
from mmgate.pipeline.sources import SOURCES, SourceContext, gather_or_cancel
from mmgate.request.protocol import ChatCompletionRequest, TextPart
from mmgate.request.structured import request_constraint, template_tools
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.config.settings import Settings
from mmgate.transport.limits import (
    element_bytes,
    encoder_bytes_limit,
    payload_too_large,
)
from mmgate.transport.placement import BufferTarget
from mmgate.types import (
    DecodedImage,
    EncoderBatch,
    ItemPlan,
    MediaRef,
    Modality,
    PendingTensor,
    PlaceholderRange,
    PreparedRequest,
    Replacement,
    RowTarget,
    SamplingParams,
    TensorLayout,
    TensorSpec,
    shifted,
)


class Rendered(NamedTuple):
    """A rendered, tokenized chat prompt (:meth:`Pipeline.render_prompt`).

    ``segments``: the prompt as tokenized, ``(text, typed)`` pieces (template text, and caller
    text holding reserved strings, tokenized as plain text); text-level prompt updates
    substitute into it.
    """

    plan: RequestPlan
    prompt: str
    ids: list[int]
    segments: tuple[tuple[str, bool], ...]


def context_length(bundle: ModelBundle) -> int:
    """The model's context length in tokens, as vLLM derives ``max_model_len`` by default: the text
    model's ``max_position_embeddings`` (``text_config``, ``thinker_config.text_config`` or the top
    level of ``config.json``), else the tokenizer's ``model_max_length``; 0 when unknown.

    Mirrors vLLM ``config/model.py`` ``_get_and_verify_max_len`` (the ``max_position_embeddings``
    key, without rope scaling: the Qwen-VL configs carry mrope sections, not a length factor).
    """
    config = bundle.config
    candidates: list[Any] = []
    for holder in (config.get("text_config"), (config.get("thinker_config") or {}).get("text_config"), config):
        if isinstance(holder, dict):
            candidates.append(holder.get("max_position_embeddings"))
    candidates.append(bundle.tokenizer_config.get("model_max_length"))
    for value in candidates:
        if isinstance(value, (int, float)) and 0 < value < 2**31:
            return int(value)
    return 0


#: how far Unicode normalization (NFC/NFKC) can shorten text: at most 4 characters compose into one
_NORMALIZATION_SLACK = 4

#: a prompt of more characters than this many per context token is counted piecewise before it is
#: tokenized whole (``BundleTokenizer.exceeds``)
_CHARS_PER_TOKEN_TRIGGER = 4

#: below this many messages and characters a prompt is rendered on the event loop (cheaper than a thread hop)
_INLINE_RENDER_MESSAGES = 64
_INLINE_RENDER_CHARS = 32 * 1024


class Pipeline:
    """Turns chat requests into :class:`PreparedRequest` objects for one model."""

    def __init__(self, runtime: ModelRuntime, settings: Settings, fetcher: MediaFetcher, executor: Executor,
                 cache: PixelCache | None = None, parallelism: int | None = None) -> None:
        self.runtime = runtime
        self.settings = settings
        self.fetcher = fetcher
        self.executor = executor
        self.cache = cache
        #: pool threads one large image may be split across (``_fill_images``)
        self.parallelism = parallelism or os.cpu_count() or 1

    @property
    def max_model_len(self) -> int:
        """The context length requests are checked against (``--max-model-len``, else the bundle's;
        0: unknown, nothing checked here and the engine decides)."""
        return self.settings.max_model_len or context_length(self.runtime.bundle)

    def _sampling(self, req: ChatCompletionRequest, prompt_len: int = 0) -> SamplingParams:
        """The request's sampling parameters, ``max_tokens`` checked against the context room.

        As vLLM's OpenAI server (``entrypoints/openai/serving_engine.py`` ``_validate_input`` and
        ``entrypoints/utils.py`` ``get_max_tokens``, v0.11): a prompt of ``max_model_len`` tokens or
        more is refused; a ``max_tokens`` / ``max_completion_tokens`` larger than the room left after
        the prompt is refused (400 ``context_length_exceeded``, ``param`` the field); without one,
        ``--default-max-tokens`` capped to the room.  ``prompt_len`` is the expanded prompt (the
        unexpanded one, a lower bound, when a worker expands media itself).

        Raises:
            GatewayError(CONTEXT_LENGTH_EXCEEDED)
        """
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        limit = self.max_model_len
        if limit:
            room = limit - prompt_len
            if room < 1:
                raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                   f"the prompt has {prompt_len} tokens; the model's context is {limit} tokens",
                                   "messages")
            if max_tokens is not None and max_tokens > room:
                raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                   f"{field_name} exceeds the {room} tokens left: the model's context is {limit} "
                                   f"tokens and the prompt has {prompt_len}", field_name)
            if max_tokens is None:
                max_tokens = min(self.settings.default_max_tokens, room)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else self.settings.default_max_tokens,
            temperature=req.temperature, top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k if req.top_k is not None and req.top_k > 0 else 0, seed=req.seed, stop=stop,
            ignore_eos=req.ignore_eos, frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            # H-C1: as vLLM ChatCompletionRequest.to_sampling_params (logprobs=top_logprobs if logprobs)
            n=req.n, min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
            min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids or ()),
            logit_bias=tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items()),
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            constraint=request_constraint(req),  # H-C2: response_format, guided_*, tool_choice
        )

    async def prepare(self, req: ChatCompletionRequest, request_id: str | None = None,
                      choose_worker: Callable[[frozenset[Modality], RoutingKey], bool] | None = None,
                      defer_pixels: bool = False) -> PreparedRequest:
        """Run every stage up to an engine-neutral request.

        ``choose_worker(modalities, key)``, when given, is called once every
        request-level refusal has had its chance (planning, rendering, anchor
        count, fetch, decode, per-item geometry) and before any pixel is
        preprocessed; ``key`` is the request's routing key (the expanded prompt,
        each item keyed by its hash: :mod:`mmgate.pipeline.routing_key`).  It
        selects the worker and returns whether that worker wants raw uint8
        pixels (``mm_device_do_normalize``).

        ``defer_pixels``: when images are the first modality of the prompt, their
        ``pixel_values`` come back as a :class:`~mmgate.types.PendingTensor` (sizes
        known, values computed later by ``fill`` straight into the transport
        buffer the engine adapter picks); every refusal has happened by then.

        Raises:
            GatewayError: any refusal of the stages (see module docstring).
        """
        timings: dict[str, float] = {}
        runtime = self.runtime
        plan, prompt, ids, segments = await self.render_prompt_async(req, timings)
        self._sampling(req, len(ids))  # refuse an over-long prompt before fetching anything
        ids, batches, plans = await self.process_media(ids, plan, timings, choose_worker, defer_pixels, segments,
                                                       req.add_special_tokens)
        return PreparedRequest(
            request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}", model=runtime.served_name, prompt_text=prompt,
            input_ids=tuple(ids), batches=batches, sampling=self._sampling(req, len(ids)), stream=req.stream,
            plans=plans, timings_ms=timings,
        )

    async def render_prompt_async(self, req: ChatCompletionRequest,
                                  timings: dict[str, float]) -> Rendered:
        """:meth:`render_prompt`, on the event loop for a small conversation, in the pool otherwise (a
        huge text or many messages never stall other requests)."""
        if _small_conversation(req):
            return self.render_prompt(req, timings)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.render_prompt, req, timings)

    def render_prompt(self, req: ChatCompletionRequest,
                      timings: dict[str, float]) -> Rendered:
        """Plan and render+tokenize: the plan, the rendered prompt, its ids (one anchor per item).

        Every refusal of planning comes first; nothing is fetched.  Prompt integrity: reserved
        token strings typed by the caller are tokenized as plain text (:mod:`mmgate.chat.integrity`).
        Before tokenizing, a length bound: caller text of more characters than ``max_model_len`` tokens can
        cover (the tokenizer's longest entry times the normalization slack) cannot fit and is
        refused without tokenizing it; after tokenizing, the exact count is checked by the caller
        (:meth:`_sampling`).  Used by :meth:`prepare` and by worker-side forwarding
        (``--mm-processing``).

        Raises:
            GatewayError: planning refusals, RESERVED_TOKEN_IN_TEXT, CONTEXT_LENGTH_EXCEEDED,
                INVALID_REQUEST (the template refused the conversation).
        """
        runtime = self.runtime
        with metrics.stage("plan", timings, self.runtime.served_name):
            plan = plan_request(req, runtime, self.settings)
            limit = self.max_model_len
            if limit:
                chars = _text_chars(plan.template_messages)
                if chars > limit * runtime.tokenizer.max_token_chars * _NORMALIZATION_SLACK:
                    raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                       f"the messages are longer than the model's context of {limit} tokens can hold",
                                       "messages")
            safe = runtime.reserved.sanitize(plan.template_messages, req.chat_template_kwargs, template_tools(req))
        with metrics.stage("render", timings, self.runtime.served_name):
            if runtime.bundle.chat_template is None:
                raise GatewayError(ErrorCode.INVALID_REQUEST, "model has no chat template")
            prompt = render_chat(runtime.bundle.chat_template, safe.messages, runtime.tokenizer.special_tokens,
                                 add_generation_prompt=req.add_generation_prompt, extra=safe.template_kwargs,
                                 tools=safe.tools, continue_final_message=req.continue_final_message)
            segments = safe.segments(prompt)
            if safe.typed:
                prompt = "".join(text for text, _ in segments)
            if limit and len(prompt) > limit * _CHARS_PER_TOKEN_TRIGGER and runtime.tokenizer.exceeds(prompt, limit - 1):
                # Far more text than the context holds: refused from a bounded count, without ever
                # holding the encoding of the whole text.
                raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                   f"the prompt is longer than the model's context of {limit} tokens", "messages")
            ids = runtime.tokenizer.encode_segments(segments, runtime.reserved_ids, req.add_special_tokens)
        return Rendered(plan, prompt, ids, tuple(segments))

    async def process_media(self, ids: list[int], plan: RequestPlan, timings: dict[str, float],
                            choose_worker: Callable[[frozenset[Modality], RoutingKey], bool] | None = None,
                            defer_pixels: bool = False, segments: Sequence[tuple[str, bool]] | None = None,
                            add_special_tokens: bool | None = None,
                            ) -> tuple[list[int], tuple[EncoderBatch, ...], tuple[ItemPlan[Hashable], ...]]:
        """Prompt ids with one anchor per item + the plan's media -> expanded ids, encoder batches, plans.

        Anchor check, fetch+decode, preprocess, expand.  The one implementation
        of media processing: the gateway runs it in router mode; the reference
        engine (``--mm-processor inprocess``) and the Redis sidecar run it on
        forwarded media references (``RequestPlan(template_messages=[], media=refs)``).

        ``segments``: the rendered prompt as tokenized (:meth:`render_prompt`); a family whose
        prompt updates are text-level (Gemma 3) needs it: each anchor's text is replaced and the
        prompt tokenized again, as the reference processor does, with the request's
        ``add_special_tokens`` as :meth:`render_prompt` tokenized it.

        In the gateway (``choose_worker`` given: the tensors then travel to an engine), a request
        whose planned encoder tensors exceed what the transport carries
        (:func:`mmgate.transport.limits.encoder_bytes_limit`) is refused with 413
        ``multimodal_payload_too_large``: a clip from its header before it is decoded, the whole
        request after decoding and before preprocessing.
        """
        family = self.runtime.family
        modalities = frozenset(r.modality for r in plan.media)
        batches: tuple[EncoderBatch, ...] = ()
        plans: tuple[ItemPlan[Hashable], ...] = ()
        if plan.media:
            assert family is not None  # _check_media refused media for text-only models
            groups: dict[Modality, list[MediaRef]] = {}
            for ref in plan.media:  # modalities in the order they first appear in the prompt
                groups.setdefault(ref.modality, []).append(ref)
            procs = {m: processor(family, m) for m in groups}
            check_anchors(ids, plan.media, family)
            ctx = SourceContext(self.fetcher, self.executor, self.settings)
            with metrics.stage("fetch_decode", timings, self.runtime.served_name):
                limit = encoder_bytes_limit(self.settings.transport) if choose_worker is not None else None
                loaded = await _all_or_none(*(SOURCES[m].load(ctx, procs[m], refs, limit)
                                              for m, refs in groups.items()))
                decoded = dict(zip(groups, loaded))
                hosts = add_companions(groups, decoded)  # clips' audio tracks join the audio group
                if hosts is not None:
                    procs = {m: processor(family, m) for m in groups}
                    modalities = frozenset(groups)
            with metrics.stage("preprocess", timings, self.runtime.served_name):
                batch = {m: SOURCES[m].batch_context(procs[m], decoded[m], self.settings) for m in groups}
                items = {m: [_at(r, SOURCES[m].plan, procs[m], d, r.hints, batch[m]) for d, r in zip(decoded[m], refs)]
                         for m, refs in groups.items()}
                prints = {m: [SOURCES[m].fingerprint(procs[m], d, self.settings) + _batch_print(procs[m], pl)
                              for d, pl in zip(decoded[m], items[m])] for m in groups}
                hashes = {m: tuple(item_hash(d.content_hash, hinted(fp, r.hints))
                                   for d, fp, r in zip(decoded[m], prints[m], refs)) for m, refs in groups.items()}
                reps = {m: [procs[m].expand(pl) for pl in items[m]] for m in groups}  # type: ignore[arg-type]
                if hosts is not None:
                    expand_hosts(reps, items, procs, hosts)
                raw = False
                if choose_worker is not None:
                    keyed = anchored({m: list(zip(hashes[m], reps[m])) for m in reps}, hosts)
                    raw = choose_worker(modalities, expanded_key(ids, {
                        procs[m].anchor_token_id: [(h, _run(rep)) for h, rep in pairs] for m, pairs in keyed.items()}))
                    raw = raw and all(procs[m].device_normalizable for m in reps)
                if limit is not None:
                    _check_payload([(pl, r) for m, refs in groups.items() for pl, r in zip(items[m], refs)],
                                   element_bytes(self.settings.transport, raw), limit)
                first = plan.media[0].modality
                made = await _all_or_none(*(
                    self._preprocess(procs[m], decoded[m], items[m], prints[m], groups[m], raw,
                                     defer_pixels and m is first)
                    for m in groups))
            with metrics.stage("expand", timings, self.runtime.served_name):
                ids, ranges = self._expand(ids, anchored(reps, hosts), procs, segments, add_special_tokens)
                if hosts is not None:
                    companion_ranges(ids, ranges, hosts, procs[Modality.AUDIO].placeholder_token_id)
                batches = tuple(batch.with_items(tuple(ranges[m]), hashes[m]) for m, batch in zip(groups, made))
                plans = in_prompt_order(plan.media, items, hosts)
            for m, refs in groups.items():
                metrics.MM_ITEMS.labels(self.runtime.served_name, m.value).inc(len(refs))
        elif choose_worker is not None:
            choose_worker(modalities, RoutingKey.text(ids))
        return ids, batches, plans

    def _expand(self, ids: list[int], reps: Mapping[Modality, Sequence[Replacement]],
                procs: Mapping[Modality, MediaProcessor], segments: Sequence[tuple[str, bool]] | None,
                add_special_tokens: bool | None = None) -> tuple[list[int], dict[Modality, list[PlaceholderRange]]]:
        """Every anchor replaced by its item's prompt update: text-level updates first (the prompt
        text re-tokenized with the replacements in place, :func:`mmgate.pipeline.planning.splice_text`),
        then token-level ones (:func:`mmgate.pipeline.planning.splice_all`).

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): text-level updates without the prompt text
                (media references forwarded to a worker for such a family).
            GatewayError(INTERNAL_ERROR): the re-tokenized prompt does not hold the updates'
                embedding tokens as planned.
        """
        ranges: dict[Modality, list[PlaceholderRange]] = {}
        texts = {m: r for m, r in reps.items() if r and r[0].text is not None}
        if texts:
            if segments is None:
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   "this model's prompt updates are text-level; they need the prompt text")
            tokenizer = self.runtime.tokenizer
            anchors = {tokenizer.decode([procs[m].anchor_token_id], skip_special_tokens=False): [
                r.text or "" for r in texts[m]] for m in texts}
            ids = tokenizer.encode_segments(splice_text(segments, anchors), self.runtime.reserved_ids,
                                            add_special_tokens)
        tokens = {procs[m].anchor_token_id: r for m, r in reps.items() if m not in texts}
        ids, by_anchor = splice_all(ids, tokens)
        for m in reps:
            # text-level items are located in the final ids: the token-level splice moves them (InternVL3
            # mixes a text-level clip with token-level images)
            ranges[m] = (locate_text_items(ids, procs[m].placeholder_token_id, texts[m]) if m in texts
                         else by_anchor[procs[m].anchor_token_id])
        return ids, ranges

    async def _preprocess(self, proc: MediaProcessor, decoded: Sequence[Any], plans: Sequence[ItemPlan[Hashable]],
                          prints: Sequence[str], refs: Sequence[MediaRef], raw: bool,
                          defer: bool = False) -> EncoderBatch:
        """One modality's batch: each distinct item's primary share computed once (the content-hash cache
        first, then the pool), the other tensors from the plans.

        ``plans``: the processor's plans of the items (what its ``preprocess`` takes); ``prints``: each item's
        fingerprint (:meth:`MediaSource.fingerprint`).  The cache key is the item's content hash with its
        fingerprint, output form and hints.  The primary tensor is
        computed by :meth:`_fill` into one array, or, with ``defer`` (and a layout that allows it,
        :func:`mmgate.models.family.deferrable`), later into whatever buffer the engine adapter gives the
        returned :class:`PendingTensor`.
        """
        spec = primary_spec(proc.specs)
        keys = [item_hash(d.content_hash, hinted(f"{fp}:raw={raw}", r.hints)) for d, fp, r in zip(decoded, prints, refs)]
        items = {key: (d, pl) for key, d, pl in zip(keys, decoded, plans)}
        dtype = np.dtype(np.uint8 if raw else np.float32)
        if not deferrable(spec, plans):
            shares = await self._compute(proc, items, keys, raw)
            return assemble(proc, plans, shares)
        shape, firsts = primary_layout(spec, plans)
        width = int(np.prod(shape[1:], dtype=np.int64))
        rows = {key: item_rows(spec, pl) for key, pl in zip(keys, plans)}

        release = _clip_writer(proc) is not None  # decoded clips are large: let them go once written

        async def fill(target: RowTarget) -> None:
            if not items:
                raise GatewayError(ErrorCode.INTERNAL_ERROR, "the clips' encoder input was written already")
            await self._fill(proc, spec, items, rows, keys, firsts, raw, target)
            if release:
                # every row is in the buffer: the decoded frames go now, not with the request; a failed fill
                # (e.g. /dev/shm full) keeps them for the inline retry
                items.clear()

        if defer:
            return assemble(proc, plans, PendingTensor(shape=shape, dtype=dtype, fill=fill))
        values = np.empty(shape, dtype=dtype)
        await fill(BufferTarget(values.reshape(-1).view(np.uint8), width, dtype.itemsize, owner=values,
                                values=dtype))
        return assemble(proc, plans, values)

    def _cached(self, key: str, proc: MediaProcessor) -> np.ndarray | None:
        """The cache's share under ``key`` (counted as a hit or miss of the modality), None without a cache."""
        if self.cache is None:
            return None
        return self.cache.get(key, self.runtime.served_name, proc.modality.value)

    async def _compute(self, proc: MediaProcessor, items: Mapping[str, tuple[Any, Any]], keys: Sequence[str],
                       raw: bool) -> list[np.ndarray]:
        """Each distinct item's primary share once (cache first, then the pool), in prompt order."""
        loop = asyncio.get_running_loop()
        todo: dict[str, asyncio.Future[np.ndarray]] = {}
        hits: dict[str, np.ndarray] = {}
        for key in keys:
            if key in todo or key in hits:
                continue
            hit = self._cached(key, proc)
            if hit is not None:
                hits[key] = hit
            else:
                todo[key] = loop.run_in_executor(self.executor, proc.preprocess, *items[key], raw)  # type: ignore[arg-type]
        await _all_or_none(*todo.values())
        for key, fut in todo.items():
            hits[key] = fut.result()
            if self.cache is not None:
                self.cache.put(key, hits[key])
        return [hits[key] for key in keys]

    async def _fill(self, proc: MediaProcessor, spec: TensorSpec, items: Mapping[str, tuple[Any, Any]],
                    rows: Mapping[str, int], keys: Sequence[str], firsts: Sequence[int], raw: bool,
                    target: RowTarget) -> None:
        """Write every item's share at its first row of ``target`` (the primary tensor's
        ``[rows, width]`` view), in the pool.

        A cache hit is copied in; an image seen once with no cache, of a processor that writes
        rows itself (:class:`~mmgate.models.family.RowWriter`), is computed straight into the
        target (block by block, or in place where the target is a
        :class:`~mmgate.types.RowArray`), a large one in horizontal bands on several pool threads;
        a clip likewise one temporal patch at a time; otherwise its share is computed once, cached,
        and copied to each of its places.
        """
        loop = asyncio.get_running_loop()
        places: dict[str, list[int]] = {}
        for key, first in zip(keys, firsts):
            places.setdefault(key, []).append(first)
        writer = proc if isinstance(proc, RowWriter) and spec.layout is TensorLayout.FLAT else None
        clip_writer = _clip_writer(proc) if spec.layout is TensorLayout.FLAT else None

        def clip_rows(key: str, at: list[int]) -> None:
            assert clip_writer is not None
            with target.writer() as put:
                def sink(row: int, block: np.ndarray) -> None:
                    for first in at:
                        put(first + row, block)
                # one place: the writer may compute straight into the target (a RowArray stays one)
                one_place = shifted(put, at[0]) if len(at) == 1 else sink
                clip_writer.write_rows(*items[key], raw, one_place)  # type: ignore[arg-type]

        def stream(im: DecodedImage, pl: ItemPlan, first: int, band: tuple[int, int]) -> None:
            assert writer is not None
            with target.writer() as put:
                writer.write_rows(im, pl, raw, shifted(put, first), band)

        def copy(share: np.ndarray | None, key: str, at: list[int]) -> np.ndarray:
            with target.writer() as put:
                if share is None:
                    share = proc.preprocess(*items[key], raw)  # type: ignore[arg-type]
                block = share.reshape(rows[key], -1)
                for first in at:
                    put(first, block)
                return share

        async def one(key: str, at: list[int], hit: np.ndarray | None) -> np.ndarray | None:
            if clip_writer is not None and hit is None and self.cache is None:
                # a clip a temporal patch at a time straight into the target: no whole-clip array
                await loop.run_in_executor(self.executor, clip_rows, key, at)
                return None
            if writer is None or hit is not None or len(at) > 1 or self.cache is not None:
                return await loop.run_in_executor(self.executor, copy, hit, key, at)
            im, pl = items[key]
            parts = max(1, min(self.parallelism, pl.primary_shape[0] // BAND_MIN_ROWS))
            if parts > 1:
                im = await loop.run_in_executor(self.executor, writer.resized, im, pl)
            await _all_or_none(*(loop.run_in_executor(self.executor, stream, im, pl, at[0], (k, parts))
                                 for k in range(parts)))
            return None

        hits = {key: self._cached(key, proc) for key in places}
        computed = await _all_or_none(*(one(key, at, hits[key]) for key, at in places.items()))
        if self.cache is not None:
            for key, share in zip(places, computed):
                if hits[key] is None and share is not None:
                    self.cache.put(key, share)


def _clip_writer(proc: MediaProcessor) -> VideoRowWriter | None:
    """``proc`` when it is a clip processor that writes rows itself (protocol checks see only method names:
    an image :class:`RowWriter` has a ``write_rows`` too)."""
    return proc if isinstance(proc, VideoProcessor) and isinstance(proc, VideoRowWriter) else None


#: rows of ``pixel_values`` per band below which a deferred image is not split across threads
BAND_MIN_ROWS = 1024


async def _all_or_none(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` that cancels the others when one fails (and waits for them)."""
    return await gather_or_cancel([asyncio.ensure_future(a) for a in aws])


def _at(ref: MediaRef, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its refusal naming ``ref``'s content part."""
    try:
        return fn(*args)
    except GatewayError as exc:
        raise GatewayError(exc.code, exc.message, exc.param or ref.param) from None


def _check_payload(items: Sequence[tuple[ItemPlan[Hashable], MediaRef]], itemsize: int, limit: int) -> None:
    """Refuse (413 ``multimodal_payload_too_large``, naming the largest item) planned encoder input
    of more than ``limit`` bytes: each item's primary share (``ItemPlan.primary_values``) x ``itemsize``.

    Raises:
        GatewayError(MULTIMODAL_PAYLOAD_TOO_LARGE): over the limit.
    """
    sizes = [pl.primary_values * itemsize for pl, _ in items]
    if sizes and sum(sizes) > limit:
        raise payload_too_large(sum(sizes), limit, items[sizes.index(max(sizes))][1].param)


def _batch_print(proc: MediaProcessor, plan: ItemPlan[Hashable]) -> str:
    """What a batch-planned item's share owes to its batch (:class:`~mmgate.models.family.BatchPlanner`), a
    fingerprint suffix: ``""`` for an item whose share equals its share alone."""
    suffix = proc.batch_fingerprint(plan) if isinstance(proc, BatchPlanner) else ""  # type: ignore[arg-type]
    return f":{suffix}" if suffix else ""


def _run(rep: Replacement) -> tuple[int, ...] | int:
    """The ids an anchor expands to (token-level updates), else their count (text-level: known once the
    prompt is tokenized again; lead, embedding and trailing tokens)."""
    if rep.text is None:
        return rep.token_ids
    return rep.embed_offset + rep.embed_length + rep.trail


def _small_conversation(req: ChatCompletionRequest) -> bool:
    """Few messages and little caller text: rendering costs less than a trip to the pool."""
    if len(req.messages) > _INLINE_RENDER_MESSAGES or req.chat_template_kwargs:
        return False
    chars = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif content is not None:
            chars += sum(len(p.text) for p in content if isinstance(p, TextPart))
        for extra in (message.reasoning_content, message.name, message.tool_call_id):
            chars += len(extra) if extra else 0
        if message.tool_calls or chars > _INLINE_RENDER_CHARS:
            return False
    return not getattr(req, "tools", None)


def _text_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of every caller string a template may render (content, text parts, names, tool
    calls, reasoning)."""
    total = 0
    stack: list[Any] = list(messages)
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
