"""The character tokenizer: round trips, HF-format files that AutoTokenizer loads identically."""

from __future__ import annotations

import pytest

from engine.model.errors import CheckpointError
from engine.model.tokenizer import CharTokenizer

ALPHABET = "0123456789abc +=:\n\t<>"


def test_round_trip_and_special_token_ids():
    tok = CharTokenizer.build(ALPHABET)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 4 + len(ALPHABET) and tok.alphabet == ALPHABET
    text = "12+ab=\n\t3 <c>"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert len(ids) == len(text) + 2 and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"


def test_characters_outside_the_alphabet_become_unk():
    tok = CharTokenizer.build(ALPHABET)
    assert tok.encode("1z2") == [tok.encode("1")[0], tok.unk_id, tok.encode("2")[0]]


def test_saved_files_load_back_and_into_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = CharTokenizer.build(ALPHABET)
    tok.save(tmp_path)
    again = CharTokenizer.load(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "ab 12=3\n"
    assert again.encode(text) == tok.encode(text) == hf(text)["input_ids"]
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    assert hf.decode(tok.encode(text, add_eos=True), skip_special_tokens=True) == text
    assert len(hf) == tok.vocab_size


def test_bad_alphabets_and_missing_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer.build("abca")
    with pytest.raises(ValueError):
        CharTokenizer.build("")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        CharTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="not a usable tokenizer"):
        CharTokenizer.load(tmp_path)
