"""The analytic cost model: per-layer costs from FLOPs and bytes, and hardware presets.

Owns `hardware(name)` (the presets a100, h100, h200, the spot-trace instances' v100
and t4, and cpu measured on the spot),
`analytic_cost_model(shape, hw, ...)`, and the formulas both sources of a `CostModel`
share: FLOPs per layer, tensor-parallel all-reduce times, state bytes per parameter,
activation and boundary bytes. The profiler (`planaria.templates.profiler`) measures
compute and activations but takes state bytes and tensor-parallel communication
from here, so the two sources agree on what they do not measure.

No torch import (numpy only, for the CPU benchmark): a plan for 1,024 H100 nodes can
be made on a laptop.

Precision as Planaria runs it (`train.dtype`):
- "float32" and "float64": everything in that dtype.
- "bfloat16": autocast over float32 master weights. Matmuls run in bf16 and their
  outputs are bf16, but the residual stream stays float32: the embedding is not
  autocast and `x + f(x)` promotes to float32. So the hidden state sent between
  stages, and gradients w.r.t. float32 tensors, are 4 bytes per element.
"""
from __future__ import annotations

import functools
import os
import socket
import threading
import time

import numpy as np

from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape, check_kv_heads

HARDWARE_NAMES = ("a100", "h100", "h200", "v100", "t4", "cpu")
DTYPE_NAMES = ("float32", "bfloat16", "float64")

# Parameters, gradients and both Adam moments are kept in the master dtype: float32
# for "float32" and "bfloat16" (autocast keeps float32 masters), float64 for "float64".
_BYTES_PER_PARAMETER = {"float32": 16, "bfloat16": 16, "float64": 32}
_WIDE_SUM_BYTES = 8  # a float64 gradient sum per parameter (train.exact_reduction)
# Element size of matmul outputs (the activations autocast produces).
_ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
# Element size of the residual stream and of the master weights.
_HIDDEN_BYTES = {"float32": 4, "bfloat16": 4, "float64": 8}
# Cross-entropy runs in float32 under bf16 (Planaria upcasts the logits first).
_CROSS_ENTROPY_FLOPS_PER_LOGIT = 5  # max, subtract, exp, sum, and the softmax gradient's share

