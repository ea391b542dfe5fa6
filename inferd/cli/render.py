"""The daemon's answers to status, stats and the switches, as the lines and tables `inferctl` prints."""

from __future__ import annotations

import time
from typing import Any


def status_table(status: dict[str, Any]) -> str:
    """The status object as the lines `inferctl status` prints: the daemon, its models, workers and gateways."""
    lines = [f"inferd {status['version']}, pid {status['pid']}, {status['state']} "
             f"for {status['uptime_s']:.1f} s, listening on {', '.join(status['listen'])}", "models:"]
    for name, model in status["models"].items():
        candidate = model["candidate"]
        trial = ""
        if candidate is not None:
            trial = f"  {candidate['mode']} {candidate['version']} at {candidate['weight']:g} %"
            trial += ", guarded" if candidate["guarded"] else ""
            if candidate["promote_in_s"] is not None:
                trial += f", promoted in {candidate['promote_in_s']:.0f} s if clean"
        origin = ""
        if model["live_from"] == "saved" and model["config_version"] != model["live_version"]:
            origin = f"  (saved live version; the config says {model['config_version']})"
        lines.append(f"  {name:<20} live {model['live_version']:<12} queued {model['queue_depth']}{trial}{origin}")
    lines.append("workers:")
    for w in status["workers"]:
        line = (f"  {w['name']:<9} pid {w['pid']!s:<8} {w['device']:<8} {w['state']:<9}"
                f" generation {w['generation']}  restarts {w['restarts']}  busy executors {w['executors_busy']}"
                f"  loaded: {', '.join(w['loaded']) or 'nothing'}")
        if w["last_error"]:
            line += f"  last error: {w['last_error']}"
        lines.append(line)
    if status["gateways"]:
        lines.append("gateways:")
    lines += [f"  {g['name']:<8} pid {g['pid']!s:<8} {g['address']:<22} restarts {g['restarts']}"
              for g in status["gateways"]]
    return "\n".join(lines)


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
                         f"{_figure(part['latency_ms']['p50'], 9, part['latency_ms']['count'])}"
                         f"{_figure(part['latency_ms']['p99'], 9, part['latency_ms']['count'])}")
    for name, model in stats["models"].items():
        admission = model["admission"]
        refused = f"{admission['refused_as_late']} refused as sure to miss their deadline"
        if admission["estimate_ms"] is None:
            lines.append(f"admission: no estimate for {name} yet (it has computed nothing); {refused}")
        else:
            lines.append(f"admission: a new request to {name} would finish in {admission['estimate_ms']:.1f} ms at "
                         f"the soonest; {refused}")
    return lines


def _figure(value: float, width: int, count: int, digits: int = 2) -> str:
    """A figure right-aligned in `width`, or "-" when it rests on nothing (`count` is 0)."""
    return f"{'-':>{width}}" if not count else f"{value:>{width}.{digits}f}"


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
            compute, compared = shadow["compute_ms"], shadow["compared"]
            lines.append(f"{name} shadow {version}: {compared} of {shadow['chosen']} compared, {close} "
                         f"allclose, max difference {shadow['max_abs_difference']:.3g} (relative "
                         f"{shadow['max_rel_difference']:.3g}), compute p50 "
                         f"{_figure(compute['shadow']['p50'], 0, compared)} ms against "
                         f"{_figure(compute['live']['p50'], 0, compared)} ms live, {shadow['failed']} failed, "
                         f"{sum(shadow['dropped'].values())} dropped")
    return ["", *lines] if lines else []


def _error_lines(stats: dict[str, Any]) -> list[str]:
    """The replies that were not `ok`, by kind, of each version of each model (since start)."""
    lines = []
    for name, model in stats["models"].items():
        for version, part in model["versions"].items():
            kinds = [f"{n} {status}" for status, n in sorted(part["requests"].items()) if status != "ok" and n]
            if kinds:
                lines.append(f"{name} {version}: {', '.join(kinds)}")
    return ["", "not ok, by kind (since start):", *lines] if lines else []


def _shape_lines(stats: dict[str, Any]) -> list[str]:
    """The batches of each model with inputs of any size, by shape, and the padding they computed (since start):
    elements of padding per element the requests brought, so over 1 where padding outweighs them. That share is
    worked out here from the counts: padding_share, rounded to 4 places, would round twice (1.634996 to 1.635 to
    1.64)."""
    lines = []
    for name, model in stats["models"].items():
        for shape, part in model["shapes"].items():
            share = part["padding_elements"] / part["elements"] if part["elements"] else 0.0
            lines.append(f"{name} shape {shape}: {part['batches']} batch(es), {part['elements']} input elements "
                         f"requested, {part['padding_elements']} of padding ({share:.2f} per element requested)")
    return ["", *lines] if lines else []


