import asyncio
import time

import pytest

from engine.swarm.rate_limit import TokenBucket
from engine.swarm.run_config import RunConfig, run_config_from_dict


def test_run_config_survives_the_wire_and_rejects_bad_fields():
    cfg = RunConfig()
    assert run_config_from_dict(cfg.to_dict()) == cfg
    bad = cfg.to_dict()
    bad["lr"] = 5.0
    with pytest.raises(ValueError):
        run_config_from_dict(bad)
    bad = cfg.to_dict()
    bad["objective"]["sneaky"] = 1
    with pytest.raises(ValueError):
        run_config_from_dict(bad)
    with pytest.raises(ValueError):
        run_config_from_dict([1, 2])


def test_token_bucket_holds_senders_to_the_cap():
    async def send(total, chunk, mbps):
        bucket = TokenBucket(mbps)
        start = time.monotonic()
        for _ in range(total // chunk):
            await bucket.consume(chunk)
        return time.monotonic() - start

    # 1 MB at 8 Mbit/s = 1 MB/s: about 1 s minus the 0.25 s burst
    elapsed = asyncio.run(send(1_000_000, 10_000, 8.0))
    assert 0.6 < elapsed < 4.0  # generous above: a loaded CI machine oversleeps; the cap is the lower bound
    assert asyncio.run(send(1_000_000, 10_000, None)) < 0.1
    with pytest.raises(ValueError):
        TokenBucket(0)


@pytest.mark.parametrize("path,value", [
    (("lr",), float("nan")), (("objective", "kl_coef"), float("nan")), (("sampling", "temperature"), float("inf")),
    (("group_size",), True), (("group_size",), 1), (("seed",), "7"), (("update_encoding",), "zip"),
    (("task", "min_digits"), 2.0),
])
def test_run_config_refuses_non_finite_wrong_typed_and_out_of_range_values_at_every_level(path, value):
    bad = RunConfig().to_dict()
    target = bad
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=path[-1]):
        run_config_from_dict(bad)


def test_run_configs_built_in_code_are_checked_too():
    import dataclasses

    with pytest.raises(ValueError, match="max_versions"):
        dataclasses.replace(RunConfig(), max_versions=-1)
    with pytest.raises(ValueError, match="lr"):
        RunConfig(lr=float("nan"))
    assert dataclasses.replace(RunConfig(), seed=3).seed == 3
