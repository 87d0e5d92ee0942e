"""`polis export --gguf`: transformers loads the GGUF file alone (gguf_file=) with the export's logits,
its tokenizer from GGUF metadata, and the same greedy answers on held-out chat items."""

import json
import shutil

import pytest

from engine.cli import main
from tests.support.stage_run import make_run
from tests.support.tiny_tied_llama import write_tiny_tied_llama

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("gguf")


def test_a_gguf_export_loads_back_with_the_same_logits_tokenizer_and_greedy_answers(tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    from engine.rl.codec import ChatCodec
    from engine.rl.tasks import TaskConfig, make_chat_task

    base = write_tiny_tied_llama(tmp_path / "tied", num_layers=2)
    run = make_run(tmp_path / "run", base, num_stages=2, steps=2, vocab_low=3, vocab_high=300)
    run.close()
    out = tmp_path / "out"
    assert main(["export", "--run-dir", str(run.run_dir), "--out", str(out), "--no-eval", "--gguf", "f32",
                 "--json"]) == 0
    gguf_path = json.loads(capsys.readouterr().out)["gguf"]
    alone = tmp_path / "alone"  # only the .gguf: the tokenizer must come from its metadata
    alone.mkdir()
    shutil.copy(gguf_path, alone / "model.gguf")

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    gg = transformers.AutoModelForCausalLM.from_pretrained(str(alone), gguf_file="model.gguf",
                                                           dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(alone), gguf_file="model.gguf")
    codec = ChatCodec.from_dir(out)
    task = make_chat_task(TaskConfig(name="reasoning_gym:chain_sum", eval_size=8,
                                     options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}))
    for item in task.eval_items()[:4]:
        text = codec.render(item.prompt.as_dicts())
        ids = codec.encode(text)
        assert tok(text, add_special_tokens=False).input_ids == ids
        prompt = torch.as_tensor([ids])
        with torch.no_grad():
            assert torch.max(torch.abs(hf(prompt).logits - gg(prompt).logits)).item() <= 1e-5
            a = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=codec.pad_id)
            b = gg.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=codec.pad_id)
        assert a.tolist() == b.tolist()


def test_the_character_level_base_has_no_gguf_form_and_says_so(tmp_path):
    from engine.model.errors import CheckpointError
    from engine.model.export.gguf_export import write_gguf
    from engine.paths import base_checkpoint_dir

    with pytest.raises(CheckpointError, match="byte-level BPE"):
        write_gguf(base_checkpoint_dir(), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()

