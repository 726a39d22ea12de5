"""mmgate: a multimodal front end for LLM inference engines.

See ``docs/`` and ``../shared/ARCHITECTURE.md`` for the pipeline:
plan -> render+tokenize -> fetch+decode -> preprocess -> expand -> select worker
-> assemble -> transport -> engine.
"""

__version__ = "0.1.0"
