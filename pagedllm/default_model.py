"""The model every entry point loads when none is named: an installed alias (``models.loader``).

Its own module, importing nothing, so that the command line can show it without loading torch.
"""

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
