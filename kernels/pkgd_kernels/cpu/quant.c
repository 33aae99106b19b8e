/* pkgd quantized-weight kernels: the C forms of pkgd_kernels' quant_linear and quant_gather
 * (bound in pkgd_kernels/cpu/quant.py, references in pkgd_kernels/quant.py), on the loops and
 * layouts of quant.h:
 *
 *  - pkgd_quant_linear: y[m, n] = x[m, k] W^T (+ bias) for any m: the activations quantized to
 *    int8 once, then every 16-row group of W read once for all m rows (in tiles of 4 rows), the
 *    groups split across the OpenMP threads. Decode (small m) is memory-bound: the point is
 *    reading ~4.5-6.5 bits a weight instead of 32; prefill runs int8 dot products.
 *  - pkgd_quant_gather: rows of W dequantized to float32 (an embedding lookup).
 *  - pkgd_quant_activations: the int8 activations of quant.h (for tests against the reference).
 */
#include "quant.h"

#define PKGD_QUANT_ABI_VERSION 1

int pkgd_abi_version(void) { return PKGD_QUANT_ABI_VERSION; }

int64_t pkgd_struct_layout(const char* name, int64_t* out, int64_t cap) { return quant_struct_layout(name, out, cap); }

/* The best path (QIMPL_*) this CPU runs. */
int pkgd_quant_best_impl(void) { return quant_best_impl(); }

/* dst <- m rows of x (row stride ldx) quantized as family fam (QA32 / QA256), rows of
 * qa_row_bytes(fam, k). */
void pkgd_quant_activations(uint8_t* dst, const float* x, int64_t ldx, int64_t m, int64_t k, int fam) {
    qa_quantize(dst, x, ldx, m, k, fam);
}

/* y[m, w->n] (contiguous) = x[m, k] (row stride ldx) W^T + bias (NULL or [n]) on path impl (one
 * the CPU lacks runs the best it has). Returns 0, -1 when scratch memory could not be allocated,
 * -2 for a weight quant_weight_ok refuses. */
int pkgd_quant_linear(const pkgd_qweight* w, const float* x, int64_t ldx, const float* bias, float* y, int64_t m,
                      int impl) {
    if (!quant_weight_ok(w)) return -2;
    if (m <= 0) return 0;
    impl = quant_usable_impl(impl);
    const int64_t k = w->k, groups = w->n / QROWS;
    const int fams = quant_families(w);
    uint8_t* buf = (uint8_t*)aligned_alloc(64, (size_t)quant_act_bytes(k, m, fams));
    if (!buf) return -1;
    const uint8_t *a32, *a256;
    const int64_t l32 = qa_row_bytes(QA32, k), l256 = qa_row_bytes(QA256, k);
    if (m > 16) { /* quantize rows on every thread */
        uint8_t* b256 = buf + ((fams & 1) ? m * l32 : 0);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            if (fams & 1) qa_quantize_row(buf + r * l32, x + r * ldx, k, QA32);
            if (fams & 2) qa_quantize_row(b256 + r * l256, x + r * ldx, k, QA256);
        }
        a32 = (fams & 1) ? buf : NULL;
        a256 = (fams & 2) ? b256 : NULL;
    } else {
        quant_prepare(buf, x, ldx, m, k, fams, &a32, &a256);
    }
#pragma omp parallel for schedule(static) if (groups > 1)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t* wg;
        int64_t nb;
        const pkgd_qsegment* sg = quant_locate(w, g, &wg, &nb);
        const int fam = qt_family(sg->qtype);
        quant_group_fn(sg->qtype, impl)(wg, 0, nb, fam == QA32 ? a32 : a256, fam == QA32 ? l32 : l256, k,
                                        y + g * QROWS, w->n, bias ? bias + g * QROWS : NULL, m);
    }
    free(buf);
    return 0;
}

/* out[t, k] <- rows ids[t] of W as float32. Returns 0, -1 (nothing written) when an id is outside
 * [0, n), -2 for a weight quant_weight_ok refuses. */
int pkgd_quant_gather(const pkgd_qweight* w, const int64_t* ids, int64_t t, float* out) {
    if (!quant_weight_ok(w)) return -2;
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= w->n) return -1;
#pragma omp parallel for schedule(static) if (t > 8)
    for (int64_t i = 0; i < t; i++) {
        const uint8_t* wg;
        int64_t nb;
        const pkgd_qsegment* sg = quant_locate(w, ids[i] / QROWS, &wg, &nb);
        qgroup_row_dequant(wg, sg->qtype, w->k, (int)(ids[i] % QROWS), out + i * w->k);
    }
    return 0;
}
