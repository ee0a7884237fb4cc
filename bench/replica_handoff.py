"""What a replica hand-off costs: ``strategy.run`` of a step with no
collective and of a step with one rendezvous of all replicas, on N CPU
replicas, with the caller running replicas cooperatively (greenlets; the
default where ``greenlet`` is installed) and with one thread per replica.

CPU time (``time.process_time``, all threads) is the steady figure on a
loaded machine; wall time shows the wake-ups. Minimum over rounds, the two
modes alternating in one process.

    python bench/replica_handoff.py --replicas 4
"""

import argparse
import time

import mirrored as md


def per_call(clock, fn, k):
    t = clock()
    for _ in range(k):
        fn()
    return (clock() - t) / k * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(a.replicas)])
    pool = s.extended._pool
    group = pool.group
    cooperative = pool._coop

    def one_rendezvous(i):
        return group.exchange(i, "rendezvous", i, lambda payloads: payloads)

    steps = {"no collective": lambda: pool.run(lambda i: None), "one rendezvous": lambda: pool.run(one_rendezvous)}
    modes = [("threads", None)] + ([("cooperative", cooperative)] if cooperative is not None else [])
    best = {}
    for _ in range(a.rounds):
        for mode, coop in modes:
            pool._coop = coop
            for step, fn in steps.items():
                for clock in (time.process_time, time.perf_counter):
                    fn()
                    t = per_call(clock, fn, a.iters)
                    key = (mode, step, clock.__name__)
                    best[key] = min(best.get(key, t), t)
    pool._coop = cooperative
    print(f"{'mode':<12} {'step':<15} {'CPU us':>8} {'wall us':>8}")
    for mode, _ in modes:
        for step in steps:
            print(f"{mode:<12} {step:<15} {best[(mode, step, 'process_time')]:>8.1f} "
                  f"{best[(mode, step, 'perf_counter')]:>8.1f}")


if __name__ == "__main__":
    main()
