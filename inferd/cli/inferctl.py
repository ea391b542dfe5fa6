"""The `inferd` and `inferctl` commands.

Every error is printed as one plain sentence, with no traceback, and a
non-zero exit status.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import click
import msgspec
import numpy as np

from inferd import __version__, paths, protocol
from inferd import config as config_module
from inferd.errors import ERROR_BY_STATUS, InferdError
from inferd.ipc.control import ControlClient, ControlError, encode_command
from inferd.paths import RuntimeFiles

DEFAULT_TIMEOUT_S = 5.0
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
        config = config_module.parse(demo.demo_config(state_dir), source="demo")
    else:
        config = _load_config(config_path)
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
        return _load_config(config_path).server.control or paths.default_control()
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
    """Run reload, rollback, promote or canary, printing its progress; wait until done unless --timeout was given."""
    started = time.perf_counter()

    def progress(line: str) -> None:
        click.echo(f"[{time.perf_counter() - started:6.2f} s] {line}")

    with _client(ctx) as client:
        try:
            result = client.call(command, on_progress=progress, until_done=ctx.obj["timeout"] is None, **args)
        except ControlError as exc:
            raise CliError(str(exc)) from None
    click.echo(_outcome(result))


def _outcome(result: dict[str, Any]) -> str:
    """The last line of a switch: what is live, or what is tried, now."""
    name = result["model"]
    if "ended" in result:
        return f"the {result['ended']} of {name} ended; {result['version']} serves everything"
    if "was" in result:
        return f"{name} {result['mode']} {result['version']} now at {result['weight']:g} % (was {result['was']:g} %)"
    if "mode" in result:
        extra = ", guarded" if result["guarded"] else ""
        if result["promote_after_s"] is not None:
            extra += f", promoted after {result['promote_after_s']:g} s if it stays clean"
        return (f"{name} {result['version']} is a {result['mode']} at {result['weight']:g} % beside {result['live']}"
                f"{extra}: {_steps(result)}")
    if "promoted" in result:
        return (f"{name} {result['version']} is live (was {result['previous']}), promoted from its "
                f"{result['promoted']}: {_steps(result)}")
    return f"{name} {result['version']} is live (was {result['previous']}): {_steps(result)}"


def _steps(result: dict[str, Any]) -> str:
    """What a switch's steps took, of those it had."""
    steps = []
    if "load_s" in result:
        steps += [f"load {result['load_s']:.2f} s", f"warm-up {result['warm_s']:.2f} s"]
    if "switch_ms" in result:
        steps.append(f"switch {result['switch_ms']:.3f} ms")
    return ", ".join([*steps, f"{result['total_s']:.2f} s in all"])


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
        return seconds


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
    click.echo(f"inferd {result['version']}, pid {result['pid']}, {result['state']} "
               f"for {result['uptime_s']:.1f} s, listening on {', '.join(result['listen'])}")
    click.echo("models:")
    for name, model in result["models"].items():
        candidate = model["candidate"]
        trial = ""
        if candidate is not None:
            trial = f"  {candidate['mode']} {candidate['version']} at {candidate['weight']:g} %"
            trial += ", guarded" if candidate["guarded"] else ""
            if candidate["promote_in_s"] is not None:
                trial += f", promoted in {candidate['promote_in_s']:.0f} s if clean"
        click.echo(f"  {name:<20} live {model['live_version']:<12} queued {model['queue_depth']}{trial}")
    click.echo("workers:")
    for w in result["workers"]:
        line = (f"  worker{w['worker']:<3} pid {w['pid']!s:<8} {w['device']:<8} {w['state']:<9}"
                f" generation {w['generation']}  restarts {w['restarts']}  busy executors {w['executors_busy']}"
                f"  loaded: {', '.join(w['loaded']) or 'nothing'}")
        if w["last_error"]:
            line += f"  last error: {w['last_error']}"
        click.echo(line)
    if result["gateways"]:
        click.echo("gateways:")
    for g in result["gateways"]:
        click.echo(f"  {g['protocol']:<8} pid {g['pid']!s:<8} {g['address']:<22} restarts {g['restarts']}")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _scheduling_lines(stats: dict[str, Any]) -> list[str]:
    """Each model's priority levels (since start) and its admission estimate."""
    lines = ["", f"{'model':<14}{'priority':>8}{'requests':>10}{'not ok':>8}{'p50 ms':>9}{'p99 ms':>9}"
                 "   (since start)"]
    for name, model in stats["models"].items():
        for level, part in model["priorities"].items():
            requests = sum(part["requests"].values())
            lines.append(f"{name:<14}{level:>8}{requests:>10}{requests - part['requests'].get('ok', 0):>8}"
                         f"{part['latency_ms']['p50']:>9.2f}{part['latency_ms']['p99']:>9.2f}")
    for name, model in stats["models"].items():
        admission = model["admission"]
        estimate = "not known yet" if admission["estimate_ms"] is None else f"{admission['estimate_ms']:.1f} ms"
        lines.append(f"admission: a new request to {name} would finish in {estimate} at the soonest; "
                     f"{admission['refused_as_late']} refused as sure to miss their deadline")
    return lines


