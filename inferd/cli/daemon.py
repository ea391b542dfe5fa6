"""The `inferd` command: run the daemon in the foreground, or check a config file."""

from __future__ import annotations

import click
import msgspec

from inferd import __version__, paths
from inferd.cli import common
from inferd.cli.common import CliError, load_config, run_command
from inferd.config import loading


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="inferd", message="%(prog)s %(version)s")
def inferd() -> None:
    """inferd: a multiprocess inference daemon with dynamic batching."""


@inferd.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config; none: the demo.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              help="Overrides server.log_level.")
def serve(config_path: str | None, log_level: str | None) -> int:
    """Run the daemon in the foreground (what systemd starts)."""
    from inferd import demo
    from inferd.logs import set_level, setup_logging
    from inferd.supervisor.main import Supervisor
    from inferd.supervisor.state import StartupError

    setup_logging("inferd")
    if config_path is None:
        state_dir = paths.state_dir()
        demo.ensure_repository(state_dir)
        config = loading.parse(demo.demo_config(state_dir), source="demo")
    else:
        config = load_config(config_path)
    if log_level is not None:
        config = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, log_level=log_level))
    set_level(config.server.log_level)
    try:
        supervisor = Supervisor(config)
    except StartupError as exc:
        raise CliError(str(exc)) from None
    return supervisor.run()


@inferd.command("check-config")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def check_config(config_path: str) -> None:
    """Validate a config file: exit 0, or 1 naming every problem."""
    config, problems = common.check_config(config_path)
    if problems or config is None:
        for problem in problems:
            click.echo(f"{config_path}: {problem}", err=True)
        raise CliError(f"{config_path} has {len(problems)} problem(s)")
    click.echo(f"{config_path}: ok ({len(config.models)} model(s))")


def main() -> None:
    """Entry point of `inferd`."""
    run_command(inferd, "inferd")
