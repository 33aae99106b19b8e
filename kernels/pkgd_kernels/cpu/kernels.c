/* pkgd CPU kernels: the two hot loops of CPU decode that PyTorch has no fast op for.
 *
 *  - pkgd_gemv_packed64: y[M, N] = x[M, K] W^T (+ bias) for small M, reading W in oneDNN's
 *    blocked layout [N/64][K][64] (what torch.ops.mkldnn._reorder_linear_weight produces for
 *    the fp32 linears here), so the weight held for batched GEMMs serves decode too. Each
 *    64-row block is streamed once per call; memory-bound, so the goal is DRAM read speed.
 *  - pkgd_rms_norm: RMSNorm of float32 rows, optionally after adding a residual (which it
 *    also returns): one pass where PyTorch's composite op runs several (pow, mean, rsqrt, mul).
 *  - pkgd_paged_attention_decode: one query token per sequence over the paged KV cache
 *    [num_blocks, block_size, num_kv_heads, head_dim], read in place through the block table
 *    (no gathered copy), the G = Hq/Hkv query heads of a KV head sharing each K/V read
 *    (GQA), two passes: scores with a max-subtracted softmax, then the weighted sum of V.
 *
 * Plain C with GCC vector extensions (16 floats: one AVX-512 register, two AVX2 ones); built
 * at first use with -O3 -march=native -fopenmp (pkgd_kernels/cpu/__init__.py). OpenMP is the
 * runtime torch itself uses (libgomp is shared by soname), so torch.set_num_threads applies.
 */
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

int pkgd_abi_version(void) { return 2; }
int pkgd_num_threads(void) { return omp_get_max_threads(); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* ---- GEMV on the [N/64][K][64] packing ------------------------------------------------ */

static inline __attribute__((always_inline)) void gemv_block(
    const float* x, int64_t ldx, const float* wb, int64_t k, float* y, int64_t ldy,
    const float* bias, const int rows) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const float* wr = wb + kk * 64;
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

/* x: [m, k] with row stride ldx; w: [n/64][k][64]; bias: [n] or NULL; y: [m, n] contiguous.
 * n must be a multiple of 64. Rows are taken four at a time (a block stays in L1/L2 between
 * groups, so only the first group reads it from memory). */
void pkgd_gemv_packed64(const float* x, int64_t ldx, const float* w, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k) {
    const int64_t nblk = n / 64;
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t b = 0; b < nblk; b++) {
        const float* wb = w + b * k * 64;
        const float* bb = bias ? bias + b * 64 : NULL;
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) gemv_block(x + r * ldx, ldx, wb, k, y + r * n + b * 64, n, bb, 4);
        switch (m - r) {
            case 3: gemv_block(x + r * ldx, ldx, wb, k, y + r * n + b * 64, n, bb, 3); break;
            case 2: gemv_block(x + r * ldx, ldx, wb, k, y + r * n + b * 64, n, bb, 2); break;
            case 1: gemv_block(x + r * ldx, ldx, wb, k, y + r * n + b * 64, n, bb, 1); break;
            default: break;
        }
    }
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
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* Row `idx` of a cache viewed as [rows, d], as floats (converted into tmp for 16-bit caches;
 * d % 16 == 0). */
static inline __attribute__((always_inline)) const float* cache_row(
    const void* base, int64_t idx, int64_t d, const int dtype, float* tmp) {
    if (dtype == DT_F32) return (const float*)base + idx * d;
    if (dtype == DT_F16) {
        const _Float16* p = (const _Float16*)base + idx * d;
        for (int64_t i = 0; i < d; i += 16) STOREV(tmp + i, __builtin_convertvector(*(const h16u*)(p + i), v16));
        return tmp;
    }
    const uint16_t* p = (const uint16_t*)base + idx * d;
    for (int64_t i = 0; i < d; i += 16) {
        u32x16 u = __builtin_convertvector(*(const u16x16u*)(p + i), u32x16) << 16;
        v16 f;
        memcpy(&f, &u, sizeof f);
        STOREV(tmp + i, f);
    }
    return tmp;
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

/* Ask for the next block's rows ahead of use (the span from head h0 of its first token to
 * head h1 - 1 of its last): blocks sit anywhere in the cache, so the hardware prefetcher
 * cannot guess the jump, and a lone sequence would wait on DRAM at each one. */
static inline void prefetch_block(const void* base, int64_t row0, int64_t rows, int64_t h0, int64_t h1,
                                  int64_t d, int64_t esz) {
    const char* p = (const char*)base;
    const char* start = p + (row0 + h0) * d * esz;
    const char* end = p + (row0 + rows - 1 + h1 - h0) * d * esz;
    for (const char* c = start; c < end; c += 64) __builtin_prefetch(c, 0, 3);
}

/* Attention of one sequence's query heads of KV heads [h0, h1) (g query heads each). q and out
 * point at query head h0 * g; scores holds (h1 - h0) * g rows of sstride floats, acc as many
 * rows of d. Each cached token's K (then V) rows of those heads are adjacent in memory, so a
 * block is read front to back. */
static inline __attribute__((always_inline)) void attend_heads(
    float* out, const float* q, const void* kc, const void* vc, const int32_t* table,
    int64_t len, int64_t g, int64_t hkv, int64_t h0, int64_t h1, int64_t d, int64_t bs,
    float scale, float* scores, int64_t sstride, float* acc, float* tmp, const int dtype) {
    const int64_t nblocks = (len + bs - 1) / bs;
    const int64_t nq = (h1 - h0) * g;
    const int64_t esz = dtype == DT_F32 ? 4 : 2;
    /* pass 1: scores of every query head against every cached key */
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t row0 = (int64_t)table[b] * bs * hkv;
        if (b + 1 < nblocks) prefetch_block(kc, (int64_t)table[b + 1] * bs * hkv, bs * hkv, h0, h1, d, esz);
        const int64_t t0 = b * bs, n = len - t0 < bs ? len - t0 : bs;
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
    float inv[256];
    for (int64_t qi = 0; qi < nq; qi++) {
        float* s = scores + qi * sstride;
        v16 mv = (v16){0} - INFINITY;
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) {
            v16 x = LOADV(s + t);
            const v16i gt = x > mv;
            mv = (v16)(((v16i)x & gt) | ((v16i)mv & ~gt));
        }
        float mx = -INFINITY;
        for (int i = 0; i < 16; i++) mx = mv[i] > mx ? mv[i] : mx;
        for (; t < len; t++) mx = s[t] > mx ? s[t] : mx;
        inv[qi] = 1.0f / softmax_numerators(s, len, mx);
    }
    /* pass 2: probability-weighted sum of the values */
    memset(acc, 0, sizeof(float) * nq * d);
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t row0 = (int64_t)table[b] * bs * hkv;
        if (b + 1 < nblocks) prefetch_block(vc, (int64_t)table[b + 1] * bs * hkv, bs * hkv, h0, h1, d, esz);
        const int64_t t0 = b * bs, n = len - t0 < bs ? len - t0 : bs;
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
    for (int64_t qi = 0; qi < nq; qi++) {
        const v16 iv = (v16){0} + inv[qi];
        for (int64_t i = 0; i < d; i += 16) STOREV(out + qi * d + i, LOADV(acc + qi * d + i) * iv);
    }
}

