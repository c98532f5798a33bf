"""`shardlm launch --target trainjob | skypilot`: each spec passes its owner's vendored schema
(Kubeflow Trainer v2.3.0's CRDs, SkyPilot 0.14.1's task schema) and a broken one fails it; the
torchrun line and rendezvous are the other targets'; the SkyPilot run script, run by bash with a
stand-in torchrun, finds the head node and checks the cluster's shape (docs/launch.md)."""

import copy
import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from shardlm.cli.main import main
from shardlm.errors import ConfigError
from shardlm.launch import skypilot, trainjob
from shardlm.launch.schema_check import schema_errors, skypilot_errors, trainer_errors
from shardlm.launch.spec import LaunchSpec
from shardlm.launch.targets import render, validate_text
from shardlm.launch.torchrun import torchrun_argv
from test_launch_targets import fake_tool

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "gpt2-124m.toml")
OVERRIDES = ["--train.steps=100", "--parallel.zero_stage=3"]
TRAIN_ARGS = [CONFIG, *OVERRIDES, "--run.name=job1", "--run.dir=/runs"]


def launch(capsys, *args: str, config: str = CONFIG) -> tuple[int, str, str]:
    code = main(["launch", *args, "--job-name=job1", config, *OVERRIDES])
    out, err = capsys.readouterr()
    return code, out, err


def documents(text: str) -> list:
    if text.startswith("{"):
        tree = json.loads(text)
        return tree["items"] if tree.get("kind") == "List" else [tree]
    import yaml

    return list(yaml.safe_load_all(text))


def the_line(nodes: int, per_node: int, endpoint: str, max_restarts: int = 0) -> list[str]:
    """What every target runs on a node: torchrun_argv with the target's endpoint."""
    return torchrun_argv(nodes, per_node, endpoint, TRAIN_ARGS, "job1", max_restarts)


# -- trainjob -----------------------------------------------------------------------------------


def test_trainjob_on_the_stock_runtime(capsys):
    code, out, _ = launch(capsys, "--target", "trainjob", "--nodes", "3", "--gpus-per-node", "8",
                          "--image", "registry.example/shardlm:1")
    assert code == 0
    [job] = documents(out)
    assert trainer_errors(job) == []
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                         "kind": "ClusterTrainingRuntime"}
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (3, 8)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    assert trainer["image"] == "registry.example/shardlm:1"
    # the Trainer's torch plugin sets PET_MASTER_ADDR/PORT (the first pod, port 29500) in the container
    assert trainer["command"] == the_line(3, 8, "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)")
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node"
    assert pod["volumes"] == [{"name": "runs", "persistentVolumeClaim": {"claimName": "shardlm-runs"}}]
    assert pod["containers"] == [{"name": "node", "volumeMounts": [{"name": "runs", "mountPath": "/runs"}]}]


def test_trainjob_with_its_runtime_as_json(capsys):
    code, out, _ = launch(capsys, "--target", "trainjob", "--runtime", "--json", "--max-restarts", "2",
                          "--volume", "ckpt", "--nodes", "2", "--gpus-per-node", "4", "--image", "img")
    assert code == 0 and json.loads(out)["kind"] == "List"
    runtime, job = documents(out)
    assert [trainer_errors(d) for d in (runtime, job)] == [[], []]
    assert runtime["kind"] == "ClusterTrainingRuntime" and job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    # v2.2+ fields: no numProcPerNode or elasticPolicy in the torch policy (the TrainJob says G)
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"] == {"maxRestarts": 2}
    [node] = jobset["replicatedJobs"]
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert node["template"]["spec"]["template"]["spec"]["containers"] == [{"name": "node", "image": "img"}]
    assert job["spec"]["trainer"]["command"] == the_line(2, 4, "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", 2)
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "ckpt"}


def _spec(target: str, **kw) -> LaunchSpec:
    defaults = {"trainjob": {"image": "img", "volume": "shardlm-runs", "runtime": True},
                "skypilot": {"accelerator": "A100", "bucket": "job1-runs", "install": "."}}[target]
    return LaunchSpec(target, 2, 8, list(TRAIN_ARGS), "job1", **{**defaults, **kw})


