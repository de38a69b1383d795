"""Regenerate the gRPC code in minedraft/api/ from proto/ (the API's source of truth).

`python -m minedraft.api.generate` rewrites the committed code; `--output DIR` writes elsewhere (the freshness test
generates into a temporary directory and compares). protoc names modules after the .proto path (`minedraft.v1`);
here they live under `minedraft.api.minedraft.v1`, so the one cross-module import in `_pb2_grpc` is rewritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
API_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("minedraft/v1/generation.proto",)
PACKAGE_PREFIX = "minedraft.api."


def generate(output_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) into output_dir; returns the files written, relative to output_dir."""
    from grpc_tools import protoc

    output_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"--python_out={output_dir}", f"--pyi_out={output_dir}",
            f"--grpc_python_out={output_dir}", *(str(proto_root / p) for p in PROTO_FILES)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written: list[Path] = []
    for proto in PROTO_FILES:
        package_dir = Path(proto).parent
        # Package markers so the generated modules import as minedraft.api.minedraft.v1.*
        for depth in range(1, len(package_dir.parts) + 1):
            init = output_dir.joinpath(*package_dir.parts[:depth], "__init__.py")
            init.write_text("")
            written.append(init.relative_to(output_dir))
        stem = Path(proto).stem
        module = ".".join(package_dir.parts)
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = output_dir / package_dir / f"{stem}{suffix}"
            text = path.read_text()
            text = text.replace(f"from {module} import {stem}_pb2", f"from {PACKAGE_PREFIX}{module} import {stem}_pb2")
            path.write_text(text)
            written.append(path.relative_to(output_dir))
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=API_DIR,
                        help="directory to generate into (default: minedraft/api)")
    args = parser.parse_args(argv)
    for path in generate(args.output):
        print(args.output / path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
