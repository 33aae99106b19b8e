/* The whole decode step of a Llama-family model (Llama, Qwen2, Qwen3) in one call and one OpenMP
 * region, built from the loops of pkgd_kernels (kernels.h, on the include path when
 * pkgd_kernels/cpu/build.py compiles this file). Bound in llama_cpu_decode.py, whose ctypes
 * structs mirror the two below; pkgd_struct_layout reports their sizes and offsets so the
 * loader refuses a library that disagrees with them.
 */
#include <stddef.h>

#include "kernels.h"
#include "quant.h"

#define PKGD_LLAMA_DECODE_ABI_VERSION 4

enum { W_QUANT = 2 }; /* weights: a pkgd_qweight each (quant.h), GGUF's blocks kept quantized */

/* Pointers of one decoder layer. Linear weights (qkv, o, gate_up, down) are in oneDNN's packing
 * of the dims' weight_dtype (kernels.h: float32 [out/64][in][64], bf16 [out/32][in/2][32][2] or
 * [out/64][in/2][64][2]),
 * or for W_QUANT each a pkgd_qweight (quant.h) whose rows are exactly the linear's outputs;
 * norms and biases float32; Q/K rows (and q_norm/k_norm) in the adjacent-pair RoPE layout.
 * Optional tensors are NULL when the model has none. Caches: [num_blocks, block_size, hkv, d] of
 * the dims' kv_dtype. */
typedef struct {
    const float *ln1;
    const void* qkv;
    const float *qkv_bias, *q_norm, *k_norm;
    const void* o;
    const float *o_bias, *ln2;
    const void* gate_up;
    const float* gate_up_bias;
    const void* down;
    const float* down_bias;
    void *k_cache, *v_cache;
} pkgd_decoder_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, rot_dim, block_size;
    float eps, scale;
    int32_t weight_dtype;        /* W_F32, W_BF16, W_BF16_64 or W_QUANT */
    int32_t kv_dtype;            /* DT_F32, DT_F16 or DT_BF16 */
    int32_t bf16_impl;           /* BF16_DP or BF16_WIDEN (bf16 weights) */
    int32_t quant_impl;          /* QIMPL_* (quantized weights) */
    const float* final_norm;     /* [hidden] */
    const float* cos_sin_cache;  /* [max_position, rot_dim]: cos of each pair, then sin */
} pkgd_decoder_dims;

/* The new token's K (or V) row of one KV head, d floats, into the cache at element `off`. */
static inline void store_kv(void* cache, int dtype, int64_t off, const float* src, int64_t d) {
    if (dtype == DT_F32) {
        memcpy((float*)cache + off, src, sizeof(float) * (size_t)d);
    } else if (dtype == DT_F16) {
        for (int64_t i = 0; i < d; i++) ((_Float16*)cache)[off + i] = (_Float16)src[i];
    } else {
        for (int64_t i = 0; i < d; i++) ((uint16_t*)cache)[off + i] = f32_to_bf16(src[i]);
    }
}

/* attend_span with the cache dtype a run-time value (each variant inlined with its constant). */
static void attend_span_any(float* acc, float* mx, float* sum, const float* q, const void* kc, const void* vc,
                            const int32_t* table, int64_t b0, int64_t b1, int64_t len, int64_t g, int64_t hkv,
                            int64_t d, int64_t bs, float scale, float* scores, int64_t sstride, float* tmp, int dtype) {
    if (dtype == DT_F32)
        attend_span(acc, mx, sum, q, NULL, kc, vc, table, b0, b1, len, g, hkv, 0, hkv, d, bs, scale, scores,
                    sstride, tmp, DT_F32);
    else if (dtype == DT_F16)
        attend_span(acc, mx, sum, q, NULL, kc, vc, table, b0, b1, len, g, hkv, 0, hkv, d, bs, scale, scores,
                    sstride, tmp, DT_F16);
    else
        attend_span(acc, mx, sum, q, NULL, kc, vc, table, b0, b1, len, g, hkv, 0, hkv, d, bs, scale, scores,
                    sstride, tmp, DT_BF16);
}

int pkgd_abi_version(void) { return PKGD_LLAMA_DECODE_ABI_VERSION; }

/* out <- [sizeof, offsetof each field in declaration order] of the struct called `name`;
 * returns the count written, or -1 for an unknown name or too small a buffer. */
