"""Tier (b): every family's image corpus through mmgate and transformers, one test for all.

Parametrized over the ``LIVE`` declaration of each family's live module
(``test_qwen_vl_live_parity``, ``test_llava_live_parity``, ``test_gemma3_live_parity``,
``test_llama4_live_parity``: the cases,
corpora, one comparison and the family's summary checks) and both image backends, run by
``live_support.run_live``: ``pixel_values`` (and the auxiliary tensors) identical to the
reference's, max |diff| exactly 0, refusals exactly where the family expects them.

* ``..._on_a_sample``: the default run's sample (about 20 sizes per family and backend) of the
  families that have one (LLaVA-1.5, LLaVA-NeXT, Gemma 3);
* ``..._on_edge_and_random_images`` (``slow``): every edge size and >= 200 random sizes from the
  seeded RNG (``MMGATE_PARITY_SEED`` pins it; each family's module prints its seed).

The conversation tests and the checks only one family has stay in the family's module.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

import test_gemma3_live_parity as gemma3  # noqa: E402
import test_internvl_live_parity as internvl  # noqa: E402
import test_llama4_live_parity as llama4  # noqa: E402
import test_llava_live_parity as llava  # noqa: E402
import test_llava_onevision_live_parity as llava_onevision  # noqa: E402
import test_qwen_vl_live_parity as qwen_vl  # noqa: E402
from live_support import BACKENDS, LiveFamily, run_live  # noqa: E402

from mmgate.models.backend import ImageBackend  # noqa: E402

FAMILIES: tuple[LiveFamily, ...] = (qwen_vl.LIVE, llava.LIVE, gemma3.LIVE, llava_onevision.LIVE, llama4.LIVE,
                                    internvl.LIVE)


def _params(with_sample: bool) -> list:
    return [pytest.param(f, key, be, id=f"{f.case_id(key)}-{be.value}")
            for f in FAMILIES if f.sample is not None or not with_sample for key in f.keys for be in BACKENDS]


@pytest.mark.parametrize(("family", "key", "backend"), _params(with_sample=True))
def test_pixel_values_equal_the_reference_on_a_sample(family: LiveFamily, key: str, backend: ImageBackend) -> None:
    assert family.sample is not None
    run_live(family, key, backend, family.sample(key))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "key", "backend"), _params(with_sample=False))
def test_pixel_values_equal_the_reference_on_edge_and_random_images(family: LiveFamily, key: str,
                                                                     backend: ImageBackend) -> None:
    run_live(family, key, backend, family.full(key))
