/* pkgd CPU kernels: the loops shared by the generic kernels (kernels.c) and the fused decode
 * steps that model families build on them (e.g. pkgd/runner/models/llama_cpu_decode.c).
 *
 * Everything here is static inline: each library that includes this header compiles its own
 * copy, so no symbol crosses a library boundary and each library's ABI is only what it exports.
 *
 * Plain C with GCC vector extensions (16 floats: one AVX-512 register, two AVX2 ones); built
 * at first use with -O3 -march=native -fopenmp (pkgd_kernels/cpu/build.py). OpenMP is the
 * runtime torch itself uses (libgomp is shared by soname), so torch.set_num_threads applies.
 */
#ifndef PKGD_KERNELS_H
#define PKGD_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define LOADV(p) (*(const v16u*)(p))
#define STOREV(p, v) (*(v16u*)(p) = (v))
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* ---- GEMV on the [N/64][K][64] packing ------------------------------------------------ */

#define GEMV_PREFETCH_FLOATS 1024

static inline __attribute__((always_inline)) void gemv_block(
    const float* x, int64_t ldx, const float* wb, int64_t k0, int64_t k1, float* y, int64_t ldy,
    const float* bias, const int rows) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = (v16){0};
    for (int64_t kk = k0; kk < k1; kk++) {
        const float* wr = wb + kk * 64;
        /* 4 KiB ahead into L2 (prefetcht2): the hardware prefetcher alone left ~5-10% of the
         * read bandwidth unused here, more on a quiet host (prefetch hints never fault) */
        for (int c = 0; c < 64; c += 16) __builtin_prefetch(wr + GEMV_PREFETCH_FLOATS + c, 0, 1);
        v16 w0 = LOADV(wr), w1 = LOADV(wr + 16), w2 = LOADV(wr + 32), w3 = LOADV(wr + 48);
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            float xv = x[r * ldx + kk];
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
            acc[r][2] += xv * w2;
            acc[r][3] += xv * w3;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) {
            v16 o = acc[r][i];
            if (bias) o += LOADV(bias + 16 * i);
            STOREV(y + r * ldy + 16 * i, o);
        }
}

/* The 64 outputs of one packed block wb ([k][64]) for m rows of x over inputs [k0, k1); rows
 * are taken four at a time (the block stays in L1/L2 between groups, so only the first group
 * reads it from memory). y rows have stride ldy. */
static inline void gemv_rows(const float* x, int64_t ldx, const float* wb, int64_t k0, int64_t k1,
                             float* y, int64_t ldy, const float* bias, int64_t m) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) gemv_block(x + r * ldx, ldx, wb, k0, k1, y + r * ldy, ldy, bias, 4);
    switch (m - r) {
        case 3: gemv_block(x + r * ldx, ldx, wb, k0, k1, y + r * ldy, ldy, bias, 3); break;
        case 2: gemv_block(x + r * ldx, ldx, wb, k0, k1, y + r * ldy, ldy, bias, 2); break;
        case 1: gemv_block(x + r * ldx, ldx, wb, k0, k1, y + r * ldy, ldy, bias, 1); break;
        default: break;
    }
}

/* ---- GEMV on bf16 weights in oneDNN's [N/B][K/2][B][2] packing (B = 32 or 64) ---------- */

/* What torch.ops.mkldnn._reorder_linear_weight makes of a bf16 W [n, k] (checked at run time by
 * the caller against oneDNN's own product): element (v, c) at
 * w[((v / B) * (k / 2) + c / 2) * 2B + (v % B) * 2 + c % 2], so each 32-bit lane holds the pair
 * (W[v, 2j], W[v, 2j + 1]) of one output v: the operand layout of AVX512-BF16's vdpbf16ps.
 * oneDNN picks B by the CPU (32 on the AMX hosts seen, 64 on an AVX512-BF16 one without AMX), so the loops
 * below take a whole block of either width at a time: its B outputs are 2B contiguous elements
 * per pair j, the next pair right after, so a block is read front to back. x is rounded to bf16 pairs
 * first (xp[j] = bf16(x[2j]) | bf16(x[2j+1]) << 16), as a bf16 GEMM rounds its input; products
 * are summed in float32. Two ways to the same sums, chosen at run time (impl): vdpbf16ps where
 * the CPU has it (BF16_DP), else widening each bf16 to float32 by a shift (BF16_WIDEN:
 * AVX-512F, or two AVX2 registers a vector). */

enum { BF16_WIDEN = 0, BF16_DP = 1 };

typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16u __attribute__((vector_size(64), aligned(4)));
#define LOADU32(p) (*(const u32x16u*)(p))

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (finite inputs) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint32_t h) {
    const uint32_t u = h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* xp[r * (k / 2) + j] = the bf16 pair of x[r, 2j], x[r, 2j + 1]; x rows have stride ldx. */
static inline void pack_x_bf16(uint32_t* xp, const float* x, int64_t ldx, int64_t m, int64_t k) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 2; j++)
            xp[r * (k / 2) + j] = (uint32_t)f32_to_bf16(x[r * ldx + 2 * j]) |
                                  ((uint32_t)f32_to_bf16(x[r * ldx + 2 * j + 1]) << 16);
}

