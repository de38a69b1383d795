"""minedraft.profile runs where only torch and the repository's files are (a lent GPU machine has no vLLM, no
transformers, no gRPC): importing it, and the worker it starts, must need nothing else. Checked in a fresh
interpreter whose every import of those packages fails (a sitecustomize that the worker processes inherit too)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Installed here, absent on the device machine (or not needed there).
BLOCKED = ("vllm", "transformers", "tokenizers", "safetensors", "huggingface_hub", "grpc", "google.protobuf", "kopf",
           "kubernetes", "prometheus_client", "scipy", "matplotlib", "yaml", "msgspec", "zmq", "starlette",
           "uvicorn")

SITECUSTOMIZE = f'''
import importlib.abc
import sys

BLOCKED = {BLOCKED!r}


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}} is blocked: not on the device machine")
        return None


sys.meta_path.insert(0, Block())
'''


def blocked_env(tmp_path: Path, also: tuple[str, ...] = ()) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE.replace("BLOCKED = (", f"BLOCKED = {also!r} + ("))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_the_block_works(tmp_path):
    result = subprocess.run([sys.executable, "-c", "import transformers"], env=blocked_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "blocked" in result.stderr


def test_profile_imports_with_torch_only(tmp_path):
    code = ("import minedraft.profile.cli, minedraft.profile.worker, minedraft.profile.runner, "
            "minedraft.profile.model, minedraft.profile.timing, minedraft.profile.supervisor; "
            "from minedraft.profile.cli import main; main(['--help'])")
    result = subprocess.run([sys.executable, "-c", code], env=blocked_env(tmp_path), capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--shapes" in result.stdout


def test_the_command_line_parses_without_torch(tmp_path):
    """`minedraft --help` and the operator's and gateway's images build the whole parser: the profile subcommand
    must not import torch until it measures (the parent process never does with --device cpu/cuda)."""
    code = ("from minedraft.profile.cli import main; import sys; "
            "code = main(['--device', 'cpu', '--target', 'nope']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], env=blocked_env(tmp_path, also=("torch",)),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "target: 'nope' is neither a preset" in result.stderr
