"""Bootstrap intervals and paired differences (rlhf.evaluation.statistics) on samples small
enough to work out by hand."""

from __future__ import annotations

import pytest

from rlhf.evaluation.statistics import bootstrap_interval, paired_difference

# 6 of 10 right: mean 0.6, binomial standard error sqrt(0.6 * 0.4 / 10) = 0.155.
SIX_OF_TEN = [1.0] * 6 + [0.0] * 4


def width(interval: tuple[float, float]) -> float:
    return interval[1] - interval[0]


# ----------------------------------------------------------------------------- bootstrap_interval


def test_constant_values_give_a_zero_width_interval_at_that_value():
    """Every resample of [0.3] * 7 has mean 0.3, so every percentile is 0.3."""
    low, high = bootstrap_interval([0.3] * 7)
    assert low == pytest.approx(0.3) and high == pytest.approx(0.3)


def test_two_values_by_hand():
    """[0, 1]: a resample of two is (0, 0), (0, 1), (1, 0) or (1, 1), so its mean is 0, 0.5
    or 1 with probabilities 1/4, 1/2, 1/4. The 95% interval (2.5th and 97.5th percentiles)
    therefore runs from 0 to 1; the 40% interval (30th and 70th percentiles) lies inside
    the half of the resamples whose mean is 0.5, so it is [0.5, 0.5]."""
    assert bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)
    assert bootstrap_interval([0.0, 1.0], confidence=0.4) == (0.5, 0.5)


def test_the_interval_contains_the_mean():
    """6 of 10 right: the 95% interval contains 0.6 (and is about 0.6 +- 1.96 * 0.155,
    inside [0, 1]); so does the interval of 13 skewed values x**2, x = 0, 1/12, ..., 1."""
    low, high = bootstrap_interval(SIX_OF_TEN)
    assert 0.0 <= low < 0.6 < high <= 1.0
    skewed = [(i / 12) ** 2 for i in range(13)]
    mean = sum(skewed) / len(skewed)
    low, high = bootstrap_interval(skewed)
    assert low < mean < high


def test_a_larger_sample_narrows_the_interval():
    """The standard error of a mean falls as 1/sqrt(n): the same 6-of-10 proportion on 40
    problems (4x) gives about half the width of 10 problems (1.96 * 2 * 0.155 = 0.61 ->
    0.30), and on 160 problems half again (-> 0.15). Checked as: each at most 0.6 times
    the width of the smaller sample."""
    widths = [width(bootstrap_interval(SIX_OF_TEN * copies)) for copies in (1, 4, 16)]
    assert widths[0] > 0
    assert widths[1] < 0.6 * widths[0]
    assert widths[2] < 0.6 * widths[1]


def test_a_lower_confidence_gives_a_narrower_interval():
    """The 80% interval lies inside the 95% interval of the same resamples (same seed)."""
    wide = bootstrap_interval(SIX_OF_TEN * 4, confidence=0.95)
    narrow = bootstrap_interval(SIX_OF_TEN * 4, confidence=0.80)
    assert wide[0] <= narrow[0] <= narrow[1] <= wide[1]
    assert width(narrow) < width(wide)


def test_the_same_seed_gives_the_same_interval():
    """The resamples are drawn from numpy's generator seeded with `seed`: the same seed
    reproduces the interval exactly; another seed draws other resamples, which for 13
    distinct values moves the interval."""
    skewed = [(i / 12) ** 2 for i in range(13)]
    assert bootstrap_interval(skewed, seed=3) == bootstrap_interval(skewed, seed=3)
    assert bootstrap_interval(skewed, seed=0) != bootstrap_interval(skewed, seed=1)


def test_no_values_raise():
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([])


# ----------------------------------------------------------------------------- paired_difference


def test_identical_outcomes_give_zero_difference_and_a_zero_interval():
    """Candidate == baseline on every problem: every difference is 0, so the mean
    difference is 0, the interval is [0, 0], and no resample is better (p_not_better 1)."""
    outcomes = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    diff = paired_difference(outcomes, list(outcomes))
    assert diff == {"difference": 0.0, "low": 0.0, "high": 0.0, "p_not_better": 1.0, "problems": 7}


def test_constant_differences_give_a_zero_width_interval_at_that_value():
    """The candidate is right on every problem, the baseline on none: every difference is 1,
    so the difference and both ends of the interval are 1 and p_not_better is 0. A constant
    reward margin of 0.7 - 0.5 = 0.2 gives 0.2 likewise."""
    diff = paired_difference([1.0] * 20, [0.0] * 20)
    assert (diff["difference"], diff["low"], diff["high"], diff["p_not_better"]) == (1.0, 1.0, 1.0, 0.0)
    margin = paired_difference([0.7] * 5, [0.5] * 5)
    assert margin["difference"] == pytest.approx(0.2)
    assert margin["low"] == pytest.approx(0.2) and margin["high"] == pytest.approx(0.2)


