"""Clients' shared-memory regions end to end (issue 16), on a real daemon: the Python client's
`shared_memory` and `out=`, the region messages on the wire, and every rule that keeps a client's
region from being anything but its own file in /dev/shm, on a loopback or ipc:// connection."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import models
import msgspec
import numpy as np
import pytest
from conftest import MLP, PAIR, Daemon, base_config, reference, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire import RawPeer

from inferd import InvalidRequest, RetryPolicy, Unavailable, protocol
from inferd.harness import free_port
from inferd.protocol import OutputPlace, RegionStatus, RegisterRegion, TensorMeta, UnregisterRegion
from inferd.system.shm_names import SHM_DIR

# The module's daemon takes every name under "inferd-": the widest prefix the config allows, so
# that only the arena rule, not the prefix, stands between a client and the daemon's own arenas.
PREFIX = "inferd-"
MAX_MESSAGE_MB = 1  # so that a 3 MB message makes ZeroMQ drop the connection (the reconnect test)
X_MLP = np.zeros((1, models.MLP_IN), dtype=np.float32)


@pytest.fixture(scope="module")
def shm_daemon(repo: Path) -> Iterator[Daemon]:
    """One daemon for the module, client shared memory on, listening on loopback tcp (first), on the
    wildcard address and on ipc://."""
    path = Path(tempfile.mkdtemp(prefix="inferd-c"))
    config = base_config(path, repo, {"mlp": MLP, "pair": PAIR},
                         server={"allow_client_shm": True, "client_shm_prefix": PREFIX,
                                 "max_message_mb": MAX_MESSAGE_MB})
    config["server"]["listen"] += [f"tcp://0.0.0.0:{free_port()}", f"ipc://{path}/data.sock"]
    daemon = Daemon(path, config)
    daemon.start()
    try:
        yield daemon
        daemon.stop()  # a clean stop removes its arenas at once; a kill leaves them to the reaper
    finally:
        daemon.kill_all()
    shutil.rmtree(path, ignore_errors=True)


def wildcard(daemon: Daemon) -> str:
    """Where to connect to the daemon's wildcard (not loopback) endpoint."""
    return daemon.config["server"]["listen"][1].replace("0.0.0.0", "127.0.0.1")


def ipc(daemon: Daemon) -> str:
    return daemon.config["server"]["listen"][2]


def live(daemon: Daemon, model: str) -> str:
    return daemon.status()["models"][model]["live_version"]


def daemon_regions(daemon: Daemon) -> list[dict[str, Any]]:
    """What `inferctl stats --json` lists under "regions"."""
    return daemon.call("stats")["regions"]


def holds_open(pid: int, key: str) -> bool:
    """Whether process `pid` has a descriptor of /dev/shm/`key` open."""
    target = str(SHM_DIR / key)
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith(target):
                return True
        except OSError:
            pass  # closed while we looked
    return False


@pytest.fixture
def shm_file() -> Iterator[Callable[..., str]]:
    """Make a file in /dev/shm (n zero bytes, or the bytes given) under a fresh name that starts
    with `prefix`, and return its name; every one made is removed afterwards."""
    made: list[Path] = []

    def make(content: int | bytes, prefix: str = "inferd-client-test-") -> str:
        path = SHM_DIR / f"{prefix}{uuid.uuid4().hex[:12]}"
        made.append(path)
        path.write_bytes(bytes(content) if isinstance(content, int) else content)
        return path.name

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def ask(peer: RawPeer, op: protocol.RegionOp) -> dict[str, Any]:
    """Send a region message and return its reply's header."""
    peer.send_frames([protocol.encode_op(op)])
    header, _ = peer.recv()
    assert header["id"] == op.id
    return header


def infer_raw(peer: RawPeer, request_id: Any, model: str, inputs: list[np.ndarray | TensorMeta],
              outputs: tuple[OutputPlace | None, ...] = ()) -> tuple[dict[str, Any], list[bytes]]:
    """Send a request as encode_request makes it; the reply's header and its raw output frames."""
    peer.send_frames(protocol.encode_request(request_id, model, inputs, outputs=outputs))
    assert peer.socket.poll(20_000), "no reply within 20 s"
    frames = peer.socket.recv_multipart()
    header = msgspec.json.decode(frames[0])
    assert header["id"] == request_id
    return header, frames[1:]


