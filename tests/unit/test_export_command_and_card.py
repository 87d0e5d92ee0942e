"""`polis export` end to end (folder + model card from the database) and `polis eval` on the tiny chat model."""

import json

import pytest

from engine.cli import main
from engine.paths import base_checkpoint_dir
from tests.support.stage_run import make_run
from tests.support.tiny_tied_llama import write_tiny_tied_llama

yaml = pytest.importorskip("yaml")


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_polis_export_writes_a_model_card_whose_numbers_come_from_the_run_and_polis_eval(tmp_path, capsys):
    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=3, lr=3e-3)
    run.close()
    out = tmp_path / "out"
    assert main(["export", "--run-dir", str(run.run_dir), "--out", str(out), "--eval-n", "40", "--json",
                 "--backend", "torch"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["version"] == 3 and len(summary["shards"]) == 2
    card = (out / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers" and "polis" in meta["tags"]
    assert meta["base_model"] == base_checkpoint_dir().name
    [result] = meta["model-index"][0]["results"]
    after = summary["evals_after"][0]
    assert result["dataset"]["name"] == "reversal" and "40 items" in result["dataset"]["split"]
    assert result["metrics"][0]["value"] == pytest.approx(round(100 * after["strict"], 2))
    # `polis eval` on the exported folder gives the number the card states
    assert main(["eval", str(out), "--run-dir", str(run.run_dir), "--n", "40", "--json", "--backend", "torch"]) == 0
    again = json.loads(capsys.readouterr().out)["results"][0]
    assert again["strict"] == after["strict"]
    # the training section is the database's: stages, versions, samples (4 rows x 3 versions), bytes, peers
    assert "| pipeline stages | 2 |" in card
    assert "| samples trained on | 12 |" in card
    assert "this export is version 3" in card
    assert "0.0 MB sent" in card and "2 nodes (2 trainers" in card
    assert '{"0": 1, "1": 2}' in card  # per-update mean staleness 1, 0, 1 from the versions table
    assert "AutoModelForCausalLM.from_pretrained" in card


def test_polis_export_of_a_missing_version_says_which_stage_and_what_to_do(tmp_path, capsys):
    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=2)
    run.close()
    assert main(["export", "--run-dir", str(run.run_dir), "--out", str(tmp_path / "o"), "--version", "7"]) == 2
    err = capsys.readouterr().err
    assert "stage 0 of 2 has no checkpoint of version 7" in err and "omit --version" in err


def test_polis_eval_scores_a_chat_task_strictly_and_by_content_on_a_bpe_model(tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    model = write_tiny_tied_llama(tmp_path / "tiny")
    assert main(["eval", str(model), "--task", "reasoning_gym:chain_sum", "--options",
                 '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}', "--n", "4",
                 "--max-new-tokens", "3", "--json"]) == 0
    [r] = json.loads(capsys.readouterr().out)["results"]
    assert r["task"] == "reasoning_gym:chain_sum" and r["items"] == 4 and r["max_new_tokens"] == 3
    assert r["content"] is not None and r["well_formed"] is not None
    # a digit task on a BPE model is refused with what to do instead
    assert main(["eval", str(model), "--task", "reversal"]) == 2
    assert "evaluate it on a chat task" in capsys.readouterr().err


def test_a_card_names_a_known_imported_base_by_its_hub_id_and_license():
    from engine.model.export.model_card import base_identity

    smol = {"base_name": "SmolLM2-135M-Instruct", "base_kind": "smollm2-135m"}
    assert base_identity(smol, None) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert base_identity({"base_name": "my-model", "base_kind": "hf-dir"}, None) == ("my-model", "other")
    assert base_identity({"base_name": "my-model"}, "mit") == ("my-model", "mit")
