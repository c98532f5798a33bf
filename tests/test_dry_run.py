"""`shardlm train --dry-run`: the whole config resolved and checked, nothing trained; and every
command `shardlm plan` prints for a layout train can run passes it."""

from __future__ import annotations

import shlex

import pytest

from shardlm.cli.main import main


def plan_lines(capsys, *argv: str) -> tuple[list[str], list[str]]:
    """(commands, not-runnable lines) that `shardlm plan argv` printed."""
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("commands (each passes"):].splitlines()[1:]
    commands = [line.split(None, 1)[1] for line in listed if line.strip() and "not runnable" not in line]
    blocked = [line for line in listed if "not runnable" in line]
    return commands, blocked


def train_argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "torchrun":  # the workers' own command, after `-m shardlm train`
        words = words[words.index("-m") + 1:]
    assert words[:2] == ["shardlm", "train"], command
    return words[1:]


@pytest.mark.parametrize("model, cluster", [("--model=gpt2-350m", "8xA100-80GB"),
                                            ("--params=2e9", "2x8xA100-80GB"),
                                            ("--model=llama-7b", "2x8xA100-80GB"),
                                            ("--model=olmoe-like", "8xH100-80GB")])
def test_every_plan_command_passes_dry_run(capsys, tmp_path, model, cluster):
    commands, blocked = plan_lines(capsys, *model.split("="), "--gpus", cluster, "--top", "12")
    assert commands, "no runnable plan printed"
    for command in commands:
        code = main([*train_argv(command), "--dry-run", "--gpus", cluster, f"--run.dir={tmp_path}"])
        out = capsys.readouterr().out
        assert code == 0, command
        assert "dry run: the config is valid" in out
    assert not list(tmp_path.iterdir()), "a dry run created files"
    for line in blocked:  # printed as such, never as a command
        assert "shardlm train --" not in line and ("pp" in line or "ep" in line)


def test_a_long_sequence_plans_context_parallelism_and_its_commands_run(capsys, tmp_path):
    """llama-1b at 32k tokens: one sequence's activations fill most of an A100, so the plan
    splits sequences over ranks (parallel.cp), and those commands pass --dry-run."""
    commands, _ = plan_lines(capsys, "--model", "llama-1b", "--seq", "32768", "--gpus", "8xA100-80GB",
                             "--top", "6")
    with_cp = [c for c in commands if "--parallel.cp=" in c]
    assert with_cp, commands
    for command in with_cp[:3]:
        assert main([*train_argv(command), "--dry-run", "--gpus", "8xA100-80GB", f"--run.dir={tmp_path}"]) == 0
        out = capsys.readouterr().out
        cp = command.split("--parallel.cp=")[1].split()[0]
        assert f", cp {cp};" in out and "context-parallel ring" in out and "cp ring buffers" in out
        assert "dry run: the config is valid" in out
    assert not list(tmp_path.iterdir())


