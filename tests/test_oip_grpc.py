"""The Open Inference Protocol over gRPC, spoken by Triton's own client (tritonclient.grpc), unmodified,
against the real daemon; answers checked against the same models run in-process.

This process loads tritonclient's generated messages, never inferd's (both define the `inference`
package, so one process cannot hold both): inferd's own messages are looked at in subprocesses.
"""

from __future__ import annotations

import asyncio
import base64
import json
import queue
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import ml_dtypes
import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from conftest import MLP, NAMED_PAIR, ONE_AT_A_TIME, Daemon, pipeline_held, reference, wait_for
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from wire import RawPeer

from inferd.harness import free_port, to_toml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def oip(oip_daemon: Daemon) -> Daemon:
    return oip_daemon


def client(daemon: Daemon) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(daemon.config["server"]["grpc"])


def mlp_input(x: np.ndarray) -> grpcclient.InferInput:
    given = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    return given


def test_an_output_asked_for_as_classification_is_refused_not_answered_as_the_tensor(oip):
    wanted = grpcclient.InferRequestedOutput("OUTPUT__0", class_count=2)
    with pytest.raises(InferenceServerException, match="output 'OUTPUT__0' is asked for as classification") as refused:
        client(oip).infer("mlp", [mlp_input(np.zeros((1, models.MLP_IN), np.float32))], outputs=[wanted])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_health_metadata_config_and_statistics_as_tritonclient_reads_them(oip):
    c = client(oip)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("mlp")
    # As Triton answers: a model or version it does not serve is not ready, not an error.
    assert not c.is_model_ready("mlp", model_version="v1") and not c.is_model_ready("nope")
    assert c.is_model_ready("mlp", model_version="2")  # v2, by its number
    server = c.get_server_metadata(as_json=True)
    assert server["name"] == "inferd" and "model_configuration" in server["extensions"]
    meta = c.get_model_metadata("pair", as_json=True)
    assert meta["versions"] == ["v1"] and meta["platform"] == "pytorch_libtorch"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [("a", "FP32", ["-1", "3", "4"]),
                                                                               ("b", "INT64", ["-1", "2"])]
    assert [t["name"] for t in meta["outputs"]] == ["scaled", "doubled"]
    config = c.get_model_config("mlp").config
    assert config.name == "mlp" and config.max_batch_size == 16 and config.platform == "pytorch_libtorch"
    assert config.input[0].name == "INPUT__0" and list(config.input[0].dims) == [models.MLP_IN]
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_FP32
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.instance_group[0].kind == grpcclient.model_config_pb2.ModelInstanceGroup.KIND_CPU
    c.infer("mlp", [mlp_input(np.zeros((2, models.MLP_IN), dtype=np.float32))])
    stats = c.get_inference_statistics("mlp").model_stats
    assert stats[0].name == "mlp" and stats[0].version == "2" and stats[0].inference_count >= 2
    assert stats[0].inference_stats.success.count >= 1 and stats[0].inference_stats.queue.ns > 0
    everything = {s.name for s in c.get_inference_statistics().model_stats}
    assert "mlp" in everything


def test_infer_answers_like_the_model_in_process_with_the_outputs_asked_for(oip, repo):
    expected = reference(repo, "pair", "v1")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 3, 4), dtype=np.float32)
    b = rng.integers(-100, 100, (5, 2), dtype=np.int64)
    inputs = [grpcclient.InferInput("a", list(a.shape), "FP32"), grpcclient.InferInput("b", list(b.shape), "INT64")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client(oip).infer("pair", inputs, request_id="r-9")
    e0, e1 = expected(a, b)
    np.testing.assert_allclose(result.as_numpy("scaled"), e0, rtol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("doubled"), e1)
    response = result.get_response()
    assert response.id == "r-9" and response.model_version == "v1"
    only = client(oip).infer("pair", inputs, outputs=[grpcclient.InferRequestedOutput("doubled")])
    assert only.as_numpy("scaled") is None
    np.testing.assert_array_equal(only.as_numpy("doubled"), e1)


def test_bf16_in_and_out_in_raw_contents(oip, repo):
    x = np.random.default_rng(4).standard_normal((3, models.BF16_FEATURES), dtype=np.float32).astype(ml_dtypes.bfloat16)
    given = grpcclient.InferInput("INPUT__0", list(x.shape), "BF16")
    given.set_data_from_numpy(x)
    result = client(oip).infer("bf16", [given])
    e0, e1 = reference(repo, "bf16", "v1")(x)
    assert result.as_numpy("OUTPUT__0").dtype == ml_dtypes.bfloat16
    assert result.as_numpy("OUTPUT__0").tobytes() == e0.tobytes()
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), e1)
    config = client(oip).get_model_config("bf16").config
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_BF16


