"""Bad configurations are refused before any process group exists, with a message naming the key and the fix."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError, uses_planner
from planaria.runtime.config.validation import plan_from_config
from planaria.runtime.parallel.optim import optimizer_settings
from tests.launch import TINY


def refused(overrides: list[str], *, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_config(TINY, overrides)
        plan_from_config(cfg, world_size=world_size)
    return str(err.value)


def test_the_configs_kernel_modes_are_the_dispatchers():
    """config.py writes them out so as not to import torch (an agent checks configs)."""
    import planaria.kernels
    from planaria.runtime.config.sections import KERNEL_MODES

    assert KERNEL_MODES == planaria.kernels.MODES


def test_a_control_plane_process_imports_no_torch():
    """What an agent imports (the config, the controller, etcd keys, the analytic planner)
    leaves torch out: an agent starts in a fraction of the time and memory."""
    code = ("import sys, planaria.elastic.agent, planaria.runtime.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_tiny_config_leaves_the_plan_to_the_planner():
    assert uses_planner(load_config(TINY))
    assert plan_from_config(load_config(TINY, ["parallel.pp=1"]), world_size=1).world_size == 1


def test_pipelines_fill_the_processes_when_dp_is_not_given():
    plan = plan_from_config(load_config(TINY, ["parallel.pp=2"]), world_size=4)
    assert [len(p.stages) for p in plan.pipelines] == [2, 2]


def test_processes_that_do_not_split_into_pipelines():
    assert "do not split into pipelines" in refused(["parallel.pp=2"], world_size=3)


def test_overrides_are_parsed_as_yaml():
    cfg = load_config(TINY, ["parallel.layout=[[4],[2,2]]", "train.lr=1e-2", "train.recompute=true"])
    assert cfg.parallel.layout == [[4], [2, 2]]
    assert cfg.train.lr == 0.01 and cfg.train.recompute is True


def test_unknown_key_names_it_and_suggests():
    message = refused(["train.step=3"])
    assert "train.step" in message and "did you mean 'steps'" in message


def test_unknown_section():
    assert "unknown config section 'modle'" in refused(["modle.n_layers=2"])


def test_wrong_type():
    assert "train.steps must be an integer" in refused(["train.steps=ten"])


def test_layout_that_does_not_add_up_to_n_layers():
    message = refused(["parallel.layout=[[4],[2,1]]"])
    assert "parallel.layout pipeline 1" in message and "model.n_layers = 4" in message


def test_microbatches_that_do_not_add_up():
    message = refused(["parallel.layout=[[4],[2,2]]", "parallel.microbatches=[1,2]"])
    assert "parallel.microbatches" in message and "add up" in message


def test_microbatches_per_pipeline_with_dp_taken_from_the_processes():
    """pp=2 on 4 processes is two pipelines: a split of [1, 3] was refused at load time
    (dp was taken as 1 there), and [4] at launch (dp 2)."""
    cfg = load_config(TINY, ["parallel.pp=2", "parallel.microbatches=[1,3]"])
    assert [p.num_microbatches for p in plan_from_config(cfg, world_size=4).pipelines] == [1, 3]
    with pytest.raises(ConfigError, match=r"has 2 entries but the job has 1 pipeline"):
        plan_from_config(cfg, world_size=2)


def test_settings_that_would_be_ignored_are_refused():
    assert "the planner splits it itself" in refused(["parallel.microbatches=[1,3]"])
    assert "contradict" in refused(["parallel.layout=[[2,2]]", "parallel.pp=4", "parallel.dp=3"])
    load_config(TINY, ["parallel.layout=[[2,2],[4]]", "parallel.dp=2"])  # agreeing is fine


def test_compiled_blocks_under_the_zero_bubble_schedule_are_refused():
    message = refused(["train.compile=true", "parallel.schedule=zb1f1b"])
    assert "train.compile does not go with parallel.schedule zb1f1b" in message and "use 1f1b" in message
    load_config(TINY, ["train.compile=true", "parallel.schedule=interleaved"])  # the others compile


def test_world_size_that_does_not_match_the_plan():
    message = refused(["parallel.pp=2", "parallel.dp=1"], world_size=3)
    assert "needs 2 processes" in message and "--nproc-per-node=2" in message


def test_heads_must_divide_d_model():
    message = refused(["model.n_heads=5"])
    assert "model.n_heads=5 does not divide model.d_model=64" in message


def test_heads_must_be_divisible_by_tp():
    message = refused(["model.n_heads=2", "parallel.tp=4", "model.vocab_size=256"])
    assert "model.n_heads=2 is not divisible by parallel.tp=4" in message


def test_global_batch_must_split_into_microbatches():
    assert "train.micro_batch=3" in refused(["train.micro_batch=3"])


def test_too_many_stages_for_the_blocks():
    assert "every model stage needs at least one block" in refused(["parallel.pp=8"])


def test_interleaved_shape_names_valid_microbatch_counts():
    message = refused(["parallel.pp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=1",
                       "model.n_layers=8", "train.global_batch=18", "train.micro_batch=2"])
    assert "num_microbatches" in message


def test_virtual_stages_need_interleaved():
    assert "interleaved" in refused(["parallel.pp=2", "parallel.virtual_stages=2"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("no/such/config.yaml")


def test_malformed_yaml_names_the_file_and_the_place(tmp_path):
    """A YAML error was a traceback from every command, naming "<unicode string>"."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layers: [4\n")
    with pytest.raises(ConfigError, match=rf"{bad} is not valid YAML: .* at line 3, column 1"):
        load_config(bad)
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"override 'parallel.layout=\[\[4\],\[2': the value is not valid YAML"):
        load_config(TINY, ["parallel.layout=[[4],[2"])


