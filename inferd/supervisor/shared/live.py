"""The live version of each model: one record, written by the reload manager, read by everyone."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from inferd.config.schema import Config
from inferd.models.repository import LIVE_FILE, RepositoryError, resolve_version

log = logging.getLogger("inferd.supervisor.shared.live")

# Where a live version came from: the config's `version`, the live versions saved in state_dir
# (a reload before a restart), or a reload of this run.
FROM_CONFIG, FROM_SAVED, FROM_RELOAD = "config", "saved", "reload"


class LiveVersions(dict[str, str]):
    """model -> the version that computes its new batches, and the version live before the last reload.

    Only the ReloadManager calls `switch` (in its flip) and `add`; the frontend, the
    dispatcher, the worker table and the reports read it, so a flip is seen by all of
    them at once.
    It is a dict for them to read at a dict's speed (it is read several times per
    request); every other way to change it is refused.
    """

    def __init__(self, live: dict[str, str], previous: dict[str, str], origins: dict[str, str] | None = None) -> None:
        super().__init__(live)
        self._previous = {model: version for model, version in previous.items() if model in live}
        self._origins = {model: (origins or {}).get(model, FROM_CONFIG) for model in live}

    @classmethod
    def first(cls, config: Config, saved: dict[str, str], previous: dict[str, str]) -> LiveVersions:
        """What to serve at start: each model's version saved as live where it still exists, else the
        config's; raises RepositoryError for a model that has neither. A saved version that is not the
        config's is said in the log: an operator who edited `version` would otherwise wonder."""
        live, origins = {}, {}
        for name, model in config.models.items():
            live[name] = resolve_version(model, saved.get(name))
            origins[name] = FROM_SAVED if live[name] == saved.get(name) else FROM_CONFIG
            try:
                configured = resolve_version(model)
            except RepositoryError as exc:
                configured = f"none ({exc})"
            if origins[name] == FROM_SAVED and configured != live[name]:
                log.warning("serving %s %s, the version saved as live in %s/%s, not the config's %s (version = %r); "
                            "`inferctl reload --version` switches it", name, live[name], config.server.state_dir,
                            LIVE_FILE, configured, model.version)
        return cls(live, previous, origins)

    def origin(self, model: str) -> str:
        """Where `model`'s live version came from: FROM_CONFIG, FROM_SAVED or FROM_RELOAD."""
        return self._origins.get(model, FROM_CONFIG)

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("the live versions change only through switch() and add()")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def previous(self, model: str) -> str | None:
        """The version that was live before the last reload of `model`, if it was reloaded."""
        return self._previous.get(model)

    def switch(self, model: str, version: str) -> str:
        """Record `version` as live; return the version it replaces."""
        before = self[model]
        dict.__setitem__(self, model, version)
        self._previous[model] = before
        self._origins[model] = FROM_RELOAD
        return before

    def add(self, model: str, version: str, origin: str = FROM_CONFIG) -> None:
        """Serve a model a config reload added."""
        dict.__setitem__(self, model, version)
        self._origins[model] = origin

    def snapshot(self) -> tuple[dict[str, str], dict[str, str]]:
        """Copies of (live, previous), to save."""
        return dict(self), dict(self._previous)