def test_a_pinned_version_compression_and_a_deadline_that_is_met(oip, repo):
    x = np.random.default_rng(1).standard_normal((3, models.MLP_IN), dtype=np.float32)
    for algorithm in ("gzip", "deflate", None):
        result = client(oip).infer("mlp", [mlp_input(x)], model_version="v2", compression_algorithm=algorithm,
                                   timeout=5_000_000)
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), reference(repo, "mlp", "v2")(x), rtol=1e-5,
                                   atol=1e-6)
    with pytest.raises(InferenceServerException,
                       match="Request for unknown model: 'mlp' version 'v1' is not found") as refused:
        client(oip).infer("mlp", [mlp_input(x)], model_version="v1")
    assert refused.value.status() == "StatusCode.NOT_FOUND"


def infer_error(daemon: Daemon, model: str, inputs: list[grpcclient.InferInput], **kwargs) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as failed:
        client(daemon).infer(model, inputs, **kwargs)
    return failed.value.status(), failed.value.message()


def raw_input(name: str, datatype: str, shape: list[int], data: bytes) -> grpcclient.InferInput:
    given = grpcclient.InferInput(name, shape, datatype)
    given._raw_content = data  # a payload that disagrees with the shape; tritonclient would not build one
    return given


ONE = np.zeros((1, models.MLP_IN), dtype=np.float32)
ERRORS = [
    ("unknown model", "nope", [mlp_input(ONE)], "StatusCode.NOT_FOUND",
     "Request for unknown model: 'nope' is not found"),
    ("unknown input", "mlp", [raw_input("x", "FP32", [1, 16], ONE.tobytes())], "StatusCode.INVALID_ARGUMENT",
     "has no input 'x'"),
    ("wrong datatype", "mlp", [raw_input("INPUT__0", "FP64", [1, 16], bytes(128))], "StatusCode.INVALID_ARGUMENT",
     "is FP64, but mlp takes FP32"),
    ("bytes", "mlp", [raw_input("INPUT__0", "BYTES", [1, 16], bytes(64))], "StatusCode.INVALID_ARGUMENT",
     "is BYTES, but mlp takes FP32"),
    ("shape and bytes disagree", "mlp", [raw_input("INPUT__0", "FP32", [2, 16], ONE.tobytes())],
     "StatusCode.INVALID_ARGUMENT", "has 64 bytes of data, but FP32 [2, 16] needs 128"),
    ("negative dim", "mlp", [raw_input("INPUT__0", "FP32", [-1, 16], ONE.tobytes())], "StatusCode.INVALID_ARGUMENT",
     "at least 1"),
    ("huge dims", "mlp", [raw_input("INPUT__0", "FP32", [2**40, 2**40], b"")], "StatusCode.INVALID_ARGUMENT",
     "elements"),
    ("batch too big", "mlp", [mlp_input(np.zeros((17, 16), dtype=np.float32))], "StatusCode.INVALID_ARGUMENT",
     "over max_batch_size 16"),
    ("model error", "failing", [mlp_input(np.array([[-1.0, 2.0]], dtype=np.float32))], "StatusCode.INTERNAL",
     "negative input refused by the model"),
]


@pytest.mark.parametrize("case, model, inputs, status, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_each_bad_request_gets_its_status_and_a_sentence_and_the_daemon_serves_on(oip, case, model, inputs, status,
                                                                                 message):
    got, text = infer_error(oip, model, inputs)
    assert got == status and message in text, (got, text)
    assert client(oip).infer("mlp", [mlp_input(ONE)]).as_numpy("OUTPUT__0").shape == (1, models.MLP_OUT)


def call_raw(daemon: Daemon, method: str, body: bytes) -> grpc.RpcError | bytes:
    """One call of the service with `body` as its request, bytes as they are."""
    with grpc.insecure_channel(daemon.config["server"]["grpc"]) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        try:
            return call(body, timeout=20)
        except grpc.RpcError as exc:
            return exc


