"""The `inferd` and `inferctl` commands.

Every error is printed as one plain sentence, with no traceback, and a
non-zero exit status.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click
import numpy as np

from inferd import __version__, paths, protocol
from inferd import config as config_module
from inferd.errors import ERROR_BY_STATUS, InferdError
from inferd.ipc.control import ControlClient, ControlError, encode_command

DEFAULT_TIMEOUT_S = 5.0


class CliError(click.ClickException):
    """An error printed as one sentence."""


def _run(group: click.Group, prog: str) -> None:
    try:
        code = group.main(prog_name=prog, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"{prog}: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def _load_config(path: str) -> config_module.Config:
    from inferd import repository

    try:
        config = config_module.load(path)
    except config_module.ConfigError as exc:
        raise CliError(f"{path} has {len(exc.problems)} problem(s): " + "; ".join(exc.problems)) from None
    problems = repository.check(config)
    if problems:
        raise CliError("; ".join(problems))
    return config


# -- inferd ----------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="inferd", message="%(prog)s %(version)s")
def inferd() -> None:
    """inferd: a multiprocess inference daemon with dynamic batching."""


@inferd.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config; none: the demo.")
def serve(config_path: str | None) -> int:
    """Run the daemon in the foreground (what systemd starts)."""
    from inferd import demo
    from inferd.logs import set_level, setup_logging
    from inferd.supervisor.main import Supervisor

    setup_logging("inferd")
    if config_path is None:
        state_dir = paths.state_dir()
        demo.ensure_repository(state_dir)
        config = config_module.parse(demo.demo_config(state_dir), source="demo")
    else:
        config = _load_config(config_path)
    set_level(config.server.log_level)
    return Supervisor(config).run()


@inferd.command("check-config")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def check_config(config_path: str) -> None:
    """Validate a config file: exit 0, or 1 naming every problem."""
    from inferd import repository

    try:
        config = config_module.load(config_path)
    except config_module.ConfigError as exc:
        problems = exc.problems
    else:
        problems = repository.check(config)
    if problems:
        for problem in problems:
            click.echo(f"{config_path}: {problem}", err=True)
        raise CliError(f"{config_path} has {len(problems)} problem(s)")
    click.echo(f"{config_path}: ok ({len(config.models)} model(s))")


# -- inferctl ----------------------------------------------------------------------


def _control_endpoint(control: str | None, config_path: str | None) -> str:
    if control:
        return control
    config_path = config_path or os.environ.get("INFERD_CONFIG")
    if config_path:
        return _load_config(config_path).server.control
    return paths.find_control()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Find the daemon from this config.")
@click.option("--control", help="The daemon's control endpoint, e.g. ipc:///run/inferd/control.sock.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"Seconds to wait for the daemon [default: {DEFAULT_TIMEOUT_S:g}; reload and rollback: until done].")
@click.pass_context
def inferctl(ctx: click.Context, config_path: str | None, control: str | None, timeout: float | None) -> None:
    """Operate a running inferd."""
    ctx.obj = {"config_path": config_path, "control": control, "timeout": timeout}


def _timeout(ctx: click.Context) -> float:
    return ctx.obj["timeout"] or DEFAULT_TIMEOUT_S


def _client(ctx: click.Context) -> ControlClient:
    endpoint = _control_endpoint(ctx.obj["control"], ctx.obj["config_path"])
    try:
        return ControlClient(endpoint, timeout=_timeout(ctx))
    except ControlError as exc:
        raise CliError(str(exc)) from None


def _call(ctx: click.Context, command: str, **args: Any) -> Any:
    with _client(ctx) as client:
        try:
            return client.call(command, **args)
        except ControlError as exc:
            raise CliError(str(exc)) from None


def _switch(ctx: click.Context, command: str, **args: Any) -> None:
    """Run reload or rollback, printing its progress; wait until done unless --timeout was given."""
    started = time.perf_counter()

    def progress(line: str) -> None:
        click.echo(f"[{time.perf_counter() - started:6.2f} s] {line}")

    with _client(ctx) as client:
        try:
            result = client.call(command, on_progress=progress, wait_forever=ctx.obj["timeout"] is None, **args)
        except ControlError as exc:
            raise CliError(str(exc)) from None
    click.echo(f"{result['model']} {result['version']} is live (was {result['previous']}): load {result['load_s']:.2f} s, "
               f"warm-up {result['warm_s']:.2f} s, switch {result['switch_ms']:.3f} ms, {result['total_s']:.2f} s in all")


@inferctl.command()
@click.pass_context
def health(ctx: click.Context) -> None:
    """Exit 0 when the daemon is ready to serve, 1 otherwise."""
    try:
        result = _call(ctx, "health")
    except CliError as exc:
        raise CliError(f"not healthy: {exc.message}") from None
    if not result["healthy"]:
        raise CliError(f"not healthy: {result['reason']}")
    click.echo("healthy")


@inferctl.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """The daemon's state, its workers and the live version of each model."""
    result = _call(ctx, "status")
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"inferd {result['version']}, pid {result['pid']}, {result['state']} "
               f"for {result['uptime_s']:.1f} s, listening on {', '.join(result['listen'])}")
    click.echo("models:")
    for name, model in result["models"].items():
        click.echo(f"  {name:<20} live {model['live_version']:<12} queued {model['queue_depth']}")
    click.echo("workers:")
    for w in result["workers"]:
        line = (f"  worker{w['worker']:<3} pid {str(w['pid']):<8} {w['device']:<8} {w['state']:<9}"
                f" generation {w['generation']}  restarts {w['restarts']}  busy executors {w['busy_executors']}"
                f"  loaded: {', '.join(w['loaded']) or 'nothing'}")
        if w["last_error"]:
            line += f"  last error: {w['last_error']}"
        click.echo(line)