def _pipeline_lines(stats: dict[str, Any]) -> list[str]:
    """Each pipeline (since start): its requests, latency and requests under way, then per step its model and its
    requests' queue wait and compute, the model's batch size beside them (the step whose wait grows is the
    bottleneck)."""
    lines = []
    for name, pipeline in stats.get("pipelines", {}).items():
        requests, latency = pipeline["requests"], pipeline["latency_ms"]
        p50, p99 = _figure(latency["p50"], 0, latency["count"]), _figure(latency["p99"], 0, latency["count"])
        lines += ["", f"pipeline {name}: {sum(requests.values())} requests, {requests.get('ok', 0)} ok, p50 {p50} ms, "
                      f"p99 {p99} ms; {pipeline['in_flight']} in flight (at most {pipeline['max_in_flight']})",
                  f"  {'step':<14}{'model':<14}{'wait p50':>9}{'wait p99':>9}{'compute p50':>12}{'compute p99':>12}"
                  f"{'batch':>7}"]
        for step, part in pipeline["steps"].items():
            wait, compute = part["wait_ms"], part["compute_ms"]
            model = stats["models"].get(part["model"], {})
            batches = sum(model.get("batch_size", {}).get("distribution", {}).values())
            lines.append(f"  {step:<14}{part['model']:<14}{_figure(wait['p50'], 9, wait['count'])}"
                         f"{_figure(wait['p99'], 9, wait['count'])}{_figure(compute['p50'], 12, compute['count'])}"
                         f"{_figure(compute['p99'], 12, compute['count'])}"
                         f"{_figure(model.get('batch_size', {}).get('mean', 0), 7, batches, 1)}")
    return lines


