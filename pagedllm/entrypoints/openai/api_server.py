"""``python -m pagedllm.entrypoints.openai.api_server [MODEL] [flags]``, vLLM's module path for
its server: ``pagedllm serve`` (the app itself: ``openai.app``)."""

from __future__ import annotations

import sys

from pagedllm.entrypoints.cli import main as cli_main


def main() -> None:
    cli_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    main()
