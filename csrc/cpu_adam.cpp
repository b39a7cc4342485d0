// Native CPU Adam / AdamW kernels (see cpu_adam.h for the contract). No Python here: the binding is
// bind_cpu_adam.cpp, part of the one extension module optimized._native.
#include "cpu_adam.h"
#include "worker_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HOSTOFFLOAD_X86 1
#else
#define HOSTOFFLOAD_X86 0
#endif

namespace hostoffload {
namespace cpu_adam {
namespace {

// ---- one element, the R16 sequence (also the tail of the vector loops) ---------------------------------
// m and v are the widened stored moments on entry and the new fp32 moments on return (the caller stores them).
inline void adam_element(float& p_ref, float g, float& m_ref, float& v_ref, const AdamScalars& s) {
    float p = p_ref;
    if (s.has_grad_scale) g = g * s.grad_scale;
    if (s.has_weight_decay) {
        if (s.decoupled) {
            p = p * s.decay;
        } else {
            g = g + p * s.decay;
        }
    }
    const float m = m_ref * s.beta1 + g * s.one_minus_beta1;
    const float v = v_ref * s.beta2 + (g * g) * s.one_minus_beta2;
    const float denom = std::sqrt(v) * s.inv_bias_correction2 + s.eps;
    p = p - (m / denom) * s.step_size;
    m_ref = m;
    v_ref = v;
    p_ref = p;
}

// Round to nearest even; NaN -> the quiet NaN 0x7FC0 (any NaN payload is a NaN to the caller). The definition is
// R29's round_to_bf16 (reference/contract/accumulation_state_precision.py), word for word.
inline std::uint16_t to_bf16(float x) {
    if (x != x) return 0x7FC0;
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>(u >> 16);
}

// bf16 -> fp32 is exact: the bf16 bits are the upper half of the fp32 word.
inline float from_bf16(std::uint16_t b) {
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
}

// The stored form of the moments (R29): Moments<P>::Word is the element type, load widens, store rounds.
template <StatePrecision P>
struct Moments;

template <>
struct Moments<StatePrecision::kFp32> {
    using Word = float;
    static float load(const Word* a, std::size_t i) { return a[i]; }
    static void store(Word* a, std::size_t i, float x) { a[i] = x; }
};

template <>
struct Moments<StatePrecision::kBf16> {
    using Word = std::uint16_t;
    static float load(const Word* a, std::size_t i) { return from_bf16(a[i]); }
    static void store(Word* a, std::size_t i, float x) { a[i] = to_bf16(x); }
};

// P: the moments' stored form; G: the gradient's (read only, widened exactly).
template <StatePrecision P, StatePrecision G>
void adam_scalar(const AdamArrays& a, const AdamScalars& s, std::size_t lo, std::size_t hi) {
    using M = Moments<P>;
    auto* ma = static_cast<typename M::Word*>(a.exp_avg);
    auto* va = static_cast<typename M::Word*>(a.exp_avg_sq);
    const auto* ga = static_cast<const typename Moments<G>::Word*>(a.grad);
    for (std::size_t i = lo; i < hi; ++i) {
        float m = M::load(ma, i);
        float v = M::load(va, i);
        adam_element(a.param[i], Moments<G>::load(ga, i), m, v, s);
        M::store(ma, i, m);
        M::store(va, i, v);
        if (a.bf16_out != nullptr) a.bf16_out[i] = to_bf16(a.param[i]);
    }
}

void cast_scalar(const float* src, std::uint16_t* dst, std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) dst[i] = to_bf16(src[i]);
}

#if HOSTOFFLOAD_X86
// ---- AVX2 (8 lanes) ----------------------------------------------------------------------------------------
__attribute__((target("avx2"))) inline __m128i bf16_avx2(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // packus works per 128-bit lane: keep qwords 0 and 2 to get the 8 results in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

__attribute__((target("avx2"))) inline __m256 widen_avx2(const std::uint16_t* src) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <StatePrecision P>
__attribute__((target("avx2"))) inline __m256 load_moment_avx2(const void* a, std::size_t i) {
    if constexpr (P == StatePrecision::kBf16) {
        return widen_avx2(static_cast<const std::uint16_t*>(a) + i);
    } else {
        return _mm256_loadu_ps(static_cast<const float*>(a) + i);
    }
}

template <StatePrecision P>
__attribute__((target("avx2"))) inline void store_moment_avx2(void* a, std::size_t i, __m256 x) {
    if constexpr (P == StatePrecision::kBf16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(a) + i), bf16_avx2(x));
    } else {
        _mm256_storeu_ps(static_cast<float*>(a) + i, x);
    }
}

template <StatePrecision P, StatePrecision G>
__attribute__((target("avx2"))) void adam_avx2(const AdamArrays& a, const AdamScalars& s, std::size_t lo,
                                                std::size_t hi) {
    const __m256 b1 = _mm256_set1_ps(s.beta1), omb1 = _mm256_set1_ps(s.one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_beta2);
    const __m256 ibc2 = _mm256_set1_ps(s.inv_bias_correction2), eps = _mm256_set1_ps(s.eps);
    const __m256 step = _mm256_set1_ps(s.step_size), decay = _mm256_set1_ps(s.decay);
    const __m256 scale = _mm256_set1_ps(s.grad_scale);
    std::size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 p = _mm256_loadu_ps(a.param + i);
        __m256 g = load_moment_avx2<G>(a.grad, i);
        __m256 m = load_moment_avx2<P>(a.exp_avg, i);
        __m256 v = load_moment_avx2<P>(a.exp_avg_sq, i);
        if (s.has_grad_scale) g = _mm256_mul_ps(g, scale);
        if (s.has_weight_decay) {
            if (s.decoupled) {
                p = _mm256_mul_ps(p, decay);
            } else {
                g = _mm256_add_ps(g, _mm256_mul_ps(p, decay));
            }
        }
        m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(g, omb1));
        v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
        const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
        p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_div_ps(m, denom), step));
        _mm256_storeu_ps(a.param + i, p);
        store_moment_avx2<P>(a.exp_avg, i, m);
        store_moment_avx2<P>(a.exp_avg_sq, i, v);
        if (a.bf16_out != nullptr) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(a.bf16_out + i), bf16_avx2(p));
        }
    }
    adam_scalar<P, G>(a, s, i, hi);
}

