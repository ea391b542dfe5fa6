"""Clients and tools that others wrote, installed beside the venv for the tests that run them.

    python tests/third_party.py install VENV

- perf_analyzer: Triton's load tool, the C++ binary inside tritonclient 2.51.0's wheel (the last
  that ships it; its Python package needs numpy < 2, so only the binary is taken), with the CUDA
  runtime library it links (nvidia-cuda-runtime-cu12; it runs on the CPU all the same) and a
  wrapper that finds it. It also needs Debian's libb64-0d, which .ci/run installs.
- KServe's Python SDK (InferenceRESTClient, InferenceGRPCClient), in a venv of its own: its
  pins (psutil < 6) conflict with inferd's, and its client is run as a separate process anyway.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

TRITONCLIENT = "tritonclient==2.51.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.9.79"
KSERVE = "kserve==0.21.0"


def perf_analyzer(venv: Path) -> Path:
    """Where the perf_analyzer wrapper lies."""
    return venv / "tools" / "perf_analyzer"


def kserve_python(venv: Path) -> Path:
    """The interpreter of the venv that has KServe's SDK."""
    return venv / "kserve" / "bin" / "python"


def missing_library(venv: Path) -> str | None:
    """Why perf_analyzer cannot start here, if it cannot: the library the loader does not find."""
    out = subprocess.run(["ldd", str(perf_analyzer(venv).with_suffix(".bin"))], capture_output=True, text=True,
                         env={"LD_LIBRARY_PATH": str(venv / "tools" / "lib")})
    missing = [line.split()[0] for line in out.stdout.splitlines() if "not found" in line]
    return missing[0] if missing else None


def _install_perf_analyzer(venv: Path) -> None:
    tools = venv / "tools"
    wheels = tools / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    TRITONCLIENT, CUDA_RUNTIME], check=True)
    (tools / "lib").mkdir(parents=True, exist_ok=True)
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.endswith("/bin/perf_analyzer"):
                    target = perf_analyzer(venv).with_suffix(".bin")
                elif name.endswith("/lib/libcudart.so.12"):
                    target = tools / "lib" / "libcudart.so.12"
                else:
                    continue
                with archive.open(name) as source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out)
                target.chmod(0o755)
    shutil.rmtree(wheels)
    wrapper = perf_analyzer(venv)
    wrapper.write_text('#!/bin/sh\nhere="$(dirname "$0")"\n'
                       'LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" '
                       'exec "$here/perf_analyzer.bin" "$@"\n')
    wrapper.chmod(0o755)


def _install_kserve(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv / "kserve")], check=True)
    subprocess.run([str(kserve_python(venv)), "-m", "pip", "install", "-q", KSERVE], check=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] != "install":
        print(__doc__, file=sys.stderr)
        return 2
    venv = Path(argv[2]).resolve()
    _install_perf_analyzer(venv)
    _install_kserve(venv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
