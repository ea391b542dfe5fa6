"""The Open Inference Protocol over HTTP, spoken by Triton's own client (tritonclient.http), unmodified,
against the real daemon; answers checked against the same models run in-process."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import models
import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from conftest import MLP, ONE_AT_A_TIME, Daemon, pipeline_held, reference, wait_for
from tritonclient.utils import InferenceServerException
from wire import RawPeer

from inferd.harness import free_port


@pytest.fixture(scope="module")
def oip(oip_daemon: Daemon) -> Daemon:
    return oip_daemon


def url(daemon: Daemon) -> str:
    return daemon.config["server"]["http"]


def client(daemon: Daemon) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(url(daemon))


def test_health_metadata_and_config_as_tritonclient_reads_them(oip):
    c = client(oip)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("mlp")
    server = c.get_server_metadata()
    assert server["name"] == "inferd" and "binary_tensor_data" in server["extensions"]
    meta = c.get_model_metadata("pair")
    assert meta["versions"] == ["v1"]
    assert meta["inputs"] == [{"name": "a", "datatype": "FP32", "shape": [-1, 3, 4]},
                              {"name": "b", "datatype": "INT64", "shape": [-1, 2]}]
    assert meta["outputs"] == [{"name": "scaled", "datatype": "FP32", "shape": [-1, 3]},
                               {"name": "doubled", "datatype": "INT64", "shape": [-1, 2]}]
    config = c.get_model_config("mlp")
    assert config["max_batch_size"] == 16 and config["input"][0] == {"name": "INPUT__0", "data_type": "TYPE_FP32",
                                                                     "dims": [16]}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert c.get_model_metadata("mlp", model_version="v2")["name"] == "mlp"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_with_binary_or_json_data_answers_like_the_model_in_process(oip, repo, binary):
    expected = reference(repo, "pair", "v1")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 3, 4), dtype=np.float32)
    b = rng.integers(-100, 100, (5, 2), dtype=np.int64)
    inputs = [httpclient.InferInput("a", list(a.shape), "FP32"), httpclient.InferInput("b", list(b.shape), "INT64")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("scaled", binary_data=binary),
               httpclient.InferRequestedOutput("doubled", binary_data=not binary)]
    result = client(oip).infer("pair", inputs, outputs=outputs, request_id="r-7")
    e0, e1 = expected(a, b)
    np.testing.assert_allclose(result.as_numpy("scaled"), e0, rtol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("doubled"), e1)
    response = result.get_response()
    assert response["id"] == "r-7" and response["model_version"] == "v1"


def test_an_output_holding_nan_or_infinity_asked_for_as_json_comes_as_binary_data(oip, repo):
    # JSON has no number for them: written as null, +inf and -inf would both come back NaN.
    a = np.random.default_rng(5).standard_normal((3, 3, 4), dtype=np.float32)
    a[0, 0, 0], a[1, 0, 0], a[2, 0, :2] = np.inf, -np.inf, (np.inf, -np.inf)
    b = np.zeros((3, 2), np.int64)
    inputs = [httpclient.InferInput("a", list(a.shape), "FP32"), httpclient.InferInput("b", list(b.shape), "INT64")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=False) for name in ("scaled", "doubled")]
    result = client(oip).infer("pair", inputs, outputs=outputs)
    scaled, doubled = reference(repo, "pair", "v1")(a, b)
    assert np.isposinf(scaled).any() and np.isneginf(scaled).any() and np.isnan(scaled).any()
    np.testing.assert_array_equal(result.as_numpy("scaled"), scaled)
    entries = {entry["name"]: entry for entry in result.get_response()["outputs"]}
    assert entries["scaled"]["parameters"] == {"binary_data_size": scaled.nbytes} and "data" not in entries["scaled"]
    assert entries["doubled"]["data"] == doubled.ravel().tolist(), "a finite output is still JSON"


def test_bf16_travels_as_binary_and_comes_back_as_json_numbers_too(oip, repo):
    x = np.random.default_rng(4).standard_normal((3, models.BF16_FEATURES), dtype=np.float32).astype(ml_dtypes.bfloat16)
    given = httpclient.InferInput("INPUT__0", list(x.shape), "BF16")
    given.set_data_from_numpy(x, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT__0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT__1", binary_data=False)]
    result = client(oip).infer("bf16", [given], outputs=outputs)
    e0, e1 = reference(repo, "bf16", "v1")(x)
    assert result.as_numpy("OUTPUT__0").dtype == ml_dtypes.bfloat16
    assert result.as_numpy("OUTPUT__0").tobytes() == e0.tobytes()
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), e1)
    json_out = client(oip).infer("bf16", [given], outputs=[httpclient.InferRequestedOutput("OUTPUT__0",
                                                                                           binary_data=False)])
    np.testing.assert_array_equal(np.asarray(json_out.get_response()["outputs"][0]["data"], dtype=np.float32),
                                  e0.astype(np.float32).ravel())
    assert client(oip).get_model_config("bf16")["input"][0]["data_type"] == "TYPE_BF16"


def test_half_precision_inputs_are_taken_as_json_numbers_where_triton_refuses_them(oip, repo):
    # docs/protocols/oip.md lists it among the differences from Triton: each number rounded to the datatype.
    x = np.random.default_rng(13).standard_normal((2, models.BF16_FEATURES))
    request = {"inputs": [{"name": "INPUT__0", "datatype": "BF16", "shape": list(x.shape), "data": x.ravel().tolist()}],
               "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}}]}
    answer, data = binary_answer(requests.post(f"http://{url(oip)}/v2/models/bf16/infer", json=request, timeout=20))
    assert answer["outputs"][0]["datatype"] == "BF16"
    expected = reference(repo, "bf16", "v1")(x.astype(ml_dtypes.bfloat16))[0]
    assert data == expected.tobytes()


def test_a_pinned_version_gzip_bodies_and_a_deadline(oip, repo):
    x = np.random.default_rng(1).standard_normal((3, models.MLP_IN), dtype=np.float32)
    given = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client(oip).infer("mlp", [given], model_version="v2", request_compression_algorithm="gzip",
                               timeout=5_000_000)
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    by_number = client(oip).infer("mlp", [given], model_version="2")  # v2's number: Triton's tools send those
    np.testing.assert_array_equal(by_number.as_numpy("OUTPUT__0"), result.as_numpy("OUTPUT__0"))
    assert by_number.get_response()["model_version"] == "v2"
    with pytest.raises(InferenceServerException,
                       match="Request for unknown model: 'mlp' version 'v1' is not found") as refused:
        client(oip).infer("mlp", [given], model_version="v1")
    assert refused.value.status() == "404"


def post(daemon: Daemon, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url(daemon)}{path}", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_an_output_asked_for_as_classification_is_refused_not_answered_as_the_tensor(oip):
    given = httpclient.InferInput("INPUT__0", [1, models.MLP_IN], "FP32")
    given.set_data_from_numpy(np.zeros((1, models.MLP_IN), np.float32))
    with pytest.raises(InferenceServerException, match="output 'OUTPUT__0' is asked for as classification") as refused:
        client(oip).infer("mlp", [given], outputs=[httpclient.InferRequestedOutput("OUTPUT__0", class_count=2)])
    assert refused.value.status() == "400"


def test_an_empty_list_of_outputs_asks_for_every_output(oip, repo):
    a = np.random.default_rng(6).standard_normal((1, 3, 4), dtype=np.float32)
    b = np.array([[2, -3]], np.int64)
    request = {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 3, 4], "data": a.ravel().tolist()},
                          {"name": "b", "datatype": "INT64", "shape": [1, 2], "data": b.ravel().tolist()}],
               "outputs": []}
    status, answer = post(oip, "/v2/models/pair/infer", json.dumps(request).encode())
    assert status == 200, answer
    outputs = {output["name"]: output["data"] for output in answer["outputs"]}
    scaled, doubled = reference(repo, "pair", "v1")(a, b)
    assert set(outputs) == {"scaled", "doubled"} and outputs["doubled"] == doubled.ravel().tolist()
    np.testing.assert_allclose(outputs["scaled"], scaled.ravel(), rtol=1e-5)


ONE = {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}
ERRORS = [
    ("not json", b"{nope", 400, "not JSON"),
    ("unknown model", b"{}", 404, "Request for unknown model: 'nope' is not found"),
    ("no inputs", json.dumps({"inputs": []}).encode(), 400, "has no inputs"),
    ("unknown input", json.dumps({"inputs": [{**ONE, "name": "x"}]}).encode(), 400, "has no input 'x'"),
    ("wrong datatype", json.dumps({"inputs": [{**ONE, "datatype": "FP64"}]}).encode(), 400,
     "is FP64, but mlp takes FP32"),
    ("bytes", json.dumps({"inputs": [{**ONE, "datatype": "BYTES"}]}).encode(), 400, "BYTES"),
    ("wrong sample shape", json.dumps({"inputs": [{**ONE, "shape": [2, 8]}]}).encode(), 400, "mlp takes [N, 16]"),
    ("data and shape disagree", json.dumps({"inputs": [{**ONE, "shape": [2, 16]}]}).encode(), 400,
     "16 values of data, but shape [2, 16] holds 32"),
    ("negative dim", json.dumps({"inputs": [{**ONE, "shape": [-1, 16]}]}).encode(), 400, "at least 1"),
    ("huge dims", json.dumps({"inputs": [{**ONE, "shape": [2**40, 2**40]}]}).encode(), 400, "elements"),
    ("batch too big", json.dumps({"inputs": [{**ONE, "shape": [17, 16], "data": [0.0] * 272}]}).encode(), 400,
     "over max_batch_size 16"),
    ("missing binary size", json.dumps({"inputs": [{k: v for k, v in ONE.items() if k != "data"}]}).encode(), 400,
     "neither data nor parameters.binary_data_size"),
    ("deep json", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "not JSON"),
    ("bad timeout", json.dumps({"inputs": [ONE], "parameters": {"timeout": -5}}).encode(), 400,
     "positive number of microseconds"),
]


@pytest.mark.parametrize("case, body, status, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_each_bad_request_gets_its_status_and_a_sentence_and_the_daemon_serves_on(oip, case, body, status, message):
    model = "nope" if case == "unknown model" else "mlp"
    got, answer = post(oip, f"/v2/models/{model}/infer", body)
    assert got == status and message in answer["error"], (got, answer)
    assert post(oip, "/v2/models/mlp/infer", json.dumps({"inputs": [ONE]}).encode())[0] == 200


def test_binary_sizes_that_disagree_with_the_body_and_a_truncated_body_are_refused(oip):
    header = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 16],
                                     "parameters": {"binary_data_size": 64}}]}).encode()
    for data, message in ((b"\0" * 60, "binary_data_size 64, but 60 bytes"),
                          (b"\0" * 68, "4 bytes of binary data follow that no input claims")):
        status, answer = post(oip, "/v2/models/mlp/infer", header + data,
                              {"Inference-Header-Content-Length": str(len(header))})
        assert status == 400 and message in answer["error"], answer
    status, answer = post(oip, "/v2/models/mlp/infer", header, {"Inference-Header-Content-Length": "9999"})
    assert status == 400 and "Inference-Header-Content-Length" in answer["error"]


def test_a_gzip_bomb_is_refused_once_it_inflates_past_the_limit(oip):
    bomb = gzip.compress(b"\0" * (80 << 20))  # 80 MiB of zeros in ~80 KB; the limit is 64 MiB
    status, answer = post(oip, "/v2/models/mlp/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "inflates to over" in answer["error"]


def test_a_model_error_is_500_and_statistics_count_what_was_served(oip):
    x = np.array([[-1.0, 2.0]], dtype=np.float32)
    given = httpclient.InferInput("INPUT__0", [1, 2], "FP32")
    given.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="negative input refused by the model") as failed:
        client(oip).infer("failing", [given])
    assert failed.value.status() == "500"
    before = client(oip).get_inference_statistics("mlp")["model_stats"]
    served = sum(s["inference_stats"]["success"]["count"] for s in before)
    post(oip, "/v2/models/mlp/infer", json.dumps({"inputs": [ONE]}).encode())
    wait_for(lambda: sum(s["inference_stats"]["success"]["count"]
                         for s in client(oip).get_inference_statistics("mlp")["model_stats"]) == served + 1,
             timeout=5, what="the statistics to count the request")
    stats = client(oip).get_inference_statistics("mlp")["model_stats"][0]
    assert stats["version"] == "2" and stats["execution_count"] >= 1 and stats["inference_stats"]["queue"]["ns"] > 0
    by_protocol = oip.call("stats")["models"]["mlp"]["requests_by_protocol"]
    assert by_protocol["http"]["ok"] >= 1
    with urllib.request.urlopen(f"http://{oip.config['server']['metrics']}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    ok = float(by_protocol["http"]["ok"])
    counted = f'inferd_requests_by_protocol_total{{model="mlp",protocol="http",status="ok"}} {ok}'
    assert counted in metrics, [line for line in metrics.splitlines() if "by_protocol" in line]


def test_the_asyncio_client_and_zeromq_clients_are_batched_together(start_daemon, repo, gates):
    # A daemon of its own, whose one executor is held while the requests of both protocols queue: sent to an
    # idle one, they would be batched only as far as they happened to arrive faster than batches ran.
    daemon = start_daemon({"mlp": MLP, "variable": ONE_AT_A_TIME}, workers={"streams": 1},
                          server={"http": f"127.0.0.1:{free_port()}"})
    expected = reference(repo, "mlp", "v2")
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, models.MLP_IN), dtype=np.float32) for _ in range(60)]

    async def over_http() -> list[np.ndarray]:
        async with aioclient.InferenceServerClient(url(daemon)) as c:
            async def one(x: np.ndarray) -> np.ndarray:
                given = aioclient.InferInput("INPUT__0", list(x.shape), "FP32")
                given.set_data_from_numpy(x)
                return (await c.infer("mlp", [given])).as_numpy("OUTPUT__0")
            return await asyncio.gather(*(one(x) for x in xs[:30]))

    with RawPeer(daemon.endpoint) as peer, daemon.client() as zmq_client, ThreadPoolExecutor(1) as http:
        with pipeline_held(daemon, gates, lambda gate, full: peer.send(gate.number, "variable", [gate.input])):
            http_answers = http.submit(asyncio.run, over_http())
            futures = [zmq_client.submit("mlp", x) for x in xs[30:]]
            wait_for(lambda: daemon.status()["models"]["mlp"]["queue_depth"] == 60, what="all queued")
        answers = http_answers.result() + [f.result() for f in futures]
    for x, y in zip(xs, answers):
        np.testing.assert_allclose(y, expected(x), rtol=1e-5, atol=1e-6)
    sizes = daemon.call("stats")["models"]["mlp"]["batch_size"]["distribution"]
    # 60 requests of one sample in batches of up to 16 (max_batch_size): 16, 16, 16 and 12, so the 30 of
    # either protocol cannot have gone alone.
    assert sizes == {"16": 3, "12": 1}, sizes


SMALL = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}).encode()


def test_overloaded_is_503_with_retry_after_as_triton_answers(start_daemon, gates):
    daemon = start_daemon({"variable": ONE_AT_A_TIME}, server={"http": f"127.0.0.1:{free_port()}"},
                          queue={"max_size": 1}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send("blocker", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
        peer.send(0, "variable", [np.ones((1, 2), dtype=np.float32)], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="the executor's pipeline full")
        peer.send(1, "variable", [np.ones((1, 2), dtype=np.float32)], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 1, what="the queue's one place taken")
        request = urllib.request.Request(f"http://{url(daemon)}/v2/models/variable/infer", data=SMALL, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=20)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
        assert "queue is full" in json.loads(refused.value.read())["error"]
        gate.open()
        assert [peer.recv()[0]["status"] for _ in range(3)] == ["ok"] * 3


def test_a_deadline_that_passes_is_504_and_a_draining_daemon_answers_503(start_daemon, gates):
    daemon = start_daemon({"variable": ONE_AT_A_TIME}, server={"http": f"127.0.0.1:{free_port()}"},
                          workers={"streams": 1})
    late = json.dumps({**json.loads(SMALL), "parameters": {"timeout": 100_000}}).encode()  # 100 ms
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send("blocker", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
        status, answer = post(daemon, "/v2/models/variable/infer", late)
        assert status == 504 and "deadline" in answer["error"], answer
        gate.open()
        assert peer.recv()[0]["status"] == "ok"
        gate = gates()
        peer.send("blocker2", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy again")
        daemon.signal(signal.SIGTERM)
        wait_for(lambda: daemon.status()["state"] == "draining", what="the drain")
        status, answer = post(daemon, "/v2/models/variable/infer", SMALL)
        assert status == 503 and "shutting down" in answer["error"]
        gate.open()
        assert peer.recv()[0]["status"] == "ok", "what was running finishes"
    assert daemon.wait(30) == 0


def get(daemon: Daemon, path: str) -> tuple[int, dict | list, str]:
    """GET `path`: the status, the JSON body and its content type."""
    try:
        with urllib.request.urlopen(f"http://{url(daemon)}{path}", timeout=20) as response:
            return response.status, json.loads(response.read() or b"{}"), response.headers["content-type"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), exc.headers["content-type"]


def test_readiness_answers_carry_kserves_json_bodies(oip):
    assert get(oip, "/v2/health/live")[:2] == (200, {"live": True})
    assert get(oip, "/v2/health/ready")[:2] == (200, {"ready": True})
    assert get(oip, "/v2/models/mlp/ready")[:2] == (200, {"name": "mlp", "ready": True})
    assert get(oip, "/v2/models/mlp/versions/2/ready")[:2] == (200, {"name": "mlp", "ready": True})
    status, answer, _ = get(oip, "/v2/models/nope/ready")
    assert status == 404 and "Request for unknown model: 'nope' is not found" in answer["error"]


def test_v2_with_a_trailing_slash_is_the_server_metadata(oip):
    status, answer, _ = get(oip, "/v2/")
    assert status == 200 and answer == get(oip, "/v2")[1] and answer["name"] == "inferd"
    assert get(oip, "/v2/health/live/")[:2] == (200, {"live": True})


def test_a_wrong_method_is_405_with_the_one_each_endpoint_takes_in_allow(oip):
    for method, path in (("POST", "/v2"), ("POST", "/v2/health/live"), ("PUT", "/v2/health/ready"),
                         ("POST", "/v2/models/stats"), ("POST", "/v2/models/mlp"), ("POST", "/v2/models/mlp/ready"),
                         ("DELETE", "/v2/models/mlp/versions/2/config"), ("POST", "/v2/models/mlp/stats"),
                         ("GET", "/v2/models/mlp/infer"), ("GET", "/v2/repository/index"),
                         ("GET", "/v2/repository/models/mlp/load"), ("POST", "/v2/systemsharedmemory/status"),
                         ("GET", "/v2/systemsharedmemory/region/r/register"),
                         ("GET", "/v2/cudasharedmemory/unregister"), ("OPTIONS", "/v2/models/nope/infer")):
        answer = requests.request(method, f"http://{url(oip)}{path}", timeout=20)
        allowed = "POST" if path.endswith(("/infer", "/index", "/load", "/register", "/unregister")) else "GET"
        assert answer.status_code == 405 and answer.headers["allow"] == allowed, (method, path, answer.status_code)
        assert answer.json()["error"] == f"{path!r} takes {allowed}, not {method}"
    status, answer, _ = get(oip, "/v2/nowhere")
    assert status == 404 and answer["error"] == "no such endpoint: GET '/v2/nowhere'"


def test_an_error_quotes_at_most_200_characters_of_what_the_client_sent(oip):
    # Ten thousand dims: the error once repeated a shape whole (ten million dims, 20 KiB gzipped, made 30 MB).
    dims = [0] * 10_000
    answer = requests.post(f"http://{url(oip)}/v2/models/mlp/infer", timeout=60,
                           data=json.dumps({"inputs": [{**ONE, "shape": dims}]}, separators=(",", ":")).encode())
    shown = ("[" + ", ".join("0" * 100))[:200]
    assert answer.status_code == 400 and len(answer.content) < 1024
    assert answer.json()["error"] == (f"input 'INPUT__0' has shape {shown}... (cut at 200 characters): a list of "
                                      "1 to 8 integers, batch dim first")
    name = "x" * (10 << 10)
    status, refused = post(oip, "/v2/models/mlp/infer", json.dumps({"inputs": [{**ONE, "name": name}]}).encode())
    assert status == 400 and refused["error"] == ("mlp has no input '" + "x" * 199 + "... (cut at 200 characters); "
                                                  "it takes INPUT__0")
    # Larger than any field but tensor data needs, a field is refused before it is decoded.
    for field, value in (("shape", [0] * 10_000_000), ("name", "x" * (1 << 20))):
        body = gzip.compress(json.dumps({"inputs": [{**ONE, field: value}]}, separators=(",", ":")).encode())
        status, refused = post(oip, "/v2/models/mlp/infer", body, {"Content-Encoding": "gzip"})
        assert status == 400 and refused["error"] == (f"an input's {field} is over 65536 bytes of JSON; only tensor "
                                                      "data may be larger")


def test_statistics_list_each_ready_version_from_the_start_with_its_number(oip):
    status, answer, _ = get(oip, "/v2/models/untouched/stats")
    assert status == 200
    [entry] = answer["model_stats"]
    assert entry["name"] == "untouched" and entry["version"] == "2"  # v2 of mlp's repository, the live one
    assert entry["inference_count"] == entry["execution_count"] == 0 and entry["batch_stats"] == []
    assert {phase: spent["count"] for phase, spent in entry["inference_stats"].items()} == dict.fromkeys(
        ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"), 0)
    assert get(oip, "/v2/models/untouched/versions/2/stats")[1] == answer
    assert get(oip, "/v2/models/untouched/versions/v2/stats")[1] == answer


def test_statistics_split_the_compute_into_its_phases_per_request_and_per_batch_size(oip):
    x = np.random.default_rng(6).standard_normal((4, models.MLP_IN), dtype=np.float32)
    given = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    for _ in range(3):
        client(oip).infer("mlp", [given])
    [entry] = client(oip).get_inference_statistics("mlp")["model_stats"]
    stats = entry["inference_stats"]
    ok = stats["success"]["count"]
    assert ok >= 3 and all(stats[phase]["count"] == ok for phase in ("queue", "compute_input", "compute_infer",
                                                                      "compute_output"))
    assert all(stats[phase]["ns"] > 0 for phase in ("compute_input", "compute_infer", "compute_output"))
    # The phases lie within the compute the worker measured, which lies within each request's time.
    phases_ns = sum(stats[phase]["ns"] for phase in ("compute_input", "compute_infer", "compute_output"))
    assert phases_ns <= stats["success"]["ns"]
    batches = entry["batch_stats"]
    assert sum(b["compute_infer"]["count"] for b in batches) == entry["execution_count"] >= 3
    assert any(b["batch_size"] == 4 for b in batches)
    assert all(b["compute_infer"]["ns"] > 0 and b["compute_input"]["count"] == b["compute_infer"]["count"]
               for b in batches)


def test_fields_the_protocol_does_not_name_are_left_alone_as_kserves_client_sends_them(oip, repo):
    body = {"model_name": "mlp", "model_version": "", "inputs": [{**ONE, "extra": 1}], "unnamed": {"a": 1}}
    status, answer = post(oip, "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 200, answer
    expected = reference(repo, "mlp", "v2")(np.zeros((1, models.MLP_IN), dtype=np.float32))
    np.testing.assert_allclose(answer["outputs"][0]["data"], expected.ravel(), rtol=1e-5, atol=1e-6)


def binary_answer(response: requests.Response) -> tuple[dict, bytes]:
    """A binary inference response's JSON part and the bytes after it."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    split = int(response.headers["inference-header-content-length"])
    return json.loads(response.content[:split]), response.content[split:]