def register(name: str, key: str, byte_size: int, offset: int = 0, request_id: Any = "reg") -> RegisterRegion:
    return RegisterRegion(id=request_id, name=name, key=key, byte_size=byte_size, offset=offset)


def assert_serving(daemon: Daemon, pids: list[int] | None = None) -> None:
    """The daemon still answers a plain request, is `serving`, and (given `pids`) kept its workers."""
    with RawPeer(daemon.endpoint) as peer:
        peer.send("still-serving", "mlp", [X_MLP])
        assert peer.recv()[0]["status"] == "ok"
    status = daemon.status()
    assert status["state"] == "serving"
    if pids is not None:
        assert [w["pid"] for w in status["workers"]] == pids, "a worker was restarted"


# --- The Python client -----------------------------------------------------------------------------


def test_python_client_reads_inputs_from_and_writes_outputs_into_its_region(shm_daemon, repo):
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))
    rng = np.random.default_rng(16)
    with shm_daemon.client() as client:
        with client.shared_memory(4096) as region:
            x = region.array("float32", (3, models.MLP_IN))
            x[:] = rng.standard_normal(x.shape, dtype=np.float32)
            out = region.array("float32", (3, models.MLP_OUT), offset=x.nbytes)
            y = client.infer("mlp", x, out=out)
            assert np.shares_memory(y, out), "the output was not handed back as the view of the region asked for"
            np.testing.assert_allclose(out, expected(x.copy()), rtol=1e-5, atol=1e-6)
            # Inputs alone in the region, the output in the reply.
            np.testing.assert_allclose(client.infer("mlp", x), expected(x.copy()), rtol=1e-5, atol=1e-6)

            listed = client.regions()
            assert [(r.name, r.key, r.offset, r.byte_size) for r in listed] == [(region.name, region.key, 0, 4096)]
            (entry,) = [r for r in daemon_regions(shm_daemon) if r["name"] == region.name]
            assert entry["key"] == region.key and entry["byte_size"] == 4096 and entry["offset"] == 0
            assert entry["owner"].startswith(f"{shm_daemon.endpoint} connection ")
            assert entry["requests"] == 2, "each request that named the region is counted; inputs travel by reference"
            path = SHM_DIR / region.key
            assert path.exists() and holds_open(shm_daemon.status()["pid"], region.key)
            table = subprocess.run([str(Path(sys.executable).parent / "inferctl"), "--control", shm_daemon.control,
                                    "stats"], capture_output=True, text=True, check=True).stdout
            row = next(line for line in table.splitlines() if line.startswith(region.name))
            assert row.split()[1:4] == [region.key, "4096", "2"] and entry["owner"] in row, table
        # The context manager unregistered it (and waited for the answer), unmapped and unlinked it.
        assert region.name not in [r["name"] for r in daemon_regions(shm_daemon)]
        assert client.regions() == []
        assert not path.exists()
        assert not holds_open(shm_daemon.status()["pid"], region.key)


def test_a_mixed_request_one_input_and_one_output_in_the_region(shm_daemon, repo):
    expected = reference(repo, "pair", live(shm_daemon, "pair"))
    rng = np.random.default_rng(17)
    a_inline = rng.standard_normal((4, 3, 4), dtype=np.float32)
    with shm_daemon.client() as client, client.shared_memory(1024) as region:
        b = region.array("int64", (4, 2))
        b[:] = rng.integers(-100, 100, b.shape)
        out1 = region.array("int64", (4, 2), offset=512)
        y0, y1 = client.infer("pair", [a_inline, b], out=[None, out1])
        e0, e1 = expected(a_inline, b.copy())
        np.testing.assert_allclose(y0, e0, rtol=1e-5)
        np.testing.assert_array_equal(y1, e1)
        assert np.shares_memory(y1, out1) and not np.shares_memory(y0, region.array("uint8", (1024,)))
        np.testing.assert_array_equal(out1, e1)
        (entry,) = [r for r in daemon_regions(shm_daemon) if r["name"] == region.name]
        assert entry["requests"] == 1


