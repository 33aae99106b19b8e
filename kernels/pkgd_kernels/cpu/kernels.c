/* pkgd CPU kernels: the hot loops of CPU decode that PyTorch has no fast op for. Each is the C
 * form of a pkgd_kernels op (bound in pkgd_kernels/cpu/__init__.py, reference in the op's module):
 *
 *  - pkgd_gemv_packed64: y[M, N] = x[M, K] W^T (+ bias) for small M, reading W in oneDNN's
 *    blocked layout [N/64][K][64] (what torch.ops.mkldnn._reorder_linear_weight produces for
 *    the fp32 linears here), so the weight held for batched GEMMs serves decode too. Each
 *    64-row block is streamed once per call; memory-bound, so the goal is DRAM read speed.
 *  - pkgd_gather_packed64: rows of a weight in that packing (the embedding lookup of a model
 *    whose embedding is tied to its packed LM head).
 *  - pkgd_gemv_bf16_packed / pkgd_gather_bf16_packed: the same for bf16 weights in oneDNN's
 *    bf16 packing [N/B][K/2][B][2], B = 32 or 64 (vdpbf16ps where the CPU has it, else widening).
 *  - pkgd_rms_norm: RMSNorm of float32 rows, optionally after adding a residual (which it
 *    also returns): one pass where PyTorch's composite op runs several (pow, mean, rsqrt, mul).
 *    pkgd_rms_norm_bf16: the same on bf16 rows, with the roundings of the bf16 reference.
 *  - pkgd_rotary_embedding: RoPE on the query and key rows of float32 or bf16 tokens, reading
 *    the cos/sin table by position (PyTorch's form gathers the table, widens bf16 rows, rotates
 *    as complex numbers and rounds back: five passes).
 *  - pkgd_silu_and_mul: SwiGLU's gate on float32 or bf16 rows in one pass (torch runs silu,
 *    then a product, and for bf16 a conversion each way inside each).
 *  - pkgd_paged_attention_decode: one query token per sequence over the paged KV cache
 *    [num_blocks, block_size, num_kv_heads, head_dim], read in place through the block table
 *    (no gathered copy), the G = Hq/Hkv query heads of a KV head sharing each K/V read
 *    (GQA), two passes: scores with a max-subtracted softmax, then the weighted sum of V.
 *
 * The loops themselves are in kernels.h. pkgd_abi_version and pkgd_struct_layout let the
 * loader check this library against its ctypes bindings (pkgd_kernels/cpu/build.py).
 */
#include "kernels.h"

#define PKGD_KERNELS_ABI_VERSION 10

int pkgd_abi_version(void) { return PKGD_KERNELS_ABI_VERSION; }

/* No structs cross this library's ABI (every argument is a pointer or a scalar): any name is
 * unknown (-1). */
int64_t pkgd_struct_layout(const char* name, int64_t* out, int64_t cap) {
    (void)name, (void)out, (void)cap;
    return -1;
}

int pkgd_num_threads(void) { return omp_get_max_threads(); }

/* 1 when this CPU executes AVX512-BF16's vdpbf16ps (the BF16_DP path), else 0. */
int pkgd_bf16_dot_native(void) { return bf16_dot_native(); }

/* x: [m, k] with row stride ldx; w: [n/64][k][64]; bias: [n] or NULL; y: [m, n] contiguous.
 * n must be a multiple of 64. */
void pkgd_gemv_packed64(const float* x, int64_t ldx, const float* w, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k) {
    const int64_t nblk = n / 64;
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t b = 0; b < nblk; b++)
        gemv_rows(x, ldx, w + b * k * 64, 0, k, y + b * 64, n, bias ? bias + b * 64 : NULL, m);
}

/* y[m, n] = x[m, k] W^T (+ bias) for bf16 W in the [n/bb][k/2][bb][2] packing (kernels.h; bb 32
 * or 64); x float32 rows of stride ldx, rounded to bf16; y float32 [m, n] contiguous.
 * n % bb == 0, k % 2 == 0. impl: BF16_DP or BF16_WIDEN. Returns 0, -1 when scratch could not be
 * allocated, -2 for another bb. */