def test_a_raw_binary_request_is_the_one_inputs_bytes_and_is_answered_in_binary(oip, repo):
    # As Triton's binary tensor extension says, and its test_raw_binary reads: every output in binary.
    x = np.random.default_rng(7).standard_normal((3, models.MLP_IN), dtype=np.float32)
    answer, data = binary_answer(requests.post(f"http://{url(oip)}/v2/models/mlp/infer", data=x.tobytes(),
                                               headers={"Inference-Header-Content-Length": "0"}, timeout=20))
    [output] = answer["outputs"]
    assert output["shape"] == [3, models.MLP_OUT] and output["parameters"] == {"binary_data_size": len(data)}
    assert "data" not in output
    np.testing.assert_allclose(np.frombuffer(data, dtype=np.float32).reshape(3, -1), reference(repo, "mlp", "v2")(x),
                               rtol=1e-5, atol=1e-6)
    status, answer = post(oip, "/v2/models/mlp/infer", x.tobytes()[:-4], {"Inference-Header-Content-Length": "0"})
    assert status == 400 and "not a whole number of samples of 'INPUT__0' (FP32 [16], 64 bytes each)" in \
        answer["error"]
    status, answer = post(oip, "/v2/models/pair/infer", b"\0" * 64, {"Inference-Header-Content-Length": "0"})
    assert status == 400 and "for a model of one input; pair takes a, b" in answer["error"]


