"""``mmgate serve | engine | sidecar | demo``.

* ``serve``: the OpenAI-compatible gateway (flags in :mod:`mmgate.config.settings`; ``--workers N``:
  N gateway processes on one port, :mod:`mmgate.api.multiproc`).
* ``engine``: the CPU reference engine (:mod:`mmgate.refengine`).
* ``sidecar``: the Redis media-processing sidecar (:mod:`mmgate.sidecar`).
* ``demo``: the quick start — starts a reference engine and a gateway on
  loopback with a bundled Qwen-VL model, sends one chat request with a sample
  image, prints the answer, the prompt token count and the stage timings, then
  stops both (:mod:`mmgate.cli.demo`).

``mmgate COMMAND --help`` lists a command's flags grouped by topic, each with its
default and environment variable; docs/configuration.md lists them all.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence


def serve(argv: Sequence[str]) -> int:
    """Run the gateway until interrupted (uvicorn with the limits of :mod:`mmgate.api.server`).

    With ``--workers N`` (N > 1) this process only supervises N gateway processes serving the same
    port (:mod:`mmgate.api.multiproc`); with the default 1 it is the gateway.

    Returns 0 after a clean stop, 1 when the server did not start (port taken) or, with ``--workers``,
    every process was taken out of rotation for dying too often, 2 on a bad model.
    """
    from mmgate.config.settings import parse_settings

    settings = parse_settings(argv, os.environ)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.processes > 1:
        from mmgate.api.multiproc import Supervisor

        return Supervisor(settings, argv, os.environ).run()

    import uvicorn

    from mmgate.api.app import create_app
    from mmgate.gateway.state import build_state
    from mmgate.api.server import uvicorn_config
    from mmgate.errors import GatewayError

    try:
        state = build_state(settings)
    except GatewayError as exc:
        print(f"mmgate: {exc.message}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn_config(create_app(state), settings))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        return serve(rest)
    if command == "engine":
        from mmgate.refengine.server import main as engine_main

        return int(engine_main(rest) or 0)
    if command == "sidecar":
        from mmgate.sidecar.server import main as sidecar_main
        return sidecar_main(rest)
    if command == "demo":
        from mmgate.cli.demo import main as demo_main

        return demo_main(rest)
    print(f"mmgate: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    return 2

