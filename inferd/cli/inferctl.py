"""The `inferctl` command: operate a running inferd through its control socket."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import click
import numpy as np

from inferd import protocol
from inferd.cli.common import CliError, Duration, Finite, config_error, run_command
from inferd.cli.render import models_text, stats_table, status_table, switch_outcome, versions_text
from inferd.cli.stacks import signalled_stacks
from inferd.config import loading
from inferd.errors import ERROR_BY_STATUS, InferdError
from inferd.ipc.control import ControlClient, ControlError, NoDaemon, encode_command
from inferd.ipc.curve import load_pair, load_public
from inferd.system import paths
from inferd.system.paths import RuntimeFiles

DEFAULT_TIMEOUT_S = 5.0
# The longest --timeout or --watch: longer is a slip of the finger (1e10), and the waits underneath (a poll in
# milliseconds, threading's TIMEOUT_MAX) overflow somewhere past 1e9 s.
MAX_WAIT_S = 86_400


def _control_endpoint(control: str | None, config_path: str | None) -> str:
    if control:
        return control
    config_path = config_path or os.environ.get("INFERD_CONFIG")
    if config_path:
        try:
            return loading.control_endpoint(config_path)
        except loading.ConfigError as exc:
            raise config_error(config_path, exc.problems) from None
    return paths.find_control()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Find the daemon from this config.")
@click.option("--control", help="The daemon's control endpoint, e.g. ipc:///run/inferd/control.sock.")
@click.option("--timeout", type=Finite(min=0, min_open=True, max=MAX_WAIT_S), default=None,
              help=f"Seconds to wait for the daemon [default: {DEFAULT_TIMEOUT_S:g}; reload and rollback: until done].")
@click.option("--server-key", type=click.Path(dir_okay=False),
              help="For a tcp:// control socket: the daemon's public key file (NAME.key).")
@click.option("--client-key", type=click.Path(dir_okay=False),
              help="For a tcp:// control socket: this client's NAME.key_secret, whose NAME.key the daemon authorizes.")
@click.pass_context
def inferctl(ctx: click.Context, config_path: str | None, control: str | None, timeout: float | None,
             server_key: str | None, client_key: str | None) -> None:
    """Operate a running inferd."""
    ctx.obj = {"config_path": config_path, "control": control, "timeout": timeout, "server_key": server_key,
               "client_key": client_key}


def _timeout(ctx: click.Context) -> float:
    return ctx.obj["timeout"] or DEFAULT_TIMEOUT_S


NO_DAEMON_HINT = ("; start one with `inferd serve`, or point inferctl at yours with --config PATH, "
                  "$INFERD_CONFIG or --control ADDR")


def _curve_keys(ctx: click.Context, endpoint: str) -> tuple[bytes, tuple[bytes, bytes]] | None:
    """The daemon's public key and this client's pair, for a tcp:// endpoint (CURVE only); None for ipc://."""
    server_key, client_key = ctx.obj["server_key"], ctx.obj["client_key"]
    if not endpoint.startswith("tcp://"):
        return None
    if not (server_key and client_key):
        raise CliError(f"{endpoint} is a tcp control socket, which speaks CURVE only: give --server-key (the "
                       "daemon's NAME.key) and --client-key (your NAME.key_secret, authorized by the daemon)")
    try:
        return load_public(server_key), load_pair(client_key)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read the CURVE keys: {exc}") from None


def _client(ctx: click.Context) -> ControlClient:
    endpoint = _control_endpoint(ctx.obj["control"], ctx.obj["config_path"])
    try:
        return ControlClient(endpoint, timeout=_timeout(ctx), curve=_curve_keys(ctx, endpoint))
    except NoDaemon as exc:
        raise CliError(f"{exc}{NO_DAEMON_HINT}") from None
    except ControlError as exc:
        raise CliError(str(exc)) from None


def _call(ctx: click.Context, command: str, **args: Any) -> Any:
    with _client(ctx) as client:
        try:
            return client.call(command, **args)
        except ControlError as exc:
            raise CliError(str(exc)) from None


def _switch(ctx: click.Context, command: str, **args: Any) -> None:
    """Run reload, rollback, promote or canary, printing its progress; wait until done unless --timeout was given."""
    started = time.perf_counter()

    def progress(line: str) -> None:
        click.echo(f"[{time.perf_counter() - started:6.2f} s] {line}")

    with _client(ctx) as client:
        try:
            result = client.call(command, on_progress=progress, until_done=ctx.obj["timeout"] is None, **args)
        except ControlError as exc:
            raise CliError(str(exc)) from None
    click.echo(switch_outcome(result))


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
    """The daemon's state, its workers, its gateways and the live version of each model."""
    result = _call(ctx, "status")
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(status_table(result))


