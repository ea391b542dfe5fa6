"""Inputs with a dim of any size (-1 in the config, bounded by max_shape): requests of many lengths over
ZeroMQ, HTTP and gRPC, each answered as the model answers it alone, batched only with requests of their
own shape; shapes past the bound or off the fixed dims refused with a sentence."""

from __future__ import annotations

import shutil
import signal
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import models
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import Daemon, module_daemon, pipeline_held, reference, wait_for
from gates import Gate
from test_cli import inferctl
from tritonclient.utils import InferenceServerException
from wire import RawPeer

from inferd import config, protocol
from inferd.harness import free_port, to_toml
from inferd.ipc.control import ControlError
from inferd.models import model_files
from inferd.models.convert import convert
from inferd.protocol import TensorMeta
from inferd.system.shm_names import SHM_DIR

RAGGED = {"inputs": [{"dtype": "float32", "shape": [2, -1], "max_shape": [2, models.RAGGED_MAX], "name": "x"}],
          "outputs": [{"name": "running"}, {"name": "pooled"}], "max_batch_size": 8,
          # Behind a batch held at a gate, a partial batch waits for company until the test opens the gate
          # (with the executor idle, whatever waits goes at once).
          "max_wait_ms": 60_000}
# The same model with its samples padded with zeros (which change neither its running sums, cut back to each
# request's length, nor its pooled sums): to each batch's longest, or to shape buckets.
PADDED = {**RAGGED, "inputs": [{**RAGGED["inputs"][0], "pad_value": 0}],
          "outputs": [{"name": "running", "unpad": "x:1"}, {"name": "pooled"}]}
BUCKETED = {**PADDED, "shape_buckets": [8, 16, 48]}


@pytest.fixture(scope="module")
def daemon(repo) -> Iterator[Daemon]:
    # One executor: a batch held at a gate keeps the rest waiting, so the test sees how they are batched.
    ragged = str(repo / "ragged")
    with module_daemon(repo, {"ragged": RAGGED, "padded": {**PADDED, "repository": ragged},
                              "bucketed": {**BUCKETED, "repository": ragged}}, workers={"streams": 1},
                       server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                               "metrics": f"127.0.0.1:{free_port()}", "allow_client_shm": True,
                               "client_shm_prefix": "inferd-client-"}) as started:
        yield started


def sample(length: int, seed: int, samples: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (samples, 2, length)).astype(np.float32)


def batches(daemon: Daemon) -> int:
    return daemon.call("stats")["workers"][0]["batches"]


def shape_counts(daemon: Daemon, model: str, shape: str) -> tuple[int, int, int]:
    counts = daemon.call("stats")["models"][model]["shapes"].get(shape, {})
    return counts.get("batches", 0), counts.get("elements", 0), counts.get("padding_elements", 0)


def held(client: Any, model: str) -> Callable[[Gate, bool], Any]:
    """What pipeline_held sends: a batch of `model` that waits at a gate, of one sample, or full (8)."""
    def send(gate: Gate, full: bool) -> Any:
        x = np.zeros((8 if full else 1, 2, 2), dtype=np.float32)
        x[0, 0, 0] = -gate.number
        return client.submit(model, x)
    return send