int64_t pkgd_struct_layout(const char* name, int64_t* out, int64_t cap) {
    static const int64_t layer[] = {
        sizeof(pkgd_decoder_layer), offsetof(pkgd_decoder_layer, ln1), offsetof(pkgd_decoder_layer, qkv),
        offsetof(pkgd_decoder_layer, qkv_bias), offsetof(pkgd_decoder_layer, q_norm),
        offsetof(pkgd_decoder_layer, k_norm), offsetof(pkgd_decoder_layer, o), offsetof(pkgd_decoder_layer, o_bias),
        offsetof(pkgd_decoder_layer, ln2), offsetof(pkgd_decoder_layer, gate_up),
        offsetof(pkgd_decoder_layer, gate_up_bias), offsetof(pkgd_decoder_layer, down),
        offsetof(pkgd_decoder_layer, down_bias), offsetof(pkgd_decoder_layer, k_cache),
        offsetof(pkgd_decoder_layer, v_cache),
    };
    static const int64_t dims[] = {
        sizeof(pkgd_decoder_dims), offsetof(pkgd_decoder_dims, num_layers), offsetof(pkgd_decoder_dims, hidden),
        offsetof(pkgd_decoder_dims, num_heads), offsetof(pkgd_decoder_dims, num_kv_heads),
        offsetof(pkgd_decoder_dims, head_dim), offsetof(pkgd_decoder_dims, intermediate),
        offsetof(pkgd_decoder_dims, rot_dim), offsetof(pkgd_decoder_dims, block_size),
        offsetof(pkgd_decoder_dims, eps), offsetof(pkgd_decoder_dims, scale),
        offsetof(pkgd_decoder_dims, weight_dtype), offsetof(pkgd_decoder_dims, kv_dtype),
        offsetof(pkgd_decoder_dims, bf16_impl), offsetof(pkgd_decoder_dims, quant_impl),
        offsetof(pkgd_decoder_dims, final_norm), offsetof(pkgd_decoder_dims, cos_sin_cache),
    };
    const int64_t* src = NULL;
    int64_t n = 0;
    if (!strcmp(name, "pkgd_decoder_layer")) src = layer, n = sizeof layer / sizeof *layer;
    else if (!strcmp(name, "pkgd_decoder_dims")) src = dims, n = sizeof dims / sizeof *dims;
    if (!src) return quant_struct_layout(name, out, cap); /* pkgd_qweight, pkgd_qsegment */
    if (n > cap) return -1;
    memcpy(out, src, sizeof(int64_t) * (size_t)n);
    return n;
}

/* One linear of a layer by a thread team (every thread calling): y = x W^T (+ bias), x rows of
 * stride ldx, into gemv_team's output protocol. xbuf is this thread's scratch for x in the
 * weights' form: bf16 pairs (W_BF16, W_BF16_64) or int8 activations (W_QUANT), made by each thread itself
 * (cheaper than a barrier). */
static inline void layer_gemv(const float* x, int64_t ldx, void* xbuf, const void* w, int wdt, int impl, int qimpl,
                              const float* bias, float* y, int64_t m, int64_t n, int64_t k, float* part, int64_t* blk) {
    if (wdt == W_QUANT) {
        const pkgd_qweight* qw = (const pkgd_qweight*)w;
        const uint8_t *a32, *a256;
        quant_prepare((uint8_t*)xbuf, x, ldx, m, k, quant_families(qw), &a32, &a256);
        qgemv_team(qw, a32, a256, qimpl, bias, y, m, part, blk);
        return;
    }
    if (is_bf16(wdt)) pack_x_bf16((uint32_t*)xbuf, x, ldx, m, k);
    gemv_team(x, ldx, (const uint32_t*)xbuf, w, wdt, impl, bias, y, m, n, k, part, blk);
}

