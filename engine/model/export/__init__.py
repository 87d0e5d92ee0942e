"""``polis export``: a run's policy version as a public artifact (HF checkpoint, PEFT adapter, model card).

* ``run_record`` — what a run's coordinator database says (read-only; or as a coordinator sent it);
* ``stage_files`` — each stage's checkpoint of one version, verified by its content hash;
* ``hf_export`` — sharded safetensors (one shard per stage), index, config, tokenizer;
* ``peft_adapter`` — a LoRA run's adapters in PEFT's format;
* ``gguf_export`` — the merged model as one GGUF file (Llama, f32/f16, tokenizer in metadata);
* ``model_card`` — ``README.md`` with HF front matter, generated from the database and evals;
* ``command`` — the CLI.

From a running swarm (``polis export --coordinator URL``) the stages' weights are fetched by
``engine.swarm.export_fetch`` (checkpoint when readable here, else the stage leader over WebRTC,
verified against the swarm's agreed digest) and written by the same ``hf_export.write_export``.
"""
