"""The arms of ``bench_zero_offload.py``: the model presets, the arm names and what each name configures, and how each
arm's trainer is built (our engine, DeepSpeed, FSDP2, the issue-40 peers), with our arms' host-memory prediction.

Split from the benchmark's driver (issue 51 item 6) so that "what an arm is" has one home: the driver runs arms in
subprocesses, ``zero_offload_match.py`` sizes the memory-matched ones, ``zero_offload_report.py`` prints them.
"""

from __future__ import annotations

import importlib.util
import resource
import sys
import time
from typing import TYPE_CHECKING

from convergence import Trainer
from ds_configs import DS_ARMS, ds_config, variant
from zero_offload_peers import PEER_PACKAGES

if TYPE_CHECKING:  # for annotations only: the functions import torch where they use it
    import torch


#: name -> (hidden, layers, heads, intermediate, vocab, seq, batch, gas)
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 176, 512, 32, 2, 2),
    # A CPU-sized model for time-to-loss curves on a development machine (3.7M parameters).
    "small": (256, 4, 4, 688, 1024, 128, 4, 2),
    # 32000 * 2048 * 2 (embeddings + untied head) + 15 * (4 * 2048^2 + 3 * 2048 * 5472 + 2 * 2048) + 2048 = 887M
    "886m": (2048, 15, 16, 5472, 32000, 2048, 4, 2),
    "1.5b": (2560, 18, 20, 6912, 32000, 2048, 4, 2),
    "3b": (3200, 24, 25, 8640, 32000, 2048, 4, 2),
    "5b": (4096, 24, 32, 11008, 32000, 2048, 4, 2),
    # Between 5b and 7b: 18 bytes of host memory per parameter (docs/zero.md) put 7B at the box's edge.
    "6b": (4096, 28, 32, 11008, 32000, 2048, 4, 2),
    "7b": (4096, 32, 32, 11008, 32000, 2048, 4, 2),
    # Issue 40's target for bf16 moments (R29: 14 instead of 18 bytes of host memory per parameter): 8.4B and 9.2B.
    "8b": (4096, 40, 32, 11008, 32000, 2048, 4, 2),
    "9b": (4096, 44, 32, 11008, 32000, 2048, 4, 2),
    "13b": (5120, 40, 40, 13824, 32000, 2048, 4, 2),
}


ARMS = ["ours-s2", "ours-s2-bf16acc", "ours-s2-offload", "ours-s2-offload-bf16acc", "ours-s2-offload-bf16state",
        "ours-s2-offload-overlap", "ours-s2-offload-bf16acc-bf16state-overlap",
        "ours-s2-offload-bf16state-overlap", "ours-s2-offload-split",
        "ours-s2-offload-dpu",
        "ours-s2-offload-dpu-warmup", "ours-s3", "ours-s3-offload", "ours-s3-offload-split", "ours-s3-offload-dpu",
        "ours-s3-offload-dpu-warmup", *DS_ARMS, "fsdp2", "fsdp2-offload",
        "ours-s2-offload-matched", "ours-s2-offload-bf16state-matched", "ours-s2-offload-bf16state-overlap-matched",
        "ours-s2-offload-bf16acc-bf16state-overlap-matched", *PEER_PACKAGES]


#: ``--mode converge``'s arms unless ``--arms`` is given (issue 27 item 6), most telling first: a run cut short by
#: its time box keeps those.
CONVERGE_ARMS = ["ours-s2", "ours-s2-offload", "ours-s2-offload-bf16state", "ours-s2-offload-bf16state-overlap",
                 "ours-s2-offload-split",
                 "ours-s2-offload-dpu-warmup", "ours-s2-offload-dpu", "ds-z2-offload", "ours-s2-offload-matched",
                 *PEER_PACKAGES]


#: The arm-name token of R29's compressed state (``state_precision: bf16``), e.g. ``ours-s2-offload-bf16state``.
BF16_STATE = "-bf16state"


#: The arm-name token of R30's overlapped update (``host_update_start: last_backward``), e.g.
#: ``ours-s2-offload-bf16state-overlap`` (share 0) and ``ours-s2-offload-bf16state-overlap-matched`` (with R28).
OVERLAP = "-overlap"


#: The arm-name suffix of the memory-matched arms (issue 40): ``ours-s2-offload-matched`` and, with R29's bf16
#: moments (12 instead of 16 bytes per element on the split's device side, so a larger share fits the same budget),
#: ``ours-s2-offload-bf16state-matched``. What they need measured before them: our arm with every update on the host
#: (its peak is the base the budget adds to; share 0's GPU memory does not depend on the state precision) and
#: DeepSpeed's (the peak to match; not needed with ``--match-memory-gib``).
MATCHED = "-matched"


MATCH_BASE_ARM = "ours-s2-offload"


#: The arm-name token of accumulation at the model dtype (bf16), DeepSpeed's default numerics (issue 49 item 1):
#: without it our arms accumulate in fp32 (``data_types.grad_accum_dtype: fp32``, R9).
BF16_ACC = "-bf16acc"


