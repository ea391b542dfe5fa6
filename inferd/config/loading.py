"""A config from TOML or a dict, checked against the declaration in `schema`, and its msgpack form.

`parse` names every bad key with its full key and value rather than stopping at
the first, so one `inferd check-config` lists what needs fixing. Paths in a
config file are read from the file's folder.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from inferd.config.pipelines import pipeline_problems
from inferd.config.schema import (
    CHECKS,
    MODEL_NAME,
    MODEL_TOML,
    PATH_KEYS,
    SECTIONS,
    Config,
    ModelConfig,
    PipelineConfig,
    ServerConfig,
    padding_problem,
)
from inferd.system import paths

NAME_RULE = "a model name is letters, digits, '_', '.' or '-' (at most 64)"


class ConfigError(Exception):
    """The config has problems; `problems` names each one with its key, and `models` holds the
    model tables that had none (so their repositories can be checked in the same pass)."""

    def __init__(self, problems: list[str], models: dict[str, ModelConfig] | None = None) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
        self.models = models or {}


def _value_at(value: Any, where: str) -> Any:
    """The part of `value` that a msgspec path such as `[0].shape[1]` points at."""
    for key, index in re.findall(r"\.(\w+)|\[(\d+)\]", where):
        try:
            value = value[key] if key else value[int(index)]
        except (KeyError, IndexError, TypeError):
            break
    return value


def _convert_error(key: str, raw: Any, exc: msgspec.ValidationError) -> str:
    """Turn msgspec's `... - at `$[0].dtype`` into a problem named by its full key and bad value."""
    message, _, where = str(exc).partition(" - at `$")
    where = where.rstrip("`")
    value = _value_at(raw, where)
    if not message.startswith("Invalid enum value"):  # that one names the value already
        message += f" {value!r}" if ", got" in message else f", got {value!r}"
    return f"{key}{where}: {message}"


def _build(cls: type[msgspec.Struct], table: Any, prefix: str, problems: list[str], base: Path) -> Any:
    """Build one section from its TOML table, adding a problem for each bad key; relative paths are
    made absolute from `base`."""
    if not isinstance(table, dict):
        problems.append(f"{prefix.rstrip('.')}: expected a table, got {type(table).__name__}")
        return None
    fields = {field.name: field for field in msgspec.structs.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        field = fields.get(key)
        if field is None:
            problems.append(f"{prefix}{key}: unknown key; known keys are {', '.join(fields)}")
            continue
        try:
            value = msgspec.convert(raw, field.type)
        except msgspec.ValidationError as exc:
            problems.append(_convert_error(prefix + key, raw, exc))
            continue
        if (cls, key) in PATH_KEYS and value:
            value = str(base / Path(value).expanduser())
        check = CHECKS.get((cls, key))
        problem = check(value) if check else None
        if problem:
            problems.append(f"{prefix}{key}: {problem}")
            continue
        values[key] = value
    missing = [f.name for f in fields.values() if f.required and f.name not in table]
    problems.extend(f"{prefix}{name}: required, and missing" for name in missing)
    if len(values) != len(table) or missing:
        return None
    return cls(**values)


def _build_model(name: str, table: Any, repository: str, problems: list[str], base: Path,
                 prefix: str | None = None) -> ModelConfig | None:
    """One model from its table; `repository` unless the table names one; problems named by `prefix`
    (default `models.NAME.`)."""
    prefix = prefix or f"models.{name}."
    if not MODEL_NAME.match(name):
        problems.append(f"models.{name}: {NAME_RULE}")
        return None
    model = _build(ModelConfig, table, prefix, problems, base)
    if model is None:
        return None
    warmup = model.warmup_batch_sizes or tuple(sorted({1, model.max_batch_size}))
    for key, sizes in (("warmup_batch_sizes", warmup), ("batch_buckets", model.batch_buckets)):
        too_big = [size for size in sizes if size > model.max_batch_size]
        if too_big:
            problems.append(f"{prefix}{key}: {too_big[0]} is over max_batch_size ({model.max_batch_size})")
            return None
    if list(model.batch_buckets) != sorted(set(model.batch_buckets)):
        problems.append(f"{prefix}batch_buckets: list each size once, smallest first (e.g. [1, 2, 4, 8])")
        return None
    if model.cuda_graphs and not model.batch_buckets:
        problems.append(f"{prefix}cuda_graphs: needs batch_buckets, the batch sizes a graph is captured at "
                        "(e.g. [1, 2, 4, 8, 16, 32])")
        return None
    padding = padding_problem(model)
    if padding is not None:
        problems.append(f"{prefix}{padding[0]}: {padding[1]}")
        return None
    return msgspec.structs.replace(model, warmup_batch_sizes=warmup, repository=model.repository or repository)


def _model_folders(root: str, taken: dict[str, ModelConfig], problems: list[str]) -> dict[str, ModelConfig]:
    """The models of `server.model_root`: each folder holding a `model.toml`, named after the folder and
    served from it; a name also in `taken` (the config's own tables) is a problem."""
    folder = Path(root)
    if not folder.is_dir():
        problems.append(f"server.model_root: {root} is not a folder")
        return {}
    models: dict[str, ModelConfig] = {}
    for path in sorted(folder.glob(f"*/{MODEL_TOML}")):
        name, where = path.parent.name, f"{path}: "
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            problems.append(f"{where}cannot be read: {exc.strerror}")
            continue
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"{where}not valid TOML: {exc}")
            continue
        if not MODEL_NAME.match(name):
            problems.append(f"server.model_root: the folder {path.parent} is not a model name: {NAME_RULE}")
            continue
        if "repository" in table:
            problems.append(f"{where}repository: a model folder is its own repository; remove the key")
            continue
        if name in taken:
            problems.append(f"models.{name}: also a folder of server.model_root ({path.parent}); keep one of them")
            continue
        model = _build_model(name, table, str(path.parent), problems, path.parent, where)
        if model is not None:
            models[name] = model
    return models


