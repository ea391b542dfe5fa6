"""Model repositories on disk and the record of which version is live.

A repository is a folder of version folders, each holding `model.pt`
(TorchScript), `model.pt2` (torch.export, AOTInductor) or `model.py` (a Python
model, which wins where a folder holds both: its code may load a torch file of
its own). This module only looks at files; loading a model is a worker's or a
step's job.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from inferd.config.schema import ModelConfig, kind_problem, version_problem
from inferd.models import model_files
from inferd.models.model_files import PYTHON_FILE

log = logging.getLogger("inferd.models.repository")

MODEL_FILES = (PYTHON_FILE, "model.pt", "model.pt2")
MODEL_FILES_SAID = "model.py, model.pt or model.pt2"  # MODEL_FILES in a sentence
LIVE_FILE = "live_versions.json"
NUMBERS_FILE = "version_numbers.json"
CONFIG_KEY = "config"  # what names, in each of them, the config file that saved it


class RepositoryError(Exception):
    """A repository or version is missing, or names something outside the repository."""


def _natural_key(name: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def model_file(repository: str | Path, version: str) -> Path:
    """The model file of `version`, refusing names that leave the repository."""
    problem = version_problem(version)
    if problem is not None:
        raise RepositoryError(problem)
    folder = Path(repository) / version
    for name in MODEL_FILES:
        if (folder / name).is_file():
            return folder / name
    raise RepositoryError(f"version {version!r} has no {MODEL_FILES_SAID} in {Path(repository)}")


def is_python(path: Path) -> bool:
    """Whether a version's model file (model_file) is a Python model's model.py."""
    return path.name == PYTHON_FILE


def python_version(model: ModelConfig, version: str) -> bool:
    """Whether `version` of `model` is a Python model; RepositoryError where it has no model file."""
    return is_python(model_file(model.repository or "", version))


def kind_change(name: str, model: ModelConfig, live: str, version: str) -> str | None:
    """The sentence refusing `version` of `model` where it is not of its live version's kind (a Python model, or
    a file torch saved): the two run in different processes. None when it is, or when either has no file (said
    elsewhere)."""
    try:
        was, becomes = python_version(model, live), python_version(model, version)
    except RepositoryError:
        return None
    if was == becomes:
        return None
    kinds = {True: "a Python model (model.py)", False: "a tensor model (a file torch saved)"}
    return (f"{name} {version} is {kinds[becomes]}, but {name} is served as {kinds[was]}: a model keeps its kind "
            "across versions; serve the other under another name")


def versions(repository: str | Path) -> list[str]:
    """Version folders that hold a model file, oldest first in natural order (v2 before v10)."""
    root = Path(repository)
    if not root.is_dir():
        raise RepositoryError(f"the repository {root} does not exist")
    found = [p.name for p in root.iterdir() if p.is_dir() and any((p / f).is_file() for f in MODEL_FILES)]
    return sorted(found, key=_natural_key)


def resolve_version(model: ModelConfig, saved: str | None = None) -> str:
    """The version to serve first: the one saved as live if it still exists, else the config's."""
    repository = model.repository or ""  # config.parse always sets it
    if saved is not None:
        try:
            model_file(repository, saved)
            return saved
        except RepositoryError as exc:
            log.warning("saved live version %r cannot be served (%s); using the config's version", saved, exc)
    if model.version != "latest":
        model_file(repository, model.version)
        return model.version
    found = versions(repository)
    if not found:
        raise RepositoryError(f"the repository {repository} holds no version with a model file")
    return found[-1]


def writable_by_others(model: str, path: Path) -> str | None:
    """The sentence refusing a model file that, or whose folder, the owner's group or others may write (None
    when only its owner may): whoever can write it can make the worker (or a Python model's step) run their
    code."""
    for where in (path, path.parent):
        mode = where.stat().st_mode
        who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit)
        if who:
            return (f"{where} may be written by {who}, and a model file is code the worker runs; `chmod go-w "
                    f"{where}`, or set models.{model}.allow_writable = true")
    return None


def check(models: dict[str, ModelConfig]) -> list[str]:
    """Problems with the repositories of `models`, each a sentence with its key."""
    problems = []
    for name, model in models.items():
        try:
            version = resolve_version(model)
        except RepositoryError as exc:
            problems.append(f"models.{name}: {exc}")
            continue
        path = model_file(model.repository or "", version)
        problem = model_files.inspect(path).problem
        if problem is None and not model.allow_writable:
            problem = writable_by_others(name, path)
        if problem is not None:
            problems.append(f"models.{name}: version {version!r}: {problem}")
        misfit = kind_problem(model, is_python(path))
        if misfit is not None:
            problems.append(f"models.{name}.{misfit[0]}: {misfit[1]}")
    return problems


def config_name(source: str | None) -> str:
    """How the records in state_dir name the config that saved them: its file's absolute path (not following
    symlinks: a Kubernetes ConfigMap's file is a link whose target changes with each update), or "demo" for a
    daemon started without a config file."""
    return os.path.abspath(source) if source not in (None, "demo") else "demo"


