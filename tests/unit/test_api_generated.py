"""The committed generated code is exactly what proto/ generates (one source of truth)."""

from pathlib import Path

from minedraft.api.generate import API_DIR, generate


def test_committed_code_matches_the_proto(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert any(p.name == "generation_pb2_grpc.py" for p in written)
    stale = [str(p) for p in written if (API_DIR / p).read_text() != (tmp_path / p).read_text()]
    assert not stale, f"regenerate with scripts/gen_proto.sh: {stale}"


def test_generated_modules_import_under_minedraft_api() -> None:
    from minedraft.api import SERVICE_NAME, pb, pb_grpc

    assert SERVICE_NAME == "minedraft.v1.Generation"
    assert hasattr(pb_grpc, "GenerationStub") and hasattr(pb_grpc, "GenerationServicer")
    request = pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=3))
    assert request.sampling_params.HasField("max_tokens") and not request.sampling_params.HasField("top_p")
