"""The thin unit layer, without processes: the slot layout, the dispatcher's stacking and reply
slicing, a child process's restart backoff, the worker table's restarts, the reload manager's
state machine, the executor.

Workers here are sockets in this process that speak the worker's side of the messages; only
spawning is left out (WorkerTable.spawn is what the end-to-end tests exercise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket as stdlib_socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import models
import msgspec
import numpy as np
import pytest
import torch
import zmq
from conftest import wait_for

from inferd import config as config_module
from inferd import protocol
from inferd.ipc import addresses, messages
from inferd.ipc.arena import Arena, arena_name, new_instance
from inferd.ipc.slots import batch_bytes, place, slot_shortfall
from inferd.models.repository import NUMBERS_FILE, SavedVersions, VersionNumbers, config_name
from inferd.supervisor.dispatch.compute_times import ComputeTimes
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.dispatch.replies import Replies, ReplyTo
from inferd.supervisor.intake.connections import close_accepted, is_at
from inferd.supervisor.intake.receive_limits import receive_mark
from inferd.supervisor.processes.children import MAX_BACKOFF_S, ChildProcess
from inferd.supervisor.processes.workers import ExecutorHandle, WorkerState, WorkerTable
from inferd.supervisor.queueing.queue import QueuedRequest
from inferd.supervisor.shared.candidates import Candidate, Candidates, Mode
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.stats import Stats
from inferd.supervisor.versions.reload import ReloadManager
from inferd.system.paths import RuntimeFiles
from inferd.system.systemd import Systemd
from inferd.worker.executor import Executor, Overlap, arena_tensor, is_out_of_memory, is_sticky_cuda_error
from inferd.worker.exits import WorkerExit
from inferd.worker.main import IdleTrim
from inferd.worker.runner import ModelError, ModelRunner

SIGNATURE = (messages.TensorSpec("float32", (models.MLP_OUT,)),)


def config_for(repo: Path, workdir: Path, **workers: Any) -> config_module.Config:
    return config_module.parse({
        "server": {"control": f"ipc://{workdir}/control.sock", "state_dir": str(workdir / "state"), "metrics": ""},
        "workers": {"devices": ["cpu", "cpu"], "shm_mb": 1, **workers},
        "models": {"mlp": {"repository": str(repo / "mlp"), "inputs": [{"dtype": "float32", "shape": [16]}],
                           "max_batch_size": 8, "version": "v1"}},
    })


# -- the slot layout ----------------------------------------------------------------


def test_tensors_are_laid_one_after_the_other_each_aligned():
    offsets, end = place(4096, [10, 64, 1])
    assert offsets == [4096, 4160, 4224] and end == 4225


def test_a_full_batch_is_sized_inputs_then_outputs():
    model = config_module.parse({"models": {"m": {"inputs": [{"dtype": "float32", "shape": [3]},
                                                             {"dtype": "int64", "shape": [2]}],
                                                  "max_batch_size": 5}}}).models["m"]
    outputs = (messages.TensorSpec("float16", (7,)),)
    # 5 x 12 bytes, aligned to 64, then 5 x 16, aligned to 192, then 5 x 14.
    assert batch_bytes(model, outputs, 5) == 192 + 70
    assert slot_shortfall("m", model, outputs, 262) is None
    assert "needs 0.0 MiB of arena slot but a slot has 0.0 MiB" in slot_shortfall("m", model, outputs, 261)


# -- a table of workers that are sockets of this process ----------------------------


class FakeWorker:
    """The worker side of one WorkerHandle: its control socket and one executor socket."""

    def __init__(self, context: zmq.Context, endpoint: str, index: int) -> None:
        self.control = context.socket(zmq.DEALER)
        self.executor = context.socket(zmq.DEALER)
        for socket, role in ((self.control, None), (self.executor, 0)):
            socket.linger = 0
            socket.connect(endpoint)
            socket.send(messages.encode(messages.Hello(index, 1, role)))

    def ready(self, versions: dict[str, str]) -> None:
        loaded = {m: messages.LoadedModel(v, SIGNATURE) for m, v in versions.items()}
        self.control.send(messages.encode(messages.Ready(pid=1, device="cpu", models=loaded)))

    def received(self, socket: zmq.Socket) -> messages.Message:
        assert socket.poll(5000), "the supervisor sent nothing"
        return messages.decode(socket.recv())

    def close(self) -> None:
        self.control.close()
        self.executor.close()


class Table:
    """A WorkerTable with its arenas and backend socket, whose workers are FakeWorkers."""

    def __init__(self, config: config_module.Config, workdir: Path) -> None:
        self.context = zmq.Context()
        self.live = LiveVersions({"mlp": "v1"}, {})
        self.table = WorkerTable(config, self.context, ["cpu", "cpu"], RuntimeFiles(config.server.control or "",
                                                                                    new_instance()), self.live)
        self.table.open(new_instance())
        self.fakes: list[FakeWorker] = []

    def boot(self, index: int) -> FakeWorker:
        """Bring worker `index` up as a spawn would, minus the process."""
        worker = self.table.workers[index]
        worker.generation, worker.state = 1, WorkerState.BOOTING
        worker.executors = [ExecutorHandle(worker, 0)]
        fake = FakeWorker(self.context, self.table.endpoint, index)
        self.fakes.append(fake)
        wait_for(lambda: self.pump() or (worker.control is not None and worker.executors[0].identity is not None),
                 what="the hello")
        fake.ready(dict(self.live))
        wait_for(lambda: self.pump() or worker.state == WorkerState.READY, what="ready")
        return fake

    def pump(self) -> list[messages.Message]:
        """Hand what the fake workers sent to the table, as the loop does; return the rest."""
        rest = []
        while self.table.backend.poll(0):
            identity, payload = self.table.backend.recv_multipart()
            message = messages.decode(payload)
            if self.table.on_message(identity, message) is None and not isinstance(message, messages.Hello):
                rest.append(message)
        return rest

    def close(self) -> None:
        for fake in self.fakes:
            fake.close()
        self.table.close()
        self.context.term()


@pytest.fixture
def table(reload_repo: Path, workdir: Path) -> Iterator[Table]:
    made = Table(config_for(reload_repo, workdir), workdir)
    yield made
    made.close()


class Process:
    """What WorkerTable.reap reads of a process that has exited."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode
        self.pid = 1
        self.sentinel = -1

    def join(self, timeout: float | None = None) -> None:
        pass


