"""A model of an overload level's refusals: how a 429's Retry-After decides how often refused clients knock and
whether they get a slot in time (llm_server/doors/http.py, refused_error).

A discrete-event simulation, not the stack: closed-loop clients (each asks again at once when its stream ends, and
after a refusal once the Retry-After passed), a worker with `slots` streams of a random life, and its admission queue
as llm_server/admission.py keeps it (at most as many waiting as the limit, the most retried first, refused after the
queue's wait). Its inputs are issue 43's CPU overload levels (benchmarks/concurrency.py --quick): 102 and 153
clients for 44 slots, streams of 25-65 s, a 3 s queue wait, the benchmark's client honouring a Retry-After up to
10 s (the openai SDK: up to 120 s, the worker says at most 60). At the queue's wait it gives the refusals the runs
measured (run 52: 9.5 a second at 2x, 23 at 3x).

    python benchmarks/retry_after_model.py [--out benchmarks/results/retry-after-model.json]

Per policy: the share of clients with audio within 100 s (10 s of audio time at the CPU's 0.1x), and refusals a
second, over 12 seeds.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
from dataclasses import dataclass

QUEUE_S = 3.0
FIRST_AUDIO_S = 2.5  # from admission to a stream's first audio, as the runs' p50
IN_TIME_S = 100.0
RELEASES_SEEN = 32  # llm_server/admission.py


@dataclass(frozen=True)
class Level:
    clients: int
    slots: int = 44
    life_s: tuple[float, float] = (25.0, 65.0)
    duration_s: float = 160.0
    honoured_s: float = 10.0  # the longest Retry-After a client waits out


def retry_after(policy: str, expected_s: float | None, rnd: random.Random) -> float:
    """A refusal's Retry-After under `policy` (the worker's bound: 60 s)."""
    if policy == "queue wait" or expected_s is None:
        return QUEUE_S
    expected_s = max(QUEUE_S, min(expected_s, 60.0))
    if policy == "expected wait":
        return expected_s
    if policy == "drawn between":  # what refused_error does
        return rnd.uniform(QUEUE_S, expected_s)
    raise ValueError(policy)


def simulate(policy: str, level: Level, seed: int) -> tuple[float, float]:
    """(share of clients with audio within IN_TIME_S, refusals a second)."""
    rnd = random.Random(seed)
    events: list = []
    order = itertools.count()

    def at(t: float, kind: str, client: int, life: float = 0.0) -> None:
        heapq.heappush(events, (t, next(order), kind, client, life))

    active, refusals = 0, 0
    queue: list[tuple[int, float, int]] = []  # (-retries, arrival, client)
    deadline: dict[int, float] = {}
    lives: list[float] = []
    retries = dict.fromkeys(range(level.clients), 0)
    first_audio: dict[int, float] = {}

    def admit(t: float, client: int) -> None:
        nonlocal active
        active += 1
        retries[client] = 0
        first_audio.setdefault(client, t + FIRST_AUDIO_S)
        life = rnd.uniform(*level.life_s)
        at(t + life, "end", client, life)

    def refuse(t: float, client: int) -> None:
        nonlocal refusals
        refusals += 1
        retries[client] += 1
        seen = lives[-RELEASES_SEEN:]
        expected = (len(queue) + 1) * statistics.mean(seen) / level.slots if seen else None
        at(t + min(retry_after(policy, expected, rnd), level.honoured_s), "ask", client)

    for client in range(level.clients):  # the level's clients start over 2 s
        at(client * 2.0 / level.clients, "ask", client)
    while events:
        t, _, kind, client, life = heapq.heappop(events)
        if t > level.duration_s:
            break
        if kind == "ask":
            if active < level.slots and not queue:
                admit(t, client)
            elif len(queue) < level.slots:
                queue.append((-retries[client], t, client))
                queue.sort()
                deadline[client] = t + QUEUE_S
                at(t + QUEUE_S, "deadline", client)
            else:
                refuse(t, client)
        elif kind == "deadline" and deadline.get(client) == t:
            queue[:] = [waiting for waiting in queue if waiting[2] != client]
            del deadline[client]
            refuse(t, client)
        elif kind == "end":
            active -= 1
            lives.append(life)
            while queue and active < level.slots:
                _, _, waiting = queue.pop(0)
                del deadline[waiting]
                admit(t, waiting)
            at(t, "ask", client)
    in_time = sum(1 for c in range(level.clients) if first_audio.get(c, IN_TIME_S + 1) <= IN_TIME_S)
    return in_time / level.clients, refusals / level.duration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--seeds", type=int, default=12)
    args = parser.parse_args()
    rows = []
    for name, level in (("2x", Level(102)), ("3x", Level(153)), ("2x, Retry-After honoured to 60 s", Level(102, honoured_s=60.0))):
        for policy in ("queue wait", "expected wait", "drawn between"):
            runs = [simulate(policy, level, seed) for seed in range(args.seeds)]
            row = {"level": name, "policy": policy,
                   "clients_in_time": round(statistics.mean(r[0] for r in runs), 3),
                   "clients_in_time_worst": round(min(r[0] for r in runs), 3),
                   "refusals_per_s": round(statistics.mean(r[1] for r in runs), 1)}
            rows.append(row)
            print(f"{name:34s} {policy:14s} clients in time {row['clients_in_time']:.2f} (worst {row['clients_in_time_worst']:.2f})"
                  f"  refusals/s {row['refusals_per_s']:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": "benchmarks/retry_after_model.py", "seeds": args.seeds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