int pkgd_gemv_bf16_packed(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y, int64_t m,
                          int64_t n, int64_t k, int64_t bb, int impl) {
    if (bb != 32 && bb != 64) return -2;
    uint32_t* xp = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(m * (k / 2) + 1));
    if (!xp) return -1;
    pack_x_bf16(xp, x, ldx, m, k);
    const int64_t nblk = n / bb; /* whole blocks, each read front to back (gemv_bf16_rows) */
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t b = 0; b < nblk; b++)
        gemv_bf16_rows(xp, k / 2, w + b * k * bb, 2 * bb, 0, k / 2, y + b * bb, n, bias ? bias + b * bb : NULL, m,
                       impl, bb);
    free(xp);
    return 0;
}

/* out[t, k] <- rows ids[t] of bf16 W [n, k] in the [n/bb][k/2][bb][2] packing: row v's pair j sits
 * in line (v / bb) * (k / 2) + j (of 2 * bb elements), 4 bytes of it, so as in
 * pkgd_gather_packed64 all of a row's lines are requested before the first is read. Returns 0,
 * -1 (nothing written) when an id is outside [0, n), -2 for a bb other than 32 or 64. */
int pkgd_gather_bf16_packed(uint16_t* out, const uint16_t* w, const int64_t* ids, int64_t t, int64_t n, int64_t k,
                            int64_t bb) {
    if (bb != 32 && bb != 64) return -2;
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
#pragma omp parallel for schedule(static) if (t > 8)
    for (int64_t i = 0; i < t; i++) {
        const uint16_t* col = w + (ids[i] / bb) * k * bb + (ids[i] % bb) * 2;
        for (int64_t j = 0; j < k / 2; j++) __builtin_prefetch(col + j * 2 * bb, 0, 1);
        for (int64_t j = 0; j < k / 2; j++) {
            out[i * k + 2 * j] = col[j * 2 * bb];
            out[i * k + 2 * j + 1] = col[j * 2 * bb + 1];
        }
    }
    return 0;
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

/* out: [ns, hq, d] contiguous, of q_dtype; q: [ns, hq, d] of q_dtype (float32, float16 or
 * bfloat16) with token stride q_stride (heads contiguous), widened to float32 per work item;
 * kc/vc: [num_blocks, bs, hkv, d] of `dtype`; block_tables: int32 [ns, bt_stride];
 * seq_lens: int32 [ns]. Computes in float32; a 16-bit out is rounded once (bf16: to nearest
 * even). bf16 queries over a bf16 cache take the scores by vdpbf16ps when impl is BF16_DP and
 * the CPU has it (attend_span), else by widening. Requires d % 16 == 0, hq % hkv == 0, hq <= 256.
 * Work is split by sequence when there are enough sequences for every thread, else by
 * (sequence, KV head); below 8192 token-heads of context in all, the calling thread does it
 * alone (waking the pool costs more than the work). Returns 0, or -1 when scratch memory could not be allocated. */
int pkgd_paged_attention_decode(void* out, const void* q, int64_t q_stride, int q_dtype, const void* kc,
                                const void* vc, int dtype, const int32_t* block_tables,
                                int64_t bt_stride, const int32_t* seq_lens, int64_t ns, int64_t hq,
                                int64_t hkv, int64_t d, int64_t bs, float scale, int impl) {
    const int64_t g = hq / hkv;
    const int dp = impl == BF16_DP && q_dtype == DT_BF16 && dtype == DT_BF16 && bf16_dot_native();
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
        /* scores, acc, tmp (one row), then for 16-bit queries the widened query heads and the
         * float32 output before rounding */
        const int64_t wide = q_dtype == DT_F32 ? 0 : 2 * nq * d;
        float* scores = (float*)malloc(sizeof(float) * (size_t)(nq * sstride + nq * d + d + 16 + wide));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        float* acc = scores ? scores + nq * sstride : NULL;
        float* tmp = acc ? acc + nq * d : NULL;
        float* qf = tmp ? tmp + d + 16 : NULL;
        float* of = qf ? qf + nq * d : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < ns * split; w++) {
            if (!scores) continue;
            const int64_t s = w / split, h0 = (w % split) * hper, h1 = h0 + hper;
            const int64_t qoff = s * q_stride + h0 * g * d, ooff = (s * hq + h0 * g) * d;
            const float* qs = (const float*)q + qoff;
            float* os = (float*)out + ooff;
            if (q_dtype != DT_F32) {
                for (int64_t i = 0; i < nq * d; i += 16) STOREV(qf + i, load_kv16(q, qoff + i, q_dtype));
                qs = qf, os = of;
            }
            const uint16_t* qb = dp ? (const uint16_t*)q + qoff : NULL;
            const int32_t* table = block_tables + s * bt_stride;
            const int64_t len = seq_lens[s];
            if (dtype == DT_F32)
                attend_heads(os, qs, kc, vc, table, len, g, hkv, h0, h1, d, bs, scale, scores, sstride, acc, tmp, DT_F32, qb);
            else if (dtype == DT_F16)
                attend_heads(os, qs, kc, vc, table, len, g, hkv, h0, h1, d, bs, scale, scores, sstride, acc, tmp, DT_F16, qb);
            else
                attend_heads(os, qs, kc, vc, table, len, g, hkv, h0, h1, d, bs, scale, scores, sstride, acc, tmp, DT_BF16, qb);
            if (q_dtype == DT_BF16)
                for (int64_t i = 0; i < nq * d; i += 16) store_bf16x16((uint16_t*)out + ooff + i, LOADV(of + i));
            else if (q_dtype == DT_F16)
                for (int64_t i = 0; i < nq * d; i += 16)
                    *(h16u*)((_Float16*)out + ooff + i) = __builtin_convertvector(LOADV(of + i), h16u);
        }
        free(scores);
    }
    return failed ? -1 : 0;
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