def die(table: WorkerTable, index: int, now: float, code: int = -signal.SIGKILL) -> str:
    worker = table.workers[index]
    worker.process = Process(code)  # type: ignore[assignment]
    return table.reap(worker, now, retry=True)


# -- child processes ----------------------------------------------------------------


def test_a_child_restarts_at_once_then_with_doubling_backoff_up_to_the_cap_then_is_given_up():
    child = ChildProcess()
    delays = [child.crashed(float(now), max_restarts=10) for now in range(11)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S, None]
    assert child.restarts == 10 and child.respawn_at == 9.0 + MAX_BACKOFF_S


# -- the worker table ---------------------------------------------------------------


def test_a_dying_worker_restarts_at_once_then_with_doubling_backoff_then_is_given_up(table):
    workers = table.table
    worker = workers.workers[0]
    delays = []
    for now in (100.0, 101.0, 102.0, 103.0, 104.0):
        reason = die(workers, 0, now)
        assert "killed by signal 9 (SIGKILL) (perhaps out of memory?)" in reason
        delays.append(round(worker.respawn_at - now, 3))
        assert worker.state == WorkerState.DEAD
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0]
    die(workers, 0, 105.0)  # the sixth death within a minute: more than max_restarts (5)
    assert worker.state == WorkerState.FAILED and worker.restarts == 5


def test_deaths_older_than_the_window_no_longer_count(table):
    worker = table.table.workers[0]
    for now in (0.0, 1.0, 2.0):
        die(table.table, 0, now)
    die(table.table, 0, 200.0)
    assert worker.respawn_at == 200.0, "the first death in a new minute restarts at once"


def test_a_worker_that_cannot_load_its_models_is_given_up_not_restarted(table):
    reason = die(table.table, 0, 10.0, WorkerExit.BOOT_ERROR)
    assert "it could not load its models" in reason
    assert table.table.workers[0].state == WorkerState.FAILED


def test_a_replaced_worker_restarts_at_once_and_its_death_is_not_a_crash(table):
    table.boot(0)
    worker = table.table.workers[0]
    table.table.replace(worker, "worker0 did not load mlp v9 within workers.load_timeout_s (1 s)")
    assert worker.state == WorkerState.REPLACING and not worker.serves("mlp", "v1")
    reason = die(table.table, 0, 50.0)
    assert worker.state == WorkerState.DEAD and worker.respawn_at == 50.0 and not worker.deaths
    assert "did not load mlp v9" in reason


def test_a_worker_whose_full_batch_does_not_fit_a_slot_cannot_serve(reload_repo, workdir):
    # 1 MiB arena over 4 slots: 256 KiB each; 8 samples of 64 KiB outputs need 512 KiB.
    made = Table(config_for(reload_repo, workdir), workdir)
    try:
        worker = made.table.workers[0]
        problem = made.table.version_loaded(worker, "mlp", messages.LoadedModel("huge", (
            messages.TensorSpec("float32", (16384,)),)))
        assert problem is not None and "raise workers.shm_mb" in problem
        assert ("mlp", "huge") not in worker.loaded
    finally:
        made.close()


# -- the dispatcher -------------------------------------------------------------------