_GPU_PRESETS = {
    # A100 80GB SXM. Memory: 80e9 vendor spec, ~76e9 usable after the CUDA context,
    # NCCL buffers and allocator fragmentation (typical achieved). 312e12 dense bf16
    # tensor-core peak (vendor spec). NVLink 3: 300 GB/s per direction (vendor spec),
    # ~240e9 B/s all-reduce bus bandwidth (typical achieved, nccl-tests). Inter-node:
    # one 200 Gb/s HDR InfiniBand NIC per GPU = 25e9 B/s (vendor spec line rate).
    # 0.5 of peak: typical achieved MFU of large GPT training on A100 (Megatron-LM).
    "a100": dict(device_memory_bytes=76_000_000_000, peak_flops=312e12,
                 intra_node_bandwidth=240e9, inter_node_bandwidth=25e9,
                 matmul_efficiency=0.5, link_latency_s=1e-5),
    # H100 80GB SXM. 989e12 dense bf16 (vendor spec; 1979e12 is with sparsity).
    # NVLink 4: 450 GB/s per direction (vendor spec), ~360e9 B/s all-reduce bus
    # bandwidth (typical achieved). Inter-node: 400 Gb/s NDR per GPU = 50e9 B/s (vendor
    # spec). 0.4 of peak: typical achieved MFU on H100, lower than on A100 because
    # compute grew faster than memory bandwidth.
    "h100": dict(device_memory_bytes=76_000_000_000, peak_flops=989e12,
                 intra_node_bandwidth=360e9, inter_node_bandwidth=50e9,
                 matmul_efficiency=0.4, link_latency_s=1e-5),
    # H200: the H100's compute and links (vendor spec) with 141e9 bytes of HBM3e,
    # ~135e9 usable (same overhead as above, typical achieved).
    "h200": dict(device_memory_bytes=135_000_000_000, peak_flops=989e12,
                 intra_node_bandwidth=360e9, inter_node_bandwidth=50e9,
                 matmul_efficiency=0.4, link_latency_s=1e-5),
    # The GPUs of the spot traces' instances (p3: V100, g4dn: T4; one GPU per instance in
    # the traces' smallest sizes), for `planaria simulate`. Neither has bf16: training
    # runs in fp16 with fp32 masters, the same bytes as bf16 here.
    # V100 SXM2 16GB: 16e9, ~15e9 usable; 125e12 fp16 tensor-core peak (vendor spec);
    # NVLink 2: 150 GB/s per direction, ~120e9 B/s achieved. Inter-node: the single-GPU
    # instance's "up to 10 Gb/s" = 1.25e9 B/s (vendor spec). 0.35 of peak: fp16 V100
    # training reaches less of its peak than A100 (typical achieved).
    "v100": dict(device_memory_bytes=15_000_000_000, peak_flops=125e12,
                 intra_node_bandwidth=120e9, inter_node_bandwidth=1.25e9,
                 matmul_efficiency=0.35, link_latency_s=3e-5),
    # T4 16GB: ~15e9 usable; 65e12 fp16 tensor-core peak (vendor spec), no NVLink (PCIe 3:
    # ~12e9 B/s). Inter-node: "up to 25 Gb/s" = 3.1e9 B/s (vendor spec). 0.3 of peak: a
    # 70 W inference part throttles under sustained training load (typical achieved).
    "t4": dict(device_memory_bytes=15_000_000_000, peak_flops=65e12,
               intra_node_bandwidth=12e9, inter_node_bandwidth=3.1e9,
               matmul_efficiency=0.3, link_latency_s=3e-5),
}
_GPUS_PER_NODE = {"a100": 8, "h100": 8, "h200": 8,  # DGX/HGX nodes (vendor spec)
                  "v100": 1, "t4": 1}  # p3.2xlarge, g4dn.xlarge: the traces' instances
# Host memory per GPU of those nodes (vendor spec): DGX A100 640GB and DGX H100 2 TB for 8
# GPUs, HGX H200 servers as commonly built (2 TB); p3.2xlarge 61 GiB, g4dn.xlarge 16 GiB.
_HOST_MEMORY_PER_GPU = {"a100": 2 * 10**12 // 8, "h100": 2 * 10**12 // 8, "h200": 2 * 10**12 // 8,
                        "v100": 61 * 2**30, "t4": 16 * 2**30}


def hardware(name: str, *, gpus_per_node: int | None = None) -> Hardware:
    """The preset `name` (one of HARDWARE_NAMES); "cpu" is measured on this machine.

    On cpu each worker is one process and "device memory" is the physical memory
    divided among `gpus_per_node` workers (default 1). The measurement runs once per
    process (about half a second) and is reused. Its links are a raw loopback TCP
    socket's, a lower bound: a gloo message between two worker processes takes about
    ten times the socket's latency, and costs each worker time to post and complete.
    The profiled cost model (`planaria.templates.profiler`, `measure_links=True`, the
    default of `planaria.runtime.planning.measured_costs.profile_model` on CPU) replaces the links,
    message overhead and commit time with gloo measured between two processes; this
    module cannot, as it does not import torch.
    """
    if name not in HARDWARE_NAMES:
        raise ValueError(f"unknown hardware {name!r}; valid names are {list(HARDWARE_NAMES)}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, got {gpus_per_node}")
    if name == "cpu":
        return _cpu_hardware(gpus_per_node or 1)
    gpus = gpus_per_node or _GPUS_PER_NODE[name]
    return Hardware(name=name, gpus_per_node=gpus, host_memory_bytes=gpus * _HOST_MEMORY_PER_GPU[name],
                    **_GPU_PRESETS[name])


