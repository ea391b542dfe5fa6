"""Reconfiguring (SIGHUP): re-read the config file, apply what may change while the daemon runs,
and name what needs a restart.

`plan` compares the running config with the one just read and returns the
config to run with from now on: the new values of keys that can change live
(config/schema.py marks them), the old values of keys that cannot (each named,
so the operator is told). `Reconfigurer` carries the plan out: new models, new
versions (a blue-green reload each), then the new file's pipelines, each checked
against the models served from now on (`settle_pipelines`), and the new config
for every part.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec

from inferd.config import loading
from inferd.config.pipelines import pipeline_problems
from inferd.config.schema import SECTIONS, Config, ModelConfig, PipelineConfig, live_keys
from inferd.ipc.slots import slot_shortfall
from inferd.models import repository
from inferd.models.repository import RepositoryError, python_version, resolve_version
from inferd.supervisor.processes.workers import WorkerTable
from inferd.supervisor.shared.command_replies import LoggedReply
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.state import StartupError
from inferd.supervisor.versions.reload import ReloadManager

log = logging.getLogger("inferd.reconfigure")

T = TypeVar("T", bound=msgspec.Struct)


@dataclasses.dataclass
class Plan:
    """The config to run with, and the changes sorted by when they apply."""

    config: Config
    applied: list[str]
    need_restart: list[str]
    added_models: list[str]
    version_changed: list[str]  # models whose config names another version now


def _value(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def _describe(key: str, old: object, new: object) -> str:
    if old is None:
        return f"{key} added"
    if new is None:
        return f"{key} removed"
    return f"{key} {_value(old)} -> {_value(new)}"


def _merge(before: T, after: T, prefix: str, live: Callable[[str], bool], applied: list[str],
           need_restart: list[str]) -> tuple[T, list[str]]:
    """`after`, with the fields that cannot change live kept as in `before`; and the fields that changed live."""
    keep = {}
    changed = []
    for field in msgspec.structs.fields(before):
        a, b = getattr(before, field.name), getattr(after, field.name)
        if a == b:
            continue
        if live(field.name):
            applied.append(_describe(prefix + field.name, a, b))
            changed.append(field.name)
        else:
            need_restart.append(_describe(prefix + field.name, a, b))
            keep[field.name] = a
    return msgspec.structs.replace(after, **keep), changed


def plan(old: Config, new: Config) -> Plan:
    """Decide, key by key, what of `new` applies now; the pipelines stay as in `old` until `settle_pipelines`."""
    applied: list[str] = []
    need_restart: list[str] = []
    sections = {}
    for section, cls in SECTIONS.items():
        sections[section], _ = _merge(getattr(old, section), getattr(new, section), f"{section}.",
                                      live_keys(cls).__contains__, applied, need_restart)
    models: dict[str, ModelConfig] = {}
    added: list[str] = []
    version_changed: list[str] = []
    for name in sorted(set(old.models) | set(new.models)):
        before, after = old.models.get(name), new.models.get(name)
        if after is None:
            assert before is not None
            need_restart.append(_describe(f"models.{name}", name, None))
            models[name] = before
            continue
        if before is None:
            applied.append(_describe(f"models.{name}", None, name))
            added.append(name)
            models[name] = after
            continue
        models[name], changed = _merge(before, after, f"models.{name}.", live_keys(ModelConfig).__contains__,
                                       applied, need_restart)
        if "version" in changed:
            version_changed.append(name)
    config = Config(server=sections["server"], workers=sections["workers"], queue=sections["queue"],
                    models=models, source=new.source, pipelines=old.pipelines)
    return Plan(config, applied, need_restart, added, version_changed)


def settle_pipelines(old: dict[str, PipelineConfig], new: dict[str, PipelineConfig], change: Plan) -> Plan:
    """`change` with the pipelines of the new file (`new`), as far as the models it serves from now on run them.

    A pipeline's every key applies at once (the schema marks them live for the reference; this is what applies
    them): its runs under way finish with the steps they began with. One that
    its models cannot run as they are served now (a model whose change waits for a restart, or one not added)
    serves as it was, or is not added, and the first reason is named."""
    pipelines: dict[str, PipelineConfig] = {}
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if after is None:
            change.applied.append(_describe(f"pipelines.{name}", name, None))
            continue
        problems = pipeline_problems(name, after, change.config.models)
        if problems:
            change.need_restart.append(problems[0])
            if before is not None and not pipeline_problems(name, before, change.config.models):
                pipelines[name] = before
            continue
        pipelines[name] = after
        if before is None:
            change.applied.append(_describe(f"pipelines.{name}", None, name))
            continue
        for field in msgspec.structs.fields(after):
            was, now = getattr(before, field.name), getattr(after, field.name)
            if was != now:
                change.applied.append(_describe(f"pipelines.{name}.{field.name}", was, now)
                                      if isinstance(now, int) else f"pipelines.{name}.{field.name} changed")
    return dataclasses.replace(change, config=msgspec.structs.replace(change.config, pipelines=pipelines))


class VersionReload(LoggedReply):
    """The log's reply to a reload a SIGHUP started to the version `named` of model `name` (whose config named
    `before`); where it fails, `keep(name, before, named)` runs."""

    def __init__(self, what: str, name: str, before: str | None, named: str | None,
                 keep: Callable[[str, str | None, str | None], None]) -> None:
        super().__init__(what)
        self.name, self.before, self.named, self.keep = name, before, named, keep

    def fail(self, error: str) -> None:
        """Log the failure, and have the running config name the version before."""
        super().fail(error)
        self.keep(self.name, self.before, self.named)


class Reconfigurer:
    """Carries out a SIGHUP: what the new config changes, as far as it can change while serving."""

    def __init__(self, workers: WorkerTable, reloads: ReloadManager, live: LiveVersions,
                 saved_live: dict[str, str], configure: Callable[[Config], None],
                 running: Callable[[], Config]) -> None:
        self.workers = workers
        self.reloads = reloads
        self.live = live
        self.saved_live = saved_live  # what the state file said at start: a model added later may be in it
        self.configure = configure  # hands a config to every part of the daemon
        self.running = running  # the config the daemon runs with now

    def reconfigure(self, running: Config) -> None:
        """Re-read `running`'s config file and apply it as far as it can be applied while serving."""
        if running.source is None or running.source == "demo":
            log.warning("SIGHUP: the demo has no config file to re-read; nothing changed")
            return
        try:
            new = loading.load(running.source)
            # As check-config and a start check it: a version named that is not there (not copied yet, say)
            # is a problem of the file, which changes nothing, not a change half made.
            problems = repository.check(new.models)
        except loading.ConfigError as exc:
            problems = exc.problems
        if problems:
            log.error("SIGHUP: %s has %d problem(s), nothing changed: %s", running.source, len(problems),
                      "; ".join(problems))
            return
        change = self._keep_slots_large_enough(running, plan(running, new))
        for name in change.added_models:
            added = change.config.models[name]
            try:
                version = resolve_version(added, self.saved_live.get(name))
                if python_version(added, version):
                    # Its processes' handles before its version is live: its versions belong on them, not on a
                    # device. They start at the loop's next housekeeping (while it serves), with the new config.
                    self.workers.add_steps(name, added.processes)
            except (RepositoryError, StartupError) as exc:
                log.error("SIGHUP: models.%s cannot be added: %s", name, exc)
                change.applied.remove(_describe(f"models.{name}", None, name))
                change.config.models.pop(name)
                continue
            self.reloads.add_model(name, version, added.repository)
        self._raise_processes(running, new, change)
        change = settle_pipelines(running.pipelines, new.pipelines, change)
        self.configure(change.config)
        for name in change.version_changed:
            try:
                target = resolve_version(change.config.models[name])
            except RepositoryError as exc:
                log.error("SIGHUP: models.%s.version: %s", name, exc)
                continue
            if target != self.live[name]:
                reply = VersionReload(f"reload of {name} to {target} (SIGHUP)", name, running.models[name].version,
                                      change.config.models[name].version, self._keep_version)
                self.reloads.start(name, target, False, reply)
        for worker in self.workers.workers:
            self.reloads.catch_up(worker)
        log.info("SIGHUP: applied %s", "; ".join(change.applied) or "nothing (no live change)")
        if change.need_restart:
            log.warning("SIGHUP: these changes need a restart and were not applied: %s",
                        "; ".join(change.need_restart))

    def _keep_version(self, name: str, before: str | None, named: str | None) -> None:
        """A reload to the version `named` that a SIGHUP started did not happen (refused, or failed): the running
        config names `before` again, so that a SIGHUP of the same file, once its cause is mended (a canary ended,
        a folder copied), tries it again rather than finding nothing changed."""
        config = self.running()
        model = config.models.get(name)
        if model is None or model.version != named:  # a later SIGHUP has changed it since
            return
        self.configure(msgspec.structs.replace(config, models={
            **config.models, name: msgspec.structs.replace(model, version=before)}))
        log.warning("SIGHUP: models.%s.version stays %r, as its reload did not happen; a SIGHUP tries %r again",
                    name, before, named)

    def _raise_processes(self, running: Config, new: Config, change: Plan) -> None:
        """Add the processes of each Python model whose `processes` the new config raises (they start as an
        added model's do); a lowered one waits for a restart, as the plan says."""
        for name, model in change.config.models.items():
            old, asked = running.models.get(name), new.models.get(name)
            if old is None or asked is None or asked.processes <= old.processes or name not in self.workers.pools:
                continue
            try:
                self.workers.add_steps(name, asked.processes - old.processes)
            except StartupError as exc:
                log.error("SIGHUP: models.%s.processes cannot be raised: %s", name, exc)
                continue
            said = _describe(f"models.{name}.processes", old.processes, asked.processes)
            change.need_restart.remove(said)
            change.applied.append(said)
            change.config.models[name] = msgspec.structs.replace(model, processes=asked.processes)

    def _keep_slots_large_enough(self, running: Config, change: Plan) -> Plan:
        """Refuse a larger max_batch_size whose full batch would not fit an arena slot."""
        for name, model in list(change.config.models.items()):
            old = running.models.get(name)
            if old is None or model.max_batch_size <= old.max_batch_size:
                continue
            for worker in self.workers.workers:
                loaded = worker.loaded.get((name, self.live[name]))
                if loaded and slot_shortfall(name, model, loaded.outputs, worker.slots.slot_size):
                    change.config.models[name] = msgspec.structs.replace(model, max_batch_size=old.max_batch_size)
                    change.need_restart.append(f"models.{name}.max_batch_size {model.max_batch_size}: a full "
                                               "batch would not fit an arena slot; raise workers.shm_mb too")
                    break
        return change
