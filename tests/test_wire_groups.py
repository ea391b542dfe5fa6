"""Several requests in one ZeroMQ message (a group), and their replies in one where they finish in one batch:
each request keeps its own id, model, deadline, priority and reply, and a malformed one is refused alone."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import models
import msgspec
import numpy as np
import pytest
from conftest import MLP, PAIR, Daemon, module_daemon, reference
from wire import RawPeer, ScriptedServer, ok

from inferd import Client, protocol

SLEEPY = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 1, "warmup_batch_sizes": [1]}


@pytest.fixture(scope="module")
def daemon(repo: Path) -> Iterator[Daemon]:
    """mlp, pair and sleepy (about 5 ms a batch) on one worker."""
    with module_daemon(repo, {"mlp": MLP, "pair": PAIR, "sleepy": SLEEPY}) as started:
        yield started


def request(request_id: object, model: str, arrays: list[np.ndarray], **header: object) -> list[bytes]:
    """One request's frames, as a member of a group carries them."""
    body = {"id": request_id, "model": model, "inputs": [{"dtype": a.dtype.name, "shape": list(a.shape)}
                                                         for a in arrays], **header}
    return [msgspec.json.encode(body), *(np.ascontiguousarray(a).tobytes() for a in arrays)]


def replies(peer: RawPeer, count: int) -> tuple[dict[object, tuple[dict, list[bytes]]], list[int]]:
    """`count` replies by id, and how many each message that carried them held."""
    found: dict[object, tuple[dict, list[bytes]]] = {}
    sizes = []
    while len(found) < count:
        assert peer.socket.poll(20_000), f"{len(found)} of {count} replies came"
        frames = peer.socket.recv_multipart()
        members = protocol.group_of(frames, 1 << 40) or [frames]
        sizes.append(len(members))
        for header, *outputs in members:
            decoded = msgspec.json.decode(header)
            assert decoded["id"] not in found, "one reply per request"
            found[decoded["id"]] = (decoded, outputs)
    return found, sizes


def test_a_group_of_mixed_models_deadlines_and_a_malformed_member_answers_each_alone(daemon, repo):
    rng = np.random.default_rng(4)
    x = [rng.standard_normal((n, models.MLP_IN)).astype(np.float32) for n in (1, 3)]
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), np.arange(4, dtype=np.int64).reshape(2, 2)
    wrong_size = request("short", "mlp", [x[0]])
    wrong_size[1] = wrong_size[1][:-4]
    members = [request("m1", "mlp", [x[0]]), request("m3", "mlp", [x[1]], priority=0), request("pair", "pair", [a, b]),
               wrong_size, request("late", "sleepy", [np.zeros((1, 2), np.float32)], timeout_ms=1),
               request("nowhere", "no such model", [x[0]])]
    with RawPeer(daemon.endpoint) as peer:
        peer.send_frames(protocol.encode_group(members))
        found, _ = replies(peer, len(members))
    mlp = reference(repo, "mlp", "v2")
    for name, given in (("m1", x[0]), ("m3", x[1])):
        header, (output,) = found[name]
        assert header["status"] == "ok" and header["model"] == "mlp"
        np.testing.assert_allclose(np.frombuffer(output, np.float32).reshape(len(given), -1), mlp(given), rtol=1e-5)
    header, outputs = found["pair"]
    assert header["status"] == "ok" and len(outputs) == 2
    assert found["short"][0]["status"] == "invalid" and "input 0 is 60 bytes" in found["short"][0]["error"]
    assert found["late"][0]["status"] in ("timeout", "overloaded"), "its own deadline, 1 ms, was kept"
    assert found["nowhere"][0]["status"] == "invalid" and "unknown model" in found["nowhere"][0]["error"]


def test_replies_of_a_group_that_finish_in_one_batch_leave_as_one_message(daemon, repo):
    x = np.random.default_rng(5).standard_normal((8, models.MLP_IN)).astype(np.float32)
    with RawPeer(daemon.endpoint) as peer:
        peer.send_frames(protocol.encode_group([request(i, "mlp", [x[i:i + 1]]) for i in range(8)]))
        found, sizes = replies(peer, 8)
        assert len(sizes) < 8 and max(sizes) > 1, f"messages of {sizes} replies: grouped where one batch held them"
        # One request per message: one reply per message, never a group.
        for i in range(8):
            peer.send(f"alone{i}", "mlp", [x[i:i + 1]])
        _, alone = replies(peer, 8)
        assert alone == [1] * 8
    want = reference(repo, "mlp", "v2")(x)
    for i in range(8):
        header, (output,) = found[i]
        assert header["status"] == "ok"
        np.testing.assert_allclose(np.frombuffer(output, np.float32), want[i], rtol=1e-5)


@pytest.mark.parametrize(("first", "says"), [
    (b'{"group": [2, 2]}', "counts 4 frames, but 3 follow it"),
    (b'{"group": [0, 3]}', "frame counts, each at least 1"),
    (msgspec.json.encode({"group": [1] * (protocol.MAX_GROUP + 1)}), f"1 to {protocol.MAX_GROUP} frame counts")])
def test_a_group_whose_counts_do_not_fit_its_frames_is_refused_whole(daemon, first, says):
    with RawPeer(daemon.endpoint) as peer:
        frames = request(1, "mlp", [np.zeros((1, models.MLP_IN), np.float32)])
        peer.send_frames([first, *frames, frames[0]])
        header, _ = peer.recv()
        assert header["id"] is None and header["status"] == "invalid" and says in header["error"]
        assert peer.nothing_more()


def test_the_client_sends_what_its_callers_submit_at_once_as_groups(server_factory):
    x = np.ones((1, 2), np.float32)
    server: ScriptedServer = server_factory(lambda n, h, b: ok(h, np.frombuffer(b[0], np.float32) + h["id"]))
    with Client(server.endpoint, timeout=20.0) as client:
        # Submitted from a done-callback, which runs on the client's I/O thread: every call is posted before
        # that thread takes its next turn, however the threads are scheduled.
        submitted: concurrent.futures.Future = concurrent.futures.Future()
        first = client.submit("m", x)
        first.add_done_callback(lambda _: submitted.set_result([client.submit("m", x) for _ in range(500)]))
        answers = [future.result() for future in [first, *submitted.result(timeout=20.0)]]
    for call_id, answer in enumerate(answers, start=1):
        np.testing.assert_array_equal(answer, x.ravel() + call_id)
    assert server.group_sizes == [1, protocol.MAX_GROUP, 500 - protocol.MAX_GROUP]
    before = len(server.group_sizes)
    with Client(server.endpoint, timeout=20.0, group=False) as client:
        for future in [client.submit("m", x) for _ in range(100)]:
            future.result()
    assert server.group_sizes[before:] == [1] * 100, "group=False: a message per call"


def test_the_client_answers_each_call_of_a_group_of_replies_through_the_daemon(daemon, repo):
    x = np.random.default_rng(6).standard_normal((64, models.MLP_IN)).astype(np.float32)
    with daemon.client() as client:
        futures = [client.submit("mlp", x[i:i + 1]) for i in range(64)]
        got = np.concatenate([future.result() for future in futures])
    np.testing.assert_allclose(got, reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
