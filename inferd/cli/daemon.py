"""The `inferd` command: run the daemon in the foreground, or check a config file."""

from __future__ import annotations

import os

import click

from inferd import __version__
from inferd.cli import common
from inferd.cli.common import CliError, load_config, run_command
from inferd.config import loading
from inferd.system import paths


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="inferd", message="%(prog)s %(version)s")
def inferd() -> None:
    """inferd: a multiprocess inference daemon with dynamic batching."""


@inferd.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config; none: the demo.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              help="Overrides server.log_level and INFERD_LOG_LEVEL, across SIGHUPs too.")
def serve(config_path: str | None, log_level: str | None) -> int:
    """Run the daemon in the foreground (what systemd starts)."""
    from inferd.supervisor.wakeup import hold_signals

    hold_signals()  # before the imports below, which take seconds
    from inferd import demo
    from inferd.supervisor.main import Supervisor
    from inferd.supervisor.shared.state import StartupError
    from inferd.system.logs import set_level, setup_logging

    setup_logging("inferd")
    if config_path is None:
        state_dir = paths.state_dir()
        demo.ensure_repository(state_dir)
        config = loading.parse(demo.demo_config(state_dir), source="demo")
    else:
        config = load_config(config_path)
    if log_level is not None:
        # Through the environment, whose INFERD_LOG_LEVEL set_level lets win here and in every child: the config
        # keeps the file's level, so a SIGHUP compares the file with itself and does not undo the override.
        os.environ["INFERD_LOG_LEVEL"] = log_level
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
    pipelines = f", {len(config.pipelines)} pipeline(s)" if config.pipelines else ""
    click.echo(f"{config_path}: ok ({len(config.models)} model(s){pipelines})")


@inferd.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The daemon's config: where the model's repository is, and its inputs.")
@click.option("--model", required=True, help="Model name.")
@click.option("--from", "source", required=True, help="The version to convert (TorchScript or torch.export).")
@click.option("--to", "target", required=True, help="The new version's name: a folder beside it.")
@click.option("--format", "format_", type=click.Choice(["exported", "aoti"]),
              help="exported: a torch.export program; aoti: compiled by AOTInductor for --device. Default: aoti "
                   "where a C++ compiler is found, else exported.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda:N: where the version will run.")
def convert(config_path: str, model: str, source: str, target: str, format_: str | None, device: str) -> None:
    """Make a new version of a model from an old one in a newer format, checked to give the same answers.

    From TorchScript through PyTorch's converter, exported with a dynamic batch dim up to max_batch_size, and
    with --format aoti compiled for --device (minutes on a small machine); the new version must give the old
    one's answers at several batch sizes, and carries the old one's output as its canary. Then
    `inferctl reload --version NEW` puts it live.
    """
    import warnings

    from inferd.models.convert import ConvertError, default_format, timed
    from inferd.models.convert import convert as make_version

    warnings.simplefilter("ignore", FutureWarning)  # torch's notes to its own developers, not to this command's user

    config = load_config(config_path)
    if model not in config.models:
        raise CliError(f"{config_path} has no model {model!r}; it serves {', '.join(sorted(config.models))}")
    say = timed(click.echo)
    try:
        folder = make_version(model, config.models[model], source, target, format_ or default_format(), device, say)
    except ConvertError as exc:
        raise CliError(str(exc)) from None
    say(f"{model} {target} written to {folder}; `inferctl reload --model {model} --version {target}` puts it live")


def main() -> None:
    """Entry point of `inferd`."""
    run_command(inferd, "inferd")
