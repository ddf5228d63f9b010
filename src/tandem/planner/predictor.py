"""Forecasters of the next interval's value (request rate, ISL, OSL) from past intervals.

`constant` repeats the last value, `moving_average` averages the last `window`, `holt` is
double exponential smoothing (level + trend), so a ramp is followed instead of lagged.
Each has `observe(x)` and `predict() -> float` (0 before any observation); never negative.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Predictor(Protocol):
    def observe(self, value: float) -> None: ...

    def predict(self) -> float: ...


class ConstantPredictor:
    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self) -> float:
        return self._last


class MovingAveragePredictor:
    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"window={window}; expected >= 1")
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0


class HoltPredictor:
    """level' = α·x + (1−α)(level + trend); trend' = β(level' − level) + (1−β)·trend;
    forecast = level + trend (one interval ahead)."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        for name, v in (("alpha", alpha), ("beta", beta)):
            if not 0 < v <= 1:
                raise ValueError(f"{name}={v}; expected 0 < {name} <= 1")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def observe(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        level = self.alpha * value + (1 - self.alpha) * (self._level + self._trend)
        self._trend = self.beta * (level - self._level) + (1 - self.beta) * self._trend
        self._level = level

    def predict(self) -> float:
        if self._level is None:
            return 0.0
        return max(self._level + self._trend, 0.0)


PREDICTORS = ("constant", "holt", "moving_average")


def make_predictor(name: str) -> Predictor:
    if name == "constant":
        return ConstantPredictor()
    if name == "moving_average":
        return MovingAveragePredictor()
    if name == "holt":
        return HoltPredictor()
    raise ValueError(f"unknown predictor '{name}'; expected one of: {', '.join(PREDICTORS)}")