#define GEMV_BF16_PREFETCH 2048 /* bf16 elements ahead: 4 KiB, as the float32 GEMV */

/* The 16 * nv outputs at wb (pairs ldj elements apart; nv = 2, or 4 for a whole
 * 64-wide block) for `rows` rows of xp over pairs [j0, j1). */
static inline __attribute__((always_inline)) void gemv_bf16_block_widen(
    const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0, int64_t j1, float* y, int64_t ldy,
    const float* bias, const int rows, const int nv) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = (v16){0};
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t* wr = wb + j * ldj;
        v16 e[4], o[4];
#pragma GCC unroll 4
        for (int i = 0; i < nv; i++) {
            __builtin_prefetch(wr + GEMV_BF16_PREFETCH + 32 * i, 0, 1);
            const u32x16 w = LOADU32(wr + 32 * i);
            e[i] = (v16)(w << 16);
            o[i] = (v16)(w & 0xffff0000u);
        }
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const uint32_t p = xp[r * ldxp + j];
            const float xe = bf16_to_f32(p & 0xffffu), xo = bf16_to_f32(p >> 16);
#pragma GCC unroll 4
            for (int i = 0; i < nv; i++) acc[r][i] += xe * e[i] + xo * o[i];
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < nv; i++) {
            v16 out = acc[r][i];
            if (bias) out += LOADV(bias + 16 * i);
            STOREV(y + r * ldy + 16 * i, out);
        }
}

static inline __attribute__((always_inline)) void gemv_bf16_rows_widen_nv(
    const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0, int64_t j1, float* y, int64_t ldy,
    const float* bias, int64_t m, const int nv) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4)
        gemv_bf16_block_widen(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 4, nv);
    switch (m - r) {
        case 3: gemv_bf16_block_widen(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 3, nv); break;
        case 2: gemv_bf16_block_widen(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 2, nv); break;
        case 1: gemv_bf16_block_widen(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 1, nv); break;
        default: break;
    }
}

static void gemv_bf16_rows_widen(const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0,
                                 int64_t j1, float* y, int64_t ldy, const float* bias, int64_t m, int64_t outs) {
    if (outs == 64)
        gemv_bf16_rows_widen_nv(xp, ldxp, wb, ldj, j0, j1, y, ldy, bias, m, 4);
    else
        gemv_bf16_rows_widen_nv(xp, ldxp, wb, ldj, j0, j1, y, ldy, bias, m, 2);
}

#if defined(__x86_64__) && (__GNUC__ >= 10 || defined(__clang__))
#define PKGD_HAVE_BF16_DP 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
/* vdpbf16ps: acc[lane] += x.lo * w.lo + x.hi * w.hi for 16 outputs; compiled for AVX512-BF16
 * whatever -march says, called only where the CPU has it (pkgd_bf16_dot_native). */
static inline __attribute__((always_inline)) void gemv_bf16_block_dp(
    const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0, int64_t j1, float* y, int64_t ldy,
    const float* bias, const int rows, const int nv) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t* wr = wb + j * ldj;
        __m512bh w[4];
#pragma GCC unroll 4
        for (int i = 0; i < nv; i++) {
            _mm_prefetch((const char*)(wr + GEMV_BF16_PREFETCH + 32 * i), _MM_HINT_T1);
            w[i] = (__m512bh)_mm512_loadu_si512(wr + 32 * i);
        }
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[r * ldxp + j]);
#pragma GCC unroll 4
            for (int i = 0; i < nv; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w[i], xb);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < nv; i++) {
            __m512 o = acc[r][i];
            if (bias) o = _mm512_add_ps(o, _mm512_loadu_ps(bias + 16 * i));
            _mm512_storeu_ps(y + r * ldy + 16 * i, o);
        }
}

static inline __attribute__((always_inline)) void gemv_bf16_rows_dp_nv(
    const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0, int64_t j1, float* y, int64_t ldy,
    const float* bias, int64_t m, const int nv) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) gemv_bf16_block_dp(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 4, nv);
    switch (m - r) {
        case 3: gemv_bf16_block_dp(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 3, nv); break;
        case 2: gemv_bf16_block_dp(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 2, nv); break;
        case 1: gemv_bf16_block_dp(xp + r * ldxp, ldxp, wb, ldj, j0, j1, y + r * ldy, ldy, bias, 1, nv); break;
        default: break;
    }
}

static void gemv_bf16_rows_dp(const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0,
                              int64_t j1, float* y, int64_t ldy, const float* bias, int64_t m, int64_t outs) {
    if (outs == 64)
        gemv_bf16_rows_dp_nv(xp, ldxp, wb, ldj, j0, j1, y, ldy, bias, m, 4);
    else
        gemv_bf16_rows_dp_nv(xp, ldxp, wb, ldj, j0, j1, y, ldy, bias, m, 2);
}
#pragma GCC pop_options
#endif