@inferctl.command()
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--name", default="inferd", show_default=True, help="Base name of the two files.")
def keygen(folder: str, name: str) -> None:
    """Write a CURVE key pair: NAME.key (public, to share) and NAME.key_secret (secret, mode 0600)."""
    import zmq.auth

    try:
        os.makedirs(folder, exist_ok=True)
        public, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
    except OSError as exc:
        raise CliError(f"cannot write the keys to {folder}: {exc.strerror}") from None
    click.echo(f"public key: {public}\nsecret key: {secret}")


@inferctl.command()
@click.pass_context
def stacks(ctx: click.Context) -> None:
    """Print the thread stacks of the supervisor and of every worker (where is a hung daemon?).

    When the control socket does not answer, the daemon's processes are sent SIGUSR1
    and the stacks they write (faulthandler, from the signal itself) are printed.
    """
    endpoint = _control_endpoint(ctx.obj["control"], ctx.obj["config_path"])
    try:
        result = _call(ctx, "stacks")
    except CliError as exc:
        if not endpoint.startswith("ipc://") or "did not answer" not in exc.message:
            raise
        click.echo(f"{exc.message}; asking its processes with SIGUSR1", err=True)
        result = signalled_stacks(RuntimeFiles(endpoint, ""))
    click.echo("== supervisor ==\n" + result["supervisor"])
    for name, text in result["workers"].items():
        click.echo(f"== {name} ==\n" + (text or "(no answer)"))


