"""The built-in demo: a small MLP repository, and the script behind `make demo`.

`inferd serve` with no config builds the repository (versions v1 and v2 of an
MLP with different weights) in the state folder and serves it. `python -m
inferd.demo run` starts that daemon, sends it a few requests, checks the
answers against the same model run in-process, prints them with their latency,
and stops the daemon cleanly.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inferd.models.repository import MODEL_FILES

DEMO_MODEL = "mlp"
DEMO_VERSIONS = {"v1": 1, "v2": 2}  # version -> weight seed
DEMO_FILE = "model.pt2"  # torch.export programs: PyTorch's way to save a model for serving now
DEMO_ENDPOINT = "tcp://127.0.0.1:5555"
IN_FEATURES, HIDDEN, OUT_FEATURES = 256, 128, 10


def build_mlp(seed: int):
    """The demo MLP (256 -> 128 -> 10, ReLU) with weights drawn from `seed`, exported with a dynamic batch dim."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT_FEATURES)
    ).eval()
    batch = torch.export.Dim("batch", max=1024)
    return torch.export.export(model, (torch.zeros(2, IN_FEATURES),), dynamic_shapes=({0: batch},))


def build_repository(root: Path) -> None:
    """Write every demo version under `root/mlp/VERSION/model.pt2` (atomically per file)."""
    import torch

    for version, seed in DEMO_VERSIONS.items():
        target = root / DEMO_MODEL / version / DEMO_FILE
        if any((target.parent / name).exists() for name in MODEL_FILES):  # an earlier release's demo is kept
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name("partial-" + target.name)  # torch.export.save warns of a name not ending .pt2
        torch.export.save(build_mlp(seed), str(partial))
        # Whatever the umask: a model file others may write is refused (models.NAME.allow_writable).
        partial.chmod(0o644)
        target.parent.chmod(0o755)
        partial.rename(target)


def repository_path(state_dir: str | Path) -> Path:
    """Where the demo repository lives in a state folder."""
    return Path(state_dir) / "demo" / "models"


def ensure_repository(state_dir: str | Path) -> Path:
    """Build the demo repository if it is not there, in a child process.

    The child keeps torch out of the supervisor, which never imports it.
    """
    root = repository_path(state_dir)
    if all((root / DEMO_MODEL / v / DEMO_FILE).exists() for v in DEMO_VERSIONS):
        return root
    subprocess.run([sys.executable, "-m", "inferd.demo", "build", str(root)], check=True)
    return root


def demo_config(state_dir: str | Path) -> dict[str, Any]:
    """The config `inferd serve` runs with when given none."""
    root = repository_path(state_dir)
    return {
        # Its own state folder: the demo's live versions must never mix with a real daemon's.
        "server": {"listen": [DEMO_ENDPOINT], "state_dir": str(Path(state_dir) / "demo")},
        "models": {
            DEMO_MODEL: {
                "repository": str(root / DEMO_MODEL),
                "inputs": [{"dtype": "float32", "shape": [IN_FEATURES]}],
                "max_batch_size": 32,
                "warmup_batch_sizes": [1, 8, 32],
            }
        },
    }


def run_demo() -> int:
    """Start the demo daemon, query it, check and print the answers, stop it."""
    import tempfile

    import numpy as np
    import torch

    from inferd.harness import DaemonProcess

    # Everything in a temporary folder (as root too): a demo leaves nothing in /var/lib/inferd or /run/inferd.
    workdir = Path(tempfile.mkdtemp(prefix="inferd-demo-"))
    ensure_repository(workdir)
    config = demo_config(workdir)
    config["server"]["control"] = f"ipc://{workdir}/control.sock"
    daemon = DaemonProcess(workdir, config)
    try:
        daemon.start(timeout=120)
    except RuntimeError as exc:
        daemon.kill_all()  # one that is only slow must not keep holding the demo port
        print(exc)
        shutil.rmtree(workdir, ignore_errors=True)
        return 1
    try:
        live = daemon.status()["models"][DEMO_MODEL]["live_version"]
        print(f"\ninferd is serving {DEMO_MODEL} {live} on {DEMO_ENDPOINT} (control: {daemon.control})")
        reference = torch.export.load(str(repository_path(workdir) / DEMO_MODEL / live / DEMO_FILE)).module()
        rng = np.random.default_rng(0)
        with daemon.client(timeout=5.0) as client:
            for samples in (1, 4, 16):
                x = rng.standard_normal((samples, IN_FEATURES), dtype=np.float32)
                started = time.perf_counter()
                y = client.infer(DEMO_MODEL, x)
                assert isinstance(y, np.ndarray), "the demo model has one output"
                latency_ms = (time.perf_counter() - started) * 1000
                expected = reference(torch.from_numpy(x)).detach().numpy()
                match = "matches" if np.allclose(y, expected, atol=1e-5) else "DIFFERS FROM"
                print(f"  {samples:2d} sample(s) -> output {list(y.shape)} in {latency_ms:6.2f} ms, "
                      f"{match} the in-process model; first row: {np.round(y[0, :4], 3)}")
            inputs = [rng.standard_normal((1, IN_FEATURES), dtype=np.float32) for _ in range(200)]
            started = time.perf_counter()
            futures = [client.submit(DEMO_MODEL, x) for x in inputs]
            for future in futures:
                future.result()
            elapsed = time.perf_counter() - started
            print(f"  200 concurrent requests answered in {elapsed * 1000:.1f} ms")
        return 0
    finally:
        code = daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"daemon stopped cleanly (exit code {code})" if code == 0 else f"daemon exit code {code}")


def main(argv: list[str]) -> int:
    """`python -m inferd.demo build DIR` or `python -m inferd.demo run`."""
    if len(argv) == 2 and argv[0] == "build":
        build_repository(Path(argv[1]))
        return 0
    if argv == ["run"]:
        return run_demo()
    print("usage: python -m inferd.demo build DIR | run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
