"""How long a batch computes: learned from the batches that ran (the dispatcher is the one writer), per
model, per batch-size band and, for a model with inputs of any size, per band of its samples' size
(elements); the batcher's "auto" window and deadline-aware admission (forecast.py) read them."""

from __future__ import annotations

SMOOTHING = 0.2  # weight of the newest batch in a band's average: a few batches follow a change


class ComputeTimes:
    """Expected compute seconds of a batch, per model and per power-of-two band of its samples (and of the
    elements of each of its samples, where they vary), for the version that computed last (a new live
    version starts afresh: it computes at its own speed)."""

    def __init__(self) -> None:
        self._bands: dict[str, dict[tuple[int, int], float]] = {}
        self._least: dict[str, int] = {}  # model -> the smallest elements band measured
        self._versions: dict[str, str] = {}

    def observe(self, model: str, version: str, samples: int, seconds: float, elements: int | None = None) -> None:
        """A batch of `samples` samples (of `elements` input elements each, where that varies) of `version` of
        `model` computed in `seconds`."""
        if self._versions.get(model) != version:
            self._versions[model] = version
            self._bands[model] = {}
            self._least.pop(model, None)
        bands = self._bands[model]
        band = (samples.bit_length(), (elements or 0).bit_length())
        self._least[model] = min(band[1], self._least.get(model, band[1]))
        known = bands.get(band)
        bands[band] = seconds if known is None else known + SMOOTHING * (seconds - known)

    def batch_s(self, model: str, samples: int, elements: int | None = None) -> float | None:
        """Expected seconds for a batch of `samples` samples of `elements` elements each (None: the smallest
        measured); a band not yet measured takes the nearest smaller one measured (a batch computes no
        faster with more or larger samples), else None."""
        bands = self._bands.get(model)
        if not bands:
            return None
        band = samples.bit_length()
        size = elements.bit_length() if elements is not None else self._least[model]
        known = bands.get((band, size))
        if known is not None:  # the common case, for every request's admission: no scan
            return known
        smaller = [(e, s) for s, e in bands if s <= band and e <= size]
        if not smaller:
            return None
        e, s = max(smaller)
        return bands[(s, e)]
