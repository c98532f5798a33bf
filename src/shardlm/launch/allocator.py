"""The C heap's policy in a training process: glibc malloc's mmap threshold, fixed once at worker
start-up, before any large allocation. The one place that sets it: `shardlm train` calls
`apply_malloc_policy` in every process that trains (each rank of `--nproc N`, of your own
`torchrun ... -m shardlm train`, or the single process); the benchmarks call the same function.

Why. glibc serves a request below its mmap threshold from a heap (an arena) and keeps freed
memory there for reuse. By default the threshold is dynamic: 128 KiB at start, raised to the size
of any mmapped block that is freed (up to 32 MiB), with the trim threshold at twice that. After the
first large free, the multi-MiB temporaries of training (a unit's gathered parameters and
gradients, the NVMe tier's staging chunks, the optimizer's pieces) come from heaps, where
fragmentation keeps freed memory resident: gpt2-774m at ZeRO-3 with parameters and optimizer on
NVMe peaked at 3.42 GiB per rank this way, 2.58 GiB with the threshold fixed (docs/benchmarks.md).
A fixed threshold (mallopt(M_MMAP_THRESHOLD), which also stops the dynamic rise), with the trim
threshold back at glibc's default, serves every block of at least that size by mmap and returns it
to the OS when freed: resident memory follows the bytes alive. It is the same as starting the
process with MALLOC_MMAP_THRESHOLD_ set, which glibc reads at start-up.

Precedence (docs/allocator.md): the user's environment first. If MALLOC_MMAP_THRESHOLD_ (or
glibc.malloc.mmap_threshold in GLIBC_TUNABLES) is set, glibc applied it at start-up and nothing is
changed. Otherwise run.malloc_mmap_threshold (bytes; default 8 MiB; 0 = leave glibc's dynamic
default alone). Off glibc (macOS, musl) it is a no-op, and the returned policy says why.

Why 8 MiB and not glibc's initial 128 KiB (the default until 2026-11-29): every block at or
above the threshold is a fresh mapping whose pages fault in zeroed on first touch and are
unmapped on free. A training step allocates its activations anew each micro-batch; at 128 KiB
every one of them paid that (the planner's "fresh memory" term: 37% of gpt-mini's step on one
rank, measured and predicted; ~45% of a LoRA step of a 135M checkpoint). At 8 MiB the activations
of small and medium micro-batches come from the heap, reused step after step, while the
multi-MiB temporaries the policy is for (gathered units, flat gradient buffers, NVMe staging
chunks, the logits) stay mapped and go back to the OS when freed (docs/allocator.md).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

DEFAULT_THRESHOLD = 8 * 1024 * 1024
"""run.malloc_mmap_threshold's default (the module's docstring says why)."""
MAX_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); mallopt refuses more."""
PROBE_BYTES = 16 * 2**20
"""threshold_in_effect's block: below glibc's 32 MiB ceiling, above any threshold it can read back."""
_TRIM_DEFAULT = 128 * 1024  # glibc's DEFAULT_TRIM_THRESHOLD, which the dynamic rise may have raised
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
ENV_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
ENV_TUNABLES = "GLIBC_TUNABLES"


@dataclass(frozen=True)
class MallocPolicy:
    """What start-up did about the allocator, for the log."""
    source: str
    """'config' (we called mallopt), 'environment' (the user's setting, left as is), 'off'
    (run.malloc_mmap_threshold = 0) or 'unsupported' (not glibc, or mallopt refused)."""
    threshold: int | None
    """The fixed mmap threshold in bytes in effect by our call or the user's variable; None:
    glibc's dynamic default (or an allocator we do not manage)."""
    reason: str

    def __str__(self) -> str:
        return f"malloc: {self.reason}"

    def report(self) -> str:
        """The log line: str(self), and where a fixed threshold is claimed (up to the probe's
        16 MiB), whether this process reads it back as in effect (threshold_in_effect)."""
        if self.threshold is None or not 0 < self.threshold <= PROBE_BYTES:
            return str(self)
        return f"{self}; read back: {'in effect' if threshold_in_effect() else 'NOT in effect'}"


_applied: MallocPolicy | None = None


def user_setting(environ: os._Environ | dict | None = None) -> str | None:
    """The user's own mmap-threshold setting in the environment (glibc reads it at start-up), as
    'NAME=value', or None."""
    env = os.environ if environ is None else environ
    if env.get(ENV_THRESHOLD):
        return f"{ENV_THRESHOLD}={env[ENV_THRESHOLD]}"
    for item in env.get(ENV_TUNABLES, "").replace(":", " ").split():
        if item.startswith("glibc.malloc.mmap_threshold="):
            return f"{ENV_TUNABLES}={item}"
    return None


def planned_threshold(threshold: int = DEFAULT_THRESHOLD, environ: os._Environ | dict | None = None) -> int:
    """The mmap threshold a training process started now will run with, for the planner (its
    fresh-memory term): the environment's value where the user set one (it wins, as in
    apply_malloc_policy), else `threshold` (run.malloc_mmap_threshold); glibc's dynamic
    threshold (0, or a setting it cannot read) as the 32 MiB it rises to after the first large
    free."""
    env = user_setting(environ)
    value = _env_threshold(env) if env is not None else threshold
    return value if value and 0 < value <= MAX_THRESHOLD else MAX_THRESHOLD