def _read_record(path: Path, owner: str, ignored: str) -> tuple[dict[str, Any], bool]:
    """The JSON object in `path` where `owner`'s config saved it, and whether it names no config (saved before
    records named theirs: it is taken as `owner`'s, to be saved again naming it). A record another config
    saved is logged, with `ignored` (what this daemon does instead), and read as empty; so is one unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, False
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}, False
    if not isinstance(data, dict):
        return {}, False
    saved_by = data.get(CONFIG_KEY)
    if not isinstance(saved_by, str):
        log.info("%s names no config (an earlier inferd saved it): taken as %s's, and saved again naming it",
                 path, owner)
        return data, True
    if saved_by != owner:
        log.warning("ignoring %s: the daemon of %s saved it, and this one runs %s; %s, and replaces the record when "
                    "it saves its own (give each config its own server.state_dir)", path, saved_by, owner, ignored)
        return {}, False
    return data, False


class SavedVersions:
    """The file in `state_dir` that records which version of each model is live, which was live
    before the last reload, and which is under trial (a canary or a shadow), so a restart serves
    the same versions again and a rollback still knows where to go back to. It names the config
    that saved it (`owner`, config_name): a daemon of another config ignores it."""

    def __init__(self, state_dir: str | Path, owner: str) -> None:
        self.path = Path(state_dir) / LIVE_FILE
        self.owner = owner

    def load(self) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
        """(live, previous, candidates as saved); a record that is unreadable or another config's is logged and
        treated as empty, and one that names no config is saved again naming this one."""
        data, adopted = _read_record(self.path, self.owner, "it serves its config's versions")

        def table(key: str) -> dict[str, str]:
            value = data.get(key)
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}

        candidates = data.get("candidates")
        saved = table("live"), table("previous"), candidates if isinstance(candidates, dict) else {}
        if adopted:
            try:
                self.save(*saved)
            except OSError as exc:  # it is read the same way at the next start
                log.warning("cannot save %s again naming its config: %s", self.path, exc)
        return saved

    def save(self, live: dict[str, str], previous: dict[str, str], candidates: dict[str, Any]) -> None:
        """Write atomically: a crash leaves the old file or the new one, never half of one."""
        write_atomically(self.path, {CONFIG_KEY: self.owner, "live": live, "previous": previous,
                                     "candidates": candidates})


class VersionNumbers:
    """Each version's number, for the protocols whose versions are integers (Triton's tools parse
    them): kept in `state_dir`, so a version keeps its number once given, whatever is added or
    removed later. A version first seen is given the next number after the model's highest, in
    natural order among those first seen together; one named by a whole number is given that
    number if it is free. The file names the config that saved it (`owner`), as SavedVersions's
    does: a daemon of another config numbers the versions anew."""

    def __init__(self, state_dir: str | Path, owner: str) -> None:
        self.path = Path(state_dir) / NUMBERS_FILE
        self.owner = owner
        data, adopted = _read_record(self.path, owner, "it numbers the versions anew")
        # Before the file named its config, it held the numbers alone.
        numbers = data if adopted else data.get("numbers", {})
        self._numbers: dict[str, dict[str, int]] = {
            str(model): {str(v): n for v, n in found.items() if isinstance(n, int)}
            for model, found in (numbers.items() if isinstance(numbers, dict) else ()) if isinstance(found, dict)
        }
        if adopted:
            self._save()

    def of_all(self, repositories: dict[str, str]) -> dict[str, dict[str, int]]:
        """The number of each version in each model's repository now (model -> repository), giving the new
        ones theirs, saved in one write; a model whose folder cannot be read has none."""
        result: dict[str, dict[str, int]] = {}
        changed = False
        for model, repository in repositories.items():
            try:
                found = versions(repository)
            except RepositoryError:  # the folder went away: the versions served keep what they had
                result[model] = {}
                continue
            numbers = self._numbers.setdefault(model, {})
            for version in found:
                if version not in numbers:
                    taken = set(numbers.values())
                    numbers[version] = int(version) if version.isdigit() and 0 < int(version) not in taken \
                        else max(taken, default=0) + 1
                    changed = True
            result[model] = {version: numbers[version] for version in found}
        if changed:
            self._save()
        return result

    def _save(self) -> None:
        try:
            write_atomically(self.path, {CONFIG_KEY: self.owner, "numbers": self._numbers})
        except OSError as exc:  # the numbers hold for this run; the next may give new ones
            log.warning("cannot save the version numbers in %s: %s", self.path, exc)


def write_atomically(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` so that a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def folders_without_model(repository: str | Path) -> list[str]:
    """Folders of a repository that hold no model file (a version copied in half, or misnamed)."""
    root = Path(repository)
    found = [p.name for p in root.iterdir() if p.is_dir() and not any((p / f).is_file() for f in MODEL_FILES)]
    return sorted(found, key=_natural_key)


def describe_versions(repository: str | Path) -> list[dict[str, object]]:
    """Each version of a repository with its model file, size in bytes, modification time, format,
    and the sentence saying why it cannot be served (None when it can)."""
    described = []
    for version in versions(repository):
        path = model_file(repository, version)
        stat = path.stat()
        found = model_files.inspect(path, provenance=True)
        described.append({"version": version, "file": path.name, "size_bytes": stat.st_size, "modified": stat.st_mtime,
                          "format": found.format, "problem": found.problem, "made": found.made})
    return described