class Clients:
    """A ROUTER the dispatcher answers on and a DEALER that reads the replies."""

    def __init__(self, context: zmq.Context) -> None:
        self.router = context.socket(zmq.ROUTER)
        self.router.bind("inproc://clients")
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, b"client")
        self.dealer.connect("inproc://clients")

    def request(self, rid: int, x: np.ndarray, version: str | None = None, deadline: float = 1e12) -> QueuedRequest:
        header = protocol.RequestHeader(id=rid, model="mlp", inputs=(protocol.TensorMeta("float32", x.shape),),
                                        version=version)
        return QueuedRequest(header, [x.tobytes()], ReplyTo(self.router, [b"client"]), "c", x.shape[0], x.nbytes,
                             0.0, deadline)

    def reply(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        assert self.dealer.poll(5000)
        header, outputs = protocol.decode_reply(self.dealer.recv_multipart())
        return msgspec_dict(header), outputs

    def close(self) -> None:
        self.router.close()
        self.dealer.close()


def msgspec_dict(header: protocol.ReplyHeader) -> dict[str, Any]:
    return msgspec.to_builtins(header)


@pytest.fixture
def wired(table: Table) -> Iterator[tuple[FakeWorker, Clients, Dispatcher]]:
    """Worker 0 up, clients to answer, and the dispatcher between them."""
    fake = table.boot(0)
    clients = Clients(table.context)
    stats = Stats(0.0)
    candidates = Candidates()
    yield fake, clients, Dispatcher(table.table.config, table.table, Replies(stats, table.live), table.live,
                                    candidates, stats, ComputeTimes())
    clients.close()


def test_the_dispatcher_stacks_requests_where_the_layout_says_and_slices_each_reply(table, wired):
    fake, clients, dispatcher = wired
    xs = [np.full((n, 16), float(k), dtype=np.float32) for k, n in enumerate((1, 3, 2))]
    dispatcher.dispatch("mlp", [clients.request(k, x) for k, x in enumerate(xs)])
    run = fake.received(fake.executor)
    assert isinstance(run, messages.RunBatch) and run.samples == (1, 3, 2)
    worker = table.table.workers[0]
    assert run.slot_offset == worker.slots.offset(0) and run.slot_size == worker.slots.slot_size
    (ref,) = run.inputs
    assert ref.offset == run.slot_offset and ref.shape == (6, 16)
    stacked = np.ndarray((6, 16), np.float32, buffer=worker.arena.buf, offset=ref.offset)
    np.testing.assert_array_equal(stacked, np.concatenate(xs))
    # The worker's answer: an output of 4 per sample, right after the inputs, request 1 expired.
    out_at = place(run.slot_offset, [6 * 16 * 4])[1]
    out_at = place(out_at, [0])[0][0]
    rows = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)  # the rows of requests 0 and 2
    np.ndarray((3, 4), np.float32, buffer=worker.arena.buf, offset=out_at)[:] = rows
    done = messages.BatchDone(run.batch_id, (messages.TensorRef("float32", (3, 4), out_at),), 10, 0, 0, 0, (1,))
    dispatcher.on_result(worker.executors[0], done)
    replies = {h["id"]: (h, o) for h, o in (clients.reply() for _ in range(3))}
    np.testing.assert_array_equal(replies[0][1][0], rows[:1])
    np.testing.assert_array_equal(replies[2][1][0], rows[1:])
    assert replies[1][0]["status"] == "timeout" and replies[1][0]["version"] == "v1"
    assert worker.slots.free == worker.slots.count and worker.batches == 1


def test_a_batch_whose_executor_is_gone_before_the_loop_knows_goes_back_to_the_queue_unanswered(table, wired):
    fake, clients, dispatcher = wired
    worker = table.table.workers[0]
    identity = worker.executors[0].identity
    fake.executor.close()  # its process died; the loop has not read its exit yet
    wait_for(lambda: not table.table.send(identity, messages.Ping(0.0)), what="ZeroMQ to see the executor go")
    requests = [clients.request(k, np.ones((1, 16), dtype=np.float32)) for k in range(2)]
    assert dispatcher.dispatch("mlp", list(requests)) == requests, "back to the queue"
    assert worker.executors[0].identity is None, "no batch goes there again"
    assert worker.slots.free == worker.slots.count and not dispatcher.inflight
    assert not clients.dealer.poll(200), "nothing was answered: the requests wait for another executor"


def test_requests_naming_a_version_that_was_replaced_are_refused_not_computed(wired):
    fake, clients, dispatcher = wired
    x = np.ones((1, 16), dtype=np.float32)
    dispatcher.dispatch("mlp", [clients.request(1, x, version="v0"), clients.request(2, x)])
    header, _ = clients.reply()
    assert header["id"] == 1 and header["status"] == "unavailable"
    assert "version 'v0' of mlp was replaced by 'v1' while the request waited" in header["error"]
    assert fake.received(fake.executor).samples == (1,), "only the other request is computed"


def test_during_a_canary_named_versions_keep_theirs_and_wait_when_their_executors_are_busy(table, wired):
    fake, clients, dispatcher = wired
    worker = table.table.workers[0]
    assert table.table.version_loaded(worker, "mlp", messages.LoadedModel("v2", SIGNATURE)) is None
    dispatcher.candidates.set("mlp", Candidate("v2", Mode.CANARY, 100.0, False, None, 0.0))
    x = np.ones((1, 16), dtype=np.float32)
    assert dispatcher.dispatch("mlp", [clients.request(1, x, version="v1")]) == []
    assert fake.received(fake.executor).version == "v1", "a request naming the live version keeps it"
    # The one executor has room for one more batch: the free request takes it, to the canary (weight
    # 100); the request naming v1 cannot share that batch, and waits for the executor.
    left = dispatcher.dispatch("mlp", [clients.request(2, x), clients.request(3, x, version="v1")])
    run = fake.received(fake.executor)
    assert (run.version, run.samples) == ("v2", (1,))
    assert [r.header.id for r in left] == [3]
    assert dispatcher.split_share("mlp") == 1.0


# -- the reload manager -------------------------------------------------------------


class Reply:
    """Collects what a reload says."""

    def __init__(self) -> None:
        self.progress_lines: list[str] = []
        self.result: Any = None
        self.error: str | None = None

    def progress(self, text: str, wait_s: float | None = None) -> None:
        self.progress_lines.append(text)

    def finish(self, result: Any) -> None:
        self.result = result

    def fail(self, error: str) -> None:
        self.error = error


def reload_manager(table: Table, workdir: Path) -> ReloadManager:
    stats = Stats(0.0)
    candidates = Candidates()
    dispatcher = Dispatcher(table.table.config, table.table, None, table.live, candidates,  # type: ignore[arg-type]
                            stats, ComputeTimes())
    return ReloadManager(table.table.config, table.table, dispatcher, table.live, candidates,
                         SavedVersions(workdir / "state", config_name(table.table.config.source)), Systemd(),
                         lambda callback: callback())


def loaded(version: str) -> messages.VersionLoaded:
    return messages.VersionLoaded("mlp", messages.LoadedModel(version, SIGNATURE), 0.1, 0.2)