#: The files whose frames make an allocation an engine's own (peak_breakdown.py): ours and the peers'.
ENGINE_PATHS = ("/optimized/", "/reference/", "/deepspeed/", "/torchao/", "/megatron/", "zero_offload_peers.py")


#: The ``-dpu-warmup`` arm's undelayed boundaries on a tree whose config has no ``delayed_update_warmup``: the 30
#: ``apply_delayed_update()`` boundaries issue 27 measured.
DEFAULT_MANUAL_WARMUP = 30


def engine_step(engine, micro: torch.Tensor) -> torch.Tensor:
    """One optimizer step through the DeepSpeed-style surface both ZeroEngine and DeepSpeed's engine offer: a
    forward, ``backward`` and ``step`` per micro-batch of ``micro`` (``[gas, batch, seq]``; the engine decides on
    which call the update happens). Returns the mean of the micro-batch losses, detached (read by the caller)."""
    total = None
    for ids in micro:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach() if total is None else total + loss.detach()
    return total / len(micro)


def preset_shape(opts, name: str) -> tuple[int, int, int, int]:
    """(vocab, seq, batch, gas) of preset ``name`` with the ``--seq/--batch/--gas`` overrides."""
    _, _, _, _, vocab, seq, batch, gas = MODELS[name]
    return vocab, opts.seq or seq, opts.batch or batch, opts.gas or gas


def llama(name: str, seq: int):
    """The model, built on the current default device (the child builds it on the GPU: initialising a 5B model's
    random weights on the host took minutes, longer than the arm itself)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, vocab, _, _, _ = MODELS[name]
    cfg = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def progress(t0: float, what: str) -> None:
    """One line on stderr per phase of an arm: a time-boxed arm reports how far it got (the parent quotes it)."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def offload_key_accepted(key: str, value) -> bool:
    """Whether this tree's config takes ``zero_optimization.offload_optimizer.<key>`` (the split update's
    ``gpu_share``, R28, and the delayed update's ``delayed_update_warmup`` arrived after this benchmark): False
    when the config rejects the key as unknown; a value the config rejects otherwise is the caller's error."""
    from reference.contract.accumulation_config import AccumulationConfig
    from reference.contract.errors import ConfigurationError

    off = {"device": "cpu", key: value}
    if key.startswith("delayed_update"):
        off["delayed_parameter_update"] = True
    try:
        AccumulationConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": off}})
    except ConfigurationError as exc:
        if "unknown" in str(exc):
            return False
        raise SystemExit(f"bench_zero_offload.py: {exc}") from None
    return True


def gpu_share(text: str) -> float | str:
    """``--gpu-share``: "auto" or a number (the config validates its range)."""
    return text if text == "auto" else float(text)


def ours_zero(arm: str, opts) -> tuple[dict, int]:
    """Our arm's ``zero_optimization`` section, and how many first boundaries get an ``apply_delayed_update()``
    (the ``-dpu-warmup`` arm on a tree whose config has no ``delayed_update_warmup`` yet: the warm-up the issue
    measured by hand)."""
    stage = 2 if "-s2" in arm else 3
    zero: dict = {"stage": stage}
    manual_warmup = 0
    if "-offload" in arm:
        off: dict = {"device": "cpu"}
        if BF16_STATE in arm:  # R29: Adam's moments stored in bf16 (share 0 unless the arm also splits)
            off["state_precision"] = "bf16"
        if OVERLAP in arm:  # R30: the host update started under the boundary's last backward
            off["host_update_start"] = "last_backward"
        if arm.endswith("-split"):
            off["gpu_share"] = gpu_share(opts.gpu_share)
            if opts.gpu_memory_budget_gib is not None:
                off["gpu_memory_budget"] = int(opts.gpu_memory_budget_gib * 2**30)
            if opts.gpu_memory_limit_gib is not None:  # R28: the engine fits the split under this whole peak
                off["gpu_memory_limit"] = int(opts.gpu_memory_limit_gib * 2**30)
        if arm.endswith(MATCHED):  # the budget the parent derived from the peaks (memory_match)
            off["gpu_share"] = "auto"
            off["gpu_memory_budget"] = int(opts.match_budget_gib * 2**30)
        if "-dpu" in arm:
            off["delayed_parameter_update"] = True
            warm = opts.dpu_warmup if arm.endswith("-warmup") else 0
            if offload_key_accepted("delayed_update_warmup", 0):
                if warm is not None:  # None: the warm-up arm runs the engine's default
                    off["delayed_update_warmup"] = warm
            elif arm.endswith("-warmup"):
                manual_warmup = DEFAULT_MANUAL_WARMUP if warm is None else warm
        zero["offload_optimizer"] = off
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return zero, manual_warmup


def ours_config(arm: str, opts, batch: int, gas: int, zero: dict) -> dict:
    """Our engine's config for ``arm``: bf16, AdamW, clipping, and the accumulation dtype the arm names (fp32
    unless ``-bf16acc``: then the model dtype, DeepSpeed's default numerics)."""
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": gas,
              "gradient_clipping": opts.clip, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": opts.lr, "weight_decay": 0.01}}}
    if BF16_ACC not in arm:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def configuration(arm: str) -> str:
    """What the arm's row is configured to compute, in words (every row names its configuration)."""
    if arm.startswith("ds-"):
        return "DeepSpeed: " + variant(arm).label()
    if arm.startswith("ours"):
        return "grad accumulation " + ("bf16 (model dtype)" if BF16_ACC in arm else "fp32")
    return ""


