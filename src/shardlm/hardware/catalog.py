"""The hardware catalog: devices, links, nodes, and the cluster syntax `[NODES x] COUNT x DEVICE`.

Every number is a published nominal value with its source, or an assumption said to be one.
Units: bytes, bytes/s (1 GB/s = 1e9 B/s; network Gb/s are divided by 8), FLOP/s, seconds.
Peak FLOP/s are *dense* (no 2:4 sparsity). "fp32" is true fp32, not TF32: PyTorch keeps TF32
off for matmuls by default (`torch.backends.cuda.matmul.allow_tf32 = False` since 1.12).

"This CPU" is not in the table: `local_cpu(n_ranks)` describes it from hardware/probe.py's
measurements (matmul peak per precision at the per-rank thread count, memory bandwidth, gloo
latency and bandwidth between two local ranks, a worker's baseline RSS), taken once per machine,
cached, and only when a user asks for them. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace

from shardlm.errors import ConfigError
from shardlm.hardware.machine import (at_least_one_thread, available_memory, cpu_bf16_gemm, cpu_share, local_disk,
                                      local_disk_lone)
from shardlm.hardware.curves import (MatmulCurve, describe_memory_rates, intensity, interpolate,  # noqa: F401 (re-exported)
                                     measured_curve)
from shardlm.hardware.prices import GRID_DEFAULT, PRICES, PUE_DEFAULT, Price, find_price  # noqa: F401 (re-exported)

MIB = 2**20


@dataclass(frozen=True)
class Link:
    """A point-to-point or switched connection, per endpoint and direction."""

    name: str
    bandwidth: float
    """Nominal bytes/s one endpoint can send (one direction)."""
    latency: float
    """Seconds per message step (the alpha of the alpha-beta model), software included."""
    efficiency: float
    """Fraction of `bandwidth` collectives reach (NCCL's "bus bandwidth" / nominal)."""
    source: str

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


# Efficiencies: nccl-tests all_reduce bus bandwidth over nominal — NVLink ~0.75-0.8 (A100 DGX
# ~230 of 300 GB/s), InfiniBand ~0.9 (HDR ~23 of 25 GB/s), PCIe ~0.8 (~12-13 of 15.75 GB/s on
# gen3), TCP Ethernet ~0.7. Latencies are NCCL-level assumptions, not wire latencies; they
# matter only for small messages.
LINKS: dict[str, Link] = {l.name: l for l in (
    Link("pcie3", 15.75e9, 5e-6, 0.8, "PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b"),
    Link("pcie4", 31.5e9, 5e-6, 0.8, "PCIe 4.0 x16: 16 GT/s x 16 lanes"),
    Link("pcie5", 63.0e9, 5e-6, 0.8, "PCIe 5.0 x16: 32 GT/s x 16 lanes"),
    Link("nvlink2", 150e9, 3e-6, 0.75, "V100 SXM2: 6 NVLink2 links x 25 GB/s per direction "
         "(300 GB/s bidirectional; V100 datasheet)"),
    Link("nvlink3", 300e9, 3e-6, 0.75, "A100 SXM4: 12 NVLink3 links x 25 GB/s per direction "
         "(600 GB/s bidirectional; A100 datasheet)"),
    Link("nvlink4", 450e9, 3e-6, 0.75, "H100/H200 SXM: 18 NVLink4 links x 25 GB/s per direction "
         "(900 GB/s bidirectional; H100 datasheet)"),
    Link("infinity-fabric", 100e9, 3e-6, 0.7, "MI250X GCD-to-GCD Infinity Fabric: 50 GB/s per "
         "link per direction, 2 links assumed on a ring path (AMD CDNA2 white paper)"),
    Link("ici-v4", 100e9, 3e-6, 0.8, "TPU v4 inter-chip interconnect, one torus dimension "
         "(Jouppi et al. 2023); approximate"),
    Link("ib-edr", _gbit(100), 5e-6, 0.9, "InfiniBand EDR 100 Gb/s per adapter"),
    Link("ib-hdr", _gbit(200), 5e-6, 0.9, "InfiniBand HDR 200 Gb/s per adapter"),
    Link("ib-ndr", _gbit(400), 5e-6, 0.9, "InfiniBand NDR 400 Gb/s per adapter"),
    Link("roce-100", _gbit(100), 8e-6, 0.85, "RoCE v2 100 GbE per adapter"),
    Link("roce-200", _gbit(200), 8e-6, 0.85, "RoCE v2 200 GbE per adapter"),
    Link("roce-400", _gbit(400), 8e-6, 0.85, "RoCE v2 400 GbE per adapter"),
    Link("slingshot-200", _gbit(200), 5e-6, 0.85, "HPE Slingshot-11 200 Gb/s per adapter (Frontier)"),
    Link("eth-10", _gbit(10), 30e-6, 0.7, "10 GbE, TCP"),
    Link("eth-25", _gbit(25), 30e-6, 0.7, "25 GbE, TCP"),
    Link("eth-100", _gbit(100), 30e-6, 0.7, "100 GbE, TCP"),
)}


@dataclass(frozen=True)
class Device:
    name: str
    kind: str
    """'cuda', 'rocm', 'tpu' or 'cpu': decides runtime reserve, autocast policy, calibration."""
    memory: float
    """Bytes the device reports (nvidia-smi's total), before the runtime's own reserve."""
    peak: dict[str, float]
    """Dense FLOP/s per compute dtype; a missing dtype is not supported by the hardware."""
    memory_bandwidth: float
    efficiency: float
    """Fraction of `peak` our transformer matmuls reach (docs/planner.md, "Efficiency")."""
    source: str
    power: float | None = None
    """Board power in W (the vendor's TDP / max power), for energy estimates; None: unknown."""
    curves: dict[str, MatmulCurve] = field(default_factory=dict)
    """Measured matmul rates per precision (this CPU: the probe's and `shardlm calibrate`'s);
    where a precision has one, the time model reads it and `efficiency` is not used."""
    op_seconds: float = 0.0
    """Seconds per dispatched op, forward ones and backward ones alike (eager PyTorch: the call,
    autograd's recording, its backward node), measured on this CPU (probe.memory_probe).
    0 for the catalog's GPUs: their kernels launch asynchronously, ahead of the device, so the
    host's dispatch hides behind the kernels (an assumption, stated in docs/planner.md)."""
    fresh_bandwidth: float = 0.0
    """Bytes/s of writing freshly mapped memory (page faults, the kernel's zeroing, the unmap):
    on a CPU every block above glibc's fixed mmap threshold (a training process's, docs/
    allocator.md) is mapped anew at each allocation; measured. 0 = allocations are reused
    (CUDA's caching allocator): no cost."""
    memory_source: str = ""
    """Where op_seconds, fresh_bandwidth and the curves below came from (describe_memory_rates),
    '' where nothing was measured."""
    bandwidth_curve: tuple[tuple[float, float], ...] = ()
    """(tensor bytes, read + write bytes/s of element-wise ops) measured on this CPU from
    cache-sized to DRAM-sized tensors (probe.memory_probe); () = memory_bandwidth at every size."""
    passes: tuple[tuple[str, float], ...] = ()
    """(planner.in_situ.pass_key, seconds) of whole-model forward + loss + backward passes
    `shardlm calibrate` timed on this CPU at a rank's threads (train/calibration.py), time-
    shared as the ranks are; () for the catalog's devices."""
    adamw_curve: tuple[tuple[float, float], ...] = ()
    """(parameters, seconds per parameter) of torch's fused AdamW measured on this CPU; () = its
    bytes over memory_bandwidth (planner/memory_bound.py)."""

    def bandwidth_at(self, nbytes: float) -> float:
        """Read + write bytes/s of element-wise work on buffers of `nbytes` (the measured curve,
        log-linear between its points, clamped to its ends)."""
        return interpolate(self.bandwidth_curve, nbytes) if self.bandwidth_curve else self.memory_bandwidth


@dataclass(frozen=True)
class Node:
    """What surrounds the devices of one machine (defaults: the vendor's reference system)."""

    per_node: int
    intra: Link
    inter: Link
    nics: int
    """Network adapters per node; rail-optimised clusters have one per device."""
    pcie: Link
    """Device-to-host link (offload traffic)."""
    host_memory: float
    host_bandwidth: float
    nvme_bandwidth: float
    """Aggregate NVMe bytes/s per node (read and write assumed alike): an assumption."""
    source: str
    nvme_lone_bandwidth: float = 0.0
    """Bytes/s in all while each of the node's ranks has one disk request in flight (the nvme
    tier's first chunk read, its last chunk written: one direction alone), where measured
    (local_disk_lone); 0 = nvme_bandwidth."""


def _device(name, kind, memory_mib, peak, bw, eff, source, power=None):
    return Device(name, kind, memory_mib * MIB, peak, bw, eff, source, power)


# Efficiency (matmul FLOP/s reached / peak, before communication, bubble and optimizer, which the
# cost model adds itself): 0.5 on NVIDIA data-centre GPUs in bf16/fp16 (end-to-end MFU of tuned
# dense training is 40-55%: Megatron-LM 52% on A100 (Narayanan et al. 2021), PaLM 46% on TPU v4;
# our blocks are unfused apart from SDPA), 0.45 on H100/H200 (harder to saturate: torchtitan
# reports ~35-40% end-to-end MFU for Llama 3 8B in bf16), 0.35 on MI250X (Frontier studies
# report ~30% end-to-end MFU). Calibrated against our measurements by bench/bench_planner.py.
DEVICES: dict[str, Device] = {d.name: d for d in (
    _device("V100-16GB", "cuda", 16160, {"fp16": 125e12, "fp32": 15.7e12}, 900e9, 0.5,
            "NVIDIA Tesla V100 SXM2 datasheet: fp16 tensor 125 TF, fp32 15.7 TF, HBM2 900 GB/s; "
            "no bf16", 300),  # 300 W: V100 SXM2 datasheet, "max power consumption"
    _device("V100-32GB", "cuda", 32510, {"fp16": 125e12, "fp32": 15.7e12}, 900e9, 0.5,
            "NVIDIA Tesla V100 SXM2 32GB datasheet", 300),  # 300 W: V100 SXM2 datasheet
    _device("A100-40GB", "cuda", 40536, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
            1555e9, 0.5, "NVIDIA A100 SXM4 datasheet: bf16/fp16 312 TF dense, fp32 19.5 TF, "
            "HBM2 1,555 GB/s", 400),  # 400 W: A100 SXM4 datasheet, "max TDP power"
    _device("A100-80GB", "cuda", 81920, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
            2039e9, 0.5, "NVIDIA A100 SXM4 80GB datasheet: HBM2e 2,039 GB/s", 400),  # 400 W: A100 datasheet
    _device("H100-80GB", "cuda", 81559, {"bf16": 989e12, "fp16": 989e12, "fp32": 66.9e12, "fp8": 1979e12},
            3350e9, 0.45, "NVIDIA H100 SXM5 datasheet: bf16/fp16 989 TF dense (1,979 with "
            "sparsity), fp8 1,979 TF dense (3,958 with sparsity), fp32 66.9 TF, HBM3 3.35 TB/s", 700),  # "up to 700 W": H100 SXM datasheet
    _device("H200-141GB", "cuda", 143771, {"bf16": 989e12, "fp16": 989e12, "fp32": 66.9e12, "fp8": 1979e12},
            4800e9, 0.45, "NVIDIA H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s", 700),  # up to 700 W: H200 datasheet
    _device("MI250X", "rocm", 65536, {"bf16": 191.5e12, "fp16": 191.5e12, "fp32": 47.9e12},
            1600e9, 0.35, "AMD Instinct MI250X datasheet (383 TF bf16, 95.7 TF fp32 matrix, "
            "128 GB, 3.2 TB/s per package) halved: PyTorch sees each of its two GCDs as a device", 280),
    # 280 W per GCD: the MI250X OAM package's 560 W peak board power (AMD datasheet) halved
    _device("TPU-v4", "tpu", 32768, {"bf16": 275e12}, 1200e9, 0.5,
            "Google Cloud TPU v4 documentation: 275 TF bf16, 32 GiB HBM2 at 1,200 GB/s "
            "(modelled only: the runtime does not drive TPUs)"),
    # TPU v4: no power figure (Google's documentation gives no per-chip TDP): energy unknown.
)}

# Reference systems: DGX-1 (V100), DGX A100, DGX H100/H200 (NVIDIA DGX user guides), HPE Cray
# EX235a (Frontier: 4 MI250X = 8 GCDs, 4 Slingshot NICs, 512 GB DDR4), a TPU v4 host (4 chips).
# Host memory bandwidth = sockets x channels x DDR rate x 8 B. NVMe: 12 GB/s (4 Gen4 U.2 drives)
# or 25 GB/s (8 drives, DGX H100) per node, an assumption.
NODES: dict[str, Node] = {
    "V100": Node(8, LINKS["nvlink2"], LINKS["ib-edr"], 4, LINKS["pcie3"], 512e9, 153.6e9, 6e9,
                 "DGX-1: 8 V100 SXM2, NVLink2 hybrid cube-mesh, 4 x EDR, 512 GB, 2 x 4-ch DDR4-2400"),
    "A100": Node(8, LINKS["nvlink3"], LINKS["ib-hdr"], 8, LINKS["pcie4"], 1024e9, 409.6e9, 12e9,
                 "DGX A100: NVSwitch, 8 x HDR 200 Gb/s, 1 TB, 2 x 8-ch DDR4-3200"),
    "H100": Node(8, LINKS["nvlink4"], LINKS["ib-ndr"], 8, LINKS["pcie5"], 2048e9, 614e9, 25e9,
                 "DGX H100: NVSwitch, 8 x NDR 400 Gb/s, 2 TB, 2 x 8-ch DDR5-4800"),
    "MI250X": Node(8, LINKS["infinity-fabric"], LINKS["slingshot-200"], 4, LINKS["pcie4"], 512e9,
                   204.8e9, 12e9, "HPE Cray EX235a (Frontier): 8 GCDs, 4 x Slingshot-11, 512 GB"),
    "TPU": Node(4, LINKS["ici-v4"], LINKS["ici-v4"], 4, LINKS["pcie4"], 400e9, 200e9, 6e9,
                "TPU v4 host: 4 chips on ICI (pods are ICI tori); host figures approximate"),
}


def node_for(device: Device) -> Node:
    key = {"H200-141GB": "H100", "TPU-v4": "TPU"}.get(device.name, device.name.split("-")[0])
    return NODES[key]


@dataclass(frozen=True)
class Calibration:
    """Per device kind: what the allocator cannot see and how well communication overlaps."""

    runtime_reserve: float
    """Bytes outside tensors: CUDA/HIP context, cuBLAS workspace, NCCL buffers (assumed
    1 GB), or for the CPU a worker's measured baseline RSS."""
    overlap: float
    """Fraction of a compute window that hides asynchronous communication."""
    norms_in_fp32: bool
    """Autocast runs layer_norm in fp32 (CUDA's policy; CPU autocast keeps the input dtype)."""
    half_width: float
    """Matmul efficiency scales by h / (h + half_width): small matrices fill less of the chip."""
    collective_factors: tuple[tuple[str, float], ...] = ()
    """Measured time / ring-model time per collective, at least 1 (gloo's all-gather and
    reduce-scatter are not rings; its ring hop, send_recv, is timed apart from its all-reduce);
    1 for what is not listed."""
    mmap_threshold: int = 128 * 1024
    """A CPU process's malloc mmap threshold (launch/allocator.py): tensors of at least this many
    bytes are fresh mappings each time (planner/memory_bound.py); local_cpu sets the one the run
    will have (run.malloc_mmap_threshold, or the environment's), a catalog CPU keeps 128 KiB."""

    def factor(self, op: str) -> float:
        return dict(self.collective_factors).get(op, 1.0)


CALIBRATION = {
    # overlap 0.5 on GPUs: a collective beside compute takes SMs and memory bandwidth from the
    # matmuls (and they from it), so half a unit's compute window hides communication. 0.8 (the
    # earlier assumption) predicted Megatron-LM 2021's ZeRO-3 rows +16/+22/+28%; 0.5 gives
    # 0/+3/+16% (docs/planner.md section 5). One constant for every row, not per row.
    "cuda": Calibration(1.0e9, 0.5, True, 256),
    "rocm": Calibration(1.0e9, 0.7, True, 256),
    "tpu": Calibration(0.5e9, 0.8, True, 256),
    # On a CPU gloo's threads need the cores compute is using: no overlap. No size term: this
    # CPU's matmul rates are measured (Device.curves, local_cpu); a CPU Device without a curve
    # runs at peak x its stated efficiency.
    "cpu": Calibration(0.4e9, 0.0, False, 0),
}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int
    device: Device
    node: Node
    measured: Calibration | None = None
    """This CPU: the calibration with the measured baseline RSS as its runtime reserve."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def calibration(self) -> Calibration:
        return self.measured or CALIBRATION[self.device.kind]

    def describe(self) -> str:
        layout = (f"{self.per_node} x {self.device.name}" if self.nodes == 1
                  else f"{self.nodes} nodes x {self.per_node} x {self.device.name}")
        inter = f", {self.node.nics} x {self.node.inter.name} per node" if self.nodes > 1 else ""
        return f"{layout} ({self.node.intra.name}{inter})"


def _closest_device(name: str) -> str:
    known = list(DEVICES)
    close = difflib.get_close_matches(name.upper(), [k.upper() for k in known], n=2, cutoff=0.4)
    prefix = [k for k in known if k.upper().startswith(name.upper())]
    hint = prefix or [next(k for k in known if k.upper() == c) for c in close]
    did_you = f" Did you mean {' or '.join(hint)}?" if hint else ""
    return (f"unknown device {name!r}.{did_you} Known devices: {', '.join(known)}, and 'cpu' "
            f"(this machine, measured)")


def find_device(name: str) -> Device:
    """A catalog device by name, case-insensitive; an error lists the known ones."""
    for key, device in DEVICES.items():
        if key.upper() == name.upper():
            return device
    raise ConfigError(_closest_device(name))


def device_for_gpu_name(name: str) -> Device | None:
    """The catalog device that torch.cuda.get_device_name() reports as `name` ('Tesla
    V100-SXM2-16GB', 'NVIDIA A100-SXM4-80GB', 'NVIDIA H100 80GB HBM3', 'AMD Instinct MI250X'),
    or None. Matched by family (the catalog name before its memory size), preferring the
    entry whose memory size the name contains; peaks do not differ within a family here.
    Best effort: PCIe and NVL cards are matched to the SXM part, which is clocked higher (H100
    PCIe: 756 TF bf16), so their MFU reads low."""
    upper = name.upper()
    family = [d for d in DEVICES.values() if d.kind in ("cuda", "rocm") and re.search(
        rf"(?<![A-Z0-9]){re.escape(d.name.split('-')[0].upper())}(?![0-9])", upper)]
    sized = [d for d in family if d.name.split("-")[-1].upper() in upper]
    return (sized or family or [None])[0]


def find_link(name: str) -> Link:
    if name not in LINKS:
        close = difflib.get_close_matches(name, list(LINKS), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown link {name!r}.{hint} Known links: {', '.join(LINKS)}")
    return LINKS[name]


_SPEC = re.compile(r"^(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?([A-Za-z][\w.\-]*)$")


def parse_cluster(spec: str, intra: str | None = None, inter: str | None = None,
                  nics: int | None = None) -> Cluster:
    """`DEVICE`, `COUNTxDEVICE` or `NODESxPER_NODExDEVICE` (e.g. 8xV100-16GB, 2x8xA100-80GB).

    COUNT alone fills reference nodes (8 GPUs each, 4 TPU chips): 16xA100-80GB is 2 nodes of 8.
    `Nxcpu` is N ranks on this machine, measured (the probe runs on first use, then is cached).
    """
    match = _SPEC.match(spec.strip())
    if not match:
        raise ConfigError(f"cannot read the cluster {spec!r}: write COUNTxDEVICE or "
                          f"NODESxPER_NODExDEVICE, e.g. 8xV100-16GB or 2x8xA100-80GB")
    first, second, name = match.groups()
    if name.lower() == "cpu":
        if second is not None:
            raise ConfigError(f"{spec!r}: 'cpu' means ranks on this one machine; write Nxcpu")
        return local_cpu(int(first or 1))
    device = find_device(name)
    node = node_for(device)
    if second is not None:
        nodes, per_node = int(first), int(second)
    else:
        count = int(first or 1)
        if count > node.per_node and count % node.per_node:
            raise ConfigError(
                f"{spec!r}: {count} devices do not fill {device.name} nodes of {node.per_node}; "
                f"say the layout, e.g. {-(-count // node.per_node)}x{count // -(-count // node.per_node)}"
                f"x{device.name} or {count}x1x{device.name}")
        nodes, per_node = (count // node.per_node, node.per_node) if count > node.per_node else (1, count)
    if nodes < 1 or per_node < 1:
        raise ConfigError(f"{spec!r}: node and device counts must be >= 1")
    node = replace(node, per_node=per_node,
                   intra=find_link(intra) if intra else node.intra,
                   inter=find_link(inter) if inter else node.inter,
                   nics=nics if nics else node.nics)
    return Cluster(nodes, per_node, device, node)


# ---------------------------------------------------------------------------------------------
# This CPU, measured (its parts: hardware/machine.py)


def local_cpu(n_ranks: int, mmap_threshold: int | None = None) -> Cluster:
    """This machine as `n_ranks` local gloo ranks: every number measured (cached per machine);
    its processes' malloc mmap threshold `mmap_threshold` (run.malloc_mmap_threshold; default:
    its default), or the environment's where set (launch.allocator.planned_threshold)."""
    if n_ranks < 1:
        raise ConfigError(f"cpu rank count {n_ranks} must be >= 1")
    from shardlm.hardware.probe import measure_cpu

    measured = measure_cpu(n_ranks)
    # Each rank gets max(1, cores // n_ranks) threads (launch.init_runtime); the ranks share the
    # machine's memory bandwidth and RAM. Matmul rates: the measured curve (measured_curve). With more ranks
    # than cores the ranks time-share the cores: each gets cores / n_ranks of the thread the
    # probe timed alone, for its matmuls and for gloo's copies alike (oversubscription).
    share = cpu_share(n_ranks, measured["cores"])
    peak, curves = dict(measured["peak"]), dict(measured.get("curve", {}))
    if "bf16" in peak and cpu_bf16_gemm(peak) == "fp32":  # a bf16 run multiplies in fp32 here
        peak["bf16"], curves["bf16"] = peak["fp32"], curves.get("fp32", ())
    rates = at_least_one_thread(measured.get("memory", {}), measured.get("memory_one_thread", {}))
    # A rank's memory-bound work runs at its threads' measured rates, time-shared with more
    # ranks than cores (share); the curve's DRAM end is the machine's 256 MiB copy, which all
    # ranks share (1/n each).
    dram = measured["memory_bandwidth"] / n_ranks
    curve = tuple((n, bw * share) for n, bw in rates.get("elementwise", ()) if n < 256 * MIB)
    curve = curve + ((256 * MIB, dram),) if curve else ()
    device = Device(
        name=f"cpu ({measured['cpu']}, {measured['threads']} thread(s)/rank"
             + (f", {share:.2g} of a core each" if share < 1 else "") + ")", kind="cpu",
        memory=available_memory() / n_ranks, peak={k: v * share for k, v in peak.items()},
        memory_bandwidth=dram, efficiency=1.0,
        source="measured by shardlm.hardware.probe.measure_cpu (cached)",
        curves={p: measured_curve(points, f"{p}, {measured['threads']} thread(s) on {measured['cpu']}").scaled(share)
                for p, points in curves.items() if points},
        op_seconds=rates.get("op_seconds", 0.0) / share, fresh_bandwidth=rates.get("fresh_bandwidth", 0.0) * share,
        passes=tuple((key, seconds / share) for key, seconds in sorted(measured.get("passes", {}).items())),
        bandwidth_curve=curve, adamw_curve=tuple((n, sec / share) for n, sec in rates.get("adamw", ())),
        memory_source=describe_memory_rates(rates) + (f", x {share:.2g} (ranks share the cores)" if share < 1 else "")
        if rates else "")
    # The ring model fitted to collectives timed among matmuls, as a step issues them (gloo_
    # probe._in_step): two ranks' on two cores, or with more ranks than cores that many ranks'
    # (oversubscribed_in_step), whose time-sharing is measured in it: neither its latency nor
    # its bandwidth is stretched again. (Fitted up to 4 MiB, the oversubscribed bandwidth came
    # out ~2 GB/s and was replaced by two ranks' x share; with the 16 MiB point it is ~0.9 GB/s
    # for 4 ranks on 2 cores, against two ranks' ~1.0: gloo's copies mostly wait on the loopback.)
    gloo = Link("gloo-local", measured["gloo_in_step_bandwidth"], measured["gloo_in_step_latency"], 1.0,
                f"measured: collectives between {measured.get('in_step_ranks', 2)} local gloo ranks among matmuls")
    disk, disk_source = local_disk(measured.get("disk") or {}, n_ranks)
    node = Node(n_ranks, gloo, LINKS["eth-10"], 1, gloo, available_memory(),
                measured["memory_bandwidth"], disk, f"this machine (disk: {disk_source})",
                local_disk_lone(measured.get("disk") or {}, n_ranks))
    # A worker also holds its tokenizer, data loader and threads: +100 MB over the probe's
    # imports and gloo (measured: a gpt-tiny training rank at 324 MiB, the probe's at 228).
    from shardlm.launch.allocator import DEFAULT_THRESHOLD, planned_threshold

    threshold = planned_threshold(DEFAULT_THRESHOLD if mmap_threshold is None else mmap_threshold)
    calibration = replace(CALIBRATION["cpu"], runtime_reserve=measured["baseline_rss"] + 1e8, mmap_threshold=threshold,
                          collective_factors=tuple((op, measured[f"gloo_in_step_{op}_factor"])
                                                   for op in ("all_gather", "reduce_scatter", "send_recv")))
    return Cluster(1, n_ranks, device, node, calibration)


def choose_compute(kind: str, peak: dict[str, float]) -> str:
    """What precision.compute = 'auto' means on a device: on a CPU the faster of fp32 and bf16
    by the measured matmul peak (bf16 is fast only on some CPUs: AMX, or AMD's AVX-512-BF16;
    the CPU flags alone do not tell), elsewhere bf16 where the hardware has it, else fp16 (V100:
    tensor cores at 8x fp32's rate, with the loss scaler). The one home of this rule: the
    trainer resolves 'auto' once per run with it, the planner predicts with it."""
    if kind == "cpu":
        return "bf16" if peak.get("bf16", 0.0) > 1.1 * peak["fp32"] else "fp32"
    return "bf16" if "bf16" in peak else "fp16"
