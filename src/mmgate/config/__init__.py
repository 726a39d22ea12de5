"""Configuration: read once at start-up, passed down.

``options.py`` is the one mechanism (a record drives a flag, its environment fallback, ``--help`` and
docs/configuration.md); ``settings.py`` builds the ``mmgate serve`` :class:`Settings` from it;
``docs.py`` renders docs/configuration.md (``python -m mmgate.config.docs``).
"""