/* out: [ns, hq, d] contiguous; q: [ns, hq, d] with token stride q_stride (heads contiguous);
 * kc/vc: [num_blocks, bs, hkv, d] of `dtype`; block_tables: int32 [ns, bt_stride];
 * seq_lens: int32 [ns]. Requires d % 16 == 0, hq % hkv == 0, hq <= 256.
 * Work is split by sequence when there are enough sequences for every thread, else by
 * (sequence, KV head); below 8192 token-heads of context in all, the calling thread does it
 * alone (waking the pool costs more than the work). Returns 0, or -1 when scratch memory could not be allocated. */
int pkgd_paged_attention_decode(float* out, const float* q, int64_t q_stride, const void* kc,
                                const void* vc, int dtype, const int32_t* block_tables,
                                int64_t bt_stride, const int32_t* seq_lens, int64_t ns, int64_t hq,
                                int64_t hkv, int64_t d, int64_t bs, float scale) {
    const int64_t g = hq / hkv;
    int64_t maxl = 1;
    for (int64_t s = 0; s < ns; s++) maxl = seq_lens[s] > maxl ? seq_lens[s] : maxl;
    const int64_t sstride = (maxl + 15) & ~(int64_t)15;
    const int64_t split = ns >= 4 * (int64_t)omp_get_max_threads() ? 1 : hkv;  /* items per sequence */
    const int64_t hper = hkv / split;
    int failed = 0;
    int64_t work = 0;  /* token-heads to read; a lone short sequence is not worth waking threads */
    for (int64_t s = 0; s < ns; s++) work += seq_lens[s] * hkv;
#pragma omp parallel if (work > 8192)
    {
        const int64_t nq = hper * g;
        float* scores = (float*)malloc(sizeof(float) * (size_t)(nq * sstride + nq * d + d + 16));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        float* acc = scores ? scores + nq * sstride : NULL;
        float* tmp = acc ? acc + nq * d : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < ns * split; w++) {
            if (!scores) continue;
            const int64_t s = w / split, h0 = (w % split) * hper, h1 = h0 + hper;
            const float* qs = q + s * q_stride + h0 * g * d;
            float* os = out + (s * hq + h0 * g) * d;
            const int32_t* table = block_tables + s * bt_stride;
            const int64_t len = seq_lens[s];
            if (dtype == DT_F32)
                attend_heads(os, qs, kc, vc, table, len, g, hkv, h0, h1, d, bs, scale, scores, sstride, acc, tmp, DT_F32);
            else if (dtype == DT_F16)
                attend_heads(os, qs, kc, vc, table, len, g, hkv, h0, h1, d, bs, scale, scores, sstride, acc, tmp, DT_F16);
            else
                attend_heads(os, qs, kc, vc, table, len, g, hkv, h0, h1, d, bs, scale, scores, sstride, acc, tmp, DT_BF16);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* ---- RMSNorm -------------------------------------------------------------------------- */

/* For each of t rows of h floats: r = x (+ residual); out = r / sqrt(mean(r^2) + eps) * weight.
 * With residual != NULL, r is also written to res_out. x rows have stride ldx; residual,
 * out and res_out are contiguous [t, h]. Zhang & Sennrich (2019); the sum of squares is in
 * float32 like transformers' LlamaRMSNorm for float32 inputs. */
void pkgd_rms_norm(float* out, float* res_out, const float* x, int64_t ldx, const float* residual,
                   const float* weight, int64_t t, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (t * h > (1 << 16))
    for (int64_t i = 0; i < t; i++) {
        const float* xr = x + i * ldx;
        float* o = out + i * h;
        const float* r = xr;
        if (residual) {
            float* ro = res_out + i * h;
            const float* rr = residual + i * h;
            int64_t j = 0;
            for (; j + 16 <= h; j += 16) STOREV(ro + j, LOADV(xr + j) + LOADV(rr + j));
            for (; j < h; j++) ro[j] = xr[j] + rr[j];
            r = ro;
        }
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
}
