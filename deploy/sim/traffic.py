"""Requests per model over the day, the latency they meet, and the autoscaler that sizes each Deployment.

Traffic is diurnal (lowest at 04:00, highest at 16:00) with seeded noise per
model, sized so that at peak the pods it calls for fill a set share of the
fleet: of its GPUs where pods do not share them, of its GPU memory where they
do. Each pod is an M/M/1 queue (its requests spread evenly by the Service):
a request's time in the pod is exponential with rate mu - lambda, so the share
over the SLO is exp(-SLO * (mu - lambda)).
"""

from __future__ import annotations

import math

import numpy as np

from deploy.sim.fleet import EXCLUSIVE, GPU_GIB, GPUS_PER_NODE, SHARED, Model, request_gib

SLO_S = 0.2
ROLLOUT_HOUR = 10.0  # mid-morning, traffic rising: the rollout runs into the afternoon peak
TROUGH = 0.35  # lowest traffic over highest
PEAK_FILL = {EXCLUSIVE: 0.85, SHARED: 0.8}  # share of the fleet the pods take at peak
NOISE_SIGMA = 0.06  # log-normal noise on each model's rate...
NOISE_CORRELATION_S = 900.0  # ...correlated over about 15 minutes

# The HPA (deploy/kubernetes/autoscaling/hpa.yaml): GPU utilisation 80 % and p99 200 ms targets;
# at once up to doubling (or +2 pods) a minute; down after 5 quiet minutes, every 2 minutes. hpa.yaml
# takes one pod down each time, which suits its 2 to 16 replicas; a Deployment of 1,000 would stay
# hours over its need each evening, so here it is one pod or 5 %, whichever is more.
GPU_TARGET = 0.8
MIN_REPLICAS = 2
TOLERANCE = 0.1
UP_PERIOD_S = 60.0
DOWN_WINDOW_S = 300.0
DOWN_PERIOD_S = 120.0
DOWN_SHARE = 0.05


def diurnal(hour: float) -> float:
    """Traffic at `hour` over the day's highest."""
    return TROUGH + (1 - TROUGH) * 0.5 * (1 - math.cos(2 * math.pi * (hour - 4) / 24))


def target_utilisation(model: Model) -> float:
    """The utilisation at which neither the GPU trigger nor the p99 trigger asks for more pods.

    An M/M/1 pod's p99 is ln(100) / (mu (1 - rho)).
    """
    return min(GPU_TARGET, 1 - math.log(100) / (model.rate * SLO_S))


def late_share(utilisation: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """Share of requests over the SLO at each model's pod utilisation (all of them at or over 1)."""
    return np.where(utilisation < 1, np.exp(-SLO_S * rate * (1 - np.minimum(utilisation, 1))), 1.0)


def trace(models: tuple[Model, ...], mode: str, nodes: int, steps: int, step_s: float, fill: float,
          rng: np.random.Generator) -> np.ndarray:
    """Requests a second per (step, model) for a fleet of `nodes` whose pods fill `fill` of it at peak."""
    shares = np.array([m.share for m in models])
    requests = np.array([request_gib(m, mode) for m in models], dtype=float)
    pods_at_peak = fill * nodes * GPUS_PER_NODE * GPU_GIB / float(shares @ requests) * shares
    peak = pods_at_peak * np.array([m.rate * target_utilisation(m) for m in models])
    hours = np.arange(steps) * step_s / 3600.0
    shape = np.array([diurnal(h) for h in hours])
    phi = math.exp(-step_s / NOISE_CORRELATION_S)
    noise = np.empty((steps, len(models)))
    noise[0] = rng.normal(0.0, NOISE_SIGMA, len(models))
    kicks = rng.normal(0.0, NOISE_SIGMA * math.sqrt(1 - phi * phi), (steps, len(models)))
    for k in range(1, steps):
        noise[k] = phi * noise[k - 1] + kicks[k]
    return shape[:, None] * peak[None, :] * np.exp(noise)


class Autoscaler:
    """One HPA per model, reading the rate its pods see; keeps each Deployment's replica count."""

    def __init__(self, models: tuple[Model, ...], rates: np.ndarray) -> None:
        self._capacity = np.array([m.rate * target_utilisation(m) for m in models])
        self.replicas = np.maximum(MIN_REPLICAS, np.ceil(rates / self._capacity)).astype(np.int64)
        self._last_up = np.full(len(models), -math.inf)
        self._last_down = np.full(len(models), -math.inf)
        self._history: list[tuple[float, np.ndarray]] = []

    def update(self, now: float, rates: np.ndarray) -> np.ndarray:
        """The replica counts at `now` given each model's requests a second."""
        current = self.replicas
        ratio = rates / (current * self._capacity)
        wanted = np.maximum(MIN_REPLICAS, np.ceil(rates / self._capacity)).astype(np.int64)
        wanted = np.where(np.abs(ratio - 1) <= TOLERANCE, current, wanted)
        self._history = [(t, w) for t, w in self._history if now - t < DOWN_WINDOW_S]
        self._history.append((now, wanted))
        stable = np.max([w for _, w in self._history], axis=0)

        up = (wanted > current) & (now - self._last_up >= UP_PERIOD_S)
        limit = np.maximum(2 * current, current + 2)
        down = (stable < current) & (now - self._last_down >= DOWN_PERIOD_S)
        step_down = np.maximum(1, (current * DOWN_SHARE).astype(np.int64))
        self.replicas = np.where(up, np.minimum(wanted, limit),
                                 np.where(down, np.maximum(stable, current - step_down), current))
        self._last_up = np.where(up, now, self._last_up)
        self._last_down = np.where(down, now, self._last_down)
        return self.replicas
