"""`make demo`: the daemon starts with no config, answers correctly, and stops cleanly."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from inferd.demo import DEMO_ENDPOINT
from inferd.system import paths


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


# The demo listens on fixed ports (5555, and the config's defaults for the rest), below the ephemeral range every
# other test's daemon takes its ports from: it runs beside them.
@pytest.mark.skipif(port_in_use(int(DEMO_ENDPOINT.rsplit(":", 1)[1])), reason="the demo's port is taken")
def test_demo_runs_answers_correctly_and_stops_cleanly_leaving_no_state(tmp_path):
    system_state = paths.SYSTEM_STATE_DIR / "demo"
    was_there = system_state.exists()
    # A home of its own: the demo must not write the user's state folder either.
    result = subprocess.run([sys.executable, "-m", "inferd.demo", "run"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("matches the in-process model") == 3, result.stdout
    assert "DIFFERS" not in result.stdout
    assert "daemon stopped cleanly (exit code 0)" in result.stdout
    control = re.search(r"\(control: ipc://([^)]+)\)", result.stdout).group(1)
    assert Path(control).is_relative_to(tempfile.gettempdir()) and not Path(control).parent.exists()
    assert not (tmp_path / ".local").exists() and system_state.exists() == was_there
    assert "ERROR" not in result.stdout + result.stderr


def test_the_set_up_pins_its_torch_so_that_pip_cannot_replace_it(tmp_path):
    import torch

    # The Makefile's own target, on this venv's Python (which imports torch, so nothing is installed).
    venv = tmp_path / "venv"
    venv.mkdir()
    made = subprocess.run(["make", "-C", str(Path(__file__).parent.parent), f"VENV={venv}", f"PY={sys.executable}",
                           str(venv / "constraints.txt")], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    pin = f"torch=={torch.__version__}"
    assert (venv / "constraints.txt").read_text().split() == [pin]
    # Something that asks for another torch is refused, not installed (--dry-run: nothing is, either way).
    asked = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-c",
                            str(venv / "constraints.txt"), f"torch!={torch.__version__}"],
                           capture_output=True, text=True, timeout=120)
    assert asked.returncode != 0 and "ResolutionImpossible" in asked.stderr, asked.stdout + asked.stderr
    constraint = next(line for line in asked.stdout.splitlines() if "The user requested (constraint) torch" in line)
    assert f"=={torch.__version__}" in constraint, asked.stdout