def test_many_requests_in_flight_each_in_its_own_part_of_the_region(shm_daemon, repo):
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))
    count, rows = 48, 2
    in_bytes, out_bytes = rows * models.MLP_IN * 4, rows * models.MLP_OUT * 4
    rng = np.random.default_rng(18)
    with shm_daemon.client() as client, client.shared_memory(count * (in_bytes + out_bytes)) as region:
        xs = [region.array("float32", (rows, models.MLP_IN), offset=i * in_bytes) for i in range(count)]
        outs = [region.array("float32", (rows, models.MLP_OUT), offset=count * in_bytes + i * out_bytes)
                for i in range(count)]
        for x in xs:
            x[:] = rng.standard_normal(x.shape, dtype=np.float32)
        futures = [client.submit("mlp", x, out=out) for x, out in zip(xs, outs)]
        for x, out, future in zip(xs, outs, futures):
            y = future.result()
            assert np.shares_memory(y, out)
            np.testing.assert_allclose(y, expected(x.copy()), rtol=1e-5, atol=1e-6)
        (entry,) = [r for r in daemon_regions(shm_daemon) if r["name"] == region.name]
        assert entry["requests"] == count


def test_out_that_lies_in_no_region_or_in_pieces_is_refused_by_the_client(shm_daemon):
    with shm_daemon.client() as client, client.shared_memory(256) as region:
        with pytest.raises(ValueError, match=r"out\[0\] does not lie in a region"):
            client.infer("mlp", X_MLP, out=np.zeros((1, models.MLP_OUT), dtype=np.float32))
        with pytest.raises(ValueError, match=r"out\[0\] is not contiguous"):
            client.infer("mlp", X_MLP, out=region.array("float32", (1, 2 * models.MLP_OUT))[:, ::2])


def test_out_is_what_the_call_gives_and_an_output_that_does_not_fit_it_fails_the_call(shm_daemon, repo):
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))
    x = np.random.default_rng(19).standard_normal((3, models.MLP_IN), dtype=np.float32)
    with shm_daemon.client() as client, client.shared_memory(4096) as region:
        fits = region.array("float32", (3, models.MLP_OUT))
        assert client.infer("mlp", x, out=fits) is fits
        np.testing.assert_allclose(fits, expected(x.copy()), rtol=1e-5, atol=1e-6)
        small = region.array("float32", (1, models.MLP_OUT), offset=1024)  # one sample's room, of three
        neighbour = region.array("float32", (8,), offset=1024 + small.nbytes)  # the caller's own data after it
        neighbour[:] = 7.0
        said = f"output 0, float32 [3, {models.MLP_OUT}] ({fits.nbytes} bytes), does not fit out[0], float32"
        with pytest.raises(InvalidRequest, match=re.escape(said)):
            client.infer("mlp", x, out=small)
        assert (small == 0).all() and (neighbour == 7.0).all(), "nothing written, least of all past `out`"
        wide = region.array("float64", (3, models.MLP_OUT), offset=2048)
        with pytest.raises(InvalidRequest, match="give an out of the output's dtype and shape"):
            client.infer("mlp", x, out=wide)


def test_a_region_the_caller_made_is_registered_used_and_unregistered_but_never_unlinked(shm_daemon, repo, shm_file):
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))
    key = shm_file(8192)
    with shm_daemon.client() as client:
        region = client.register_region("theirs", f"/{key}", 2048, offset=4096)
        x = region.array("float32", (2, models.MLP_IN))
        x[:] = 0.25
        out = region.array("float32", (2, models.MLP_OUT), offset=1024)
        y = client.infer("mlp", x, out=out)
        assert np.shares_memory(y, out)
        np.testing.assert_allclose(y, expected(x.copy()), rtol=1e-5, atol=1e-6)
        stored = np.frombuffer((SHM_DIR / key).read_bytes()[4096 + 1024: 4096 + 1024 + out.nbytes], np.float32)
        np.testing.assert_array_equal(stored, out.reshape(-1))  # the window starts at the registered offset
        assert [(r.name, r.offset, r.byte_size) for r in client.regions()] == [("theirs", 4096, 2048)]
        client.unregister_region("theirs")
        assert client.regions() == []
        with pytest.raises(ValueError, match="is closed"):
            region.array("float32", (1,))
    assert (SHM_DIR / key).exists(), "the client unlinks only the files it created"


