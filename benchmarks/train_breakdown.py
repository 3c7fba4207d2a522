"""Where a training step of the demo model goes: the step alone on prebuilt batches, and reading +
building one batch from Parquet, in process (medians). Uses the data ``dynarec bench train-step``
writes (run it once first with the same ``--batch``). Usage:

    python benchmarks/train_breakdown.py --batch 512
"""

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from dynarec.bench.train import _config
from dynarec.train.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    warnings.simplefilter("ignore")  # the dynamic table's fill warnings
    tmp = Path(tempfile.gettempdir()) / f"dynarec-bench-train-{a.batch}-1"
    if not (tmp / "data" / "meta.json").exists():
        raise SystemExit(f"no data in {tmp}: run `dynarec bench train-step --batch {a.batch}` first")
    config = _config(tmp / "data", a.batch, 0, 1, 20_000, 5_000)
    trainer = Trainer(config, tmp / "model-breakdown", device=a.device, progress=False)
    source = trainer._train_batches()
    prebuilt = [next(source) for _ in range(40)]

    def step_ms(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            batch, _, rows = prebuilt[i % len(prebuilt)]
            trainer.train_step(batch, rows)
        return (time.perf_counter() - start) / n * 1e3

    def data_ms(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            next(source)
        return (time.perf_counter() - start) / n * 1e3

    step_ms(10)
    steps = [step_ms(20) for _ in range(5)]
    data = [data_ms(20) for _ in range(3)]
    print(
        f"batch {a.batch}: the step on prebuilt batches {statistics.median(steps):.2f} ms "
        f"(runs {', '.join(f'{x:.2f}' for x in steps)}); reading + building a batch {statistics.median(data):.2f} ms"
    )


if __name__ == "__main__":
    main()