def _trial_lines(stats: dict[str, Any]) -> list[str]:
    """Each model's running trial with the guard's view of it, and each shadowed version's comparison."""
    lines = []
    for name, model in stats["models"].items():
        candidate = model["candidate"]
        if candidate is not None:
            routed = "" if candidate["routed_share"] is None else f", {candidate['routed_share']:.1%} routed so far"
            line = f"{name}: {candidate['mode']} {candidate['version']} at {candidate['weight']:g} %{routed}"
            guard = candidate.get("guard")
            if guard is not None:
                line += f"; guard ({guard['window_s']:g} s window): {guard['verdict']}, {guard['reason']}"
            lines.append(line)
        for version, shadow in model["shadow"].items():
            close = "-" if shadow["allclose_share"] is None else f"{shadow['allclose_share']:.1%}"
            compute = shadow["compute_ms"]
            lines.append(f"{name} shadow {version}: {shadow['compared']} of {shadow['chosen']} compared, {close} "
                         f"allclose, max difference {shadow['max_abs_difference']:.3g} (relative "
                         f"{shadow['max_rel_difference']:.3g}), compute p50 {compute['shadow']['p50']:.2f} ms against "
                         f"{compute['live']['p50']:.2f} ms live, {shadow['failed']} failed, "
                         f"{sum(shadow['dropped'].values())} dropped")
    return ["", *lines] if lines else []


def _stats_table(stats: dict[str, Any]) -> str:
    """The stats object as a few aligned lines a person reads in a terminal."""
    lines = [f"inferd {stats['state']}, up {stats['uptime_s']:.0f} s; latencies over the last minute, "
             "throughput over the last 10 s"]
    header = (f"{'model':<14}{'version':<10}{'requests':>9}{'not ok':>8}{'samples':>9}{'p50 ms':>9}{'p99 ms':>9}"
              f"{'queue p99':>10}{'compute p99':>12}{'samples/s':>10}{'goodput/s':>10}{'batch':>7}{'queued':>7}"
              f"{'peak':>6}")
    lines += ["", header]
    for name, model in stats["models"].items():
        for version, part in [("all", model), *model["versions"].items()]:
            requests = sum(part["requests"].values())
            latency = part["latency_ms"]
            live = version == model["live_version"]
            lines.append(
                f"{(name if version == 'all' else ''):<14}{version + ('*' if live else ''):<10}{requests:>9}"
                f"{requests - part['requests'].get('ok', 0):>8}{part['samples']:>9}{latency['total']['p50']:>9.2f}"
                f"{latency['total']['p99']:>9.2f}{latency['queue']['p99']:>10.2f}{latency['compute']['p99']:>12.2f}"
                f"{part['throughput']['samples_per_s_10s']:>10.1f}{part['goodput']['requests_per_s_10s']:>10.1f}"
                f"{part['batch_size']['mean']:>7.1f}"
                + (f"{model['queue_depth']:>7}{part['queue_depth_peak_60s']:>6}" if version == "all" else "")
            )
    lines += _scheduling_lines(stats)
    lines += _trial_lines(stats)
    lines += ["", f"{'worker':<8}{'pid':>8}  {'device':<8}{'state':<10}{'busy':>5}{'batches':>9}{'restarts':>9}"
                  f"{'rss MiB':>9}{'cpu %':>7}{'growth MiB':>11}  gpu"]
    for w in stats["workers"]:
        gpu = ""
        if "gpu_memory_used_bytes" in w:
            gpu = (f"{_mib(w['gpu_memory_used_bytes'])}/{_mib(w['gpu_memory_total_bytes'])} MiB, "
                   f"{w['gpu_utilization']:.0%} busy")
        if "torch_reserved_bytes" in w:
            gpu += (f"{', ' if gpu else ''}torch {_mib(w['torch_allocated_bytes'])}/"
                    f"{_mib(w['torch_reserved_bytes'])} MiB, fragmentation {w['fragmentation']:.0%}")
        warn = "  LEAK?" if w["leak_warning"] else ""
        lines.append(f"{'worker' + str(w['worker']):<8}{w['pid']!s:>8}  {w['device']:<8}{w['state']:<10}"
                     f"{w['executors_busy']:>5}{w['batches']:>9}{w['restarts']:>9}{_mib(w.get('rss_bytes')):>9}"
                     f"{w.get('cpu_percent', 0):>7.0f}{_mib(w['memory_growth_bytes']):>11}  {gpu}{warn}")
    if stats.get("regions"):
        regions = stats["regions"]
        name = max(len("region"), *(len(r["name"]) for r in regions)) + 2
        key = max(len("shared memory"), *(len(r["key"]) for r in regions)) + 2
        lines += ["", f"{'region':<{name}}{'shared memory':<{key}}{'bytes':>12}{'requests':>10}  owner"]
        lines += [f"{r['name']:<{name}}{r['key']:<{key}}{r['byte_size']:>12}{r['requests']:>10}  {r['owner']}"
                  for r in regions]
    return "\n".join(lines)


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


