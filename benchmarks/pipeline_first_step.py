"""The first pipeline step after fresh stages, with torch's metadata inference and without.

    python benchmarks/pipeline_first_step.py [--repeats R] [--config YAML]
                                             [--set section.key=value ...] [--json out.json]

When a job moves to a new plan, every worker builds new `PipelineStage`s. Built
without example arguments (dynamic mode), a stage's first `step` runs torch's warm-up
vote across the pipeline and then infers its metadata: a forward (and, when training,
a backward) of one microbatch on empty tensors, stage after stage, each sending its
pickled metadata to the next (`send_object_list`). Built with `input_args` and
`output_args` (static mode), the vote still crosses the pipeline but the inference is
skipped.

Three gloo processes on loopback (torch.multiprocessing spawn, OMP_NUM_THREADS=1) hold
a 3-stage pipeline of the config's model (default configs/demo.yaml: embedding, 4
blocks of d_model 128, head; global batch 8 in microbatches of 2; the 1f1b schedule),
built with Planaria's own pieces: `LayerModel.build_layer`, `nn.Sequential` chunks as
`Engine._build_schedule` makes them, `build_stages` (static mode: with the examples of
`LayerModel.stage_examples`, as the engine passes them), `PlanSchedule`. Each repeat,
for each mode in alternating order, a new pipeline group (as an epoch builds one) and
new stages are built, then two training steps are timed, each started after a barrier
and ended when the slowest rank is done (the max over ranks). The table gives the
medians over repeats of the first step, the second, and the first minus the second,
per mode, and how much static metadata saves on the first step (the median of each
repeat's difference). The machine's load average before and after is printed: three
processes on few cores are easily disturbed by other work.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "demo.yaml"
STAGES = 3
MODES = ("dynamic", "static")


def _chunks(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as they go, one per stage."""
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(zip(bounds, bounds[1:]))


def _worker(rank: int, config: str, overrides: list[str], repeats: int, rendezvous: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.models.llama import LayerModel, torch_dtypes
    from planaria.runtime.parallel.pipeline import PlanSchedule, build_stages
    from planaria.runtime.models.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=STAGES)
    cfg = load_config(config, overrides)
    param_dtype, autocast = torch_dtypes(cfg.train.dtype)
    if autocast is not None or cfg.parallel.tp != 1:
        raise SystemExit("this benchmark builds tp = 1 pipelines without autocast")
    model = LayerModel(cfg.model, seed=cfg.train.seed)
    tp, device = TensorParallel(), torch.device("cpu")
    start, stop = _chunks(model.num_layers, STAGES)[rank]
    layers = [model.build_layer(i, tp, param_dtype, device, pretrained=True) for i in range(start, stop)]
    head = layers[-1] if rank == STAGES - 1 else None
    num_mb = cfg.train.global_batch // cfg.train.micro_batch
    gen = torch.Generator().manual_seed(cfg.data.seed)
    tokens = torch.randint(cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(output, target):
        return model.loss(output, target, tp, head=head) / num_mb

    def build(mode: str, group):
        """New stages over a new chunk of the same layers, as an epoch's `_build_schedule`."""
        examples = None
        if mode == "static":  # what Engine._build_schedule passes
            examples = [model.stage_examples(start, stop, cfg.train.micro_batch, 1, param_dtype, None,
                                             requires_grad=True)]
        return build_stages([(rank, nn.Sequential(*layers))], STAGES, group, device, examples=examples)

    def timed_step(schedule) -> float:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        dist.barrier()
        begin = time.perf_counter()
        schedule.step(*((inputs,) if rank == 0 else ()), target=targets if rank == STAGES - 1 else None)
        elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for mode in order:
            group = dist.new_group(list(range(STAGES)), backend="gloo")
            stages = build(mode, group)
            schedule = PlanSchedule(stages, "1f1b", num_mb, loss_fn)
            first = timed_step(schedule)
            second = timed_step(schedule)
            times[mode].append((first, second))
            del schedule, stages
            dist.destroy_process_group(group)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):8.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--set", action="append", default=[], metavar="section.key=value")
    parser.add_argument("--json", help="also write the per-repeat times (seconds) here")
    args = parser.parse_args(argv)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch.multiprocessing as mp

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(args.config, args.set, args.repeats, os.path.join(tmp, "rendezvous"), out),
                 nprocs=STAGES, join=True)
        times = json.loads(Path(out).read_text())
    print(f"{STAGES}-stage pipeline, 1f1b, {args.repeats} repeats, medians (ms; max over ranks); "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"{'mode':<8} {'first':>8} {'second':>8} {'first-second':>13}")
    for mode in MODES:
        pairs = times[mode]
        print(f"{mode:<8} {_ms([a for a, _ in pairs])} {_ms([b for _, b in pairs])} "
              f"{_ms([a - b for a, b in pairs]):>13}")
    saved = [d[0] - s[0] for d, s in zip(times["dynamic"], times["static"])]
    print(f"static saves on the first step: {_ms(saved).strip()} ms (median of the per-repeat differences)")
    if args.json:
        Path(args.json).write_text(json.dumps(times, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
