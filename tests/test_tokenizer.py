"""The tokenizer srv loads is the one AutoTokenizer loads, without importing torch when
tokenizer_config.json settles the class (see srv.engine.tokenizer)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
                                                        TOKENIZER_MAPPING_NAMES)

from srv.engine.tokenizer import GENERIC_BACKEND_MODEL_TYPES, hf_tokenizer

CHAT = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And 3 more, in French: é, ü?"}]


def test_the_model_types_of_the_direct_path_are_ones_transformers_does_not_correct():
    for model_type in GENERIC_BACKEND_MODEL_TYPES:
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert (TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast") != "MistralCommonBackend"


@pytest.mark.parametrize("model", ["default", "llama", "qwen2", "qwen3"])
def test_the_tokenizer_is_autotokenizers(model, default_model_dir, tiny_models):
    path = str(default_model_dir if model == "default" else tiny_models[model])
    ours, theirs = hf_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs)
    text = "Hello, world! <|im_start|> 12345 naïve   spaces\n\ttabs"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_loading_it_does_not_import_torch(default_model_dir):
    code = ("import sys; from srv.engine.tokenizer import hf_tokenizer; "
            f"hf_tokenizer({str(default_model_dir)!r}).apply_chat_template([{{'role': 'user', 'content': 'hi'}}], "
            "tokenize=False); assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_other_tokenizer_configs_go_through_autotokenizer(tmp_path, default_model_dir):
    """A class named in tokenizer_config.json that is not the generic backend: AutoTokenizer decides."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(hf_tokenizer(str(tmp_path))) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
    assert type(hf_tokenizer(str(tmp_path))).__name__ == "GPT2Tokenizer"
