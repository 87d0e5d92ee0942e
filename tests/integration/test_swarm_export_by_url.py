"""`polis export --coordinator URL` from a real running 2-node swarm (processes, WebRTC): with the stage
checkpoints out of reach it fetches every stage from its leader over WebRTC, verified against the swarm's
agreed digests, and writes exactly the local-directory export of that version, whose transformers logits
are the pipeline's; a stage whose leader is gone is an error naming the stage."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.cli import main
from tests.integration.swarm_harness import Swarm
from tests.support.export_logits import model_logits, pipeline_logits

pytestmark = [pytest.mark.network, pytest.mark.slow]

VERSIONS = 3
RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", f"max_versions={VERSIONS}",
       "checkpoint_every_versions=1"]


def _stage_files(tmp_path):
    return sorted(tmp_path.glob("n*/stages/*/stage[0-9].safetensors"), key=lambda f: f.name)  # stage order


def _hide(files):
    for f in files:
        f.rename(f.with_name(f.name + ".hidden"))


def _unhide(files):
    for f in files:
        f.with_name(f.name + ".hidden").rename(f)


def test_an_export_by_coordinator_url_fetches_the_stages_over_webrtc_and_equals_the_local_export(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    swarm = Swarm(tmp_path, settings=RUN)
    by_url, by_checkpoint, local = tmp_path / "by-url", tmp_path / "by-checkpoint", tmp_path / "local"
    url_args = ["export", "--coordinator", swarm.url, "--admin-token-file", str(tmp_path / "token"), "--json",
                "--no-eval"]
    try:
        swarm.start_coordinator()
        for i in range(2):
            swarm.start_node(f"n{i}")
        stats = swarm.wait(lambda s: s["finished"] and all(st["leader"] for st in s["stages"]), timeout_s=400,
                           what=f"the run to pass version {VERSIONS}")
        last = stats["version"]
        files = _stage_files(tmp_path)
        assert len(files) == 2
        (tmp_path / "wrong-token").write_text("not-the-token")
        assert main(["export", "--coordinator", swarm.url, "--admin-token-file", str(tmp_path / "wrong-token"),
                     "--out", str(tmp_path / "refused")]) == 2
        assert "refused the admin token" in capsys.readouterr().err
        _hide(files)  # not readable here: each stage must come from its leader over WebRTC
        assert main([*url_args, "--out", str(by_url)]) == 0
        fetched = json.loads(capsys.readouterr().out)
        _unhide(files)
        assert fetched["version"] == last >= VERSIONS
        assert [s.startswith("peer ") and s.endswith("(WebRTC)") for s in fetched["stage_files"]] == [True, True]
        assert main([*url_args, "--out", str(by_checkpoint), "--version", str(last)]) == 0
        assert json.loads(capsys.readouterr().out)["stage_files"] == [str(f) for f in files]

        # a stage whose only trainer left, its checkpoint out of reach: an error naming it, no folder
        stage1 = next(st for st in stats["stages"] if st["stage"] == 1)["leader"]
        gone = next(n for n in swarm.nodes if swarm.peer_id(n) == stage1)
        swarm.nodes[gone].terminate()
        swarm.nodes[gone].wait(30)
        swarm.wait(lambda s: not s["stages"][1]["replicas"], timeout_s=60, what="stage 1's trainer to leave")
        _hide([f for f in files if f.name == "stage1.safetensors"])
        assert main([*url_args, "--out", str(tmp_path / "refused")]) == 2
        error = capsys.readouterr().err
        assert f"stage 1 has no reachable weights of version {last}" in error and "Bring back a node" in error
        assert not (tmp_path / "refused").exists()
        _unhide([f for f in files if f.name == "stage1.safetensors"])
    finally:
        swarm.stop()

    assert main(["export", "--run-dir", str(tmp_path / "c.db"), "--out", str(local), "--json", "--no-eval"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["version"] == last and summary["shards"] == fetched["shards"]
    for out in (by_url, by_checkpoint):
        for shard in summary["shards"]:
            assert (out / shard).read_bytes() == (local / shard).read_bytes(), (out, shard)
    assert json.loads((by_url / "polis_model.json").read_text())["source"] == swarm.url
    assert "fetched over WebRTC (2 of 2 stages)" in (by_url / "README.md").read_text()

    # the pipeline at that version, restored from the stages' checkpoints as a node restores them
    x = pipeline_logits(swarm.checkpoint, summary["stage_files"], last)
    exported = model_logits(by_url)
    assert np.max(np.abs(exported - x)) <= 1e-5
