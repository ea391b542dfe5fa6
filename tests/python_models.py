"""Python models (model.py) the tests serve, written into a repository as a user would write them.

Each is a class Model over numpy arrays; the tests import the same files in-process to check what the daemon
answers.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any

SCALE_FEATURES = 4

# float32 [4] -> "scaled" float32 [4] (x * parameters.factor) and "total" float64 [1]: each sample's sum. A batch
# holding a negative value is refused with inferd.InvalidInput, one holding a value over 1000 raises ValueError.
# A batch whose first value is GATE waits at the gate its second value numbers (it writes itself to that file of
# the folder parameters.gates, which a test made a named pipe: tests/gates.py), then answers zeros; one whose
# first value is HANG sleeps without end; one whose first value is QUIT raises what is not an Exception: SystemExit
# (sys.exit(1)) where its second value is 0, KeyboardInterrupt where it is 1, else BaseException. Its close() notes
# its version in the file `closed` of that folder.
GATE, HANG, QUIT = 4242, 777, 999
SCALE = f'''
import sys
import time
from pathlib import Path

import numpy as np

import inferd


class Model:
    def __init__(self, context):
        self.factor = float(context.parameters.get("factor", 2.0))
        self.gates = Path(context.parameters.get("gates", "/nonexistent"))
        self.version = context.version

    def __call__(self, inputs):
        x = inputs["x"]
        if x[0, 0] == {GATE}:
            (self.gates / str(int(x[0, 1]))).write_bytes(x.tobytes())
            return {{"scaled": np.zeros_like(x), "total": np.zeros((len(x), 1))}}
        if x[0, 0] == {HANG}:
            while True:
                time.sleep(1)
        if x[0, 0] == {QUIT}:
            if x[0, 1] == 0:
                sys.exit(1)
            if x[0, 1] == 1:
                raise KeyboardInterrupt
            raise BaseException("base")
        if (x < 0).any():
            raise inferd.InvalidInput(f"negative values are refused: {{x[x < 0][:3].tolist()}}")
        if (x > 1000).any():
            raise ValueError("values over 1000 are out of this model's range")
        return {{"scaled": x * self.factor, "total": x.astype(np.float64).sum(axis=1, keepdims=True)}}

    def close(self):
        if self.gates.is_dir():
            with open(self.gates / "closed", "a") as said:
                said.write(self.version + "\\n")
'''

# Returns its input as its output, the same array: what a model that does nothing costs.
IDENTITY = '''
class Model:
    def __call__(self, inputs):
        return {"y": inputs["x"]}
'''

# Burns CPU in Python for each sample (a tokenizer's or an image decoder's kind of work): float32 [1] -> [1].
BUSY = '''
class Model:
    def __init__(self, context):
        self.loops = int(context.parameters.get("loops", 20000))

    def __call__(self, inputs):
        x = inputs["x"]
        total = 0
        for _ in range(self.loops * len(x)):
            total += 1
        return {"y": x + total * 0.0}
'''

# float32 [2] -> "y" float32 [2], as it came; a batch whose first value is GATE waits at the gate its second value
# numbers, of the folder parameters.gates (tests/gates.py), first. A CPU step that a test can hold.
RELAY = f'''
from pathlib import Path


class Model:
    def __init__(self, context):
        self.gates = Path(context.parameters.get("gates", "/nonexistent"))

    def __call__(self, inputs):
        x = inputs["x"]
        if x[0, 0] == {GATE}:
            (self.gates / str(int(x[0, 1]))).write_bytes(x.tobytes())
        return {{"y": x.copy()}}
'''

# float32 [2] -> "y" float32 [2], x * 2, computed in place in the slot (as torch.from_numpy(x).mul_(2) would); a batch
# holding a sample whose first value is 13 raises ValueError after that. A batch whose first value is GATE waits
# at the gate its second value numbers, of the folder parameters.gates (tests/gates.py), first.
DOUBLE_IN_PLACE = f'''
from pathlib import Path


class Model:
    def __init__(self, context):
        self.gates = Path(context.parameters.get("gates", "/nonexistent"))

    def __call__(self, inputs):
        x = inputs["x"]
        if x[0, 0] == {GATE}:
            (self.gates / str(int(x[0, 1]))).write_bytes(x.tobytes())
            return {{"y": x.copy()}}
        x.flags.writeable = True
        x *= 2
        if (x[:, 0] == 26).any():
            raise ValueError("a sample whose first value is 13 is refused")
        return {{"y": x.copy()}}
'''

# float32 [2] -> "y" float32 [2], x + 1. Its constructor starts a helper process (sleep), and writes its pid to the
# file helper-PID (PID: the model's process) of the folder parameters.helpers; it has no close() to stop it. A
# batch holding a negative value ends the process as a crash in a C extension would (os._exit).
WITH_HELPER = '''
import os
import subprocess
from pathlib import Path


class Model:
    def __init__(self, context):
        self.helper = subprocess.Popen(["sleep", "600"])
        (Path(context.parameters["helpers"]) / f"helper-{os.getpid()}").write_text(str(self.helper.pid))

    def __call__(self, inputs):
        x = inputs["x"]
        if (x < 0).any():
            os._exit(1)
        return {"y": x + 1}
'''

# "a" float32 [4] and "b" float64 [1] -> "y" float64 [4], a + b: a step that joins two branches of a pipeline.
JOIN = '''
class Model:
    def __call__(self, inputs):
        return {"y": inputs["a"] + inputs["b"]}
'''

# Triton's simple_string, as Triton's examples call it: INPUT0 and INPUT1, BYTES [16], each element an integer
# in decimal; OUTPUT0 their sums and OUTPUT1 their differences, written the same way. An element that is no
# integer is refused with inferd.InvalidInput.
SIMPLE_STRING = """
import numpy as np