def glibc_version() -> str | None:
    """'glibc 2.36' where this process runs on glibc, else None."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or None
    except (AttributeError, ValueError, OSError):  # not Linux, or a libc without the name (musl)
        return None


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the process's own symbols: glibc's malloc, not a second copy


def apply_malloc_policy(threshold: int = DEFAULT_THRESHOLD) -> MallocPolicy:
    """Fix glibc's mmap threshold at `threshold` bytes (run.malloc_mmap_threshold) unless the
    user's environment set it; call before large allocations. Idempotent per process: the first
    call decides, later calls return its result."""
    global _applied
    if _applied is not None:
        return _applied
    env = user_setting()
    version = glibc_version()
    if env is not None:
        policy = MallocPolicy("environment", _env_threshold(env), f"{env} from the environment (it takes "
                              f"precedence over run.malloc_mmap_threshold; glibc applied it at start-up)")
    elif threshold == 0:
        policy = MallocPolicy("off", None, "run.malloc_mmap_threshold = 0: glibc's dynamic mmap "
                              "threshold left as it is")
    elif version is None:
        policy = MallocPolicy("unsupported", None, "not glibc: run.malloc_mmap_threshold has no effect "
                              "here (mallopt(M_MMAP_THRESHOLD) is glibc's); the allocator is left as it is")
    else:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold))
        if ok:  # the dynamic rise may have lifted the trim threshold before this call: put it
            # back, and give the heap's free top back now (else a large block could still be cut
            # from what the heap kept before this call)
            libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_TRIM_DEFAULT))
            libc.malloc_trim(ctypes.c_size_t(0))
            policy = MallocPolicy("config", threshold, f"mmap threshold fixed at {threshold:,} bytes "
                                  f"(mallopt, {version}; run.malloc_mmap_threshold): blocks this large "
                                  f"go back to the OS when freed")
        else:
            policy = MallocPolicy("unsupported", None, f"{version} refused mallopt(M_MMAP_THRESHOLD, "
                                  f"{threshold}); glibc's dynamic threshold left as it is")
    _applied = policy
    return policy


def _env_threshold(setting: str) -> int | None:
    value = setting.rpartition("=")[2]
    try:
        return int(value, 0)
    except ValueError:
        return None


def mmapped_block_count() -> int | None:
    """glibc's count of blocks currently served by mmap (mallinfo2().hblks), or None off glibc."""
    if glibc_version() is None:
        return None
    libc = _libc()
    fields = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                   "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
        class Info(ctypes.Structure):
            _fields_ = fields
        libc.mallinfo2.restype = Info
        return int(libc.mallinfo2().hblks)
    class OldInfo(ctypes.Structure):  # noqa: E306  the int fields of mallinfo (older glibc)
        _fields_ = [(name, ctypes.c_int) for name, _ in fields]
    libc.mallinfo.restype = OldInfo
    return int(libc.mallinfo().hblks)


def threshold_in_effect(probe: int = PROBE_BYTES) -> bool | None:
    """Whether a `probe`-byte block (below glibc's 32 MiB ceiling) is served by mmap after a
    larger mmapped block was freed: True with a fixed threshold <= probe; False under glibc's
    dynamic default (freeing the larger block raised the threshold above probe, so the probe comes
    from the heap). None off glibc. A read-back for tests and the log, not a measurement."""
    if glibc_version() is None:
        return None
    libc = _libc()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(ctypes.c_size_t(probe + probe // 2)))  # dynamic: threshold -> 24 MiB
    before = mmapped_block_count()
    block = libc.malloc(ctypes.c_size_t(probe))
    try:
        return mmapped_block_count() == before + 1
    finally:
        libc.free(block)


# ---------------------------------------------------------------------------------------------
# Host memory for copies to and from a GPU


_PINNED_REFUSED: list[str] = []
"""Why page-locked memory was last refused in this process (empty: never)."""


def host_tensor(shape, dtype, pinned: bool, stride=None):
    """An uninitialised host tensor for device copies: page-locked where `pinned` (what makes a
    copy asynchronous and fast), else pageable. If the OS refuses page-locked memory (ulimit -l,
    a container's memlock limit, the host out of it) the tensor is pageable instead, said once per
    process: copies are then synchronous, so slower, never wrong — every reader of a
    non-blocking copy synchronises first."""
    import logging

    import torch

    make = (lambda pin: torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pin)) \
        if stride is not None else (lambda pin: torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin))
    if pinned:
        try:
            return make(True)
        except RuntimeError as e:
            if not _PINNED_REFUSED:
                logging.getLogger("shardlm").warning(
                    "shardlm: page-locked host memory refused (%s): using pageable memory, so host "
                    "<-> device copies are synchronous and slower. Raise the memlock limit "
                    "(ulimit -l) or offload less.", str(e).splitlines()[0])
            _PINNED_REFUSED[:] = [str(e).splitlines()[0]]
    return make(False)
