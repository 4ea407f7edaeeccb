"""The straggler proof shared by the core and Lightning timeline tests: blame lands on the slowed steps."""

from __future__ import annotations


def assert_blamed_for_slow_steps_only(blamed: dict[int, int | None], steps: int, slow_every: int) -> None:
    """Rank 1 slept before the steps ``step % slow_every == 1``: it is blamed for all of them but 5% (one
    at least: a step where the shared cores held rank 0 up longer than rank 1's sleep is blamed on rank 0,
    seen once in 19 in a loaded ``make test``), and for clean steps no more often than rank 0 (which had
    nothing injected: this machine's jitter) plus 10%.

    Step 1 is left out: DDP rebuilds its buckets in its second step with a broadcast torch issues in
    C++, where rank 0 waits out rank 1's delay unseen by the timeline.
    """
    slow = [s for s in range(2, steps) if s % slow_every == 1]
    clean = [s for s in range(2, steps) if s % slow_every != 1]
    on_rank1 = sum(blamed.get(s) == 1 for s in slow)
    missed = len(slow) - on_rank1
    assert missed <= max(1, 0.05 * len(slow)), f"rank 1 blamed in {on_rank1} of its {len(slow)} slow steps: {blamed}"
    noise = sum(blamed.get(s) == 0 for s in clean)
    leaked = sum(blamed.get(s) == 1 for s in clean)
    assert leaked <= noise + 0.1 * len(clean), f"clean steps blamed on rank 1 beyond noise ({noise}): {blamed}"
