"""The exported model's ``README.md``: a Hugging Face model card generated from the run's database.

Front matter (YAML; every value written as a JSON scalar, which YAML reads unchanged):
``base_model``, ``license``, ``library_name``, ``pipeline_tag``, ``tags`` and a
``model-index`` whose results are the ``polis eval`` figures of the exported model. Then
the sections a reader expects: what the model is; how it was trained (swarm size and
backends, stages, versions, samples, staleness histogram, the off-policy correction, bytes
on the wire, wall clock — all read from ``RunRecord``); the swarm's own evals; before/after
figures per task from ``polis eval`` (base vs export); a three-line ``transformers``
snippet; how to upload (Polis sends nothing); limitations. Nothing in it is typed by hand:
every figure comes from the database, the export or an eval run.

What it does not know: how evals are computed or where files are written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from engine.model.export.hf_export import ExportResult
from engine.model.export.run_record import RunRecord
from engine.rl.checkpoint_eval import TaskEval

#: ``polis import`` kinds whose upstream model is known: (Hugging Face id, its license)
KNOWN_BASES = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}


def base_identity(manifest: dict[str, Any], license_name: str | None) -> tuple[str, str]:
    """``base_model`` and ``license`` for the front matter: the upstream id and license when the base
    is a known import, else the base's own name and ``license_name`` (default ``other``)."""
    known = KNOWN_BASES.get(str(manifest.get("base_kind")))
    if known:
        return known[0], license_name or known[1]
    return str(manifest.get("base_name")), license_name or "other"


