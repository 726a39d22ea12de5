"""``python -m mmgate.cli``: the ``mmgate`` command (:func:`mmgate.cli.main`)."""

from __future__ import annotations

from mmgate.cli import main

raise SystemExit(main())
