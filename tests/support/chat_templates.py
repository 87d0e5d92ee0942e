"""Chat templates and a tiny byte-level BPE tokenizer for tests of trajectories and loss masks.

SMOLLM2 is SmolLM2-Instruct's ChatML template; LLAMA3 a Llama-3 style template. They are
rendered with jinja2 the way Hugging Face renders chat templates.
"""

from __future__ import annotations

from typing import Iterable

import jinja2.sandbox
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
#: the model-turn pattern of each template: (turn opener, end of turn)
TURNS = {SMOLLM2: ("<|im_start|>assistant\n", "<|im_end|>"),
         LLAMA3: ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")}


def render_fn(template: str):
    """(messages as dicts, add_generation_prompt) -> text, as transformers' apply_chat_template renders."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = env.from_string(template)
    return lambda messages, add_generation_prompt: compiled.render(messages=list(messages),
                                                                   add_generation_prompt=add_generation_prompt)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 420) -> Tokenizer:
    """A byte-level BPE tokenizer (every text encodes) with the templates' special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok
