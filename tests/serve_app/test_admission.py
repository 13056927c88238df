"""serve_app.admission: big streamed prompts wait in the router while every worker is prefilling."""

from __future__ import annotations

import asyncio

import pytest

from bench import routesim
from serve_app.admission import Admission, AdmissionConfig
from tests.serve_app.test_router_core import chat, make_core

BIG = "A long document to summarise, sentence after sentence. " * 400  # ~22k chars: hundreds of blocks


def test_a_target_is_busy_from_max_prefilling_and_the_fleet_saturated_when_all_routable_ones_are():
    a = Admission(AdmissionConfig(max_prefilling=2))
    fleet = [("w0", True), ("w1", True), ("w2", False)]  # w2 down: not a place to go
    assert not a.saturated(fleet)
    for t in ("w0", "w0", "w1"):
        a.dispatched(t)
    assert not a.saturated(fleet)  # w1 has one, below 2
    a.dispatched("w1")
    assert a.saturated(fleet)
    a.prefilled("w0")
    assert not a.saturated(fleet)
    assert not a.saturated([("w2", False)])  # nothing routable: nothing to wait for
    assert not Admission(AdmissionConfig(enabled=False)).saturated(fleet)


def test_held_requests_go_in_arrival_order_one_per_target_that_frees_up():
    async def main() -> list[str]:
        a = Admission(AdmissionConfig(max_wait_s=5.0))
        a.dispatched("w0")
        a.dispatched("w1")
        order: list[str] = []

        async def held(name: str) -> None:
            await a.hold()
            order.append(name)

        tasks = [asyncio.create_task(held(n)) for n in ("first", "second", "third")]
        await asyncio.sleep(0.01)
        assert a.waiting == 3 and order == []
        assert a.saturated([("w0", True), ("w1", True), ("w9", True)])  # others wait: a newcomer queues too
        a.dispatched("w0")  # w0 now has two: still busy
        a.prefilled("w0")
        await asyncio.sleep(0.01)
        assert order == []  # 2 → 1 is not a target freeing up (max_prefilling 1)
        a.prefilled("w0")
        await asyncio.sleep(0.01)
        assert order == ["first"]
        a.prefilled("w1")
        await asyncio.sleep(0.01)
        assert order == ["first", "second"]
        a.release(5)  # e.g. new workers joined
        await asyncio.gather(*tasks)
        assert a.waiting == 0 and a.held == 3 and a.timed_out == 0
        return order

    assert asyncio.run(main()) == ["first", "second", "third"]


def test_a_held_request_goes_after_max_wait_s_and_a_cancelled_one_leaves_the_queue():
    async def main() -> None:
        a = Admission(AdmissionConfig(max_wait_s=0.05))
        a.dispatched("w0")
        held = await a.hold()
        assert held >= 0.05 and a.timed_out == 1 and a.waiting == 0
        t = asyncio.create_task(a.hold())
        await asyncio.sleep(0.01)
        assert a.waiting == 1
        t.cancel()  # the client went away while held
        with pytest.raises(asyncio.CancelledError):
            await t
        assert a.waiting == 0
        u = asyncio.create_task(a.hold())
        await asyncio.sleep(0.01)
        a.prefilled("w0")  # the wake-up goes to the one still waiting, not the cancelled one
        assert await asyncio.wait_for(u, 1.0) < 0.05

    asyncio.run(main())


def test_max_held_bounds_the_queue():
    a = Admission(AdmissionConfig(max_held=0))
    a.dispatched("w0")
    assert not a.saturated([("w0", True)])


def test_config_values_are_checked():
    for bad in ({"max_prefilling": 0}, {"min_uncached_blocks": -1}, {"max_wait_s": 0}, {"max_held": -1}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)


