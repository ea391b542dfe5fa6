"""The example pipelines of docs/pipelines.md (examples/pipelines), served as their inferd.toml writes them:
`embed` (text -> tokenizer -> an exported encoder of any sequence length -> JSON) and `classify` (JPEG ->
thumbnail -> ResNet-18 -> top-5 labels), over ZeroMQ (inferd's client), HTTP and gRPC (Triton's clients),
each answer checked against the same steps run one after another in this process."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import models
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import Daemon, built_once, module_daemon
from python_models import in_process

from inferd.harness import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TEXTS = [b"The cat sat on the mat", b"a DOG ran fast under the table and the cat " * 3, "zebra \u00e9".encode(), b"",
         b"the dog"]


def load_export_script() -> Any:
    """examples/pipelines/export.py, as a module."""
    spec = importlib.util.spec_from_file_location("pipeline_examples_export", EXAMPLES / "pipelines" / "export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_examples(root: Path) -> None:
    """A copy of examples/, with the pipelines' tensor models saved as export.py saves them (ResNet-18 from
    tests/models.py, as torchvision's cannot load here)."""
    shutil.copytree(EXAMPLES, root, dirs_exist_ok=True)
    export = load_export_script()
    export.export_encoder(root / "pipelines" / "encoder")
    torch.manual_seed(0)
    export.export_classifier(models.ResNet18(), root / "pipelines" / "resnet18")


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    return built_once(tmp_path_factory, pytestconfig, "pipeline-examples", build_examples) / "pipelines"


@pytest.fixture(scope="module")
def served(examples: Path) -> Iterator[Daemon]:
    """The example config's models and pipelines as written (each repository read from its folder), on ZeroMQ,
    HTTP and gRPC."""
    written = tomllib.loads((examples / "inferd.toml").read_text())
    table = {name: {**body, "repository": str((examples / body["repository"]).resolve())}
             for name, body in written["models"].items()}
    with module_daemon(examples, table, lambda config, _: config.update(pipelines=written["pipelines"]),
                       workers={"shm_mb": 32},
                       server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"}) as daemon:
        yield daemon


def text_chain(examples: Path) -> Any:
    """embed's steps in this process, one after the other: texts [N, 1] -> JSON answers [N, 1]."""
    tokenizer = in_process(EXAMPLES / "python-models" / "tokenizer" / "v1")
    encoder = torch.export.load(str(examples / "encoder" / "v1" / "model.pt2")).module()
    pool = in_process(examples / "pool" / "v1")

    def run(texts: np.ndarray) -> np.ndarray:
        tokens = tokenizer({"text": texts})
        with torch.no_grad():
            hidden = encoder(torch.from_numpy(tokens["ids"])).numpy()
        return pool({"hidden": hidden, "length": tokens["length"]})["json"]

    return run


def image_chain(examples: Path) -> Any:
    """classify's steps in this process, one after the other: images [N, 1] -> (labels [N, 5], scores)."""
    thumbnail = in_process(EXAMPLES / "python-models" / "thumbnail" / "v1")
    resnet = torch.export.load(str(examples / "resnet18" / "v1" / "model.pt2")).module()
    top5 = in_process(examples / "top5" / "v1")

    def run(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pixels = thumbnail({"image": images})["pixels"]
        with torch.no_grad():
            logits = resnet(torch.from_numpy(pixels)).numpy()
        answer = top5({"logits": logits})
        return answer["labels"], answer["scores"]

    return run


def jpegs(count: int) -> list[bytes]:
    """`count` JPEGs of random pixels, of sizes of their own."""
    from PIL import Image

    rng = np.random.default_rng(7)
    made = []
    for index in range(count):
        size = (40 + 13 * index, 30 + 7 * index)
        encoded = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), np.uint8)).save(encoded, "JPEG")
        made.append(encoded.getvalue())
    return made


def assert_same_embeddings(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape == (len(want), 1)
    for said, meant in zip(got[:, 0], want[:, 0]):
        answer, expected = json.loads(said), json.loads(meant)
        assert answer["tokens"] == expected["tokens"]
        np.testing.assert_allclose(answer["embedding"], expected["embedding"], atol=2e-5)


def assert_same_top5(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    labels = [[value.decode() if isinstance(value, bytes) else value for value in row] for row in got[0]]
    assert labels == [[value.decode() for value in row] for row in want[0]]
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)


def test_the_example_pipelines_answer_over_zeromq_as_their_steps_do_in_process(served, examples):
    texts = np.array([[text] for text in TEXTS], dtype=object)
    images = np.array([[image] for image in jpegs(6)], dtype=object)
    with served.client() as client:
        # One request per sample, all in flight at once, so that the steps batch them; and one of several samples.
        embedded = [client.submit("embed", texts[i : i + 1], details=True) for i in range(len(texts))]
        classified = [client.submit("classify", images[i : i + 1]) for i in range(len(images))]
        together = client.infer("classify", images[:3])
        replies = [future.result() for future in embedded]
        answers = [future.result() for future in classified]
    assert_same_embeddings(np.concatenate([reply.outputs for reply in replies]), text_chain(examples)(texts))
    assert replies[0].version == "tokenizer:v1,encoder:v1,pool:v1"
    expected = image_chain(examples)
    assert_same_top5((np.concatenate([a[0] for a in answers]), np.concatenate([a[1] for a in answers])),
                     expected(images))
    assert_same_top5(together, expected(images[:3]))


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_the_example_pipelines_answer_over_the_open_inference_protocol(served, examples, module):
    address = served.config["server"]["http" if module is httpclient else "grpc"]
    client = module.InferenceServerClient(address)
    try:
        texts = np.array([[text] for text in TEXTS], dtype=object)
        given = module.InferInput("text", list(texts.shape), "BYTES")
        given.set_data_from_numpy(texts)
        result = client.infer("embed", [given])
        assert_same_embeddings(result.as_numpy("json"), text_chain(examples)(texts))
        images = np.array([[image] for image in jpegs(4)], dtype=object)
        given = module.InferInput("image", list(images.shape), "BYTES")
        given.set_data_from_numpy(images)
        result = client.infer("classify", [given])
        assert_same_top5((result.as_numpy("labels"), result.as_numpy("scores")), image_chain(examples)(images))
        bad = module.InferInput("image", [1, 1], "BYTES")
        bad.set_data_from_numpy(np.array([[b"GIF89a, or so it says"]], dtype=object))
        with pytest.raises(Exception, match=r"pipeline classify, step thumbnail \(model thumbnail v1\): "
                                            r"thumbnail v1: InvalidInput: the image cannot be decoded") as raised:
            client.infer("classify", [bad])
        assert raised.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    finally:
        client.close()
