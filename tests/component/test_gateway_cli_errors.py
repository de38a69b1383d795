"""`minedraft gateway` and `minedraft client` with bad input: one line naming the flag on stderr, exit status 2, no
traceback (run in-process through the CLI's main)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from minedraft.cli import main


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def one_line_error(err: str, *words: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("minedraft "), err
    for word in words:
        assert word in lines[0], (word, err)


@pytest.mark.parametrize(("argv", "words"), [
    (["--prompt-token-ids", "1,x,3"], ["prompt-token-ids", "'x'"]),
    (["--prompt-token-ids", "-4"], ["prompt-token-ids", "negative"]),
    (["--prompt", "hi", "--token-file", "/nonexistent/token"], ["token-file", "/nonexistent/token"]),
    (["--prompt", "hi", "--token-file", "EMPTY"], ["token-file", "holds no token"]),
    (["--prompt", "hi", "--tls-ca", "/nonexistent/ca.pem"], ["tls-ca", "/nonexistent/ca.pem"]),
])
def test_client_bad_input_is_one_line(capsys, tmp_path: Path, argv, words):
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    code, err = run(capsys, "client", "generate", "--target", "127.0.0.1:1", *argv)
    assert code == 2
    one_line_error(err, *words)


def test_gateway_bad_input_is_one_line(capsys, tmp_path: Path):
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate")
    cases = [
        (["--engines", ""], ["engines"]),
        (["--engines", "127.0.0.1:1", "--max-attempts", "0"], ["max-attempts", ">= 1"]),
        (["--engines", "127.0.0.1:1", "--max-attempts", "-1"], ["max-attempts"]),
        (["--engines", "127.0.0.1:1", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
         ["tls-"]),
        (["--engines", "127.0.0.1:1", "--tls-cert", str(not_pem), "--tls-key", str(not_pem)],
         ["tls-key", "no PEM"]),
    ]
    for argv, words in cases:
        code, err = run(capsys, "gateway", "--port", "0", "--metrics-port", "0", *argv)
        assert code == 2, argv
        one_line_error(err, *words)


def test_gateway_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run(capsys, "gateway", "--port", str(port), "--metrics-port", "0", "--engines", "127.0.0.1:1")
    assert code == 2
    one_line_error(err, "cannot bind", str(port))
    assert "minedraft gateway: on" not in err, "never says it is on before it has bound"
