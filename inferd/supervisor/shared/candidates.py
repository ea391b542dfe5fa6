"""The candidate version of each model under trial: one record, written by the canary manager, read by everyone.

A candidate is loaded and warmed beside the live version on every worker, as a
reload would load it, and then, instead of a flip, it is tried:

- a canary takes `weight` percent of the model's batches (by samples; the
  rest, and every request that names the live version, stay on the live one);
- a shadow recomputes `weight` percent of them on idle executors, and only
  the comparison is kept: clients get the live version's replies.

The record is saved in state_dir with the live versions, so a restart keeps
the trial going.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn


class Mode(StrEnum):
    """How a candidate is tried."""

    CANARY = "canary"
    SHADOW = "shadow"


@dataclass(frozen=True)
class Candidate:
    """A version of a model under trial beside the live one."""

    version: str
    mode: Mode
    weight: float  # percent of the model's samples it computes
    guarded: bool  # rolled back by itself when it does worse than the live version
    promote_at: float | None  # wall-clock time (time.time()) it is promoted at if still clean
    started: float  # wall-clock time the trial began
    allow_signature_change: bool = False  # else a worker catching up checks its outputs against live's

    def describe(self) -> str:
        """How logs, status and systemd name it: "canary v3 at 10 %"."""
        return f"{self.mode} {self.version} at {self.weight:g} %"

    def to_json(self) -> dict[str, Any]:
        """What the state file keeps of it."""
        return {"version": self.version, "mode": str(self.mode), "weight": self.weight, "guarded": self.guarded,
                "promote_at": self.promote_at, "started": self.started,
                "allow_signature_change": self.allow_signature_change}

    @classmethod
    def from_json(cls, data: Any) -> Candidate:
        """Read what `to_json` wrote; ValueError names what is wrong."""
        try:
            promote_at = data["promote_at"]
            candidate = cls(str(data["version"]), Mode(data["mode"]), float(data["weight"]), bool(data["guarded"]),
                            None if promote_at is None else float(promote_at), float(data["started"]),
                            bool(data.get("allow_signature_change", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a saved candidate is unreadable ({exc!r})") from None
        problem = weight_problem(candidate.mode, candidate.weight)
        if problem is not None:
            raise ValueError(f"a saved candidate's {problem}")
        return candidate


def weight_problem(mode: Mode, weight: float) -> str | None:
    """The sentence for a weight that is not a percentage; None for one that is."""
    return None if 0 <= weight <= 100 else f"{mode} weight is a percentage from 0 to 100, not {weight:g}"


class Candidates(dict[str, Candidate]):
    """model -> its candidate version, for the models that have one.

    Only the CanaryManager calls `set` and `end`; the frontend (which versions a
    request may name), the dispatcher (where a batch goes), the reload manager
    (what stays loaded) and the reports read it.
    """

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("the candidates change only through set() and end()")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def set(self, model: str, candidate: Candidate) -> None:
        """Begin a trial of `candidate`, or change its weight."""
        dict.__setitem__(self, model, candidate)

    def end(self, model: str) -> Candidate | None:
        """End `model`'s trial; return the candidate it had."""
        return dict.pop(self, model, None)

    def canary_version(self, model: str) -> str | None:
        """The version that takes a share of `model`'s requests, if a canary runs."""
        candidate = self.get(model)
        return candidate.version if candidate is not None and candidate.mode == Mode.CANARY else None

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """What to save."""
        return {model: candidate.to_json() for model, candidate in self.items()}


class Split:
    """Routes whole batches so that the share of samples the candidate computed stays at its weight.

    A batch goes to the candidate when that brings the running share nearer the
    weight than sending it to the live version would: deterministic, so a
    thousand requests split within a batch or two of the weight, and batches are
    never cut in two for it.
    """

    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate
        self.samples = 0
        self.taken = 0

    def take(self, samples: int) -> bool:
        """Whether a batch of `samples` goes to the candidate; counts it either way."""
        self.samples += samples
        owed = self.candidate.weight / 100 * self.samples - self.taken
        if owed * 2 >= samples:
            self.taken += samples
            return True
        return False

    def share(self) -> float:
        """The share of samples routed to the candidate so far, of those it could have taken."""
        return self.taken / self.samples if self.samples else 0.0