def _pipelines(table: Any, models: dict[str, ModelConfig], problems: list[str],
               base: Path) -> dict[str, PipelineConfig]:
    """The [pipelines.NAME] tables, each checked against the models it runs (docs/pipelines.md)."""
    if not isinstance(table, dict):
        problems.append(f"pipelines: expected a table of [pipelines.NAME] tables, got {type(table).__name__}")
        return {}
    pipelines: dict[str, PipelineConfig] = {}
    for name, body in table.items():
        if not MODEL_NAME.match(name):
            problems.append(f"pipelines.{name}: {NAME_RULE.replace('model', 'pipeline')}")
            continue
        pipeline = _build(PipelineConfig, body, f"pipelines.{name}.", problems, base)
        if pipeline is None:
            continue
        found = pipeline_problems(name, pipeline, models)
        problems += found
        if not found:
            pipelines[name] = pipeline
    return pipelines


def parse(raw: dict[str, Any], source: str | None = None, base: Path | None = None) -> Config:
    """Validate a config already read as a dict; raise `ConfigError` naming every problem. Relative
    paths are read from `base` (default: the working folder)."""
    base = (base or Path.cwd()).resolve()
    problems: list[str] = []
    for key in raw:
        if key not in SECTIONS and key not in ("models", "pipelines"):
            problems.append(f"{key}: unknown section; known sections are "
                            f"{', '.join([*SECTIONS, 'models', 'pipelines'])}")
    sections = {name: _build(cls, raw.get(name, {}), f"{name}.", problems, base) for name, cls in SECTIONS.items()}
    server, queue = sections["server"], sections["queue"]
    state_dir = (server.state_dir if server else None) or str(paths.state_dir())
    models_table = raw.get("models", {})
    models: dict[str, ModelConfig] = {}
    if not isinstance(models_table, dict):
        problems.append(f"models: expected a table of [models.NAME] tables, got {type(models_table).__name__}")
        models_table = {}
    for name, table in models_table.items():
        model = _build_model(name, table, str(Path(state_dir) / "models" / name), problems, base)
        if model is not None:
            models[name] = model
    if server is not None and server.model_root:
        models.update(_model_folders(server.model_root, models, problems))
    if not models and not problems:
        problems.append("models: no model is configured; add a [models.NAME] table"
                        + (f", or a folder with a {MODEL_TOML} to server.model_root" if server and
                           server.model_root else ""))
    pipelines = _pipelines(raw.get("pipelines", {}), models, problems, base)
    if server is not None:
        if bool(server.curve_secret_key) != bool(server.curve_authorized_keys):
            problems.append("server.curve_secret_key and server.curve_authorized_keys go together: set both or "
                            "neither")
        if bool(server.tls_cert) != bool(server.tls_key):
            problems.append("server.tls_cert and server.tls_key go together: set both or neither")
        if server.gateway_buffer_mb < server.max_message_mb:
            problems.append(f"server.gateway_buffer_mb: {server.gateway_buffer_mb:g} is less than "
                            f"server.max_message_mb ({server.max_message_mb:g}), so a gateway could never take the "
                            "largest request; raise it, or lower max_message_mb")
    if queue is not None and queue.default_priority is not None and queue.default_priority >= queue.priority_levels:
        levels = queue.priority_levels
        problems.append(f"queue.default_priority: {queue.default_priority} is not a level; with "
                        f"priority_levels = {levels} the levels are 0 to {levels - 1}")
    if problems:
        raise ConfigError(problems, models)
    server = msgspec.structs.replace(
        server, state_dir=state_dir, control=server.control or paths.default_control()
    )
    return Config(
        server=server, workers=sections["workers"], queue=queue, models=models, source=source, pipelines=pipelines
    )


def _read(path: str | Path) -> dict[str, Any]:
    """The TOML file at `path` as a dict; ConfigError when it cannot be read or is not TOML."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"cannot read {path}: {exc.strerror}"]) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path} is not valid TOML: {exc}"]) from None


def load(path: str | Path) -> Config:
    """Read and validate a TOML config file; raise `ConfigError` naming every problem."""
    return parse(_read(path), source=str(path), base=Path(path).parent)


def control_endpoint(path: str | Path) -> str:
    """The control endpoint of a daemon started with the config file at `path`, from its `server.control`
    alone: the rest of the file may be an operator's edit in progress (a version not copied yet), which must
    not keep inferctl from the daemon that runs. ConfigError when the file or that key is bad."""
    server = _read(path).get("server", {})
    table = {key: value for key, value in server.items() if key == "control"} if isinstance(server, dict) else server
    problems: list[str] = []
    built = _build(ServerConfig, table, "server.", problems, Path(path).parent)
    if built is None:
        raise ConfigError(problems)
    return built.control or paths.default_control()


def encode(config: Config) -> bytes:
    """The config as msgpack, to hand to a spawned worker."""
    return msgspec.msgpack.encode(config)


def decode(data: bytes) -> Config:
    """The inverse of `encode`."""
    return msgspec.msgpack.decode(data, type=Config)
