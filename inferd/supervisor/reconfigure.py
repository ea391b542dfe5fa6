"""What a config reload (SIGHUP) may change while the daemon runs, and what needs a restart.

`plan` compares the running config with the one just read and returns the
config to run with from now on: the new values of keys that can change live,
the old values of keys that cannot (each named, so the operator is told).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from inferd.config import Config, ModelConfig

# Keys whose new value takes effect at once; any other change waits for a restart.
LIVE_KEYS = {
    "server.drain_timeout_s",
    "server.log_level",
    "server.spin_us",
    "workers.reload_memory_factor",
    "workers.batch_timeout_s",
    "workers.max_restarts",
    "queue.max_size",
    "queue.max_per_client",
    "queue.default_timeout_ms",
}
T = TypeVar("T", bound=msgspec.Struct)

LIVE_MODEL_KEYS = {"max_batch_size", "max_wait_ms", "warmup_batch_sizes", "version"}


@dataclass
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
    """Decide, key by key, what of `new` applies now."""
    applied: list[str] = []
    need_restart: list[str] = []
    sections = {}
    for section in ("server", "workers", "queue"):
        sections[section], _ = _merge(getattr(old, section), getattr(new, section), f"{section}.",
                                      lambda name, s=section: f"{s}.{name}" in LIVE_KEYS, applied, need_restart)
    models: dict[str, ModelConfig] = {}
    added: list[str] = []
    version_changed: list[str] = []
    for name in sorted(set(old.models) | set(new.models)):
        before, after = old.models.get(name), new.models.get(name)
        if after is None:
            need_restart.append(_describe(f"models.{name}", name, None))
            models[name] = before
            continue
        if before is None:
            applied.append(_describe(f"models.{name}", None, name))
            added.append(name)
            models[name] = after
            continue
        models[name], changed = _merge(before, after, f"models.{name}.", LIVE_MODEL_KEYS.__contains__,
                                       applied, need_restart)
        if "version" in changed:
            version_changed.append(name)
    config = Config(server=sections["server"], workers=sections["workers"], queue=sections["queue"],
                    models=models, source=new.source)
    return Plan(config, applied, need_restart, added, version_changed)
