"""Byte strings (dtype bytes, the Open Inference Protocol's BYTES) into and out of Python models, end to end:
over ZeroMQ with inferd's client, over HTTP and gRPC with Triton's clients, in shared memory; answers checked
against the same model.py run in-process, and every malformed byte string refused with a sentence."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from conftest import Daemon, base_config, module_daemon, sent_while_held
from python_models import IDENTITY_MOST, SIMPLE_IDENTITY_CONFIG, SIMPLE_STRING_CONFIG, STRINGS_PER_SAMPLE, in_process
from tritonclient.utils import serialize_byte_tensor
from wire import RawPeer

from inferd import RetryPolicy
from inferd.errors import InvalidRequest
from inferd.harness import free_port, local_config, to_toml
from inferd.protocol import OutputPlace, pack_bytes

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def served(python_repo: Path) -> Iterator[Daemon]:
    """simple_string and simple_identity (whose gates are a folder of the daemon's) over ZeroMQ, HTTP and gRPC,
    with client shared memory allowed."""
    def gated(config: dict[str, Any], folder: Path) -> None:
        (folder / "gates").mkdir()
        config["models"]["simple_identity"]["parameters"] = {"gates": str(folder / "gates")}

    with module_daemon(python_repo, {"simple_string": SIMPLE_STRING_CONFIG, "simple_identity": SIMPLE_IDENTITY_CONFIG},
                       gated, server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                                      "allow_client_shm": True}) as daemon:
        yield daemon


def reference(daemon: Daemon, model: str) -> Any:
    """The model's model.py, made in this process."""
    return in_process(Path(daemon.config["models"][model]["repository"]) / "v1",
                      daemon.config["models"][model].get("parameters"))


def numbers_as_text(rows: int, start: int) -> np.ndarray:
    """`rows` samples of simple_string's input: integers in decimal, as an object array of bytes."""
    values = np.arange(start, start + rows * STRINGS_PER_SAMPLE).reshape(rows, STRINGS_PER_SAMPLE)
    return np.vectorize(lambda n: str(n).encode(), otypes=[object])(values)


def texts(array: np.ndarray) -> list[str]:
    """Each element as text, whichever of bytes and str a client gave it as."""
    return [value.decode() if isinstance(value, bytes) else value for value in np.asarray(array).flat]


def test_inferds_client_sends_and_gets_byte_strings_as_model_py_makes_them(served):
    a, b = numbers_as_text(3, -20), numbers_as_text(3, 7)
    want = reference(served, "simple_string")({"INPUT0": a, "INPUT1": b})
    with served.client() as client:
        # Unicode arrays travel as UTF-8 too.
        total, difference = client.infer("simple_string", [a, np.array(texts(b)).reshape(b.shape)])
    assert total.dtype == object and total.shape == (3, STRINGS_PER_SAMPLE)
    assert texts(total) == texts(want["OUTPUT0"]) and texts(difference) == texts(want["OUTPUT1"])
    assert all(isinstance(value, bytes) for value in total.flat)


def test_triton_http_client_mixes_binary_and_json_byte_strings_as_its_example_does(served):
    client = httpclient.InferenceServerClient(served.config["server"]["http"])
    a, b = numbers_as_text(1, 0), numbers_as_text(1, 1)
    inputs = [httpclient.InferInput("INPUT0", [1, STRINGS_PER_SAMPLE], "BYTES"),
              httpclient.InferInput("INPUT1", [1, STRINGS_PER_SAMPLE], "BYTES")]
    inputs[0].set_data_from_numpy(a, binary_data=True)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("simple_string", inputs, outputs=outputs)
    want = reference(served, "simple_string")({"INPUT0": a, "INPUT1": b})
    assert texts(result.as_numpy("OUTPUT0")) == texts(want["OUTPUT0"])
    assert texts(result.as_numpy("OUTPUT1")) == texts(want["OUTPUT1"])
    json_output = result.get_output("OUTPUT1")
    assert json_output["datatype"] == "BYTES" and json_output["data"] == texts(want["OUTPUT1"])
    metadata = client.get_model_metadata("simple_string")
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "BYTES", "shape": [-1, STRINGS_PER_SAMPLE]}
    assert client.get_model_config("simple_string")["output"][1]["data_type"] == "TYPE_STRING"


