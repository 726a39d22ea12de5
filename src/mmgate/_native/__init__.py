"""Optional compiled kernels, built from the C sources beside this file by ``pip install``.

* ``tvresize``: torch's CPU uint8 antialiased resize passes (:mod:`mmgate.media.tv_resize`
  is the entry point; it falls back to numpy when the extension is not built).
* ``patchrows``: uint8 frames -> Qwen-VL ``pixel_values`` rows (:mod:`mmgate.models.patch_native`; numpy
  fallback in :mod:`mmgate.models.image_rows`).
"""
