"""Pre-scaling: a pure scaling policy (forecast, simulated futures, rules) that the
dispatcher service and the simulation both run; actuators carry its decisions out."""

from dispatcher.autoscale.arrival_forecast import ArrivalHistory, RateForecast
from dispatcher.autoscale.futures import (
    DRAINING,
    LIVE,
    STARTING,
    FleetForecast,
    FleetSnapshot,
    InstanceState,
    drain_order,
    forecast_fleet,
)
from dispatcher.autoscale.rules import ActionHistory, ScalingRules, apply_rules, count_reversals
from dispatcher.autoscale.scalers import (
    SCALERS,
    Autoscaler,
    PredictiveScaler,
    ReactiveScaler,
    ScalerTuning,
    ScalingDecision,
    ScheduledScaler,
    StaticScaler,
    make_autoscaler,
)

__all__ = ["SCALERS", "ScalerTuning", "make_autoscaler", "DRAINING", "LIVE", "STARTING", "ActionHistory", "ArrivalHistory", "Autoscaler", "FleetForecast",
           "FleetSnapshot", "InstanceState", "PredictiveScaler", "RateForecast", "ReactiveScaler", "ScalingDecision",
           "ScalingRules", "ScheduledScaler", "StaticScaler", "apply_rules", "count_reversals", "drain_order", "forecast_fleet"]