__attribute__((target("avx2"))) void cast_avx2(const float* src, std::uint16_t* dst, std::size_t lo,
                                                std::size_t hi) {
    std::size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16_avx2(_mm256_loadu_ps(src + i)));
    }
    cast_scalar(src, dst, i, hi);
}

// ---- AVX-512F (16 lanes) -------------------------------------------------------------------------------
__attribute__((target("avx512f"))) inline __m256i bf16_avx512(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

__attribute__((target("avx512f"))) inline __m512 widen_avx512(const std::uint16_t* src) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

template <StatePrecision P>
__attribute__((target("avx512f"))) inline __m512 load_moment_avx512(const void* a, std::size_t i) {
    if constexpr (P == StatePrecision::kBf16) {
        return widen_avx512(static_cast<const std::uint16_t*>(a) + i);
    } else {
        return _mm512_loadu_ps(static_cast<const float*>(a) + i);
    }
}

template <StatePrecision P>
__attribute__((target("avx512f"))) inline void store_moment_avx512(void* a, std::size_t i, __m512 x) {
    if constexpr (P == StatePrecision::kBf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(a) + i), bf16_avx512(x));
    } else {
        _mm512_storeu_ps(static_cast<float*>(a) + i, x);
    }
}

template <StatePrecision P, StatePrecision G>
__attribute__((target("avx512f"))) void adam_avx512(const AdamArrays& a, const AdamScalars& s, std::size_t lo,
                                                     std::size_t hi) {
    const __m512 b1 = _mm512_set1_ps(s.beta1), omb1 = _mm512_set1_ps(s.one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_minus_beta2);
    const __m512 ibc2 = _mm512_set1_ps(s.inv_bias_correction2), eps = _mm512_set1_ps(s.eps);
    const __m512 step = _mm512_set1_ps(s.step_size), decay = _mm512_set1_ps(s.decay);
    const __m512 scale = _mm512_set1_ps(s.grad_scale);
    std::size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 p = _mm512_loadu_ps(a.param + i);
        __m512 g = load_moment_avx512<G>(a.grad, i);
        __m512 m = load_moment_avx512<P>(a.exp_avg, i);
        __m512 v = load_moment_avx512<P>(a.exp_avg_sq, i);
        if (s.has_grad_scale) g = _mm512_mul_ps(g, scale);
        if (s.has_weight_decay) {
            if (s.decoupled) {
                p = _mm512_mul_ps(p, decay);
            } else {
                g = _mm512_add_ps(g, _mm512_mul_ps(p, decay));
            }
        }
        m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, omb1));
        v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
        const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), ibc2), eps);
        p = _mm512_sub_ps(p, _mm512_mul_ps(_mm512_div_ps(m, denom), step));
        _mm512_storeu_ps(a.param + i, p);
        store_moment_avx512<P>(a.exp_avg, i, m);
        store_moment_avx512<P>(a.exp_avg_sq, i, v);
        if (a.bf16_out != nullptr) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.bf16_out + i), bf16_avx512(p));
        }
    }
    adam_scalar<P, G>(a, s, i, hi);
}