/* Whether this CPU executes vdpbf16ps (AVX512-BF16). */
static inline int bf16_dot_native(void) {
#ifdef PKGD_HAVE_BF16_DP
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* `outs` (32, or 64 = a whole block of a 64-wide packing, read front to back rather than as two
 * half-blocks of 128 bytes in every 256, which measured ~2x slower from DRAM) outputs of the bf16
 * GEMV (at wb, pairs ldj apart) by `impl` (BF16_DP falls back to widening where the CPU lacks
 * it, so a wrong request never faults). */
static inline void gemv_bf16_rows(const uint32_t* xp, int64_t ldxp, const uint16_t* wb, int64_t ldj, int64_t j0,
                                  int64_t j1, float* y, int64_t ldy, const float* bias, int64_t m, int impl,
                                  int64_t outs) {
#ifdef PKGD_HAVE_BF16_DP
    if (impl == BF16_DP) {
        gemv_bf16_rows_dp(xp, ldxp, wb, ldj, j0, j1, y, ldy, bias, m, outs);
        return;
    }
#else
    (void)impl;
#endif
    gemv_bf16_rows_widen(xp, ldxp, wb, ldj, j0, j1, y, ldy, bias, m, outs);
}

/* ---- paged decode attention ----------------------------------------------------------- */

/* exp(x) for x <= 0, 16 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-6
 * polynomial, scale by 2^n through the exponent bits); relative error ~1e-7. */
static inline v16 vexp(v16 x) {
    const v16 lo = (v16){0} - 87.3f;
    const v16i below = x < lo;
    x = (v16)(((v16i)lo & below) | ((v16i)x & ~below));
    v16 fx = x * 1.44269504088896341f + 0.5f;
    v16i ti = __builtin_convertvector(fx, v16i);             /* truncates toward zero */
    v16 tf = __builtin_convertvector(ti, v16);
    v16i gt = tf > fx;                                       /* -1 where truncation rounded up */
    ti = ti + gt;
    fx = __builtin_convertvector(ti, v16);
    x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
    v16 y = (v16){0} + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    v16i e = (ti + 127) << 23;
    v16 scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/* scores[0..n) <- exp(scores - mx); returns their sum. */
static inline float softmax_numerators(float* s, int64_t n, float mx) {
    v16 acc = (v16){0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 e = vexp(LOADV(s + i) - mx);
        STOREV(s + i, e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; i < n; i++) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    return sum;
}

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

typedef _Float16 h16u __attribute__((vector_size(32), aligned(2)));
typedef uint16_t u16x16u __attribute__((vector_size(32), aligned(2)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

/* 16 bf16 values widened to float32 (exact). */
static inline v16 load_bf16x16(const uint16_t* p) {
    const u32x16 u = __builtin_convertvector(*(const u16x16u*)p, u32x16) << 16;
    v16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Elements [i, i + 16) of a cache of `dtype` as floats (widened in registers). */
static inline __attribute__((always_inline)) v16 load_kv16(const void* base, int64_t i, const int dtype) {
    if (dtype == DT_F32) return LOADV((const float*)base + i);
    if (dtype == DT_F16) return __builtin_convertvector(*(const h16u*)((const _Float16*)base + i), v16);
    return load_bf16x16((const uint16_t*)base + i);
}

/* Row `idx` of a cache viewed as [rows, d], as floats (converted into tmp for 16-bit caches;
 * d % 16 == 0). */
static inline __attribute__((always_inline)) const float* cache_row(
    const void* base, int64_t idx, int64_t d, const int dtype, float* tmp) {
    if (dtype == DT_F32) return (const float*)base + idx * d;
    for (int64_t i = 0; i < d; i += 16) STOREV(tmp + i, load_kv16(base, idx * d + i, dtype));
    return tmp;
}

/* Lane j of the result = the sum of p[j]'s 16 lanes: sixteen horizontal sums as one tree of
 * pairwise shuffles and adds (15 steps in four rounds, each round halving the vectors and
 * doubling the keys per vector), where hsum takes four dependent steps for each sum. */
static inline __attribute__((always_inline)) v16 hsum16(const v16 p[16]) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lane 2u + t: key 2i + t, lanes 2u and 2u + 1 added */
        a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                       14, 30) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                       15, 31);
    for (int i = 0; i < 4; i++) /* lane 4u + t: key 4i + t */
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                                       28, 29) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                                       30, 31);
    for (int i = 0; i < 2; i++) /* lane 8u + t: key 8i + t */
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                                       26, 27) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                                       30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(c[0], c[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* Scores of one query head (D floats in registers, D a compile-time 64 or 128) against the K rows
 * of m <= 16 consecutive cached tokens of one head (token j's row at element (row + j * hkv) * D),
 * times scale, written to s[0, m). */
static inline __attribute__((always_inline)) void scores16(float* s, const v16* qv, const void* kc, int64_t row,
                                                           int64_t hkv, int64_t m, float scale, const int D,
                                                           const int dtype) {
    v16 p[16];
    for (int j = 0; j < 16; j++) {
        v16 x = (v16){0}, y = (v16){0};
        if (j < m) {
            const int64_t e = (row + j * hkv) * D;
            for (int c = 0; c < D / 16; c += 2) {
                x += qv[c] * load_kv16(kc, e + c * 16, dtype);
                y += qv[c + 1] * load_kv16(kc, e + c * 16 + 16, dtype);
            }
        }
        p[j] = x + y;
    }
    const v16 r = hsum16(p) * scale;
    if (m == 16) {
        STOREV(s, r);
    } else {
        for (int64_t j = 0; j < m; j++) s[j] = r[j];
    }
}

/* Accumulate p * row into acc (d floats, d % 16 == 0); four registers at a time. */
static inline void axpy(float* acc, float p, const float* row, int64_t d) {
    for (int64_t i = 0; i < d; i += 64) {
        if (i + 64 <= d) {
            STOREV(acc + i, LOADV(acc + i) + p * LOADV(row + i));
            STOREV(acc + i + 16, LOADV(acc + i + 16) + p * LOADV(row + i + 16));
            STOREV(acc + i + 32, LOADV(acc + i + 32) + p * LOADV(row + i + 32));
            STOREV(acc + i + 48, LOADV(acc + i + 48) + p * LOADV(row + i + 48));
        } else {
            for (int64_t j = i; j < d; j += 16) STOREV(acc + j, LOADV(acc + j) + p * LOADV(row + j));
        }
    }
}

static inline float dot(const float* a, const float* b, int64_t d) {
    v16 s0 = (v16){0}, s1 = (v16){0};
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        s0 += LOADV(a + i) * LOADV(b + i);
        s1 += LOADV(a + i + 16) * LOADV(b + i + 16);
    }
    if (i < d) s0 += LOADV(a + i) * LOADV(b + i);
    return hsum(s0 + s1);
}

#ifdef PKGD_HAVE_BF16_DP
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
/* Pass 1 of attend_span on one block by vdpbf16ps, for bf16 queries (qb: query head h0 * g's
 * first element, heads d apart) over a bf16 K cache: both operands are bf16 already, so each
 * product is exact in float32 and only the order of the float32 sums differs from the widening
 * form; two instructions per key and head for D = 64 where widening takes four conversions and
 * four FMAs. Scores of the block's n tokens (from token t0 of the span) times scale into scores
 * (rows sstride apart). d is 64 or 128. */
static void scores_block_dp(float* scores, int64_t sstride, const uint16_t* qb, const uint16_t* kc, int64_t row0,
                            int64_t hkv, int64_t h0, int64_t h1, int64_t g, int64_t n, int64_t t0, float scale,
                            int64_t d) {
    const int nv = (int)(d / 32);
    for (int64_t h = h0; h < h1; h++)
        for (int64_t gi = 0; gi < g; gi++) {
            const int64_t qi = (h - h0) * g + gi;
            __m512bh qv[4];
            for (int c = 0; c < nv; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qb + qi * d + 32 * c);
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                const int64_t m = n - j0 < 16 ? n - j0 : 16;
                v16 p[16];
                for (int j = 0; j < 16; j++) {
                    __m512 x = _mm512_setzero_ps(), y = _mm512_setzero_ps();
                    if (j < m) {
                        const uint16_t* kr = kc + (row0 + (j0 + j) * hkv + h) * d;
                        x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(kr), qv[0]);
                        y = _mm512_dpbf16_ps(y, (__m512bh)_mm512_loadu_si512(kr + 32), qv[1]);
                        if (nv == 4) {
                            x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(kr + 64), qv[2]);
                            y = _mm512_dpbf16_ps(y, (__m512bh)_mm512_loadu_si512(kr + 96), qv[3]);
                        }
                    }
                    p[j] = (v16)_mm512_add_ps(x, y);
                }
                const v16 r = hsum16(p) * scale;
                float* sd = scores + qi * sstride + t0 + j0;
                if (m == 16) {
                    STOREV(sd, r);
                } else {
                    for (int64_t j = 0; j < m; j++) sd[j] = r[j];
                }
            }
        }
}
#pragma GCC pop_options
#endif

