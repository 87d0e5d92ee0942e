"""Shard plans: cutting a model's decoder layers into contiguous pipeline stages.

``plan_stages(num_layers, num_stages)`` splits the layers evenly, earlier
stages taking one extra layer when the split is uneven (stage 0 also runs the
embedding lookup, which is cheap; the last stage runs the LM head, which is not,
so the last stage is never the one given more layers). ``check_plan`` validates a
plan received from elsewhere (for instance a coordinator). This module knows
layer indices only, not tensors or devices.
"""

from __future__ import annotations

from typing import Sequence

from backends.base import StageSpec


def plan_stages(num_layers: int, num_stages: int) -> list[StageSpec]:
    """Split ``num_layers`` decoder layers into ``num_stages`` contiguous, non-empty stages."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages (at most one stage per layer)")
    base, extra = divmod(num_layers, num_stages)
    specs, start = [], 0
    for index in range(num_stages):
        count = base + (1 if index < extra else 0)
        specs.append(StageSpec(index, num_stages, start, start + count))
        start += count
    return specs


def check_plan(specs: Sequence[StageSpec], num_layers: int) -> None:
    """Raise ``ValueError`` unless ``specs`` cover ``[0, num_layers)`` contiguously, in order."""
    if not specs:
        raise ValueError("a plan needs at least one stage")
    expected_start = 0
    for index, spec in enumerate(specs):
        if spec.stage_index != index or spec.num_stages != len(specs):
            raise ValueError(f"stage {index} is labelled {spec.stage_index} of {spec.num_stages}, "
                             f"expected {index} of {len(specs)}")
        if spec.layer_start != expected_start:
            raise ValueError(f"stage {index} starts at layer {spec.layer_start}, expected {expected_start}")
        expected_start = spec.layer_end
    if expected_start != num_layers:
        raise ValueError(f"plan ends at layer {expected_start} but the model has {num_layers} layers")


def check_spec(spec: StageSpec, num_layers: int) -> None:
    """Raise ``ValueError`` unless ``spec`` fits a model of ``num_layers`` layers.

    The last stage must end at the last layer (it applies the final norm and head).
    """
    if spec.layer_end > num_layers:
        raise ValueError(f"stage {spec.stage_index} wants layers up to {spec.layer_end} "
                         f"but the model has {num_layers}")
    if spec.is_last and spec.layer_end != num_layers:
        raise ValueError(f"last stage ends at layer {spec.layer_end}, not at the model's last layer {num_layers}")
    if spec.is_first and spec.layer_start != 0:
        raise ValueError(f"first stage starts at layer {spec.layer_start}, not 0")