def test_winning_every_problem_gives_p_not_better_zero_and_a_positive_lower_bound():
    """Rewards where the candidate beats the baseline on all 5 problems, by 0.7, 0.1, 0.6,
    0.05 and 0.3 (mean 0.35): every resample averages positive differences, so no resample
    is <= 0 (p_not_better 0) and the lower bound is at least the smallest margin, 0.05; the
    upper bound is at most the largest, 0.7."""
    candidate = [0.9, 0.4, 0.7, 0.3, 0.8]
    baseline = [0.2, 0.3, 0.1, 0.25, 0.5]
    diff = paired_difference(candidate, baseline)
    assert diff["difference"] == pytest.approx(0.35)
    assert diff["p_not_better"] == 0.0
    assert 0.05 - 1e-9 <= diff["low"] < 0.35 < diff["high"] <= 0.7 + 1e-9
    assert diff["problems"] == 5


def test_p_not_better_by_hand():
    """Differences [1, 0]: a resample's mean is <= 0 only when it draws the 0 twice, with
    probability 1/4, so p_not_better is about 0.25 (2000 resamples: standard error 0.01).
    The mean difference is 0.5 and, as for [0, 1] above, the 95% interval is [0, 1]."""
    diff = paired_difference([1.0, 0.0], [0.0, 0.0])
    assert diff["difference"] == 0.5
    assert (diff["low"], diff["high"]) == (0.0, 1.0)
    assert diff["p_not_better"] == pytest.approx(0.25, abs=0.03)


def test_ten_more_right_out_of_a_hundred():
    """Candidate right on 60 of 100 problems, the baseline on 50, the candidate right
    wherever the baseline is: differences are 10 ones and 90 zeros, mean 0.10, standard
    error sqrt(0.1 * 0.9 / 100) = 0.03, so the 95% interval is about 0.10 +- 0.06: the
    lower bound is above 0.04, the upper bound below 0.20, and no resample (the chance of
    drawing none of the 10 is 0.9**100 < 1e-4) is <= 0."""
    diff = paired_difference([1.0] * 60 + [0.0] * 40, [1.0] * 50 + [0.0] * 50)
    assert diff["difference"] == pytest.approx(0.10)
    assert 0.04 < diff["low"] < 0.10 < diff["high"] < 0.20
    assert diff["p_not_better"] == 0.0
    assert diff["problems"] == 100


def test_the_paired_interval_is_narrower_than_the_unpaired_one():
    """Pairing removes what the problems share: the 10-of-100 gain above has a paired
    interval about 0.12 wide, while the interval of either accuracy alone (0.6 or 0.5 on
    100 problems, standard error about 0.05) is about 0.2 wide."""
    candidate, baseline = [1.0] * 60 + [0.0] * 40, [1.0] * 50 + [0.0] * 50
    diff = paired_difference(candidate, baseline)
    paired_width = diff["high"] - diff["low"]
    assert paired_width < 0.7 * width(bootstrap_interval(candidate))
    assert paired_width < 0.7 * width(bootstrap_interval(baseline))


def test_swapping_the_sides_negates_the_difference_and_mirrors_the_interval():
    """With the same seed the same problems are resampled, so paired_difference(b, a) has
    difference -d and interval [-high, -low] of paired_difference(a, b)."""
    a = [1.0] * 25 + [0.0] * 25 + [1.0] * 26 + [0.0] * 24
    b = [1.0] * 50 + [0.0] * 50
    forward, backward = paired_difference(a, b), paired_difference(b, a)
    assert backward["difference"] == pytest.approx(-forward["difference"])
    assert backward["low"] == pytest.approx(-forward["high"])
    assert backward["high"] == pytest.approx(-forward["low"])


def test_the_same_seed_gives_the_same_paired_interval():
    a = [1.0] * 25 + [0.0] * 25 + [1.0] * 26 + [0.0] * 24
    b = [1.0] * 50 + [0.0] * 50
    assert paired_difference(a, b, seed=7) == paired_difference(a, b, seed=7)


@pytest.mark.parametrize(("candidate", "baseline"), [([1.0, 0.0, 1.0], [1.0, 0.0]), ([], [])])
def test_mismatched_or_empty_outcomes_raise(candidate, baseline):
    """Pairs need one outcome per problem on both sides: 3 vs 2 outcomes, or none, raise."""
    with pytest.raises(ValueError, match="same non-zero length"):
        paired_difference(candidate, baseline)
