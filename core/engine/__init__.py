"""The engine: requests, KV memory, the prefix cache, the scheduler loop and the model runner."""