def _scalar(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def front_matter(name: str, base_name: str, license_name: str, tags: Sequence[str],
                 after: Sequence[TaskEval]) -> str:
    lines = ["---", f"base_model: {_scalar(base_name)}", f"license: {_scalar(license_name)}",
             'library_name: "transformers"', 'pipeline_tag: "text-generation"', "tags:"]
    lines += [f"- {_scalar(t)}" for t in tags]
    lines += ["model-index:", f"- name: {_scalar(name)}", "  results:"]
    for r in after:
        lines += ["  - task:", '      type: "text-generation"', "    dataset:",
                  f"      name: {_scalar(r.task)}", f"      type: {_scalar(r.task)}",
                  f"      split: {_scalar(f'held-out ({r.items} items, fixed seed)')}", "    metrics:",
                  '    - type: "accuracy"', '      name: "strict accuracy (greedy)"',
                  f"      value: {_scalar(round(100 * r.strict, 2))}"]
        if r.content is not None:
            lines += ['    - type: "accuracy"', '      name: "content-only accuracy (greedy)"',
                      f"      value: {_scalar(round(100 * r.content, 2))}"]
    if not after:
        lines[-1] = "  results: []"
    lines.append("---")
    return "\n".join(lines)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {s:02d} s"


def training_rows(record: RunRecord, result: ExportResult) -> list[tuple[str, str]]:
    run = record.run
    trainers = [p for p in record.peers if (p.role or "trainer") == "trainer"]
    inference = [p for p in record.peers if p.role == "inference"]
    backends: dict[str, int] = {}
    for p in record.peers:
        key = f"{p.backend or '?'}" + (f" on {p.device}" if p.device else "")  # the device when the node said
        backends[key] = backends.get(key, 0) + 1
    objective = run.get("objective", {})
    correction = (f"decoupled PPO: proximal anchor, truncated importance weight min(exp(p - b), "
                  f"{objective.get('is_cap')}), tokens masked outside exp(p - b) in "
                  f"[{objective.get('mask_low')}, {objective.get('mask_high')}]"
                  if objective.get("decoupled") else "none (plain PPO against the behaviour policy)")
    hist = record.staleness["histogram"]
    per_stage: dict[int, int] = {}
    for p in trainers:
        if p.stage is not None:
            per_stage[p.stage] = per_stage.get(p.stage, 0) + 1
    return [
        ("swarm", f"{len(record.peers)} nodes ({len(trainers)} trainers, {len(inference)} inference replicas); "
                  f"trainers per stage: " + ", ".join(f"stage {s}: {n}" for s, n in sorted(per_stage.items()))),
        ("backends", "; ".join(f"{n} x {k}" for k, n in sorted(backends.items())) or "-"),
        ("pipeline stages", str(record.num_stages)),
        ("task", f"{record.task.name} (eval_size {record.task.eval_size})"),
        ("fine-tuning", "LoRA rank {rank}, alpha {alpha}, on {t}".format(
            t=", ".join(result.lora["target_modules"]), **result.lora) if result.lora else "full (every weight)"),
        ("policy versions", f"{record.latest_version} trained; this export is version {result.version}"),
        ("samples trained on", str(record.samples)),
        ("rollouts", ", ".join(f"{k}: {v}" for k, v in sorted(record.rollout_counts.items())) or "-"),
        ("group size x prompts per step", f"{run.get('group_size')} x {run.get('prompts_per_step')}"),
        ("learning rate", str(run.get("lr"))),
        ("max staleness", f"{run.get('max_staleness')} versions"),
        ("staleness histogram", f"{json.dumps(hist)} ({record.staleness['counts']})"),
        ("off-policy correction", correction),
        ("bytes on the wire", f"{record.bytes_on_wire / 1e6:.1f} MB sent by all nodes (as they reported it)"),
        ("wall clock", _duration(record.wall_clock_s)),
    ]


def _sources(result: ExportResult) -> str:
    fetched = sum(1 for f in result.stage_files if f.startswith("peer "))
    if not fetched:
        return "the stages' own checkpoints, each verified against the SHA-256 recorded when it was saved"
    return (f"the stages' checkpoints and their leaders' weights fetched over WebRTC ({fetched} of "
            f"{len(result.stage_files)} stages), each verified against the SHA-256 recorded when it was saved "
            "or the weights digest the stage's replicas reported for that version")


def render_card(record: RunRecord, result: ExportResult, *, manifest: dict[str, Any], before: Sequence[TaskEval],
                after: Sequence[TaskEval], license_name: str | None = None) -> str:
    """The model card text (``README.md``) of ``result``; ``manifest``: the export's ``polis_model.json``."""
    base_name = str(manifest.get("base_name"))
    base_model, license_name = base_identity(manifest, license_name)
    name = f"{base_name}-polis-v{result.version}"
    tags = ["polis", "reinforcement-learning", "grpo", "decentralized-training", "text-generation"]
    if result.lora:
        tags.append("lora")
    weights = ("PEFT adapters" if result.adapter_only else "merged LoRA adapters" if result.lora
               else "fp32 weights")
    parts = [front_matter(name, base_model, license_name, tags, after), "", f"# {name}", "",
             "## What it is", "",
             f"`{base_name}` post-trained with reinforcement learning from verifiable rewards by a Polis swarm: "
             f"the model was cut into {record.num_stages} pipeline stages held by different machines, which "
             f"generated rollouts through the pipeline and trained their own stage. This is policy version "
             f"{result.version} of run `{record.run_id}`, written by `polis export` from {_sources(result)} "
             f"({weights}"
             f"{', one tied embedding matrix' if result.tied else ''}).", "",
             "## How it was trained", "", "| | |", "|---|---|"]
    parts += [f"| {k} | {v} |" for k, v in training_rows(record, result)]
    parts += ["", "The swarm's own held-out evals (greedy, exact match / strict score, recorded by the coordinator):",
              "", "| version | accuracy | items |", "|---|---|---|"]
    parts += [f"| {e['version']} | {_pct(e['accuracy'])} | {e['n']} |" for e in record.evals] or ["| - | - | - |"]
    parts += ["", "## Evaluation", "",
              "Greedy decoding on each task's fixed held-out split (the items the run never trained on), "
              "measured by `polis eval` on the base and on this export. *Strict*: exact match (digit tasks) or "
              "the dataset's score of the answer inside `<answer>` tags; *content*: the stated answer with the "
              "tags ignored (claim a skill from this one).", "",
              "| task | items | strict before | strict after | content before | content after |",
              "|---|---|---|---|---|---|"]
    by_task = {r.task: r for r in before}
    for r in after:
        b = by_task.get(r.task)
        parts.append(f"| {r.task} | {r.items} | {_pct(b.strict if b else None)} | {_pct(r.strict)} | "
                     f"{_pct(b.content if b else None)} | {_pct(r.content)} |")
    if not after:
        parts.append("| (not evaluated: exported with --no-eval) | | | | | |")
    parts += ["", "## How to use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "tokenizer = AutoTokenizer.from_pretrained(\"PATH_TO_THIS_FOLDER\")",
              "model = AutoModelForCausalLM.from_pretrained(\"PATH_TO_THIS_FOLDER\")", "```", "",
              "Polis uploads nothing. To publish the folder: `huggingface-cli upload YOUR_NAME/MODEL_NAME "
              "PATH_TO_THIS_FOLDER`.", "",
              "## Limitations", "",
              f"- Trained and evaluated on one task family ({record.task.name}); other skills of the base are not "
              "measured here and may have changed.",
              "- Accuracy is greedy on a few hundred procedurally generated items at most: a point or two either way "
              "is noise.",
              "- A strict gain can be format (answering inside the tags) rather than skill; compare the content "
              "figures.",
              *([f"- The base was imported from `{Path(str(manifest['base_source'])).name}`; if that is a quantised "
                 "GGUF, its dequantised weights are not the original full-precision model's."]
                if str(manifest.get("base_source", "")).endswith(".gguf") else []),
              "- The training data came from untrusted peers; rollouts were scored by the coordinator, but a "
              "colluding majority of a stage's replicas could have steered its weights.",
              "", f"<sub>Generated by `polis export` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from "
              f"`{record.origin or record.db_path.name}` of run `{record.run_id}`.</sub>", ""]
    return "\n".join(parts)
