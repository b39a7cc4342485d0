"""Model-FLOPs utilisation (MFU) of a decoder-only transformer's training step, for the benchmarks' tables.

MFU = model FLOPs per token x tokens per second / the GPU's dense bf16 peak. The model FLOPs are those of the
model's arithmetic, whatever the implementation spends besides (an optimizer step, copies, recomputation), so
arms of one shape are compared on the work they get done:

- ``6 N`` per token: a matmul weight costs 2 FLOPs per token forward and 4 backward (input and weight gradients).
  N counts the parameters a matmul multiplies by: every parameter but the input embedding (a lookup); the untied
  LM head counts. (Norm weights are counted too: a few thousand parameters, no visible effect.)
- ``12 L h s`` per token for attention's two sequence-long products (QK^T and the weighted sum of V: 2 x 2 h s
  FLOPs per token and layer forward, times 3 with backward), the convention of the PaLM paper's appendix B; the
  half that a causal mask skips is not subtracted.

The peak is taken from ``--peak-tflops`` or, unset, from the device's name: dense (no 2:4 sparsity) bf16 tensor
throughput of NVIDIA's data sheets -- H100 SXM and H200 989 TFLOP/s, H100 NVL 835, H100 PCIe 756, A100 312. A
device not listed gets no MFU (the tokens/s are still reported).
"""

from __future__ import annotations

#: (name substring, dense bf16 TFLOP/s): the first whose substring is in the device's name wins
DENSE_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
)


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of the device called ``device_name`` (``torch.cuda.get_device_name``), None if not
    listed in :data:`DENSE_BF16_PEAK_TFLOPS`."""
    for part, tflops in DENSE_BF16_PEAK_TFLOPS:
        if device_name and part in device_name:
            return tflops
    return None


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token (module docstring): ``6 * matmul_params + 12 * layers * hidden * seq``."""
    return 6.0 * matmul_params + 12.0 * layers * hidden * seq


def utilisation(row: dict, layers: int, hidden: int, peak: float | None) -> None:
    """Add to a benchmark ``row`` that has ``matmul_parameters``, ``seq`` and ``tokens_per_s``: the model FLOPs per
    token, the model TFLOP/s achieved and, where ``peak`` (TFLOP/s) is known, ``mfu`` (a fraction) and the peak."""
    if row.get("tokens_per_s") is None or row.get("matmul_parameters") is None:
        return
    per_token = flops_per_token(row["matmul_parameters"], layers, hidden, row["seq"])
    row["model_flops_per_token"] = per_token
    row["model_tflops_per_s"] = per_token * row["tokens_per_s"] / 1e12
    if peak:
        row["peak_tflops"] = peak
        row["mfu"] = row["model_tflops_per_s"] / peak
