"""Custom logit processors (`--enable-custom-logit-processor`): code a request carries, run on
the logits of its rows before sampling, in SGLang's wire format so the same client code works.

    class OnlyToken(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list):
            for row, params in enumerate(custom_param_list):
                keep = logits[row, params["token_id"]].clone()
                logits[row] = float("-inf")
                logits[row, params["token_id"]] = keep
            return logits

    {"custom_logit_processor": OnlyToken.to_str(), "sampling_params": {"custom_params": {"token_id": 5}}}

The class travels pickled by dill (by value when it is defined in `__main__`), so a server runs
it only when launched with the flag: it is code.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _dill() -> Any:
    try:
        import dill
    except ImportError:
        raise ImportError("custom logit processors travel pickled by dill: pip install dill") from None
    return dill


class CustomLogitProcessor(ABC):
    @abstractmethod
    def __call__(self, logits: "torch.Tensor",
                 custom_param_list: list[dict[str, Any] | None] | None = None) -> "torch.Tensor":
        """logits [rows, vocab] of the requests that name this processor, and each one's
        custom_params; returns the logits to sample from (it may change them in place)."""

    @classmethod
    def to_str(cls) -> str:
        """The class as a request carries it: {"callable": the hex of its dill pickle}."""
        return json.dumps({"callable": _dill().dumps(cls).hex()})

    @staticmethod
    def from_str(text: str) -> "CustomLogitProcessor":
        """An instance of the class `text` carries (cached: a processor is unpickled once)."""
        return _unpickled(text)()


@functools.lru_cache(maxsize=64)
def _unpickled(text: str) -> type:
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("callable"), str):
        raise ValueError('a custom logit processor is {"callable": "<hex of a dill pickle>"}')
    return _dill().loads(bytes.fromhex(data["callable"]))
