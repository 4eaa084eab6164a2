"""Transfer Dock: put+get throughput with 4 producer and 4 consumer threads, and get(256) latency vs capacity.

Run: python benchmarks/bench_dock.py [--no-ray]
Prints, for the embedded dock, the Ray-backed dock and a baseline dock that scans rows
in Python under one global lock (the straightforward way to write one): throughput in
rows/s, and the median latency of one ``get(256)`` at capacity 1,024 and 65,536 with
their ratio (target: within 2x, i.e. the cost does not grow with capacity).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

from rlcore.dataflow import RayTransferDock, TransferDock

N_SAMPLES = 8
ROW_TOKENS = 64
LATENCY_REPEATS = 21


class ScanDock:
    """Baseline: per-row Python flags under one global lock; a get scans every row, then samples at random."""

    def __init__(self, num_prompts: int, n_samples: int, *, consumers=(), **_: object) -> None:
        self.capacity = num_prompts * n_samples
        self.n = n_samples
        self.lock = threading.Lock()
        self.data: dict[str, list] = {}
        self.taken = {c: [False] * self.capacity for c in consumers}
        self.rng = random.Random(0)

    def add_consumer(self, name: str) -> None:
        self.taken[name] = [False] * self.capacity

    def put(self, columns, indexes) -> None:
        with self.lock:
            for column, rows in columns.items():
                store = self.data.setdefault(column, [None] * self.capacity)
                for i, row in zip(indexes, rows):
                    store[i] = row

    def get(self, consumer, columns, count, **_: object):
        with self.lock:
            taken = self.taken[consumer]
            stores = [self.data.get(c) for c in columns]
            if any(store is None for store in stores):
                return {}, torch.empty(0, dtype=torch.int64)
            groups = [
                g
                for g in range(self.capacity // self.n)
                if all(
                    not taken[r] and all(store[r] is not None for store in stores)
                    for r in range(g * self.n, (g + 1) * self.n)
                )
            ]
            if len(groups) * self.n < count:
                return {}, torch.empty(0, dtype=torch.int64)
            picked = [r for g in self.rng.sample(groups, count // self.n) for r in range(g * self.n, (g + 1) * self.n)]
            for r in picked:
                taken[r] = True
        rows = {c: [self.data[c][r] for r in picked] for c in columns}
        batch = {c: torch.nn.utils.rnn.pad_sequence(v, batch_first=True) for c, v in rows.items()}
        return batch, torch.tensor(picked)


def _rows(start: int, count: int) -> list[torch.Tensor]:
    return [torch.full((ROW_TOKENS - (i % 16),), i, dtype=torch.int64) for i in range(start, start + count)]


def throughput(make, capacity: int, *, producers: int = 4, consumers: int = 4, chunk: int = 64) -> float:
    """Rows per second through put and get, with producer and consumer threads racing."""
    dock = make(capacity // N_SAMPLES, N_SAMPLES, columns=["responses"], consumers=["train"])
    chunks = [list(range(s, s + chunk)) for s in range(0, capacity, chunk)]
    payloads = [_rows(c[0], len(c)) for c in chunks]
    got = [0] * consumers

    def produce(k: int) -> None:
        for rows, payload in zip(chunks[k::producers], payloads[k::producers]):
            dock.put({"responses": payload}, rows)

    def consume(k: int) -> None:
        while sum(got) < capacity:
            _, idx = dock.get("train", ["responses"], chunk, timeout=0.05)
            got[k] += idx.numel()

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    threads += [threading.Thread(target=consume, args=(k,)) for k in range(consumers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert sum(got) == capacity
    return capacity / elapsed


def get_latencies(make, capacities: tuple[int, ...], count: int = 256) -> list[float]:
    """Median seconds of one get(count) on a full table of each capacity.

    Each repeat uses a fresh consumer, so every get sees the whole table; the
    capacities are measured in turn within each repeat, so machine load drifts
    affect them alike.
    """
    names = [f"c{k}" for k in range(LATENCY_REPEATS + 1)]
    docks = []
    for capacity in capacities:
        dock = make(capacity // N_SAMPLES, N_SAMPLES, columns=["responses"], consumers=names)
        for start in range(0, capacity, 4096):
            n = min(4096, capacity - start)
            dock.put({"responses": _rows(start, n)}, list(range(start, start + n)))
        docks.append(dock)
    times: list[list[float]] = [[] for _ in capacities]
    for name in names:
        for dock, out in zip(docks, times):
            t = time.perf_counter()
            _, idx = dock.get(name, ["responses"], count)
            out.append(time.perf_counter() - t)
            assert idx.numel() == count
    return [statistics.median(out[1:]) for out in times]  # the first get warms up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    backends = {"embedded": TransferDock, "scan baseline": ScanDock}
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        hosts = RayTransferDock.start_hosts(2)

        def make_ray(*a, **kw):
            return RayTransferDock(*a, hosts=hosts, **kw)

        backends["ray"] = make_ray
    print(
        f"{'backend':<14} {'put+get rows/s (4P/4C)':>24} {'get(256) @1,024':>17} {'get(256) @65,536':>18} {'ratio':>7}"
    )
    for name, make in backends.items():
        rate = statistics.median(throughput(make, 8192) for _ in range(3))
        small, large = get_latencies(make, (1024, 65536))
        target = "met" if large / small <= 2 else "NOT met"
        print(
            f"{name:<14} {rate:>24,.0f} {small * 1e3:>14.3f} ms {large * 1e3:>15.3f} ms {large / small:>6.2f}x"
            f"  (target <= 2x: {target})",
            flush=True,
        )


if __name__ == "__main__":
    main()