def test_binary_replies_are_octet_streams_and_an_output_asked_twice_is_refused(oip):
    request = urllib.request.Request(f"http://{url(oip)}/v2/models/mlp/infer", method="POST",
                                     data=json.dumps({"inputs": [ONE], "parameters": {"binary_data_output": True}})
                                     .encode())
    with urllib.request.urlopen(request, timeout=20) as response:
        assert response.headers["content-type"] == "application/octet-stream"
        assert int(response.headers["inference-header-content-length"]) < len(response.read())
    assert get(oip, "/v2/models/mlp")[2] == "application/json"
    twice = {"inputs": [ONE], "outputs": [{"name": "OUTPUT__0"}, {"name": "OUTPUT__0"}]}
    status, answer = post(oip, "/v2/models/mlp/infer", json.dumps(twice).encode())
    assert status == 400 and "output 'OUTPUT__0' is requested twice" in answer["error"]


def test_data_nested_deeper_than_its_shape_is_refused_with_why(oip):
    deep: list = [0.0] * 16
    for _ in range(70):
        deep = [deep]
    status, answer = post(oip, "/v2/models/mlp/infer", json.dumps({"inputs": [{**ONE, "data": deep}]}).encode())
    assert status == 400 and "nested over 3 lists deep, but its shape [1, 16] has 2 dims" in answer["error"]
    ragged = {**ONE, "shape": [2, 16], "data": [[0.0] * 16, [0.0] * 15]}
    status, answer = post(oip, "/v2/models/mlp/infer", json.dumps({"inputs": [ragged]}).encode())
    assert status == 400 and "lists differ in length" in answer["error"]