import inferd


def numbers(name, strings):
    try:
        return np.array([int(s) for s in strings.flat], dtype=np.int64).reshape(strings.shape)
    except ValueError as exc:
        raise inferd.InvalidInput(f"{name} holds an element that is not an integer: {exc}") from None


class Model:
    def __call__(self, inputs):
        a, b = numbers("INPUT0", inputs["INPUT0"]), numbers("INPUT1", inputs["INPUT1"])
        return {"OUTPUT0": (a + b).astype(str), "OUTPUT1": (a - b).astype(str)}
"""

# Triton's simple_identity: INPUT0, BYTES of any length, answered as it came. A batch whose first element is
# b"gate:NAME" waits at the gate NAME of the folder parameters.gates (tests/gates.py); one whose first element is
# b"give:KIND" answers an output that is not byte strings, of KIND, or (huge) byte strings of 64 MiB.
SIMPLE_IDENTITY = """
from pathlib import Path

import numpy as np

WRONG = {b"ints": lambda x: np.zeros(x.shape, np.int64), b"fixed": lambda x: x.astype(bytes),
         b"objects": lambda x: np.full(x.shape, 3, dtype=object),
         b"nones": lambda x: np.full(x.shape, None, dtype=object),
         b"huge": lambda x: np.full(x.shape, b"x" * (64 << 20), dtype=object)}


class Model:
    def __init__(self, context):
        self.gates = Path(context.parameters.get("gates", "/nonexistent"))

    def __call__(self, inputs):
        x = inputs["INPUT0"]
        first = x.flat[0] if x.size else b""
        if first.startswith(b"gate:"):
            (self.gates / first[5:].decode()).write_bytes(first)
        if first.startswith(b"give:"):
            return {"OUTPUT0": WRONG[first[5:]](x)}
        return {"OUTPUT0": x}
"""

# float32 [-1] padded with 0 -> "mean" float32 [1], each sample's mean, and "y" float32 [-1], x * 2. Version masked
# leaves the padding out of the mean (a sample holds no 0 of its own); version unmasked does not, so its mean of a
# sample changes once padded.
MEANPOOL = """
import numpy as np


class Model:
    def __init__(self, context):
        self.masked = context.version == "masked"

    def __call__(self, inputs):
        x = inputs["x"]
        if self.masked:
            kept = x != 0
            mean = (x * kept).sum(axis=1, keepdims=True) / np.maximum(kept.sum(axis=1, keepdims=True), 1)
        else:
            mean = x.mean(axis=1, keepdims=True)
        return {"mean": mean, "y": x * 2}
