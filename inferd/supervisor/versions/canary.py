"""Trials of a candidate version beside the live one: canary and shadow, their guard, promotion and end.

    reload V --canary W ──▶ the reload manager loads V everywhere (no flip) ──▶ candidates[model] = V, W
                                                                                      │
          promote (by hand, or --promote-after D with a clean window) ◀──────────────┤ every tick, if guarded:
          = a flip to V                                                               │ judge V against live
                                                                                      ▼ over the guard's window
                              rollback (by hand, or the guard) = V unloaded, live serves everything

The canary manager is the one writer of the candidates record; every change is
saved with the live versions before its command returns, so a restart keeps the
trial. The guard's judgement is a pure function of the stats windows, the same
one `inferctl stats` shows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from inferd.config.schema import CanaryGuard, Config
from inferd.models.repository import RepositoryError, model_file
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.processes.workers import WorkerTable
from inferd.supervisor.shared.candidates import Candidate, Candidates, Mode, weight_problem
from inferd.supervisor.shared.command_replies import LoggedReply, Reply
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.stats import Series, Stats
from inferd.supervisor.versions.reload import Reload, ReloadManager

log = logging.getLogger("inferd.canary")

P99_MIN_OK = 100  # ok replies each version needs in the window before their p99s are compared


@dataclass(frozen=True)
class Judgement:
    """The guard's view of a canary against the live version over one window."""

    verdict: str  # "waiting" (too few replies to judge), "clean" or "failing"
    reason: str  # one sentence
    candidate: dict[str, Any]  # requests, ok, failed_share, p99_ms
    live: dict[str, Any]


def _figures(series: Series) -> dict[str, Any]:
    requests = sum(series.replies.values())
    ok = series.replies["ok"]
    failed = series.replies["internal"] + series.replies["timeout"]
    return {"requests": requests, "ok": ok, "failed_share": round(failed / requests, 4) if requests else 0.0,
            "p99_ms": round(series.total.quantile(0.99) * 1000, 3) if ok else None}


def judge(guard: CanaryGuard, candidate: Series, live: Series) -> Judgement:
    """Whether the canary does worse than the live version by more than the guard's margins."""
    mine, theirs = _figures(candidate), _figures(live)
    if mine["requests"] < guard.min_requests:
        return Judgement("waiting", f"{mine['requests']} of the {guard.min_requests} replies it needs to be judged",
                         mine, theirs)
    # A timeout is a failure too: a version too slow for its clients' deadlines answers few of them ok.
    errors, live_errors = mine["failed_share"], theirs["failed_share"]
    if errors - live_errors > guard.max_error_increase:
        return Judgement("failing", f"its share of failed replies (internal or timeout), {errors:.1%}, exceeds "
                         f"the live version's {live_errors:.1%} by more than {guard.max_error_increase:.1%}",
                         mine, theirs)
    if mine["ok"] < P99_MIN_OK or theirs["ok"] < P99_MIN_OK:
        # Not clean yet, only not failing: a promotion waits for the latency to be compared too.
        return Judgement("waiting", f"it fails no more often than the live version; the p99s are compared once "
                         f"each has {P99_MIN_OK} ok replies in the window", mine, theirs)
    p99, live_p99 = candidate.total.quantile(0.99), live.total.quantile(0.99)
    if p99 > live_p99 * (1 + guard.max_p99_increase) and (p99 - live_p99) * 1000 > guard.min_p99_increase_ms:
        return Judgement("failing", f"its p99 latency, {p99 * 1000:.1f} ms, exceeds the live version's "
                         f"{live_p99 * 1000:.1f} ms by more than {guard.max_p99_increase:.0%} and "
                         f"{guard.min_p99_increase_ms:g} ms", mine, theirs)
    return Judgement("clean", "no worse than the live version within the guard's margins", mine, theirs)


