"""KServe's own Python SDK against a daemon, run by tests/test_oip_kserve.py in the venv that has it.

    python kserve_calls.py < request.json > answer.json

The request names the protocol ("rest" or "grpc"), the address, the model, the inputs (name,
datatype, shape, flat data) and whether they travel as binary; the answer has what each call
returned: liveness, readiness, the model's readiness, and each output (name, datatype, shape, flat
data), or the error the SDK raised.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig
from kserve.protocol.infer_type import InferInput, InferRequest


def _request(asked: dict[str, Any]) -> InferRequest:
    inputs = []
    for given in asked["inputs"]:
        tensor = InferInput(given["name"], given["shape"], given["datatype"])
        data = np.array(given["data"], dtype=given["dtype"]).reshape(given["shape"])
        tensor.set_data_from_numpy(data, binary_data=asked["binary"])
        inputs.append(tensor)
    return InferRequest(model_name=asked["model"], infer_inputs=inputs, request_id="kserve-1")


def _outputs(response: Any) -> list[dict[str, Any]]:
    return [{"name": o.name, "datatype": o.datatype, "shape": list(o.shape), "data": o.as_numpy().ravel().tolist()}
            for o in response.outputs]


async def _rest(asked: dict[str, Any]) -> dict[str, Any]:
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    base = f"http://{asked['address']}"
    try:
        answer = {"live": await client.is_server_live(base), "ready": await client.is_server_ready(base),
                  "model_ready": await client.is_model_ready(base, asked["model"]),
                  "unknown_ready": await client.is_model_ready(base, "no-such-model")}
        response = await client.infer(base, _request(asked), model_name=asked["model"])
        answer.update(id=response.id, outputs=_outputs(response))
        try:
            await client.infer(base, InferRequest(model_name="no-such-model", infer_inputs=_request(asked).inputs),
                               model_name="no-such-model")
        except Exception as exc:  # noqa: BLE001 - the SDK's error, as its user sees it
            answer["unknown_error"] = str(exc)
        return answer
    finally:
        await client.close()


async def _grpc(asked: dict[str, Any]) -> dict[str, Any]:
    client = InferenceGRPCClient(asked["address"], timeout=30)
    try:
        answer = {"live": await client.is_server_live(), "ready": await client.is_server_ready(),
                  "model_ready": await client.is_model_ready(asked["model"]),
                  "unknown_ready": await client.is_model_ready("no-such-model")}
        response = await client.infer(_request(asked))
        answer.update(id=response.id, outputs=_outputs(response))
        try:
            await client.infer(InferRequest(model_name="no-such-model", infer_inputs=_request(asked).inputs))
        except Exception as exc:  # noqa: BLE001 - the SDK's error, as its user sees it
            answer["unknown_error"] = str(exc)
        return answer
    finally:
        await client.close()


def main() -> int:
    asked = json.load(sys.stdin)
    answer = asyncio.run(_rest(asked) if asked["protocol"] == "rest" else _grpc(asked))
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