def test_the_client_registers_its_regions_again_after_a_reconnect(shm_daemon, repo):
    """A message past the receive limit makes ZeroMQ drop the connection; the client reconnects at
    once and must register its regions on the new connection before it sends anything naming them."""
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))
    too_big = np.zeros((50_000, models.MLP_IN), dtype=np.float32)  # 3.2 MB, over (1 + 1) MiB
    with shm_daemon.client(retry=RetryPolicy(max_attempts=1)) as client, client.shared_memory(1024) as region:
        (before,) = [r["owner"] for r in daemon_regions(shm_daemon) if r["name"] == region.name]
        with pytest.raises(Unavailable, match="connection to the daemon dropped"):
            client.infer("mlp", too_big)

        def registered_again() -> bool:
            owners = [r["owner"] for r in daemon_regions(shm_daemon) if r["name"] == region.name]
            return bool(owners) and owners != [before]

        wait_for(registered_again, timeout=10, what="the region's registration on the new connection")
        x = region.array("float32", (1, models.MLP_IN))
        x[:] = 1.5
        out = region.array("float32", (1, models.MLP_OUT), offset=512)
        np.testing.assert_allclose(client.infer("mlp", x, out=out), expected(x.copy()), rtol=1e-5, atol=1e-6)
        assert [r.name for r in client.regions()] == [region.name]


# --- The wire ----------------------------------------------------------------------------------------


def test_region_messages_and_requests_that_name_a_region_on_the_wire(shm_daemon, repo, shm_file):
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))
    x = np.random.default_rng(19).standard_normal((2, models.MLP_IN), dtype=np.float32)
    window = 1024  # the registered window starts this far into the file
    key = shm_file(bytes(window) + x.tobytes() + bytes(2048 - x.nbytes))
    with RawPeer(shm_daemon.endpoint) as peer:
        reply = ask(peer, register("raw", f"/{key}", 2048, offset=window))  # a POSIX name: leading / allowed
        assert reply["status"] == "ok", reply
        assert reply["regions"] == [{"name": "raw", "key": key, "offset": window, "byte_size": 2048}]
        assert ask(peer, RegionStatus(id="all"))["regions"] == reply["regions"]
        assert ask(peer, RegionStatus(id="one", name="raw"))["regions"] == reply["regions"]

        header, frames = infer_raw(peer, "q", "mlp", [TensorMeta("float32", x.shape, "raw", 0)],
                                   (OutputPlace("raw", 1024),))
        assert header["status"] == "ok", header
        assert header["outputs"] == [{"dtype": "float32", "shape": [2, models.MLP_OUT], "region": "raw",
                                      "offset": 1024}]
        assert frames == [], "an output placed in a region has no frame in the reply"
        written = (SHM_DIR / key).read_bytes()[window + 1024: window + 1024 + 2 * models.MLP_OUT * 4]
        np.testing.assert_allclose(np.frombuffer(written, np.float32).reshape(2, models.MLP_OUT), expected(x),
                                   rtol=1e-5, atol=1e-6)

        gone = ask(peer, UnregisterRegion(id="u0", name="never-registered"))
        assert gone["status"] == "ok" and gone["regions"] == []
        status = ask(peer, RegionStatus(id="missing", name="never-registered"))
        assert status["status"] == "invalid" and "no region 'never-registered'" in status["error"]

        gone = ask(peer, UnregisterRegion(id="u1", name="raw"))
        assert gone["status"] == "ok" and [r["name"] for r in gone["regions"]] == ["raw"]
        assert ask(peer, RegionStatus(id="none"))["regions"] == []
        header, _ = infer_raw(peer, "after", "mlp", [TensorMeta("float32", x.shape, "raw", 0)])
        assert header["status"] == "invalid" and "no region 'raw' is registered on this connection" in header["error"]
        header, _ = infer_raw(peer, "after-out", "mlp", [x], (OutputPlace("raw", 0),))
        assert header["status"] == "invalid" and "no region 'raw'" in header["error"]
        assert not holds_open(shm_daemon.status()["pid"], key)


