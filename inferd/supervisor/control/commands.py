"""The control commands `inferctl` sends, each a `command_<name>` method.

They read the supervisor's state and start what it already knows how to do; a
command and the signal that means the same run the same code.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import msgspec

from inferd import __version__
from inferd.config.schema import OutputSpec
from inferd.models.repository import MODEL_FILES_SAID, RepositoryError, describe_versions, folders_without_model
from inferd.supervisor.control.control_server import ControlReply, deferred
from inferd.supervisor.control.report import candidate_status, stats_report, worker_summary
from inferd.supervisor.pipelines.graph import Graph
from inferd.supervisor.shared.candidates import Mode
from inferd.supervisor.shared.command_replies import Then
from inferd.supervisor.shared.state import DaemonState

if TYPE_CHECKING:
    from inferd.supervisor.control.view import DaemonView


STACKS_WAIT_S = 0.5


def _own_stacks() -> str:
    """Every thread of this process, as faulthandler would print them."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Commands:
    """The handler object of the ControlServer."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon

    def command_health(self) -> dict[str, Any]:
        """Ready to serve: accepting requests, and every model live on a ready worker (an on-demand one
        loads when a request comes)."""
        if self.daemon.state != DaemonState.SERVING:
            return {"healthy": False, "reason": f"the daemon is {self.daemon.state}"}
        for name, version in self.daemon.live.items():
            if self.daemon.config.models[name].on_demand:
                continue
            if not any(w.serves(name, version) for w in self.daemon.workers.workers):
                return {"healthy": False, "reason": f"no ready worker serves {name} {version}"}
        return {"healthy": True, "reason": "serving"}

    @deferred
    def command_stacks(self, reply: ControlReply) -> None:
        """Thread stacks of the supervisor and of every worker (faulthandler on SIGUSR1), for a hung daemon."""
        asked = []
        for worker in self.daemon.workers.workers:
            if worker.pid is None:
                continue
            worker.stacks_path.write_text("")
            try:
                os.kill(worker.pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            asked.append(worker)
        supervisor = _own_stacks()

        def collect() -> None:
            reply.finish({
                "supervisor": supervisor,
                "workers": {f"{w.name} (pid {w.pid})": w.stacks_path.read_text(errors="replace")
                            for w in asked},
            })

        # faulthandler writes from the workers' signal handlers; give them a moment.
        timer = threading.Timer(STACKS_WAIT_S, lambda: self.daemon.call_soon_threadsafe(collect))
        timer.daemon = True
        timer.start()

    def command_stats(self) -> dict[str, Any]:
        """Requests, latencies, throughput, batch sizes and queues per model; processes, memory, GPUs per worker."""
        return stats_report(self.daemon)

    def command_models(self, on_disk: bool = False, model: str | None = None) -> dict[str, Any]:
        """Each model's live version and where it came from, whether a ready worker serves it, its
        outputs, its config, the daemon's priority levels as they are now (a SIGHUP changes them), each
        version's number (for the protocols whose versions are integers), and per version the counts
        and times the Open Inference Protocol's statistics report (what the gateway asks). With
        `on_disk` (`inferctl models`), also every folder in its repository and whether it can be served.
        With `model`, only that one ({} if it serves none of that name): what a gateway asks per request,
        where listing every model's repository would hold the loop for milliseconds per hundred models."""
        since_epoch = time.time() - time.monotonic()
        load_errors = self.daemon.placement.refusals(time.monotonic())
        configs = self.daemon.config.models
        names = list(self.daemon.live) if model is None else [model] if model in self.daemon.live else []
        all_numbers = self.daemon.version_numbers.of_all({name: configs[name].repository or "" for name in names})
        served: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in names}
        for (name, version), series in self.daemon.stats.since_start.items():
            if name in served:
                served[name][version] = {
                    "requests": dict(series.replies), "samples": series.samples,
                    "total_s": series.total.sum, "queue_s": series.queue.sum,
                    "phases_s": series.phases,
                    "computed": {str(size): sums for size, sums in series.computed.items()},
                    "last_inference_s": since_epoch + series.last_answered if series.last_answered else 0.0,
                }
        result = {}
        for name in names:
            live = self.daemon.live[name]
            outputs = self.daemon.workers.signature(name, live) or ()
            queue = self.daemon.config.queue
            config = configs[name]
            canary = self.daemon.candidates.canary_version(name)
            result[name] = {
                "config": msgspec.to_builtins(config),
                "kind": "python" if name in self.daemon.workers.pools else "tensor",
                "priority_levels": queue.priority_levels, "default_level": queue.default_level,
                "live_version": live,
                "live_from": self.daemon.live.origin(name),
                "canary_version": canary,
                "ready": any(w.serves(name, live) for w in self.daemon.workers.workers),
                "loading": self.daemon.placement.loading(name),
                "load_error": load_errors.get(name),
                "ready_versions": [v for v in (live, canary)
                                   if v is not None and any(w.serves(name, v) for w in self.daemon.workers.workers)],
                "version_numbers": all_numbers[name],
                "outputs": [[spec.dtype, spec.public_shape()] for spec in outputs],
                "versions": served[name],
            }
            if on_disk:
                result[name]["on_disk"] = self._on_disk(config.repository or "")
        graphs = self.daemon.pipelines.graphs
        for name in sorted(graphs) if model is None else [model] if model in graphs else []:
            result[name] = self._pipeline(graphs[name], result)
        return result

    def _pipeline(self, graph: Graph, models: dict[str, Any]) -> dict[str, Any]:
        """A pipeline as `models` answers for a model (what a gateway serves it by): its inputs, its outputs as
        the steps that make them answer them, and its version, its steps' ("decode:v2,resnet:v3,top5:v1")."""
        live, workers = self.daemon.live, self.daemon.workers.workers
        ready = all(any(w.serves(step.model, live[step.model]) for w in workers) for step in graph.steps)
        made = {tensor: (step.model, index) for step in graph.steps for index, tensor in step.makes}
        outputs = []
        for tensor in graph.config.outputs:
            model, index = made[tensor]
            signature = self.daemon.workers.signature(model, live[model]) or ()
            outputs.append([signature[index].dtype, signature[index].public_shape()] if index < len(signature)
                           else None)
        version = ",".join(f"{step.title}:{live[step.model]}" for step in graph.steps)
        config = msgspec.structs.replace(graph.inputs, outputs=tuple(OutputSpec(name=t) for t in graph.config.outputs))
        queue = self.daemon.config.queue
        series = self.daemon.stats.pipeline(graph.name)
        # Its counts since start, under its version as it is now: a pipeline's requests, whichever versions
        # of its steps computed them. Its steps' time in queues and batches is its queue and compute time.
        since_epoch = time.time() - time.monotonic()
        served = {"requests": dict(series.replies), "samples": series.samples, "total_s": series.total.sum,
                  "queue_s": series.queue_s, "phases_s": [0.0, series.compute_s, 0.0], "computed": {},
                  "last_inference_s": since_epoch + series.last_answered if series.last_answered else 0.0}
        return {
            "config": msgspec.to_builtins(config), "kind": "pipeline",
            "priority_levels": queue.priority_levels, "default_level": queue.default_level,
            "live_version": version, "live_from": "its steps", "canary_version": None, "ready": ready,
            "loading": False, "load_error": None, "ready_versions": [version] if ready else [],
            "version_numbers": {}, "outputs": outputs if None not in outputs else [], "versions": {version: served},
        }

    @staticmethod
    def _on_disk(repository: str) -> list[dict[str, Any]] | str:
        """Each folder of a repository: its file, size, format, and why it cannot be served (or None);
        the sentence saying why the repository cannot be read, if it cannot."""
        try:
            found = describe_versions(repository)
            empty = folders_without_model(repository)
        except (RepositoryError, OSError) as exc:
            return str(exc)
        return found + [{"version": folder, "file": None, "size_bytes": 0, "modified": 0.0, "format": None,
                         "made": {}, "problem": f"the folder holds no {MODEL_FILES_SAID}"} for folder in empty]

    def command_status(self) -> dict[str, Any]:
        """The daemon's state, its workers, its gateways and the live version of each model."""
        return {
            "pid": os.getpid(),
            "version": __version__,
            "state": self.daemon.state,
            "uptime_s": round(time.monotonic() - self.daemon.started, 3),
            "listen": list(self.daemon.listening),
            "models": {
                name: {
                    "live_version": version,
                    "live_from": self.daemon.live.origin(name),
                    "config_version": self.daemon.config.models[name].version,
                    "previous_version": self.daemon.live.previous(name),
                    "reloading_to": self.daemon.reloads.active[name].version if name in self.daemon.reloads.active
                    else None,
                    "candidate": candidate_status(self.daemon.candidates.get(name)),
                    "queue_depth": self.daemon.queue.depth(name),
                    "max_batch_size": self.daemon.config.models[name].max_batch_size,
                    "max_wait_ms": self.daemon.config.models[name].max_wait_ms,
                }
                for name, version in self.daemon.live.items()
            },
            "workers": [
                {
                    **worker_summary(w),
                    "loaded": sorted(f"{m} {v}" for m, v in w.loaded),
                    "last_error": w.last_error or None,
                }
                for w in self.daemon.workers.workers
            ],
            "gateways": [
                {"protocol": g.protocol, "name": g.name, "address": g.address,
                 "pid": g.process.pid if g.process else None, "restarts": g.restarts, "given_up": g.given_up,
                 "listening": g.listening}
                for g in self.daemon.gateways
            ],
            "replies": dict(self.daemon.stats.replies),
            "undelivered_replies": self.daemon.stats.undelivered,
        }

    @deferred
    def command_reload(self, reply: ControlReply, version: str, model: str | None = None,
                       allow_signature_change: bool = False, canary: float | None = None,
                       shadow: float | None = None, auto_rollback: bool = False,
                       promote_after_s: float | None = None) -> None:
        """Blue-green: load `version` beside the live one on every worker, then flip; answer when done.
        With `canary` or `shadow` (a percentage) the version is tried instead of made live."""
        name = self._model(model)
        if canary is not None and shadow is not None:
            reply.fail("a version is tried as a canary or as a shadow, not both")
        elif canary is None and shadow is None:
            if auto_rollback or promote_after_s is not None:
                reply.fail("--auto-rollback and --promote-after go with --canary")
                return
            self.daemon.reloads.start(name, version, allow_signature_change, reply)
        else:
            mode, weight = (Mode.CANARY, canary) if canary is not None else (Mode.SHADOW, shadow)
            assert weight is not None
            self.daemon.canaries.start(name, version, mode, weight, auto_rollback, promote_after_s,
                                       allow_signature_change, reply)

    @deferred
    def command_canary(self, reply: ControlReply, weight: float, model: str | None = None) -> None:
        """Move the running canary (or shadow) of a model to `weight` percent."""
        self.daemon.canaries.weigh(self._model(model), weight, reply)

    @deferred
    def command_promote(self, reply: ControlReply, model: str | None = None) -> None:
        """Make the canary (or shadow) of a model live."""
        self.daemon.canaries.promote(self._model(model), reply)

    @deferred
    def command_rollback(self, reply: ControlReply, model: str | None = None, confirm: bool = False) -> None:
        """End the canary or shadow of a model; without one, and with `confirm`, blue-green back to the
        version live before the last reload (without `confirm` a second run of a rollback that ended a
        trial would switch production)."""
        name = self._model(model)
        if name in self.daemon.candidates:
            self.daemon.canaries.end(name, reply)
            return
        previous = self.daemon.live.previous(name)
        if previous is None:
            reply.fail(f"{name} has not been reloaded; there is nothing to roll back to")
            return
        if not confirm:
            reply.fail(f"{name} has no canary or shadow; a rollback would switch it from {self.daemon.live[name]} "
                       f"back to {previous} (blue-green): run it again with --yes to do that")
            return
        self.daemon.reloads.start(name, previous, True, reply)

    @deferred
    def command_load(self, reply: ControlReply, model: str, version: str | None = None) -> None:
        """Load `model` on a worker if none has it (an unknown name reads the config and server.model_root
        again first); with `version`, make that version live first (blue-green where it is loaded)."""
        if model not in self.daemon.live:
            self.daemon.reconfigurer.reconfigure(self.daemon.config)
        name = self._model(model)
        if version is None or version == self.daemon.live[name]:
            self.daemon.placement.load(name, reply)
            return
        self.daemon.reloads.start(name, version, False, Then(reply, lambda: self.daemon.placement.load(name, reply)))

    def command_unload(self, model: str) -> dict[str, Any]:
        """Take on-demand `model` off every worker that has it, if no request of it waits or runs."""
        return self.daemon.placement.unload(self._model(model))

    def command_gateway_listening(self, name: str, pid: int) -> None:
        """A gateway process (`name`, `pid`) says it takes connections: the daemon is ready once all do."""
        for gateway in self.daemon.gateways:
            if gateway.name == name and gateway.process is not None and gateway.process.pid == pid:
                gateway.listening = True

    def command_trim(self) -> dict[str, Any]:
        """Every ready worker returns its GPU allocator's unused memory now, busy or not."""
        return {"workers": self.daemon.workers.trim_memory("inferctl trim")}

    def command_versions(self, model: str | None = None) -> dict[str, Any]:
        """The versions in each repository, with file sizes and dates, and which is live."""
        names = [self._model(model)] if model is not None or len(self.daemon.live) == 1 else sorted(self.daemon.live)
        result = {}
        for name in names:
            try:
                found = describe_versions(self.daemon.config.models[name].repository or "")
            except RepositoryError as exc:
                raise ValueError(str(exc)) from None
            for entry in found:
                entry["live"] = entry["version"] == self.daemon.live[name]
            result[name] = found
        return result

    def _model(self, model: str | None) -> str:
        """The model a command is about: the one named, or the only one served."""
        if model is None:
            if len(self.daemon.live) == 1:
                return next(iter(self.daemon.live))
            raise ValueError(f"this daemon serves several models ({', '.join(sorted(self.daemon.live))}); "
                             "name one with --model")
        pipeline = self.daemon.config.pipelines.get(model)
        if pipeline is not None:
            steps = ", ".join(sorted({step.model for step in pipeline.steps}))
            raise ValueError(f"{model} is a pipeline, which has no versions of its own: reload, load or try versions "
                             f"of the models it runs ({steps}), e.g. inferctl reload --model {pipeline.steps[0].model} "
                             "--version V")
        if model not in self.daemon.live:
            raise ValueError(f"unknown model {model!r}; this daemon serves {', '.join(sorted(self.daemon.live))}")
        return model