"""
MEANPOOL_MOST = 8
MEANPOOL_CONFIG: dict[str, Any] = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [-1], "max_shape": [MEANPOOL_MOST], "pad_value": 0}],
    "outputs": [{"name": "mean", "dtype": "float32", "shape": [1]},
                {"name": "y", "dtype": "float32", "shape": [-1], "max_shape": [MEANPOOL_MOST], "unpad": "x:0"}],
    "max_batch_size": 8,
}

STRINGS_PER_SAMPLE, IDENTITY_MOST = 16, 64
SIMPLE_STRING_CONFIG: dict[str, Any] = {
    "inputs": [{"name": name, "dtype": "bytes", "shape": [STRINGS_PER_SAMPLE]} for name in ("INPUT0", "INPUT1")],
    "outputs": [{"name": name, "dtype": "bytes", "shape": [STRINGS_PER_SAMPLE]} for name in ("OUTPUT0", "OUTPUT1")],
    "max_batch_size": 8,
}
SIMPLE_IDENTITY_CONFIG: dict[str, Any] = {
    "inputs": [{"name": "INPUT0", "dtype": "bytes", "shape": [-1], "max_shape": [IDENTITY_MOST]}],
    "outputs": [{"name": "OUTPUT0", "dtype": "bytes", "shape": [-1], "max_shape": [IDENTITY_MOST]}],
    "max_batch_size": 8,
}

RELAY_CONFIG: dict[str, Any] = {
    "inputs": [{"dtype": "float32", "shape": [2], "name": "x"}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}], "max_batch_size": 1,
}
JOIN_CONFIG: dict[str, Any] = {
    "inputs": [{"dtype": "float32", "shape": [SCALE_FEATURES], "name": "a"},
               {"dtype": "float64", "shape": [1], "name": "b"}],
    "outputs": [{"name": "y", "dtype": "float64", "shape": [SCALE_FEATURES]}], "max_batch_size": 8,
}
SCALE_CONFIG: dict[str, Any] = {
    "inputs": [{"dtype": "float32", "shape": [SCALE_FEATURES], "name": "x"}],
    "outputs": [{"name": "scaled", "dtype": "float32", "shape": [SCALE_FEATURES]},
                {"name": "total", "dtype": "float64", "shape": [1]}],
    "max_batch_size": 8, "max_wait_ms": 0,
}


def gated(gate_number: int, rows: int = 1) -> Any:
    """A batch of scale of `rows` samples that waits at the gate numbered `gate_number`."""
    import numpy as np

    x = np.zeros((rows, SCALE_FEATURES), np.float32)
    x[0, :2] = GATE, gate_number
    return x


def write(root: Path, name: str, version: str, source: str) -> Path:
    """Write `source` as model.py of NAME/VERSION under `root`."""
    folder = root / name / version
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(source)
    return folder


def build_python_repository(root: Path) -> None:
    """Every Python model of the tests: scale v1, v2 (five times its factor), exits (whose constructor calls
    sys.exit(0)), bad_canary (v1, whose folder's expected output for its example input is wrong) and tensor (a
    TorchScript module), identity, busy,
    simple_string, simple_identity, relay and join."""
    import numpy as np

    write(root, "scale", "v1", SCALE)
    write(root, "scale", "v2", SCALE.replace('get("factor", 2.0)', 'get("factor", 2.0) * 5'))
    write(root, "scale", "exits", SCALE.replace("    def __init__(self, context):\n",
                                                "    def __init__(self, context):\n        sys.exit(0)\n"))
    canary = write(root, "scale", "bad_canary", SCALE)
    np.save(canary / "example_input.npy", np.ones((2, SCALE_FEATURES), np.float32))
    np.save(canary / "expected_output.npy", np.zeros((2, SCALE_FEATURES), np.float32))
    import models  # a version of scale that torch saved: a model keeps its kind, so it is never served
    models.save_script(lambda: models.Sleepy(1), root, "scale", "tensor", 1)
    write(root, "identity", "v1", IDENTITY)
    write(root, "busy", "v1", BUSY)
    write(root, "simple_string", "v1", SIMPLE_STRING)
    write(root, "simple_identity", "v1", SIMPLE_IDENTITY)
    write(root, "relay", "v1", RELAY)
    write(root, "join", "v1", JOIN)
    write(root, "double_in_place", "v1", DOUBLE_IN_PLACE)
    write(root, "with_helper", "v1", WITH_HELPER)
    write(root, "meanpool", "masked", MEANPOOL)
    write(root, "meanpool", "unmasked", MEANPOOL)


def in_process(folder: Path, parameters: dict[str, Any] | None = None) -> Any:
    """The Model of `folder`'s model.py, made in this process as a step makes it."""
    from inferd.step.runner import ModelContext

    spec = importlib.util.spec_from_file_location(f"reference_{folder.parent.name}_{folder.name}", folder / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    context = ModelContext(folder, folder.parent.name, folder.name, parameters or {})
    return module.Model(context) if inspect.signature(module.Model).parameters else module.Model()
