"""Fixes for bugs of the installed transformers' model classes, each applied only while the bug is there.

Stage: engine start-up (:func:`mmgate.refengine.bundle.load_model` calls :func:`apply_model_fixes`
on every model it builds).  In: a built model; out: the same model, with forward hooks where a
known bug of its class is present in the installed source, and the names of the fixes applied
(logged by the engine, tested in ``tests/refengine/test_refengine_llama4.py``).  No fix replaces
reference code: each one is a hook around the unchanged ``forward``, so the computation is
transformers' own, and each is skipped as soon as the installed transformers no longer has the bug.

Fixes:

* ``llama4_image_outputs`` (transformers 5.24 ``models/llama4/modeling_llama4.py``
  ``Llama4ForConditionalGeneration.forward``, its last statement): the output is built with
  ``image_outputs=outputs.image_outputs``, where ``outputs`` is the language model's
  ``MoeCausalLMOutputWithPast``, which has no such attribute, so *every* call with
  ``return_dict=True`` (text-only ones and ``generate`` included) raises ``AttributeError:
  'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'``.  What the line means is
  the image encoder's output of that call (``mm_encoder_outputs["image"]``, as the other
  multimodal models return it).  The fix: a pre-hook on the model notes the call's
  ``mm_encoder_outputs["image"]`` (None when absent), a hook on ``vision_model`` notes the tower's
  output when the call computes it, and a hook on ``language_model`` sets ``image_outputs`` on the
  language model's output to what was noted, so the buggy line reads the intended value.  Logits,
  cache and every other field are untouched.  Applied while the class's ``forward`` source holds
  :data:`LLAMA4_BUGGY_LINE`.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

__all__ = ["LLAMA4_BUGGY_LINE", "apply_model_fixes", "llama4_forward_is_buggy"]

#: the statement of transformers 5.24 ``Llama4ForConditionalGeneration.forward`` that raises
LLAMA4_BUGGY_LINE = "image_outputs=outputs.image_outputs"


def llama4_forward_is_buggy(cls: type) -> bool:
    """Whether ``cls.forward`` (decorators unwrapped) still holds :data:`LLAMA4_BUGGY_LINE`."""
    try:
        source = inspect.getsource(inspect.unwrap(getattr(cls, "forward")))
    except (OSError, TypeError):
        return False
    return LLAMA4_BUGGY_LINE in "".join(source.split())


def _fix_llama4_image_outputs(model: torch.nn.Module) -> None:
    """Hooks that give the language model's output the call's image encoder output (module docstring).

    What a call noted is kept per thread (the engine may run forwards on several threads at once) and dropped
    once the language model's output holds it, so no request's vision output outlives its call."""
    noted = threading.local()

    def before(_module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        given = kwargs.get("mm_encoder_outputs") or {}
        noted.image = given.get("image")

    def tower(_module: torch.nn.Module, _args: tuple, output: Any) -> None:
        noted.image = output

    def language(_module: torch.nn.Module, _args: tuple, output: Any) -> None:
        image = getattr(noted, "image", None)
        noted.image = None
        if not isinstance(output, tuple) and not hasattr(output, "image_outputs"):
            output.image_outputs = image

    vision_model: torch.nn.Module = getattr(model, "vision_model")
    language_model: torch.nn.Module = getattr(model, "language_model")
    model.register_forward_pre_hook(before, with_kwargs=True)
    vision_model.register_forward_hook(tower)
    language_model.register_forward_hook(language)


def apply_model_fixes(model: torch.nn.Module) -> tuple[str, ...]:
    """Apply every fix whose bug ``model``'s class has in the installed transformers.

    Returns:
        The names of the fixes applied (empty: none needed).
    """
    applied: list[str] = []
    if type(model).__name__ == "Llama4ForConditionalGeneration" and llama4_forward_is_buggy(type(model)):
        _fix_llama4_image_outputs(model)
        applied.append("llama4_image_outputs")
    return tuple(applied)