def test_dry_run_predicts_a_context_parallel_layout(capsys, tmp_path):
    code = main(["train", "--dry-run", "--nproc", "2", "--parallel.cp=2", "--precision.compute=fp32",
                 f"--run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "dp_shard 1, cp 2;" in out and "tokens per rank" in out
    assert "context-parallel ring" in out and "b·s/cp" in out
    assert "dry run: the config is valid" in out


def test_plan_marks_layouts_train_cannot_run(capsys, tmp_path):
    """Pipelines run at every ZeRO stage (ZeRO-3 too: issue 28), printed as commands that pass
    --dry-run; expert parallelism runs beside tp and cp too (the ep x tp grid, ep inside dp_shard
    x cp), its commands carrying the experts and passing --dry-run, nothing printed as blocked."""
    # top 40: since Ulysses' saved activations are priced as measured (activations.cp_saved: q,
    # k, v kept as the all-to-all's one buffer), context-parallel layouts fit and fill the top 20
    commands, blocked = plan_lines(capsys, "--model", "llama-7b", "--gpus", "4xA100-40GB", "--top", "40")
    zero3_pp = [c for c in commands if "--parallel.pp=" in c and "--parallel.zero_stage=3" in c]
    assert zero3_pp, "expected ZeRO-3 pipeline layouts among the top plans for llama-7b on 4 GPUs"
    assert not blocked
    assert main([*train_argv(zero3_pp[0]), "--dry-run", "--gpus", "4xA100-40GB", f"--run.dir={tmp_path}"]) == 0
    assert "dry run: the config is valid" in capsys.readouterr().out
    commands, blocked = plan_lines(capsys, "--model", "llama-7b", "--gpus", "2x8xA100-80GB", "--experts", "8",
                                   "--top", "40")
    ep = [c for c in commands if "--parallel.ep=" in c]
    assert ep and all("--model.experts=8" in c for c in ep) and not blocked
    beside = [c for c in ep if "--parallel.tp=" in c or "--parallel.cp=" in c]
    assert beside, "expected expert parallelism beside tp or cp among the top plans"
    for command in dict.fromkeys([ep[0], *beside[:2]]):
        assert main([*train_argv(command), "--dry-run", "--gpus", "2x8xA100-80GB", f"--run.dir={tmp_path}"]) == 0, command
        assert "dry run: the config is valid" in capsys.readouterr().out


def test_pipeline_plans_print_commands_that_pass_dry_run(capsys, tmp_path):
    """llama-7b (32 blocks) on 4 A100-40GB: pipeline layouts are among the best plans, printed as
    `shardlm train --parallel.pp=P --parallel.pp_schedule=1f1b` commands that pass --dry-run,
    which shows every stage's memory and the pipeline's traffic."""
    commands, _ = plan_lines(capsys, "--model", "llama-7b", "--gpus", "4xA100-40GB", "--top", "8")
    piped = [c for c in commands if "--parallel.pp=" in c]
    assert piped, commands
    for command in piped:
        assert "--parallel.pp_schedule=1f1b" in command and "--parallel.zero_stage=3" not in command
        assert main([*train_argv(command), "--dry-run", "--gpus", "4xA100-40GB", f"--run.dir={tmp_path}"]) == 0
        out = capsys.readouterr().out
        pp = command.split("--parallel.pp=")[1].split()[0]
        assert f"pp {pp} (1f1b, blocks " in out and "per pipeline stage (1f1b" in out
        assert "pipeline send/recv" in out and "dry run: the config is valid" in out
    assert not list(tmp_path.iterdir())


def test_dry_run_shows_every_pipeline_stage(capsys, tmp_path):
    for schedule, held in (("1f1b", "2"), ("gpipe", "4")):
        code = main(["train", "--dry-run", "--nproc", "2", "--parallel.pp=2", f"--parallel.pp_schedule={schedule}",
                     "--train.grad_accum=4", "--precision.compute=fp32", f"--run.dir={tmp_path}"])
        out = capsys.readouterr().out
        assert code == 0 and "dry run: the config is valid" in out
        rows = out[out.index(f"per pipeline stage ({schedule}, 4 micro-batches)"):].splitlines()[2:4]
        assert rows[0].split()[:2] == ["0", "first"] and rows[1].split()[:2] == ["1", "last"]
        assert rows[0].split()[4] == held  # micro-batches the first stage holds
        assert "Resolved: ZeRO stage 0, pp 2" in out
    assert not list(tmp_path.iterdir())


def test_dry_run_resolves_auto_and_reports_memory(capsys, tmp_path):
    code = main(["train", "--dry-run", "--nproc", "2", "--parallel.strategy=auto",
                 "--precision.compute=fp32", f"--run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "per-rank memory" in out and "peak, training step" in out
    assert "Resolved: ZeRO stage" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, words", [
    (["--dry-run", "--nproc", "2", "--parallel.dp_shard=3"], ["dp_shard", "3"]),
    (["--dry-run", "--nproc", "-1"], ["--nproc", ">= 0"]),
    (["--gpus", "8xA100-80GB"], ["--gpus", "--dry-run"]),
    (["--dry-run", "--gpus", "8xA100-80GB", "--nproc", "4"], ["--nproc 4", "8 devices"]),
    (["--dry-run", "--gpus", "8xB999"], ["unknown device"]),
])
def test_dry_run_errors_early(capsys, argv, words):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_a_transformers_config_json_is_planned_and_its_commands_run(capsys, tmp_path):
    """`--model config.json`: a LLaMA-family shape (GQA, SwiGLU width, untied head, vocabulary)
    read from the file, planned, and every runnable command passes --dry-run."""
    import json

    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 5632,
              "max_position_embeddings": 2048, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["estimate", "--model", str(path), "--gpus", "8xA100-80GB", "--zero-stage", "3",
                 "--micro-batch", "2", "--seq", "2048"]) == 0
    out = capsys.readouterr().out
    assert "32/8 kv heads" in out and "swiglu/rmsnorm/rope" in out and "vocab 32000" in out
    commands, _ = plan_lines(capsys, "--model", str(path), "--gpus", "8xA100-80GB", "--top", "6")
    assert commands
    for command in commands:
        assert main([*train_argv(command), "--dry-run", "--gpus", "8xA100-80GB",
                     f"--run.dir={tmp_path / 'runs'}"]) == 0, command
        assert "dry run: the config is valid" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 3}))
    assert main(["estimate", "--model", str(tmp_path / "bad.json"), "--gpus", "8xA100-80GB"]) == 2
    assert "is not one that maps onto our decoder" in capsys.readouterr().err


def test_dry_run_prices_an_expert_grid(capsys, tmp_path):
    """Expert parallelism beside tensor parallelism (the ep x tp grid, parallel/expert/dispatch.py) is a
    layout the planner models: a dry run on 4 CPU ranks prices its exchange over the 4 ranks of
    the grid and its MoE blocks' tensor-parallel collectives (traffic.moe_tp_calls)."""
    code = main(["train", "--nproc", "4", "--model.preset=moe-tiny", "--parallel.tp=2", "--parallel.ep=2",
                 "--parallel.dp_shard=2", "--precision.compute=fp32", "--run.device=cpu", "--dry-run",
                 f"--run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "expert all-to-all" in out and "2 ep x 2 tp = 4 ranks" in out, out
    assert "tp 2, ep 2" in out, out
