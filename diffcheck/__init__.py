"""diffcheck: golden-output differential testing for LLM inference engines."""

__version__ = "0.1.0"
