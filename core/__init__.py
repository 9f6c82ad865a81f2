"""srv: an LLM inference server whose every backend is a plugin."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch and transformers; `import srv` for the CLI or the SDK should not.
    if name == "Engine":
        from srv.engine.engine import Engine

        return Engine
    raise AttributeError(name)