@pytest.mark.parametrize("model", ["ragged", "padded", "bucketed"])
def test_requests_of_many_lengths_from_many_clients_answer_as_the_model_does_alone(daemon, repo, model):
    expected = reference(repo, "ragged", "v1")
    lengths = [1, 3, 3, 17, models.RAGGED_MAX, 5, 17, 3, 40, 1, 9, 64]
    answers: dict[int, tuple[np.ndarray, ...]] = {}
    failures: list[BaseException] = []

    def one_client(index: int) -> None:
        try:
            with daemon.client() as client:
                for round_ in range(4):
                    x = sample(lengths[index], seed=index * 10 + round_, samples=1 + round_ % 2)
                    answers[index * 10 + round_] = (x, *client.infer(model, x))
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=one_client, args=(index,)) for index in range(len(lengths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert len(answers) == 4 * len(lengths)
    for x, running, pooled in answers.values():
        want_running, want_pooled = expected(x)
        assert running.shape == x.shape[:1] + x.shape[2:] and pooled.shape == (x.shape[0], 4)
        np.testing.assert_allclose(running, want_running, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-5)


# How many batches the requests of each length make, all queued behind batches held, by how the model batches:
# exact shapes apart; padded to the longest, all of them; to buckets, per bucket (5 and 7 in 8, 12 in 16,
# 40 in 48), a smaller bucket riding along in a larger one's batch only if it is at least half as large and
# while it could not fill its own.
@pytest.mark.parametrize("model, lengths, expected_batches", [
    ("ragged", [5, 7, 5, 7, 5, 7], 2),
    ("padded", [5, 7, 40, 1, 64, 12], 1),
    ("bucketed", [5, 7, 5, 7, 5, 7], 1),
    ("bucketed", [12, 5, 7, 12], 1),
    ("bucketed", [40, 5, 12, 12, 40, 7], 3),
    ("bucketed", [12] + [5] * 8, 2),
])
def test_requests_batch_by_shape_or_bucket_and_each_is_answered_as_alone(daemon, repo, gates, model, lengths,
                                                                       expected_batches):
    expected = reference(repo, "ragged", "v1")
    before = batches(daemon)
    with daemon.client() as client:
        with pipeline_held(daemon, gates, held(client, model)):
            inputs = [sample(length, seed) for seed, length in enumerate(lengths)]
            futures = [client.submit(model, x) for x in inputs]
            wait_for(lambda: daemon.status()["models"][model]["queue_depth"] == len(inputs), what="all queued")
        for x, future in zip(inputs, futures):
            running, pooled = future.result()
            want_running, want_pooled = expected(x)
            assert running.shape == want_running.shape, "the padding reached the reply"
            np.testing.assert_allclose(running, want_running, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-5)
    assert batches(daemon) - before == 2 + expected_batches


def test_stats_count_each_shapes_batches_and_the_padding_computed(daemon, gates):
    lengths = [5, 7, 40, 1, 64, 12]
    before = shape_counts(daemon, "padded", f"2x{models.RAGGED_MAX}")
    with daemon.client() as client:
        with pipeline_held(daemon, gates, held(client, "padded")):
            futures = [client.submit("padded", sample(length, seed)) for seed, length in enumerate(lengths)]
            wait_for(lambda: daemon.status()["models"]["padded"]["queue_depth"] == len(lengths), what="all queued")
        for future in futures:
            future.result()
    after = shape_counts(daemon, "padded", f"2x{models.RAGGED_MAX}")
    real = 2 * sum(lengths)
    assert [b - a for a, b in zip(before, after)] == [1, real, 2 * models.RAGGED_MAX * len(lengths) - real]
    shapes = daemon.call("stats")["models"]["padded"]["shapes"]
    assert shapes[f"2x{models.RAGGED_MAX}"]["padding_share"] > 0
    with urllib.request.urlopen(f"http://{daemon.config['server']['metrics']}/metrics", timeout=10) as page:
        scraped = page.read().decode()
    labels = f'{{model="padded",shape="2x{models.RAGGED_MAX}"}}'
    for name, value in zip(("batches_by_shape", "input_elements", "padding_elements"), after):
        assert f"inferd_{name}_total{labels} {float(value)}" in scraped, scraped
    # The text says what padding_share is: elements of padding per element requested (this test's batch alone
    # computed about two for each).
    batches_, elements, padding = after
    table = inferctl(daemon, "stats").stdout
    assert (f"padded shape 2x{models.RAGGED_MAX}: {batches_} batch(es), {elements} input elements requested, {padding} "
            f"of padding ({padding / elements:.2f} per element requested)") in table, table


@pytest.mark.parametrize("shape, sentence", [
    ((1, 2, models.RAGGED_MAX + 1), f"each -1 at most as in max_shape [2, {models.RAGGED_MAX}]"),
    ((1, 3, 5), "takes [N, 2, -1]"),
    ((1, 2), "takes [N, 2, -1]"),
    ((1, 2, 1 << 20), "max_shape"),
], ids=["past max_shape", "fixed dim off", "a dim short", "huge"])
def test_a_shape_the_model_does_not_take_is_refused_with_a_sentence_and_the_daemon_serves_on(daemon, shape,
                                                                                           sentence):
    with RawPeer(daemon.endpoint) as peer:
        peer.send("bad", "ragged", [np.zeros(shape, dtype=np.float32)])
        header, _ = peer.recv()
        assert header["status"] == "invalid" and sentence in header["error"], header
        peer.send("good", "ragged", [sample(6, 1)], timeout_ms=10_000)
        assert peer.recv()[0]["status"] == "ok"


@pytest.mark.parametrize("model", ["ragged", "bucketed"])
def test_the_open_inference_protocol_reports_minus_one_and_takes_each_requests_shape(daemon, repo, model):
    expected = reference(repo, "ragged", "v1")
    server = daemon.config["server"]
    http, grpc = httpclient.InferenceServerClient(server["http"]), grpcclient.InferenceServerClient(server["grpc"])
    metadata = http.get_model_metadata(model)
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2, -1]}]
    # The running sums are as long as the sample; the pooled rows are not.
    assert metadata["outputs"] == [{"name": "running", "datatype": "FP32", "shape": [-1, -1]},
                                   {"name": "pooled", "datatype": "FP32", "shape": [-1, 4]}]
    assert http.get_model_config(model)["input"][0]["dims"] == [2, -1]
    for length, (module, client) in zip([4, 11], [(httpclient, http), (grpcclient, grpc)]):
        x = sample(length, seed=length, samples=2)
        given = module.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        result = client.infer(model, [given])
        want_running, want_pooled = expected(x)
        np.testing.assert_allclose(result.as_numpy("running"), want_running, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("pooled"), want_pooled, rtol=1e-5, atol=1e-5)
    too_long = httpclient.InferInput("x", [1, 2, models.RAGGED_MAX + 1], "FP32")
    too_long.set_data_from_numpy(sample(models.RAGGED_MAX + 1, 0))
    with pytest.raises(InferenceServerException) as refused:
        http.infer(model, [too_long])
    assert "max_shape" in str(refused.value)


