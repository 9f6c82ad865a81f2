"""Incremental detokenization (srv.engine.detokenizer): streamed text equals decoding the whole output."""

from __future__ import annotations

import random

import pytest

from srv.engine.detokenizer import IncrementalDetokenizer

SAMPLES = {
    "ascii": "Hello world! The quick brown fox jumps over the lazy dog.",
    "accented": "Café, naïve façade: señor Müller's crème brûlée à l'œuvre.",
    "cjk": "日本語のテキスト、中文文本和한국어 텍스트。",
    "emoji": "Party 🎉👍🏽 time 🧑‍💻 and flags 🇫🇷🇯🇵!",
    "code": "def f(x):\n    return  x * 2\n\n\tif x:\n\t\tpass  # done\n\n\n}\r\n",
    "mixed": " leading space, \"quotes\" — dashes… ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓\n",
}


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    """A Llama-style tokenizer built in memory: "▁" word starts, byte fallback, and a decoder that
    drops the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁Hello", "▁world", "▁the", "▁a", "▁é", "▁", "e", "o", "l", ",", "▁日本", "語"]
    vocab = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
             + [(w, -1.0) for w in words])
    tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["default", "sentencepiece"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, ids: list[int], chunk_sizes=None) -> list[str]:
    """Push ids one at a time (or in the given chunk sizes), then finish; the pieces returned."""
    pieces, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        pieces.append(det.push(ids[i:i + n]))
        i += n
    pieces.append(det.finish())
    return pieces


def random_chunks(n: int, seed: int) -> list[int]:
    rng, sizes = random.Random(seed), []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 7))
    return sizes


def special_ids(tok) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens]


def check_stream(tok, ids: list[int], skip: bool, chunk_sizes=None) -> None:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = stream(det, ids, chunk_sizes)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert det.text == expected
    assert "".join(pieces) == expected
    assert det.stopped is None


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("skip", [True, False])
def test_one_at_a_time_equals_full_decode(tokenizer, sample, skip):
    check_stream(tokenizer, encode(tokenizer, SAMPLES[sample]), skip)


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("seed", range(3))
def test_random_chunks_equal_full_decode(tokenizer, sample, seed):
    ids = encode(tokenizer, SAMPLES[sample])
    check_stream(tokenizer, ids, True, random_chunks(len(ids), seed))


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
def test_special_tokens_in_the_middle(tokenizer, skip, chunked):
    specials = special_ids(tokenizer)
    ids = (specials[:1] + encode(tokenizer, "Hello world") + specials + encode(tokenizer, " 日本 and 🎉")
           + specials[-1:] * 3 + encode(tokenizer, "Hello, the end") + specials[:1])
    check_stream(tokenizer, ids, skip, random_chunks(len(ids), 1) if chunked else None)


def test_all_samples_in_one_output(tokenizer):
    text = "\n".join(SAMPLES.values())
    ids = encode(tokenizer, text)
    check_stream(tokenizer, ids, True)
    check_stream(tokenizer, ids, True, random_chunks(len(ids), 7))


@pytest.mark.parametrize("seed", range(5))
def test_random_token_ids_equal_full_decode(default_tokenizer, seed):
    """Random ids make stray and incomplete UTF-8 bytes anywhere, not only at the end."""
    rng, specials = random.Random(seed), set(special_ids(default_tokenizer))
    ids = [i for i in (rng.randrange(len(default_tokenizer)) for _ in range(400)) if i not in specials]
    check_stream(default_tokenizer, ids, True)
    check_stream(default_tokenizer, ids, False, random_chunks(len(ids), seed))


def test_incomplete_character_held_until_complete(default_tokenizer):
    tok = default_tokenizer
    ids = encode(tok, "ok 🎉")
    assert "\ufffd" in tok.decode(ids[:-1])  # the emoji's bytes span tokens
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[-1].endswith("🎉") and det.text == "ok 🎉"


def test_finish_emits_incomplete_tail_as_decoded(default_tokenizer):
    tok = default_tokenizer
    ids = encode(tok, "ok 🎉")[:-1]
    det = IncrementalDetokenizer(tok)
    assert "".join(det.push([i]) for i in ids) == "ok"
    assert det.finish() == tok.decode(ids)[2:]
    assert det.text == tok.decode(ids) and det.text.endswith("\ufffd")
    assert det.finish() == ""


# ---- stop strings ----


def stop_stream(tok, text: str, stop: list[str], chunk_sizes=None):
    det = IncrementalDetokenizer(tok, stop=stop)
    ids = encode(tok, text)
    pieces, emitted = [], ""
    i, sizes = 0, iter(chunk_sizes or [])
    while i < len(ids) and det.stopped is None:
        n = next(sizes, 1)
        pieces.append(det.push(ids[i:i + n]))
        emitted += pieces[-1]
        assert not any(s in emitted for s in stop)  # never, at any point
        i += n
    if det.stopped is None:
        pieces.append(det.finish())
    assert "".join(pieces) == det.text
    return det, pieces, ids[:i]


def test_stop_prefix_held_back_then_released(default_tokenizer):
    tok = default_tokenizer
    det = IncrementalDetokenizer(tok, stop=["\n\nUser:"])
    assert det.push(encode(tok, "Hello")) == "Hello"
    assert det.push(encode(tok, "\n\n")) == ""          # could be the stop string
    assert det.push(encode(tok, "User")) == ""          # still could be
    assert det.push(encode(tok, " said")) == "\n\nUser said"
    assert det.stopped is None and det.text == "Hello\n\nUser said"


def test_stop_prefix_released_by_finish(default_tokenizer):
    tok = default_tokenizer
    det, pieces, _ = stop_stream(tok, "Hello\n\nUs", ["\n\nUser:"])
    assert det.stopped is None and det.text == "Hello\n\nUs" and pieces[-1] == "\n\nUs"


@pytest.mark.parametrize("chunked", [False, True])
def test_stop_string_cuts_text(tokenizer, chunked):
    tok = tokenizer
    full = "Hello world, the answer.\n\nUser: more text after\n\nUser: again"
    ids = encode(tok, full)
    det, _, _ = stop_stream(tok, full, ["\n\nUser:"], random_chunks(len(ids), 3) if chunked else None)
    assert det.stopped == "\n\nUser:"
    assert det.text == tok.decode(ids)[:tok.decode(ids).find("\n\nUser:")]
    assert det.text.endswith("answer.")
    assert det.push(encode(tok, " more")) == "" and det.finish() == ""
    assert det.text.endswith("answer.")


def test_stop_in_the_middle_of_a_token(default_tokenizer):
    tok = default_tokenizer
    det, _, _ = stop_stream(tok, "The password is swordfish, obviously.", ["ordf"])
    assert det.stopped == "ordf" and det.text == "The password is sw"


def test_earliest_of_several_stops_wins(default_tokenizer):
    tok = default_tokenizer
    full = "one two three four"
    det, _, _ = stop_stream(tok, full, ["four", "two", "nothing"], [len(encode(tok, full))])
    assert det.stopped == "two" and det.text == "one "


@pytest.mark.parametrize("sample", SAMPLES)
def test_stop_matches_full_decode_cut(default_tokenizer, sample):
    tok = default_tokenizer
    full = SAMPLES[sample]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    for chunk_sizes in (None, random_chunks(len(encode(tok, full)), 5)):
        det, _, consumed = stop_stream(tok, full, [stop, "\x00never"], chunk_sizes)
        decoded = tok.decode(consumed)
        assert det.stopped == stop and det.text == decoded[:decoded.find(stop)]


def test_stop_on_special_token_text(default_tokenizer):
    tok = default_tokenizer
    det = IncrementalDetokenizer(tok, skip_special_tokens=False, stop=["<|im_end|>"])
    ids = encode(tok, "Done.") + [tok.convert_tokens_to_ids("<|im_end|>")] + encode(tok, "junk")
    pieces = [det.push([i]) for i in ids]
    assert "".join(pieces) == det.text == "Done." and det.stopped == "<|im_end|>"


def test_no_stop_strings_behaves_like_none(default_tokenizer):
    tok = default_tokenizer
    ids = encode(tok, SAMPLES["code"])
    det = IncrementalDetokenizer(tok, stop=[""])
    assert "".join(stream(det, ids)) == tok.decode(ids) and det.stopped is None