SIGNALLED_WAIT_S = 2.0


def signalled_stacks(files: RuntimeFiles) -> dict[str, Any]:
    """The stacks a hung daemon's processes write on SIGUSR1, read from their stacks files."""
    import psutil

    try:
        pid = int(files.pid.read_text())
        supervisor = psutil.Process(pid)
        workers = {child: int(child.cmdline()[0].split()[1].removeprefix("worker"))
                   for child in supervisor.children() if child.cmdline()[0].startswith("inferd: worker")}
    except (OSError, ValueError, IndexError, psutil.Error) as exc:
        raise CliError(f"cannot find the daemon's processes from {files.pid}: {exc}") from None
    targets = {"supervisor": (supervisor, files.stacks),
               **{f"worker{i} (pid {p.pid})": (p, files.worker_stacks(i)) for p, i in workers.items()}}
    sizes = {name: path.stat().st_size if path.exists() else 0 for name, (_, path) in targets.items()}
    for process, _ in targets.values():
        try:
            process.send_signal(signal.SIGUSR1)
        except psutil.AccessDenied:
            raise CliError(f"cannot signal pid {process.pid}: run inferctl as root or as the daemon's user") from None
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + SIGNALLED_WAIT_S
    texts: dict[str, str] = {}
    while time.monotonic() < deadline and len(texts) < len(targets):
        time.sleep(0.05)
        for name, (_, path) in targets.items():
            if name not in texts and path.exists() and path.stat().st_size > sizes[name]:
                with open(path, errors="replace") as written:
                    written.seek(sizes[name])
                    texts[name] = written.read()
    return {"supervisor": texts.get("supervisor", "(no answer)"),
            "workers": {name: texts.get(name, "") for name in targets if name != "supervisor"}}


@inferctl.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema in README).")
@click.option("--watch", type=click.FloatRange(min=0.1), help="Refresh every SECONDS until Ctrl-C.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool, watch: float | None) -> None:
    """Requests, latency, throughput and batches per model; processes, memory and GPUs per worker."""
    if watch is None:
        result = _call(ctx, "stats")
        click.echo(json.dumps(result, indent=2) if as_json else _stats_table(result))
        return
    try:  # until Ctrl-C, wherever it lands: in the wait or in a refresh
        while True:
            result = _call(ctx, "stats")
            click.echo("\033[2J\033[H" + (json.dumps(result, indent=2) if as_json else _stats_table(result)))
            time.sleep(watch)
    except KeyboardInterrupt:
        return


PERCENT = click.FloatRange(0, 100)
MODEL_OPTION = click.option("--model", help="Model name (may be left out when the daemon serves one model).")


@inferctl.command()
@click.option("--version", required=True, help="The version folder to make live (or to try).")
@MODEL_OPTION
@click.option("--allow-signature-change", is_flag=True, help="Accept outputs of another dtype or shape.")
@click.option("--canary", type=PERCENT, help="Try VERSION on this percentage of the model's batches instead.")
@click.option("--shadow", type=PERCENT, help="Compute this percentage of requests again with VERSION, only to "
              "compare; clients get the live version's replies.")
@click.option("--auto-rollback", is_flag=True, help="With --canary: roll it back by itself when it does worse "
              "than the live version (README, \"Canary and shadow\").")
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
@click.pass_context
def rollback(ctx: click.Context, model: str | None) -> None:
    """End the canary or shadow; without one, blue-green back to the version live before the last reload."""
    _switch(ctx, "rollback", model=model)


@inferctl.command()
@click.pass_context
def trim(ctx: click.Context) -> None:
    """Every ready worker returns its GPU allocator's unused cached memory to the device now."""
    asked = _call(ctx, "trim")["workers"]
    click.echo(f"asked {len(asked)} workers to return their unused GPU memory")


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
    except (OSError, ValueError, EOFError) as exc:  # EOFError: an empty or cut-off .npy
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


def main_inferd() -> None:
    """Entry point of `inferd`."""
    run_command(inferd, "inferd")


def main_inferctl() -> None:
    """Entry point of `inferctl`."""
    run_command(inferctl, "inferctl")

