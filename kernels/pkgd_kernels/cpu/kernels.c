/* pkgd CPU kernels: the hot loops of CPU decode that PyTorch has no fast op for.
 *
 *  - pkgd_gemv_packed64: y[M, N] = x[M, K] W^T (+ bias) for small M, reading W in oneDNN's
 *    blocked layout [N/64][K][64] (what torch.ops.mkldnn._reorder_linear_weight produces for
 *    the fp32 linears here), so the weight held for batched GEMMs serves decode too. Each
 *    64-row block is streamed once per call; memory-bound, so the goal is DRAM read speed.
 *  - pkgd_gather_packed64: rows of a weight in that packing (the embedding lookup of a model
 *    whose embedding is tied to its packed LM head).
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

int pkgd_abi_version(void) { return 4; }
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

/* x: [m, k] with row stride ldx; w: [n/64][k][64]; bias: [n] or NULL; y: [m, n] contiguous.
 * n must be a multiple of 64. */
void pkgd_gemv_packed64(const float* x, int64_t ldx, const float* w, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k) {
    const int64_t nblk = n / 64;
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t b = 0; b < nblk; b++)
        gemv_rows(x, ldx, w + b * k * 64, 0, k, y + b * 64, n, bias ? bias + b * 64 : NULL, m);
}

/* out[t, k] <- rows ids[t] of W [n, k] held in the packing above ([n/64][k][64]): element
 * (v, c) sits at w[(v / 64) * k * 64 + c * 64 + v % 64], one float per 64-byte line, so all of a
 * row's k lines are requested (into L2) before the first is read: read one after another they
 * cost a DRAM round trip each (~180 us for a 576-float row of a cold LM head, ~10 us this way).
 * The embedding lookup of a model whose embedding is tied to a packed LM head. Returns 0, or -1
 * (nothing written) when an id is outside [0, n). */
