"""What the dispatch layer reads of the running gateway.

Stage: dispatch.  :class:`DispatchContext` names the parts of :class:`mmgate.gateway.state.GatewayState`
that the dispatchers (:mod:`mmgate.routing.dispatch`), the capability check and PD pairing use, so that
``routing/`` imports nothing above it: the gateway's state satisfies it structurally.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from mmgate.pipeline.budget import InflightBudget
from mmgate.pipeline.prepare import Pipeline
from mmgate.routing.workers import WorkerRegistry
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.config.settings import Settings


class DispatchContext(Protocol):
    """The served model, its pipeline and workers, the in-flight budget and the preprocessing pool."""

    @property
    def settings(self) -> Settings: ...

    @property
    def runtime(self) -> ModelRuntime: ...

    @property
    def pipeline(self) -> Pipeline: ...

    @property
    def workers(self) -> WorkerRegistry: ...

    @property
    def budget(self) -> InflightBudget: ...

    @property
    def executor(self) -> ThreadPoolExecutor: ...