def stats_table(stats: dict[str, Any]) -> str:
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
            # The latencies are of the last minute, the batch sizes since start: each "-" where there is none.
            total, queue, compute = latency["total"], latency["queue"], latency["compute"]
            batches = sum(part["batch_size"]["distribution"].values())
            lines.append(
                f"{(name if version == 'all' else ''):<14}{version + ('*' if live else ''):<10}{requests:>9}"
                f"{requests - part['requests'].get('ok', 0):>8}{part['samples']:>9}"
                f"{_figure(total['p50'], 9, total['count'])}{_figure(total['p99'], 9, total['count'])}"
                f"{_figure(queue['p99'], 10, queue['count'])}{_figure(compute['p99'], 12, compute['count'])}"
                f"{part['throughput']['samples_per_s_10s']:>10.1f}{part['goodput']['requests_per_s_10s']:>10.1f}"
                f"{_figure(part['batch_size']['mean'], 7, batches, 1)}"
                + (f"{model['queue_depth']:>7}{part['queue_depth_peak_60s']:>6}" if version == "all" else "")
            )
    lines += _pipeline_lines(stats)
    lines += _scheduling_lines(stats)
    lines += _error_lines(stats)
    lines += _shape_lines(stats)
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
        lines.append(f"{w['name']:<8}{w['pid']!s:>8}  {w['device']:<8}{w['state']:<10}"
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


def switch_outcome(result: dict[str, Any]) -> str:
    """The last line of a switch: what is live, or what is tried, now."""
    name = result["model"]
    if result.get("already_live"):
        return f"{name} {result['version']} is already live; nothing to do"
    if "loaded" in result:
        where = ", ".join(f"worker{index}" for index in result["workers"])
        if result["loaded"]:
            return f"{name} {result['version']} loaded on {where} in {result['load_s']:.2f} s"
        return f"{name} {result['version']} was loaded already, on {where}"
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


def models_text(models: dict[str, Any], listen: list[str]) -> str:
    """What `inferctl models` prints: each model's contract, its versions on disk, and a request to try."""
    endpoint = next((e.replace("0.0.0.0", "127.0.0.1") for e in listen), "tcp://127.0.0.1:5555")
    lines: list[str] = []
    for name, model in models.items():
        config = model["config"]
        origin = {"config": "the config", "saved": "the saved live version", "reload": "a reload"}[model["live_from"]]
        lines.append(f"{name}: live {model['live_version']} (from {origin}; the config says {config['version']!r})")
        for index, spec in enumerate(config["inputs"]):
            label = spec["name"] or f"INPUT__{index}"
            bound = f" (-1: any size, up to max_shape {spec['max_shape']})" if spec.get("max_shape") else ""
            lines.append(f"  input  {label:<16} {_per_sample(spec['dtype'], spec['shape'])}{bound}")
        names = [o["name"] for o in config["outputs"]]
        for index, (dtype, shape) in enumerate(model["outputs"]):
            label = (names[index] if index < len(names) else None) or f"OUTPUT__{index}"
            lines.append(f"  output {label:<16} {_per_sample(dtype, shape)}")
        wait = config["max_wait_ms"]
        window = "until an executor is about to be free" if wait == "auto" else f"up to {wait:g} ms"
        lines.append(f"  batches of up to {config['max_batch_size']} samples; a partial batch waits {window} "
                     "(max_wait_ms)")
        lines.append(f"  versions in {config['repository']}:")
        on_disk = model["on_disk"]
        if isinstance(on_disk, str):
            lines.append(f"    cannot list them: {on_disk}")
        lines += [version_line(entry, entry["version"] == model["live_version"])
                  for entry in (on_disk if isinstance(on_disk, list) else [])]
        lines.append("  try it:")
        lines += [f"    {line}" for line in _example(name, config["inputs"], endpoint)]
    return "\n".join(lines)


def version_line(entry: dict[str, Any], live: bool, modified: bool = False) -> str:
    """One version on disk: its file, format, size (and with `modified` its date), how it was made (the device
    an AOTInductor package was compiled for, the torch that exported a program), whether it is live; or why
    it cannot be served."""
    if entry["problem"]:
        what = f"cannot be served: {entry['problem']}"
    else:
        stamp = time.strftime("  %Y-%m-%d %H:%M:%S", time.localtime(entry["modified"])) if modified else ""
        made = entry.get("made", {})
        how = f"  compiled for {made['device']}" if made.get("device") else \
            f"  exported by torch {made['torch_version']}" if made.get("torch_version") else ""
        what = (f"{entry['format']:<12} {entry['size_bytes'] / 2**20:8.2f} MiB{stamp}{how}"
                f"{'  (live)' if live else ''}")
    return f"  {'*' if live else ' '} {entry['version']:<14} {entry['file'] or '-':<10} {what}"


def versions_text(result: dict[str, list[dict[str, Any]]]) -> str:
    """What `inferctl versions` prints: each model's versions on disk."""
    lines: list[str] = []
    for name, found in result.items():
        lines.append(f"{name}:")
        lines += [version_line(entry, entry["live"], modified=True) for entry in found]
    return "\n".join(lines)


def _per_sample(dtype: str, shape: list[int]) -> str:
    return f"{dtype} [{', '.join(['N', *map(str, shape)])}]"


def _example_shape(spec: dict[str, Any]) -> tuple[int, ...]:
    """One sample's shape, batch dim first: a -1 dim at 8, or at its bound where that is less."""
    bound = spec.get("max_shape") or spec["shape"]
    return (1, *(min(8, most) if dim == -1 else dim for dim, most in zip(spec["shape"], bound)))


def _example(name: str, inputs: list[dict[str, Any]], endpoint: str) -> list[str]:
    """Commands that send `name` one sample of zeros: with inferctl (.npy files), and with the Python client."""
    shapes = [_example_shape(spec) for spec in inputs]
    zeros = [f"np.zeros({shape}, {spec['dtype']!r})" for spec, shape in zip(inputs, shapes)]
    if any(spec["dtype"] == "bfloat16" for spec in inputs):  # numpy has no bfloat16: torch makes the tensor
        zeros = [f"torch.zeros({shape}, dtype=torch.{spec['dtype']})" for spec, shape in zip(inputs, shapes)]
        return [f"python -c \"import torch; from inferd.client import Client; "
                f"print(Client('{endpoint}').infer('{name}', [{', '.join(zeros)}]))\""]
    files = [f"{name}-input{index}.npy" for index in range(len(inputs))]
    saves = "; ".join(f"np.save('{file}', {array})" for file, array in zip(files, zeros))
    return [f"python -c \"import numpy as np; {saves}\"",
            f"inferctl infer --model {name} {' '.join(f'--input {file}' for file in files)}",
            f"python -c \"import numpy as np; from inferd.client import Client; "
            f"print(Client('{endpoint}').infer('{name}', [{', '.join(zeros)}]))\""]