int pkgd_gather_packed64(float* out, const float* w, const int64_t* ids, int64_t t, int64_t n, int64_t k) {
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
#pragma omp parallel for schedule(static) if (t > 8)
    for (int64_t i = 0; i < t; i++) {
        const float* col = w + (ids[i] / 64) * k * 64 + ids[i] % 64;
        for (int64_t c = 0; c < k; c++) __builtin_prefetch(col + c * 64, 0, 1);
        for (int64_t c = 0; c < k; c++) out[i * k + c] = col[c * 64];
    }
    return 0;
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
 * sum = 0, acc = 0. q points at query head h0 * g; scores holds (h1 - h0) * g rows of sstride
 * floats (sstride >= the span's tokens), acc as many rows of d. Each cached token's K (then V)
 * rows of those heads are adjacent in memory, so a block is read front to back. */
static inline __attribute__((always_inline)) void attend_span(
    float* acc, float* mx_out, float* sum_out, const float* q, const void* kc, const void* vc,
    const int32_t* table, int64_t b0, int64_t b1, int64_t len, int64_t g, int64_t hkv, int64_t h0,
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
        if (dtype == DT_F32 && d % 64 == 0) {
            /* 64 output floats of one query head held in registers over the block's tokens
             * (accumulating through memory chained each token's add on the last one's store) */
            for (int64_t h = h0; h < h1; h++)
                for (int64_t gi = 0; gi < g; gi++) {
                    const int64_t qi = (h - h0) * g + gi;
                    const float* p = scores + qi * sstride + t0;
                    for (int64_t i = 0; i < d; i += 64) {
                        float* a = acc + qi * d + i;
                        v16 a0 = LOADV(a), a1 = LOADV(a + 16), a2 = LOADV(a + 32), a3 = LOADV(a + 48);
                        for (int64_t j = 0; j < n; j++) {
                            const float* vr = (const float*)vc + (row0 + j * hkv + h) * d + i;
                            a0 += p[j] * LOADV(vr);
                            a1 += p[j] * LOADV(vr + 16);
                            a2 += p[j] * LOADV(vr + 32);
                            a3 += p[j] * LOADV(vr + 48);
                        }
                        STOREV(a, a0);
                        STOREV(a + 16, a1);
                        STOREV(a + 32, a2);
                        STOREV(a + 48, a3);
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

/* attend_span over a whole sequence of len tokens, normalised into out ((h1 - h0) * g rows of d);
 * mx/sum scratch of 256 floats each on the stack (hq <= 256). */
static inline __attribute__((always_inline)) void attend_heads(
    float* out, const float* q, const void* kc, const void* vc, const int32_t* table,
    int64_t len, int64_t g, int64_t hkv, int64_t h0, int64_t h1, int64_t d, int64_t bs,
    float scale, float* scores, int64_t sstride, float* acc, float* tmp, const int dtype) {
    float mx[256], sum[256];
    const int64_t nq = (h1 - h0) * g;
    attend_span(acc, mx, sum, q, kc, vc, table, 0, (len + bs - 1) / bs, len, g, hkv, h0, h1, d, bs, scale,
                scores, sstride, tmp, dtype);
    for (int64_t qi = 0; qi < nq; qi++) {
        const v16 iv = (v16){0} + 1.0f / sum[qi];
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

/* For each of t rows of h floats: r = x (+ residual); out = rms_row(r). With residual != NULL,
 * r is also written to res_out. x rows have stride ldx; residual, out and res_out are
 * contiguous [t, h]. */
void pkgd_rms_norm(float* out, float* res_out, const float* x, int64_t ldx, const float* residual,
                   const float* weight, int64_t t, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (t * h > (1 << 16))
    for (int64_t i = 0; i < t; i++) {
        const float* r = x + i * ldx;
        if (residual) {
            add_row(res_out + i * h, r, NULL, residual + i * h, h);
            r = res_out + i * h;
        }
        rms_row(out + i * h, r, weight, h, eps);
    }
}

/* ---- one decode step of a Llama-family model ------------------------------------------- */

/* Pointers of one decoder layer. Linear weights are in the packing of pkgd_gemv_packed64
 * ([out/64][in][64]); Q/K rows (and q_norm/k_norm) in the adjacent-pair RoPE layout. Optional
 * tensors are NULL when the model has none. Caches: [num_blocks, block_size, hkv, d] float32. */
typedef struct {
    const float *ln1, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *ln2, *gate_up, *gate_up_bias,
        *down, *down_bias;
    float *k_cache, *v_cache;
} pkgd_decoder_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, rot_dim, block_size;
    float eps, scale;
    const float* final_norm;     /* [hidden] */
    const float* cos_sin_cache;  /* [max_position, rot_dim]: cos of each pair, then sin */
} pkgd_decoder_dims;

/* Inside a parallel region, every thread calling: y[m, n] = x[m, k] W^T (+ bias) on the packed
 * W ([n/64][k][64]). The buffer is cut into one contiguous range of 64-float rows per thread,
 * equal to within a row, so each thread streams its own part of memory front to back and none
 * waits on a leftover block (9 blocks on 2 threads would otherwise leave one idle for a ninth
 * of the time). A block a thread enters mid-way is summed into part[t] (m x 64, part_blk[t] =
 * the block, else -1) rather than into y: after the caller's barrier, a reader takes y through
 * fixed_range, which adds those parts. No barrier inside. */
static void gemv_team(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                      int64_t m, int64_t n, int64_t k, float* part, int64_t* part_blk) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t units = (n / 64) * k;
    const int64_t u1 = units * (t + 1) / nt;
    int64_t u = units * t / nt;
    part_blk[t] = -1;
    while (u < u1) {
        const int64_t b = u / k, k0 = u % k;
        const int64_t k1 = (b + 1) * k <= u1 ? k : u1 - b * k;
        const float* wb = w + b * k * 64;
        if (k0 == 0) {
            gemv_rows(x, ldx, wb, 0, k1, y + b * 64, n, bias ? bias + b * 64 : NULL, m);
        } else { /* only a thread's first piece can start mid-block */
            gemv_rows(x, ldx, wb, k0, k1, part + t * m * 64, 64, NULL, m);
            part_blk[t] = b;
        }
        u = b * k + k1;
    }
}

/* dst[0, j1 - j0) = columns [j0, j1) of row r of a gemv_team output (row yrow, m rows in all),
 * with the parts of split blocks added in thread order. */
static inline void fixed_range(float* dst, const float* yrow, int64_t j0, int64_t j1, const float* part,
                               const int64_t* part_blk, int nt, int64_t m, int64_t r) {
    memcpy(dst, yrow + j0, sizeof(float) * (size_t)(j1 - j0));
    for (int i = 0; i < nt; i++) {
        if (part_blk[i] < 0) continue;
        const int64_t b0 = part_blk[i] * 64, lo = b0 > j0 ? b0 : j0, hi = b0 + 64 < j1 ? b0 + 64 : j1;
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

/* silu(g) * u for n floats (SwiGLU, Shazeer 2020): g * sigmoid(g), the exponent taken of -|g|
 * so vexp stays in its range. */
static inline void silu_mul_row(float* o, const float* g, const float* u, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const v16 gv = LOADV(g + j);
        const v16i neg = gv < 0;
        const v16 ax = (v16)((v16i)gv & 0x7fffffff); /* |g|: the sign bit cleared */
        const v16 e = vexp((v16){0} - ax);
        const v16 num = (v16)(((v16i)e & neg) | ((v16i)((v16){0} + 1.0f) & ~neg));
        STOREV(o + j, gv * (num / (1.0f + e)) * LOADV(u + j));
    }
    for (; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* One decode step of m sequences (one new token each) through every layer, in one OpenMP
 * region: per layer RMSNorm -> QKV -> (QK-norm) -> RoPE -> K/V written at slots[r] -> paged
 * attention over seq_lens[r] tokens -> o_proj -> residual + RMSNorm -> gate/up -> SiLU*mul ->
 * down_proj, then the final RMSNorm. The GEMVs and the attention are split across the threads,
 * each ending at a barrier; the small steps between them (norms, residual adds, RoPE, the span
 * merge, and SiLU for m <= 2) are done by every thread on its own copy, which costs less than
 * a barrier: 5 barriers a layer (6 for m > 2). Nothing returns to Python between layers. Same
 * arithmetic as the per-op path (pkgd_gemv_packed64, pkgd_rms_norm,
 * pkgd_paged_attention_decode), except that a GEMV block split between threads sums its two
 * halves separately, and a long sequence's attention is cut into spans whose softmaxes are merged.
 *
 * emb: [m, hidden] embeddings of the new tokens; out: [m, hidden] final hidden states;
 * positions, slots: int64 [m] (slot -1: do not write); block_tables int32 [m, bt_stride];
 * seq_lens int32 [m] (including the new token). Requires head_dim % 16 == 0,
 * num_heads % num_kv_heads == 0, num_heads <= 256. Returns 0, or -1 when scratch memory could
 * not be allocated (out is then undefined; the caches may hold the new tokens' K/V). */
int pkgd_decode_forward(const pkgd_decoder_dims* md, const pkgd_decoder_layer* layers, const float* emb,
                        float* out, int64_t m, const int64_t* positions, const int64_t* slots,
                        const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens) {
    const int64_t H = md->hidden, hq = md->num_heads, hkv = md->num_kv_heads, d = md->head_dim;
    const int64_t I = md->intermediate, G = hq / hkv, nqkv = (hq + 2 * hkv) * d, qd = hq * d;
    const int64_t rot = md->rot_dim, bs = md->block_size;
    const int nt = omp_get_max_threads();
    const int split_silu = m > 2; /* else every thread computes all of SiLU*mul itself */
    int64_t maxl = 1;
    for (int64_t r = 0; r < m; r++) maxl = seq_lens[r] > maxl ? seq_lens[r] : maxl;
    const int64_t sstride = (maxl + 15) & ~(int64_t)15;
    /* attention work items: (sequence, span of its blocks), all heads of a span together, so
     * each block (every head of every token: adjacent in memory) is read once, front to back;
     * sequences are cut into spans (flash-decoding, Dao et al., 2023) when there are too few
     * to keep every thread busy, and the spans' partial softmaxes merged after */
    const int64_t maxb = (maxl + bs - 1) / bs;
    int64_t nsplit = (2 * nt + m - 1) / m;
    nsplit = nsplit > maxb / 2 ? (maxb / 2 > 1 ? maxb / 2 : 1) : nsplit;
    const int64_t items = m * nsplit;
    /* shared: GEMV outputs, their split-block parts (one set per GEMV of a layer, so a reader
     * of one never races the writer of the next), the spans' partial attention */
    const size_t nbuf = (size_t)(m * (nqkv + H + 2 * I + I) + 4 * nt * m * 64 + m * hq * nsplit * (d + 2));
    float* buf = (float*)malloc(sizeof(float) * nbuf);
    int64_t* blk = (int64_t*)malloc(sizeof(int64_t) * 4 * nt);
    if (!buf || !blk) {
        free(buf);
        free(blk);
        return -1;
    }
    float *qkv = buf, *y = qkv + m * nqkv, *gu = y + m * H, *act = gu + m * 2 * I, *parts = act + m * I;
    float *pacc = parts + 4 * nt * m * 64, *pmx = pacc + m * hq * nsplit * d, *psum = pmx + m * hq * nsplit;
    float *p_qkv = parts, *p_o = p_qkv + nt * m * 64, *p_gu = p_o + nt * m * 64, *p_down = p_gu + nt * m * 64;
    int64_t *b_qkv = blk, *b_o = blk + nt, *b_gu = blk + 2 * nt, *b_down = blk + 3 * nt;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        /* this thread's own: residual and normed rows, one fixed GEMV row, the merged attention,
         * SiLU*mul (m <= 2), RoPE'd Q/K of a sequence, attention scores and scratch */
        const int64_t wrow = nqkv > 2 * I ? nqkv : 2 * I;
        const size_t nown = (size_t)(2 * m * H + wrow + m * qd + (split_silu ? 0 : m * I) + (hq + hkv) * d +
                                     hq * sstride + d + 16);
        float* own = (float*)malloc(sizeof(float) * nown);
        if (!own) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        const int ok = !failed;
        float *xr = own, *xn = xr + m * H, *row = xn + m * H, *at = row + wrow, *actp = at + m * qd;
        float *qk = actp + (split_silu ? 0 : m * I), *scores = qk + (hq + hkv) * d, *tmp = scores + hq * sstride;
        if (ok) memcpy(xr, emb, sizeof(float) * m * H);
        for (int64_t l = 0; ok && l < md->num_layers; l++) {
            const pkgd_decoder_layer* L = layers + l;
            /* residual += previous layer's output (+ its down bias); x = RMSNorm(residual) */
            for (int64_t r = 0; r < m; r++) {
                if (l > 0) {
                    fixed_range(row, y + r * H, 0, H, p_down, b_down, nt, m, r);
                    add_row(xr + r * H, row, layers[l - 1].down_bias, xr + r * H, H);
                }
                rms_row(xn + r * H, xr + r * H, L->ln1, H, md->eps);
            }
            gemv_team(xn, H, L->qkv, L->qkv_bias, qkv, m, nqkv, H, p_qkv, b_qkv);
#pragma omp barrier
            /* per item: the sequence's Q/K (QK-norm, RoPE) on this thread's copy; the item
             * holding the last block first writes the new token's K/V into the cache */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                const int64_t r = it / nsplit, sp = it % nsplit;
                fixed_range(row, qkv + r * nqkv, 0, nqkv, p_qkv, b_qkv, nt, m, r);
                for (int64_t hd = 0; hd < hq + hkv; hd++) {
                    float* v = qk + hd * d;
                    const float* nw = hd < hq ? L->q_norm : L->k_norm;
                    if (nw) rms_row(v, row + hd * d, nw, d, md->eps);
                    else memcpy(v, row + hd * d, sizeof(float) * d);
                    rope_head(v, md->cos_sin_cache + positions[r] * rot, rot);
                }
                if (sp == nsplit - 1 && slots[r] >= 0)
                    for (int64_t kh = 0; kh < hkv; kh++) {
                        const int64_t off = (slots[r] * hkv + kh) * d;
                        memcpy(L->k_cache + off, qk + (hq + kh) * d, sizeof(float) * d);
                        memcpy(L->v_cache + off, row + (hq + hkv + kh) * d, sizeof(float) * d);
                    }
                const int64_t nb = (seq_lens[r] + bs - 1) / bs, base = it * hq;
                attend_span(pacc + base * d, pmx + base, psum + base, qk, L->k_cache, L->v_cache,
                            block_tables + r * bt_stride, nb * sp / nsplit, nb * (sp + 1) / nsplit, seq_lens[r], G,
                            hkv, 0, hkv, d, bs, md->scale, scores, sstride, tmp, DT_F32);
            }
            /* merge the spans: weights exp(span max - overall max) (one span: weight 1, as attend_heads) */
            for (int64_t it = 0; it < m * hq; it++) {
                const int64_t r = it / hq, qh = it % hq;
                const int64_t base = r * nsplit * hq + qh; /* span sp at base + sp * hq */
                float mx = -INFINITY, den = 0.0f;
                for (int64_t sp = 0; sp < nsplit; sp++) mx = pmx[base + sp * hq] > mx ? pmx[base + sp * hq] : mx;
                float* o = at + r * qd + qh * d;
                for (int64_t i = 0; i < d; i += 16) STOREV(o + i, (v16){0});
                for (int64_t sp = 0; sp < nsplit; sp++) {
                    if (psum[base + sp * hq] == 0.0f) continue; /* an empty span */
                    const float w = expf(pmx[base + sp * hq] - mx);
                    den += w * psum[base + sp * hq];
                    const float* a = pacc + (base + sp * hq) * d;
                    for (int64_t i = 0; i < d; i += 16) STOREV(o + i, LOADV(o + i) + w * LOADV(a + i));
                }
                const v16 iv = (v16){0} + 1.0f / den;
                for (int64_t i = 0; i < d; i += 16) STOREV(o + i, LOADV(o + i) * iv);
            }
            gemv_team(at, qd, L->o, NULL, y, m, H, qd, p_o, b_o);
#pragma omp barrier
            for (int64_t r = 0; r < m; r++) {
                fixed_range(row, y + r * H, 0, H, p_o, b_o, nt, m, r);
                add_row(xr + r * H, row, L->o_bias, xr + r * H, H);
                rms_row(xn + r * H, xr + r * H, L->ln2, H, md->eps);
            }
            gemv_team(xn, H, L->gate_up, L->gate_up_bias, gu, m, 2 * I, H, p_gu, b_gu);
#pragma omp barrier
            const float* a_in = actp;
            if (split_silu) {
#pragma omp for schedule(static)
                for (int64_t c = 0; c < m * nt; c++) { /* rows cut in nt pieces of 16-float multiples */
                    const int64_t r = c / nt, p = c % nt;
                    const int64_t j0 = (I * p / nt) & ~(int64_t)15, j1 = p + 1 == nt ? I : (I * (p + 1) / nt) & ~(int64_t)15;
                    fixed_range(row, gu + r * 2 * I, j0, j1, p_gu, b_gu, nt, m, r);
                    fixed_range(row + (j1 - j0), gu + r * 2 * I, I + j0, I + j1, p_gu, b_gu, nt, m, r);
                    silu_mul_row(act + r * I + j0, row, row + (j1 - j0), j1 - j0);
                }
                a_in = act;
            } else {
                for (int64_t r = 0; r < m; r++) {
                    fixed_range(row, gu + r * 2 * I, 0, 2 * I, p_gu, b_gu, nt, m, r);
                    silu_mul_row(actp + r * I, row, row + I, I);
                }
            }
            gemv_team(a_in, I, L->down, NULL, y, m, H, I, p_down, b_down);
#pragma omp barrier
        }
        if (ok) {
            const int t = omp_get_thread_num();
            for (int64_t r = t; r < m; r += nt) {
                fixed_range(row, y + r * H, 0, H, p_down, b_down, nt, m, r);
                add_row(xr + r * H, row, layers[md->num_layers - 1].down_bias, xr + r * H, H);
                rms_row(out + r * H, xr + r * H, md->final_norm, H, md->eps);
            }
        }
        free(own);
    }
    free(buf);
    free(blk);
    return failed ? -1 : 0;
}
