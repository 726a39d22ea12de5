"""What a prefill leg hands its decode leg: the prompt's KV cache, the model's position state, the first tokens.

Stage: engine model thread (snapshot after the prefill forward; restore before the first decode
step) and the handoff between legs (:mod:`.handoff` carries :func:`pack_prefill` trees).

The split mirrors SGLang's PD (``disaggregation/prefill.py``: the prefill engine runs the prompt,
samples the first output token and sends it with the KV, ``disaggregation/decode.py`` starts from
it), for every wire of the reference engine, vLLM's included (a vLLM NixlConnector decode instead
recomputes the last prompt position from the transferred blocks; with greedy sampling both give
the same ids, and one scheme keeps the engine's three wires alike).  Per request:

  * ``layers``: each cache layer's ``keys`` / ``values`` (``[1, kv_heads, seq, head_dim]`` float32,
    the transformers 5.24 ``DynamicLayer`` tensors) and, for a sliding-window layer, its
    ``cumulative_length``;
  * ``rope``: every module's ``rope_deltas`` after the prefill (Qwen-VL M-RoPE keeps its position
    offset there, ``Qwen2VLModel.compute_3d_position_ids``; later steps add it to the cache length);
  * ``first``: per choice, the sampled token, its logprobs, and the choice's ``torch.Generator``
    state after the draw (seeded sampling continues where the prefill left off);
  * ``prompt_ids``: the decode leg refuses a KV computed for another prompt.

Restoring gives the decode leg exactly the state a single engine has after its own prefill, so the
decode steps run the same arithmetic on the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig

from mmgate.refengine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A choice's first output token, sampled by the prefill leg."""

    token: int
    logprobs: TokenLogprobs | None
    generator_state: torch.Tensor | None  # the choice's generator after drawing it; None unless seeded sampling


@dataclass(frozen=True, slots=True)
class PrefillState:
    """Everything the decode leg needs to continue a prefilled request (see the module docstring)."""

    prompt_ids: tuple[int, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor, int | None], ...]  # (keys, values, cumulative_length)
    rope: tuple[tuple[str, torch.Tensor], ...]  # (module name, rope_deltas)
    first: tuple[FirstToken, ...]  # one per choice


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


def rope_state(model: torch.nn.Module) -> tuple[tuple[str, torch.Tensor], ...]:
    """Every module's ``rope_deltas`` tensor, by module name."""
    return tuple((name, module.rope_deltas.detach().clone()) for name, module in model.named_modules()
                 if isinstance(getattr(module, "rope_deltas", None), torch.Tensor))


def set_rope_state(model: torch.nn.Module, state: tuple[tuple[str, torch.Tensor], ...]) -> None:
    """Clear every module's ``rope_deltas``, then set those of ``state``.

    Raises:
        ValueError: ``state`` names a module this model does not have (another model's state).
    """
    clear_rope_state(model)
    modules = dict(model.named_modules())
    for name, deltas in state:
        if name not in modules:
            raise ValueError(f"the handed-over position state names module {name!r}, which this model lacks")
        setattr(modules[name], "rope_deltas", deltas)  # noqa: B010 - any module type


def snapshot_cache(cache: DynamicCache) -> tuple[tuple[torch.Tensor, torch.Tensor, int | None], ...]:
    """Each layer's (keys, values, cumulative_length or None); the tensors are the cache's own (not copied)."""
    out = []
    layers: list[Any] = list(cache.layers)  # DynamicLayer / DynamicSlidingWindowLayer for these models
    for layer in layers:
        if not layer.is_initialized:
            raise ValueError("a cache layer was never written by the prefill")
        cumulative = getattr(layer, "cumulative_length", None)
        out.append((layer.keys, layer.values, int(cumulative) if isinstance(cumulative, int) else None))
    return tuple(out)


def restore_cache(config: PretrainedConfig,
                  layers: tuple[tuple[torch.Tensor, torch.Tensor, int | None], ...]) -> DynamicCache:
    """A fresh ``DynamicCache(config=...)`` holding ``layers`` (its layer kinds from the config, as the prefill's).

    Raises:
        ValueError: the layer count differs from the model's (another model's KV).
    """
    cache = DynamicCache(config=config)
    own: list[Any] = list(cache.layers)
    if len(own) != len(layers):
        raise ValueError(f"the handed-over KV has {len(layers)} layers; this model has {len(own)}")
    for layer, (keys, values, cumulative) in zip(own, layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if cumulative is not None and hasattr(layer, "cumulative_length"):
            layer.cumulative_length = cumulative
    return cache


def pack_prefill(state: PrefillState) -> dict[str, Any]:
    """``state`` as a handoff tree (:func:`mmgate.refengine.handoff.encode_tree`)."""
    first = [{"token": f.token, "generator": f.generator_state,
              "logprobs": None if f.logprobs is None else [f.logprobs.token_id, f.logprobs.logprob,
                                                           list(f.logprobs.top_ids), list(f.logprobs.top_logprobs)]}
             for f in state.first]
    return {"prompt_ids": list(state.prompt_ids), "first": first,
            "layers": [[k, v, c] for k, v, c in state.layers], "rope": [[n, t] for n, t in state.rope]}


def unpack_prefill(tree: Any) -> PrefillState:
    """The inverse of :func:`pack_prefill`.

    Raises:
        ValueError: a tree of another shape.
    """
    try:
        first = []
        for f in tree["first"]:
            lp = f["logprobs"]
            logprobs = None if lp is None else TokenLogprobs(int(lp[0]), float(lp[1]), tuple(int(i) for i in lp[2]),
                                                             tuple(float(v) for v in lp[3]))
            first.append(FirstToken(int(f["token"]), logprobs, f["generator"]))
        return PrefillState(prompt_ids=tuple(int(i) for i in tree["prompt_ids"]),
                            layers=tuple((k, v, None if c is None else int(c)) for k, v, c in tree["layers"]),
                            rope=tuple((str(n), t) for n, t in tree["rope"]), first=tuple(first))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"the handed-over prefill state is malformed ({exc})") from None
