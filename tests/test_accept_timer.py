"""The agent's wait for a call's first answer before sending it again."""

from __future__ import annotations

from shared.accept_timer import AcceptTimer


def test_before_any_answer_it_waits_the_floor_and_doubles_per_resend() -> None:
    t = AcceptTimer(floor_s=1.0, ceiling_s=15.0)
    assert [t.wait_s(n) for n in range(5)] == [1.0, 2.0, 4.0, 8.0, 15.0]


def test_fast_answers_keep_the_floor() -> None:
    t = AcceptTimer(floor_s=1.0, ceiling_s=15.0)
    for _ in range(50):
        t.observe(0.02)
    assert t.wait_s() == 1.0


def test_slow_answers_lengthen_the_wait_past_them() -> None:
    # overload: every answer takes about 3 s; resending at 1 s would send every call twice
    t = AcceptTimer(floor_s=1.0, ceiling_s=30.0)
    for i in range(40):
        t.observe(3.0 + 0.5 * (i % 2))
    assert 3.5 < t.wait_s() < 8.0


def test_a_latency_jump_is_followed_within_a_few_answers() -> None:
    t = AcceptTimer(floor_s=1.0, ceiling_s=30.0)
    for _ in range(20):
        t.observe(0.05)
    for _ in range(4):
        t.observe(2.0)
    assert t.wait_s() > 2.0  # the deviation term covers the jump before the mean does