/* Pass 2 of attend_span for nb (1-4, a compile-time constant) query heads of one KV head h,
 * heads qi0 .. qi0 + nb - 1, over a block's n tokens (rows from row0; d % 64 == 0): each
 * cached value row is loaded (and widened) once for the nb heads that read it, 64 floats of
 * each head's output held in registers over the tokens. */
static inline __attribute__((always_inline)) void values_heads(
    float* acc, const float* scores, int64_t sstride, const void* vc, int64_t row0, int64_t hkv, int64_t h, int64_t d,
    int64_t n, int64_t t0, int64_t qi0, const int nb, const int dtype) {
    for (int64_t i = 0; i < d; i += 64) {
        v16 a[4][4];
        const float* p[4];
#pragma GCC unroll 4
        for (int gg = 0; gg < nb; gg++) {
            p[gg] = scores + (qi0 + gg) * sstride + t0;
            for (int c = 0; c < 4; c++) a[gg][c] = LOADV(acc + (qi0 + gg) * d + i + 16 * c);
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t e = (row0 + j * hkv + h) * d + i;
            const v16 v0 = load_kv16(vc, e, dtype), v1 = load_kv16(vc, e + 16, dtype);
            const v16 v2 = load_kv16(vc, e + 32, dtype), v3 = load_kv16(vc, e + 48, dtype);
#pragma GCC unroll 4
            for (int gg = 0; gg < nb; gg++) {
                const float pj = p[gg][j];
                a[gg][0] += pj * v0;
                a[gg][1] += pj * v1;
                a[gg][2] += pj * v2;
                a[gg][3] += pj * v3;
            }
        }
#pragma GCC unroll 4
        for (int gg = 0; gg < nb; gg++)
            for (int c = 0; c < 4; c++) STOREV(acc + (qi0 + gg) * d + i + 16 * c, a[gg][c]);
    }
}

