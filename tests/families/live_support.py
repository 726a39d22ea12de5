"""The live tier's harness (tier (b)): one loop that runs a family's corpus through mmgate and transformers.

In: a :class:`LiveFamily` (what one family's live module declares: its cases, its corpora, how one
image is compared) and a case key and backend.  Out: one summary line printed and the assertions
of the tier: no mismatch, max |diff| exactly 0, and the family's own summary checks (which images
were refused, how many compared with crops).  ``test_live_parity.py`` parametrizes this over every
family; the conversation tests stay in each family's module (their prompt updates differ).

Also here, shared by the family modules: the run's seed (:func:`live_seed`: ``MMGATE_PARITY_SEED``
or a fresh one, printed per family as before), the reference processors of one bundle for both
backends (:func:`load_reference`) and the comparisons (:func:`max_abs_diff`, :func:`tensor_problems`,
:func:`first_difference`).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from parity_support import MODES, ImageSpec, find_bundle_dir

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import load_family
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend

MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)
EQUAL, REFUSED = "equal", "refused"  # outcomes of a comparison besides a mismatch description


def live_seed(label: str) -> int:
    """The run's seed: ``MMGATE_PARITY_SEED`` or 32 random bits, printed with how to pin it."""
    seed = int(os.environ.get("MMGATE_PARITY_SEED") or secrets.randbits(32))
    print(f"\n[{label} live parity] seed={seed} (rerun with MMGATE_PARITY_SEED={seed})")
    return seed


@dataclass
class Reference:
    """One bundle with its mmgate families and the transformers processors, per backend."""

    folder: str
    path: Path
    bundle: object
    tokenizer: object
    families: dict  # backend -> mmgate family
    ref_image: dict  # backend -> reference image processor
    ref_processor: dict  # backend -> reference processor built with that image processor


def load_reference(folder: str, image_processor_class: str,
                   family_of: Callable[[object, object, ImageBackend], object] = load_family) -> Reference:
    """``AutoProcessor`` (torchvision backend) and ``AutoImageProcessor(backend="pil")`` of ``folder``,
    checked to be ``image_processor_class`` and its ``Pil`` twin; skips when the bundle is absent."""
    path = find_bundle_dir(folder)
    if path is None:
        pytest.skip(f"model bundle {folder} not on MMGATE_MODEL_PATH / ../shared/models")
    from transformers import AutoImageProcessor, AutoProcessor

    bundle = load_bundle(Path(path))
    tok = load_tokenizer(bundle)
    processor = AutoProcessor.from_pretrained(str(path))
    pil_ip = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    assert type(processor.image_processor).__name__ == image_processor_class
    assert type(pil_ip).__name__ == image_processor_class + "Pil"
    return Reference(
        folder=folder, path=Path(path), bundle=bundle, tokenizer=tok,
        families={be: family_of(bundle, tok, be) for be in BACKENDS},
        ref_image={ImageBackend.TORCHVISION: processor.image_processor, ImageBackend.PIL: pil_ip},
        ref_processor={ImageBackend.TORCHVISION: processor,
                       ImageBackend.PIL: AutoProcessor.from_pretrained(str(path), image_processor=pil_ip)},
    )


# ---------------------------------------------------------------- corpora

#: the random sizes' modes: RGB six times as often as each other mode
RANDOM_MODES = ("RGB",) * 6 + MODES


def mode_specs(seed: int, first: Callable[[int], tuple[int, int]], second: Callable[[int], tuple[int, int]],
               jpeg: tuple[int, int]) -> list[ImageSpec]:
    """Every mode of ``MODES`` at two off-grid sizes (``first(j)``, ``second(j)``: (width, height) of
    the j-th mode; seeds ``seed + 100 + j`` / ``seed + 200 + j``), then RGB and L JPEGs of ``jpeg``."""
    specs: list[ImageSpec] = []
    for j, mode in enumerate(MODES):
        specs.append(ImageSpec(*first(j), mode, seed + 100 + j, name="mode"))
        specs.append(ImageSpec(*second(j), mode, seed + 200 + j, name="mode"))
    specs += [ImageSpec(*jpeg, m, seed + 300 + k, "JPEG", name="jpeg") for k, m in enumerate(("RGB", "L"))]
    return specs


def random_spec(rng: np.random.Generator, width: int, height: int) -> ImageSpec:
    """A random image of the given size: mode from :data:`RANDOM_MODES`, then (RGB and L only) JPEG
    one time in five, then the seed — drawn from ``rng`` in that order."""
    mode = str(rng.choice(RANDOM_MODES))
    fmt = "JPEG" if mode in ("RGB", "L") and rng.random() < 0.2 else "PNG"
    return ImageSpec(width, height, mode, int(rng.integers(0, 2**31)), fmt, name="random")


