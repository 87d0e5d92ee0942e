"""A model's chat template, rendered with jinja2 in a sandbox the way ``transformers`` renders it.

``ChatTemplate.render(messages, add_generation_prompt=True)`` turns a list of
``{"role", "content"}`` turns into the prompt text the model was tuned on. The
environment matches ``transformers``' ``apply_chat_template`` (an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block tag, ``raise_exception``,
``strftime_now`` and a non-escaping ``tojson``) and hands the template the
tokenizer's special-token strings (``bos_token``, ``eos_token``, ...), so the
text is the same character for character; a test compares them. Templates come
from checkpoint files, i.e. from strangers: the sandbox keeps them from reaching
Python internals, and template and message sizes are capped.

``end_of_turn_tokens(template_text, candidates)`` says which of the tokenizer's
special tokens close a turn in this template (used for the stop set).

This module knows template text and strings; it knows nothing about token ids,
files or models. jinja2 is imported when a template is compiled.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

#: largest template accepted (real ones are a few KB; tool-calling ones up to ~20 KB)
MAX_TEMPLATE_CHARS = 256 * 1024
#: largest conversation rendered, summed over message contents
MAX_MESSAGES_CHARS = 1024 * 1024
#: roles a message may have
ROLES = ("system", "user", "assistant", "tool")
#: special tokens that end a turn in the common template families (ChatML, Llama 3, Phi, Gemma, Llama 2)
KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>", "</s>")


class ChatTemplateError(ValueError):
    """The template cannot be compiled or rendered, or the messages are malformed."""


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"the chat template has {len(source)} characters, over the "
                                    f"{MAX_TEMPLATE_CHARS} cap")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._compiled = _compile(source)

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any]) -> "ChatTemplate | None":
        """The template of a parsed ``tokenizer_config.json`` (``None`` when it has none).

        A list of named templates (an older format) yields the one named ``default``.
        """
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is None:
            return None
        if not isinstance(template, str):
            raise ChatTemplateError(f"chat_template is a {type(template).__name__}, not text")
        specials = {key: token_text(config.get(key)) for key in
                    ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        return cls(template, {k: v for k, v in specials.items() if v is not None})

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` reaches the template too (e.g. ``enable_thinking``)."""
        import jinja2

        turns = check_messages(messages)
        try:
            return self._compiled.render(messages=turns, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.special_tokens, **extra)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from None


def token_text(value: Any) -> str | None:
    """The text of a special token as tokenizer_config.json writes it (a string or ``{"content": ...}``)."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Plain ``{"role", "content"}`` dicts, or ChatTemplateError saying what is wrong."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} turns")
    turns, total = [], 0
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else getattr(message, "role", None)
        content = message.get("content") if isinstance(message, Mapping) else getattr(message, "content", None)
        if role not in ROLES:
            raise ChatTemplateError(f"message {i} has role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ChatTemplateError(f"message {i} has no text content")
        total += len(content)
        turns.append({"role": role, "content": content})
    if total > MAX_MESSAGES_CHARS:
        raise ChatTemplateError(f"messages hold {total} characters, over the {MAX_MESSAGES_CHARS} cap")
    return turns


def end_of_turn_tokens(template_source: str, candidates: Iterable[str]) -> list[str]:
    """Those of ``candidates`` that are known end-of-turn tokens and appear literally in the template."""
    return [t for t in candidates if t in KNOWN_END_OF_TURN and t in template_source]


def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it for masks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