/* Bytes of K/V asked for ahead of use, per sequence being attended: about a quarter of a core's
 * L2, so what arrives early is still there when it is read. */
#define KV_PREFETCH_BYTES (128 * 1024)

/* Ask for one block's rows (the span from head h0 of its first token to head h1 - 1 of its last)
 * into L2 ahead of use. Blocks sit anywhere in the cache and the hardware prefetcher stops at
 * each 4 KiB page, so without this a lone sequence waits on DRAM several times per block; into
 * L2 rather than L1 (prefetcht2), whose few fill buffers would cap the requests in flight
 * (measured: a cold 192-token decode ~35% faster than with prefetcht0 of the next block only). */
static inline void prefetch_block(const void* base, int64_t row0, int64_t bs, int64_t hkv, int64_t h0, int64_t h1,
                                  int64_t d, int64_t esz) {
    const char* p = (const char*)base;
    const char* start = p + (row0 + h0) * d * esz;
    const char* end = p + (row0 + (bs - 1) * hkv + h1) * d * esz;
    for (const char* c = start; c < end; c += 64) __builtin_prefetch(c, 0, 1);
}

/* Block i of the read order of attend_heads: K blocks 0..n-1, then V blocks 0..n-1. */
static inline void prefetch_nth(const void* kc, const void* vc, const int32_t* table, int64_t i,
                                int64_t n, int64_t bs, int64_t hkv, int64_t h0, int64_t h1, int64_t d,
                                int64_t esz) {
    if (i >= 2 * n) return;
    const int64_t b = i < n ? i : i - n;
    prefetch_block(i < n ? kc : vc, (int64_t)table[b] * bs * hkv, bs, hkv, h0, h1, d, esz);
}

/* Attention of one sequence's query heads of KV heads [h0, h1) (g query heads each) over the
 * cached tokens of its blocks [b0, b1) (tokens b0*bs .. min(b1*bs, len) - 1), unnormalised:
 * for each query head qi, mx[qi] = max score, sum[qi] = sum of exp(score - mx[qi]) and
 * acc[qi] (d floats) = the exp-weighted sum of the values. An empty span gives mx = -inf,
 * sum = 0, acc = 0. q points at query head h0 * g (float32); qb, when not NULL, at the same
 * heads as bf16 (exactly q's values), and a bf16 cache then takes pass 1 by vdpbf16ps
 * (scores_block_dp; callers pass it only where the CPU has the instruction); scores holds (h1 - h0) * g rows of sstride
 * floats (sstride >= the span's tokens), acc as many rows of d. Each cached token's K (then V)
 * rows of those heads are adjacent in memory, so a block is read front to back. */
