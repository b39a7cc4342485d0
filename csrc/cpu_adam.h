// Native CPU Adam / AdamW for the offloaded optimizer step (issue 6, docs/accumulation.md R16).
//
// One pass over fp32 master weights, gradients and both moment buffers, optionally writing the bf16 copy of
// the updated weights in the same pass (the buffer the accelerator reads back). The arithmetic is R16's
// sequence exactly: one IEEE rounding per operation, no fused multiply-add (the target is compiled with
// -ffp-contract=off), correctly rounded sqrt and division (the SSE/AVX instructions are), hyper-parameter
// expressions precomputed in fp64 by the caller and rounded to fp32 once. Hence the result is bitwise equal
// to the reference's torch-op sequence on every ISA variant.
//
// Variants: scalar (portable), AVX2, AVX-512F; chosen at run time with __builtin_cpu_supports, each compiled
// with a target attribute, so the library runs on any x86-64 and never needs -march=native.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hostoffload {
namespace cpu_adam {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// R29: the precision the moments exp_avg / exp_avg_sq are stored in. kBf16: each is read as bf16 and widened to
// fp32 (exact), the step runs in fp32 as R16 says (the weights from the unrounded new moments), and the new moments
// are stored rounded to nearest even (to_bf16 below: the contract's round_to_bf16; NaN -> 0x7FC0).
enum class StatePrecision { kFp32 = 0, kBf16 = 1 };

// Hyper-parameters already rounded to fp32 where they meet a tensor (R16).
struct AdamScalars {
    float beta1;                 // b1
    float one_minus_beta1;       // 1 - b1            (fp64 expression, rounded once)
    float beta2;                 // b2
    float one_minus_beta2;       // 1 - b2
    float inv_bias_correction2;  // 1 / sqrt(1 - b2^t)
    float eps;                   // eps
    float step_size;             // lr / (1 - b1^t)
    float decay;                 // AdamW: 1 - lr*wd ; Adam: wd
    float grad_scale;            // clipping coefficient (R15), applied when has_grad_scale
    bool decoupled;              // AdamW
    bool has_weight_decay;       // wd > 0
    bool has_grad_scale;         // coef < 1
};

// The arrays of one step. bf16_out may be null; grad is read-only. exp_avg / exp_avg_sq point to n floats
// (StatePrecision::kFp32) or n bf16 bit patterns (kBf16), as `precision` says. backup_*: all null, or all set
// (R30's speculative update): each block's param / exp_avg / exp_avg_sq are copied there, bytes as stored, just
// before the block is updated -- while the block is read into cache anyway, so the backup costs its writes only,
// not a second pass over the state.
struct AdamArrays {
    float* param;
    // n floats (grad_precision kFp32), or n bf16 bit patterns (kBf16: a bf16 accumulation's sum, R11), widened to
    // fp32 on load -- exactly, so the step is the one the widened copy would give, without writing that copy.
    const void* grad;
    void* exp_avg;
    void* exp_avg_sq;
    std::uint16_t* bf16_out;
    std::size_t n;
    StatePrecision precision;
    float* backup_param = nullptr;
    void* backup_exp_avg = nullptr;
    void* backup_exp_avg_sq = nullptr;
    StatePrecision grad_precision = StatePrecision::kFp32;
};

std::vector<std::string> available_isas();
std::string best_isa();
// Throws std::invalid_argument for an unknown or unavailable ISA name.
Isa parse_isa(const std::string& name);
// Throws std::invalid_argument for a name other than "fp32" / "bf16".
StatePrecision parse_state_precision(const std::string& name);

// Runs the step on up to `threads` threads (<= 1: the calling thread only), the calling thread and the process's
// persistent worker pool (worker_pool.h), claiming blocks of whole cache lines dynamically. Thread creation
// failures leave fewer workers (the calling thread always works), so the step always completes. Concurrent calls
// are serialised; the result never depends on the thread count or the split (the formula is element-wise).
void adam_step(const AdamArrays& arrays, const AdamScalars& scalars, Isa isa, int threads);

// fp32 -> bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16) rounds every non-NaN value; NaN becomes
// the quiet NaN 0x7FC0 (torch's own NaN payload differs between versions and kernels; it is still a NaN).
void cast_to_bf16(const float* src, std::uint16_t* dst, std::size_t n, Isa isa, int threads);

}  // namespace cpu_adam
}  // namespace hostoffload
