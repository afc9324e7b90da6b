"""torchtitan's own Llama 3 trainer on one GPU, offline: the torchtitan side of
`gpu_throughput.py`.

    python benchmarks/gpu_torchtitan.py --out DIR [--shape JSON] [--batch 4] [--seq 2048]
                                        [--steps 20] [--attention flex|sdpa] [--loss ce|chunked]
                                        [--recompute none|selective|full] [--cpu-smoke]

What runs is `torchtitan.train`, the trainer torchtitan's README launches, under torchrun
with one process, unchanged: FSDP over the one GPU (bf16 parameters for compute, float32
master weights and gradient reduction), `compile` of the model and the loss, CUDA graphs
(its default), its fused AdamW, its MFU and tokens/s lines. Only its `Trainer.Config` is
built here (`job_config`): torchtitan 0.3.0 has the LLaMA 3.2 1B flavor ("1B": tied
embeddings, FFN 8192) but no config that trains it, and a model cannot be chosen from its
command line. The 8B shape with fewer blocks is its "8B" flavor cut to `n_layers`.

Offline (a GPU machine may have no network): the tokenizer is made here with Hugging Face
`tokenizers` (a word-level vocabulary with LLaMA 3's begin and end of text tokens) and the
data is a JSON-lines file of generated text that torchtitan's `c4_test` loader reads from
`--dataloader.dataset-path`. Token ids stay below the model's vocabulary; the model's
vocabulary, not the tokenizer's, sets the head's size and so the step's work.

torchtitan 0.3.0 is written against torch 2.14. On an older torch (2.11, say) `--trainer`
first adds the two names it uses that torch lacks, and changes nothing
else:
- `torch.distributed.fsdp.DataParallelMeshDims`, imported at module level (a frozen pair
  of mesh dimension names; on one GPU torchtitan's mesh is of size 1 and never passes it);
- `torch.distributed.set_timeout`, called after the first step: torch's older
  `distributed_c10d._set_pg_timeout` does the same.
On torch 2.11 torchtitan's chunked loss (`ChunkedLossWrapper`, its default) fails in the
backward under FSDP ("data is not allocated yet"), so `--loss ce` (the plain cross-entropy
over the full logits) is this script's default; `--loss chunked` runs the stock loss on
a newer torch.

`--cpu-smoke`: the same command line on CPU, the "debugmodel" flavor with PyTorch's
attention (FlexAttention has no CPU backward), no CUDA graphs: a check of the launch, the
data and the tokenizer without a GPU. Not a timing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import runpy
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB_ENV = "PLANARIA_TT_JOB"
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but "
         "have an they you were her she there been one all we their has would when if so no will more can "
         "time other into some could them these two may than first then only new its people over also any "
         "training model data token sequence layer attention batch gradient loss").split()
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


# ------------------------------------------------------- what torchtitan imports
def job_config():
    """torchtitan's `Trainer.Config` of the job in $PLANARIA_TT_JOB (`--config job_config`)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    job = json.loads(os.environ[JOB_ENV])
    spec = model_registry(job["flavor"], attn_backend=job["attention"])
    layers = spec.model.layers
    if job.get("n_layers") and job["n_layers"] < len(layers):
        del layers[job["n_layers"]:]
    if job.get("cpu_smoke"):
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
    if job["loss"] == "chunked":
        loss = ChunkedLossWrapper.Config(loss_fn=loss)
    return Trainer.Config(
        loss=loss, hf_assets_path=job["assets"], model_spec=spec, optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=job["batch"], seq_len=job["seq"], steps=job["steps"]),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=1), checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None, compile=CompileConfig(enable=True, components=["model", "loss"]),
        validator=Validator.Config(enable=False))


def add_missing_torch_names() -> list[str]:
    """The two names torchtitan 0.3.0 uses that a torch before 2.14 lacks (module doc)."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
        added.append("torch.distributed.set_timeout")
    return added


def cpu_as_the_device() -> None:
    """`--cpu-smoke`: torchtitan takes the accelerator's device module; give it the CPU's,
    with the few calls it makes that torch.cpu lacks answered trivially."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    calls = {"get_device_name": lambda *a, **k: "cpu",
             "get_device_properties": lambda *a, **k: type("P", (), {"total_memory": 1 << 40, "name": "cpu"})(),
             "memory_stats": lambda *a, **k: {}, "reset_peak_memory_stats": lambda *a, **k: None,
             "empty_cache": lambda *a, **k: None, "device_count": lambda *a, **k: 1,
             "manual_seed": torch.manual_seed, "manual_seed_all": torch.manual_seed,
             "set_device": lambda *a, **k: None, "current_device": lambda *a, **k: 0}
    for name, call in calls.items():
        if not hasattr(torch.cpu, name) or name in ("set_device", "current_device"):
            setattr(torch.cpu, name, call)