def test_the_router_holds_a_big_cold_prompt_but_not_a_cached_one_and_counts_streams_until_their_first_token():
    core, clock = make_core(2)
    big, small = core.facts(chat(BIG, "first")), core.facts(chat("be brief", "hi"))
    assert not core.should_hold(big)  # nobody is prefilling
    tickets = []
    for doc in (BIG, "Quite another document, with other words in it. " * 400):
        clock.t += 0.001
        tickets.append(core.route(core.facts(chat(doc, "one")), streamed=True))
    assert {t.worker for t in tickets} == {"w0", "w1"}
    assert core.admission.prefilling == {"w0": 1, "w1": 1}
    assert core.should_hold(core.facts(chat("Another long text entirely. " * 800, "?")))  # cold and big
    assert not core.should_hold(small)  # small: routed at once
    # the first prompt's document is cached where it went: a follow-up on it is not held
    assert not core.should_hold(core.facts(chat(BIG, "one, and then")))
    assert not core.should_hold(big, exclude={tickets[0].worker})  # one worker excluded (breaker): the other is busy
    tickets[0].first_token()
    assert core.admission.prefilling == {tickets[1].worker: 1}
    assert not core.should_hold(core.facts(chat("Another long text entirely. " * 800, "?")))
    tickets[0].finished()
    tickets[1].failed()  # ended before a first token: no longer prefilling either
    assert core.admission.prefilling == {}
    plain = core.route(core.facts(chat(BIG, "x")))  # not streamed: never counted
    assert core.admission.prefilling == {} and plain.worker


def test_a_woken_request_routed_elsewhere_wakes_the_next_while_a_worker_is_free():
    """A held request is woken when a worker frees up, but the policy may send it to another one;
    the next held request must not then wait for another first token beside the free worker."""
    async def main() -> None:
        core, clock = make_core(3, admission={"max_prefilling": 2})
        tickets = [core.route(core.facts(chat(f"Document number {i}. " * 400, "q")), streamed=True)
                   for i in range(6)]
        assert sorted(core.admission.prefilling.values()) == [2, 2, 2]
        cold = [core.facts(chat(f"A different long text {i}. " * 800, "?")) for i in range(2)]
        assert core.should_hold(cold[0])
        first, second = (asyncio.create_task(core.admission.hold()) for _ in range(2))
        await asyncio.sleep(0.01)
        freed = tickets[0].worker
        tickets[0].first_token()  # `freed` goes 2 → 1: one waiter wakes
        await asyncio.sleep(0.01)
        assert first.done() and not second.done()
        elsewhere = {t.worker for t in tickets} - {freed}
        # the policy sends the woken one to another worker (there: 3 prefilling); `freed` stays at 1
        core.route(cold[0], streamed=True, exclude={freed})
        assert core.admission.prefilling[freed] == 1 and elsewhere
        await asyncio.wait_for(second, 1.0)  # woken at once, not after max_wait_s
        assert core.admission.timed_out == 0

    asyncio.run(main())


def test_a_worker_that_leaves_is_forgotten_and_a_new_one_releases_a_held_request():
    async def main() -> None:
        core, clock = make_core(1)
        t = core.route(core.facts(chat(BIG, "q")), streamed=True)
        assert core.should_hold(core.facts(chat("Something else at length. " * 800, "?")))
        held = asyncio.create_task(core.admission.hold())
        await asyncio.sleep(0.01)
        assert core.healthz()["admission"] == {"waiting": 1, "held": 1, "timed_out": 0}
        from tests.serve_app.test_router_core import report

        report(core, clock, "w1")  # a new worker: the held request may go there
        assert await asyncio.wait_for(held, 1.0) < 1.0
        del core.follower.workers[t.worker]
        core.on_fleet_update([t.worker])
        assert core.admission.prefilling == {}

    asyncio.run(main())


def test_routesim_shows_late_binding_lowers_the_mooncake_ttft():
    """The same Admission in virtual time (routesim drives RouterCore): on 20 s of the Mooncake
    replay at the standard suite's scale, holding big prompts lowers the TTFT median (60-s windows over
    3 seeds: p50 −28 %, p99 −9 %; bench/results/routesim-mooncake.md)."""
    from bench.run import SUITES

    spec, engine = SUITES["standard"]["workloads"]["mooncake"], SUITES["standard"]["engine"]
    on, off = (routesim.run("mooncake", 20, 20, "kv_aware", seed=1, warmup_s=5, params=spec["params"], engine=engine,
                            router={"admission": {"enabled": e}}).summary() for e in (True, False))
    assert on["ttft_p50_ms"] < off["ttft_p50_ms"] * 0.9, (on, off)
