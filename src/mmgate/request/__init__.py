"""The chat request every endpoint's request becomes: its shapes (``protocol``), its constraint
(``structured``, ``constraint_limits``) and the one parse entry (``parse``).  Below ``api/``: the pipeline,
planning and routing read it; nothing here imports ``api/``."""
