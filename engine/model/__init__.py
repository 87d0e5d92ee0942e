"""The model as files and slices: checkpoints, shard plans, tokenizer, stage loading.

* ``config`` — ``ModelConfig`` from an HF ``config.json`` (Llama, Qwen2).
* ``safetensors_reader`` / ``checkpoint`` — strict, lazy reading of HF checkpoints;
  ``errors.CheckpointError`` names the offending file.
* ``tensor_names`` — which HF tensors a stage holds; ``shard_plan`` — layer splits.
* ``tokenizer`` — the character-level tokenizer in HF format; ``chat_template`` — a
  real model's chat template rendered with sandboxed jinja2 (as transformers does).
* ``importers`` — ``polis import``: an HF directory, a GGUF file or ``smollm2-135m``
  becomes an HF-layout Polis base.
* ``loader.load_stage`` — checkpoint + StageSpec -> a loaded ``StageBackend``.
* ``random_checkpoint`` — small random checkpoints for tests, benches and the demo;
  ``reference`` — the unsplit ``transformers`` model for comparisons.

Nothing here imports torch or mlx at import time.
"""
