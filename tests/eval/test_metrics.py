"""Statistics of the evaluation (kvcomm.eval.metrics): Wilson and bootstrap intervals."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.eval.metrics import bootstrap_ratio_interval, wilson_interval


def test_wilson_interval_matches_the_closed_form_and_pins_the_ends():
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_two_units_give_the_resample_distribution_of_a_ratio_of_sums():
    # resampled pairs give ratios 0 (1/4), 0.5 (1/2) and 1 (1/4): the 2.5% and 97.5% points are 0 and 1
    assert bootstrap_ratio_interval([0.0, 1.0], [1.0, 1.0]) == (0.0, 1.0)
    # 40 equal-weight units, half 0 and half 1: the resampled ratio is Binomial(40, 1/2) / 40,
    # whose 2.5% and 97.5% quantiles are 14/40 and 26/40
    assert bootstrap_ratio_interval([0.0, 1.0] * 20, [1.0, 1.0] * 20, draws=4000) == pytest.approx((0.35, 0.65))
    # unequal weights: a ratio of sums, not a mean of ratios (unit ratios 0 and 1, weights 3 and 1)
    low, high = bootstrap_ratio_interval([0.0, 1.0] * 20, [3.0, 1.0] * 20, draws=4000)
    assert low < 0.25 < high and high < 0.45


def test_units_of_one_ratio_leave_no_spread_and_more_units_narrow_the_interval():
    assert bootstrap_ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx((2.0, 2.0))
    few = bootstrap_ratio_interval([0.1, 0.0, 0.5, 0.2], [10, 12, 9, 11])
    many = bootstrap_ratio_interval([0.1, 0.0, 0.5, 0.2] * 16, [10, 12, 9, 11] * 16)
    assert many[1] - many[0] < (few[1] - few[0]) / 2


def test_same_seed_same_interval_and_bad_input_is_refused():
    data = ([0.3, 0.0, 1.2, 0.1, 0.05], [5, 7, 3, 9, 4])
    assert bootstrap_ratio_interval(*data, seed=3) == bootstrap_ratio_interval(*data, seed=3)
    assert all(math.isnan(x) for x in bootstrap_ratio_interval([], []))
    assert all(math.isnan(x) for x in bootstrap_ratio_interval([0.0], [0.0]))
    with pytest.raises(ValueError, match="equal-length"):
        bootstrap_ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ratio_interval([1.0], [1.0], level=1.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0.5, 50)), min_size=1, max_size=30))
def test_interval_lies_between_the_smallest_and_largest_unit_ratio(units):
    # every resampled ratio of sums is a weighted mean of unit ratios
    low, high = bootstrap_ratio_interval([n for n, _ in units], [d for _, d in units], draws=200)
    ratios = [n / d for n, d in units]
    assert min(ratios) - 1e-12 <= low <= high <= max(ratios) + 1e-12