def test_a_reload_flips_once_every_worker_has_the_version_and_retires_the_old_one(table, workdir):
    fakes = [table.boot(0), table.boot(1)]
    reloads = reload_manager(table, workdir)
    reply = Reply()
    reloads.start("mlp", "v2", False, reply)
    assert all(isinstance(f.received(f.control), messages.LoadVersion) for f in fakes)
    reloads.on_message(table.table.workers[0], loaded("v2"))
    assert table.live["mlp"] == "v1", "no flip while a worker still loads"
    reloads.on_message(table.table.workers[1], loaded("v2"))
    assert table.live["mlp"] == "v2" and table.live.previous("mlp") == "v1"
    reloads.close()
    assert reply.result["version"] == "v2" and reply.error is None
    for fake, worker in zip(fakes, table.table.workers):
        assert fake.received(fake.control) == messages.UnloadVersion("mlp", "v1")
        assert set(worker.loaded) == {("mlp", "v2")}


def test_one_refusal_abandons_the_reload_and_frees_what_others_loaded(table, workdir):
    fakes = [table.boot(0), table.boot(1)]
    reloads = reload_manager(table, workdir)
    reply = Reply()
    reloads.start("mlp", "v2", False, reply)
    reloads.on_message(table.table.workers[0], loaded("v2"))
    reloads.on_message(table.table.workers[1], messages.VersionFailed("mlp", "v2", "bad weights"))
    assert table.live["mlp"] == "v1"
    assert reply.error == "v2 was not made live: worker1 refused mlp v2: bad weights; v1 keeps serving"
    fakes[0].received(fakes[0].control)  # the load
    assert fakes[0].received(fakes[0].control) == messages.UnloadVersion("mlp", "v2")


def test_no_flip_while_a_ready_worker_lacks_the_version(table, workdir):
    first = table.boot(0)
    reloads = reload_manager(table, workdir)
    reply = Reply()
    reloads.start("mlp", "v2", False, reply)
    second = table.boot(1)  # came up during the reload, with v1
    reloads.on_message(table.table.workers[0], loaded("v2"))
    assert table.live["mlp"] == "v1", "worker1 is ready and lacks v2"
    assert isinstance(second.received(second.control), messages.LoadVersion)
    reloads.on_message(table.table.workers[1], loaded("v2"))
    assert table.live["mlp"] == "v2"
    assert isinstance(first.received(first.control), messages.LoadVersion)


def test_a_load_past_the_timeout_abandons_the_reload_and_replaces_one_worker_at_a_time(reload_repo, workdir):
    made = Table(config_for(reload_repo, workdir, load_timeout_s=5), workdir)
    try:
        made.boot(0)
        made.boot(1)
        reloads = reload_manager(made, workdir)
        reply = Reply()
        reloads.start("mlp", "v2", False, reply)
        reloads.check_loads(time.monotonic() + 1)
        assert reply.error is None
        reloads.check_loads(time.monotonic() + 6)
        assert "did not load mlp v2 within workers.load_timeout_s (5 s)" in reply.error
        states = [w.state for w in made.table.workers]
        assert states == [WorkerState.REPLACING, WorkerState.READY], "the other serves on meanwhile"
        reloads.check_loads(time.monotonic() + 7)
        assert made.table.workers[1].state == WorkerState.READY, "one at a time"
    finally:
        made.close()


def test_a_worker_dying_during_a_reload_ends_it_with_a_sentence(table, workdir):
    table.boot(0)
    table.boot(1)
    reloads = reload_manager(table, workdir)
    reply = Reply()
    reloads.start("mlp", "v2", False, reply)
    reloads.on_message(table.table.workers[0], loaded("v2"))
    reloads.on_worker_exit(table.table.workers[1])
    assert reply.error == "v2 was not made live: worker1 died while loading v2; v1 keeps serving"
    assert table.live["mlp"] == "v1"


# -- the executor ----------------------------------------------------------------------


@pytest.fixture
def executor(repo: Path, workdir: Path) -> Iterator[Executor]:
    arena = Arena.create(arena_name(new_instance(), 0), 1 << 20)
    context = zmq.Context()
    runner = ModelRunner(torch.device("cpu"))
    model = config_module.parse({"models": {"oom": {"repository": str(repo / "oom"),
                                                    "inputs": [{"dtype": "float32", "shape": [2]}],
                                                    "max_batch_size": 4, "warmup_batch_sizes": [1]}}}).models["oom"]
    runner.load("oom", model, "v1")
    # Its socket connects to a supervisor that is not there: run_batch is called directly.
    made = Executor(0, context, f"ipc://{workdir}/nobody", messages.Hello(0, 1, 0), arena, runner, -1, Overlap())
    yield made
    made.socket.close()
    context.term()
    arena.close()
    arena.unlink()


def batch(executor: Executor, rows: list[list[float]], deadlines: tuple[float, ...],
          model: str = "oom") -> messages.RunBatch:
    x = np.array(rows, dtype=np.float32)
    executor.arena.buf[: x.nbytes] = x.tobytes()
    return messages.RunBatch(7, model, "v1", 0, 1 << 19, (messages.TensorRef("float32", x.shape, 0),),
                             tuple(1 for _ in rows), deadlines)


def outputs_of(executor: Executor, done: messages.BatchDone | messages.BatchFailed) -> list[np.ndarray]:
    assert isinstance(done, messages.BatchDone), done
    return [np.ndarray(ref.shape, np.float32, buffer=executor.arena.buf, offset=ref.offset).copy()
            for ref in done.outputs]


# -- CUDA graphs, their CPU side ---------------------------------------------------------------------------


