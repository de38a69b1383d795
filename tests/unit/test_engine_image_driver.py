"""The engine image (also the drafter pool's) finds the NVIDIA driver wherever the node puts it: GKE mounts it at
/usr/local/nvidia rather than injecting it into the system paths."""

from __future__ import annotations

from pathlib import Path

from tests.image_contract import read_image

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_image_searches_gkes_driver_mount() -> None:
    env = read_image(ROOT / "docker" / "engine.Dockerfile").env
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/usr/local/nvidia/lib64"
    path = env["PATH"].split(":")
    assert path[0] == "/usr/local/nvidia/bin"
    # The base image's own entries stay (pip installs the `minedraft` entrypoint into /usr/local/bin).
    assert {"/usr/local/bin", "/usr/bin", "/bin"} <= set(path)