def test_unregister_without_a_name_drops_every_region_of_the_connection(shm_daemon, shm_file):
    with RawPeer(shm_daemon.endpoint) as peer:
        for name in ("one", "two"):
            assert ask(peer, register(name, shm_file(256), 256))["status"] == "ok"
        again = ask(peer, register("one", shm_file(256), 256))
        assert again["status"] == "invalid" and "'one' is already registered on this connection" in again["error"]
        gone = ask(peer, UnregisterRegion(id="all"))
        assert gone["status"] == "ok" and sorted(r["name"] for r in gone["regions"]) == ["one", "two"]
        assert ask(peer, RegionStatus(id="none"))["regions"] == []


def test_a_window_past_the_request_is_refused_before_it_queues(shm_daemon, shm_file):
    with RawPeer(shm_daemon.endpoint) as peer:
        assert ask(peer, register("small", shm_file(64), 64))["status"] == "ok"
        header, _ = infer_raw(peer, "fits", "mlp", [TensorMeta("float32", X_MLP.shape, "small", 0)])  # 64 bytes
        assert header["status"] == "ok", header
        header, _ = infer_raw(peer, "past", "mlp", [TensorMeta("float32", X_MLP.shape, "small", 8)])
        assert header["status"] == "invalid" and "bytes 8 to 72 of region 'small', which is 64 bytes" in header["error"]


def test_an_output_region_too_small_for_the_output_is_refused_before_it_is_computed(shm_daemon, shm_file):
    x = np.ones((3, models.MLP_IN), dtype=np.float32)  # its output: 3 x MLP_OUT float32, 48 bytes
    computed = shm_daemon.call("stats")["models"]["mlp"]["samples"]
    with RawPeer(shm_daemon.endpoint) as peer:
        assert ask(peer, register("out", shm_file(64), 64))["status"] == "ok"
        header, _ = infer_raw(peer, "past", "mlp", [x], outputs=(OutputPlace("out", 32),))
        assert header["status"] == "invalid", header
        assert f"output 0 of mlp {live(shm_daemon, 'mlp')} needs bytes 32 to 80 of region 'out', which is 64 " \
               "bytes" in header["error"]
        assert shm_daemon.call("stats")["models"]["mlp"]["samples"] == computed, "it was computed all the same"
        header, _ = infer_raw(peer, "fits", "mlp", [x], outputs=(OutputPlace("out", 16),))
        assert header["status"] == "ok" and header["outputs"][0]["region"] == "out", header


def test_an_output_larger_than_its_places_byte_size_comes_in_the_reply_instead(shm_daemon, shm_file, repo):
    x = np.random.default_rng(17).standard_normal((3, models.MLP_IN)).astype(np.float32)  # its output: 48 bytes
    expected = reference(repo, "mlp", live(shm_daemon, "mlp"))(x)
    key = shm_file(64)
    with RawPeer(shm_daemon.endpoint) as peer:
        assert ask(peer, register("out", key, 64))["status"] == "ok"
        # Room for 40 bytes where the region has 64: the output, computed, comes back in a frame.
        header, frames = infer_raw(peer, "larger", "mlp", [x], outputs=(OutputPlace("out", 8, byte_size=40),))
        assert header["status"] == "ok" and "region" not in header["outputs"][0], header
        np.testing.assert_allclose(np.frombuffer(frames[0], np.float32).reshape(expected.shape), expected, rtol=1e-5)
        assert (SHM_DIR / key).read_bytes() == bytes(64), "nothing was written in the region"
        # Room for all 48: written there.
        header, frames = infer_raw(peer, "fits", "mlp", [x], outputs=(OutputPlace("out", 8, byte_size=48),))
        assert header["status"] == "ok" and header["outputs"][0]["region"] == "out" and not frames, header
        written = np.frombuffer((SHM_DIR / key).read_bytes()[8:56], np.float32).reshape(expected.shape)
        np.testing.assert_allclose(written, expected, rtol=1e-5)
        # The room itself must lie in the region.
        header, _ = infer_raw(peer, "past", "mlp", [x], outputs=(OutputPlace("out", 32, byte_size=48),))
        assert header["status"] == "invalid" and "needs bytes 32 to 80 of region 'out'" in header["error"], header


