"""Character <-> token id tables for the char-level task tokenizer, without any tokenizer library.

Rewards, prompts and evals need only: encode a prompt, decode sampled ids strictly (any
special or unknown id makes a completion malformed), and the EOS / PAD / BOS ids. This
reads them from a Hugging Face ``tokenizer.json`` (+ ``tokenizer_config.json``) in a
checkpoint directory, so a coordinator can score tokens without loading a model.

What it does not know: how the tokenizer was built (``engine.model.tokenizer``), models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence


class CodecError(ValueError):
    """The tokenizer files are missing, malformed, or not character level."""


@dataclass(frozen=True)
class TaskCodec:
    """A character-level vocabulary: one id per text character plus special ids."""

    char_to_id: Mapping[str, int]
    eos_id: int
    pad_id: int
    bos_id: int | None
    vocab_size: int
    id_to_char: Mapping[int, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if any(len(ch) != 1 for ch in self.char_to_id):
            raise CodecError("every text token must be a single character")
        specials = {self.eos_id, self.pad_id} | ({self.bos_id} if self.bos_id is not None else set())
        ids = set(self.char_to_id.values())
        if ids & specials:
            raise CodecError("a special id is also a text character")
        if any(not 0 <= i < self.vocab_size for i in ids | specials):
            raise CodecError(f"token ids must lie in [0, {self.vocab_size})")
        object.__setattr__(self, "id_to_char", {i: ch for ch, i in self.char_to_id.items()})

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens). Unknown characters raise ``CodecError``."""
        try:
            return [self.char_to_id[ch] for ch in text]
        except KeyError as exc:
            raise CodecError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def encode_prompt(self, prompt: str) -> list[int]:
        """Prompt ids as the model sees them: BOS (if the vocabulary has one) + text."""
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(prompt)

    def decode_strict(self, ids: Sequence[int]) -> str | None:
        """Text of ``ids``, or ``None`` if any id is special, unknown or not an int."""
        out = []
        for i in ids:
            ch = self.id_to_char.get(int(i))
            if ch is None:
                return None
            out.append(ch)
        return "".join(out)

    def decode_lenient(self, ids: Sequence[int]) -> str:
        """Text for humans: unknown ids as ``?``, stops at EOS, skips BOS/PAD."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            out.append(self.id_to_char.get(i, "?"))
        return "".join(out)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "TaskCodec":
        """Read ``tokenizer.json`` (+ ``tokenizer_config.json``) from a checkpoint directory."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CodecError(f"{path}: missing") from None
        except (OSError, ValueError) as exc:
            raise CodecError(f"{path}: unreadable ({exc})") from None
        try:
            vocab: dict[str, int] = dict(data["model"]["vocab"])
            for tok in data.get("added_tokens", []):
                vocab[tok["content"]] = int(tok["id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"{path}: no usable vocabulary ({exc})") from None
        cfg_path = directory / "tokenizer_config.json"
        names: dict[str, str] = {}
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise CodecError(f"{cfg_path}: unreadable ({exc})") from None
            for role in ("eos", "pad", "bos"):
                value = cfg.get(f"{role}_token")
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    names[role] = value
        specials = {role: vocab.get(tok) for role, tok in names.items()}
        for role, guesses in (("eos", ("</s>", "<eos>", "<|endoftext|>")), ("pad", ("<pad>",)), ("bos", ("<s>", "<bos>"))):
            if specials.get(role) is None:
                specials[role] = next((vocab[g] for g in guesses if g in vocab), None)
        if specials["eos"] is None:
            raise CodecError(f"{path}: no end-of-sequence token")
        pad = specials["pad"] if specials["pad"] is not None else specials["eos"]
        special_ids = {specials["eos"], pad, specials["bos"]}
        chars = {tok: i for tok, i in vocab.items() if len(tok) == 1 and i not in special_ids}
        return cls(char_to_id=chars, eos_id=specials["eos"], pad_id=pad, bos_id=specials["bos"],
                   vocab_size=max(vocab.values()) + 1)