@functools.lru_cache(maxsize=None)
def _cpu_hardware(gpus_per_node: int) -> Hardware:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bandwidth, latency = measure_loopback()
    # The peak is what this CPU reaches on large float32 matmuls, so the layers reach
    # about all of it (smaller matmuls and elementwise ops reach less: efficiency 1.0
    # is an upper bound on speed, which the profiler corrects).
    return Hardware(name="cpu", device_memory_bytes=physical // gpus_per_node, host_memory_bytes=physical,
                    peak_flops=measure_cpu_flops(), gpus_per_node=gpus_per_node,
                    intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
                    matmul_efficiency=1.0, link_latency_s=latency)


def measure_cpu_flops(sizes: tuple[int, ...] = (512, 768, 1024), repeats: int = 3) -> float:
    """float32 matmul FLOP/s of this CPU: the median over a few square matmuls.

    numpy's BLAS uses the threads the process allows (OMP_NUM_THREADS), as torch does.
    A warm-up product first, so the first timing does not pay for page faults.
    """
    rng = np.random.default_rng(0)
    rates = []
    for n in sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        a @ b  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            rates.append(2 * n ** 3 / max(time.perf_counter() - start, 1e-9))
    return float(np.median(rates))


def measure_loopback(size: int = 16 << 20, repeats: int = 3) -> tuple[float, float]:
    """(bytes/s, seconds per message) over a TCP loopback socket.

    Workers of a CPU job talk through gloo, which uses TCP over loopback between local
    processes; a memcpy would overstate its bandwidth several times. Bandwidth is the
    median of a few 16 MiB transfers, latency the median of small ping-pongs (half a
    round trip).
    """
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    server.close()
    try:
        for s in (client, peer):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = bytes(size)
        rates = []
        for _ in range(repeats):
            sender = threading.Thread(target=client.sendall, args=(payload,))
            start = time.perf_counter()
            sender.start()
            _receive(peer, size)
            sender.join()
            rates.append(size / max(time.perf_counter() - start, 1e-9))
        rounds = []
        for _ in range(20):
            start = time.perf_counter()
            client.sendall(b"x")
            _receive(peer, 1)
            peer.sendall(b"y")
            _receive(client, 1)
            rounds.append((time.perf_counter() - start) / 2)
        return float(np.median(rates)), float(np.median(rounds))
    finally:
        client.close()
        peer.close()


def _receive(sock: socket.socket, size: int) -> None:
    buffer = bytearray(min(size, 1 << 20))
    left = size
    while left:
        got = sock.recv_into(buffer, min(left, len(buffer)))
        if not got:
            raise ConnectionError("loopback peer closed early")
        left -= got


# ---- sizes and checks -------------------------------------------------------------------