def test_typed_contents_are_taken_and_bytes_that_are_not_a_message_are_invalid(oip, repo):
    x = np.random.default_rng(2).standard_normal((2, models.MLP_IN), dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT__0", datatype="FP32", shape=[2, models.MLP_IN]).contents.fp32_contents.extend(
        x.ravel().tolist())
    answer = service_pb2.ModelInferResponse.FromString(call_raw(oip, "ModelInfer", request.SerializeToString()))
    np.testing.assert_allclose(np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).reshape(2, -1),
                               reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    half = service_pb2.ModelInferRequest(model_name="mlp")
    half.inputs.add(name="INPUT__0", datatype="FP16", shape=[1, 16]).contents.fp32_contents.append(1.0)
    refused = call_raw(oip, "ModelInfer", half.SerializeToString())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "no typed contents" in refused.details()
    mixed = service_pb2.ModelInferRequest(model_name="mlp")
    contents = mixed.inputs.add(name="INPUT__0", datatype="FP32", shape=[2, models.MLP_IN]).contents
    contents.fp32_contents.extend(x.ravel().tolist())
    contents.int_contents.append(7)  # values the datatype's contents leave out would be dropped unread
    refused = call_raw(oip, "ModelInfer", mixed.SerializeToString())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "has contents.int_contents too" in refused.details()
    garbage = call_raw(oip, "ModelInfer", b"\xff\xff\xff\xff")
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a inference.ModelInferRequest message" in garbage.details()
    unimplemented = call_raw(oip, "TraceSetting", b"")
    assert unimplemented.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_compressed_message_that_inflates_past_the_limit_is_refused(oip):
    huge = np.zeros((1, (80 << 20) // 4), dtype=np.float32)  # 80 MiB of zeros; the limit is 64 MiB
    given = grpcclient.InferInput("INPUT__0", list(huge.shape), "FP32")
    given.set_data_from_numpy(huge)
    got, _ = infer_error(oip, "mlp", [given], compression_algorithm="gzip")
    assert got == "StatusCode.RESOURCE_EXHAUSTED"
    assert client(oip).is_server_live()


def test_a_huge_name_is_invalid_argument_with_a_sentence_that_quotes_200_characters_of_it(oip):
    # Quoted whole, the name made a status too large for the client to take: RESOURCE_EXHAUSTED, not why.
    name = "x" * (1 << 20)
    got, text = infer_error(oip, "mlp", [raw_input(name, "FP32", [1, 16], ONE.tobytes())])
    assert got == "StatusCode.INVALID_ARGUMENT", (got, text[:300])
    assert text == "mlp has no input '" + "x" * 199 + "... (cut at 200 characters); it takes INPUT__0"
    got, text = infer_error(oip, name, [mlp_input(ONE)])
    assert got == "StatusCode.NOT_FOUND" and len(text) < 400 and "(cut at 200 characters)" in text
    assert client(oip).is_server_live()


def test_grpc_http_and_zeromq_clients_at_once_are_batched_together(start_daemon, repo, gates):
    # A daemon of its own, whose one executor is held while the requests of the three protocols queue: sent
    # to an idle one, they would be batched only as far as they happened to arrive faster than batches ran.
    daemon = start_daemon({"mlp": MLP, "variable": ONE_AT_A_TIME}, workers={"streams": 1},
                          server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"})
    expected = reference(repo, "mlp", "v2")
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, models.MLP_IN), dtype=np.float32) for _ in range(90)]

    async def over_grpc(batch: list[np.ndarray]) -> list[np.ndarray]:
        async with aioclient.InferenceServerClient(daemon.config["server"]["grpc"]) as c:
            async def one(x: np.ndarray) -> np.ndarray:
                given = aioclient.InferInput("INPUT__0", list(x.shape), "FP32")
                given.set_data_from_numpy(x)
                return (await c.infer("mlp", [given])).as_numpy("OUTPUT__0")
            return await asyncio.gather(*(one(x) for x in batch))

    http = httpclient.InferenceServerClient(daemon.config["server"]["http"], concurrency=30)
    with RawPeer(daemon.endpoint) as peer, daemon.client() as zmq_client, ThreadPoolExecutor(1) as grpc_thread:
        with pipeline_held(daemon, gates, lambda gate, full: peer.send(gate.number, "variable", [gate.input])):
            grpc_answers = grpc_thread.submit(asyncio.run, over_grpc(xs[:30]))
            http_futures = []
            for x in xs[30:60]:
                given = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
                given.set_data_from_numpy(x)
                http_futures.append(http.async_infer("mlp", [given]))
            zmq_futures = [zmq_client.submit("mlp", x) for x in xs[60:]]
            wait_for(lambda: daemon.status()["models"]["mlp"]["queue_depth"] == 90, what="all queued")
        answers = grpc_answers.result() + [f.get_result().as_numpy("OUTPUT__0") for f in http_futures] + [
            f.result() for f in zmq_futures]
    http.close()
    for x, y in zip(xs, answers):
        np.testing.assert_allclose(y, expected(x), rtol=1e-5, atol=1e-6)
    sizes = daemon.call("stats")["models"]["mlp"]["batch_size"]["distribution"]
    # 90 requests of one sample in batches of up to 16 (max_batch_size): five of 16 and one of 10, so the 30
    # of no protocol went alone.
    assert sizes == {"16": 5, "10": 1}, sizes
    by_protocol = daemon.call("stats")["models"]["mlp"]["requests_by_protocol"]
    assert by_protocol["grpc"]["ok"] == 30 and by_protocol["http"]["ok"] == 30


