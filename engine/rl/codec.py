"""Text <-> token ids for tasks: the one tokenizer path, through ``tokenizers``.

Two codecs, both read from a checkpoint directory's Hugging Face files
(``tokenizer.json`` loaded with ``tokenizers.Tokenizer.from_file``, plus
``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` for the
special ids), so a coordinator can build prompts and score completions without
loading a model:

* ``TaskCodec`` — the character-level vocabulary of the shipped tiny base (one id
  per character, built by ``engine.model.tokenizer``). The digit tasks use it:
  encode a prompt, decode sampled ids strictly (any special or unknown id makes a
  completion malformed), EOS / PAD / BOS ids.
* ``ChatCodec`` — a real model's BPE tokenizer with its chat template: prompts are
  ``messages`` (system / user / worked-example turns) rendered by the template with
  the generation prompt appended (``engine.model.chat_template``, jinja2, not
  transformers); generation stops on ``stop_ids`` (the model's EOS ids from
  ``generation_config.json``, ``tokenizer_config.json`` and ``config.json``, plus the
  end-of-turn token its template closes turns with); completions decode to text for
  the reward.

``load_codec(dir)`` picks the right one. What this module does not know: models,
tasks, rewards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.model.chat_template import ChatTemplate, ChatTemplateError, end_of_turn_tokens, token_text

#: largest JSON side file read (tokenizer_config.json with a template is tens of KB)
MAX_JSON_BYTES = 4 * 1024 * 1024
#: largest tokenizer.json read (a 150 k-token BPE vocabulary is ~11 MB)
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


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

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a completion (the character codec has one: EOS)."""
        return frozenset({self.eos_id})

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
        """Read a character-level ``tokenizer.json`` (+ ``tokenizer_config.json``) from a checkpoint directory."""
        files = _TokenizerFiles.read(Path(directory))
        model_type = type(files.tokenizer.model).__name__
        if model_type != "WordLevel":
            raise CodecError(f"{files.path}: a {model_type} tokenizer is not character level; "
                             f"use ChatCodec (engine.rl.codec.load_codec picks it)")
        vocab = files.tokenizer.get_vocab(with_added_tokens=True)
        eos, pad, bos = files.special_id("eos"), files.special_id("pad"), files.special_id("bos")
        if eos is None:
            raise CodecError(f"{files.path}: no end-of-sequence token")
        pad = pad if pad is not None else eos
        special_ids = {eos, pad, bos}
        chars = {tok: i for tok, i in vocab.items() if len(tok) == 1 and i not in special_ids}
        return cls(char_to_id=chars, eos_id=eos, pad_id=pad, bos_id=bos, vocab_size=max(vocab.values()) + 1)