def test_with_client_shared_memory_off_status_lists_no_regions_and_metadata_does_not_offer_it(oip):
    assert "system_shared_memory" not in client(oip).get_server_metadata()["extensions"]
    assert get(oip, "/v2/systemsharedmemory/status")[:2] == (200, [])
    assert client(oip).get_system_shared_memory_status() == []
    status, answer = post(oip, "/v2/systemsharedmemory/region/r/register",
                          json.dumps({"key": "/inferd-client-x", "byte_size": 64}).encode())
    assert status == 400 and "server.allow_client_shm is off" in answer["error"]
    # Triton's CUDA extension, as a server with no CUDA region: what its tools ask at start and end.
    assert get(oip, "/v2/cudasharedmemory/status")[:2] == (200, [])
    client(oip).unregister_cuda_shared_memory()
    status, answer = post(oip, "/v2/cudasharedmemory/region/r/register", b"{}")
    assert status == 400 and "inferd takes no CUDA shared memory" in answer["error"]


def get_with_host(address: str, host: str | None, path: str = "/v2/models/mlp") -> tuple[int, dict]:
    """GET `path` from `address` (HOST:PORT) with this Host header (None: none at all, as HTTP/1.0 allows)."""
    name, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(name, int(port), timeout=20)
    try:
        connection.putrequest("GET", path, skip_host=True)
        if host is not None:
            connection.putheader("Host", host)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def test_a_loopback_gateway_refuses_a_host_that_is_not_its_own_as_dns_rebinding_would_send(oip):
    port = url(oip).rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", "127.0.0.2", f"[::1]:{port}", "[::1]",
                 f"[::ffff:127.0.0.1]:{port}", "app.localhost", "localhost.", f"inferd.internal:{port}",
                 "INFERD.INTERNAL", None):
        status, answer = get_with_host(url(oip), host)
        assert status == 200 and answer["name"] == "mlp", (host, answer)
    for host in (f"attacker.example:{port}", "attacker.example", "10.0.0.7", "localhost.attacker.example",
                 f"127.0.0.1.attacker.example:{port}", "127.attacker.example", "127.0.0.1.nip.io"):
        status, answer = get_with_host(url(oip), host)
        assert status == 403, (host, status)
        assert answer["error"] == (f"Host {host.rsplit(':', 1)[0]!r} is not a name of this server, which listens "
                                   "on loopback only; add it to server.http_allowed_hosts if clients reach the "
                                   "server by it")
    assert client(oip).is_server_ready(), "the gateway serves on"