/* One decode step of m sequences (one new token each) through every layer, in one OpenMP
 * region: per layer RMSNorm -> QKV -> (QK-norm) -> RoPE -> K/V written at slots[r] -> paged
 * attention over seq_lens[r] tokens -> o_proj -> residual + RMSNorm -> gate/up -> SiLU*mul ->
 * down_proj, then the final RMSNorm. The GEMVs and the attention are split across the threads,
 * each ending at a barrier; the small steps between them (norms, residual adds, RoPE, the span
 * merge, and SiLU for m <= 2) are done by every thread on its own copy, which costs less than
 * a barrier: 5 barriers a layer (6 for m > 2). Nothing returns to Python between layers. Same
 * arithmetic as the per-op path (pkgd_gemv_packed64 / pkgd_gemv_bf16_packed32, pkgd_rms_norm,
 * pkgd_paged_attention_decode), except that a GEMV block split between threads sums its two
 * halves separately, and a long sequence's attention is cut into spans whose softmaxes are merged.
 * With bf16 weights the residual stream, norms, RoPE, softmax and SiLU stay float32; each GEMV
 * input is rounded to bf16 (as a bf16 GEMM's), and a bf16/fp16 cache stores the new K/V rounded.
 * With quantized weights (W_QUANT) likewise, each GEMV input quantized to int8 as
 * pkgd_quant_linear does (quant.h), in 16-output groups instead of packed blocks.
 *
 * emb: [m, hidden] embeddings of the new tokens; out: [m, hidden] final hidden states;
 * positions, slots: int64 [m] (slot -1: do not write); block_tables int32 [m, bt_stride];
 * seq_lens int32 [m] (including the new token). kv_first != 0: every row's K/V is written
 * before any row attends (one more barrier a layer), so rows may be consecutive positions of
 * one sequence sharing its block table (speculative verification); else each work item writes
 * its own row's K/V just before it attends. Requires head_dim % 16 == 0,
 * num_heads % num_kv_heads == 0, num_heads <= 256. Returns 0, or -1 when scratch memory could
 * not be allocated (out is then undefined; the caches may hold the new tokens' K/V). */
int pkgd_decode_forward(const pkgd_decoder_dims* md, const pkgd_decoder_layer* layers, const float* emb,
                        float* out, int64_t m, const int64_t* positions, const int64_t* slots,
                        const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens, int64_t kv_first) {
    const int64_t H = md->hidden, hq = md->num_heads, hkv = md->num_kv_heads, d = md->head_dim;
    const int64_t I = md->intermediate, G = hq / hkv, nqkv = (hq + 2 * hkv) * d, qd = hq * d;
    const int64_t rot = md->rot_dim, bs = md->block_size;
    const int wdt = md->weight_dtype, kvdt = md->kv_dtype, impl = md->bf16_impl, qimpl = quant_usable_impl(md->quant_impl);
    const int64_t bw = wdt == W_QUANT ? QROWS : block_outputs(wdt); /* outputs per packed block */
    const int64_t maxk = H > qd ? (H > I ? H : I) : (qd > I ? qd : I);
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
        /* x of the current GEMV as bf16 pairs or int8 (bf16 / quantized weights): every thread
         * makes its own copy */
        const size_t nxp = wdt == W_QUANT ? (size_t)quant_act_bytes(maxk, m, 3) : sizeof(uint32_t) * (size_t)(m * maxk / 2 + 1);
        void* xp = wdt != W_F32 ? malloc(nxp) : NULL;
        if (!own || (wdt != W_F32 && !xp)) {
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
                    fixed_range(row, y + r * H, 0, H, p_down, b_down, nt, m, r, bw);
                    add_row(xr + r * H, row, layers[l - 1].down_bias, xr + r * H, H);
                }
                rms_row(xn + r * H, xr + r * H, L->ln1, H, md->eps);
            }
            layer_gemv(xn, H, xp, L->qkv, wdt, impl, qimpl, L->qkv_bias, qkv, m, nqkv, H, p_qkv, b_qkv);
