"""The live version of each model: one record, written by the reload manager, read by everyone."""

from __future__ import annotations

from typing import Any, NoReturn

from inferd.config.schema import Config
from inferd.repository import resolve_version


class LiveVersions(dict[str, str]):
    """model -> the version that computes its new batches, and the version live before the last reload.

    Only the ReloadManager calls `switch` (in its flip) and `add`; the frontend, the
    dispatcher, the worker table and the reports read it, so a flip is seen by all of
    them at once.
    It is a dict for them to read at a dict's speed (it is read several times per
    request); every other way to change it is refused.
    """

    def __init__(self, live: dict[str, str], previous: dict[str, str]) -> None:
        super().__init__(live)
        self._previous = {model: version for model, version in previous.items() if model in live}

    @classmethod
    def first(cls, config: Config, saved: dict[str, str], previous: dict[str, str]) -> LiveVersions:
        """What to serve at start: each model's version saved as live where it still exists, else the
        config's; raises RepositoryError for a model that has neither."""
        return cls({name: resolve_version(m, saved.get(name)) for name, m in config.models.items()}, previous)

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
        return before

    def add(self, model: str, version: str) -> None:
        """Serve a model a config reload added."""
        dict.__setitem__(self, model, version)

    def snapshot(self) -> tuple[dict[str, str], dict[str, str]]:
        """Copies of (live, previous), to save."""
        return dict(self), dict(self._previous)
