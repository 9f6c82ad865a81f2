"""A tiny random Llama and a tiny word-level tokenizer, built in code (nothing is downloaded).

    path = write_tiny_llama(tmp_path / "llama")         # config.json, weights, tokenizer files
    tokens = hf_greedy(tiny_llama(), [5, 6, 7], 8)       # Hugging Face's greedy continuation

The tokenizer maps the words "t3" .. "t{vocab-1}" to ids 3 .. vocab-1 ("<unk>" 0, "<s>" 1,
"</s>" 2), so `srv.Engine` loads it like any model's and text prompts such as "t5 t6 t7" work.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 256
CONFIG = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3,
              tie_word_embeddings=False)


@functools.lru_cache(maxsize=4)
def tiny_llama(seed: int = 0) -> Any:
    """A float32 `transformers.LlamaForCausalLM` (2 layers, GQA 4/2 heads, vocab 256), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A `PreTrainedTokenizerFast` over the words t3 .. t{vocab_size-1}, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")


def save_tiny_tokenizer(path: Path, vocab_size: int = VOCAB_SIZE) -> None:
    tiny_tokenizer(vocab_size).save_pretrained(str(path))


def write_tiny_llama(path: Path, weights: str = "safetensors", model: Any = None) -> Path:
    """Save `model` (default: `tiny_llama()`) with its config and the tiny tokenizer in `path`.

    weights: "safetensors" (model.safetensors, as save_pretrained writes it) or "pt"
    (a pytorch_model.bin state dict).
    """
    model = tiny_llama() if model is None else model
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if weights == "safetensors":
        model.save_pretrained(str(path))
    elif weights == "pt":
        model.config.save_pretrained(str(path))
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, path / "pytorch_model.bin")
    else:
        raise ValueError(f"weights must be 'safetensors' or 'pt', not {weights!r}")
    save_tiny_tokenizer(path, model.config.vocab_size)
    return path


def random_prompts(lengths: list[int], vocab_size: int = VOCAB_SIZE, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, of ordinary tokens (ids 3 .. vocab_size-1)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy continuation (argmax of the full forward pass, eos ignored)."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.float().argmax()))
    return ids[len(prompt_ids):]
