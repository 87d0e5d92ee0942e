"""The loss mask of a multi-turn trajectory is exact at every turn boundary, with real templates.

A tiny byte-level BPE tokenizer (``tokenizers``) and two chat templates rendered with jinja2 as
Hugging Face renders them: SmolLM2's ChatML template and a Llama-3 style template.
"""

from __future__ import annotations

import re

import jinja2.sandbox
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.envs.contract import Message
from engine.envs.tools import format_tool_call
from engine.envs.trajectory import ChatRenderer, TemplateError, TrajectoryBuilder

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
#: drops the content of every model turn but the last (like templates that strip past reasoning)
NOT_PREFIX_STABLE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ '...' }}{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
#: the model-turn pattern of each template: (turn opener, end of turn)
TURNS = {SMOLLM2: ("<|im_start|>assistant\n", "<|im_end|>"),
         LLAMA3: ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")}

CONVERSATION = (
    Message("system", "You can use tools."),
    Message("user", "What is 1234 * 5678 + 9?"),
    Message("assistant", "Let me compute. " + format_tool_call("calculator", {"expression": "1234 * 5678"})),
    Message("tool", "7006652"),
    Message("assistant", format_tool_call("calculator", {"expression": "7006652 + 9"})),
    Message("tool", "7006661"),
    Message("assistant", "<answer>7006661</answer>"),
    Message("user", "Thanks! And halved?"),
    Message("assistant", "<answer>7006661/2</answer>"),
)


def _renderer_fn(template: str):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = env.from_string(template)
    return lambda messages, add_generation_prompt: compiled.render(messages=list(messages),
                                                                   add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [_renderer_fn(t)([m.as_dict() for m in CONVERSATION], True) for t in (SMOLLM2, LLAMA3)] * 20
    corpus += ["the quick brown fox computes 12 * 34 = 408 and answers", "calculator expression arguments name"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _renderer(template, tokenizer):
    return ChatRenderer(_renderer_fn(template), lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                        TURNS[template][1])


def _char_mask(tokenizer, ids, mask):
    """The mask per character of the decoded text (each token's characters get its mask bit)."""
    chars, done = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=False)
        assert text.startswith(done)
        chars += [mask[i]] * (len(text) - len(done))
        done = text
    return done, chars


def _expected_char_mask(full: str, template: str) -> list[int]:
    opener, eot = TURNS[template]
    expected = [0] * len(full)
    for m in re.finditer(re.escape(opener) + r"(.*?)" + re.escape(eot), full, re.DOTALL):
        for j in range(m.start(1), m.end()):
            expected[j] = 1
    return expected


@pytest.mark.parametrize("template", [SMOLLM2, LLAMA3], ids=["smollm2", "llama3"])
def test_the_mask_covers_exactly_the_model_turns_and_their_end_of_turn_tokens(tokenizer, template):
    renderer = _renderer(template, tokenizer)
    traj = renderer.trajectory(CONVERSATION)
    full = _renderer_fn(template)([m.as_dict() for m in CONVERSATION], False)
    text, char_mask = _char_mask(tokenizer, traj.ids, traj.mask)
    assert text == full
    assert char_mask == _expected_char_mask(full, template)
    eot_id = tokenizer.token_to_id(TURNS[template][1])
    spans = traj.model_spans()
    assert len(spans) == 4
    assert all(traj.ids[end - 1] == eot_id for _, end in spans)  # each model turn ends with its EOT, trained
    assert all(traj.ids[end] != eot_id for _, end in spans if end < len(traj.ids))


@pytest.mark.parametrize("template", [SMOLLM2, LLAMA3], ids=["smollm2", "llama3"])
def test_before_every_model_turn_the_context_is_exactly_the_generation_prompt(tokenizer, template):
    renderer = _renderer(template, tokenizer)
    traj = renderer.trajectory(CONVERSATION)
    render = _renderer_fn(template)
    turns = [i for i, m in enumerate(CONVERSATION) if m.role == "assistant"]
    for (start, _), i in zip(traj.model_spans(), turns):
        prompt = render([m.as_dict() for m in CONVERSATION[:i]], True)
        assert tokenizer.decode(list(traj.ids[:start]), skip_special_tokens=False) == prompt
        assert traj.mask[start - 1] == 0


def test_sampled_model_ids_are_kept_verbatim_not_retokenised(tokenizer):
    renderer = _renderer(SMOLLM2, tokenizer)
    eot = tokenizer.token_to_id("<|im_end|>")
    # a non-canonical tokenisation, as sampling may produce: one token per character
    sampled = [[t for ch in m.content for t in tokenizer.encode(ch, add_special_tokens=False).ids] + [eot]
               for m in CONVERSATION if m.role == "assistant"]
    traj = renderer.trajectory(CONVERSATION, model_ids=sampled)
    canonical = renderer.trajectory(CONVERSATION)
    spans = traj.model_spans()
    assert [list(traj.ids[s:e]) for s, e in spans] == sampled
    assert [list(traj.ids[s:e]) for s, e in spans] != [list(canonical.ids[s:e]) for s, e in canonical.model_spans()]
    assert tokenizer.decode(list(traj.ids), skip_special_tokens=False) == \
        tokenizer.decode(list(canonical.ids), skip_special_tokens=False)
    context = [t for t, m in zip(traj.ids, traj.mask) if not m]
    assert context == [t for t, m in zip(canonical.ids, canonical.mask) if not m]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    renderer = ChatRenderer(_renderer_fn(NOT_PREFIX_STABLE),
                            lambda text: tokenizer.encode(text, add_special_tokens=False).ids, "<|im_end|>")
    with pytest.raises(TemplateError):
        renderer.trajectory(CONVERSATION)


def test_a_reply_the_template_changes_is_refused(tokenizer):
    renderer = _renderer(LLAMA3, tokenizer)  # trims content: a reply ending in a space does not survive
    convo = (Message("user", "hi"), Message("assistant", "hello "))
    with pytest.raises(TemplateError):
        renderer.trajectory(convo)


def test_the_builder_masks_what_it_is_told():
    b = TrajectoryBuilder()
    b.add_context([1, 2, 3])
    b.add_model([4, 5])
    b.add_context([6])
    b.add_model([7])
    traj = b.build()
    assert traj.ids == (1, 2, 3, 4, 5, 6, 7)
    assert traj.mask == (0, 0, 0, 1, 1, 0, 1)
    assert traj.model_spans() == [(3, 5), (6, 7)]
    assert traj.trained_tokens == 3