@pytest.mark.parametrize("index,breakage,found", [
    (1, lambda d: d["spec"].pop("runtimeRef"), "missing required field 'runtimeRef'"),
    (1, lambda d: d["spec"]["trainer"].update(numNodes="2"), "numNodes: str '2', expected integer"),
    (1, lambda d: d["metadata"].update(name="1job"), "does not match"),
    (1, lambda d: d["spec"]["trainer"]["resourcesPerNode"]["limits"].update({"nvidia.com/gpu": "eight"}),
     "does not match"),
    (1, lambda d: d["spec"]["trainer"].update(numProcPerNodes=8), "unknown field 'numProcPerNodes'"),
    (0, lambda d: d["spec"]["mlPolicy"]["torch"].update(numProcPerNode=8), "unknown field 'numProcPerNode'"),
    (0, lambda d: d["spec"]["mlPolicy"]["torch"].update(elasticPolicy={"maxNodes": 2}), "unknown field 'elasticPolicy'"),
    (0, lambda d: d["spec"]["template"]["spec"]["replicatedJobs"][0].pop("template"), "missing required field 'template'"),
    (0, lambda d: d.update(kind="TrainingRuntime"), "is not one of"),
])
def test_a_broken_trainjob_fails_the_crd_schema(index, breakage, found):
    docs = trainjob.trainjob_docs(_spec("trainjob"))
    assert [trainer_errors(d) for d in docs] == [[], []]
    broken = copy.deepcopy(docs)
    breakage(broken[index])
    errors = trainer_errors(broken[index])
    assert any(found in e for e in errors), errors
    assert trainjob.problems(_spec("trainjob"), broken)  # and so does the whole check


def test_a_broken_generated_text_is_a_bug_report():
    spec = _spec("trainjob", runtime=False)
    text = render(spec)
    validate_text(spec, text)
    with pytest.raises(ConfigError, match="not valid.*numNodes"):
        validate_text(spec, text.replace("numNodes: 2", "numNodes: two"))


def test_trainjob_names_and_image_are_checked(capsys):
    code, _, err = launch(capsys, "--target", "trainjob", "--nodes", "2", "--gpus-per-node", "2")
    assert code == 2 and "--image" in err
    code = main(["launch", "--target", "trainjob", "--nodes", "2", "--gpus-per-node", "2", "--image", "i",
                 "--job-name=9job", CONFIG])
    assert code == 2 and "starts with a letter" in capsys.readouterr().err


# -- skypilot -----------------------------------------------------------------------------------