static inline __attribute__((always_inline)) void attend_span(
    float* acc, float* mx_out, float* sum_out, const float* q, const uint16_t* qb, const void* kc,
    const void* vc, const int32_t* table, int64_t b0, int64_t b1, int64_t len, int64_t g, int64_t hkv, int64_t h0,
    int64_t h1, int64_t d, int64_t bs, float scale, float* scores, int64_t sstride, float* tmp,
    const int dtype) {
    const int64_t nq = (h1 - h0) * g;
    const int64_t first = b0 * bs, ntok = (len < b1 * bs ? len : b1 * bs) - first;
    memset(acc, 0, sizeof(float) * nq * d);
    if (ntok <= 0) {
        for (int64_t qi = 0; qi < nq; qi++) mx_out[qi] = -INFINITY, sum_out[qi] = 0.0f;
        return;
    }
    const int64_t nblocks = (ntok + bs - 1) / bs; /* blocks b0 .. b0 + nblocks - 1 */
    table += b0;
    const int64_t esz = dtype == DT_F32 ? 4 : 2;
    int64_t ahead = KV_PREFETCH_BYTES / (bs * hkv * d * esz); /* blocks in flight */
    ahead = ahead < 1 ? 1 : ahead;
    for (int64_t i = 0; i < ahead; i++) prefetch_nth(kc, vc, table, i, nblocks, bs, hkv, h0, h1, d, esz);
    /* pass 1: scores of every query head against every cached key */
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t row0 = (int64_t)table[b] * bs * hkv;
        prefetch_nth(kc, vc, table, b + ahead, nblocks, bs, hkv, h0, h1, d, esz);
        const int64_t t0 = b * bs, n = ntok - t0 < bs ? ntok - t0 : bs;
#ifdef PKGD_HAVE_BF16_DP
        if (dtype == DT_BF16 && qb && (d == 64 || d == 128)) {
            scores_block_dp(scores, sstride, qb, (const uint16_t*)kc, row0, hkv, h0, h1, g, n, t0, scale, d);
            continue;
        }
#endif
        if (d == 64 || d == 128) {
            /* the query head in registers, 16 keys at a time (one reduction tree, hsum16) */
            for (int64_t h = h0; h < h1; h++)
                for (int64_t gi = 0; gi < g; gi++) {
                    const int64_t qi = (h - h0) * g + gi;
                    v16 qv[8];
                    for (int64_t c = 0; c < d / 16; c++) qv[c] = LOADV(q + qi * d + c * 16);
                    for (int64_t j0 = 0; j0 < n; j0 += 16) {
                        const int64_t m = n - j0 < 16 ? n - j0 : 16;
                        float* sd = scores + qi * sstride + t0 + j0;
                        if (d == 64)
                            scores16(sd, qv, kc, row0 + j0 * hkv + h, hkv, m, scale, 64, dtype);
                        else
                            scores16(sd, qv, kc, row0 + j0 * hkv + h, hkv, m, scale, 128, dtype);
                    }
                }
            continue;
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t h = h0; h < h1; h++) {
                const float* kr = cache_row(kc, row0 + j * hkv + h, d, dtype, tmp);
                for (int64_t gi = 0; gi < g; gi++) {
                    const int64_t qi = (h - h0) * g + gi;
                    scores[qi * sstride + t0 + j] = dot(q + qi * d, kr, d) * scale;
                }
            }
        }
    }
    for (int64_t qi = 0; qi < nq; qi++) {
        float* s = scores + qi * sstride;
        v16 mv = (v16){0} - INFINITY;
        int64_t t = 0;
        for (; t + 16 <= ntok; t += 16) {
            v16 x = LOADV(s + t);
            const v16i gt = x > mv;
            mv = (v16)(((v16i)x & gt) | ((v16i)mv & ~gt));
        }
        float mx = -INFINITY;
        for (int i = 0; i < 16; i++) mx = mv[i] > mx ? mv[i] : mx;
        for (; t < ntok; t++) mx = s[t] > mx ? s[t] : mx;
        mx_out[qi] = mx;
        sum_out[qi] = softmax_numerators(s, ntok, mx);
    }
    /* pass 2: probability-weighted sum of the values */
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t row0 = (int64_t)table[b] * bs * hkv;
        prefetch_nth(kc, vc, table, nblocks + b + ahead, nblocks, bs, hkv, h0, h1, d, esz);
        const int64_t t0 = b * bs, n = ntok - t0 < bs ? ntok - t0 : bs;
        if (d % 64 == 0) {
            /* up to four query heads of a KV head at a time (values_heads) */
            for (int64_t h = h0; h < h1; h++)
                for (int64_t gi = 0; gi < g; gi += 4) {
                    const int64_t qi0 = (h - h0) * g + gi;
                    switch (g - gi < 4 ? g - gi : 4) {
                        case 4: values_heads(acc, scores, sstride, vc, row0, hkv, h, d, n, t0, qi0, 4, dtype); break;
                        case 3: values_heads(acc, scores, sstride, vc, row0, hkv, h, d, n, t0, qi0, 3, dtype); break;
                        case 2: values_heads(acc, scores, sstride, vc, row0, hkv, h, d, n, t0, qi0, 2, dtype); break;
                        default: values_heads(acc, scores, sstride, vc, row0, hkv, h, d, n, t0, qi0, 1, dtype); break;
                    }
                }
            continue;
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t h = h0; h < h1; h++) {
                const float* vr = cache_row(vc, row0 + j * hkv + h, d, dtype, tmp);
                for (int64_t gi = 0; gi < g; gi++) {
                    const int64_t qi = (h - h0) * g + gi;
                    axpy(acc + qi * d, scores[qi * sstride + t0 + j], vr, d);
                }
            }
        }
    }
}

/* attend_span over a whole sequence of len tokens, normalised into out ((h1 - h0) * g rows of d;
 * qb as there);
 * mx/sum scratch of 256 floats each on the stack (hq <= 256). */
static inline __attribute__((always_inline)) void attend_heads(
    float* out, const float* q, const void* kc, const void* vc, const int32_t* table,
    int64_t len, int64_t g, int64_t hkv, int64_t h0, int64_t h1, int64_t d, int64_t bs,
    float scale, float* scores, int64_t sstride, float* acc, float* tmp, const int dtype, const uint16_t* qb) {
    float mx[256], sum[256];
    const int64_t nq = (h1 - h0) * g;
    attend_span(acc, mx, sum, q, qb, kc, vc, table, 0, (len + bs - 1) / bs, len, g, hkv, h0, h1, d, bs, scale,
                scores, sstride, tmp, dtype);
    for (int64_t qi = 0; qi < nq; qi++) {
        const v16 iv = (v16){0} + 1.0f / sum[qi];
        for (int64_t i = 0; i < d; i += 16) STOREV(out + qi * d + i, LOADV(acc + qi * d + i) * iv);
    }
}