def run_trainer(argv: list[str]) -> None:
    """In the torchrun process: the names added, then torchtitan.train as its own main."""
    added = add_missing_torch_names()
    if json.loads(os.environ[JOB_ENV]).get("cpu_smoke"):
        cpu_as_the_device()
    if added and os.environ.get("RANK", "0") == "0":
        print(f"[gpu_torchtitan] added to this torch: {', '.join(added)}", flush=True)
    sys.argv = ["torchtitan.train", *argv]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


# ------------------------------------------------------------ offline inputs
def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over `WORDS` with LLaMA 3's text markers, as torchtitan's
    Hugging Face tokenizer loader reads one (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {word: i for i, word in enumerate(["<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
         "model_max_length": 131072}))


def write_text(directory: Path, documents: int = 64, words: int = 4000) -> None:
    """Generated documents as JSON lines with a "text" field (what `c4_test` reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(directory / "data.json", "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")


# -------------------------------------------------------------------- driver
def command(args, out: Path) -> list[str]:
    flags = ["--module", Path(__file__).stem, "--config", "job_config",
             "--hf-assets-path", str(out / "tokenizer"),
             "--dataloader.dataset", "c4_test", "--dataloader.dataset-path", str(out / "data"),
             "--training.steps", str(args.steps), "--training.local-batch-size", str(args.batch),
             "--training.seq-len", str(args.seq), "--training.dtype", "float32",
             "--training.mixed-precision-param", "bfloat16", "--training.mixed-precision-reduce", "float32",
             "--compile.enable", "--compile.components", "model,loss",
             "--metrics.log-freq", "1", "--metrics.no-enable-tensorboard", "--metrics.no-enable-wandb",
             "--metrics.disable-color-printing", "--checkpoint.no-enable", "--validator.no-enable",
             "--dump-folder", str(out / "dump")]
    if args.cpu_smoke:
        flags.append("--training.disable-cuda-graphs")
    flags.append(f"activation-checkpoint:{args.recompute}")  # a subcommand: last
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            __file__, "--trainer", "--", *flags]


FLAVORS = {"1B": dict(d_model=2048, n_heads=32, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256),
           "8B": dict(d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256)}
"""The widths of torchtitan's flavors that a shape of gpu_throughput.py can be."""


def flavor_of(shape: dict, cpu_smoke: bool = False) -> tuple[str, int]:
    """torchtitan's flavor of a shape of gpu_throughput.py, and its blocks; a ValueError for
    a shape no flavor has (torchtitan would train another model than the other sides)."""
    if cpu_smoke:
        return "debugmodel", 0
    for flavor, widths in FLAVORS.items():
        if all(shape.get(key) == value for key, value in widths.items()):
            return flavor, int(shape.get("n_layers", 0))
    raise ValueError(f"torchtitan has no flavor of this shape's widths ({shape}); its flavors here: "
                     f"{sorted(FLAVORS)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trainer"]:
        run_trainer(argv[2:] if argv[1:2] == ["--"] else argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="{}", help="gpu_throughput.py's shape, as JSON")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--attention", choices=["flex", "sdpa"], default="flex")
    parser.add_argument("--loss", choices=["ce", "chunked"], default="ce")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_tokenizer(out / "tokenizer")
    write_text(out / "data")
    flavor, layers = flavor_of(json.loads(args.shape), args.cpu_smoke)
    job = {"flavor": flavor, "n_layers": layers, "attention": args.attention,
           "loss": args.loss, "batch": args.batch, "seq": args.seq, "steps": args.steps,
           "assets": str(out / "tokenizer"), "cpu_smoke": args.cpu_smoke}
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(out / "hf"), PYTORCH_ALLOC_CONF=os.environ.get("PYTORCH_ALLOC_CONF",
                                                                          "expandable_segments:True"),
               **{JOB_ENV: json.dumps(job)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(command(args, out), env=env, timeout=args.timeout_s)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
