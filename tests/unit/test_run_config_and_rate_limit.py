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
