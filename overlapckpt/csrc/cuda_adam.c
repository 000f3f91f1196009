/* overlapckpt's native helper for replay: CUDA's fused and foreach Adam / AdamW updates on float32 host arrays.
 *
 * Replay rolls a snapshot forward on the CPU. For a fused Adam/AdamW that stepped on a GPU it
 * must round as CUDA's fused kernel does (aten/src/ATen/native/cuda/fused_adam_utils.cuh,
 * torch 2.11): lr, betas, weight decay and eps in float32, the moments by FMAs. The Python
 * twin (overlapckpt/fused_adam_math.py) computes the same with about twenty torch passes over
 * each tensor; this is one pass, vectorized: about 0.8 ns per element on one thread, beside
 * 0.7 for the CPU's own fused kernel and about 20 for the twin
 * (benchmarks/results/replay-arithmetic/run3.txt).
 *
 * Every operation is written out and rounded once: fmaf is the exact fused multiply-add,
 * sqrtf and the division IEEE. Built with -ffp-contract=off, so the compiler contracts
 * nothing the kernel does not, and never with -ffast-math (-fno-trapping-math only lets it
 * vectorize the selects; it changes no result). target_clones picks the FMA
 * instruction where the CPU has it, else libm's exact fmaf. The caller (cuda_adam_native.py)
 * passes contiguous float32 arrays and the per-step scalars the kernel computes per tensor.
 *
 * The foreach path (overlapckpt/foreach_adam_math.py) is a sequence of kernels, each storing
 * its result: in float32 that is one pass with each kernel's rounding in order, lerp and
 * addcmul / addcdiv contracted into FMAs as nvcc contracts them.
 */
#include <math.h>
#include <stdint.h>

/* Weight decay as the fused kernel applies it: none, AdamW's, Adam's L2 term contracted, or rounded first. */
enum { WD_NONE = 0, WD_DECOUPLED = 1, WD_L2_CONTRACTED = 2, WD_L2_ROUNDED = 3 };

/* One loop per combination of the branches (inlined with constants below): a loop without
 * control flow vectorizes, and each vector lane rounds as the scalar code does (fmaf is the
 * exact fused multiply-add in every lane; division and sqrt are IEEE in every lane). */
