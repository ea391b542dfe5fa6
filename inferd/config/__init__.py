"""Every option of inferd, declared once: type, default, check and documentation.

`schema` holds the declaration; `loading` validates a TOML file against it and
names every problem with its key; `docs` renders the same declaration as the
config reference (docs/reference/config.md), so the docs cannot drift. The names below are what
users import: `from inferd import config; config.load(path)`.
"""

from inferd.config.docs import reference_markdown, update_reference
from inferd.config.loading import ConfigError, decode, encode, load, parse
from inferd.config.schema import (
    SECTIONS,
    CanaryGuard,
    Config,
    InputSpec,
    ModelConfig,
    OutputSpec,
    QueueConfig,
    ServerConfig,
    WorkersConfig,
    client_shm_protocols,
    live_keys,
    version_problem,
)

__all__ = [
    "SECTIONS",
    "CanaryGuard",
    "Config",
    "ConfigError",
    "InputSpec",
    "ModelConfig",
    "OutputSpec",
    "QueueConfig",
    "ServerConfig",
    "WorkersConfig",
    "client_shm_protocols",
    "decode",
    "encode",
    "live_keys",
    "load",
    "parse",
    "reference_markdown",
    "update_reference",
    "version_problem",
]
