"""Where a training step's time goes: `flashdraft train` for a few steps under torch.profiler, a table by self time.

    python benchmarks/train_step_profile.py configs/smollm2-b16.yaml run_dir=/tmp/prof data.dataset=… \
        pipeline.mode=offline pipeline.features_dir=… <the quickstart's other overrides> optim.max_steps=120

Any `flashdraft train` config and key=value overrides (the quickstart prints its own as its train stage's
command; `flashdraft.quickstart.train_overrides` builds them). The table's rows are aten ops and the trainer's
named phases (step/blocks, step/forward_loss, step/backward, step/optimizer); "Self CPU total" / steps is the
step time under the profiler (a little above the unprofiled one). Used for benchmarks/RESULTS.md, "Training
throughput and MFU": the loss through the 49K-row head was 30% of a CPU step.
"""

from __future__ import annotations

import sys

from torch.profiler import ProfilerActivity, profile

from flashdraft.config import load_config
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import train


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cfg = load_config(TrainConfig, sys.argv[1], [*sys.argv[2:], "telemetry.progress=false"])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        res = train(cfg)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"{res.steps} steps")


if __name__ == "__main__":
    main()
