"""serve_app.breaker: closed → open after N failures → half-open single probe → closed or open."""

from serve_app.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, Breakers


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_opens_after_consecutive_failures_only():
    b = Breakers(BreakerConfig(failures_to_open=3, open_s=5), clock=Clock())
    b.on_failure("w")
    b.on_failure("w")
    b.on_success("w")  # a success resets the count
    b.on_failure("w")
    b.on_failure("w")
    assert b.state("w") == CLOSED and "w" not in b.blocked()
    assert b.on_failure("w")
    assert b.state("w") == OPEN and b.blocked() == {"w"}


def test_half_open_lets_exactly_one_probe_through_and_its_outcome_decides():
    clock = Clock()
    b = Breakers(BreakerConfig(failures_to_open=1, open_s=5), clock=clock)
    b.on_failure("w")
    clock.t = 4.9
    assert b.state("w") == OPEN
    clock.t = 5.0
    assert b.state("w") == HALF_OPEN and "w" not in b.blocked()
    b.on_dispatch("w")
    assert "w" in b.blocked()  # a second request waits for the probe's outcome
    assert b.on_failure("w")
    assert b.state("w") == OPEN
    clock.t = 10.0
    b.on_dispatch("w")
    b.on_success("w")
    assert b.state("w") == CLOSED and not b.blocked()


def test_unknown_workers_are_closed():
    assert Breakers().state("nobody") == CLOSED
