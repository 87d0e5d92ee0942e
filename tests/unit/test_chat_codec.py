"""The chat codec: one tokenizer path through `tokenizers`, chat templates rendered as transformers does."""

import json

import pytest

from engine.model.chat_template import ChatTemplate, ChatTemplateError
from engine.model.tokenizer import CharTokenizer
from engine.rl.codec import ChatCodec, CodecError, TaskCodec, load_codec
from tests.support.tiny_tied_llama import IM_END, write_tiny_tied_llama

SYSTEM = "Answer inside <answer></answer> tags."
ONE_SHOT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "3 + 4 = 7. <answer>7</answer>"},
    {"role": "user", "content": "What is 12 - 9?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_tied_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_chat_prompt_renders_and_encodes_exactly_as_transformers_apply_chat_template(tiny_dir):
    transformers = pytest.importorskip("transformers")
    codec = ChatCodec.from_dir(tiny_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    want_text = hf.apply_chat_template(ONE_SHOT, tokenize=False, add_generation_prompt=True)
    assert codec.render(ONE_SHOT) == want_text
    assert want_text.endswith("<|im_start|>assistant\n")
    assert codec.encode_messages(ONE_SHOT) == hf(want_text, add_special_tokens=False)["input_ids"]


def test_stop_set_holds_the_eos_ids_of_generation_config_and_the_templates_end_of_turn_token(tiny_dir, tmp_path):
    codec = ChatCodec.from_dir(tiny_dir)
    assert codec.eos_id == 2 and codec.stop_ids == {2, 0}  # <|im_end|> (eos_token) and <|endoftext|>
    # A model whose files name only <|endoftext|> as EOS still stops where its template ends a turn.
    other = write_tiny_tied_llama(tmp_path / "other")
    tok_config = json.loads((other / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|endoftext|>"
    (other / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    config = json.loads((other / "config.json").read_text())
    config["eos_token_id"] = 0
    (other / "config.json").write_text(json.dumps(config))
    codec = ChatCodec.from_dir(other)
    assert codec.eos_id == 0 and codec.stop_ids == {0, 2}


def test_completion_text_for_the_reward_ends_at_the_first_stop_token(tiny_dir):
    codec = ChatCodec.from_dir(tiny_dir)
    answer = codec.encode("12 - 9 = 3. <answer>3</answer>")
    ids = answer + [codec.tokenizer.token_to_id(IM_END)] + codec.encode("<answer>99</answer>")
    assert codec.completion_ids(ids) == (answer, True)
    assert codec.decode_completion(ids) == "12 - 9 = 3. <answer>3</answer>"
    assert codec.completion_ids(answer) == (answer, False)  # ran out of tokens: not finished
    assert codec.decode([codec.vocab_size + 5, *answer]) == codec.decode(answer)  # out-of-vocabulary ids dropped


def test_a_model_without_a_chat_template_refuses_chat_prompts_saying_why(tiny_dir, tmp_path):
    bare = write_tiny_tied_llama(tmp_path / "bare")
    tok_config = json.loads((bare / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(tok_config))
    codec = ChatCodec.from_dir(bare)
    with pytest.raises(CodecError, match="no chat template"):
        codec.render(ONE_SHOT)
    assert codec.encode("plain text") == ChatCodec.from_dir(tiny_dir).encode("plain text")


def test_load_codec_picks_the_character_codec_for_the_tiny_base_and_the_chat_codec_for_bpe(tiny_dir, tmp_path):
    CharTokenizer.build("0123456789rev:=").save(tmp_path / "char")
    assert isinstance(load_codec(tmp_path / "char"), TaskCodec)
    assert load_codec(tmp_path / "char").stop_ids == {load_codec(tmp_path / "char").eos_id}
    assert isinstance(load_codec(tiny_dir), ChatCodec)
    with pytest.raises(CodecError, match="not character level"):
        TaskCodec.from_dir(tiny_dir)


def test_templates_from_checkpoint_files_are_sandboxed_and_their_errors_named():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="only user turns"):
        ChatTemplate("{{ raise_exception('only user turns') }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="role"):
        ChatTemplate("{{ messages }}").render([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        ChatTemplate("{{ messages }}").render([])


def test_template_sees_the_special_token_strings_and_the_generation_block():
    template = ChatTemplate.from_tokenizer_config({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                         "{{ eos_token }}{% endfor %}{{ messages | tojson }}"})
    out = template.render([{"role": "user", "content": "é<"}], add_generation_prompt=False)
    assert out == '<s>é<</s>[{"role": "user", "content": "é<"}]'