def test_triton_grpc_client_sends_and_gets_byte_strings(served):
    client = grpcclient.InferenceServerClient(served.config["server"]["grpc"])
    a, b = numbers_as_text(2, 100), numbers_as_text(2, -3)
    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "BYTES"),
              grpcclient.InferInput("INPUT1", list(b.shape), "BYTES")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple_string", inputs)
    want = reference(served, "simple_string")({"INPUT0": a, "INPUT1": b})
    assert texts(result.as_numpy("OUTPUT0")) == texts(want["OUTPUT0"])
    assert texts(result.as_numpy("OUTPUT1")) == texts(want["OUTPUT1"])
    client.close()


# Embedded NULs, bytes that are no UTF-8, the empty string and a long one: each must come back as it went.
AWKWARD = np.array([[b"he\x00llo", b"\xff\xfe\x00", b"", "é".encode() * 300, b"\x00\x01\x02\x03"]], dtype=object)


def test_json_strings_are_taken_flat_or_nested_as_their_shape_and_no_other_way(served):
    url = f"http://{served.config['server']['http']}/v2/models/simple_identity/infer"

    def answer(data: list) -> requests.Response:
        body = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2, 2], "data": data}]}
        return requests.post(url, json=body, timeout=30)

    for data in (["a", "b", "c", "d"], [["a", "b"], ["c", "d"]]):
        assert answer(data).json()["outputs"][0]["data"] == ["a", "b", "c", "d"]
    # As numbers are: four strings nested otherwise would be read as a shape the client did not mean.
    for data in ([["a"], ["b", "c", "d"]], [["a", "b", "c", "d"]], [["a", "b", "c"], ["d"]], ["a", ["b"], "c", "d"]):
        refused = answer(data)
        assert refused.status_code == 400 and "or do not make shape [2, 2]" in refused.json()["error"], data
    refused = answer([[["a"], "b"], ["c", "d"]])
    assert refused.status_code == 400 and "nested deeper than its shape" in refused.json()["error"]


def test_any_bytes_come_back_as_they_went_and_an_output_not_utf8_goes_binary_over_json(served):
    with served.client() as client:
        assert client.infer("simple_identity", AWKWARD).tolist() == AWKWARD.tolist()
    client = grpcclient.InferenceServerClient(served.config["server"]["grpc"])
    given = grpcclient.InferInput("INPUT0", list(AWKWARD.shape), "BYTES")
    given.set_data_from_numpy(AWKWARD)
    assert client.infer("simple_identity", [given]).as_numpy("OUTPUT0").tolist() == AWKWARD.tolist()
    client.close()
    # A JSON request asking JSON outputs: the output holds bytes JSON cannot carry, so it comes binary instead.
    body = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2], "data": ["plain", "text"]}]}
    url = f"http://{served.config['server']['http']}/v2/models/simple_identity/infer"
    answer = requests.post(url, json=body, timeout=30)
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == ["plain", "text"]
    http = httpclient.InferenceServerClient(served.config["server"]["http"])
    given = httpclient.InferInput("INPUT0", list(AWKWARD.shape), "BYTES")
    given.set_data_from_numpy(AWKWARD, binary_data=True)
    result = http.infer("simple_identity", [given],
                        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    assert result.get_output("OUTPUT0")["parameters"]["binary_data_size"] == len(pack_bytes(AWKWARD.flat))
    assert result.as_numpy("OUTPUT0").tolist() == AWKWARD.tolist()


def test_requests_of_byte_strings_batch_together_and_each_gets_its_own(served):
    gates = Path(served.config["models"]["simple_identity"]["parameters"]["gates"])
    sent = [np.array([[("x" * n).encode(), str(n).encode(), b"\xff" * (n % 3)]], dtype=object) for n in range(1, 6)]
    before = served.call("stats")["models"]["simple_identity"]["batch_size"]["distribution"]
    replies = sent_while_held(served, "simple_identity", sent,
                              lambda gate, rows: np.array([[f"gate:{gate.path.name}"]] * rows, dtype=object), gates)
    after = served.call("stats")["models"]["simple_identity"]["batch_size"]["distribution"]
    assert after.get("5", 0) == before.get("5", 0) + 1, "the five went as one batch"
    for index, x in enumerate(sent):
        header, (output,) = replies[index]
        assert header["status"] == "ok" and header["outputs"] == [{"dtype": "bytes", "shape": [1, 3]}]
        assert output.tolist() == x.tolist()


def test_byte_strings_malformed_on_any_protocol_are_refused_naming_the_input_and_element(served):
    good = numbers_as_text(1, 0)
    header = json.dumps({"id": 1, "model": "simple_string", "inputs": [
        {"dtype": "bytes", "shape": [1, STRINGS_PER_SAMPLE]}] * 2}).encode()
    with RawPeer(served.endpoint) as peer:
        cut_short = pack_bytes(good.flat)[:-1]
        peer.send_frames([header, pack_bytes(good.flat), cut_short])
        reply, _ = peer.recv()
        assert reply["status"] == "invalid"
        assert "input 1" in reply["error"] and f"element {STRINGS_PER_SAMPLE - 1} says it is" in reply["error"]
        peer.send_frames([header, pack_bytes(good.flat), pack_bytes(list(good.flat)[:-1])])
        reply, _ = peer.recv()
        assert reply["status"] == "invalid" and f"element {STRINGS_PER_SAMPLE - 1} has no length" in reply["error"]
    url = f"http://{served.config['server']['http']}/v2/models/simple_string/infer"

    def refused(data: list[Any]) -> str:
        body = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, STRINGS_PER_SAMPLE],
                            "data": texts(good)},
                           {"name": "INPUT1", "datatype": "BYTES", "shape": [1, STRINGS_PER_SAMPLE], "data": data}]}
        answer = requests.post(url, data=json.dumps(body), timeout=30)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    assert "INPUT1" in refused([*texts(good)[:-1], 7]) and "string" in refused([*texts(good)[:-1], 7])
    assert "INPUT1" in refused(texts(good)[:-1])
    lone = '{"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": ["\\ud800"]}]}'
    answer = requests.post(f"http://{served.config['server']['http']}/v2/models/simple_identity/infer", data=lone,
                           timeout=30)
    assert answer.status_code == 400 and answer.json()["error"].startswith(
        "the request's JSON holds the escape \\ud800 outside a surrogate pair")
    # A number that is no integer reaches the model, which refuses it alone: 400, naming the model.
    with served.client(retry=RetryPolicy(max_attempts=1)) as client:
        bad = good.copy()
        bad[0, 3] = b"three"
        with pytest.raises(InvalidRequest, match="^simple_string v1: InvalidInput: INPUT1 holds an element that"):
            client.infer("simple_string", [good, bad])
        assert texts(client.infer("simple_string", [good, good])[0]) == [str(2 * n) for n in range(16)]