class ReplayEagerly:
    """Stands in for CudaCapture where there is no GPU: its "replay" runs the forward again on the static
    inputs and writes the static outputs, as a graph's replay does. The rest of the graph path (a graph per
    executor and bucket, static buffers fed from the arena, the padding, the outputs cut back) is the code a
    GPU runs."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, ...]] = []
        self.replayed: list[torch.Tensor] = []  # the static input of each replay, as it was

    def __call__(self, forward: Any, inputs: list[torch.Tensor]) -> tuple[Any, tuple[torch.Tensor, ...]]:
        self.captured.append(tuple(inputs[0].shape))
        outputs = forward(inputs)

        def replay() -> None:
            self.replayed.append(inputs[0].clone())
            with torch.inference_mode():
                for static, fresh in zip(outputs, forward(inputs)):
                    static.copy_(fresh)
        return replay, outputs


@pytest.fixture
def graphed(repo: Path, workdir: Path) -> Iterator[tuple[list[Executor], list[ReplayEagerly]]]:
    """Two executors of one worker serving SeesBatch with cuda_graphs at batch buckets 4 and 8."""
    arena = Arena.create(arena_name(new_instance(), 0), 1 << 20)
    context = zmq.Context()
    captures: list[ReplayEagerly] = []

    def new_capture(device: torch.device) -> ReplayEagerly:
        captures.append(ReplayEagerly())
        return captures[-1]

    runner = ModelRunner(torch.device("cpu"), 2, capture=new_capture)
    model = config_module.parse({"models": {"seesbatch": {
        "repository": str(repo / "seesbatch"), "inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 12,
        "warmup_batch_sizes": [1, 12], "batch_buckets": [4, 8], "cuda_graphs": True}}}).models["seesbatch"]
    runner.load("seesbatch", model, "v1")
    made = [Executor(index, context, f"ipc://{workdir}/nobody", messages.Hello(0, 1, 0), arena, runner, -1, Overlap())
            for index in range(2)]
    yield made, captures
    for executor in made:
        executor.socket.close()
    context.term()
    arena.close()
    arena.unlink()


def test_each_executor_replays_its_own_graph_of_the_batch_bucket_and_larger_batches_run_without(graphed):
    (first, second), (mine, theirs) = graphed
    assert mine.captured == theirs.captured == [(4, 2), (8, 2)], "each executor captured each bucket"
    rng = np.random.default_rng(3)
    for samples, bucket in ((1, 4), (3, 4), (4, 4), (5, 8), (8, 8)):
        x = rng.standard_normal((samples, 2)).astype(np.float32)
        replays = len(mine.replayed)
        doubled, seen = outputs_of(first, first.run_batch(batch(first, x.tolist(), (1e12,) * samples, "seesbatch")))
        np.testing.assert_array_equal(doubled, x * 2)
        assert seen.shape == (samples, 1) and set(seen.ravel()) == {bucket}, (samples, seen)
        assert len(mine.replayed) == replays + 1 and tuple(mine.replayed[-1].shape) == (bucket, 2)
    assert not theirs.replayed, "executor 1's graphs are its own"
    second.run_batch(batch(second, [[1, 2]], (1e12,), "seesbatch"))
    assert len(theirs.replayed) == 1
    replays = len(mine.replayed)
    x = rng.standard_normal((10, 2)).astype(np.float32)
    doubled, seen = outputs_of(first, first.run_batch(batch(first, x.tolist(), (1e12,) * 10, "seesbatch")))
    np.testing.assert_array_equal(doubled, x * 2)
    assert set(seen.ravel()) == {10} and len(mine.replayed) == replays, "above the largest bucket: no graph"


def test_a_graph_pads_a_batch_with_its_own_last_sample_never_with_an_earlier_batch_s_rows(graphed):
    (first, _), (mine, _) = graphed
    first.run_batch(batch(first, [[1, 1], [2, 2], [3, 3], [4, 4]], (1e12,) * 4, "seesbatch"))
    now = time.monotonic()
    done = first.run_batch(batch(first, [[5, 5], [6, 6], [7, 7]], (now + 60, now - 1, now + 60), "seesbatch"))
    assert isinstance(done, messages.BatchDone) and done.expired == (1,)
    doubled, seen = outputs_of(first, done)
    np.testing.assert_array_equal(doubled, [[10, 10], [14, 14]])
    assert set(seen.ravel()) == {4}
    assert mine.replayed[-1].tolist() == [[5, 5], [7, 7], [7, 7], [7, 7]]


def test_cuda_graphs_need_batch_buckets():
    with pytest.raises(config_module.ConfigError, match=r"models.m.cuda_graphs: needs batch_buckets, the batch "
                                                        r"sizes a graph is captured at"):
        config_module.parse({"models": {"m": {"repository": "/nowhere", "inputs": [{"dtype": "float32",
                                                                                    "shape": [2]}],
                                              "cuda_graphs": True}}})


def test_a_bfloat16_arena_tensor_is_a_view_of_the_arena_not_a_copy():
    arena = Arena.create(arena_name(new_instance(), 0), 1 << 16)
    try:
        x = np.array([[1.5, -2.0], [0.25, 3.0]], dtype=np.float32).astype(ml_dtypes.bfloat16)
        arena.buf[128:128 + x.nbytes] = x.tobytes()
        tensor = arena_tensor(arena, "bfloat16", (2, 2), 128)
        assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == arena.address() + 128
        assert tensor.tolist() == [[1.5, -2.0], [0.25, 3.0]]
        tensor[1, 1] = -8.0
        assert np.frombuffer(arena.buf, ml_dtypes.bfloat16, 4, 128)[3] == -8.0, "a write lands in the arena"
        del tensor
    finally:
        arena.close()
        arena.unlink()


@pytest.mark.parametrize("offset, refused", [(0.0, False), (0.5, True)])
def test_a_canary_compares_a_bfloat16_output_with_its_float32_expectation(tmp_path, offset, refused):
    models.save_script(models.ToBfloat16, tmp_path, "half", "v1", 0)
    x = np.array([[1.0, -2.5], [0.5, 4.0]], dtype=np.float32)  # x * 3 is exact in bfloat16
    np.save(tmp_path / "half" / "v1" / "example_input.npy", x)
    np.save(tmp_path / "half" / "v1" / "expected_output.npy", x * 3 + offset)
    model = config_module.parse({"models": {"half": {"repository": str(tmp_path / "half"), "max_batch_size": 2,
                                                     "inputs": [{"dtype": "float32", "shape": [2]}],
                                                     "warmup_batch_sizes": [1]}}}).models["half"]
    runner = ModelRunner(torch.device("cpu"))
    if refused:
        with pytest.raises(ModelError, match="does not reproduce expected_output.npy: its output differs by up to 0.5"):
            runner.load("half", model, "v1")
    else:
        loaded, _, _ = runner.load("half", model, "v1")
        assert loaded.outputs == (messages.TensorSpec("bfloat16", (2,)),)


def test_out_of_memory_fails_only_its_request_with_a_sentence(executor):
    result = executor.run_batch(batch(executor, [[-1, 0], [2, 3]], (1e12, 1e12)))
    assert isinstance(result, messages.BatchDone) and result.outputs == ()
    assert result.failed == (messages.RequestFailed(0, "internal", "out of memory on cpu for batch 7 of oom v1, "
                                                                   "1 samples"),)
    assert result.each[0] == () and result.each[1][0].shape == (1, 2)
    (ref,) = result.each[1]
    np.testing.assert_array_equal(np.ndarray(ref.shape, np.float32, buffer=executor.arena.buf, offset=ref.offset),
                                  [[6, 9]])
    whole = msgspec.structs.replace(batch(executor, [[-1, 0], [2, 3]], (1e12, 1e12)), retry_alone=False)
    result = executor.run_batch(whole)
    assert isinstance(result, messages.BatchFailed), "a model not safe to run twice fails its batch, as before"
    assert result.error == "out of memory on cpu for batch 7 of oom v1, 2 samples" and result.status == "internal"
    good = executor.run_batch(batch(executor, [[1, 2]], (1e12,)))
    assert isinstance(good, messages.BatchDone), "the executor serves on"


def test_requests_past_their_deadline_are_not_computed(executor):
    now = time.monotonic()
    result = executor.run_batch(batch(executor, [[1, 1], [2, 2], [3, 3]], (now + 60, now - 1, now + 60)))
    assert isinstance(result, messages.BatchDone) and result.expired == (1,)
    (ref,) = result.outputs
    assert ref.shape == (2, 2), "only the two live rows went through the model"
    got = np.ndarray(ref.shape, np.float32, buffer=executor.arena.buf, offset=ref.offset)
    np.testing.assert_array_equal(got, [[3, 3], [9, 9]])
    assert ref.offset >= 3 * 2 * 4, "the outputs lie after the inputs"
    nothing = executor.run_batch(batch(executor, [[1, 1]], (now - 1,)))
    assert isinstance(nothing, messages.BatchDone) and nothing.expired == (0,) and nothing.outputs == ()


def test_an_idle_gpu_worker_trims_what_it_can_return_not_what_it_cannot_every_check():
    mib = 1 << 20
    trim = IdleTrim(0.5)
    assert not trim.due(100 * mib, 1000 * mib), "one check is not enough"
    assert trim.due(100 * mib, 1000 * mib), "two in a row"
    trim.trimmed(900 * mib)  # what a trim could not return: graphs' pools, partly used segments
    assert not any(trim.due(100 * mib, 900 * mib) for _ in range(5)), "nothing new to return"
    assert not trim.due(100 * mib, 930 * mib) and not trim.due(100 * mib, 930 * mib), "grown less than the floor"
    assert not trim.due(100 * mib, 1000 * mib) and trim.due(100 * mib, 1000 * mib), "grown past it, twice"
    trim.trimmed(0)
    assert not trim.due(100 * mib, 1000 * mib) and not trim.due(900 * mib, 1000 * mib), "mostly in use"


def test_only_sticky_cuda_errors_end_a_worker():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. CUDA error: out of memory"))
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: out of memory"))
    assert is_sticky_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_sticky_cuda_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: invalid configuration argument"))
    assert not is_sticky_cuda_error(ValueError("negative input refused by the model"))


def test_a_batch_counts_its_memory_growth_only_when_it_ran_alone():
    overlap = Overlap()
    alone = overlap.begin()
    assert overlap.end(alone)
    first = overlap.begin()
    second = overlap.begin()
    assert not overlap.end(second) and not overlap.end(first)
    third = overlap.begin()
    fourth_started_during = overlap.begin()
    assert not overlap.end(third)
    assert not overlap.end(fourth_started_during)


def test_a_gateway_request_the_supervisor_never_answers_still_gets_one_answer(tmp_path):
    """Upstream, on a real socket whose peer reads the request and never replies."""
    import asyncio

    from inferd.oip.upstream import Upstream

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.bind(f"ipc://{tmp_path}/silent")
    upstream = Upstream(context, f"ipc://{tmp_path}/silent", default_timeout_ms=50, slack_s=0.05)

    async def ask() -> protocol.ReplyHeader:
        upstream.start()
        reply, outputs = await upstream.infer("mlp", None, [(protocol.TensorMeta("float32", (1, 2)), bytes(8))], None)
        assert outputs == []
        return reply

    started = time.monotonic()
    reply = asyncio.run(ask())
    assert reply.status == protocol.INTERNAL and "did not answer within" in reply.error
    assert 0.1 <= time.monotonic() - started < 5
    assert silent.poll(1000)
    body = silent.recv_multipart()[1:]
    # With the region the gateway registers with its connection (oip/hop_region.py), sent in the same turn.
    sent = [protocol.decode_message(member, 1 << 20) for member in protocol.group_of(body, 1 << 20) or [body]]
    assert [m.header.model for m in sent if isinstance(m, protocol.Request)] == ["mlp"]
    upstream.close()
    silent.close()
    context.term()


def test_the_daemons_processes_do_not_load_the_client_until_a_program_asks_for_it():
    # The supervisor, the workers and the gateways import inferd's package; its client (and what the
    # client imports) is for programs that send requests, so importing the package must not load it.
    code = ("import sys, inferd, inferd.cli.daemon, inferd.cli.inferctl, inferd.supervisor.main, inferd.worker.main, "
            "inferd.oip.gateway\n"
            "assert 'inferd.client' not in sys.modules, 'loaded by the daemon'\n"
            "from inferd import Client, AsyncClient, RetryPolicy\n"
            "assert Client.__module__ == 'inferd.client.client'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_addresses_split_host_and_port_the_way_configs_write_them():
    assert addresses.split("tcp://127.0.0.1:5555") == ("127.0.0.1", "5555")
    assert addresses.split("[::1]:8000") == ("::1", "8000")
    assert addresses.split("0.0.0.0:8001") == ("0.0.0.0", "8001")
    assert [addresses.loopback(a) for a in ("tcp://127.0.0.2:1", "[::1]:2", "localhost:3", "tcp://0.0.0.0:4",
                                            "10.0.0.1:5")] == [True, True, True, False, False]
    # A name that only starts like a loopback address is anyone's (127.0.0.1.nip.io resolves to it, too).
    assert [addresses.loopback(a) for a in ("127.evil.example:1", "tcp://127.0.0.1.evil.example:2", "[::2]:3",
                                            "[::ffff:127.0.0.1]:4", "app.localhost:5")] == [False, False, False,
                                                                                            True, True]


def test_a_version_keeps_its_number_whatever_is_added_or_removed_later(tmp_path):
    repository = str(tmp_path / "repo")
    for version in ("v10", "v2", "v1"):
        (tmp_path / "repo" / version).mkdir(parents=True)
        (tmp_path / "repo" / version / "model.pt").write_bytes(b"")
    state, owner = tmp_path / "state", str(tmp_path / "inferd.toml")
    # In natural order.
    assert VersionNumbers(state, owner).of_all({"m": repository}) == {"m": {"v1": 1, "v2": 2, "v10": 3}}
    shutil.rmtree(tmp_path / "repo" / "v1")
    for version in ("v0", "7", "5"):
        (tmp_path / "repo" / version).mkdir()
        (tmp_path / "repo" / version / "model.pt").write_bytes(b"")
    # Read back from state_dir: v2 and v10 keep theirs; of the new ones, a whole number takes its own.
    numbers = VersionNumbers(state, owner).of_all({"m": repository, "gone": str(tmp_path / "gone")})
    assert numbers == {"m": {"5": 5, "7": 7, "v0": 8, "v2": 2, "v10": 3}, "gone": {}}
    assert VersionNumbers(state, owner).of_all({"other": repository}) == {
        "other": {"5": 5, "7": 7, "v0": 8, "v2": 9, "v10": 10}}


def test_version_numbers_another_config_saved_are_not_taken_and_a_file_naming_none_is_adopted(tmp_path, caplog):
    repository = tmp_path / "repo"
    for version in ("v1", "v2"):
        (repository / version).mkdir(parents=True)
        (repository / version / "model.pt").write_bytes(b"")
    state = tmp_path / "state"
    state.mkdir()
    # As an earlier inferd saved it: the numbers alone. The first config to start takes it as its own.
    (state / NUMBERS_FILE).write_text(json.dumps({"m": {"v1": 7, "v2": 3}}))
    first, second = str(tmp_path / "first" / "inferd.toml"), str(tmp_path / "second" / "inferd.toml")
    assert VersionNumbers(state, first).of_all({"m": str(repository)}) == {"m": {"v1": 7, "v2": 3}}
    assert json.loads((state / NUMBERS_FILE).read_text()) == {"config": first, "numbers": {"m": {"v1": 7, "v2": 3}}}
    assert VersionNumbers(state, first).of_all({"m": str(repository)}) == {"m": {"v1": 7, "v2": 3}}
    # Another config sharing the folder numbers the versions anew, and says why.
    with caplog.at_level(logging.WARNING, logger="inferd.models.repository"):
        assert VersionNumbers(state, second).of_all({"m": str(repository)}) == {"m": {"v1": 1, "v2": 2}}
    assert f"ignoring {state / NUMBERS_FILE}: the daemon of {first} saved it, and this one runs {second}; it " \
           "numbers the versions anew" in caplog.text


def test_corked_writes_send_a_turns_writes_together_in_order_and_a_large_one_at_once():
    from inferd.oip.http.server import CORK_BYTES, CorkedWrites

    async def exchange() -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        ours, theirs = stdlib_socket.socketpair()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        sends: list[int] = []
        real_write = transport.write

        def counted(data: bytes) -> None:
            sends.append(len(data))
            real_write(data)

        transport.write = counted  # type: ignore[method-assign]
        corked = CorkedWrites(transport, loop)
        large = bytes(range(256)) * (CORK_BYTES // 256 + 1)
        corked.write(b"head ")
        corked.write(b"body ")
        await asyncio.sleep(0)  # the turn ends: both go in one write
        corked.write(b"next ")
        corked.write(large)  # what is held goes first, then the large one, now
        corked.write(b"tail")
        corked.close()  # what is held goes before the close
        theirs.setblocking(True)
        received = b""
        while chunk := await loop.run_in_executor(None, theirs.recv, 1 << 20):
            received += chunk
        theirs.close()
        assert received == b"head body next " + large + b"tail"
        return received, sends

    _, sends = asyncio.run(exchange())
    assert sends == [10, 5, CORK_BYTES // 256 * 256 + 256, 4]


def test_compute_times_are_learned_per_size_of_sample_where_inputs_vary():
    times = ComputeTimes()
    times.observe("m", "v1", 4, 0.001, elements=10)
    times.observe("m", "v1", 4, 0.100, elements=500)
    assert times.batch_s("m", 4, 10) == 0.001 and times.batch_s("m", 4, 500) == 0.100
    assert times.batch_s("m", 4, 300) == 0.100, "a size not measured takes the nearest smaller one measured"
    assert times.batch_s("m", 4, 100) == 0.001
    assert times.batch_s("m", 4) == 0.001, "with no size given, the smallest measured: an estimate that errs short"
    assert times.batch_s("m", 2, 500) is None, "no smaller batch measured"
    times.observe("m", "v2", 4, 0.5)  # a new version starts afresh; a model of fixed shapes has one size
    assert times.batch_s("m", 4, 500) == 0.5 and times.batch_s("m", 8) == 0.5


@pytest.mark.parametrize("inputs, batch, max_bytes, mark", [
    ([{"dtype": "float32", "shape": [16]}], 16, 1 << 30, 64),  # the mlp: 1 KiB a batch, never deeper than 64
    ([{"dtype": "float32", "shape": [1 << 20]}], 1, 64 << 20, 3),  # 4 MiB: 16 MiB of budget holds 3 and a header
    ([{"dtype": "float32", "shape": [1 << 20]}], 1, 1 << 30, 15),  # the budget: a quarter of max_bytes_per_client
    ([{"dtype": "int64", "shape": [-1], "max_shape": [1 << 16]}], 8, 64 << 20, 3),  # variable: at its max_shape
    ([{"dtype": "float32", "shape": [100 << 20]}], 1, 1 << 30, 1),  # past max_message_mb: that bounds it, at 1
])
def test_a_client_socket_s_receive_mark_is_its_byte_budget_over_the_largest_request_the_models_take(
        inputs, batch, max_bytes, mark):
    config = config_module.parse({"models": {"m": {"repository": "/nowhere", "inputs": inputs,
                                                   "max_batch_size": batch},
                                             "mlp": {"repository": "/nowhere", "max_batch_size": 16,
                                                     "inputs": [{"dtype": "float32", "shape": [16]}]}},
                                  "queue": {"max_bytes": max_bytes}})
    assert receive_mark(config) == mark


def test_the_reapers_glob_of_step_stacks_files_takes_this_daemons_only_however_its_socket_is_named(tmp_path):
    from inferd.supervisor.processes.reaper import _expand

    ours = RuntimeFiles(f"ipc://{tmp_path}/d[1].sock", new_instance())
    theirs = RuntimeFiles(f"ipc://{tmp_path}/d1.sock", new_instance())  # what d[1] matches as a glob, unescaped
    for files in (ours, theirs):
        files.step_stacks("m", 0).write_text("")
        files.step_stacks("m", 1).write_text("")
    assert _expand([ours.every_step_stacks]) == [ours.step_stacks("m", 0), ours.step_stacks("m", 1)]


def test_the_stats_table_gives_a_shapes_padding_share_from_its_counts_rounded_once():
    from inferd.cli.render import _shape_lines

    # 4130 / 2526 = 1.634996...: the report's padding_share, rounded to 4 places (1.635), would print 1.64.
    part = {"batches": 10, "elements": 2526, "padding_elements": 4130, "padding_share": 1.635}
    assert _shape_lines({"models": {"padded": {"shapes": {"2x64": part}}}}) == [
        "", "padded shape 2x64: 10 batch(es), 2526 input elements requested, 4130 of padding (1.63 per element "
            "requested)"]


def test_a_connection_turned_away_is_shut_only_where_its_descriptor_is_still_one_of_that_endpoints(tmp_path):
    listener = stdlib_socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = stdlib_socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    unix = stdlib_socket.socket(stdlib_socket.AF_UNIX)
    unix.bind(str(tmp_path / "data.sock"))
    try:
        assert is_at(accepted.getsockname(), f"tcp://127.0.0.1:{port}")
        assert is_at(accepted.getsockname(), f"tcp://*:{port}")
        assert not is_at(accepted.getsockname(), f"tcp://127.0.0.1:{port + 1}")
        assert is_at(unix.getsockname(), f"ipc://{tmp_path}/data.sock")
        assert not is_at(unix.getsockname(), f"ipc://{tmp_path}/other.sock")
        # Its descriptor now another endpoint's: left alone, and still open.
        assert not close_accepted(accepted.fileno(), f"tcp://127.0.0.1:{port + 1}")
        client.setblocking(False)
        with pytest.raises(BlockingIOError):
            client.recv(1)
        assert close_accepted(accepted.fileno(), f"tcp://127.0.0.1:{port}")
        client.setblocking(True)
        assert client.recv(1) == b""  # the client sees its connection end
        assert accepted.fileno() >= 0  # and the descriptor stays its owner's to close
        with tmp_path.joinpath("file").open("w") as not_a_socket:
            before = len(os.listdir("/proc/self/fd"))
            assert not close_accepted(not_a_socket.fileno(), f"tcp://127.0.0.1:{port}")
            assert len(os.listdir("/proc/self/fd")) == before  # its duplicate closed
    finally:
        for each in (client, accepted, listener, unix):
            each.close()