__attribute__((target("avx512f"))) void cast_avx512(const float* src, std::uint16_t* dst, std::size_t lo,
                                                     std::size_t hi) {
    std::size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16_avx512(_mm512_loadu_ps(src + i)));
    }
    cast_scalar(src, dst, i, hi);
}

bool cpu_has(Isa isa) {
    __builtin_cpu_init();
    switch (isa) {
        case Isa::kScalar:
            return true;
        case Isa::kAvx2:
            return __builtin_cpu_supports("avx2") != 0;
        case Isa::kAvx512:
            return __builtin_cpu_supports("avx512f") != 0;
    }
    return false;
}
#else
bool cpu_has(Isa isa) { return isa == Isa::kScalar; }
#endif

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::kScalar:
            return "scalar";
        case Isa::kAvx2:
            return "avx2";
        case Isa::kAvx512:
            return "avx512";
    }
    return "scalar";
}

// Block size of the parallel loops: a multiple of 64 elements, so a block boundary never splits a cache line of
// the fp32 arrays or of the bf16 output (given 64-byte aligned buffers, as torch allocates them), and no two
// threads write the same line. Large enough (16K to 64K elements: 64 to 256 KiB per fp32 stream) that claiming a
// block and the hardware prefetchers' ramp-up are negligible; small enough that each thread gets several blocks
// (about kBlocksPerThread), so a slow vCPU only delays the end by a fraction of its share. Below kMinParallel
// elements (tens of microseconds of work) waking other threads costs about as much as it saves.
constexpr std::size_t kLine = 64;
constexpr std::size_t kMinBlock = 1u << 14;
constexpr std::size_t kMaxBlock = 1u << 16;
constexpr std::size_t kMinParallel = 1u << 16;
constexpr std::size_t kBlocksPerThread = 4;

std::size_t block_size(std::size_t n, int threads) {
    const std::size_t t = threads < 1 ? 1 : static_cast<std::size_t>(threads);
    std::size_t per = n / (t * kBlocksPerThread) + 1;
    per = (per + kLine - 1) / kLine * kLine;
    return std::min(kMaxBlock, std::max(kMinBlock, per));
}

// Runs body(lo, hi) over [0, n) on the process's worker pool (worker_pool.h), the calling thread included.
template <typename Body>
void parallel_ranges(std::size_t n, int threads, const Body& body) {
    if (n < kMinParallel || threads <= 1) {
        body(0, n);
        return;
    }
    worker_pool::parallel_blocks(n, block_size(n, threads), threads, body);
}

// R30: the block's state as it is before the update, into the backup arrays (see AdamArrays).
template <StatePrecision P>
void back_up(const AdamArrays& a, std::size_t lo, std::size_t hi) {
    using Word = typename Moments<P>::Word;
    const std::size_t n = hi - lo;
    std::memcpy(a.backup_param + lo, a.param + lo, n * sizeof(float));
    std::memcpy(static_cast<Word*>(a.backup_exp_avg) + lo, static_cast<const Word*>(a.exp_avg) + lo,
                n * sizeof(Word));
    std::memcpy(static_cast<Word*>(a.backup_exp_avg_sq) + lo, static_cast<const Word*>(a.exp_avg_sq) + lo,
                n * sizeof(Word));
}