class CanaryManager:
    """Begins, weighs, promotes and ends trials, and judges the guarded ones; the one writer of the candidates."""

    def __init__(self, config: Config, candidates: Candidates, live: LiveVersions, reloads: ReloadManager,
                 dispatcher: Dispatcher, workers: WorkerTable, stats: Stats) -> None:
        self.config = config
        self.candidates = candidates
        self.live = live
        self.reloads = reloads
        self.dispatcher = dispatcher
        self.workers = workers
        self.stats = stats
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (model, how a trial ended) -> trials
        self._waiting_noted: set[str] = set()  # models whose promotion waits for replies (logged once)
        reloads.on_candidate_failed = self._candidate_failed

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): the models' guards."""
        self.config = config

    def guard(self, model: str) -> CanaryGuard:
        """The guard `model`'s canaries are judged by: its config's, else the defaults."""
        return self.config.models[model].canary_guard or CanaryGuard()

    def restore(self, saved: dict[str, Any]) -> None:
        """At start: take up the trials the state file kept, dropping (and logging) any that cannot go on."""
        dropped = False
        for model, data in saved.items():
            try:
                candidate = Candidate.from_json(data)
                if model not in self.live:
                    raise ValueError(f"{model} is not in the config any more")
                if candidate.version == self.live[model]:
                    raise ValueError(f"{candidate.version} is live now")
                model_file(self.config.models[model].repository or "", candidate.version)
            except (ValueError, RepositoryError) as exc:
                log.warning("the saved trial of %s is dropped: %s", model, exc)
                dropped = True
                continue
            self.candidates.set(model, candidate)
            log.info("%s: resuming the %s beside %s", model, candidate.describe(), self.live[model])
        if dropped:
            self.reloads.save_then_answer(LoggedReply("saving the trials that go on"), {}, time.monotonic())

    def start(self, model: str, version: str, mode: Mode, weight: float, guarded: bool,
              promote_after_s: float | None, allow_signature_change: bool, reply: Reply) -> None:
        """Load `version` beside the live one as reload does, then try it as `mode` at `weight` percent."""
        problem = weight_problem(mode, weight)
        if problem is not None:
            reply.fail(f"a {problem}")
            return
        if promote_after_s is not None and promote_after_s <= 0:
            reply.fail(f"--promote-after needs a duration above zero, not {promote_after_s:g} s")
            return
        if mode == Mode.SHADOW and (guarded or promote_after_s is not None):
            reply.fail("--auto-rollback and --promote-after judge a canary; a shadow serves no client, so "
                       "promote or roll it back by hand")
            return
        guarded = mode == Mode.CANARY and (guarded or promote_after_s is not None
                                           or self.config.models[model].canary_guard is not None)

        def loaded(reload: Reload) -> None:
            now = time.time()
            candidate = Candidate(version, mode, weight, guarded,
                                  None if promote_after_s is None else now + promote_after_s, now,
                                  allow_signature_change)
            self.candidates.set(model, candidate)
            self.stats.new_window(time.monotonic())
            log.info("%s: %s beside %s%s", model, candidate.describe(), reload.previous,
                     ", guarded" if guarded else "")
            result = {"model": model, "version": version, "live": reload.previous, "mode": str(mode),
                      "weight": weight, "guarded": guarded, "promote_after_s": promote_after_s, **reload.timings()}
            self.reloads.save_then_answer(reload.reply, result, reload.started)

        self.reloads.start(model, version, allow_signature_change, reply, on_loaded=loaded)

    def weigh(self, model: str, weight: float, reply: Reply) -> None:
        """Move the running trial of `model` to `weight` percent."""
        candidate = self.candidates.get(model)
        if candidate is None:
            reply.fail(f"{model} has no canary or shadow; start one with inferctl reload --canary or --shadow")
            return
        problem = weight_problem(candidate.mode, weight)
        if problem is not None:
            reply.fail(f"a {problem}")
            return
        moved = dataclasses.replace(candidate, weight=weight)
        self.candidates.set(model, moved)
        log.info("%s: %s (was %g %%)", model, moved.describe(), candidate.weight)
        self.reloads.save_then_answer(reply, {"model": model, "version": moved.version, "mode": str(moved.mode),
                                       "weight": weight, "was": candidate.weight}, time.monotonic())

    def promote(self, model: str, reply: Reply, why: str = "by inferctl promote") -> None:
        """Make `model`'s candidate live: a flip, as a reload ends with."""
        candidate = self.candidates.get(model)
        if candidate is None:
            reply.fail(f"{model} has no canary or shadow to promote")
            return
        lacking = self._lacking(model, candidate)
        if lacking is not None:
            reply.fail(f"worker{lacking} has not loaded {candidate.version} yet; promote once it has "
                       "(inferctl status lists what each worker loaded)")
            return
        self._ended(model, "promoted")
        log.info("%s: the %s is promoted %s", model, candidate.describe(), why)
        self.reloads.flip(model, candidate.version, reply, time.monotonic(), f"promotion of its {candidate.mode}",
                          {"promoted": candidate.describe()})

    def end(self, model: str, reply: Reply, why: str = "by inferctl rollback", outcome: str = "rolled_back") -> None:
        """End `model`'s trial: the candidate is unloaded once its last batch is back; live serves everything."""
        candidate = self.candidates.get(model)
        if candidate is None:
            reply.fail(f"{model} has no canary or shadow to end")
            return
        self._ended(model, outcome)
        self.reloads.retire_everywhere(model, candidate.version)
        log.info("%s: the %s ended %s; %s serves everything", model, candidate.describe(), why, self.live[model])
        result = {"model": model, "version": self.live[model], "ended": candidate.describe()}
        self.reloads.save_then_answer(reply, result, time.monotonic())

    def check(self, now: float) -> None:
        """Judge each guarded canary (roll back one that fails) and promote one whose time came clean."""
        for model, candidate in list(self.candidates.items()):
            if candidate.mode != Mode.CANARY or not candidate.guarded:
                continue
            judgement = self.judgement(model, now)
            if judgement.verdict == "failing":
                self.end(model, LoggedReply(f"rollback of {model} {candidate.version}"),
                         f"by its guard: {judgement.reason}", "rolled_back_by_guard")
            elif candidate.promote_at is not None and time.time() >= candidate.promote_at:
                lacking = self._lacking(model, candidate)
                if judgement.verdict == "clean" and lacking is None:
                    self._waiting_noted.discard(model)
                    self.promote(model, LoggedReply(f"promotion of {model} {candidate.version}"),
                                 "by --promote-after: its window stayed clean")
                elif model not in self._waiting_noted:
                    self._waiting_noted.add(model)
                    why = judgement.reason if lacking is None else f"worker{lacking} has not loaded it yet"
                    log.info("%s: promotion of %s waits: %s", model, candidate.version, why)

    def judgement(self, model: str, now: float) -> Judgement:
        """The guard's judgement of `model`'s candidate now."""
        candidate = self.candidates[model]
        guard = self.guard(model)
        # Only the stats windows that began after the trial did (one begins with it): an earlier trial of
        # the same version must not judge this one.
        window, _ = self.stats.recent(now, min(guard.window_s, time.time() - candidate.started))
        return judge(guard, window.get((model, candidate.version), Series()),
                     window.get((model, self.live[model]), Series()))

    def _lacking(self, model: str, candidate: Candidate) -> int | None:
        """A ready worker serving `model` that has not loaded its candidate (by index), if one has not."""
        live = self.live[model]
        for worker in self.workers.workers:
            if worker.serves(model, live) and (model, candidate.version) not in worker.loaded:
                return worker.index
        return None

    def _candidate_failed(self, model: str, version: str, why: str) -> None:
        candidate = self.candidates.get(model)
        if candidate is not None and candidate.version == version:
            self.end(model, LoggedReply(f"end of the {candidate.describe()} of {model}"), f"because {why}",
                     "failed_to_load")

    def _ended(self, model: str, outcome: str) -> None:
        self._waiting_noted.discard(model)
        self.candidates.end(model)
        self.dispatcher.end_trial(model)
        self.outcomes[(model, outcome)] += 1