static inline __attribute__((always_inline)) void fused_loop(
    float *restrict param, const float *restrict grad, float *restrict exp_avg, float *restrict exp_avg_sq,
    float *restrict max_exp_avg_sq, int64_t count, float lr_times_weight_decay, float beta1, float beta2,
    float weight_decay, float eps, float step_size, float bias_correction2_sqrt, const int wd_mode, const int maximize,
    const int amsgrad) {
    for (int64_t i = 0; i < count; ++i) {
        float p = param[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
        if (maximize) {
            g = -g;
        }
        if (wd_mode == WD_DECOUPLED) {
            p = fmaf(-lr_times_weight_decay, p, p); /* param -= lr * weight_decay * param */
        } else if (wd_mode == WD_L2_CONTRACTED) {
            g = fmaf(p, weight_decay, g); /* grad += param * weight_decay */
        } else if (wd_mode == WD_L2_ROUNDED) {
            float l2 = p * weight_decay; /* the same, the product rounded first */
            g = g + l2;
        }
        m = fmaf(beta1, m, fmaf(-beta1, g, g));
        float gg = g * g;
        v = fmaf(beta2, v, fmaf(-beta2, gg, gg));
        float peak = v;
        if (amsgrad) {
            float held = max_exp_avg_sq[i];
            peak = held < v ? v : held; /* std::max(max_exp_avg_sq, exp_avg_sq) */
            max_exp_avg_sq[i] = peak;
        }
        float denom = sqrtf(peak) / bias_correction2_sqrt + eps;
        float update = step_size * m;
        param[i] = p - update / denom;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

#define FUSED_CASE(WD, MAX, AMS)                                                                                   \
    case (WD) * 4 + (MAX) * 2 + (AMS):                                                                             \
        fused_loop(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, count, lr_times_weight_decay, beta1, beta2,    \
                   weight_decay, eps, step_size, bias_correction2_sqrt, (WD), (MAX), (AMS));                       \
        break;
#define FUSED_CASES(WD) FUSED_CASE(WD, 0, 0) FUSED_CASE(WD, 0, 1) FUSED_CASE(WD, 1, 0) FUSED_CASE(WD, 1, 1)

__attribute__((target_clones("fma", "default")))
void overlapckpt_cuda_fused_adam_f32(float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                                     float *max_exp_avg_sq, int64_t count, float lr_times_weight_decay, float beta1,
                                     float beta2, float weight_decay, float eps, float step_size,
                                     float bias_correction2_sqrt, int decoupled_weight_decay, int l2_contracted,
                                     int maximize) {
    int wd_mode = weight_decay == 0.0f ? WD_NONE
                  : decoupled_weight_decay ? WD_DECOUPLED
                  : l2_contracted ? WD_L2_CONTRACTED
                  : WD_L2_ROUNDED;
    switch (wd_mode * 4 + (maximize ? 2 : 0) + (max_exp_avg_sq ? 1 : 0)) {
        FUSED_CASES(WD_NONE)
        FUSED_CASES(WD_DECOUPLED)
        FUSED_CASES(WD_L2_CONTRACTED)
        FUSED_CASES(WD_L2_ROUNDED)
    }
}

/* NaN-propagating, as torch.maximum and CUDA's _foreach_maximum_. */
static inline float maximum_propagating_nan(float a, float b) {
    if (isnan(a) || isnan(b)) {
        return a + b;
    }
    return a < b ? b : a;
}

static inline __attribute__((always_inline)) void foreach_loop(
    float *restrict param, const float *restrict grad, float *restrict exp_avg, float *restrict exp_avg_sq,
    float *restrict max_exp_avg_sq, int64_t count, float weight_decay, float decay, float lerp_weight, float beta2,
    float one_minus_beta2, float eps, float step_size, float bias_correction2_sqrt, const int wd_mode,
    const int maximize, const int amsgrad, const int capturable, const int lerp_from_start) {
    const float one_minus_lerp_weight = 1.0f - lerp_weight;
    for (int64_t i = 0; i < count; ++i) {
        float p = param[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
        if (maximize) {
            g = -g; /* _foreach_neg */
        }
        if (wd_mode == WD_DECOUPLED) {
            p = p * decay; /* _foreach_mul_(params, 1 - lr * weight_decay) */
        } else if (wd_mode == WD_L2_CONTRACTED) {
            g = fmaf(weight_decay, p, g); /* _foreach_add(grads, params, alpha=weight_decay) */
        }
        float difference = g - m; /* _foreach_lerp_(exp_avgs, grads, 1 - beta1): ATen's two formulas, by the weight */
        m = lerp_from_start ? fmaf(lerp_weight, difference, m) : fmaf(-difference, one_minus_lerp_weight, g);
        v = v * beta2; /* _foreach_mul_(exp_avg_sqs, beta2) */
        float gg = g * g;
        v = fmaf(one_minus_beta2, gg, v); /* _foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2) */
        float peak = v;
        if (amsgrad) {
            peak = maximum_propagating_nan(max_exp_avg_sq[i], v); /* _foreach_maximum_ */
            max_exp_avg_sq[i] = peak;
        }
        float denominator = sqrtf(peak); /* _foreach_sqrt */
        denominator = denominator / bias_correction2_sqrt; /* _foreach_div_ */
        denominator = denominator + eps; /* _foreach_add_ */
        if (capturable) {
            denominator = denominator / step_size; /* _foreach_div_(denominators, step_size) */
            param[i] = p + m / denominator; /* _foreach_addcdiv_(params, exp_avgs, denominators): fma(1, q, p) */
        } else {
            param[i] = fmaf(step_size, m / denominator, p); /* _foreach_addcdiv_(params, exp_avgs, denominators, step_size) */
        }
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

#define FOREACH_CASE(WD, MAX, AMS, CAP, LERP)                                                                      \
    case (((((WD) * 2 + (MAX)) * 2 + (AMS)) * 2 + (CAP)) * 2 + (LERP)):                                            \
        foreach_loop(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, count, weight_decay, decay, lerp_weight,     \
                     beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt, (WD), (MAX), (AMS), (CAP), (LERP)); \
        break;
#define FOREACH_CASES_L(WD, MAX, AMS, CAP) FOREACH_CASE(WD, MAX, AMS, CAP, 0) FOREACH_CASE(WD, MAX, AMS, CAP, 1)
#define FOREACH_CASES_C(WD, MAX, AMS) FOREACH_CASES_L(WD, MAX, AMS, 0) FOREACH_CASES_L(WD, MAX, AMS, 1)
#define FOREACH_CASES_A(WD, MAX) FOREACH_CASES_C(WD, MAX, 0) FOREACH_CASES_C(WD, MAX, 1)
#define FOREACH_CASES(WD) FOREACH_CASES_A(WD, 0) FOREACH_CASES_A(WD, 1)

__attribute__((target_clones("fma", "default")))
void overlapckpt_cuda_foreach_adam_f32(float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                                       float *max_exp_avg_sq, int64_t count, float weight_decay, float decay,
                                       float lerp_weight, float beta2, float one_minus_beta2, float eps, float step_size,
                                       float bias_correction2_sqrt, int decoupled_weight_decay, int maximize,
                                       int capturable) {
    int wd_mode = weight_decay == 0.0f ? WD_NONE : decoupled_weight_decay ? WD_DECOUPLED : WD_L2_CONTRACTED;
    int lerp_from_start = fabsf(lerp_weight) < 0.5f;
    switch (((((wd_mode * 2 + (maximize ? 1 : 0)) * 2 + (max_exp_avg_sq ? 1 : 0)) * 2 + (capturable ? 1 : 0)) * 2) +
            lerp_from_start) {
        FOREACH_CASES(WD_NONE)
        FOREACH_CASES(WD_DECOUPLED)
        FOREACH_CASES(WD_L2_CONTRACTED)
    }
}

/* Several steps of one tensor, each element carried through all of them while it is in cache.
 *
 * Replay steps a copy group W times. One step per pass reads and writes param and both moments
 * from memory W times: about 28 bytes per element and step, which bounds the pass on memory
 * bandwidth, not arithmetic. Here the tensor goes in blocks of BLOCK_ELEMENTS: each block is
 * stepped through every step before the next block, so param and the moments come from memory
 * once and only each step's gradient streams. Every element still meets the same operations in
 * the same order as in W single-step calls: the same bits (tests/test_replay_steps.py).
 *
 * ``grad_addresses[s]`` is step s's gradient; ``scalars`` holds each step's float scalars in
 * the single-step function's order (7 fused, 8 foreach), ``flags`` its int flags (3 each). */
#define BLOCK_ELEMENTS 2048
#define FUSED_FLOATS 7
#define FOREACH_FLOATS 8
#define STEP_FLAGS 3

void overlapckpt_cuda_fused_adam_f32_steps(float *param, const int64_t *grad_addresses, float *exp_avg,
                                           float *exp_avg_sq, float *max_exp_avg_sq, int64_t count, int64_t steps,
                                           const float *scalars, const int32_t *flags) {
    for (int64_t begin = 0; begin < count; begin += BLOCK_ELEMENTS) {
        int64_t n = count - begin < BLOCK_ELEMENTS ? count - begin : BLOCK_ELEMENTS;
        for (int64_t s = 0; s < steps; ++s) {
            const float *f = scalars + s * FUSED_FLOATS;
            const int32_t *k = flags + s * STEP_FLAGS;
            overlapckpt_cuda_fused_adam_f32(param + begin, (const float *)(intptr_t)grad_addresses[s] + begin,
                                            exp_avg + begin, exp_avg_sq + begin,
                                            max_exp_avg_sq ? max_exp_avg_sq + begin : 0, n, f[0], f[1], f[2], f[3],
                                            f[4], f[5], f[6], k[0], k[1], k[2]);
        }
    }
}

void overlapckpt_cuda_foreach_adam_f32_steps(float *param, const int64_t *grad_addresses, float *exp_avg,
                                             float *exp_avg_sq, float *max_exp_avg_sq, int64_t count, int64_t steps,
                                             const float *scalars, const int32_t *flags) {
    for (int64_t begin = 0; begin < count; begin += BLOCK_ELEMENTS) {
        int64_t n = count - begin < BLOCK_ELEMENTS ? count - begin : BLOCK_ELEMENTS;
        for (int64_t s = 0; s < steps; ++s) {
            const float *f = scalars + s * FOREACH_FLOATS;
            const int32_t *k = flags + s * STEP_FLAGS;
            overlapckpt_cuda_foreach_adam_f32(param + begin, (const float *)(intptr_t)grad_addresses[s] + begin,
                                              exp_avg + begin, exp_avg_sq + begin,
                                              max_exp_avg_sq ? max_exp_avg_sq + begin : 0, n, f[0], f[1], f[2], f[3],
                                              f[4], f[5], f[6], f[7], k[0], k[1], k[2]);
        }
    }
}