def check_job(shape: ModelShape, *, tp: int, micro_batch: int, dtype: str) -> None:
    """Refuse a job the model cannot run, naming the key to change."""
    if tp < 1:
        raise ValueError(f"parallel.tp must be at least 1, got {tp}")
    if micro_batch < 1:
        raise ValueError(f"train.micro_batch must be at least 1, got {micro_batch}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"train.dtype {dtype!r} is unknown; use one of {list(DTYPE_NAMES)}")
    if shape.d_model % shape.n_heads:
        raise ValueError(f"model.n_heads={shape.n_heads} does not divide model.d_model={shape.d_model}")
    for key, size in (("model.n_heads", shape.n_heads), ("model.vocab_size", shape.vocab_size),
                      ("model.ffn_hidden", shape.ffn_dim)):
        if size % tp:
            raise ValueError(f"{key}={size} is not divisible by parallel.tp={tp}")
    check_kv_heads(shape.n_heads, shape.kv_heads, tp)


def bytes_per_parameter(dtype: str, wide_gradients: bool = False) -> int:
    """State bytes per parameter: master weight, gradient and two Adam moments, and with
    `wide_gradients` (`train.exact_reduction` below float64) the float64 sum the
    gradients accumulate in."""
    if dtype not in _BYTES_PER_PARAMETER:
        raise ValueError(f"train.dtype {dtype!r} is unknown; use one of {list(DTYPE_NAMES)}")
    return _BYTES_PER_PARAMETER[dtype] + (_WIDE_SUM_BYTES if wide_gradients else 0)


def sums_wide(dtype: str, exact_reduction: bool) -> bool:
    """Whether a job sums its gradients in float64 apart from its parameters' dtype
    (`train.exact_reduction` in a float32 or bf16 job): the `wide_gradients` of a cost model."""
    return exact_reduction and dtype != "float64"


def gradient_element_bytes(dtype: str, wide_gradients: bool = False) -> int:
    """Bytes per element of the gradients summed across pipelines: float64 sums with
    `wide_gradients` or float64 training, the float32 master gradients otherwise."""
    return _WIDE_SUM_BYTES if wide_gradients or dtype == "float64" else 4


def activation_element_bytes(dtype: str) -> int:
    """Element size of matmul outputs: 2 under bf16 autocast."""
    return _ACTIVATION_BYTES[dtype]


def hidden_element_bytes(dtype: str) -> int:
    """Element size of the residual stream (the master dtype: float32 under bf16)."""
    return _HIDDEN_BYTES[dtype]


def layer_parameters_per_rank(shape: ModelShape, index: int, tp: int) -> int:
    """Parameters one worker holds of layer `index`: sharded matrices / tp, norm gains whole."""
    kind = shape.layer_kind(index)
    if kind == "block":
        return shape.block_parameters_per_rank(tp)
    replicated = {"embedding": 0, "head": shape.d_model}[kind]
    return (shape.layer_parameters(index) - replicated) // tp + replicated


def layer_state_bytes(shape: ModelShape, index: int, tp: int, dtype: str, wide_gradients: bool = False) -> int:
    """Bytes one worker pins for layer `index` (`bytes_per_parameter`)."""
    return layer_parameters_per_rank(shape, index, tp) * bytes_per_parameter(dtype, wide_gradients)


def layer_wide_sum_bytes(shape: ModelShape, index: int, tp: int, wide_gradients: bool) -> int:
    """Bytes of one worker's float64 gradient sums of layer `index` (none without)."""
    return layer_parameters_per_rank(shape, index, tp) * _WIDE_SUM_BYTES if wide_gradients else 0


def layer_gradient_bytes(shape: ModelShape, index: int, tp: int, dtype: str, wide_gradients: bool = False) -> int:
    """Bytes of one worker's summed gradients of layer `index` (`gradient_element_bytes`)."""
    return layer_parameters_per_rank(shape, index, tp) * gradient_element_bytes(dtype, wide_gradients)


def layer_output_bytes(shape: ModelShape, index: int, micro_batch: int, dtype: str) -> int:
    """The hidden state a stage ending at `index` sends on; the head sends nothing.

    Full size on every tp worker (the hidden state is replicated across tp), in the
    residual stream's dtype.
    """
    if shape.layer_kind(index) == "head":
        return 0
    return micro_batch * shape.seq_len * shape.d_model * hidden_element_bytes(dtype)


def layer_activation_bytes(shape: ModelShape, index: int, *, tp: int, micro_batch: int,
                           dtype: str, recompute: bool = False) -> int:
    """Bytes one worker keeps from forward to backward for one microbatch of layer `index`.

    Blocks follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models"), tensor parallelism without sequence parallelism:
    s·b·h·(10 + 24/t) + 5·a·s²·b/t bytes for 16-bit activations. Kept:
    - 10·sbh, replicated on every tp worker: the two norm inputs (4), the inputs of the
      QKV and first MLP matmuls (4), two dropout masks (2). Planaria has no dropout,
      but LLaMA's SwiGLU with RMSNorm saves more than GPT's MLP (gate, up, silu output
      and product, and the normalised tensors), which these 2 roughly stand for; the
      reference block measures ~1.3x this estimate (see tests/runtime/test_measured_costs.py).
    - 24·sbh/t, split by tp: Q, K, V (6), attention output (2), MLP intermediates (16).
      Grouped-query attention keeps as much: its K and V are repeated to the query
      heads before attention (runtime/models/llama.py), and those copies are what it saves.
    Dropped: 5·a·s²·b/t, the attention score matrix, its softmax and dropout. Planaria
    calls scaled_dot_product_attention, whose flash/memory-efficient kernels keep only
    the output and a per-row logsumexp (a·s floats), never an s x s matrix.
    The 16-bit bytes are scaled by element size / 2 for float32 and float64.
    With recomputation a block keeps only its input (residual dtype).
    """
    check_job(shape, tp=tp, micro_batch=micro_batch, dtype=dtype)
    tokens = micro_batch * shape.seq_len
    kind = shape.layer_kind(index)
    act, hidden = activation_element_bytes(dtype), hidden_element_bytes(dtype)
    if kind == "embedding":
        return tokens * 8  # the int64 token ids (the gradient scatters by them)
    if kind == "head":
        # The final norm's input and the output matmul's input, and the float32 softmax
        # (or log-softmax) of the logits that cross-entropy keeps: (b, T, V/tp).
        softmax = tokens * (shape.vocab_size // tp) * max(4, act)
        return 2 * tokens * shape.d_model * act + softmax
    if recompute:
        return tokens * shape.d_model * hidden
    sbh = tokens * shape.d_model
    return int(sbh * (10 + 24 / tp) * act / 2)


def layer_forward_flops(shape: ModelShape, index: int, *, tp: int, micro_batch: int) -> float:
    """Forward FLOPs of layer `index` on one tp worker for one microbatch.

    Block: Q and output projections 2·d², K and V 2·d·kv_dim (kv_dim = d without
    grouped-query attention), and the three SwiGLU matrices 3·d·ffn per token, 2 FLOPs
    per multiply-add; attention QKᵀ and AV 2·b·T²·d each. The causal kernels skip about
    half of the latter; like Megatron-LM's MFU convention we count all of it. All of a
    block's matmuls are split by tp, but K and V: a key/value head replicated on several
    ranks (tp > n_kv_heads) is computed by each. The embedding is a gather
    (no FLOPs); the head is the output matmul plus cross-entropy's few FLOPs per logit.
    """
    b, t, d = micro_batch, shape.seq_len, shape.d_model
    tokens = b * t
    kind = shape.layer_kind(index)
    if kind == "embedding":
        return 0.0
    if kind == "head":
        logits = tokens * shape.vocab_size / tp
        return 2 * logits * d + _CROSS_ENTROPY_FLOPS_PER_LOGIT * logits
    kv_per_rank = shape.kv_dim / min(tp, shape.kv_heads)
    matmuls = 2 * tokens * ((2 * d * d + 3 * d * shape.ffn_dim) / tp + 2 * d * kv_per_rank)
    attention = 4 * b * t * t * d / tp
    return matmuls + attention


def all_reduce_time(nbytes: float, tp: int, hw: Hardware) -> float:
    """Ring all-reduce of `nbytes` among `tp` workers of one node; 0 when tp == 1."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * nbytes / hw.intra_node_bandwidth + hw.link_latency_s


def tp_communication_times(shape: ModelShape, index: int, hw: Hardware, *, tp: int,
                           micro_batch: int, dtype: str,
                           recompute: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of layer `index`'s tensor-parallel all-reduces.

    Megatron's pattern as Planaria implements it (runtime/models/tensor_parallel.py):
    - embedding: one all-reduce of the output forward (float32: the gather is not
      autocast); its backward needs none.
    - block: forward, the attention and MLP row-parallel outputs (matmul outputs, bf16
      under autocast); backward, the gradients w.r.t. the two column-parallel inputs
      (residual dtype). Recomputation repeats the forward pair in the backward. (With
      more tp ranks than key/value heads, the sum of the replicated heads' gradients is
      once per step, not per microbatch: `tp_step_communication_time`.)
    - head: forward, vocab-parallel cross-entropy's three small all-reduces (row max,
      target logit, sum of exponentials: one float per token); backward, the output
      matmul's input gradient.
    """
    if tp == 1:
        return 0.0, 0.0
    tokens = micro_batch * shape.seq_len
    hidden = tokens * shape.d_model
    act, res = activation_element_bytes(dtype), hidden_element_bytes(dtype)
    kind = shape.layer_kind(index)
    if kind == "embedding":
        return all_reduce_time(hidden * res, tp, hw), 0.0
    if kind == "head":
        forward = 3 * all_reduce_time(tokens * max(4, act), tp, hw)
        return forward, all_reduce_time(hidden * res, tp, hw)
    forward = 2 * all_reduce_time(hidden * act, tp, hw)
    backward = 2 * all_reduce_time(hidden * res, tp, hw)
    return forward, backward + (forward if recompute else 0.0)


def tp_step_communication_time(shape: ModelShape, index: int, hw: Hardware, *, tp: int,
                               dtype: str) -> float:
    """Seconds of layer `index`'s once-per-step tensor-parallel communication: with more
    tp ranks than key/value heads, a block's share of the all-gather that sums the
    replicated heads' wk and wv gradients (`sum_over_head_replicas` in the runtime: one
    head's rows of each, gathered from the tp-1 other ranks, in the master dtype)."""
    if tp == 1 or shape.layer_kind(index) != "block" or shape.kv_heads % tp == 0:
        return 0.0
    local = 2 * shape.kv_dim // shape.kv_heads * shape.d_model * hidden_element_bytes(dtype)
    return (tp - 1) * local / hw.intra_node_bandwidth + hw.link_latency_s


def analytic_cost_model(shape: ModelShape, hw: Hardware, *, tp: int = 1, micro_batch: int = 1,
                        dtype: str = "bfloat16", recompute: bool = False,
                        wide_gradients: bool = False) -> CostModel:
    """Per-layer costs from FLOPs and bytes on the hardware `hw`.

    Compute time is FLOPs / (peak · matmul_efficiency); the backward is 2x the forward's
    FLOPs (input and weight gradients), 3x for a recomputed block, plus the layer's
    tensor-parallel all-reduces; once per step, the sum of replicated key/value heads'
    gradients (`optimizer_s`). Memory per worker as in `layer_state_bytes` and
    `layer_activation_bytes`; `wide_gradients`: `train.exact_reduction` below float64 (a
    float64 sum per parameter pinned, and summed across pipelines).
    """
    check_job(shape, tp=tp, micro_batch=micro_batch, dtype=dtype)
    if tp > hw.gpus_per_node:
        raise ValueError(f"parallel.tp={tp} exceeds the {hw.gpus_per_node} devices of a "
                         f"{hw.name} node; tensor parallelism stays inside a node")
    rate = hw.peak_flops * hw.matmul_efficiency
    layers = []
    for i in range(shape.num_layers):
        flops = layer_forward_flops(shape, i, tp=tp, micro_batch=micro_batch)
        recomputed = recompute and shape.layer_kind(i) == "block"
        comm_f, comm_b = tp_communication_times(shape, i, hw, tp=tp, micro_batch=micro_batch,
                                                dtype=dtype, recompute=recompute)
        layers.append(LayerCost(
            forward_s=flops / rate + comm_f,
            backward_s=(3 if recomputed else 2) * flops / rate + comm_b,
            state_bytes=layer_state_bytes(shape, i, tp, dtype, wide_gradients),
            gradient_bytes=layer_gradient_bytes(shape, i, tp, dtype, wide_gradients),
            wide_sum_bytes=layer_wide_sum_bytes(shape, i, tp, wide_gradients),
            activation_bytes=layer_activation_bytes(shape, i, tp=tp, micro_batch=micro_batch,
                                                    dtype=dtype, recompute=recompute),
            output_bytes=layer_output_bytes(shape, i, micro_batch, dtype),
            optimizer_s=tp_step_communication_time(shape, i, hw, tp=tp, dtype=dtype),
        ))
    return CostModel(shape=shape, hardware=hw, tp=tp, micro_batch=micro_batch,
                     layers=tuple(layers), source="analytic")