# ---------------------------------------------------------------- comparison


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| (0.0 for identical arrays, NaN for different shapes)."""
    if a.shape != b.shape:
        return math.nan
    if np.array_equal(a, b):
        return 0.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def tensor_problems(ref: dict, mine: dict, primary: str = "pixel_values",
                    same_dtype: tuple[str, ...] = ()) -> tuple[list[str], float]:
    """(what differs between the reference's and mmgate's tensors, max |diff| of ``primary``).

    ``primary`` must have the same dtype and shape and be identical; every other key of ``ref``
    must be equal, and those named in ``same_dtype`` of the same dtype."""
    ref_pv, pv = np.asarray(ref[primary]), mine[primary]
    diff = max_abs_diff(ref_pv, pv)
    problems = []
    if ref_pv.shape != pv.shape or ref_pv.dtype != pv.dtype:
        problems.append(f"{primary} {pv.dtype}{pv.shape} != reference {ref_pv.dtype}{ref_pv.shape}")
    elif diff != 0.0:
        problems.append(f"{primary} differ: max |diff| {diff:.3g} on {float(np.mean(ref_pv != pv)):.4%} of values")
    for key in ref:
        if key == primary:
            continue
        want, got = np.asarray(ref[key]), np.asarray(mine[key])
        if (key in same_dtype and want.dtype != got.dtype) or not np.array_equal(want, got):
            problems.append(f"{key} {got.tolist()} != reference {want.tolist()}")
    return problems, diff


def first_difference(ids: Sequence[int], ref_ids: Sequence[int]) -> str:
    """Where two id lists part, for a failure message."""
    first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
    return f"input_ids differ at {first} (len {len(ids)} vs reference {len(ref_ids)})"


# ---------------------------------------------------------------- the loop


@dataclass(frozen=True, slots=True)
class Job:
    """One comparison: an image and the request's ``mm_processor_kwargs``."""

    spec: ImageSpec
    options: dict = field(default_factory=dict)
    data: bytes | None = None  # the encoded image where the case keeps its corpus encoded; else encoded once a run


@dataclass(frozen=True, slots=True)
class Result:
    job: Job
    outcome: str  # EQUAL | REFUSED (by mmgate, where the family expects it) | a mismatch description
    diff: float  # max |diff| of pixel_values (0.0 where refused)


@dataclass(frozen=True, slots=True)
class LiveFamily:
    """What one family's live module declares for :func:`run_live` (``key``: a case of the family,
    e.g. a bundle; ``backend``: an :class:`ImageBackend`)."""

    label: str  # in ids and messages
    keys: tuple[str, ...]  # the family's cases
    key_id: Callable[[str], str]  # a case's part of the test id
    seed: int
    compare: Callable[[str, ImageBackend, Job, bytes], tuple[str, float]]
    full: Callable[[str], list[Job]]  # the slow tier's corpus: every edge size and >= 200 random sizes
    sample: Callable[[str], list[Job]] | None  # the default run's sample (None: the family has no fast tier)
    check_results: Callable[[str, ImageBackend, list[Result]], None]  # refusals expected, crops seen, ...

    def case_id(self, key: str) -> str:
        """The case in ids and summary lines: the family's label where it has one case."""
        return self.label if len(self.keys) == 1 else self.key_id(key)


def run_live(family: LiveFamily, key: str, backend: ImageBackend, jobs: list[Job]) -> None:
    """Compare every job (images encoded once), print one summary line, assert the tier."""
    t0 = time.perf_counter()
    results: list[Result] = []
    encoded: dict[ImageSpec, bytes] = {}
    for job in jobs:
        data = job.data if job.data is not None else encoded.get(job.spec)
        if data is None:
            data = encoded[job.spec] = job.spec.encode()
        outcome, diff = family.compare(key, backend, job, data)
        results.append(Result(job, outcome, diff))
    mismatches = [f"{r.job.spec.label()}{f' options={r.job.options}' if r.job.options else ''}: {r.outcome}"
                  for r in results if r.outcome not in (EQUAL, REFUSED)]
    worst = max((r.diff for r in results if r.outcome == EQUAL), default=0.0)
    refused = sum(r.outcome == REFUSED for r in results)
    images = len({r.job.spec for r in results})
    print(f"[{family.case_id(key)} {backend.value}] {images} images, {len(results)} comparisons, "
          f"{refused} refused as the family expects, max |diff| = {worst}, {time.perf_counter() - t0:.1f}s")
    assert not mismatches, (f"seed={family.seed} {key} backend={backend.value}: {len(mismatches)} of {len(results)} "
                            "comparisons differ from the reference:\n" + "\n".join(mismatches))
    assert worst == 0.0
    family.check_results(key, backend, results)
