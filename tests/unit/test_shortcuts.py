"""The shortcut monitor: the commonest answer's share against the commonest gold answer's share."""

import pytest

from engine.rl.shortcuts import divergence, normalise, shortcut_report

GOLDS = [str(k % 10) for k in range(40)]  # ten answers, 4 each


def test_an_honest_policy_is_not_flagged():
    r = shortcut_report(zip(GOLDS, GOLDS))
    assert r.commonest_share == r.gold_share == pytest.approx(0.1)
    assert r.excess == pytest.approx(0.0) and not r.suspicious


def test_a_constant_answer_is_flagged_with_what_it_earns():
    r = shortcut_report((g, "3") for g in GOLDS)
    assert (r.commonest_answer, r.commonest_share, r.gold_share) == ("3", 1.0, pytest.approx(0.1))
    assert r.commonest_correct == pytest.approx(0.1) and r.excess == pytest.approx(0.9) and r.suspicious


def test_a_half_constant_policy_is_flagged_and_a_mild_bias_is_not():
    half = [(g, "3" if k % 2 else g) for k, g in enumerate(GOLDS)]
    assert shortcut_report(half).suspicious
    mild = [(g, "3" if k % 10 == 0 else g) for k, g in enumerate(GOLDS)]
    assert not shortcut_report(mild).suspicious


def test_skewed_golds_justify_a_common_answer():
    golds = ["1"] * 30 + ["2"] * 10
    r = shortcut_report((g, "1") for g in golds)
    assert r.gold_share == 0.75 and r.excess == pytest.approx(0.25)
    assert r.suspicious  # at the default margin of 0.2
    assert not shortcut_report(((g, "1") for g in golds), margin=0.3).suspicious


def test_answers_compare_by_value_and_missing_answers_do_not_count():
    assert normalise(" 07 ") == normalise("7.0") == normalise("+7") == "7"
    assert normalise("1,000") == "1000" and normalise("-0") == "0" and normalise("Olleh") == "olleh"
    r = shortcut_report([("7", "07"), ("7", "7.0"), ("8", None), ("9", "  ")])
    assert (r.answered, r.commonest_answer, r.commonest_share) == (2, "7", 0.5)


def test_small_or_empty_batches_are_never_flagged():
    assert not shortcut_report((g, "3") for g in GOLDS[:15]).suspicious
    assert shortcut_report((g, "3") for g in GOLDS[:16]).suspicious
    empty = shortcut_report([])
    assert (empty.samples, empty.suspicious, empty.commonest_answer) == (0, False, None)
    assert shortcut_report([("1", None)] * 20).to_dict()["answered"] == 0
    with pytest.raises(ValueError):
        shortcut_report([], margin=2.0)


def test_divergence_flags_a_trained_figure_rising_while_the_honest_one_falls():
    # DESIGN §9's run: strict 7 % -> 11 % while content fell 61 % -> 11 %
    r = divergence([0.07, 0.08, 0.10, 0.11], [0.61, 0.50, 0.20, 0.11])
    assert r.diverging
    assert r.trained_change == pytest.approx(0.03) and r.honest_change == pytest.approx(-0.40)
    assert not divergence([0.1, 0.2, 0.4, 0.6], [0.2, 0.3, 0.4, 0.5]).diverging  # both rise: learning
    assert not divergence([0.5, 0.5, 0.5, 0.5], [0.6, 0.5, 0.3, 0.2]).diverging  # falling, not gamed
    assert not divergence([0.1, 0.9], [0.9, 0.1], window=2).diverging  # too few evals to tell
    with pytest.raises(ValueError):
        divergence([0.1], [0.1, 0.2])