/* pkgd_rms_norm on bf16 rows (rms_row_bf16): x rows have stride ldx; residual, out and res_out
 * are contiguous [t, h]. */
void pkgd_rms_norm_bf16(uint16_t* out, uint16_t* res_out, const uint16_t* x, int64_t ldx,
                        const uint16_t* residual, const uint16_t* weight, int64_t t, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (t * h > (1 << 16))
    for (int64_t i = 0; i < t; i++)
        rms_row_bf16(out + i * h, residual ? res_out + i * h : NULL, x + i * ldx,
                     residual ? residual + i * h : NULL, weight, h, eps);
}

/* out[t, n] = silu(x[:, :n]) * x[:, n:] for x [t, 2n] with row stride ldx (elements), float32
 * (dtype DT_F32) or bf16 (DT_BF16); out contiguous. Returns -1 for another dtype. */
int pkgd_silu_and_mul(void* out, const void* x, int64_t ldx, int64_t t, int64_t n, int dtype) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
#pragma omp parallel for schedule(static) if (t * n > (1 << 15))
    for (int64_t i = 0; i < t; i++) {
        if (dtype == DT_F32)
            silu_mul_row((float*)out + i * n, (const float*)x + i * ldx, (const float*)x + i * ldx + n, n);
        else
            silu_mul_row_bf16((uint16_t*)out + i * n, (const uint16_t*)x + i * ldx, n);
    }
    return 0;
}

static inline __attribute__((always_inline)) v16 ld16(const void* p, int64_t i, const int dtype) {
    return dtype == DT_F32 ? LOADV((const float*)p + i) : load_bf16x16((const uint16_t*)p + i);
}

static inline __attribute__((always_inline)) void st16(void* p, int64_t i, v16 v, const int dtype) {
    if (dtype == DT_F32) STOREV((float*)p + i, v);
    else store_bf16x16((uint16_t*)p + i, v);
}

/* The rotation of one token as rope_head_to reads it: cs = its table row (cos in [0, rot/2),
 * sin in [rot/2, rot)); for GPT-J pairs (2i, 2i + 1) also cd / sd [rot], each pair's cos twice
 * and its sin as (-sin, +sin), so 16 channels rotate as x * cd + swap_pairs(x) * sd. */
typedef struct {
    const float* cs;
    float* cd;
    float* sd;
} rope_row;

/* One head of d channels, the first rot rotated (Su et al., 2021), the rest copied; pairs
 * (i, i + rot/2) when neox, else (2i, 2i + 1). Computed in float32 and rounded once (bf16: to
 * nearest even). 16 channels at a time where rot % 32 == 0, else one pair at a time. */