# --- The rules --------------------------------------------------------------------------------------


def test_client_shared_memory_is_off_by_default(start_daemon, shm_file):
    daemon = start_daemon({"mlp": MLP})
    key = shm_file(1024)
    with RawPeer(daemon.endpoint) as peer:
        reply = ask(peer, register("r", key, 1024))
        assert reply["status"] == "invalid"
        assert "client shared memory is not allowed" in reply["error"] and "server.allow_client_shm" in reply["error"]
        header, _ = infer_raw(peer, "q", "mlp", [TensorMeta("float32", X_MLP.shape, "r", 0)])
        assert header["status"] == "invalid" and "server.allow_client_shm" in header["error"]
        assert ask(peer, RegionStatus(id="s"))["status"] == "invalid"
    assert daemon.call("stats")["regions"] == []
    assert not holds_open(daemon.status()["pid"], key)


def test_only_loopback_and_ipc_endpoints_allow_it(shm_daemon, shm_file):
    key = shm_file(1024)
    with RawPeer(wildcard(shm_daemon)) as peer:
        reply = ask(peer, register("r", key, 1024))
        assert reply["status"] == "invalid"
        assert "not allowed on tcp://0.0.0.0:" in reply["error"] and "ipc:// and loopback" in reply["error"]
        assert "allow_client_shm is off" not in reply["error"], "it is on; the endpoint is what refuses"
        header, _ = infer_raw(peer, "q", "mlp", [TensorMeta("float32", X_MLP.shape, "r", 0)])
        assert header["status"] == "invalid" and "not allowed on tcp://0.0.0.0:" in header["error"]
        header, _ = infer_raw(peer, "plain", "mlp", [X_MLP])
        assert header["status"] == "ok", "the wildcard endpoint still serves requests without regions"
    for endpoint in (shm_daemon.endpoint, ipc(shm_daemon)):
        with RawPeer(endpoint) as peer:
            assert ask(peer, register("r", key, 1024))["status"] == "ok", endpoint
            header, _ = infer_raw(peer, "q", "mlp", [TensorMeta("float32", X_MLP.shape, "r", 0)])
            assert header["status"] == "ok", (endpoint, header)


def test_the_daemons_own_arena_is_refused(shm_daemon):
    pid = shm_daemon.status()["pid"]
    arenas = sorted(SHM_DIR.glob(f"inferd-{pid}-*"))
    assert arenas, "the daemon's arena is not in /dev/shm"
    assert arenas[0].name.startswith(PREFIX), "the prefix would let it through: the arena rule alone refuses"
    with RawPeer(shm_daemon.endpoint) as peer:
        reply = ask(peer, register("arena", arenas[0].name, 64))
        assert reply["status"] == "invalid" and "one of the daemon's own arenas" in reply["error"]


def test_a_symlink_is_refused_not_followed(shm_daemon, tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"s" * 4096)
    link = SHM_DIR / f"inferd-client-link-{uuid.uuid4().hex[:12]}"
    link.symlink_to(target)
    try:
        with RawPeer(shm_daemon.endpoint) as peer:
            reply = ask(peer, register("link", link.name, 64))
        assert reply["status"] == "invalid" and "it is a symbolic link" in reply["error"]
    finally:
        link.unlink()


def test_a_name_without_the_prefix_is_refused(shm_daemon, shm_file):
    key = shm_file(1024, prefix="client-")
    with RawPeer(shm_daemon.endpoint) as peer:
        reply = ask(peer, register("r", key, 64))
        assert reply["status"] == "invalid"
        assert f"does not start with '{PREFIX}' (server.client_shm_prefix)" in reply["error"]
        for bad in ("../" + key, "inferd-client-a/b"):
            reply = ask(peer, register("r", bad, 64))
            assert reply["status"] == "invalid" and "is not a shared-memory name" in reply["error"], bad


