"""Observation: the Prometheus metrics (``metrics.py``) and the ``--log-mm-timing`` timing log
(``timing_log.py``), fed by one stage-timing helper.  Below every stage; imports nothing of mmgate."""
