/* overlapckpt's native helper for replay: CUDA's fused and foreach Adam / AdamW updates on float32 host arrays.
 *
 * Replay rolls a snapshot forward on the CPU. For a fused Adam/AdamW that stepped on a GPU it
 * must round as CUDA's fused kernel does (aten/src/ATen/native/cuda/fused_adam_utils.cuh,
 * torch 2.11): lr, betas, weight decay and eps in float32, the moments by FMAs. The Python
 * twin (overlapckpt/fused_adam_math.py) computes the same with about twenty torch passes over
 * each tensor; this is one pass: about 4 ns per element on one thread, against under 1 ns for
 * the CPU's own fused kernel and 17 to 29 for the twin (benchmarks/fused_replay_speed.py).
 *
 * Every operation is written out and rounded once: fmaf is the exact fused multiply-add,
 * sqrtf and the division IEEE. Built with -ffp-contract=off, so the compiler contracts
 * nothing the kernel does not, and never with -ffast-math. target_clones picks the FMA
 * instruction where the CPU has it, else libm's exact fmaf. The caller (cuda_adam_native.py)
 * passes contiguous float32 arrays and the per-step scalars the kernel computes per tensor.
 *
 * The foreach path (overlapckpt/foreach_adam_math.py) is a sequence of kernels, each storing
 * its result: in float32 that is one pass with each kernel's rounding in order, lerp and
 * addcmul / addcdiv contracted into FMAs as nvcc contracts them.
 */
#include <math.h>
#include <stdint.h>

__attribute__((target_clones("fma", "default")))
void overlapckpt_cuda_fused_adam_f32(float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                                     float *max_exp_avg_sq, int64_t count, float lr_times_weight_decay, float beta1,
                                     float beta2, float weight_decay, float eps, float step_size,
                                     float bias_correction2_sqrt, int decoupled_weight_decay, int l2_contracted,
                                     int maximize) {
    for (int64_t i = 0; i < count; ++i) {
        float p = param[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
        if (maximize) {
            g = -g;
        }
        if (weight_decay != 0.0f) {
            if (decoupled_weight_decay) {
                p = fmaf(-lr_times_weight_decay, p, p); /* param -= lr * weight_decay * param */
            } else if (l2_contracted) {
                g = fmaf(p, weight_decay, g); /* grad += param * weight_decay */
            } else {
                float l2 = p * weight_decay; /* the same, the product rounded first */
                g = g + l2;
            }
        }
        m = fmaf(beta1, m, fmaf(-beta1, g, g));
        float gg = g * g;
        v = fmaf(beta2, v, fmaf(-beta2, gg, gg));
        float peak = v;
        if (max_exp_avg_sq) {
            peak = max_exp_avg_sq[i] < v ? v : max_exp_avg_sq[i]; /* std::max(max_exp_avg_sq, exp_avg_sq) */
            max_exp_avg_sq[i] = peak;
        }
        float denom = sqrtf(peak) / bias_correction2_sqrt + eps;
        float update = step_size * m;
        param[i] = p - update / denom;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

/* NaN-propagating, as torch.maximum and CUDA's _foreach_maximum_. */
static inline float maximum_propagating_nan(float a, float b) {
    if (isnan(a) || isnan(b)) {
        return a + b;
    }
    return a < b ? b : a;
}

__attribute__((target_clones("fma", "default")))
void overlapckpt_cuda_foreach_adam_f32(float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                                       float *max_exp_avg_sq, int64_t count, float weight_decay, float decay,
                                       float lerp_weight, float beta2, float one_minus_beta2, float eps, float step_size,
                                       float bias_correction2_sqrt, int decoupled_weight_decay, int maximize,
                                       int capturable) {
    const int lerp_from_start = fabsf(lerp_weight) < 0.5f; /* ATen's lerp: two formulas, by the weight */
    const float one_minus_lerp_weight = 1.0f - lerp_weight;
    for (int64_t i = 0; i < count; ++i) {
        float p = param[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
        if (maximize) {
            g = -g; /* _foreach_neg */
        }
        if (weight_decay != 0.0f) {
            if (decoupled_weight_decay) {
                p = p * decay; /* _foreach_mul_(params, 1 - lr * weight_decay) */
            } else {
                g = fmaf(weight_decay, p, g); /* _foreach_add(grads, params, alpha=weight_decay) */
            }
        }
        float difference = g - m; /* _foreach_lerp_(exp_avgs, grads, 1 - beta1) */
        m = lerp_from_start ? fmaf(lerp_weight, difference, m) : fmaf(-difference, one_minus_lerp_weight, g);
        v = v * beta2; /* _foreach_mul_(exp_avg_sqs, beta2) */
        float gg = g * g;
        v = fmaf(one_minus_beta2, gg, v); /* _foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2) */
        float peak = v;
        if (max_exp_avg_sq) {
            peak = maximum_propagating_nan(max_exp_avg_sq[i], v); /* _foreach_maximum_ */
            max_exp_avg_sq[i] = peak;
        }
        float denominator = sqrtf(peak); /* _foreach_sqrt */
        denominator = denominator / bias_correction2_sqrt; /* _foreach_div_ */
        denominator = denominator + eps; /* _foreach_add_ */
        if (capturable) {
            denominator = denominator / step_size; /* _foreach_div_(denominators, step_size) */
            float quotient = m / denominator;
            param[i] = p + quotient; /* _foreach_addcdiv_(params, exp_avgs, denominators): fma(1, q, p) */
        } else {
            float quotient = m / denominator;
            param[i] = fmaf(step_size, quotient, p); /* _foreach_addcdiv_(params, exp_avgs, denominators, step_size) */
        }
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}