def test_a_window_larger_than_the_file_is_refused_at_registration(shm_daemon, shm_file):
    key = shm_file(100)
    with RawPeer(shm_daemon.endpoint) as peer:
        reply = ask(peer, register("r", key, 64, offset=50))
        assert reply["status"] == "invalid"
        assert "is 100 bytes, too small for byte_size 64 at offset 50" in reply["error"]
        assert ask(peer, register("r", key, 50, offset=50))["status"] == "ok", "exactly the file: allowed"


def test_a_region_truncated_under_the_daemon_is_invalid_and_the_daemon_serves_on(shm_daemon, shm_file):
    pids = [w["pid"] for w in shm_daemon.status()["workers"]]
    key = shm_file(4096)
    with RawPeer(shm_daemon.endpoint) as peer:
        assert ask(peer, register("r", key, 4096))["status"] == "ok"
        os.truncate(SHM_DIR / key, 100)  # what a careless or hostile client may do at any moment
        # Back to back, so that they may share batches: only those naming the region fail.
        messages = {
            "inline-0": protocol.encode_request("inline-0", "mlp", [X_MLP]),
            "input": protocol.encode_request("input", "mlp", [TensorMeta("float32", X_MLP.shape, "r", 1024)]),
            "inline-1": protocol.encode_request("inline-1", "mlp", [X_MLP]),
            "output": protocol.encode_request("output", "mlp", [X_MLP], outputs=[OutputPlace("r", 1024)]),
            "inline-2": protocol.encode_request("inline-2", "mlp", [X_MLP]),
        }
        for frames in messages.values():
            peer.send_frames(frames)
        replies = {}
        for _ in messages:
            header, _ = peer.recv()
            replies[header["id"]] = header
        assert peer.nothing_more(0.1)
    assert {i: h["status"] for i, h in replies.items()} == {
        "inline-0": "ok", "input": "invalid", "inline-1": "ok", "output": "invalid", "inline-2": "ok"}
    assert "region 'r' was truncated: 0 of the 64 bytes asked for at offset 1024" in replies["input"]["error"]
    assert "region 'r' was truncated: it no longer holds bytes 1024 to 1040" in replies["output"]["error"]
    assert os.stat(SHM_DIR / key).st_size == 100, "the daemon never grows a client's file"
    assert_serving(shm_daemon, pids)


def test_another_connections_region_cannot_be_named(shm_daemon, shm_file):
    key = shm_file(1024)
    with RawPeer(shm_daemon.endpoint) as first, shm_daemon.client() as second:
        assert ask(first, register("mine", key, 1024))["status"] == "ok"
        with RawPeer(shm_daemon.endpoint) as other:
            header, _ = infer_raw(other, "q", "mlp", [TensorMeta("float32", X_MLP.shape, "mine", 0)])
            assert header["status"] == "invalid"
            assert "no region 'mine' is registered on this connection" in header["error"]
            header, _ = infer_raw(other, "o", "mlp", [X_MLP], (OutputPlace("mine", 0),))
            assert header["status"] == "invalid" and "no region 'mine'" in header["error"]
            assert ask(other, RegionStatus(id="s", name="mine"))["status"] == "invalid"
            assert ask(other, UnregisterRegion(id="u", name="mine"))["regions"] == []
        assert second.regions() == [], "a client sees only its own connection's regions"
        assert [r["name"] for r in ask(first, RegionStatus(id="still"))["regions"]] == ["mine"]
        header, _ = infer_raw(first, "mine", "mlp", [TensorMeta("float32", X_MLP.shape, "mine", 0)])
        assert header["status"] == "ok"


