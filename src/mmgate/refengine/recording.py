"""Debug hook: record each request's final model inputs (``mmgate engine --record-dir DIR``).

Stage: engine, right before the model thread takes a request.  In: the
request id and its :class:`~mmgate.refengine.mm_inputs.ModelInputs`; out:
``DIR/<request_id>.npz`` holding ``input_ids`` ``[1, seq]`` int64 and every
forward tensor under its keyword name (``pixel_values``, ``image_grid_thw``,
``mm_token_type_ids``, ...), exactly as the model receives them (bfloat16 as
its raw 16-bit patterns, ``int16``).  Written atomically (temporary name, then
rename), so a reader never sees half a file.  Used to show that router-mode
and worker-mode requests reach the model bit-identical.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

from mmgate.refengine.mm_inputs import ModelInputs


def _array(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


class RequestRecorder:
    """Writes one ``.npz`` per request into ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path_for(self, request_id: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9._-]", "_", request_id) + ".npz")

    def record(self, request_id: str, inputs: ModelInputs) -> Path:
        arrays = {"input_ids": _array(inputs.input_ids)}
        arrays.update({name: _array(t) for name, t in inputs.mm_kwargs.items()})
        arrays.update({name: np.array(flag) for name, flag in inputs.flags.items()})
        final = self.path_for(request_id)
        temporary = final.with_name(f".{final.stem}.{os.getpid()}.tmp.npz")
        np.savez(temporary, **arrays)  # type: ignore[arg-type]
        os.replace(temporary, final)
        return final
