"""Each pod's GPU memory as its caching allocator holds it, and how traffic moves it.

A pod reserves its weights and a pool for activations. Each step the pool must
hold the step's largest batch and the fragmented blocks: free blocks inside
partly used segments, which no large allocation can use. The pool never shrinks
by itself (that is the caching allocator); varied batch shapes fragment more of
it the busier the pod is. A trim (torch.cuda.empty_cache) returns the cached
part: whole free segments, but not the fragmented blocks inside partly used
ones. A restart starts from nothing.

Where pods share a GPU, a pool grows only into memory no other pod holds; a
pod that cannot grow enough runs out of memory for the largest batches of
that step.
"""

from __future__ import annotations

import numpy as np

from deploy.sim.fleet import GPU_GIB, Model

TAU_S = 4 * 3600.0  # at full utilisation fragmentation nears its cap with this time constant
BATCH_SIGMA = 0.35  # spread of a step's largest batch about the pod's utilisation
SCRAPE_LOW = 0.3  # at a scrape, the tensors in use are between this share and all of the step's largest batch
WARM_UTILISATION = 0.7  # how busy the pods of the warm-started fleet were before the simulation began


class Memory:
    """GPU memory of every pod, one row (slot) per pod, as arrays so a step costs the same for 100 or 10,000."""

    def __init__(self, gpus: int, models: tuple[Model, ...]) -> None:
        self.gpus = gpus
        self._workspace = np.array([m.workspace_gib for m in models], dtype=float)
        self._frag_cap = np.array([m.frag_cap_gib for m in models], dtype=float)
        self._weights = np.array([m.weights_gib for m in models], dtype=float)
        size = 256
        self.model = np.zeros(size, dtype=np.int64)
        self.gpu = np.zeros(size, dtype=np.int64)
        self.request = np.zeros(size)
        self.pool = np.zeros(size)  # reserved beyond the weights
        self.frag = np.zeros(size)  # fragmented part of the pool
        self.act = np.zeros(size)  # tensors in use at the last scrape
        self.used = np.zeros(size, dtype=bool)
        self.ready = np.zeros(size, dtype=bool)
        self._free: list[int] = []
        self._next = 0

    def add(self, model: int, gpu: int, request: float) -> int:
        """A pod bound to `gpu` begins loading; its slot."""
        if self._free:
            slot = self._free.pop()
        else:
            if self._next == self.used.size:
                self._grow()
            slot = self._next
            self._next += 1
        self.model[slot], self.gpu[slot], self.request[slot] = model, gpu, request
        self.pool[slot] = self.frag[slot] = self.act[slot] = 0.0
        self.used[slot], self.ready[slot] = True, False
        return slot

    def age(self, slot: int, age_s: float, room: float) -> float:
        """Give a pod of the warm-started fleet the pool and fragmentation `age_s` of traffic left it.

        `room` is what its GPU had free beside it: the pool grows no further. Returns what the pod holds.
        """
        model = self.model[slot]
        frag = self._frag_cap[model] * -np.expm1(-WARM_UTILISATION * age_s / TAU_S)
        pool = min(self._workspace[model] + frag, max(room - self._weights[model], 0.0))
        self.pool[slot], self.frag[slot] = pool, min(frag, pool)
        return float(self._weights[model] + pool)

    def mark_ready(self, slot: int) -> None:
        """The pod's model is loaded: from now on traffic moves its memory."""
        self.ready[slot] = True

    def stop(self, slot: int) -> None:
        """The pod no longer serves (it is terminating): its memory stays held, and still, until it is gone."""
        self.ready[slot] = False

    def remove(self, slot: int) -> None:
        """The pod is gone and its memory with it."""
        self.used[slot] = self.ready[slot] = False
        self._free.append(slot)

    def trim(self, slot: int) -> None:
        """empty_cache: whole free segments go back to the GPU, fragmented blocks stay."""
        self.pool[slot] = self.act[slot] + self.frag[slot]

    def reserved(self) -> np.ndarray:
        """Per slot, what the pod's allocator holds (GiB): its weights once loading, and its pool."""
        return np.where(self.used, self._weights[self.model] + self.pool, 0.0)

    def unused(self) -> np.ndarray:
        """Per slot, what the pod holds without a tensor in it (GiB): cached and fragmented."""
        return np.where(self.used, self.pool - self.act, 0.0)

    def occupancy(self) -> np.ndarray:
        """Per GPU, the memory no other pod can have: each pod's request or, if more, what it holds."""
        held = np.maximum(self.request, self._weights[self.model] + self.pool)
        return np.bincount(self.gpu[self.used], weights=held[self.used], minlength=self.gpus)

    def drift(self, utilisation: np.ndarray, dt: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Move every ready pod's memory through one step at its model's `utilisation`.

        Returns the slots moved and, for each, the share of its largest batch it had no memory for.
        """
        idx = np.flatnonzero(self.ready)
        if not idx.size:
            return idx, np.zeros(0)
        model = self.model[idx]
        rho = utilisation[model]
        peak = self._workspace[model] * np.minimum(1.0, rho * rng.lognormal(0.0, BATCH_SIGMA, idx.size))
        frag = self.frag[idx]
        cap = self._frag_cap[model]
        frag = np.minimum(cap, frag + (cap - frag) * -np.expm1(-rho * dt / TAU_S) * rng.uniform(0.0, 2.0, idx.size))
        pool = self.pool[idx]
        want = np.maximum(pool, peak + frag)
        # Growth within a pod's request is memory it already holds; beyond it, it comes from the GPU's free part.
        weights, request, gpu = self._weights[model], self.request[idx], self.gpu[idx]
        extra = np.maximum(request, weights + want) - np.maximum(request, weights + pool)
        demand = np.bincount(gpu, weights=extra, minlength=self.gpus)
        over = self.occupancy() + demand - GPU_GIB
        share = np.ones(self.gpus)
        short = (over > 0) & (demand > 0)
        share[short] = np.clip(1.0 - over[short] / demand[short], 0.0, 1.0)
        pool = want - extra * (1.0 - share[gpu])
        frag = np.minimum(frag, pool)
        served = np.minimum(peak, pool - frag)
        short = np.where(peak > served + 1e-9, 1.0 - served / np.maximum(peak, 1e-9), 0.0)
        self.pool[idx], self.frag[idx] = pool, frag
        self.act[idx] = served * rng.uniform(SCRAPE_LOW, 1.0, idx.size)
        return idx, short

    def _grow(self) -> None:
        for name in ("model", "gpu", "request", "pool", "frag", "act", "used", "ready"):
            old = getattr(self, name)
            new = np.zeros(old.size * 2, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