#pragma omp barrier
            if (kv_first) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < m; r++) {
                    if (slots[r] < 0) continue;
                    fixed_range(row, qkv + r * nqkv, 0, nqkv, p_qkv, b_qkv, nt, m, r, bw);
                    for (int64_t kh = 0; kh < hkv; kh++) {
                        float* v = qk + (hq + kh) * d;
                        if (L->k_norm) rms_row(v, row + (hq + kh) * d, L->k_norm, d, md->eps);
                        else memcpy(v, row + (hq + kh) * d, sizeof(float) * d);
                        rope_head(v, md->cos_sin_cache + positions[r] * rot, rot);
                        const int64_t off = (slots[r] * hkv + kh) * d;
                        store_kv(L->k_cache, kvdt, off, v, d);
                        store_kv(L->v_cache, kvdt, off, row + (hq + hkv + kh) * d, d);
                    }
                } /* the implicit barrier: every row's K/V is in the cache */
            }
            /* per item: the sequence's Q/K (QK-norm, RoPE) on this thread's copy; the item
             * holding the last block first writes the new token's K/V into the cache */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                const int64_t r = it / nsplit, sp = it % nsplit;
                fixed_range(row, qkv + r * nqkv, 0, nqkv, p_qkv, b_qkv, nt, m, r, bw);
                for (int64_t hd = 0; hd < hq + hkv; hd++) {
                    float* v = qk + hd * d;
                    const float* nw = hd < hq ? L->q_norm : L->k_norm;
                    if (nw) rms_row(v, row + hd * d, nw, d, md->eps);
                    else memcpy(v, row + hd * d, sizeof(float) * d);
                    rope_head(v, md->cos_sin_cache + positions[r] * rot, rot);
                }
                if (!kv_first && sp == nsplit - 1 && slots[r] >= 0)
                    for (int64_t kh = 0; kh < hkv; kh++) {
                        const int64_t off = (slots[r] * hkv + kh) * d;
                        store_kv(L->k_cache, kvdt, off, qk + (hq + kh) * d, d);
                        store_kv(L->v_cache, kvdt, off, row + (hq + hkv + kh) * d, d);
                    }
                const int64_t nb = (seq_lens[r] + bs - 1) / bs, base = it * hq;
                attend_span_any(pacc + base * d, pmx + base, psum + base, qk, L->k_cache, L->v_cache,
                                block_tables + r * bt_stride, nb * sp / nsplit, nb * (sp + 1) / nsplit, seq_lens[r], G,
                                hkv, d, bs, md->scale, scores, sstride, tmp, kvdt);
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
            layer_gemv(at, qd, xp, L->o, wdt, impl, qimpl, NULL, y, m, H, qd, p_o, b_o);
#pragma omp barrier
            for (int64_t r = 0; r < m; r++) {
                fixed_range(row, y + r * H, 0, H, p_o, b_o, nt, m, r, bw);
                add_row(xr + r * H, row, L->o_bias, xr + r * H, H);
                rms_row(xn + r * H, xr + r * H, L->ln2, H, md->eps);
            }
            layer_gemv(xn, H, xp, L->gate_up, wdt, impl, qimpl, L->gate_up_bias, gu, m, 2 * I, H, p_gu, b_gu);
#pragma omp barrier
            const float* a_in = actp;
            if (split_silu) {
#pragma omp for schedule(static)
                for (int64_t c = 0; c < m * nt; c++) { /* rows cut in nt pieces of 16-float multiples */
                    const int64_t r = c / nt, p = c % nt;
                    const int64_t j0 = (I * p / nt) & ~(int64_t)15, j1 = p + 1 == nt ? I : (I * (p + 1) / nt) & ~(int64_t)15;
                    fixed_range(row, gu + r * 2 * I, j0, j1, p_gu, b_gu, nt, m, r, bw);
                    fixed_range(row + (j1 - j0), gu + r * 2 * I, I + j0, I + j1, p_gu, b_gu, nt, m, r, bw);
                    silu_mul_row(act + r * I + j0, row, row + (j1 - j0), j1 - j0);
                }
                a_in = act;
            } else {
                for (int64_t r = 0; r < m; r++) {
                    fixed_range(row, gu + r * 2 * I, 0, 2 * I, p_gu, b_gu, nt, m, r, bw);
                    silu_mul_row(actp + r * I, row, row + I, I);
                }
            }
            layer_gemv(a_in, I, xp, L->down, wdt, impl, qimpl, NULL, y, m, H, I, p_down, b_down);
#pragma omp barrier
        }
        if (ok) {
            const int t = omp_get_thread_num();
            for (int64_t r = t; r < m; r += nt) {
                fixed_range(row, y + r * H, 0, H, p_down, b_down, nt, m, r, bw);
                add_row(xr + r * H, row, layers[md->num_layers - 1].down_bias, xr + r * H, H);
                rms_row(out + r * H, xr + r * H, md->final_norm, H, md->eps);
            }
        }
        free(own);
        free(xp);
    }
    free(buf);
    free(blk);
    return failed ? -1 : 0;
}