/* ---- RMSNorm -------------------------------------------------------------------------- */

/* One row of h floats: o = r / sqrt(mean(r^2) + eps) * weight (Zhang & Sennrich, 2019; the sum
 * of squares in float32 like transformers' LlamaRMSNorm for float32 inputs). o may be r. */
static inline void rms_row(float* o, const float* r, const float* weight, int64_t h, float eps) {
    v16 acc = (v16){0};
    int64_t j = 0;
    for (; j + 16 <= h; j += 16) {
        v16 v = LOADV(r + j);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; j < h; j++) ss += r[j] * r[j];
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    j = 0;
    for (; j + 16 <= h; j += 16) STOREV(o + j, LOADV(r + j) * inv * LOADV(weight + j));
    for (; j < h; j++) o[j] = r[j] * inv * weight[j];
}

/* ro[0..h) = a + b (+ c when c != NULL, added to a first). ro may alias a or b. */
static inline void add_row(float* ro, const float* a, const float* c, const float* b, int64_t h) {
    int64_t j = 0;
    if (c) {
        for (; j + 16 <= h; j += 16) STOREV(ro + j, (LOADV(a + j) + LOADV(c + j)) + LOADV(b + j));
        for (; j < h; j++) ro[j] = (a[j] + c[j]) + b[j];
    } else {
        for (; j + 16 <= h; j += 16) STOREV(ro + j, LOADV(a + j) + LOADV(b + j));
        for (; j < h; j++) ro[j] = a[j] + b[j];
    }
}

/* ---- bf16 rows: 16 lanes (load_bf16x16) rounded back to bf16 (to nearest even) -------- */

static inline void store_bf16x16(uint16_t* p, v16 f) { /* finite inputs, as f32_to_bf16 */
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    *(u16x16u*)p = __builtin_convertvector(u >> 16, u16x16);
}

