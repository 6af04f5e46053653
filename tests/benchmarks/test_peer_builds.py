"""The build side of the Ray Data and petastorm tools (``benchmarks/peers/peer_ray.py``,
``peer_petastorm.py``: the jobs benchmark's ``build``), run small, each in its own environment:
every image of the raw lake is stored exactly once, with its label and the bytes of the per-image
work (``per_image.prepare``), and the build says when the work ran. A missing environment fails
with the command that makes it, never skips."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(PEERS))

from _data import write_lake  # noqa: E402 - benchmarks/ is not a package
from peer_common import lake_images  # noqa: E402
from per_image import prepare  # noqa: E402

#: tool -> its environment's interpreter, and the script that makes it
TOOLS = {
    "ray": (ROOT / ".venv-peers" / "ray" / "bin" / "python", "scripts/setup_peers.sh ray"),
    "petastorm": (ROOT / ".venv-petastorm" / "bin" / "python", "scripts/setup_petastorm.sh"),
}
SIZE, QUALITY = 64, 85


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lake(tmp_path_factory.mktemp("lake") / "raw", images=30, classes=3, workers=1)


def _peer(tool: str, *args: str) -> str:
    python, setup = TOOLS[tool]
    if not python.exists():
        pytest.fail(f"{tool}'s environment is missing: run bash {setup}")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYTHONPATH", None)  # the peers import nothing of this project
    command = [str(python), str(PEERS / f"peer_{tool}.py"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_build_stores_every_image_once_with_the_per_image_work(lake: Path, tmp_path: Path, tool: str) -> None:
    out = tmp_path / tool
    stdout = _peer(
        tool,
        "build",
        *("--lake", str(lake), "--out", str(out)),
        *("--size", str(SIZE), "--quality", str(QUALITY), "--workers", "2"),
    )
    built = json.loads(stdout.strip().splitlines()[-1])
    want = Counter(
        f"{label} {hashlib.sha256(prepare(path.read_bytes(), SIZE, QUALITY)).hexdigest()}"
        for path, label in lake_images(lake)
    )
    got = Counter(_peer(tool, "stored", "--out", str(out)).splitlines())
    assert got == want
    assert built["images"] == 30
    assert built["first_done"] is not None and built["first_done"] <= built["last_done"]