@inferctl.command()
@click.option("--version", required=True, help="The version folder to make live.")
@click.option("--model", help="Model name (may be left out when the daemon serves one model).")
@click.option("--allow-signature-change", is_flag=True, help="Accept outputs of another dtype or shape.")
@click.pass_context
def reload(ctx: click.Context, version: str, model: str | None, allow_signature_change: bool) -> None:
    """Blue-green: load VERSION beside the live one, warm it, then switch; exit 0 once it is live."""
    _switch(ctx, "reload", version=version, model=model, allow_signature_change=allow_signature_change)


@inferctl.command()
@click.option("--model", help="Model name (may be left out when the daemon serves one model).")
@click.pass_context
def rollback(ctx: click.Context, model: str | None) -> None:
    """Blue-green back to the version live before the last reload."""
    _switch(ctx, "rollback", model=model)


@inferctl.command()
@click.option("--model", help="Model name (default: every model).")
@click.pass_context
def versions(ctx: click.Context, model: str | None) -> None:
    """The versions in the repository, with sizes and dates, and which is live."""
    result = _call(ctx, "versions", model=model)
    for name, found in result.items():
        click.echo(f"{name}:")
        for entry in found:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry["modified"]))
            click.echo(f"  {'*' if entry['live'] else ' '} {entry['version']:<16} {entry['file']:<10} "
                       f"{entry['size_bytes'] / 2**20:10.2f} MiB  {stamp}{'  (live)' if entry['live'] else ''}")


@inferctl.command()
@click.option("--model", required=True, help="Model name.")
@click.option("--input", "inputs", required=True, multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A .npy file, batch dim first; repeat for a model with several inputs.")
@click.option("--output", type=click.Path(dir_okay=False), help="Save the (first) output here as .npy.")
@click.pass_context
def infer(ctx: click.Context, model: str, inputs: tuple[str, ...], output: str | None) -> None:
    """Run one request through the daemon's control socket."""
    try:
        arrays = [np.load(path, allow_pickle=False) for path in inputs]
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read the input: {exc}") from None
    try:
        request = protocol.encode_request(1, model, arrays, timeout_ms=int(_timeout(ctx) * 1000))
    except InferdError as exc:
        raise CliError(exc.message) from None
    with _client(ctx) as client:
        try:
            started = time.perf_counter()
            frames = client.exchange([encode_command("infer"), *request])
            elapsed_ms = (time.perf_counter() - started) * 1000
        except ControlError as exc:
            raise CliError(str(exc)) from None
        header, outputs = protocol.decode_reply([f.buffer for f in frames])
        if header.status != protocol.OK:
            raise CliError(f"{ERROR_BY_STATUS.get(header.status, InferdError).__name__}: {header.error}")
        outputs = [np.array(o) for o in outputs]
    if output:
        np.save(output, outputs[0])
    click.echo(f"{model} {header.version}: {len(outputs)} output(s) in {elapsed_ms:.2f} ms "
               f"(queue {header.timing_us.queue} us, compute {header.timing_us.compute} us)")
    for index, array in enumerate(outputs):
        click.echo(f"output {index}: {array.dtype} {list(array.shape)}" + (f" -> {output}" if output and not index else ""))
        if not output:
            click.echo(np.array2string(array, threshold=40, precision=4))


def main_inferd() -> None:
    """Entry point of `inferd`."""
    _run(inferd, "inferd")


def main_inferctl() -> None:
    """Entry point of `inferctl`."""
    _run(inferctl, "inferctl")


if __name__ == "__main__":
    main_inferd()
