"""srv: an LLM inference server whose every backend is a plugin."""

__version__ = "0.1.0"
