/* overlapckpt's native helper for replay: CUDA's fused Adam / AdamW update on float32 host arrays.
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
 * instruction where the CPU has it, else libm's exact fmaf. The caller (fused_adam_native.py)
 * passes contiguous float32 arrays and the per-step scalars the kernel computes per tensor.
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
