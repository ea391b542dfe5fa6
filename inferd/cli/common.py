"""What the `inferd`, `inferctl` and `inferd-fleet` commands share: one-sentence errors, running a
click command as a program, loading a config, finite numbers, and durations such as 10m."""

from __future__ import annotations

import math
import sys
from typing import Any

import click

from inferd.config import loading
from inferd.config.schema import Config

DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


class CliError(click.ClickException):
    """An error printed as one sentence."""


def run_command(command: click.Command, prog: str) -> None:
    """Run a click command as a program: its errors are one sentence on stderr and a non-zero exit."""
    try:
        code = command.main(prog_name=prog, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"{prog}: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def check_config(path: str) -> tuple[Config | None, list[str]]:
    """The config at `path` and every problem with it, its models' repositories included, in one pass."""
    from inferd.models import repository

    try:
        config = loading.load(path)
    except loading.ConfigError as exc:
        return None, exc.problems + repository.check(exc.models)
    return config, repository.check(config.models)


def load_config(path: str) -> Config:
    """The config at `path`, with its model repositories checked; every problem is one CliError."""
    config, problems = check_config(path)
    if problems or config is None:
        raise config_error(path, problems)
    return config


def config_error(path: str, problems: list[str]) -> CliError:
    """The one sentence that names every problem of the config at `path`."""
    return CliError(f"{path} has {len(problems)} problem(s): " + "; ".join(problems))


class Finite(click.FloatRange):
    """A number in a range, and finite: click's FloatRange lets NaN through (no comparison with a bound holds
    for it), and infinity past a minimum alone, and neither means anything to a timeout or a percentage."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        """The number; NaN, infinity or one out of range is one sentence."""
        number: float = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Duration(click.ParamType):
    """A span of time: 90, 90s, 10m, 1h or 1h30m (seconds when no unit is given)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        """Seconds, above zero; anything else is one sentence."""
        text = str(value).strip().lower()
        seconds, number = 0.0, ""
        try:
            for char in text:
                if char in DURATION_UNITS:
                    seconds += float(number) * DURATION_UNITS[char]
                    number = ""
                else:
                    number += char
            seconds += float(number) if number else 0.0
        except ValueError:
            self.fail(f"{value!r} is not a duration (say 90s, 10m or 1h)", param, ctx)
        if not seconds > 0 or not text:
            self.fail(f"{value!r} is not a duration above zero (say 90s, 10m or 1h)", param, ctx)
        if not math.isfinite(seconds):  # "inf", or "1e308h": as JSON it would be null, no duration at all
            self.fail(f"{value!r} is not a finite duration (say 90s, 10m or 1h)", param, ctx)
        return seconds
