"""The Open Inference Protocol spoken by KServe's own Python SDK (InferenceRESTClient and
InferenceGRPCClient, unmodified, in a venv of their own: tests/third_party.py) against the real
daemon; outputs checked against the same models run in-process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import models
import numpy as np
import pytest
from conftest import Daemon, reference
from third_party import kserve_python

VENV = Path(__file__).resolve().parent.parent / ".venv"


@pytest.fixture(scope="module")
def oip(oip_daemon: Daemon) -> Daemon:
    if not kserve_python(VENV).exists():
        pytest.skip("KServe's SDK is not installed: `make test` installs it (tests/third_party.py)")
    return oip_daemon


def kserve(asked: dict) -> dict:
    """Run the SDK's calls (tests/kserve_calls.py) and return what they answered."""
    out = subprocess.run([str(kserve_python(VENV)), str(Path(__file__).parent / "kserve_calls.py")],
                         input=json.dumps(asked), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def tensor(name: str, datatype: str, array: np.ndarray) -> dict:
    return {"name": name, "datatype": datatype, "dtype": str(array.dtype), "shape": list(array.shape),
            "data": array.ravel().tolist()}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_kserves_clients_check_health_and_infer_like_the_model_in_process(oip, repo, protocol, binary):
    rng = np.random.default_rng(11)
    a = rng.standard_normal((4, 3, 4), dtype=np.float32)
    b = rng.integers(-50, 50, (4, 2), dtype=np.int64)
    address = oip.config["server"]["http" if protocol == "rest" else "grpc"]
    answer = kserve({"protocol": protocol, "address": address, "model": "pair", "binary": binary,
                     "inputs": [tensor("a", "FP32", a), tensor("b", "INT64", b)]})
    assert answer["live"] is True and answer["ready"] is True and answer["model_ready"] is True
    assert answer["unknown_ready"] is False
    assert answer["id"] == "kserve-1"
    scaled, doubled = reference(repo, "pair", "v1")(a, b)
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["scaled"]["shape"] == [4, 3] and outputs["doubled"]["datatype"] == "INT64"
    np.testing.assert_allclose(np.array(outputs["scaled"]["data"]).reshape(4, 3), scaled, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(outputs["doubled"]["data"]).reshape(4, 2), doubled)
    assert "Request for unknown model: 'no-such-model' is not found" in answer["unknown_error"]


def test_kserves_rest_client_infers_the_mlp_with_binary_tensors(oip, repo):
    x = np.random.default_rng(12).standard_normal((3, models.MLP_IN), dtype=np.float32)
    answer = kserve({"protocol": "rest", "address": oip.config["server"]["http"], "model": "mlp", "binary": True,
                     "inputs": [tensor("INPUT__0", "FP32", x)]})
    [output] = answer["outputs"]
    np.testing.assert_allclose(np.array(output["data"]).reshape(3, -1), reference(repo, "mlp", "v2")(x),
                               rtol=1e-5, atol=1e-6)
