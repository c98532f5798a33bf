"""Shared fixtures: one token cache per test session, and tiny configs; the perturbed mode.

SHARDLM_TEST_PERTURB=1 runs the tests as a different CPU would, without changing the maths:
each rank and each one-process reference gets another thread count (twice this machine's
cores divided among the ranks, through SHARDLM_CPU_CORES, which init_runtime reads), so
kernels that split a reduction by thread cut it elsewhere; and ATen's vectorised kernels run
at one capability below this CPU's (AVX-512 -> AVX2, AVX2 -> scalar), so vector widths, loop
tails and the order of vectorised sums change. A claim of bitwise equality that holds only by
the luck of one machine's rounding fails here; one the arithmetic guarantees (the same
operations on the same operands in both runs) does not. `.ci/run` runs test_zero.py and
test_global_loss.py so after the suite; any file runs so with the variable set.
"""

import os


def _machine_cores() -> int:
    """The cores this process may run on (launch/runtime.py cpu_cores without its override: read
    here before torch is imported)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _perturb() -> None:
    """Set before torch is imported: ATen reads its capability once; ranks inherit both."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        pass
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2" if "avx512f" in flags else "default")
    os.environ.setdefault("SHARDLM_CPU_CORES", str(2 * _machine_cores()))


PERTURBED = os.environ.get("SHARDLM_TEST_PERTURB", "") not in ("", "0")
if PERTURBED:
    _perturb()


# The suite runs on one pytest-xdist worker per core (pyproject: `-n auto --dist loadfile`): a
# test's time is much of it processes starting, importing torch or waiting on a peer, which the
# other worker's computing fills (on 2 cores: 25.8 -> 22.2 min with more tests; both cores then
# busy through the test phase). Each worker owns its share of the cores: its ranks
# divide that share (SHARDLM_CPU_CORES, read by launch/runtime.py cpu_cores) and its own torch
# threads are that many, so two workers never run twice the machine's threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if WORKERS > 1:
    os.environ.setdefault("SHARDLM_CPU_CORES", str(max(1, _machine_cores() // WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

# oneDNN picks bf16 kernels by ISA, and on AMX CPUs its blocking (and so the rounding of a
# reduction) can follow the thread count: the parity tests compare a 2-rank run (1 thread
# each) with a 1-process reference, so every process takes the same non-AMX path. Set before
# torch loads oneDNN; spawned ranks inherit it. A no-op on CPUs without AMX.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


if WORKERS > 1:
    torch.set_num_threads(int(os.environ["SHARDLM_CPU_CORES"]))

# Read before any test hides the GPUs below: whether this machine can run the `cuda` lane.
HAS_CUDA = torch.cuda.is_available()

# The files that take longest (a module's spawned world, several launches), measured on a
# 2-core machine: handed to the workers first, so none starts last and keeps one worker busy
# after the other has finished (longest first). Order only: a file missing here runs after them.
LONGEST_FIRST = ("test_fault_tolerant.py", "test_multinode.py", "test_study.py", "test_faults.py",
                 "test_restart.py", "test_compile.py", "test_checkpoint.py", "test_offload.py",
                 "test_allocator.py", "test_zero.py", "test_damaged_inputs.py", "test_dry_run.py",
                 "test_exit_stress.py", "test_pipeline.py", "test_tensor_parallel.py",
                 "test_watchdog.py", "test_fp8_all_gather.py", "test_ray.py", "test_attention.py",
                 "test_hf_models.py", "test_async_tp.py")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (measured at 2; more workers also multiply the
    memory of the ranks their tests start at once)."""
    return max(1, min(4, _machine_cores()))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped with 'no CUDA device' "
                                       "where there is none; bench/gpu_check.py runs them)")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's order kept
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


@pytest.fixture(autouse=True)
def cpu_unless_cuda(request, monkeypatch):
    """Every test not marked `cuda` runs on the CPU on every machine: it and the ranks it spawns
    see no GPU (run.device = 'auto' means the CPU; two spawned ranks are never mapped to one
    GPU), so the CPU suite means the same on a GPU machine as in CI."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Tokenizers and token shards go to one fresh cache per session (per xdist worker), so
    tests never depend on (or pollute) the user's ~/.cache/shardlm. The CPU probe goes to one
    fresh file per pytest run, shared by its workers ($SHARDLM_PROBE_CACHE in the run's base
    temporary directory, which xdist's workers' own lie in): the machine is measured once a run
    (~50 s of CPU for 1 and 2 ranks, ~50 s more for 4), not once a worker; a worker missing an
    entry the other is measuring waits for it (hardware/probe.py _measuring). The whole cache
    is not shared: a worker building a dataset deletes the `*.tmp.*` files in its cache
    directory, another worker's half-written shard included. A test that injects timings or
    damages the probe's file uses a cache of its own: private_cache."""
    path = tmp_path_factory.mktemp("shardlm-cache")
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # <run's base>/<worker id>
        run_dir = run_dir.parent
    mp = pytest.MonkeyPatch()
    mp.setenv("SHARDLM_CACHE", str(path))
    mp.setenv("SHARDLM_PROBE_CACHE", str(run_dir / "hardware_probe.json"))
    yield path
    mp.undo()


def private_cache(monkeypatch, path):
    """Point this test (and what it spawns) at a shardlm cache of its own, the probe's file
    included: for a test that injects timings (they would reach every later test's planner
    through the run's shared probe file) or damages that file. Returns `path`."""
    monkeypatch.setenv("SHARDLM_CACHE", str(path))
    monkeypatch.delenv("SHARDLM_PROBE_CACHE", raising=False)
    return path


def tiny_overrides(tmp_path, **extra) -> dict:
    """A seconds-long run on a slice of the default stdlib corpus, on the CPU, in fp32 unless a
    test says otherwise: 'auto' would follow the machine (bf16 where it is faster, a GPU where
    there is one), and a test pins what it claims."""
    overrides = {"model.preset": "gpt-tiny", "precision.compute": "fp32", "run.device": "cpu",
                 "train.seq_len": 64,
                 "train.micro_batch": 8,
                 "train.steps": 10, "train.warmup_steps": 2, "train.eval_every": 0,
                 "train.eval_batches": 2, "train.sample_tokens": 0, "data.max_bytes": 1_000_000,
                 "run.dir": str(tmp_path / "runs"), "run.progress": "off"}
    overrides.update({k.replace("__", "."): v for k, v in extra.items()})
    return overrides


@pytest.fixture(scope="session")
def two_rank_cli_run(tmp_path_factory):
    """One `shardlm train --nproc 2` run (tests/cli_runs.py) for every test that checks what
    such a run does: one launcher and two workers started, not one set per test."""
    from cli_runs import two_rank_run

    return two_rank_run(tmp_path_factory.mktemp("two-rank-cli"))
