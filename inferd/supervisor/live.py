"""The live version of each model: one record, written by the reload manager, read by everyone."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from inferd.config import Config
from inferd.repository import resolve_version


class LiveVersions(Mapping[str, str]):
    """model -> the version that computes its new batches, and the version live before the last reload.

    Only the ReloadManager calls `flip` and `add`; the frontend, the dispatcher, the
    worker table and the reports read it, so a flip is seen by all of them at once.
    """

    def __init__(self, live: dict[str, str], previous: dict[str, str]) -> None:
        self._live = dict(live)
        self._previous = {model: version for model, version in previous.items() if model in live}

    @classmethod
    def first(cls, config: Config, saved: dict[str, str], previous: dict[str, str]) -> LiveVersions:
        """What to serve at start: each model's version saved as live where it still exists, else the
        config's; raises RepositoryError for a model that has neither."""
        return cls({name: resolve_version(m, saved.get(name)) for name, m in config.models.items()}, previous)

    def __getitem__(self, model: str) -> str:
        return self._live[model]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def previous(self, model: str) -> str | None:
        """The version that was live before the last reload of `model`, if it was reloaded."""
        return self._previous.get(model)

    def flip(self, model: str, version: str) -> str:
        """Make `version` live; return the version it replaces."""
        before = self._live[model]
        self._live[model] = version
        self._previous[model] = before
        return before

    def add(self, model: str, version: str) -> None:
        """Serve a model added by a config reload."""
        self._live[model] = version

    def snapshot(self) -> tuple[dict[str, str], dict[str, str]]:
        """Copies of (live, previous), to save."""
        return dict(self._live), dict(self._previous)
