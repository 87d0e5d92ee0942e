"""The demo's wait for the final held-out eval follows how long this run's evals took."""

from engine.swarm.demo import FINAL_EVAL_MIN_S, EvalClock


def test_the_final_eval_gets_twice_the_longest_eval_seen_and_never_less_than_the_minimum():
    clock = EvalClock()
    assert clock.final_allowance_s() == FINAL_EVAL_MIN_S
    for t, running in ((0, False), (10, True), (11, True), (140, False), (500, True), (672, False), (700, False)):
        clock.see(running, float(t))
    assert clock.longest_s == 172.0  # a multi-turn eval of a real model: minutes
    assert clock.final_allowance_s() == 344.0
    quick = EvalClock()
    quick.see(True, 0.0)
    quick.see(False, 1.5)  # the tiny base's eval: a second or two
    assert quick.final_allowance_s() == FINAL_EVAL_MIN_S