template <StatePrecision P, StatePrecision G>
void adam_dispatch(const AdamArrays& arrays, const AdamScalars& scalars, Isa isa, int threads) {
    parallel_ranges(arrays.n, threads, [&](std::size_t lo, std::size_t hi) {
        if (arrays.backup_param != nullptr) back_up<P>(arrays, lo, hi);
        switch (isa) {
#if HOSTOFFLOAD_X86
            case Isa::kAvx512:
                adam_avx512<P, G>(arrays, scalars, lo, hi);
                return;
            case Isa::kAvx2:
                adam_avx2<P, G>(arrays, scalars, lo, hi);
                return;
#endif
            default:
                adam_scalar<P, G>(arrays, scalars, lo, hi);
        }
    });
}

}  // namespace

StatePrecision parse_state_precision(const std::string& name) {
    if (name == "fp32") return StatePrecision::kFp32;
    if (name == "bf16") return StatePrecision::kBf16;
    throw std::invalid_argument("state_precision='" + name + "' is unknown; allowed values: fp32, bf16");
}

std::vector<std::string> available_isas() {
    std::vector<std::string> out;
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
        if (cpu_has(isa)) out.emplace_back(isa_name(isa));
    }
    return out;
}

std::string best_isa() {
    if (cpu_has(Isa::kAvx512)) return isa_name(Isa::kAvx512);
    if (cpu_has(Isa::kAvx2)) return isa_name(Isa::kAvx2);
    return isa_name(Isa::kScalar);
}

Isa parse_isa(const std::string& name) {
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
        if (name == isa_name(isa)) {
            if (!cpu_has(isa)) {
                throw std::invalid_argument("isa='" + name + "' is not supported by this CPU; allowed values: " +
                                            [] {
                                                std::string s;
                                                for (const auto& n : available_isas()) s += (s.empty() ? "" : ", ") + n;
                                                return s;
                                            }());
            }
            return isa;
        }
    }
    throw std::invalid_argument("isa='" + name + "' is unknown; allowed values: scalar, avx2, avx512");
}

void adam_step(const AdamArrays& arrays, const AdamScalars& scalars, Isa isa, int threads) {
    if (arrays.n == 0) return;
    if (arrays.param == nullptr || arrays.grad == nullptr || arrays.exp_avg == nullptr ||
        arrays.exp_avg_sq == nullptr) {
        throw std::invalid_argument("adam_step: param, grad, exp_avg and exp_avg_sq must be non-null");
    }
    const int backups = (arrays.backup_param != nullptr) + (arrays.backup_exp_avg != nullptr) +
                        (arrays.backup_exp_avg_sq != nullptr);
    if (backups != 0 && backups != 3) {
        throw std::invalid_argument("adam_step: backup_param, backup_exp_avg and backup_exp_avg_sq must be all set "
                                    "or all null");
    }
    using SP = StatePrecision;
    const bool bf16_moments = arrays.precision == SP::kBf16;
    if (arrays.grad_precision == SP::kBf16) {
        if (bf16_moments) {
            adam_dispatch<SP::kBf16, SP::kBf16>(arrays, scalars, isa, threads);
        } else {
            adam_dispatch<SP::kFp32, SP::kBf16>(arrays, scalars, isa, threads);
        }
    } else if (bf16_moments) {
        adam_dispatch<SP::kBf16, SP::kFp32>(arrays, scalars, isa, threads);
    } else {
        adam_dispatch<SP::kFp32, SP::kFp32>(arrays, scalars, isa, threads);
    }
}

void cast_to_bf16(const float* src, std::uint16_t* dst, std::size_t n, Isa isa, int threads) {
    if (n == 0) return;
    if (src == nullptr || dst == nullptr) throw std::invalid_argument("cast_to_bf16: src and dst must be non-null");
    parallel_ranges(n, threads, [&](std::size_t lo, std::size_t hi) {
        switch (isa) {
#if HOSTOFFLOAD_X86
            case Isa::kAvx512:
                cast_avx512(src, dst, lo, hi);
                return;
            case Isa::kAvx2:
                cast_avx2(src, dst, lo, hi);
                return;
#endif
            default:
                cast_scalar(src, dst, lo, hi);
        }
    });
}

}  // namespace cpu_adam
}  // namespace hostoffload