def test_a_padded_model_whose_output_follows_the_inputs_without_unpad_is_refused_with_a_sentence(start_daemon,
                                                                                              repo):
    # Were it served, the zeros its samples were padded with would come back in its running sums.
    daemon = start_daemon({"ragged": {**PADDED, "outputs": [{"name": "running"}, {"name": "pooled"}]}}, wait=False)
    assert daemon.wait(90) == 1
    log = daemon.log()
    assert "output 0 of ragged has dims [0] whose size follows the inputs'" in log, log
    assert 'unpad = "x"' in log and "no worker could start" in log


def padding_changes(name: str, version: str, what: str, own: int, padded: int) -> tuple[str, str]:
    """The two parts, around the difference, of the sentence refusing `meanpooled` padded (its pooled output)."""
    return (f"padding changes the answer of {name} {version}: output 1 (pooled) of {what} (x [2, {own}]) differs by "
            "up to ",
            f" once padded (x [2, {padded}]; models.{name}.padding_rtol = 0.001, padding_atol = 1e-05); mask the "
            "padding in the model (an attention mask, masked pooling), or drop pad_value so that requests batch by "
            "exact shape")


@pytest.mark.parametrize(("buckets", "own", "padded"), [([], 32, 64), ([8, 16, 48], 4, 8)])
def test_a_version_whose_answer_padding_changes_is_refused_at_start_with_what_to_do(start_daemon, buckets, own,
                                                                                    padded):
    # Its mean over each row takes the padding in: served, requests batched with longer ones were answered wrong.
    # A sample half as long as what it is padded to: max_shape (64) without buckets, else the first bucket.
    daemon = start_daemon({"meanpooled": {**PADDED, "shape_buckets": buckets}}, wait=False)
    assert daemon.wait(90) == 1
    log = daemon.log()
    before, after = padding_changes("meanpooled", "v1", "a sample made for the check", own, padded)
    assert before in log and after in log, log
    assert "no worker could start" in log


def test_a_reload_to_a_version_whose_answer_padding_changes_is_refused_unless_padding_atol_allows_it(start_daemon,
                                                                                                    repo, workdir):
    pool = workdir / "pool"
    shutil.copytree(repo / "ragged" / "v1", pool / "v1")  # sums, which the padding's zeros leave alone: it loads
    shutil.copytree(repo / "meanpooled" / "v1", pool / "v2")
    np.save(pool / "v2" / "example_input.npy", sample(5, seed=5))  # what the check computes, at 5 and padded to 8
    daemon = start_daemon({"pool": {**BUCKETED, "version": "v1", "repository": str(pool)}})
    with pytest.raises(ControlError) as refused:
        daemon.call("reload", timeout=120, version="v2")
    before, after = padding_changes("pool", "v2", "its example input", 5, 8)
    said = str(refused.value)
    assert said.startswith(f"v2 was not made live: worker0 refused pool v2: {before}") and after in said, said
    assert daemon.status()["models"]["pool"]["live_version"] == "v1"
    # Allowing a little more than the difference the refusal named lets the same version load.
    difference = float(said[len("v2 was not made live: worker0 refused pool v2: ") + len(before):].split()[0])
    config = daemon.config
    config["models"]["pool"]["padding_atol"] = 2 * difference
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP: applied" in daemon.log(), what="the SIGHUP applied")
    assert daemon.call("reload", timeout=120, version="v2")["version"] == "v2"


