"""Build hook: only the optional C extension; the project metadata lives in pyproject.toml.

``mmgate._native.tvresize`` (torch's uint8 antialiased resize passes, see
``src/mmgate/media/tv_resize.py``) is built with the system C compiler by
``pip install [-e] .``.  It is optional: where it does not build, the install
still succeeds and ``mmgate.media.tv_resize`` runs its exact numpy fallback.

``mmgate._native.patchrows`` (uint8 frames -> Qwen-VL ``pixel_values`` rows, a gather through
the normalization table; see ``src/mmgate/models/patch_native.py``) is optional the same way:
without it ``mmgate.models.image_rows`` runs its numpy path (the same values).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mmgate._native.tvresize",
            sources=["src/mmgate/_native/tvresize.c"],
            optional=True,
        ),
        Extension(
            "mmgate._native.patchrows",
            sources=["src/mmgate/_native/patchrows.c"],
            optional=True,
        ),
    ],
)