def test_a_connections_regions_go_when_it_disconnects(shm_daemon, shm_file):
    keys = [shm_file(1024) for _ in range(2)]
    pid = shm_daemon.status()["pid"]
    with RawPeer(ipc(shm_daemon)) as over_ipc, RawPeer(shm_daemon.endpoint) as over_tcp:
        for peer, key in ((over_ipc, keys[0]), (over_tcp, keys[1])):
            assert ask(peer, register("dropme", key, 1024))["status"] == "ok"
        owners = [r["owner"] for r in daemon_regions(shm_daemon) if r["name"] == "dropme"]
        assert len(owners) == 2 and all(holds_open(pid, key) for key in keys)
        over_ipc.close()
        wait_for(lambda: not holds_open(pid, keys[0]), timeout=10, what="the ipc connection's region closing")
        assert [r["key"] for r in daemon_regions(shm_daemon) if r["name"] == "dropme"] == [keys[1]]
    wait_for(lambda: not any(r["name"] == "dropme" for r in daemon_regions(shm_daemon)), timeout=10,
             what="the tcp connection's region leaving the daemon's stats")
    assert not holds_open(pid, keys[1])
    assert all((SHM_DIR / key).exists() for key in keys), "the daemon never unlinks a client's file"


def test_a_new_connection_keeps_its_regions_when_an_old_one_drops(shm_daemon, shm_file):
    """One connection registers and leaves; the next one, which likely gets the same file descriptor,
    registers while the daemon is busy with another client's requests (so that it may read the new
    connection's message before the old one's disconnect). The new connection's region must stay."""
    key = shm_file(1024)
    lost = 0
    with RawPeer(ipc(shm_daemon)) as busy:
        for attempt in range(30):
            with RawPeer(ipc(shm_daemon)) as leaving:
                assert ask(leaving, register("old", key, 1024))["status"] == "ok"
                for index in range(100):
                    busy.send(index, "mlp", [X_MLP])
            with RawPeer(ipc(shm_daemon)) as staying:
                assert ask(staying, register("new", key, 1024))["status"] == "ok"
                wait_for(lambda: not any(r["name"] == "old" for r in daemon_regions(shm_daemon)), timeout=10,
                         what="the old connection's region leaving")
                for _ in range(100):
                    assert busy.recv()[0]["status"] == "ok"
                lost += not ask(staying, RegionStatus(id=attempt))["regions"]
    assert lost == 0, f"the staying connection lost its region in {lost} of 30 attempts"


# --- Anything at all --------------------------------------------------------------------------------

VALID = "<a file that exists>"  # replaced by the test's own region file
names = st.one_of(st.sampled_from(["a", "fuzz", "", "x" * 201, "../x", "a/b"]), st.text(max_size=6))
region_messages = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(["register_region", "unregister_region", "region_status"]),
                     st.sampled_from(["", "x", "REGISTER_REGION"]), st.integers(), st.none())},
    optional={
        "id": st.one_of(st.integers(-2**70, 2**70), st.text(max_size=4), st.none(), st.floats()),
        "name": st.one_of(names, st.integers()),
        "key": st.one_of(st.sampled_from([VALID, f"/{VALID}", "inferd-client-missing", "client-x", "/etc/passwd",
                                          "../../etc/passwd", "", "."]), st.text(max_size=12)),
        "offset": st.one_of(st.integers(-3, 5000), st.integers(-2**70, 2**70)),
        "byte_size": st.one_of(st.integers(-3, 5000), st.integers(-2**70, 2**70)),
        "peer": st.one_of(st.none(), st.text(max_size=4)),
        "x": st.integers(),
    },
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=region_messages, extra=st.lists(st.binary(max_size=8), max_size=2))
def test_any_region_message_gets_exactly_one_reply_and_the_daemon_serves_on(shm_daemon, shm_file, message, extra):
    if not hasattr(shm_file, "key"):
        shm_file.key = shm_file(4096)  # one file for every example of the test
    for field in ("key", "name"):
        if isinstance(message.get(field), str):
            message[field] = message[field].replace(VALID, shm_file.key)
    with RawPeer(shm_daemon.endpoint) as peer:
        peer.send_frames([msgspec.json.encode(message), *extra])
        header, _ = peer.recv(timeout=10)
        assert header["status"] in ("ok", "invalid"), header
        assert (header["status"] == "ok") == ("regions" in header), header
        assert peer.nothing_more(0.05)
        peer.send("check", "mlp", [X_MLP])
        assert peer.recv()[0]["status"] == "ok"
        assert ask(peer, RegionStatus(id="listed"))["status"] == "ok"
