"""``python -m mmgate.refengine --model DIR --port N``: the CPU reference engine (see ``server.main``)."""

from __future__ import annotations

from mmgate.refengine.server import main

raise SystemExit(main())
