"""The DeepSpeed ZeRO-Offload configurations the benchmarks compare with, each named in its arm (issue 49 item 1).

A DeepSpeed arm is only a fair reference when its row says what DeepSpeed was asked to do: the gradient
accumulation dtype and the bucket sizes change both its GPU memory and what it computes. The variants, by the
suffix after ``ds-z2-offload`` / ``ds-z3-offload``:

- ``""`` (no suffix): **DeepSpeed's default**, what a user short of GPU memory runs: no ``data_types`` section, so
  gradients accumulate in the model dtype (bf16: DeepSpeed 0.19.8's ``get_data_types`` falls back to the
  parameter dtype; at ZeRO-2 with ``offload_optimizer`` the partitioned gradients accumulate in bf16 buffers on
  the host, each micro-batch's contribution added on the GPU), and its default buckets (``reduce_bucket_size``
  and ``allgather_bucket_size`` 5e8 elements).
- ``-b5e7``: the default numerics with buckets of 5e7 elements (a tenth of the default; the smaller bucket is
  the leaner peak on the 886M shape, issue 49's table).
- ``-fp32acc``: ``data_types.grad_accum_dtype: fp32`` with the default buckets: the same numerics as our engine's
  fp32 accumulation (R9/R10 in docs/accumulation.md), DeepSpeed's same-numerics reference; its fp32 accumulation
  buffers live on the GPU, which is why it needs ~3 GiB more than the default on the 886M shape.

:data:`DEFAULT_NUMERICS` names the variants whose peak the memory-matched arms match: the smallest peak of those
measured is the "DeepSpeed's default memory" of a run (issue 49: "the smallest peak of the two bucket settings").
"""

from __future__ import annotations

from dataclasses import dataclass

#: DeepSpeed 0.19.8's defaults for ``zero_optimization.reduce_bucket_size`` and ``allgather_bucket_size``.
DS_DEFAULT_BUCKET = 500_000_000


@dataclass(frozen=True)
class DsVariant:
    """One DeepSpeed configuration: the accumulation dtype (None: DeepSpeed's default, the model dtype) and the
    bucket size in elements (None: DeepSpeed's default, :data:`DS_DEFAULT_BUCKET`)."""

    suffix: str
    grad_accum_dtype: str | None
    bucket_elements: int | None

    def label(self) -> str:
        """The configuration in words, for the row and the table: what a reader needs to reproduce the arm."""
        accum = self.grad_accum_dtype or "bf16 (model dtype, DeepSpeed's default)"
        buckets = self.bucket_elements or DS_DEFAULT_BUCKET
        default = "" if self.bucket_elements else " (default)"
        return f"grad accumulation {accum}; reduce/allgather buckets {buckets:.0e}{default}"


VARIANTS = {
    v.suffix: v
    for v in (
        DsVariant("", None, None),
        DsVariant("-b5e7", None, 50_000_000),
        DsVariant("-fp32acc", "fp32", None),
    )
}
#: The arms whose numerics are DeepSpeed's default (bf16 accumulation): the memory-matched arms match the smallest
#: of their peaks.
DEFAULT_NUMERICS = ("ds-z2-offload", "ds-z2-offload-b5e7")
DS_ARMS = [f"ds-z{stage}-offload{suffix}" for stage in (2, 3) for suffix in VARIANTS]


def variant(arm: str) -> DsVariant:
    """The variant of DeepSpeed arm ``arm`` (``ds-z2-offload-b5e7`` -> ``-b5e7``)."""
    for prefix in ("ds-z2-offload", "ds-z3-offload"):
        if arm.startswith(prefix) and arm[len(prefix):] in VARIANTS:
            return VARIANTS[arm[len(prefix):]]
    raise ValueError(f"arm {arm!r}: allowed values: {', '.join(DS_ARMS)}")


def ds_config(arm: str, gas: int, batch: int, lr: float, clip: float) -> dict:
    """DeepSpeed's config for ``arm``: ZeRO-2 (or 3, with ``offload_param``) with ``offload_optimizer: cpu``,
    pinned, ``overlap_comm`` and ``contiguous_gradients`` (both DeepSpeed's recommendation for offload), bf16,
    AdamW, and the variant's accumulation dtype and buckets; nothing else is set."""
    v = variant(arm)
    stage = 3 if arm.startswith("ds-z3") else 2
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                  "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if v.bucket_elements is not None:
        zero["reduce_bucket_size"] = v.bucket_elements
        zero["allgather_bucket_size" if stage == 2 else "stage3_prefetch_bucket_size"] = v.bucket_elements
    config = {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
        "bf16": {"enabled": True}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}, "steps_per_print": 10**9,
    }
    if v.grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": v.grad_accum_dtype}
    return config
