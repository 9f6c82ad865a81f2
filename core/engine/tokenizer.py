"""Loading the tokenizer, the same way on the front end and in the scheduler."""

from __future__ import annotations

from argparse import Namespace
from typing import Any


def load_tokenizer(args: Namespace, model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer_path or model_dir, use_fast=args.tokenizer_mode != "slow")