def grpc_daemon(start_daemon, **sections) -> Daemon:
    server = {"grpc": f"127.0.0.1:{free_port()}", **sections.pop("server", {})}
    return start_daemon({"variable": ONE_AT_A_TIME}, server=server, workers={"streams": 1}, **sections)


def test_deadline_overloaded_and_draining_have_their_status(start_daemon, gates):
    daemon = grpc_daemon(start_daemon, queue={"max_size": 1})
    small = grpcclient.InferInput("INPUT__0", [1, 2], "FP32")
    small.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    late: queue.Queue = queue.Queue()
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send("blocker", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
        # 100 ms: it waits behind the blocker, in the executor's pipeline, and cannot be met.
        client(daemon).async_infer("variable", [small], lambda result, error: late.put(error), timeout=100_000)
        wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="the executor's pipeline full")
        peer.send(0, "variable", [np.ones((1, 2), dtype=np.float32)], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 1, what="the queue's one place taken")
        got, text = infer_error(daemon, "variable", [small])
        assert got == "StatusCode.UNAVAILABLE" and "queue is full" in text  # Triton's code, which clients retry
        error = late.get(timeout=30)
        assert error.status() == "StatusCode.DEADLINE_EXCEEDED" and "deadline" in error.message()
        gate.open()
        assert [peer.recv()[0]["status"] for _ in range(2)] == ["ok"] * 2
        gate = gates()
        peer.send("blocker2", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy again")
        daemon.signal(signal.SIGTERM)
        wait_for(lambda: daemon.status()["state"] == "draining", what="the drain")
        got, text = infer_error(daemon, "variable", [small])
        assert got == "StatusCode.UNAVAILABLE" and "shutting down" in text
        gate.open()
        assert peer.recv()[0]["status"] == "ok", "what was running finishes"
    assert daemon.wait(30) == 0


def test_inferds_messages_have_tritons_field_numbers():
    """The wire contract: every field of inferd's messages has the number, type and label of Triton's."""
    dump = (
        "import json, sys\n"
        "from google.protobuf import descriptor_pb2\n"
        "def walk(proto, prefix, out):\n"
        "    for m in proto:\n"
        "        name = prefix + '.' + m.name\n"
        "        out[name] = {f.name: [f.number, f.type, f.label, f.type_name] for f in m.field}\n"
        "        walk(m.nested_type, name, out)\n"
        "out = {}\n"
        "for module in sys.argv[1:]:\n"
        "    file = descriptor_pb2.FileDescriptorProto()\n"
        "    __import__(module, fromlist=['DESCRIPTOR']).DESCRIPTOR.CopyToProto(file)\n"
        "    walk(file.message_type, '.' + file.package, out)\n"
        "    for e in file.enum_type:\n"
        "        out['.inference.' + e.name] = {v.name: v.number for v in e.value}\n"
        "print(json.dumps(out))\n"
    )

    def messages(*modules: str) -> dict:
        done = subprocess.run([sys.executable, "-c", dump, *modules], capture_output=True, text=True, cwd=ROOT,
                              check=True)
        return json.loads(done.stdout)

    ours = messages("inferd.oip.inference_pb2")
    theirs = messages("tritonclient.grpc.service_pb2", "tritonclient.grpc.model_config_pb2")
    assert len(ours) > 30
    for name, fields in ours.items():
        assert name in theirs, name
        for field, shape in fields.items():
            assert theirs[name].get(field) == shape, (name, field, shape, theirs[name].get(field))


def test_the_checked_in_messages_are_what_protoc_makes_of_the_proto(tmp_path):
    folder = ROOT / "inferd" / "oip"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{folder}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", str(folder / "inference.proto")], check=True)
    for name in ("inference_pb2.py", "inference_pb2.pyi"):
        assert (tmp_path / name).read_text() == (folder / name).read_text(), f"{name} is stale: run `make proto`"



def test_inferctl_status_lists_both_gateways(oip):
    inferctl = Path(sys.executable).parent / "inferctl"
    shown = subprocess.run([str(inferctl), "--control", oip.control, "status"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    server = oip.config["server"]
    gateways = {g["protocol"]: g for g in oip.status()["gateways"]}
    assert set(gateways) == {"http", "grpc"} and all(g["pid"] for g in gateways.values())
    for name in ("http", "grpc"):
        line = next(line for line in shown.splitlines() if line.strip().startswith(name))
        assert f"pid {gateways[name]['pid']}" in line and server[name] in line and "restarts 0" in line


def test_a_sighup_reaches_both_gateways_a_model_it_adds_is_served_and_changed_batching_is_reported(start_daemon,
                                                                                                   repo):
    mlp = {**MLP, "max_wait_ms": 2}
    daemon = start_daemon({"mlp": mlp}, server={"http": f"127.0.0.1:{free_port()}",
                                                "grpc": f"127.0.0.1:{free_port()}"})
    http = httpclient.InferenceServerClient(daemon.config["server"]["http"])
    grpc_client = client(daemon)
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'pair' is not found"):
        http.get_model_metadata("pair")
    config = daemon.config
    config["models"]["mlp"]["max_wait_ms"] = 7
    config["models"]["pair"] = {"repository": str(repo / "pair"), **NAMED_PAIR}
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "pair v1" in daemon.status()["workers"][0]["loaded"], timeout=60, what="pair loaded")
    wait_for(lambda: http.is_model_ready("pair") and grpc_client.is_model_ready("pair"), what="pair ready over OIP")
    a = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    b = np.array([[3, -5]], dtype=np.int64)
    expected = reference(repo, "pair", "v1")(a, b)
    for protocol_client, module in ((http, httpclient), (grpc_client, grpcclient)):
        inputs = [module.InferInput("a", [1, 3, 4], "FP32"), module.InferInput("b", [1, 2], "INT64")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = protocol_client.infer("pair", inputs)
        np.testing.assert_array_equal(result.as_numpy("scaled"), expected[0])
        np.testing.assert_array_equal(result.as_numpy("doubled"), expected[1])
    assert http.get_model_config("mlp")["dynamic_batching"]["max_queue_delay_microseconds"] == 7000
    grpc_config = grpc_client.get_model_config("mlp", as_json=True)["config"]
    assert int(grpc_config["dynamic_batching"]["max_queue_delay_microseconds"]) == 7000


def test_statistics_list_each_ready_version_from_the_start_and_a_version_is_taken_by_number(oip, repo):
    [entry] = client(oip).get_inference_statistics("untouched", as_json=True)["model_stats"]
    assert entry["name"] == "untouched" and entry["version"] == "2"
    assert "inference_count" not in entry or entry["inference_count"] == "0"  # proto3 JSON leaves zeros out
    x = np.random.default_rng(8).standard_normal((2, models.MLP_IN), dtype=np.float32)
    result = client(oip).infer("mlp", [mlp_input(x)], model_version="2")
    assert result.get_response().model_version == "v2"
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    [entry] = client(oip).get_inference_statistics("mlp", model_version="2", as_json=True)["model_stats"]
    stats = entry["inference_stats"]
    assert all(int(stats[phase]["ns"]) > 0 for phase in ("compute_input", "compute_infer", "compute_output"))
    assert sum(int(b["compute_infer"]["count"]) for b in entry["batch_stats"]) == int(entry["execution_count"])


def test_an_output_asked_twice_is_refused_and_cuda_shared_memory_answers_as_a_server_with_none(oip):
    twice = [grpcclient.InferRequestedOutput("OUTPUT__0"), grpcclient.InferRequestedOutput("OUTPUT__0")]
    with pytest.raises(InferenceServerException, match="output 'OUTPUT__0' is requested twice") as refused:
        client(oip).infer("mlp", [mlp_input(ONE)], outputs=twice)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "system_shared_memory" not in client(oip).get_server_metadata(as_json=True)["extensions"]
    assert client(oip).get_system_shared_memory_status(as_json=True) == {}
    assert client(oip).get_cuda_shared_memory_status(as_json=True) == {}
    client(oip).unregister_cuda_shared_memory()
    with pytest.raises(InferenceServerException, match="inferd takes no CUDA shared memory"):
        client(oip).register_cuda_shared_memory("r", base64.b64encode(b"handle"), 0, 64)
