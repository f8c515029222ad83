"""Which concurrency level to measure next: double until a level fails, bisect, confirm the boundary.

A level passes only if every run of it passed. Once the largest passing level `lo` and the
smallest failing level `hi` are adjacent, both are measured once more: if `lo` fails on its
repeat, it becomes the new `hi` and the bisection goes on below it; if `hi` passes on its
repeat, it stays failed (one failed run is enough) and the boundary is marked flaky.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Search:
    """The search over N for one target; feed it verdicts with record()."""

    start: int = 1
    max_n: int = 1024
    confirm_runs: int = 1  # extra runs of each side of the boundary
    max_levels: int = 40  # level runs at most (the search stops, unconfirmed, past it)
    runs: dict[int, list[bool]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    lo: int = 0  # largest level with every run passed (0: none)
    hi: int | None = None  # smallest level with a failed run

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.max_n or self.confirm_runs < 0 or self.max_levels < 1:
            raise ValueError("need 1 <= start <= max_n, confirm_runs >= 0, max_levels >= 1")

    def next_level(self) -> int | None:
        """The next level to run, or None when the search is over."""
        if len(self.order) >= self.max_levels:
            return None
        if self.hi is None:  # doubling
            if self.lo >= self.max_n:
                return None
            return self.start if self.lo == 0 else min(2 * self.lo, self.max_n)
        if self.hi - self.lo > 1:
            return (self.lo + self.hi) // 2
        for n in (self.lo, self.hi):
            if n >= 1 and len(self.runs.get(n, [])) < 1 + self.confirm_runs:
                return n
        return None

    def record(self, n: int, passed: bool) -> None:
        """The verdict of one run of level n."""
        self.runs.setdefault(n, []).append(passed)
        self.order.append(n)
        if passed:
            if all(self.runs[n]) and (self.hi is None or n < self.hi):
                self.lo = max(self.lo, n)
            return
        self.hi = n if self.hi is None else min(self.hi, n)
        if self.lo >= self.hi:  # a level that had passed failed on its repeat
            self.lo = max((m for m, r in self.runs.items() if m < self.hi and all(r)), default=0)

    @property
    def done(self) -> bool:
        return self.next_level() is None

    @property
    def n_max(self) -> int:
        """The most concurrent streams that passed every run (0: not even one)."""
        return self.lo

    @property
    def confirmed(self) -> bool:
        """Both sides of the boundary were repeated and held (or the top level passed every run)."""
        if self.hi is None:
            return self.lo >= self.max_n and len(self.runs.get(self.lo, [])) >= 1
        sides = [n for n in (self.lo, self.hi) if n >= 1]
        return all(len(self.runs.get(n, [])) >= 1 + self.confirm_runs for n in sides) and not self.flaky

    @property
    def flaky(self) -> list[int]:
        """Levels whose runs disagreed."""
        return sorted(n for n, r in self.runs.items() if any(r) and not all(r))

    @property
    def censored(self) -> bool:
        """The top level passed: N_max is at least max_n, not measured."""
        return self.hi is None and self.lo >= self.max_n

    def summary(self) -> dict:
        return {"n_max": self.n_max, "confirmed": self.confirmed, "flaky_levels": self.flaky,
                "censored_at_max_n": self.censored, "levels_run": list(self.order),
                "runs": {str(n): r for n, r in sorted(self.runs.items())},
                "stopped_by_level_budget": len(self.order) >= self.max_levels and self.hi is not None
                and self.hi - self.lo > 1}