def test_skypilot_task(capsys):
    code, out, _ = launch(capsys, "--target", "skypilot", "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0
    [task] = documents(out)
    assert skypilot_errors(task) == []
    assert (task["name"], task["num_nodes"], task["resources"]) == ("job1", 2, {"accelerators": "A100:8"})
    assert task["setup"] == "pip install ." and task["workdir"] == "."
    assert task["file_mounts"] == {"/runs": {"name": "job1-runs", "mode": "MOUNT_CACHED", "persistent": True}}
    lines = task["run"].splitlines()
    assert lines[0] == 'head_node=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)'
    words = shlex.split(lines[-1])
    assert words[0] == "exec"
    line = the_line(2, 8, "$head_node:29500")
    line.insert(line.index("--rdzv-endpoint=$head_node:29500") + 1, "--rdzv-conf=is_host=$is_host")
    assert words[1:] == line


def test_skypilot_with_an_image_and_options(capsys):
    code, out, _ = launch(capsys, "--target", "skypilot", "--nodes", "4", "--gpus-per-node", "8",
                          "--image", "ghcr.io/x/shardlm:1", "--accelerator", "H100", "--bucket", "my-ckpts")
    assert code == 0
    [task] = documents(out)
    assert skypilot_errors(task) == [] and "setup" not in task  # the image has shardlm
    assert task["resources"] == {"accelerators": "H100:8", "image_id": "docker:ghcr.io/x/shardlm:1"}
    assert task["file_mounts"]["/runs"]["name"] == "my-ckpts"
    code, out, _ = launch(capsys, "--target", "skypilot", "--nodes", "1", "--gpus-per-node", "1", "--json",
                          "--install", "shardlm[hf] @ git+https://example.org/shardlm", "--volume", "shared-fs")
    assert code == 0
    task = json.loads(out)
    assert skypilot_errors(task) == [] and "file_mounts" not in task
    assert task["setup"] == "pip install 'shardlm[hf] @ git+https://example.org/shardlm'"
    assert task["volumes"] == {"/runs": "shared-fs"}  # a SkyPilot volume instead of the bucket
    code, out, err = launch(capsys, "--target", "skypilot", "--nodes", "1", "--gpus-per-node", "1",
                            "--volume", "v", "--bucket", "b")
    assert code == 2 and out == "" and "give one" in err


@pytest.mark.parametrize("breakage,found", [
    (lambda t: t.update(num_nodes="2"), "num_nodes: str '2', expected integer"),
    (lambda t: t.update(nodes=2), "unknown field 'nodes'"),
    (lambda t: t["resources"].update(accelerators=8), "matches none of anyOf"),
    (lambda t: t["resources"].update(gpus="A100:8"), "unknown field 'gpus'"),
    (lambda t: t["file_mounts"]["/runs"].update(mode="MOUNTED"), "is not one of"),
    (lambda t: t.update(run=["torchrun"]), "run: list"),
    (lambda t: t.update(envs={"1BAD": "x"}), "unknown field '1BAD'"),
])
def test_a_broken_skypilot_task_fails_its_schema(breakage, found):
    task = skypilot.skypilot_task(_spec("skypilot"))
    assert skypilot_errors(task) == []
    breakage(task)
    errors = skypilot_errors(task)
    assert any(found in e for e in errors), errors


RANKS = {"SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9\n", "SKYPILOT_NUM_NODES": "2"}


@pytest.mark.parametrize("rank,gpus", [(0, 8), (1, 8), (1, 4)])
def test_the_run_script_finds_the_head_node(tmp_path, rank, gpus):
    """The run script under bash, as SkyPilot runs it on each node, with a torchrun that prints
    its arguments: the head node is SKYPILOT_NODE_IPS' first line, rank 0 hosts the store; a
    cluster of another shape stops before torchrun."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, **RANKS, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus)}
    done = subprocess.run(["bash", "-c", skypilot.run_script(_spec("skypilot"))], env=env,
                          capture_output=True, text=True, timeout=60)
    if gpus != 8:
        assert done.returncode == 1 and "the job was checked for 2 x 8" in done.stderr and not done.stdout
        return
    assert done.returncode == 0, done.stderr
    line = the_line(2, 8, "10.0.0.7:29500")
    line.insert(line.index("--rdzv-endpoint=10.0.0.7:29500") + 1, f"--rdzv-conf=is_host={int(rank == 0)}")
    assert done.stdout.splitlines() == line[1:]


# -- both ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["trainjob", "skypilot"])
def test_the_run_directory_is_on_the_volume(capsys, tmp_path, target):
    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "gpt2-124m"\n[run]\ndir = "/mnt/ckpt"\n')
    code, out, _ = launch(capsys, "--target", target, "--nodes", "1", "--gpus-per-node", "1",
                          "--image", "img", config=str(config))
    assert code == 0 and "--run.dir=" not in out and "/mnt/ckpt" in out  # mounted where it is
    config.write_text('[model]\npreset = "gpt2-124m"\n[run]\ndir = "ckpt"\n')
    code, out, err = launch(capsys, "--target", target, "--nodes", "1", "--gpus-per-node", "1",
                            "--image", "img", config=str(config))
    assert code == 2 and out == "" and "give an absolute run.dir" in err


@pytest.mark.parametrize("target,option", [("k8s", "--volume=c"), ("trainjob", "--bucket=b"),
                                           ("skypilot", "--runtime"), ("slurm", "--accelerator=A100"),
                                           ("vertex", "--install=.")])
def test_an_option_of_another_target_is_refused(capsys, target, option):
    code, out, err = launch(capsys, "--target", target, "--nodes", "2", "--gpus-per-node", "8",
                            "--image", "img", option)
    assert code == 2 and out == "" and f"{option.split('=')[0]} is for --target" in err


@pytest.mark.parametrize("target,tool,words", [("trainjob", "kubectl", ["create", "-f"]),
                                               ("skypilot", "sky", ["jobs", "launch", "--yes", "--name", "job1"])])
def test_submit(capsys, tmp_path, monkeypatch, target, tool, words):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    code, out, err = launch(capsys, "--target", target, "--nodes", "2", "--gpus-per-node", "4",
                            "--image", "img", "--submit")
    assert code == 2 and f"--submit needs `{tool}` on PATH" in err and out == ""
    fake_tool(tmp_path, monkeypatch, tool)
    out_file = tmp_path / "job.yaml"
    code, _, err = launch(capsys, "--target", target, "--nodes", "2", "--gpus-per-node", "4",
                          "--image", "img", "--submit", "--out", str(out_file))
    assert code == 0 and "submitted" in err
    assert (tmp_path / "called").read_text().split() == [*words, str(out_file)]


def test_the_checker_follows_json_schema():
    """The subset of JSON Schema the vendored files use, on small cases of its own."""
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 1},
                             "b": {"anyOf": [{"type": "string", "pattern": "^x"}, {"type": "null"}]},
                             "c": {"type": "array", "items": {"case_insensitive_enum": ["MOUNT"]}, "maxItems": 2}}}
    assert schema_errors({"a": 1, "b": "xy", "c": ["mount"]}, schema) == []
    assert schema_errors({"a": True}, schema) == ["$.a: bool True, expected integer"]  # bool is no integer
    assert len(schema_errors({"a": 0, "b": "y", "c": ["COPY", 1, 2], "d": 1}, schema)) == 5
    assert schema_errors({}, {"type": "object", "properties": {}}) == []  # JSON Schema: open by default
    assert schema_errors({"x": 1}, {"type": "object", "properties": {}}, closed=True)  # Kubernetes: closed
    assert schema_errors({"x": 1}, {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                         closed=True) == []
