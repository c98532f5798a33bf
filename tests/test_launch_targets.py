"""`shardlm launch --target T`: every target's spec parses and carries the world size, the
rendezvous and the train command with its overrides; an invalid config is refused before anything
is written; --submit without the tool is a clear error (docs/launch.md). Nothing here starts a
process group: the specs are text (the 2-agent torchrun runs: tests/test_multinode.py)."""

import json
import os
import shlex
import stat
from pathlib import Path

import pytest

from shardlm.cli.main import main
from shardlm.launch.targets import torchrun_argv

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "gpt2-124m.toml")
OVERRIDES = ["--train.steps=100", "--parallel.zero_stage=3"]
TRAIN = ["-m", "shardlm", "train", CONFIG, *OVERRIDES, "--run.name=job1"]


def launch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["launch", *args, "--job-name=job1", CONFIG, *OVERRIDES])
    out, err = capsys.readouterr()
    return code, out, err


def load_yaml_or_json(text: str):
    try:
        import yaml
    except ImportError:
        return json.loads(text)
    return yaml.safe_load(text)


def torchrun_words(argv: list[str], nodes: int, per_node: int, endpoint: str) -> None:
    assert argv[0] == "torchrun"
    assert f"--nnodes={nodes}" in argv and f"--nproc-per-node={per_node}" in argv
    assert "--rdzv-backend=c10d" in argv and f"--rdzv-endpoint={endpoint}" in argv
    assert argv[-len(TRAIN):] == TRAIN  # the train command, config and overrides last


def test_torchrun_lines_one_per_node_with_the_rendezvous(capsys, tmp_path):
    out_file = tmp_path / "nodes.sh"
    code, out, _ = launch(capsys, "--target", "torchrun", "--nodes", "3", "--gpus-per-node", "4",
                          "--rdzv-endpoint", "10.1.2.3:29400", "--out", str(out_file))
    assert code == 0 and out_file.read_text() == out
    lines = [ln for ln in out.splitlines() if ln.startswith("torchrun ")]
    assert len(lines) == 3 and "world size 12" in out
    for ln in lines:
        torchrun_words(shlex.split(ln), 3, 4, "10.1.2.3:29400")


def test_torchrun_default_endpoint_is_the_documented_placeholder(capsys):
    code, out, _ = launch(capsys, "--target", "torchrun", "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0 and "--rdzv-endpoint=HEAD_NODE:29500" in out and "placeholder" in out


def test_slurm_script(capsys):
    code, out, _ = launch(capsys, "--target", "slurm", "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    for d in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--job-name=job1"):
        assert f"#SBATCH {d}" in lines
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    [srun] = [ln for ln in lines if ln.startswith("srun ")]
    words = shlex.split(srun)  # the shell's own quoting: the variable stays for it to expand
    assert words[0] == "srun"
    torchrun_words(words[1:], 2, 8, "$head_node:29500")
    assert "--rdzv-id=$SLURM_JOB_ID" in words


def test_k8s_pytorchjob(capsys):
    code, out, _ = launch(capsys, "--target", "k8s", "--nodes", "3", "--gpus-per-node", "8",
                          "--image", "registry.example/shardlm:1")
    assert code == 0
    job = load_yaml_or_json(out)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"] == "job1" and job["spec"]["nprocPerNode"] == "8"
    reps = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in reps.items()} == {"Master": 1, "Worker": 2}  # 3 x 8 = 24
    for rep in reps.values():
        [c] = rep["template"]["spec"]["containers"]
        assert c["image"] == "registry.example/shardlm:1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        torchrun_words(c["command"], 3, 8, "$(MASTER_ADDR):$(MASTER_PORT)")


def test_k8s_json_and_a_single_node_has_no_workers(capsys):
    code, out, _ = launch(capsys, "--target", "k8s", "--nodes", "1", "--gpus-per-node", "2",
                          "--image", "img", "--json")
    assert code == 0
    reps = json.loads(out)["spec"]["pytorchReplicaSpecs"]
    assert list(reps) == ["Master"] and reps["Master"]["replicas"] == 1


def test_vertex_custom_job(capsys):
    code, out, _ = launch(capsys, "--target", "vertex", "--nodes", "2", "--gpus-per-node", "8",
                          "--image", "us-docker.pkg.dev/p/r/shardlm:1")
    assert code == 0
    job = json.loads(out)
    assert job["displayName"] == "job1"
    pools = job["jobSpec"]["workerPoolSpecs"]
    assert [p["replicaCount"] for p in pools] == [1, 1]
    for p in pools:
        assert p["machineSpec"] == {"machineType": "a2-highgpu-8g", "acceleratorType": "NVIDIA_TESLA_A100",
                                    "acceleratorCount": 8}
        assert p["containerSpec"]["imageUri"] == "us-docker.pkg.dev/p/r/shardlm:1"
        sh, dash_c, line = p["containerSpec"]["command"]
        assert (sh, dash_c) == ("sh", "-c")
        words = shlex.split(line)
        assert words[0] == "exec"
        torchrun_words(words[1:], 2, 8, "$MASTER_ADDR:${MASTER_PORT:-29500}")


def test_vertex_without_a_default_machine_needs_machine_type(capsys):
    code, _, err = launch(capsys, "--target", "vertex", "--nodes", "2", "--gpus-per-node", "3",
                          "--image", "img")
    assert code == 2 and "--machine-type" in err


