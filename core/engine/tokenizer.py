"""Loading the tokenizer, the same way on the front end and in the scheduler."""

from __future__ import annotations

from argparse import Namespace
from typing import Any


def load_tokenizer(args: Namespace, model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer_path or model_dir, use_fast=args.tokenizer_mode != "slow")


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
