"""The adaptive activation limiter (``substrate.admission``): its gradient rule and its FIFO of permits."""

from __future__ import annotations

import asyncio

import pytest

from substrate.admission import ActivationLimiter, GradientLimit, LimiterSettings, LimiterTimeout
from substrate.settings import Settings


def test_the_limit_grows_while_latency_holds_and_the_limit_is_used():
    g = GradientLimit(LimiterSettings(initial=8, min_limit=2, max_limit=64))
    for _ in range(50):
        g.sample(0.3, in_use=g.value)
    assert g.value > 16, g.value
    for _ in range(500):
        g.sample(0.3, in_use=g.value)
    assert g.value == 64, "bounded by max_limit"


def test_an_unused_limit_does_not_grow():
    g = GradientLimit(LimiterSettings(initial=8, min_limit=2, max_limit=64))
    for _ in range(200):
        g.sample(0.3, in_use=2)  # under half the limit in use: the limit is not what holds anything back
    assert g.value == 8


def test_the_limit_falls_when_latency_climbs_and_recovers_after():
    g = GradientLimit(LimiterSettings(initial=64, min_limit=4, max_limit=1000))
    for _ in range(100):
        g.sample(0.3, in_use=64)
    high = g.value
    for _ in range(40):  # the machine saturates: activations take 10x their usual time
        g.sample(3.0, in_use=g.value)
    low = g.value
    assert low <= 12 and low < high / 4, (high, low)
    assert low >= 4, "never below min_limit"
    for _ in range(300):  # back to normal: the long average forgets the overload and the limit grows again
        g.sample(0.3, in_use=g.value)
    assert g.value > 3 * low, (low, g.value)


def test_latency_within_the_tolerance_does_not_shrink_the_limit():
    g = GradientLimit(LimiterSettings(initial=32, min_limit=4, max_limit=32, tolerance=2.0))
    for i in range(200):
        g.sample(0.3 if i % 2 else 0.5, in_use=32)  # jitter well within 2x
    assert g.value == 32


def test_nonsense_samples_are_ignored():
    g = GradientLimit(LimiterSettings(initial=8))
    for bad in (float("nan"), float("inf"), -1.0):
        assert g.sample(bad, in_use=8) == 8
    assert g.long_s is None


@pytest.mark.parametrize("kwargs", [
    {"min_limit": 0}, {"initial": 2, "min_limit": 4}, {"initial": 64, "max_limit": 32},
    {"tolerance": 0.5}, {"tolerance": float("nan")}, {"smoothing": 0}, {"long_window": 0},
])
def test_bad_limiter_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LimiterSettings(**kwargs)


@pytest.mark.parametrize("env", [
    {"SUBSTRATE_API__ACTIVATION_LIMIT_MIN": "64"},  # above the initial 32
    {"SUBSTRATE_API__ACTIVATION_LIMIT_MAX": "8"},  # below the initial 32
    {"SUBSTRATE_API__ACTIVATION_LIMIT_INITIAL": "0"},
    {"SUBSTRATE_API__ACTIVATION_LATENCY_TOLERANCE": "0.9"},
])
def test_bad_activation_limit_variables_are_refused_with_their_names(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as e:
        Settings()
    assert "activation" in str(e.value).lower()


def test_max_zero_means_no_bound():
    s = Settings(api={"activation_limit_max": 0})
    assert s.api.activation_limit_max == 0
    lim = ActivationLimiter(LimiterSettings(initial=1, min_limit=1, max_limit=0))

    async def go():
        for _ in range(100):
            await lim.acquire(0)
        return lim.in_use

    assert asyncio.run(go()) == 100


def _fixed(n: int) -> ActivationLimiter:
    return ActivationLimiter(LimiterSettings(initial=n, min_limit=n, max_limit=n))


async def test_permits_beyond_the_limit_are_granted_first_in_first_out():
    lim = _fixed(2)
    await lim.acquire(1)
    await lim.acquire(1)
    order: list[int] = []

    async def one(i: int) -> None:
        await lim.acquire(5)
        order.append(i)

    tasks = [asyncio.create_task(one(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert lim.queued == 3 and order == []
    lim.release(0.1)
    await asyncio.sleep(0.01)
    assert order == [0]
    lim.release(0.1)
    lim.release(0.1)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and lim.in_use == 2 and lim.queued == 0


async def test_a_waiter_gives_up_after_its_timeout_and_leaves_the_queue():
    lim = _fixed(1)
    await lim.acquire(1)
    with pytest.raises(LimiterTimeout, match="no activation permit"):
        await lim.acquire(0.05)
    assert lim.queued == 0 and lim.in_use == 1
    lim.release()
    await lim.acquire(0)  # the permit is free again, not held by the one that left
    assert lim.in_use == 1


async def test_a_cancelled_waiter_that_was_just_granted_passes_its_permit_on():
    lim = _fixed(1)
    await lim.acquire(1)
    first = asyncio.create_task(lim.acquire(5))
    second = asyncio.create_task(lim.acquire(5))
    await asyncio.sleep(0.01)
    lim.release()  # grants ``first`` ...
    first.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert lim.in_use == 1 and lim.queued == 0
