"""workers/budget.py: at most ``limit`` restarts within any ``window_s`` seconds, on a clock the
test steps."""

from __future__ import annotations

from workers.budget import RestartBudget


def test_deaths_spread_wider_than_the_window_are_never_refused() -> None:
    budget = RestartBudget(limit=2, window_s=10.0)
    assert all(budget.spend(t * 5.0) for t in range(1000))  # two per window, forever


def test_a_crash_loop_is_refused_and_nothing_is_taken() -> None:
    budget = RestartBudget(limit=2, window_s=10.0)
    assert budget.spend(100.0) and budget.spend(101.0)
    assert not budget.spend(102.0)  # a third within 10 s
    assert budget.used(102.0) == 2  # the refusal took nothing


def test_the_window_slides_restarts_leave_it_one_by_one() -> None:
    budget = RestartBudget(limit=2, window_s=10.0)
    assert budget.spend(100.0) and budget.spend(105.0)
    assert not budget.spend(109.9)
    assert budget.spend(110.0)  # 100 left the window (it is (now - 10, now])
    assert not budget.spend(114.9)  # 105 and 110 are still in it
    assert budget.used(120.0) == 0
