"""A character-level tokenizer built with ``tokenizers``, saved in Hugging Face format.

Every character of a given alphabet is one token; four special tokens come
first: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3, any character
outside the alphabet). ``save(dir)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads the same tokenizer;
``CharTokenizer.load(dir)`` reads ``tokenizer.json`` back with ``tokenizers`` only
(no transformers import). No BOS/EOS is added implicitly: callers say so.

This module knows tokens and text; it knows nothing about models or tasks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.model.errors import CheckpointError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


class CharTokenizer:
    """One token per character; see the module docstring for ids and files."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if any(i is None for i in ids):
            missing = [t for t, i in zip(SPECIAL_TOKENS, ids) if i is None]
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = ids

    # -- construction ------------------------------------------------------------
    @classmethod
    def build(cls, alphabet: str) -> "CharTokenizer":
        """A tokenizer whose vocabulary is the special tokens then each character of ``alphabet``."""
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError("alphabet must be a non-empty string of characters")
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if duplicates:
            raise ValueError(f"alphabet repeats characters {duplicates!r}")
        vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(tok)

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        """Load ``tokenizer.json`` from a checkpoint directory."""
        path = Path(directory) / TOKENIZER_FILE
        try:
            return cls(Tokenizer.from_file(str(path)))
        except FileNotFoundError:
            raise CheckpointError(path, "file not found (the checkpoint has no tokenizer)") from None
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(path, f"not a usable tokenizer ({exc})") from None

    def save(self, directory: str | Path, *, model_max_length: int = 2048) -> None:
        """Write the HF tokenizer files into ``directory`` (created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        special = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                  "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
                  "add_bos_token": False, "add_eos_token": False}
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (directory / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")

    # -- use ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def alphabet(self) -> str:
        """The characters of the vocabulary, in id order (special tokens excluded)."""
        by_id = sorted((i, t) for t, i in self._tok.get_vocab(with_added_tokens=False).items())
        return "".join(t for _, t in by_id if t not in SPECIAL_TOKENS)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (unknown characters become ``<unk>``)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def encode_batch(self, texts: Sequence[str], **kwargs) -> list[list[int]]:
        return [self.encode(t, **kwargs) for t in texts]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special`` is false."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)