static inline __attribute__((always_inline)) void rope_head_to(
    void* o, const void* x, rope_row r, int64_t d, int64_t rot, int neox, const int dtype) {
    const int64_t half = rot / 2, es = dtype == DT_F32 ? 4 : 2;
    if (rot % 32 == 0 && neox) {
        for (int64_t i = 0; i < half; i += 16) {
            const v16 a = ld16(x, i, dtype), b = ld16(x, half + i, dtype);
            const v16 c = LOADV(r.cs + i), s = LOADV(r.cs + half + i);
            st16(o, i, a * c - b * s, dtype);
            st16(o, half + i, b * c + a * s, dtype);
        }
    } else if (rot % 32 == 0) {
        for (int64_t j = 0; j < rot; j += 16) {
            const v16 v = ld16(x, j, dtype);
            const v16 sw = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
            st16(o, j, v * LOADV(r.cd + j) + sw * LOADV(r.sd + j), dtype);
        }
    } else {
        const int64_t step = neox ? 1 : 2, other = neox ? half : 1;
        for (int64_t i = 0; i < half; i++) {
            const int64_t ia = i * step, ib = ia + other;
            const float a = dtype == DT_F32 ? ((const float*)x)[ia] : bf16_to_f32(((const uint16_t*)x)[ia]);
            const float b = dtype == DT_F32 ? ((const float*)x)[ib] : bf16_to_f32(((const uint16_t*)x)[ib]);
            const float c = r.cs[i], s = r.cs[half + i];
            if (dtype == DT_F32) {
                ((float*)o)[ia] = a * c - b * s;
                ((float*)o)[ib] = b * c + a * s;
            } else {
                ((uint16_t*)o)[ia] = f32_to_bf16(a * c - b * s);
                ((uint16_t*)o)[ib] = f32_to_bf16(b * c + a * s);
            }
        }
    }
    if (d > rot) memcpy((char*)o + rot * es, (const char*)x + rot * es, (size_t)((d - rot) * es));
}

/* qo[t, hq * d] / ko[t, hk * d] (contiguous) = q / k (rows ldq / ldk elements apart) with RoPE
 * at positions pos[t] of the float32 table cache [max_pos, rot]; float32 (DT_F32) or bf16
 * (DT_BF16) rows; rot <= 512 (ROPE_MAX_ROT in the bindings). Returns 0, -1 for another dtype or rot, or 1 + the first token whose position lies
 * outside [0, max_pos) (nothing is written then). */
int64_t pkgd_rotary_embedding(void* qo, void* ko, const void* q, int64_t ldq, const void* k, int64_t ldk,
                              const int64_t* pos, const float* cache, int64_t max_pos, int64_t t, int64_t hq,
                              int64_t hk, int64_t d, int64_t rot, int neox, int dtype) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    for (int64_t i = 0; i < t; i++)
        if (pos[i] < 0 || pos[i] >= max_pos) return i + 1;
    const int64_t es = dtype == DT_F32 ? 4 : 2;
    if (rot > 512) return -1;
#pragma omp parallel for schedule(static) if (t * (hq + hk) * d > (1 << 15))
    for (int64_t i = 0; i < t; i++) {
        float cd[512] __attribute__((aligned(64))), sd[512] __attribute__((aligned(64)));
        const rope_row r = {cache + pos[i] * rot, cd, sd};
        if (!neox)
            for (int64_t j = 0; j < rot; j++) {
                cd[j] = r.cs[j / 2];
                sd[j] = (j & 1) ? r.cs[rot / 2 + j / 2] : -r.cs[rot / 2 + j / 2];
            }
        for (int64_t h = 0; h < hq + hk; h++) {
            const int isq = h < hq;
            const int64_t hh = isq ? h : h - hq;
            char* o = (char*)(isq ? qo : ko) + ((isq ? i * hq : i * hk) + hh) * d * es;
            const char* x = (const char*)(isq ? q : k) + (i * (isq ? ldq : ldk) + hh * d) * es;
            if (dtype == DT_F32) rope_head_to(o, x, r, d, rot, neox, DT_F32);
            else rope_head_to(o, x, r, d, rot, neox, DT_BF16);
        }
    }
    return 0;
}
