"""Continuous batching over the session store: one forward per step mixes the prompt chunks of
arriving turns, the recomputed history of returning sessions, and the decode tokens of running ones."""

from .engine import Engine, EngineStats
from .request import RequestFailed, RequestHandle, RequestMetrics, RequestOutput, RequestStatus
from .runner import StepRecord
from .sampling import SamplingParams
from .scheduler import SchedulerConfig

__all__ = [
    "Engine", "EngineStats", "RequestFailed", "RequestHandle", "RequestMetrics", "RequestOutput", "RequestStatus",
    "SamplingParams", "SchedulerConfig", "StepRecord",
]