@pytest.mark.parametrize("host", ["127.0.0.1.attacker.example", "127.attacker.example"])
def test_a_page_rebound_to_loopback_cannot_post_what_a_browser_sends_without_a_preflight(oip, host):
    """A name that only starts like a loopback address is a page's own: its simple POSTs (text/plain, which a
    browser sends without asking first) get nothing but 403."""
    port = url(oip).rsplit(":", 1)[1]
    served = oip.call("stats")["models"]["mlp"]["requests_by_protocol"].get("http", {}).get("ok", 0)
    infer = json.dumps({"inputs": [ONE]}).encode()
    for path, body in (("/v2/repository/index", b"{}"), ("/v2/models/mlp/infer", infer)):
        answer = requests.post(f"http://{url(oip)}{path}", data=body, timeout=20,
                               headers={"Host": f"{host}:{port}", "Content-Type": "text/plain"})
        assert answer.status_code == 403 and "is not a name of this server" in answer.json()["error"], answer.text
    assert oip.call("stats")["models"]["mlp"]["requests_by_protocol"].get("http", {}).get("ok", 0) == served
    assert client(oip).is_model_ready("mlp")


def test_a_gateway_bound_beyond_loopback_takes_any_host(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server={"http": f"0.0.0.0:{free_port()}"})
    port = daemon.config["server"]["http"].rsplit(":", 1)[1]
    status, answer = get_with_host(f"127.0.0.1:{port}", "inferd.example.com")
    assert status == 200 and answer["name"] == "mlp"