def current_rss_gib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def predict_host_memory(arm: str, model_name: str, shape: tuple, opts, row: dict) -> None:
    """Before the model or the engine exists: what the engine's host buffers will take
    (``ZeroEngine.estimate_host_memory`` on the model built on the meta device) plus this process as it is now,
    the prediction the measured peak RSS is printed beside. A tree or config without the estimate says why."""
    import torch

    try:
        from optimized.accumulation import estimate_host_memory
    except ImportError:
        row["host_estimate"] = "not in this tree"
        return
    from reference.contract.errors import ConfigurationError

    zero, _ = ours_zero(arm, opts)
    if "gpu_share" in zero.get("offload_optimizer", {}):
        row["host_estimate"] = "not estimated (the split's cut is decided at run time)"
        return
    _, _, batch, gas = shape
    with torch.device("meta"):
        meta = llama(model_name, shape[1])
    try:
        est = estimate_host_memory(meta, ours_config(arm, opts, batch, gas, zero), device=opts.device)
    except ConfigurationError as exc:
        row["host_estimate"] = f"not estimated: {exc}"
        return
    process = current_rss_gib()
    row["host_estimate"] = {"buffers_gib": est.total_bytes / 2**30, "process_before_gib": process,
                            "predicted_peak_gib": est.total_bytes / 2**30 + process,
                            "bytes_per_parameter": est.total_bytes / est.parameters}
    progress(opts.t_start, f"predicted host memory: {est.total_bytes / 2**30:.2f} GiB of engine buffers "
                            f"({est.total_bytes / est.parameters:.1f} B/parameter) + {process:.2f} GiB this process")


def build_ours(arm: str, model, device, shape: tuple, opts, row: dict) -> Trainer:
    from optimized.accumulation import ZeroEngine
    from reference.contract.envvars import cpu_adam_threads, pin_backend, zero_host_memory

    _, _, batch, gas = shape
    zero, manual_warmup = ours_zero(arm, opts)
    engine = ZeroEngine(model, ours_config(arm, opts, batch, gas, zero), device=device)
    row["pin_backend"] = pin_backend()
    row["zero_host_memory"] = zero_host_memory()
    row["adam_threads"] = cpu_adam_threads()
    row["offload_optimizer"] = zero.get("offload_optimizer")
    # What the engine asked to pin; the host RSS column shows what the allocator really took.
    row["host_pinned_requested_gib"] = sum(t.numel() * t.element_size() for t in engine.pinned_buffers()) / 2**30
    if manual_warmup:
        row["dpu_warmup_by"] = (f"apply_delayed_update() after boundaries 1-{manual_warmup} (this config has no "
                                f"delayed_update_warmup)")

    def after_boundary(k: int) -> None:
        if k <= manual_warmup:
            engine.apply_delayed_update()

    def finish() -> None:
        engine.synchronize()
        report = getattr(engine, "split_report", None)  # R28's measurement, where the engine has one
        if callable(report):
            row["split"] = report()
        overlap = getattr(engine, "overlap_report", None)  # R30's redone boundaries, where the engine has them
        if callable(overlap):
            row["overlap"] = overlap()
        try:  # which kernel stepped the device masters (a tree without the fused device Adam has no module)
            from optimized.accumulation import device_adam
        except ImportError:
            return
        row["device_adam"] = {"triton": device_adam.available(), "checks": device_adam.verdicts()}

    return Trainer(step=lambda micro: engine_step(engine, micro), set_lr=engine.set_lr,
                   after_boundary=after_boundary, timings=engine.offload_timings, finish=finish)


def build_ds(arm: str, model, shape: tuple, opts) -> Trainer:
    import deepspeed

    _, _, batch, gas = shape
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(arm, gas, batch, opts.lr, opts.clip))

    def set_lr(lr: float) -> None:
        for g in engine.optimizer.param_groups:
            g["lr"] = lr

    return Trainer(step=lambda micro: engine_step(engine, micro), set_lr=set_lr)


def build_fsdp2(arm: str, model, device, opts) -> Trainer:
    import torch

    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if arm.endswith("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    else:
        model.to(device)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01, fused=not arm.endswith("offload"))

    def step(micro: torch.Tensor) -> torch.Tensor:
        total = None
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def set_lr(lr: float) -> None:
        for g in opt.param_groups:
            g["lr"] = lr

    return Trainer(step=step, set_lr=set_lr)


def package_missing(arm: str) -> bool:
    """Whether the package a peer arm needs (DeepSpeed, torchao, Megatron-Core) cannot be imported here."""
    package = "deepspeed" if arm.startswith("ds-") else PEER_PACKAGES.get(arm)
    if package is None:
        return False
    try:
        return importlib.util.find_spec(package) is None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return True