def test_inline_carries_the_config_as_overrides(capsys):
    code, out, _ = launch(capsys, "--target", "torchrun", "--nodes", "2", "--gpus-per-node", "2",
                          "--inline")
    assert code == 0
    words = shlex.split([ln for ln in out.splitlines() if ln.startswith("torchrun ")][0])
    train = words[words.index("train") + 1:]
    assert CONFIG not in train and "--model.preset=gpt2-124m" in train
    assert train[-3:] == [*OVERRIDES, "--run.name=job1"]


@pytest.mark.parametrize("target", ["torchrun", "slurm", "k8s", "trainjob", "vertex", "skypilot", "ray"])
def test_an_invalid_config_is_refused_before_anything_is_written(capsys, tmp_path, target):
    out_file = tmp_path / "spec"
    code = main(["launch", "--target", target, "--nodes", "2", "--gpus-per-node", "3", "--image", "img",
                 "--out", str(out_file), "--parallel.dp_replicate=4"])  # 6 ranks, not divisible by 4
    out, err = capsys.readouterr()
    assert code == 2 and "not divisible by dp_replicate (4)" in err
    assert out == "" and not out_file.exists()
    code = main(["launch", "--target", target, "--nodes", "2", "--gpus-per-node", "2", "--image", "img",
                 "--out", str(out_file), "--train.no_such_key=1"])
    assert code == 2 and not out_file.exists() and capsys.readouterr().out == ""


def test_missing_image_for_a_container_target_is_refused(capsys):
    code, out, err = launch(capsys, "--target", "k8s", "--nodes", "2", "--gpus-per-node", "2")
    assert code == 2 and "--image" in err and out == ""


@pytest.mark.parametrize("target,tool", [("slurm", "sbatch"), ("k8s", "kubectl")])
def test_submit_without_the_tool_is_a_clear_error(capsys, tmp_path, monkeypatch, target, tool):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    out_file = tmp_path / "spec"
    code, out, err = launch(capsys, "--target", target, "--nodes", "2", "--gpus-per-node", "4",
                            "--image", "img", "--submit", "--out", str(out_file))
    assert code == 2 and f"--submit needs `{tool}` on PATH" in err
    assert out == "" and not out_file.exists()


def test_submit_vertex_without_the_sdk_says_what_to_install(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "google.cloud.aiplatform", None)  # absent, even if installed
    code, _, err = launch(capsys, "--target", "vertex", "--nodes", "2", "--gpus-per-node", "8",
                          "--image", "img", "--submit")
    assert code == 2 and "pip install 'shardlm[vertex]'" in err


def fake_tool(tmp_path, monkeypatch, tool: str) -> None:
    """`tool` on PATH as a script that writes its arguments to tmp_path/called and says
    'submitted' (what --submit runs, without a cluster)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / tool
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "called"}\necho submitted\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("target,tool", [("slurm", "sbatch"), ("k8s", "kubectl")])
def test_submit_runs_the_tool_on_the_written_file(capsys, tmp_path, monkeypatch, target, tool):
    fake_tool(tmp_path, monkeypatch, tool)
    out_file = tmp_path / "job.spec"
    code, _, err = launch(capsys, "--target", target, "--nodes", "2", "--gpus-per-node", "4",
                          "--image", "img", "--submit", "--out", str(out_file))
    assert code == 0 and "submitted" in err
    called = (tmp_path / "called").read_text().split()
    assert called[-1] == str(out_file) and (called[0] == "create" if tool == "kubectl" else True)


def test_the_builder_is_the_same_line_on_every_node():
    argv = torchrun_argv(2, 8, "h:1", ["c.toml", "--train.steps=1"], "id", 3)
    assert argv == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=h:1", "--rdzv-id=id", "--max-restarts=3", "-m", "shardlm",
                    "train", "c.toml", "--train.steps=1"]


def test_ray_script_runs_the_config_on_n_times_g_workers(capsys, tmp_path):
    """The Ray target is a Python script: it parses, imports the entry, and carries the train
    arguments (run.name fixed, so a restarted worker group finds the run), N x G workers and the
    restarts; it is what --out wrote. The run itself: tests/test_ray.py."""
    import ast

    out_file = tmp_path / "job.py"
    code, out, _ = launch(capsys, "--target", "ray", "--nodes", "2", "--gpus-per-node", "4",
                          "--max-restarts", "3", "--out", str(out_file))
    assert code == 0 and out_file.read_text() == out and out.startswith("#!/usr/bin/env python3")
    values = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(out).body
              if isinstance(n, ast.Assign)}
    assert values == {"TRAIN_ARGS": [CONFIG, *OVERRIDES, "--run.name=job1"], "NUM_WORKERS": 8,
                      "MAX_FAILURES": 3}
    assert "from shardlm.integrations.ray import fit" in out.splitlines() and "world size 8" in out


def test_ray_submit_runs_the_script_or_says_what_to_install(capsys, tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # absent, even if installed
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    code, out, err = launch(capsys, "--target", "ray", "--nodes", "1", "--gpus-per-node", "2", "--submit")
    assert code == 2 and "pip install 'shardlm[ray]'" in err and out == ""
    monkeypatch.undo()
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: ran.append(argv) or subprocess.CompletedProcess(argv, 0))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    out_file = tmp_path / "job.py"
    code, _, err = launch(capsys, "--target", "ray", "--nodes", "1", "--gpus-per-node", "2", "--submit",
                          "--out", str(out_file))
    assert code == 0 and ran == [[sys.executable, str(out_file)]] and "Ray Train run finished" in err