@pytest.mark.timeout(60)
def test_cli_refuses_before_creating_a_process_group(tmp_path):
    """A rank of a 3-process job with a 2-rank plan exits at once with the reason.

    Had it created a process group it would wait for its peers (none exist) until the
    timeout; exiting in seconds with code 2 shows it never got that far.
    """
    env = dict(os.environ, WORLD_SIZE="3", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.train", str(TINY), "parallel.pp=2", "parallel.dp=1",
         f"output.dir={tmp_path}"],
        capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 2
    assert "config error" in proc.stdout and "needs 2 processes" in proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_data_is_a_one_line_error_before_any_process_group(tmp_path):
    """A headerless token file without data.dtype: rank 0 of a 2-process job says what to
    set and exits 2 at once (no planner, no process group waiting for a peer), no traceback."""
    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(bytes(4096))
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.train", str(TINY), f"data.source={corpus}",
         f"output.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 2
    assert "config error: data.dtype" in proc.stdout and "set data.dtype: uint16" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", [
    # torchrun: two local ranks.
    {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    # A Planaria agent's second worker on its node (its local rank in PLANARIA_LOCAL_RANK).
    {"PLANARIA_STORE": "127.0.0.1:1", "PLANARIA_NODE": "node0", "PLANARIA_LOCAL_RANK": "1"},
], ids=["torchrun", "planaria-agent"])
def test_cli_refuses_more_nccl_processes_than_gpus(launcher, tmp_path):
    """Two processes on a node with fewer GPUs (none here): a config error naming the
    counts and the ways out, not a CUDA error from the second rank."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **launcher)
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.train", str(TINY), "parallel.pp=2", "comm.backend=nccl",
         f"output.dir={tmp_path}"],
        capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "2 process(es) on this node but 0 GPU(s) visible" in proc.stdout
    assert "comm.backend=gloo" in proc.stdout


def test_layout_must_be_a_list_of_lists():
    assert "e.g. [[4], [2, 2]]" in refused(["parallel.layout=[4,4]"])


@pytest.mark.parametrize("lr", [1.0e-4, 6.0e-5, 1.5e-4, 3.0e-4])  # LLaMA's and GPT-3 175B's peaks
def test_published_learning_rates_are_accepted_with_a_final_lr_of_a_tenth(lr):
    cfg = load_config(TINY, [f"train.lr={lr}"])
    assert cfg.train.final_lr == pytest.approx(lr / 10)
    assert optimizer_settings(cfg.train).min_lr == pytest.approx(lr / 10)


def test_min_lr_given_wins_over_the_ratio_and_must_not_exceed_lr():
    assert load_config(TINY, ["train.lr=1e-4", "train.min_lr=0"]).train.final_lr == 0
    assert load_config(TINY, ["train.min_lr_ratio=0.05"]).train.final_lr == pytest.approx(3e-3 * 0.05)
    with pytest.raises(ConfigError, match="train.min_lr must be between 0 and train.lr"):
        load_config(TINY, ["train.lr=1e-4", "train.min_lr=3e-4"])
    with pytest.raises(ConfigError, match="train.min_lr_ratio"):
        load_config(TINY, ["train.min_lr_ratio=1.5"])
    with pytest.raises(ConfigError, match="train.min_lr must be a number"):
        load_config(TINY, ["train.min_lr=low"])


def test_adam_settings_reach_the_optimizer():
    settings = optimizer_settings(load_config(TINY, ["train.adam_eps=1e-5", "train.adam_beta2=0.99"]).train)
    assert (settings.eps, settings.betas) == (1e-5, (0.9, 0.99))
    with pytest.raises(ConfigError, match="train.adam_eps"):
        load_config(TINY, ["train.adam_eps=0"])


def test_keys_of_the_earlier_layout_still_work_and_name_their_new_place():
    with pytest.warns(FutureWarning, match=r"parallel\.timeout_s is now comm\.timeout_s"):
        cfg = load_config(TINY, ["parallel.timeout_s=12", "parallel.fault_tolerance=2", "parallel.audit_every=3",
                                 "parallel.audit_repair=true", "parallel.backend=gloo"])
    assert (cfg.comm.timeout_s, cfg.fault_tolerance.f, cfg.audit.every, cfg.audit.repair, cfg.comm.backend) == \
        (12.0, 2, 3, True, "gloo")


def test_a_config_file_of_the_earlier_layout_loads(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(TINY.read_text().replace("fault_tolerance:\n  f: 1", "")
                   .replace("parallel:\n", "parallel:\n  fault_tolerance: 0\n  heartbeat_timeout_s: 7\n"))
    with pytest.warns(FutureWarning, match=r"parallel\.fault_tolerance is now fault_tolerance\.f"):
        cfg = load_config(old)
    assert cfg.fault_tolerance.f == 0 and cfg.comm.heartbeat_timeout_s == 7


def test_a_moved_key_given_both_ways_in_a_file_is_refused(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text(TINY.read_text().replace("parallel:\n", "parallel:\n  timeout_s: 12\n") + "comm:\n  timeout_s: 13\n")
    with pytest.raises(ConfigError, match=r"parallel\.timeout_s and comm\.timeout_s are one setting, given twice"):
        load_config(both)


def test_an_override_under_either_name_wins_over_the_file():
    with pytest.warns(FutureWarning):
        assert load_config(TINY, ["parallel.fault_tolerance=3"]).fault_tolerance.f == 3
    assert load_config(TINY, ["fault_tolerance.f=0"]).fault_tolerance.f == 0


@pytest.mark.parametrize("override, message", [
    ("parallel.schedule=zigzag", r"parallel\.schedule 'zigzag' is unknown; use one of 'gpipe', '1f1b', "
                                 r"'interleaved', 'zb1f1b'"),
    ("parallel.schedule=interleave", r"parallel\.schedule 'interleave' is unknown \(did you mean 'interleaved'\?\)"),
    ("comm.backend=mpi", r"comm\.backend 'mpi' is unknown; use one of 'auto', 'gloo', 'nccl'"),
    ("train.dtype=float16", r"train\.dtype 'float16' is unknown \(did you mean 'bfloat16'\?\); use one of 'float32', 'float64', 'bfloat16'"),
    ("model.kernels=true", r"model\.kernels True is unknown"),
    ("data.dtype=uint8", r"data\.dtype 'uint8' is unknown.*; use uint16 or uint32 for a headerless \.bin"),
    ("train.lr_schedule=linear", r"train\.lr_schedule 'linear' is unknown; use one of 'cosine', 'constant'"),
])
def test_a_choice_outside_its_set_is_refused_with_the_set(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


def test_the_logging_sections_keys_are_set_as_section_sub_key(tmp_path):
    cfg = load_config(TINY, ["logging.tensorboard.enabled=true", "output.dir=out"])
    assert cfg.tensorboard_dir == Path("out") / "tensorboard"
    assert load_config(TINY, []).tensorboard_dir is None  # off by default
    path = tmp_path / "job.yaml"
    path.write_text(Path(TINY).read_text() + "\nlogging:\n  tensorboard: {enabled: true, dir: tb}\n")
    assert load_config(path, ["logging.tensorboard.dir=elsewhere"]).tensorboard_dir == Path("elsewhere")


@pytest.mark.parametrize("override, message", [
    ("logging.tensorboard.enabeld=true", r"unknown config key logging\.tensorboard\.enabeld \(did you mean 'enabled'\?\); "
                                         r"keys of 'logging\.tensorboard' are \['dir', 'enabled'\]"),
    ("logging.tb=true", r"unknown config key logging\.tb; keys of 'logging' are \['tensorboard', 'wandb'\]"),
    ("logging.wandb=true", r"logging\.wandb must be a mapping of its keys \[.*'mode'.*\], got True"),
    ("logging.wandb.mode=batch", r"logging\.wandb\.mode 'batch' is unknown; use one of 'online', 'offline'"),
    ("logging.tensorboard.enabled=yes please", r"logging\.tensorboard\.enabled must be true or false"),
    ("logging.wandb.enabled=true", r"set logging\.tensorboard\.enabled=true too"),
    ("train.lr.x=1", r"train\.lr is 0\.003, not a sub-section of keys"),
    ("logging.wandb.mode.x=1", r"must look like section\.key=value"),
])
def test_the_logging_sections_bad_keys_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, ["train.lr=0.003", override])


def test_wandb_enabled_without_the_package_says_how_to_install_it(monkeypatch):
    # The test extra installs wandb; None in sys.modules is how Python marks a module
    # that cannot be imported (importlib.util.find_spec returns None for it).
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"needs the wandb package.*pip install wandb"):
        load_config(TINY, ["logging.tensorboard.enabled=true", "logging.wandb.enabled=true"])
