"""What a model file holds, told from its zip archive's listing, never by unpickling it.

TorchScript (`torch.jit.save`), torch.export (`torch.export.save`) and
AOTInductor (`torch._inductor.aoti_compile_and_package`) archives are served, and
Python models (`model.py`, told by its name);
what people save by mistake is named with the way to save it instead: a pickled
module (`torch.save(model)`), a state dict or checkpoint
(`torch.save(model.state_dict())`), or a file that is no archive at all.
"""

from __future__ import annotations

import json
import pickletools
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

TORCHSCRIPT, EXPORTED, AOTI, PYTHON = "torchscript", "exported", "aoti", "python"
PYTHON_FILE = "model.py"  # a Python model: a class Model that inferd runs in its step processes
# What an AOTInductor package records about where it was compiled (its *_metadata.json), by the name
# inferd reports it under.
AOTI_MADE = {"AOTI_DEVICE_KEY": "device", "AOTI_PLATFORM": "platform", "AOTI_MACHINE": "machine",
             "AOTI_CPU_ISA": "cpu_isa", "AOTI_COMPUTE_CAPABILITY": "compute_capability"}
PICKLE_PEEK_BYTES = 1 << 20  # a module's pickle names its class within its first opcodes
# An exported program's models/*.json ends with the torch version that exported it; found by its key, since
# parsing the whole graph only to read it would slow every listing.
TORCH_VERSION = re.compile(rb'"torch_version":\s*"([^"\\]{1,64})"')

HOW_TO_SAVE = ("save it with torch.export.save(torch.export.export(model, example, dynamic_shapes=...)) as "
               "model.pt2, or with torch.jit.save(torch.jit.script(model)) as model.pt")


@dataclass(frozen=True)
class ModelFile:
    """A model file's format (TORCHSCRIPT, EXPORTED, AOTI or PYTHON), or the sentence saying why it cannot be served;
    `made`: what the file records about how it was made: an exported program's `torch_version`, an
    AOTInductor package's device (above all), platform, machine, CPU ISA and compute capability."""

    path: Path
    format: str | None
    problem: str | None = None
    made: dict[str, str] = field(default_factory=dict)


def inspect(path: Path, provenance: bool = False) -> ModelFile:
    """Tell what `path` holds from its archive's member names (and a pickle's first class name). With
    `provenance`, also the torch version an exported program records, which reads the program's JSON
    (megabytes for a large model): for listings, not for every load."""
    if path.name == PYTHON_FILE:
        return ModelFile(path, PYTHON)
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            inner = {name.partition("/")[2] for name in names}
            if "constants.pkl" in inner or any(name.startswith("code/") for name in inner):
                return ModelFile(path, TORCHSCRIPT)
            if "archive_format" in inner or any(name.startswith("models/") for name in inner):
                compiled = [name for name in names if name.partition("/")[2].startswith("data/aotinductor/")]
                if compiled:
                    return ModelFile(path, AOTI, made=_aoti_made(archive, compiled))
                return ModelFile(path, EXPORTED, made=_exported_made(archive, names) if provenance else {})
            pickle = next((name for name in names if name.partition("/")[2] == "data.pkl"), None)
            if pickle is None:
                return ModelFile(path, None, f"{path} is a zip archive but neither TorchScript nor torch.export; "
                                             f"{HOW_TO_SAVE}")
            with archive.open(pickle) as stream:
                first_class = _first_class(stream.read(PICKLE_PEEK_BYTES))
    except zipfile.BadZipFile:
        return ModelFile(path, None, f"{path} is not a TorchScript or torch.export archive; {HOW_TO_SAVE}")
    except OSError as exc:
        return ModelFile(path, None, f"cannot read {path}: {exc.strerror or exc}")
    if first_class is None or first_class == "collections.OrderedDict" or first_class.startswith("torch._utils."):
        return ModelFile(path, None, f"{path} holds a state dict or checkpoint (weights without code, written by "
                                     f"torch.save); load it into its module in Python, then {HOW_TO_SAVE}")
    return ModelFile(path, None, f"{path} is a pickled {first_class} written by torch.save(model), which inferd "
                                 f"never unpickles (a pickle can run any code); {HOW_TO_SAVE}")


def _aoti_made(archive: zipfile.ZipFile, members: list[str]) -> dict[str, str]:
    """The compile-time facts an AOTInductor package's first metadata file records (empty ones left out)."""
    for name in sorted(members):
        if name.endswith("_metadata.json"):
            try:
                recorded = json.loads(archive.read(name))
            except ValueError:
                return {}
            return {ours: str(recorded[theirs]) for theirs, ours in AOTI_MADE.items() if recorded.get(theirs)}
    return {}


def _exported_made(archive: zipfile.ZipFile, names: list[str]) -> dict[str, str]:
    """The torch version a torch.export archive records, if it does."""
    program = next((name for name in names if name.partition("/")[2].startswith("models/")
                    and name.endswith(".json")), None)
    found = TORCH_VERSION.findall(archive.read(program)) if program is not None else []
    return {"torch_version": found[-1].decode("ascii", "replace")} if found else {}


def _first_class(data: bytes) -> str | None:
    """The first class a pickle names (module.name), or None when it starts with a plain container.
    Only the opcodes are read; nothing is imported or run."""
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL" and isinstance(arg, str):
                return ".".join(arg.split(" ", 1))
            if opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                return f"{strings[-2]}.{strings[-1]}"
            if opcode.name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST") and not strings:
                return None
            if isinstance(arg, str):
                strings.append(arg)
    except ValueError:  # cut off at PICKLE_PEEK_BYTES, or not a pickle after all
        pass
    return None
