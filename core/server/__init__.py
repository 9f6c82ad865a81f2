"""HTTP: the OpenAI-compatible and native routes over the engine."""
