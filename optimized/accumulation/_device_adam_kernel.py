"""The Triton source of the fused device Adam (see :mod:`optimized.accumulation.device_adam`, which imports this
module only where Triton is installed and decorates :func:`adam_kernel` itself: ``triton.jit`` for a GPU, the
Triton interpreter for CPU tensors).

One program updates ``BLOCK`` elements: it reads the master, the gradient and both moments once and writes the
master, the moments and (``HAS_OUT``) the bf16 weights once. Each line below is one operation of R16's sequence
(``optimizers.torch_step``) in the same order, on fp32 values, so that with FP contraction off every result is
rounded exactly where the torch sequence rounds it.

``BF16_STATE`` (R29): the moments are bf16 (passed as int16 views). They are widened exactly (the bits shifted into
the upper half of an fp32 word), the step runs in fp32, and they are stored rounded to nearest even in integer
arithmetic -- the contract's ``round_to_bf16``, NaN as 0x7FC0 -- as the bf16 weights are.
"""

from __future__ import annotations

import triton.language as tl


def adam_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n,
    clip, decay, wd, beta1, one_minus_beta1, beta2, one_minus_beta2, bias2, eps, step_size,
    HAS_CLIP: tl.constexpr, DECOUPLED: tl.constexpr, L2: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    BF16_STATE: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if BF16_STATE:  # bf16 bits (int16) -> fp32, exactly: the bits become the upper half of the word
        m_bits = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        v_bits = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        m = (m_bits << 16).to(tl.float32, bitcast=True)
        v = (v_bits << 16).to(tl.float32, bitcast=True)
    else:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_CLIP:
        g = g * clip  # R15
    if DECOUPLED:
        p = p * decay  # AdamW: p * (1 - lr * wd), before the moments
    if L2:
        g = g + p * wd  # Adam's L2 term, from the weights before the step
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    denom = tl.sqrt_rn(v) * bias2 + eps  # the correctly rounded root, as torch_step's fp64 root rounded to fp32
    p = p - tl.div_rn(m, denom) * step_size
    tl.store(p_ptr + offs, p, mask=mask)
    # fp32 -> bf16 below, rounded to nearest even in integer arithmetic (what torch's cast does; a float conversion
    # would depend on the backend: the interpreter truncates). A NaN becomes the quiet NaN 0x7FC0 (torch's CUDA
    # cast's): rounding the bits of a NaN with a full payload would carry into the sign and give -0.0.
    if BF16_STATE:  # R29: the contract's round_to_bf16, word for word
        m_up = m.to(tl.uint32, bitcast=True)
        m_up = tl.where(m != m, 0x7FC0, (m_up + 0x7FFF + ((m_up >> 16) & 1)) >> 16)
        tl.store(m_ptr + offs, m_up.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        v_up = v.to(tl.uint32, bitcast=True)
        v_up = tl.where(v != v, 0x7FC0, (v_up + 0x7FFF + ((v_up >> 16) & 1)) >> 16)
        tl.store(v_ptr + offs, v_up.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(out_ptr + offs, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