@dataclass(frozen=True)
class ChatCodec:
    """A BPE (or any ``tokenizers``) vocabulary with the model's chat template and stop set."""

    tokenizer: Any  #: a ``tokenizers.Tokenizer``
    template: ChatTemplate | None  #: None: the model has no chat template (chat prompts are refused)
    eos_id: int  #: the canonical end-of-sequence id (first of the model's EOS ids)
    pad_id: int  #: id used to right-pad batches (the tokenizer's pad token, else EOS)
    bos_id: int | None  #: the BOS id, when the tokenizer names one (templates write it themselves)
    stop_ids: frozenset[int]  #: every id that ends a completion (EOS ids + end-of-turn tokens)
    vocab_size: int  #: ids in the tokenizer, added tokens included

    def __post_init__(self) -> None:
        if self.eos_id not in self.stop_ids:
            raise CodecError("the EOS id must be one of the stop ids")
        ids = set(self.stop_ids) | {self.pad_id} | ({self.bos_id} if self.bos_id is not None else set())
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise CodecError(f"special token ids must lie in [0, {self.vocab_size})")

    # -- prompts -----------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """Prompt text: ``messages`` through the chat template, ending with the assistant's turn opener."""
        if self.template is None:
            raise CodecError("this model has no chat template (tokenizer_config.json has no 'chat_template'); "
                             "chat tasks need an instruction-tuned model")
        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        except ChatTemplateError as exc:
            raise CodecError(str(exc)) from None

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as the template wrote it (special-token text becomes its id; nothing is added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_messages(self, messages: Sequence[Mapping[str, str]], **extra: Any) -> list[int]:
        """Prompt ids for a chat: rendered with the generation prompt, then encoded."""
        return self.encode(self.render(messages, add_generation_prompt=True, **extra))

    # -- completions -------------------------------------------------------------
    def completion_ids(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The ids before the first stop id, and whether a stop id was produced at all."""
        out = []
        for i in ids:
            i = int(i)
            if i in self.stop_ids:
                return out, True
            out.append(i)
        return out, False

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special`` is false."""
        valid = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tokenizer.decode(valid, skip_special_tokens=skip_special)

    def decode_completion(self, ids: Sequence[int]) -> str:
        """The text a reward scores: the completion up to its first stop id, special tokens dropped."""
        return self.decode(self.completion_ids(ids)[0])

    @classmethod
    def from_dir(cls, directory: str | Path) -> "ChatCodec":
        """Read the tokenizer, its template and the stop set from a checkpoint directory."""
        files = _TokenizerFiles.read(Path(directory))
        try:
            template = ChatTemplate.from_tokenizer_config(files.tokenizer_config)
        except ChatTemplateError as exc:
            raise CodecError(f"{files.directory / 'tokenizer_config.json'}: {exc}") from None
        eos_ids = files.eos_ids()
        if not eos_ids:
            raise CodecError(f"{files.path}: no end-of-sequence token (neither generation_config.json, "
                             f"tokenizer_config.json nor config.json names one)")
        stops = set(eos_ids)
        if template is not None:
            added = [t.content for t in files.tokenizer.get_added_tokens_decoder().values()]
            stops.update(files.tokenizer.token_to_id(t) for t in end_of_turn_tokens(template.source, added))
        pad = files.special_id("pad")
        return cls(tokenizer=files.tokenizer, template=template, eos_id=eos_ids[0],
                   pad_id=pad if pad is not None else eos_ids[0], bos_id=files.special_id("bos"),
                   stop_ids=frozenset(stops), vocab_size=files.tokenizer.get_vocab_size(with_added_tokens=True))


def load_codec(directory: str | Path) -> TaskCodec | ChatCodec:
    """The codec for a checkpoint: character level for a WordLevel tokenizer, chat otherwise."""
    files = _TokenizerFiles.read(Path(directory))
    if type(files.tokenizer.model).__name__ == "WordLevel":
        return TaskCodec.from_dir(directory)
    return ChatCodec.from_dir(directory)


@dataclass(frozen=True)
class _TokenizerFiles:
    """The tokenizer and the JSON files that name its special tokens, as read from one directory."""

    directory: Path
    tokenizer: Any
    tokenizer_config: Mapping[str, Any]
    generation_config: Mapping[str, Any]
    model_config: Mapping[str, Any]

    @property
    def path(self) -> Path:
        return self.directory / "tokenizer.json"

    @classmethod
    def read(cls, directory: Path) -> "_TokenizerFiles":
        from tokenizers import Tokenizer

        path = directory / "tokenizer.json"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CodecError(f"{path}: missing (the checkpoint has no tokenizer)") from None
        if size > MAX_TOKENIZER_BYTES:
            raise CodecError(f"{path}: {size} bytes, over the {MAX_TOKENIZER_BYTES}-byte cap")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise CodecError(f"{path}: unreadable ({exc})") from None
        return cls(directory, tokenizer, _optional_json(directory / "tokenizer_config.json"),
                   _optional_json(directory / "generation_config.json"), _optional_json(directory / "config.json"))

    def special_id(self, role: str) -> int | None:
        """Id of the ``role`` (eos, pad, bos) token named by tokenizer_config.json, else a common spelling."""
        name = token_text(self.tokenizer_config.get(f"{role}_token"))
        if name is not None and self.tokenizer.token_to_id(name) is not None:
            return self.tokenizer.token_to_id(name)
        for key in (self.generation_config, self.model_config):
            value = key.get(f"{role}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        guesses = {"eos": ("</s>", "<eos>", "<|endoftext|>"), "pad": ("<pad>",), "bos": ("<s>", "<bos>")}[role]
        return next((self.tokenizer.token_to_id(g) for g in guesses if self.tokenizer.token_to_id(g) is not None),
                    None)

    def eos_ids(self) -> list[int]:
        """Every EOS id the files name, the tokenizer's own first, without repeats."""
        out: list[int] = []
        named = self.special_id("eos")
        for value in (named, self.generation_config.get("eos_token_id"), self.model_config.get("eos_token_id")):
            for i in value if isinstance(value, list) else [value]:
                if isinstance(i, int) and not isinstance(i, bool) and i not in out:
                    out.append(i)
        return out


def _optional_json(path: Path) -> Mapping[str, Any]:
    if not path.exists():
        return {}
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CodecError(f"{path}: over the {MAX_JSON_BYTES}-byte cap")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise CodecError(f"{path}: not a JSON object")
    return data