def test_a_request_larger_than_a_slot_is_refused_naming_workers_shm_mb(served):
    big = np.array([[b"x" * (served.config["workers"]["shm_mb"] << 20)]], dtype=object)
    with served.client(retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(InvalidRequest, match="workers.shm_mb"):
            client.infer("simple_identity", big)
        assert client.infer("simple_identity", AWKWARD).tolist() == AWKWARD.tolist(), "the daemon serves on"


def test_an_answer_that_is_not_byte_strings_fails_alone_with_a_sentence_naming_the_output(served):
    with served.client(retry=RetryPolicy(max_attempts=1)) as client:
        for kind, says in ((b"ints", "is int64, but its config declares bytes"),
                           (b"fixed", "is a fixed-width bytes array"), (b"objects", "holds a int"),
                           (b"nones", "is bytes, and holds a NoneType")):
            with pytest.raises(Exception, match=f"output 'OUTPUT0' {says}" if kind not in (b"objects", b"nones")
                               else says) as err:
                client.infer("simple_identity", np.array([[b"give:" + kind]], dtype=object))
            assert getattr(err.value, "status", None) == "internal", err.value


def test_an_answer_larger_than_its_slot_fails_that_request_alone_naming_workers_shm_mb(served):
    with served.client(retry=RetryPolicy(max_attempts=1)) as client:
        futures = [client.submit("simple_identity", x) for x in (np.array([[b"give:huge"]], dtype=object), AWKWARD)]
        with pytest.raises(Exception, match=r"simple_identity v1: MemoryError: .*raise workers.shm_mb") as err:
            futures[0].result()
        assert getattr(err.value, "status", None) == "internal"
        assert futures[1].result().tolist() == AWKWARD.tolist()


def test_byte_strings_in_shared_memory_both_ways(served):
    a, b = numbers_as_text(2, 5), numbers_as_text(2, 9)
    want = reference(served, "simple_string")({"INPUT0": a, "INPUT1": b})
    with served.client() as client, client.shared_memory(1 << 16) as region:
        given = region.put_bytes(a)
        total, difference = client.infer("simple_string", [given, b],
                                         out=[OutputPlace(region.name, 8192), None])
        assert texts(total) == texts(want["OUTPUT0"]) and texts(difference) == texts(want["OUTPUT1"])
        # The first output lies in the region, where the daemon wrote it after the input.
        assert region.bytes_at(total.shape, 8192, len(pack_bytes(total.flat))).tolist() == total.tolist()
    # Triton's HTTP client, an input in system shared memory as tritonclient lays out byte strings.
    http = httpclient.InferenceServerClient(served.config["server"]["http"])
    packed = serialize_byte_tensor(a)  # a 0-d array of the packed bytes, as tritonclient's users give them
    key = f"/inferd-client-bytes-{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(key[1:], key, len(packed.item()))
    try:
        shm.set_shared_memory_region(handle, [packed])
        assert packed.item() == pack_bytes(a.flat), "tritonclient lays byte strings out as inferd does"
        http.register_system_shared_memory("strings", key, len(packed.item()))
        first = httpclient.InferInput("INPUT0", list(a.shape), "BYTES")
        first.set_shared_memory("strings", len(packed.item()))
        second = httpclient.InferInput("INPUT1", list(b.shape), "BYTES")
        second.set_data_from_numpy(b)
        result = http.infer("simple_string", [first, second])
        assert texts(result.as_numpy("OUTPUT0")) == texts(want["OUTPUT0"])
        http.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(handle)


def test_check_config_refuses_a_tensor_model_given_byte_strings(tmp_path, repo):
    config = base_config(tmp_path, repo, {"mlp": {"inputs": [{"dtype": "bytes", "shape": [1]}]}})
    path = tmp_path / "inferd.toml"
    path.write_text(to_toml(config))
    checked = subprocess.run([BIN / "inferd", "check-config", "--config", str(path)], capture_output=True, text=True)
    assert checked.returncode != 0
    assert "models.mlp.inputs: a tensor model takes and gives tensors, not byte strings" in checked.stderr


def test_an_input_of_more_elements_than_max_shape_is_refused(served):
    with served.client(retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(InvalidRequest, match=str(IDENTITY_MOST)):
            client.infer("simple_identity", np.array([[b"a"] * (IDENTITY_MOST + 1)], dtype=object))


EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "python-models"


def test_the_examples_tokenizer_and_thumbnail_answer_as_in_process(workdir):
    from PIL import Image

    table = tomllib.loads((EXAMPLES / "inferd.toml").read_text())["models"]
    served = {name: {**body, "repository": str(EXAMPLES / body["repository"])} for name, body in table.items()}
    daemon = Daemon(workdir, local_config(workdir, served, server={"http": f"127.0.0.1:{free_port()}"}))
    try:
        daemon.start()
        texts_in = np.array([[b"The cat sat on the mat"], [b"a DOG ran fast under the table and the cat " * 3],
                             ["zebra \u00e9".encode()], [b""]], dtype=object)
        tokenizer = in_process(EXAMPLES / "tokenizer" / "v1")
        want = tokenizer({"text": texts_in})
        images = []
        for size, kind in (((64, 48), "JPEG"), ((20, 90), "PNG")):
            image = Image.fromarray(np.random.default_rng(size[0]).integers(0, 255, (*size[::-1], 3), np.uint8))
            encoded = io.BytesIO()
            image.save(encoded, kind)
            images.append([encoded.getvalue()])
        pictures = np.array(images, dtype=object)
        pixels = in_process(EXAMPLES / "thumbnail" / "v1")({"image": pictures})["pixels"]
        with daemon.client(retry=RetryPolicy(max_attempts=1)) as client:
            ids, length = client.infer("tokenizer", texts_in)
            np.testing.assert_array_equal(ids, want["ids"])
            np.testing.assert_array_equal(length, want["length"])
            np.testing.assert_array_equal(client.infer("thumbnail", pictures), pixels)
            with pytest.raises(InvalidRequest, match=r"^tokenizer v1: InvalidInput: the text is not UTF-8"):
                client.infer("tokenizer", np.array([[b"caf\xe9"]], dtype=object))
            with pytest.raises(InvalidRequest, match=r"^thumbnail v1: InvalidInput: the image cannot be decoded"):
                client.infer("thumbnail", np.array([[b"GIF89a, or so it says"]], dtype=object))
        http = httpclient.InferenceServerClient(daemon.config["server"]["http"])
        given = httpclient.InferInput("text", list(texts_in.shape), "BYTES")
        given.set_data_from_numpy(texts_in, binary_data=False)
        np.testing.assert_array_equal(http.infer("tokenizer", [given]).as_numpy("ids"), want["ids"])
    finally:
        daemon.kill_all()
