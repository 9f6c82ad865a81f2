"""Loading the tokenizer, the same way on the front end and in the scheduler."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path
from typing import Any


# Model types whose tokenizer AutoTokenizer loads as the class tokenizer_config.json names when
# that class is the generic fast backend: transformers corrects no hub class for them (its
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) and none of them uses Mistral's own backend.
# tests/test_tokenizer.py checks this list against the installed transformers.
GENERIC_BACKEND_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe"})
GENERIC_BACKENDS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(args: Namespace, model_dir: str) -> Any:
    return hf_tokenizer(args.tokenizer_path or model_dir, use_fast=args.tokenizer_mode != "slow",
                        trust_remote_code=bool(args.trust_remote_code))


def hf_tokenizer(path: str, use_fast: bool = True, trust_remote_code: bool = False) -> Any:
    """transformers' tokenizer for `path`, the one AutoTokenizer would load.

    AutoTokenizer reads config.json through transformers' configuration module, which imports
    torch: seconds of CPU in the HTTP process, which otherwise never imports torch, on the way to
    the first token. Where the outcome is known without it (see GENERIC_BACKEND_MODEL_TYPES), the
    class loads directly.
    """
    import transformers

    if use_fast and _generic_backend(Path(path)):
        return transformers.TokenizersBackend.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path, use_fast=use_fast, trust_remote_code=trust_remote_code)


def import_tokenizer_modules() -> None:
    """What `hf_tokenizer` imports on its fast path, ahead of time."""
    import transformers

    transformers.TokenizersBackend  # noqa: B018 (transformers imports its submodules on attribute access)


def _generic_backend(directory: Path) -> bool:
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tokenizer_config.get("tokenizer_class") in GENERIC_BACKENDS and "auto_map" not in tokenizer_config
            and model_type in GENERIC_BACKEND_MODEL_TYPES and (directory / "tokenizer.json").is_file())


class TokenizerPool:
    """--tokenizer-worker-num > 1: tokenize in worker processes, so that long prompts neither
    hold the front end's event loop nor queue behind each other."""

    def __init__(self, args: Namespace, model_dir: str, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_start_worker, initargs=(args, model_dir))

    async def encode(self, text: str) -> list[int]:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self.pool, _encode, text)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_worker_tokenizer: Any = None


def _start_worker(args: Namespace, model_dir: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(args, model_dir)


def _encode(text: str) -> list[int]:
    return _worker_tokenizer.encode(text)