/* f rounded to bf16 and widened back: the value a bf16 tensor holds. */
static inline v16 round_bf16x16(v16 f) {
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* One bf16 row of h values, rounded as transformers' LlamaRMSNorm rounds a bf16 input: the mean
 * square of r in float32, n = bf16(r / sqrt(ms + eps)), o = bf16(n * weight). With res != NULL,
 * r = bf16(x + res) is written to ro first (the residual add in bf16, as torch's). */
static inline void rms_row_bf16(uint16_t* o, uint16_t* ro, const uint16_t* x, const uint16_t* res,
                                const uint16_t* weight, int64_t h, float eps) {
    const uint16_t* r = x;
    int64_t j = 0;
    if (res) {
        for (; j + 16 <= h; j += 16) store_bf16x16(ro + j, load_bf16x16(x + j) + load_bf16x16(res + j));
        for (; j < h; j++) ro[j] = f32_to_bf16(bf16_to_f32(x[j]) + bf16_to_f32(res[j]));
        r = ro;
    }
    v16 acc = (v16){0};
    for (j = 0; j + 16 <= h; j += 16) {
        const v16 v = load_bf16x16(r + j);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; j < h; j++) ss += bf16_to_f32(r[j]) * bf16_to_f32(r[j]);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (j = 0; j + 16 <= h; j += 16)
        store_bf16x16(o + j, round_bf16x16(load_bf16x16(r + j) * inv) * load_bf16x16(weight + j));
    for (; j < h; j++) o[j] = f32_to_bf16(round_bf16(bf16_to_f32(r[j]) * inv) * bf16_to_f32(weight[j]));
}

/* silu(g) = g * sigmoid(g) (Elfwing et al., 2018), 16 lanes, with exp of -|g| only (vexp's
 * domain), so no lane overflows. */
static inline v16 vsilu(v16 g) {
    const v16i neg = g < 0;
    const v16 a = (v16)((v16i)g & 0x7fffffff); /* |g|: the sign bit cleared */
    /* exp(-|g|) is 0 in float32 beyond vexp's clamp (below the smallest normal), as expf's */
    const v16 e = (v16)((v16i)vexp((v16){0} - a) & (a < 87.3f));
    const v16 one = (v16){0} + 1.0f;
    const v16 num = (v16)(((v16i)e & neg) | ((v16i)one & ~neg)); /* sigmoid(g) * (1 + e) */
    return g * num / (one + e);
}

static inline float silu1(float g) { return g / (1.0f + expf(-g)); } /* -0 where expf(-g) overflows */

/* One bf16 row: o[0..n) = silu(x[0..n)) * x[n..2n), silu's value rounded to bf16 before the
 * product, as torch's two bf16 ops round. */
static inline void silu_mul_row_bf16(uint16_t* ob, const uint16_t* g, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        store_bf16x16(ob + j, round_bf16x16(vsilu(load_bf16x16(g + j))) * load_bf16x16(g + n + j));
    for (; j < n; j++) ob[j] = f32_to_bf16(round_bf16(silu1(bf16_to_f32(g[j]))) * bf16_to_f32(g[n + j]));
}

/* ---- GEMV by a thread team, and the small row loops of a decoder layer ------------- */

/* A linear's weight as the GEMVs read it: float32 [n/64][k][64] (W_F32), bf16 [n/32][k/2][32][2]
 * (W_BF16) or [n/64][k/2][64][2] (W_BF16_64), with the bf16 dot product `impl`. */
enum { W_F32 = 0, W_BF16 = 1, W_BF16_64 = 3 };

static inline int is_bf16(int wdt) { return wdt == W_BF16 || wdt == W_BF16_64; }

/* Outputs a gemv_team block holds for weights of dtype wdt (not W_QUANT): 64 in float32 and in
 * a 64-wide bf16 packing (the whole block, front to back), 32 in a 32-wide one. */
static inline int64_t block_outputs(int wdt) { return wdt == W_BF16 ? 32 : 64; }

/* Inside a parallel region, every thread calling: y[m, n] = x[m, k] W^T (+ bias) on the packed
 * W (of dtype wdt; for bf16 weights, xp holds x as bf16 pairs, see pack_x_bf16). The buffer is cut
 * into one contiguous range of block rows per thread (block_outputs(wdt) outputs a block), equal to within a row, so each thread streams its own part of memory front to back and
 * none waits on a leftover block (9 blocks on 2 threads would otherwise leave one idle for a
 * ninth of the time). A block a thread enters mid-way is summed into part[t] (m x 64, part_blk[t]
 * = the block, else -1) rather than into y: after the caller's barrier, a reader takes y
 * through fixed_range, which adds those parts. No barrier inside. */
static inline void gemv_team(const float* x, int64_t ldx, const uint32_t* xp, const void* w, int wdt, int impl,
                             const float* bias, float* y, int64_t m, int64_t n, int64_t k, float* part,
                             int64_t* part_blk) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int bf16 = is_bf16(wdt);
    const int64_t bw = block_outputs(wdt), kk = bf16 ? k / 2 : k; /* outputs, rows a block */
    const int64_t bb = wdt == W_BF16_64 ? 64 : 32;                /* oneDNN's bf16 block width */
    const int64_t units = (n / bw) * kk;
    const int64_t u1 = units * (t + 1) / nt;
    int64_t u = units * t / nt;
    part_blk[t] = -1;
    while (u < u1) {
        const int64_t b = u / kk, k0 = u % kk;
        const int64_t k1 = (b + 1) * kk <= u1 ? kk : u1 - b * kk;
        float* out = k0 == 0 ? y + b * bw : part + t * m * 64; /* only a thread's first piece can start mid-block */
        const int64_t ldo = k0 == 0 ? n : 64;
        const float* bo = k0 == 0 && bias ? bias + b * bw : NULL;
        if (bf16)
            gemv_bf16_rows(xp, k / 2, (const uint16_t*)w + b * k * bw, 2 * bb, k0, k1, out, ldo, bo, m, impl, bw);
        else
            gemv_rows(x, ldx, (const float*)w + b * k * 64, k0, k1, out, ldo, bo, m);
        if (k0 != 0) part_blk[t] = b;
        u = b * kk + k1;
    }
}

/* dst[0, j1 - j0) = columns [j0, j1) of row r of a gemv_team output (row yrow, m rows in all;
 * blocks of bw outputs), with the parts of split blocks added in thread order. */
static inline void fixed_range(float* dst, const float* yrow, int64_t j0, int64_t j1, const float* part,
                               const int64_t* part_blk, int nt, int64_t m, int64_t r, int64_t bw) {
    memcpy(dst, yrow + j0, sizeof(float) * (size_t)(j1 - j0));
    for (int i = 0; i < nt; i++) {
        if (part_blk[i] < 0) continue;
        const int64_t b0 = part_blk[i] * bw, lo = b0 > j0 ? b0 : j0, hi = b0 + bw < j1 ? b0 + bw : j1;
        const float* pr = part + (i * m + r) * 64 - b0;
        for (int64_t j = lo; j < hi; j++) dst[j - j0] += pr[j];
    }
}

/* Rotate one head (adjacent pairs (x[2i], x[2i+1]) by the angle whose cos/sin are cs[i] and
 * cs[rot/2 + i]; Su et al., 2021), in place. */
static inline void rope_head(float* x, const float* cs, int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const float c = cs[i], s = cs[half + i], a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/* silu(g) * u for n floats (SwiGLU, Shazeer 2020). */
static inline void silu_mul_row(float* o, const float* g, const float* u, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) STOREV(o + j, vsilu(LOADV(g + j)) * LOADV(u + j));
    for (; j < n; j++) o[j] = silu1(g[j]) * u[j];
}

#endif /* PKGD_KERNELS_H */
