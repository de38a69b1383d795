#!/usr/bin/env bash
# Regenerate minedraft/api/ from proto/ (tests/unit/test_api_generated.py fails when the committed code is stale).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m minedraft.api.generate "$@"