def test_padded_requests_whose_inputs_lie_in_a_clients_shared_memory_answer_as_alone(daemon, repo):
    expected = reference(repo, "ragged", "v1")
    inputs = [sample(length, seed) for seed, length in enumerate([3, 9, 14])]
    path = SHM_DIR / f"inferd-client-{uuid.uuid4().hex[:12]}"
    path.write_bytes(b"".join(x.tobytes() for x in inputs))
    try:
        with RawPeer(daemon.endpoint) as peer:
            peer.send_frames([protocol.encode_op(protocol.RegisterRegion(id="reg", name="r", key=path.name,
                                                                         byte_size=path.stat().st_size))])
            assert peer.recv()[0]["status"] == "ok"
            offset = 0
            for index, x in enumerate(inputs):
                peer.send_frames(protocol.encode_request(index, "bucketed", [TensorMeta("float32", x.shape, "r",
                                                                                        offset)]))
                offset += x.nbytes
            replies = dict((header["id"], (header, outputs)) for header, outputs in
                           (peer.recv() for _ in inputs))
    finally:
        path.unlink(missing_ok=True)
    for index, x in enumerate(inputs):
        header, (running, pooled) = replies[index]
        assert header["status"] == "ok", header
        want_running, want_pooled = expected(x)
        np.testing.assert_allclose(running, want_running, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-5)


def test_an_output_region_too_small_for_the_requests_own_length_is_refused_before_it_is_computed(daemon, repo):
    expected = reference(repo, "ragged", "v1")
    path = SHM_DIR / f"inferd-client-{uuid.uuid4().hex[:12]}"
    path.write_bytes(bytes(20))  # "running" of one sample of length 5: 5 float32
    short, long = sample(5, 1), sample(12, 2)
    try:
        with RawPeer(daemon.endpoint) as peer:
            peer.send_frames([protocol.encode_op(protocol.RegisterRegion(id="reg", name="out", key=path.name,
                                                                         byte_size=20))])
            assert peer.recv()[0]["status"] == "ok"
            computed = batches(daemon)
            into_region = (protocol.OutputPlace("out", 0),)
            peer.send_frames(protocol.encode_request("long", "padded", [long], outputs=into_region))
            refused, _ = peer.recv()
            assert refused["status"] == "invalid", refused
            assert "output 0 of padded v1 needs bytes 0 to 48 of region 'out', which is 20 bytes" in refused["error"]
            assert batches(daemon) == computed, "it was computed all the same"
            peer.send_frames(protocol.encode_request("short", "padded", [short], outputs=into_region))
            header, (pooled,) = peer.recv()
        assert header["status"] == "ok", header
        running = np.frombuffer(path.read_bytes(), np.float32).reshape(1, 5)
        want_running, want_pooled = expected(short)
        np.testing.assert_allclose(running, want_running, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-5)
    finally:
        path.unlink(missing_ok=True)


class MaskedMean(torch.nn.Module):
    """Token ids and their mask (int64 [L] each) -> float32 [8]: the mean of the ids' embeddings where the mask
    is 1 (an answer the padding does not change)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).to(torch.float32)
        return (self.embed(ids) * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def test_convert_exports_a_model_of_any_length_with_a_dim_for_its_minus_ones(workdir):
    torch.manual_seed(34)
    (workdir / "masked" / "v1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(MaskedMean().eval()), str(workdir / "masked" / "v1" / "model.pt"))
    token = {"dtype": "int64", "shape": [-1], "max_shape": [16], "pad_value": 0}
    model = config.parse({"models": {"masked": {"repository": str(workdir / "masked"), "max_batch_size": 8,
                                                "inputs": [{**token, "name": "ids"}, {**token, "name": "mask"}],
                                                "shape_buckets": [4, 16]}}}).models["masked"]
    said: list[str] = []  # in this process: test_formats runs the command itself
    convert("masked", model, "v1", "v2", model_files.EXPORTED, "cpu", said.append)
    assert "checking v2 against v1 at batch sizes 1, 2, 8 and -1 dims of 1, 5, 16" in said, said
    exported = torch.export.load(str(workdir / "masked" / "v2" / "model.pt2")).module()
    scripted = torch.jit.load(str(workdir / "masked" / "v1" / "model.pt"))
    rng = np.random.default_rng(34)
    for batch, length in ((1, 3), (6, 11), (8, 16)):
        ids = torch.from_numpy(rng.integers(0, 50, (batch, length)))
        mask = torch.from_numpy((rng.random((batch, length)) < 0.7).astype(np.int64))
        with torch.inference_mode():
            np.testing.assert_allclose(exported(ids, mask).numpy(), scripted(ids, mask).numpy(), rtol=1e-5,
                                       atol=1e-6)
    too_long = torch.zeros((1, 17), dtype=torch.int64)
    with pytest.raises(Exception, match="<= 16"):  # past max_shape: the program's own guard refuses it
        exported(too_long, too_long)