@inferctl.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema in docs/operations/watching.md).")
@click.option("--watch", type=Finite(min=0.1, max=MAX_WAIT_S), help="Refresh every SECONDS until Ctrl-C.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool, watch: float | None) -> None:
    """Requests, latency, throughput and batches per model; processes, memory and GPUs per worker."""
    if watch is None:
        result = _call(ctx, "stats")
        click.echo(json.dumps(result, indent=2) if as_json else stats_table(result))
        return
    # Ctrl-C ends the loop at once in a wait, and after the refresh in one, rather than as a
    # KeyboardInterrupt that may land inside ZeroMQ's calls (a refresh's socket, the closing of its
    # context): a clean-clone run beside a CPU burner once saw inferctl outlive Ctrl-C by 10 s.
    stopped = threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    while not stopped.is_set():
        result = _call(ctx, "stats")
        click.echo("\033[2J\033[H" + (json.dumps(result, indent=2) if as_json else stats_table(result)))
        stopped.wait(watch)


@inferctl.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """Each model's inputs and outputs, batching, live version (and where it came from), the versions on
    disk (and why any cannot be served), and a request to try it with."""
    found = _call(ctx, "models", on_disk=True)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    click.echo(models_text(found, _call(ctx, "status")["listen"]))


PERCENT = Finite(0, 100)
MODEL_OPTION = click.option("--model", help="Model name (may be left out when the daemon serves one model).")


@inferctl.command()
@click.option("--version", required=True, help="The version folder to make live (or to try).")
@MODEL_OPTION
@click.option("--allow-signature-change", is_flag=True, help="Accept outputs of another dtype or shape.")
@click.option("--canary", type=PERCENT, help="Try VERSION on this percentage of the model's batches instead.")
@click.option("--shadow", type=PERCENT, help="Compute this percentage of requests again with VERSION, only to "
              "compare; clients get the live version's replies.")
@click.option("--auto-rollback", is_flag=True, help="With --canary: roll it back by itself when it does worse "
              "than the live version (docs/operations/canary.md).")
@click.option("--promote-after", type=Duration(), help="With --canary: promote it after this long (10m, 1h) if it "
              "stays clean; implies --auto-rollback.")
@click.pass_context
def reload(ctx: click.Context, version: str, model: str | None, allow_signature_change: bool, canary: float | None,
           shadow: float | None, auto_rollback: bool, promote_after: float | None) -> None:
    """Blue-green: load VERSION beside the live one, warm it, then switch; exit 0 once it is live.
    With --canary or --shadow, VERSION is tried beside the live one instead."""
    _switch(ctx, "reload", version=version, model=model, allow_signature_change=allow_signature_change,
            canary=canary, shadow=shadow, auto_rollback=auto_rollback, promote_after_s=promote_after)


@inferctl.command()
@click.option("--weight", required=True, type=PERCENT, help="The new percentage.")
@MODEL_OPTION
@click.pass_context
def canary(ctx: click.Context, weight: float, model: str | None) -> None:
    """Move the running canary (or shadow) to WEIGHT percent."""
    _switch(ctx, "canary", weight=weight, model=model)


@inferctl.command()
@MODEL_OPTION
@click.pass_context
def promote(ctx: click.Context, model: str | None) -> None:
    """Make the canary (or shadow) live: a blue-green switch to the version already loaded."""
    _switch(ctx, "promote", model=model)


@inferctl.command()
@MODEL_OPTION
@click.option("--yes", is_flag=True, help="Without a canary or shadow: do switch back to the version before.")
@click.pass_context
def rollback(ctx: click.Context, model: str | None, yes: bool) -> None:
    """End the canary or shadow; without one, blue-green back to the version live before the last reload
    (which asks for --yes)."""
    _switch(ctx, "rollback", model=model, confirm=yes)


@inferctl.command()
@click.option("--model", required=True, help="The model to load (an unknown one is looked for in the config again).")
@click.option("--version", help="Make this version live first (blue-green where the model is loaded).")
@click.pass_context
def load(ctx: click.Context, model: str, version: str | None) -> None:
    """Load a model on a worker if none has it; exit 0 once one serves it."""
    _switch(ctx, "load", model=model, version=version)


@inferctl.command()
@click.option("--model", required=True, help="The on-demand model to unload.")
@click.pass_context
def unload(ctx: click.Context, model: str) -> None:
    """Unload an on-demand model from every worker; refused while requests of it wait or run."""
    result = _call(ctx, "unload", model=model)
    where = ", ".join(f"worker{index}" for index in result["workers"]) or "no worker (it was not loaded)"
    click.echo(f"{result['model']} unloaded from {where}")


@inferctl.command()
@click.pass_context
def trim(ctx: click.Context) -> None:
    """Every ready worker returns its GPU allocator's unused cached memory to the device now."""
    asked = _call(ctx, "trim")["workers"]
    click.echo(f"asked {len(asked)} workers to return their unused GPU memory")


@inferctl.command()
@click.option("--model", help="Model name (default: every model).")
@click.option("--json", "as_json", is_flag=True, help="As JSON: the model names, each a list of its versions.")
@click.pass_context
def versions(ctx: click.Context, model: str | None, as_json: bool) -> None:
    """The versions in the repository: each one's file, format, size and date, where an AOTInductor package was
    compiled for, and which is live."""
    result = _call(ctx, "versions", model=model)
    click.echo(json.dumps(result, indent=2) if as_json else versions_text(result))


@inferctl.command()
@click.option("--model", required=True, help="Model name.")
@click.option("--input", "inputs", required=True, multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A .npy file, batch dim first; repeat for a model with several inputs.")
@click.option("--output", type=click.Path(dir_okay=False), help="Save the (first) output here as .npy.")
@click.pass_context
def infer(ctx: click.Context, model: str, inputs: tuple[str, ...], output: str | None) -> None:
    """Run one request through the daemon's control socket."""
    arrays = [_read_npy(path) for path in inputs]
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
        try:
            np.save(output, outputs[0])
        except OSError as exc:
            raise CliError(f"cannot write {output}: {exc.strerror}") from None
    timing = header.timing_us or protocol.Timing(0, 0, 0)
    click.echo(f"{model} {header.version}: {len(outputs)} output(s) in {elapsed_ms:.2f} ms "
               f"(queue {timing.queue} us, compute {timing.compute} us)")
    for index, array in enumerate(outputs):
        saved = f" -> {output}" if output and not index else ""
        click.echo(f"output {index}: {array.dtype} {list(array.shape)}{saved}")
        if not output:
            click.echo(np.array2string(array, threshold=40, precision=4))


NPY_MAGIC = b"\x93NUMPY"


def _read_npy(path: str) -> np.ndarray:
    """The array in a .npy file; anything else (an .npz, a pickle, text) is one sentence saying what to give."""
    try:
        with open(path, "rb") as stream:
            if stream.read(len(NPY_MAGIC)) != NPY_MAGIC:
                raise CliError(f"{path} is not a .npy file; save the input with numpy.save(path, array)")
            stream.seek(0)
            return np.load(stream, allow_pickle=False)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, EOFError) as exc:  # EOFError: cut off; ValueError: an object array, a bad header
        reason = "it holds Python objects" if "allow_pickle" in str(exc) else str(exc)
        raise CliError(f"cannot read {path} as an array ({reason}); save a numeric array with "
                       "numpy.save(path, array)") from None


def main() -> None:
    """Entry point of `inferctl`."""
    run_command(inferctl, "inferctl")
