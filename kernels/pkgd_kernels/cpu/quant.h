/* pkgd quantized-weight kernels: x @ W^T on GGUF's quantized blocks, repacked 16 output rows at a
 * time so one 64-byte line holds the same 4 inputs of 16 rows (the operand layout of AVX-512
 * VNNI's vpdpbusd: lane j = output row j). Shared by quant.c (the ops' C forms) and the fused
 * decode steps that include it (pkgd/runner/models/llama_cpu_decode.c). Everything is static
 * inline; each library compiles its own copy.
 *
 * Weights (pkgd_kernels/quant.py packs GGUF blocks into these and documents them): a matrix
 * is one or more segments of rows (fused projections whose GGUF tensors differ in type), each
 * of one GGML type, rows a multiple of 16, laid out group by group (16 rows), each group block
 * by block along K:
 *   Q4_0 / Q4_1 (32 inputs a block, 320 bytes a group-block): fp16 d[16], fp16 m[16], then
 *     4 lines of nibbles: line s, row j, byte i = q[j][4s+i] | q[j][16+4s+i] << 4 (q in 0..15);
 *     w = d * q + m (Q4_0: m = -8 d).
 *   Q8_0 (32 inputs, 576 bytes): fp16 d[16], int16 wsum[16] (sum of the block's q), then 8
 *     lines: line t, row j, byte i = q[j][4t+i] (int8); w = d * q.
 *   Q4_K (256 inputs, 2368 bytes): fp16 d[16], fp16 dmin[16], u8 sc[8][16], u8 mn[8][16], then
 *     8 chunks of 32 inputs in the Q4 nibble layout; w = d * sc[c] * q - dmin * mn[c].
 *   Q6_K (256 inputs, 3392 bytes): fp16 d[16], 32 bytes unused, int8 sc[16][16] (per 16 inputs),
 *     then 8 chunks of 32 inputs: 4 lines of low nibbles (Q4 layout) and 2 lines of high bit
 *     pairs (line u, row j, byte i, bits 2p..2p+1 = q >> 4 of input 4(4u+p)+i); w = d * sc * (q - 32).
 *
 * Activations are quantized to int8 once per call (llama.cpp's scheme, as its CPU matmuls do):
 *   A32 (Q4_0/Q4_1/Q8_0): per 32 inputs, dx = max|x| / 127, q = rint(x / dx) (nearest even);
 *     a row is int8 q[K], float dx[K/32], float ds[K/32] (= dx * sum(q)).
 *   A256 (Q4_K/Q6_K): per 256 inputs, the same dx; a row is int8 q[K], float dx[K/256], int32
 *     bsum[K/16] (sums of q over 16 inputs).
 * Integer dot products of a block are exact and identical on every path; paths differ only in
 * the order of the float sums.
 *
 * Paths (QIMPL_*), chosen at run time by CPU feature (quant_best_impl), each compiled for its
 * own target whatever -march the library was built with: AVX-512 VNNI (vpdpbusd), AVX2
 * (vpmaddubsw + vpmaddwd; Q8_0 through the sign trick, |w| * sign(x, w), so nothing saturates),
 * and portable C. A request for a path the CPU lacks runs the best one it has.
 */
#ifndef PKGD_QUANT_H
#define PKGD_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14 }; /* GGML type ids */
enum { QIMPL_SCALAR = 0, QIMPL_AVX2 = 1, QIMPL_VNNI512 = 2 };
enum { QA32 = 0, QA256 = 1 };

#define PKGD_QMAX_SEG 4
#define QROWS 16       /* output rows a group */
#define QTILE 4        /* activation rows a kernel pass */
#define QPREFETCH 2048 /* bytes of weights requested ahead of use */

typedef struct {
    int64_t qtype;       /* QT_* */
    int64_t rows;        /* output rows, a multiple of 16 */
    const uint8_t* data; /* rows / 16 groups of K / qt_block(qtype) blocks */
} pkgd_qsegment;

typedef struct {
    int64_t n, k, nseg; /* n = sum of the segments' rows */
    pkgd_qsegment seg[PKGD_QMAX_SEG];
} pkgd_qweight;

static inline int64_t qt_block(int64_t qt) { return qt == QT_Q4_K || qt == QT_Q6_K ? 256 : 32; }
static inline int qt_family(int64_t qt) { return qt == QT_Q4_K || qt == QT_Q6_K ? QA256 : QA32; }
static inline int64_t qt_group_block_bytes(int64_t qt) {
    switch (qt) {
        case QT_Q4_0: case QT_Q4_1: return 320;
        case QT_Q8_0: return 576;
        case QT_Q4_K: return 2368;
        case QT_Q6_K: return 3392;
        default: return 0;
    }
}

/* Bytes of one row of quantized activations of family f over k inputs (64-byte multiple). */
static inline int64_t qa_row_bytes(int f, int64_t k) {
    const int64_t b = f == QA32 ? k + 8 * (k / 32) : k + 4 * (k / 256) + 4 * (k / 16);
    return (b + 63) & ~(int64_t)63;
}

static inline float qh2f(uint16_t h) { /* IEEE half -> float, exact (subnormals included) */
    const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { /* subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- activation quantization (scalar: the same on every path) --------------------------- */

static inline void qa_quantize_row(uint8_t* dst, const float* x, int64_t k, int f) {
    int8_t* q = (int8_t*)dst;
    const int64_t bl = f == QA32 ? 32 : 256;
    float* dx = (float*)(dst + k);
    for (int64_t b = 0; b < k / bl; b++) {
        const float* xb = x + b * bl;
        float amax = 0.0f;
        for (int64_t i = 0; i < bl; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int64_t i = 0; i < bl; i++) {
            float v = nearbyintf(xb[i] * id);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[b * bl + i] = (int8_t)v;
            s += (int32_t)v;
        }
        dx[b] = d;
        if (f == QA32) dx[k / 32 + b] = d * (float)s;
    }
    if (f == QA256) {
        int32_t* bs = (int32_t*)(dx + k / 256);
        for (int64_t j = 0; j < k / 16; j++) {
            int32_t s = 0;
            for (int64_t i = 0; i < 16; i++) s += q[j * 16 + i];
            bs[j] = s;
        }
    }
}

static inline void qa_quantize(uint8_t* dst, const float* x, int64_t ldx, int64_t m, int64_t k, int f) {
    const int64_t rb = qa_row_bytes(f, k);
    for (int64_t r = 0; r < m; r++) qa_quantize_row(dst + r * rb, x + r * ldx, k, f);
}

/* ---- portable path ----------------------------------------------------------------------- */

static inline int32_t qs_i32(const uint8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint16_t qs_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* input i (0..31) of row j in a Q4-layout chunk (4 lines of nibbles) */
static inline int q4_at(const uint8_t* lines, int j, int i) {
    const int s = (i & 15) >> 2, b = i & 3;
    const uint8_t v = lines[s * 64 + j * 4 + b];
    return i < 16 ? (v & 15) : (v >> 4);
}

/* y[r][0..16) = (the group's 16 outputs over blocks [b0, b1)) for m rows of activations xa
 * (row stride lda, the family of qt), + bias when given; y rows have stride ldy. */
static void qgroup_scalar(const uint8_t* wg, int64_t qt, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda,
                          int64_t k, float* y, int64_t ldy, const float* bias, int64_t m) {
    const int64_t gbb = qt_group_block_bytes(qt);
    for (int64_t r = 0; r < m; r++) {
        const int8_t* xq = (const int8_t*)(xa + r * lda);
        const float* dxs = (const float*)(xa + r * lda + k);
        for (int j = 0; j < QROWS; j++) {
            float acc = 0.0f;
            for (int64_t b = b0; b < b1; b++) {
                const uint8_t* wb = wg + b * gbb;
                const float d = qh2f(qs_u16(wb + 2 * j));
                if (qt == QT_Q4_0 || qt == QT_Q4_1) {
                    int32_t is = 0;
                    for (int i = 0; i < 32; i++) is += q4_at(wb + 64, j, i) * xq[b * 32 + i];
                    acc += (d * dxs[b]) * (float)is + qh2f(qs_u16(wb + 32 + 2 * j)) * dxs[k / 32 + b];
                } else if (qt == QT_Q8_0) {
                    int32_t is = 0;
                    for (int i = 0; i < 32; i++) is += (int8_t)wb[64 + (i >> 2) * 64 + j * 4 + (i & 3)] * xq[b * 32 + i];
                    acc += (d * dxs[b]) * (float)is;
                } else if (qt == QT_Q4_K) {
                    const int32_t* bs = (const int32_t*)(dxs + k / 256);
                    int32_t isc = 0, imn = 0;
                    for (int c = 0; c < 8; c++) {
                        int32_t is = 0;
                        for (int i = 0; i < 32; i++) is += q4_at(wb + 320 + c * 256, j, i) * xq[b * 256 + c * 32 + i];
                        isc += is * wb[64 + c * 16 + j];
                        imn += wb[192 + c * 16 + j] * (bs[b * 16 + 2 * c] + bs[b * 16 + 2 * c + 1]);
                    }
                    const float dmin = qh2f(qs_u16(wb + 32 + 2 * j));
                    acc += (d * dxs[b]) * (float)isc - (dmin * dxs[b]) * (float)imn;
                } else { /* QT_Q6_K */
                    const int32_t* bs = (const int32_t*)(dxs + k / 256);
                    int32_t isc = 0;
                    for (int c = 0; c < 8; c++) {
                        const uint8_t* ch = wb + 320 + c * 384;
                        for (int h = 0; h < 2; h++) {
                            int32_t is = 0;
                            for (int i = 16 * h; i < 16 * h + 16; i++) {
                                const int t = i >> 2, u = t >> 2, p = t & 3;
                                const int hi = (ch[256 + u * 64 + j * 4 + (i & 3)] >> (2 * p)) & 3;
                                is += (q4_at(ch, j, i) | (hi << 4)) * xq[b * 256 + c * 32 + i];
                            }
                            const int sub = 2 * c + h;
                            isc += (is - 32 * bs[b * 16 + sub]) * (int8_t)wb[64 + sub * 16 + j];
                        }
                    }
                    acc += (d * dxs[b]) * (float)isc;
                }
            }
            y[r * ldy + j] = acc + (bias ? bias[j] : 0.0f);
        }
    }
}

/* Row j of a group as floats over all of K (the dequantized weights; embedding lookups). */
static inline void qgroup_row_dequant(const uint8_t* wg, int64_t qt, int64_t k, int j, float* out) {
    const int64_t gbb = qt_group_block_bytes(qt), nb = k / qt_block(qt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* wb = wg + b * gbb;
        const float d = qh2f(qs_u16(wb + 2 * j));
        if (qt == QT_Q4_0 || qt == QT_Q4_1) {
            const float mm = qh2f(qs_u16(wb + 32 + 2 * j));
            for (int i = 0; i < 32; i++) out[b * 32 + i] = d * (float)q4_at(wb + 64, j, i) + mm;
        } else if (qt == QT_Q8_0) {
            for (int i = 0; i < 32; i++) out[b * 32 + i] = d * (float)(int8_t)wb[64 + (i >> 2) * 64 + j * 4 + (i & 3)];
        } else if (qt == QT_Q4_K) {
            const float dmin = qh2f(qs_u16(wb + 32 + 2 * j));
            for (int c = 0; c < 8; c++) {
                const float sc = d * (float)wb[64 + c * 16 + j], mn = dmin * (float)wb[192 + c * 16 + j];
                for (int i = 0; i < 32; i++) out[b * 256 + c * 32 + i] = sc * (float)q4_at(wb + 320 + c * 256, j, i) - mn;
            }
        } else {
            for (int c = 0; c < 8; c++) {
                const uint8_t* ch = wb + 320 + c * 384;
                for (int i = 0; i < 32; i++) {
                    const int t = i >> 2, u = t >> 2, p = t & 3;
                    const int hi = (ch[256 + u * 64 + j * 4 + (i & 3)] >> (2 * p)) & 3;
                    const float sc = d * (float)(int8_t)wb[64 + (2 * c + (i >> 4)) * 16 + j];
                    out[b * 256 + c * 32 + i] = sc * (float)((q4_at(ch, j, i) | (hi << 4)) - 32);
                }
            }
        }
    }
}

#if defined(__x86_64__) && (__GNUC__ >= 10 || defined(__clang__))
#define PKGD_HAVE_QSIMD 1
#include <immintrin.h>

/* ---- AVX-512 VNNI path ------------------------------------------------------------------ */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")

static inline __attribute__((always_inline)) __m512i q5_bcast(const int8_t* p) { return _mm512_set1_epi32(qs_i32((const uint8_t*)p)); }

/* The 8 vectors of 4 inputs x 16 rows of a Q4-layout chunk at `lines`. */
static inline __attribute__((always_inline)) void q5_nibbles(const uint8_t* lines, __m512i v[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int s = 0; s < 4; s++) {
        const __m512i l = _mm512_loadu_si512(lines + 64 * s);
        v[s] = _mm512_and_si512(l, m4);
        v[s + 4] = _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
    }
}

static inline __attribute__((always_inline)) void q5_tile(const uint8_t* wg, const int64_t qt, int64_t b0, int64_t b1,
                                                          const uint8_t* xa, int64_t lda, int64_t k, float* y,
                                                          int64_t ldy, const float* bias, const int R) {
    __m512 acc[QTILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t gbb = qt_group_block_bytes(qt);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t* wb = wg + b * gbb;
        for (int64_t c = 0; c < gbb; c += 64) _mm_prefetch((const char*)(wb + QPREFETCH + c), _MM_HINT_T1);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)wb));
        if (qt == QT_Q4_0 || qt == QT_Q4_1) {
            const __m512 mm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wb + 32)));
            __m512i v[8];
            q5_nibbles(wb + 64, v);
            for (int r = 0; r < R; r++) {
                const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 32;
                const float* dxs = (const float*)(xa + r * lda + k);
                __m512i is = _mm512_setzero_si512();
                for (int t = 0; t < 8; t++) is = _mm512_dpbusd_epi32(is, v[t], q5_bcast(xq + 4 * t));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(dxs[b])), acc[r]);
                acc[r] = _mm512_fmadd_ps(mm, _mm512_set1_ps(dxs[k / 32 + b]), acc[r]);
            }
        } else if (qt == QT_Q8_0) {
            const __m512i ws = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)(wb + 32))), 7);
            const __m512i flip = _mm512_set1_epi8((char)0x80);
            __m512i v[8];
            for (int t = 0; t < 8; t++) v[t] = _mm512_loadu_si512(wb + 64 + 64 * t);
            for (int r = 0; r < R; r++) {
                const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 32;
                const float* dxs = (const float*)(xa + r * lda + k);
                __m512i is = _mm512_setzero_si512();
                /* vpdpbusd takes one unsigned operand: x + 128, then 128 * sum(w) taken back */
                for (int t = 0; t < 8; t++) is = _mm512_dpbusd_epi32(is, _mm512_xor_si512(q5_bcast(xq + 4 * t), flip), v[t]);
                is = _mm512_sub_epi32(is, ws);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(dxs[b])), acc[r]);
            }
        } else if (qt == QT_Q4_K) {
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wb + 32)));
            __m512i isc[QTILE], imn[QTILE];
            for (int r = 0; r < R; r++) isc[r] = imn[r] = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wb + 64 + 16 * c)));
                const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wb + 192 + 16 * c)));
                __m512i v[8];
                q5_nibbles(wb + 320 + 256 * c, v);
                for (int r = 0; r < R; r++) {
                    const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 256 + c * 32;
                    const int32_t* bs = (const int32_t*)(xa + r * lda + k + 4 * (k / 256)) + b * 16 + 2 * c;
                    __m512i is = _mm512_setzero_si512();
                    for (int t = 0; t < 8; t++) is = _mm512_dpbusd_epi32(is, v[t], q5_bcast(xq + 4 * t));
                    isc[r] = _mm512_add_epi32(isc[r], _mm512_mullo_epi32(is, sc));
                    imn[r] = _mm512_add_epi32(imn[r], _mm512_mullo_epi32(mn, _mm512_set1_epi32(bs[0] + bs[1])));
                }
            }
            for (int r = 0; r < R; r++) {
                const float dx = ((const float*)(xa + r * lda + k))[b];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isc[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
                acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imn[r]), _mm512_mul_ps(dmin, _mm512_set1_ps(dx)), acc[r]);
            }
        } else { /* QT_Q6_K */
            __m512i isc[QTILE];
            for (int r = 0; r < R; r++) isc[r] = _mm512_setzero_si512();
            const __m512i m3 = _mm512_set1_epi8(3);
            for (int c = 0; c < 8; c++) {
                const uint8_t* ch = wb + 320 + 384 * c;
                const __m512i sca = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wb + 64 + 32 * c)));
                const __m512i scb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wb + 64 + 32 * c + 16)));
                __m512i v[8];
                q5_nibbles(ch, v);
                for (int u = 0; u < 2; u++) {
                    const __m512i h = _mm512_loadu_si512(ch + 256 + 64 * u);
                    for (int p = 0; p < 4; p++)
                        v[4 * u + p] = _mm512_or_si512(
                            v[4 * u + p], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * p), m3), 4));
                }
                for (int r = 0; r < R; r++) {
                    const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 256 + c * 32;
                    const int32_t* bs = (const int32_t*)(xa + r * lda + k + 4 * (k / 256)) + b * 16 + 2 * c;
                    __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
                    for (int t = 0; t < 4; t++) ia = _mm512_dpbusd_epi32(ia, v[t], q5_bcast(xq + 4 * t));
                    for (int t = 4; t < 8; t++) ib = _mm512_dpbusd_epi32(ib, v[t], q5_bcast(xq + 4 * t));
                    ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(32 * bs[0]));
                    ib = _mm512_sub_epi32(ib, _mm512_set1_epi32(32 * bs[1]));
                    isc[r] = _mm512_add_epi32(isc[r], _mm512_add_epi32(_mm512_mullo_epi32(ia, sca), _mm512_mullo_epi32(ib, scb)));
                }
            }
            for (int r = 0; r < R; r++) {
                const float dx = ((const float*)(xa + r * lda + k))[b];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isc[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 o = acc[r];
        if (bias) o = _mm512_add_ps(o, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(y + r * ldy, o);
    }
}

/* One instance per (type, tile height) so each inner loop is compiled for its constants. */
#define Q5_TILES(NAME, QT)                                                                                       \
    static void NAME(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k,    \
                     float* y, int64_t ldy, const float* bias, int64_t m) {                                     \
        const int64_t rb = lda;                                                                                  \
        int64_t r = 0;                                                                                           \
        for (; r + QTILE <= m; r += QTILE) q5_tile(wg, QT, b0, b1, xa + r * rb, lda, k, y + r * ldy, ldy, bias, QTILE); \
        switch (m - r) {                                                                                         \
            case 3: q5_tile(wg, QT, b0, b1, xa + r * rb, lda, k, y + r * ldy, ldy, bias, 3); break;             \
            case 2: q5_tile(wg, QT, b0, b1, xa + r * rb, lda, k, y + r * ldy, ldy, bias, 2); break;             \
            case 1: q5_tile(wg, QT, b0, b1, xa + r * rb, lda, k, y + r * ldy, ldy, bias, 1); break;             \
            default: break;                                                                                      \
        }                                                                                                        \
    }
Q5_TILES(qgroup_vnni_q4_0, QT_Q4_0)
Q5_TILES(qgroup_vnni_q4_1, QT_Q4_1)
Q5_TILES(qgroup_vnni_q8_0, QT_Q8_0)
Q5_TILES(qgroup_vnni_q4_k, QT_Q4_K)
Q5_TILES(qgroup_vnni_q6_k, QT_Q6_K)
#pragma GCC pop_options

/* ---- AVX2 path -------------------------------------------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* vpdpbusd on AVX2: 4 products of unsigned a and signed b bytes summed per 32-bit lane
 * (vpmaddubsw's pair sums of 4-bit or 6-bit weights times int8 stay below 2^15). */
static inline __attribute__((always_inline)) __m256i q2_dot(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
static inline __attribute__((always_inline)) __m256i q2_bcast(const int8_t* p) { return _mm256_set1_epi32(qs_i32((const uint8_t*)p)); }

/* The 8 vectors of 4 inputs x 8 rows (half hf of the group) of a Q4-layout chunk. */
static inline __attribute__((always_inline)) void q2_nibbles(const uint8_t* lines, int hf, __m256i v[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int s = 0; s < 4; s++) {
        const __m256i l = _mm256_loadu_si256((const __m256i*)(lines + 64 * s + 32 * hf));
        v[s] = _mm256_and_si256(l, m4);
        v[s + 4] = _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    }
}

/* Outputs [8 hf, 8 hf + 8) of a group for R rows over blocks [b0, b1). */
static inline __attribute__((always_inline)) void q2_tile(const uint8_t* wg, const int64_t qt, int64_t b0, int64_t b1,
                                                          const uint8_t* xa, int64_t lda, int64_t k, float* y,
                                                          int64_t ldy, const float* bias, const int R, const int hf) {
    __m256 acc[QTILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t gbb = qt_group_block_bytes(qt);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t* wb = wg + b * gbb;
        if (hf == 0)
            for (int64_t c = 0; c < gbb; c += 64) _mm_prefetch((const char*)(wb + QPREFETCH + c), _MM_HINT_T1);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wb + 16 * hf)));
        if (qt == QT_Q4_0 || qt == QT_Q4_1) {
            const __m256 mm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wb + 32 + 16 * hf)));
            __m256i v[8];
            q2_nibbles(wb + 64, hf, v);
            for (int r = 0; r < R; r++) {
                const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 32;
                const float* dxs = (const float*)(xa + r * lda + k);
                __m256i is = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) is = q2_dot(is, v[t], q2_bcast(xq + 4 * t));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, _mm256_set1_ps(dxs[b])), acc[r]);
                acc[r] = _mm256_fmadd_ps(mm, _mm256_set1_ps(dxs[k / 32 + b]), acc[r]);
            }
        } else if (qt == QT_Q8_0) {
            __m256i v[8], va[8];
            for (int t = 0; t < 8; t++) {
                v[t] = _mm256_loadu_si256((const __m256i*)(wb + 64 + 64 * t + 32 * hf));
                va[t] = _mm256_sign_epi8(v[t], v[t]); /* |w| (as unsigned: 128 for -128) */
            }
            for (int r = 0; r < R; r++) {
                const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 32;
                const float* dxs = (const float*)(xa + r * lda + k);
                __m256i is = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) is = q2_dot(is, va[t], _mm256_sign_epi8(q2_bcast(xq + 4 * t), v[t]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, _mm256_set1_ps(dxs[b])), acc[r]);
            }
        } else if (qt == QT_Q4_K) {
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wb + 32 + 16 * hf)));
            __m256i isc[QTILE], imn[QTILE];
            for (int r = 0; r < R; r++) isc[r] = imn[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(wb + 64 + 16 * c + 8 * hf)));
                const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(wb + 192 + 16 * c + 8 * hf)));
                __m256i v[8];
                q2_nibbles(wb + 320 + 256 * c, hf, v);
                for (int r = 0; r < R; r++) {
                    const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 256 + c * 32;
                    const int32_t* bs = (const int32_t*)(xa + r * lda + k + 4 * (k / 256)) + b * 16 + 2 * c;
                    __m256i is = _mm256_setzero_si256();
                    for (int t = 0; t < 8; t++) is = q2_dot(is, v[t], q2_bcast(xq + 4 * t));
                    isc[r] = _mm256_add_epi32(isc[r], _mm256_mullo_epi32(is, sc));
                    imn[r] = _mm256_add_epi32(imn[r], _mm256_mullo_epi32(mn, _mm256_set1_epi32(bs[0] + bs[1])));
                }
            }
            for (int r = 0; r < R; r++) {
                const float dx = ((const float*)(xa + r * lda + k))[b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isc[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imn[r]), _mm256_mul_ps(dmin, _mm256_set1_ps(dx)), acc[r]);
            }
        } else { /* QT_Q6_K */
            __m256i isc[QTILE];
            for (int r = 0; r < R; r++) isc[r] = _mm256_setzero_si256();
            const __m256i m3 = _mm256_set1_epi8(3);
            for (int c = 0; c < 8; c++) {
                const uint8_t* ch = wb + 320 + 384 * c;
                const __m256i sca = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(wb + 64 + 32 * c + 8 * hf)));
                const __m256i scb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(wb + 64 + 32 * c + 16 + 8 * hf)));
                __m256i v[8];
                q2_nibbles(ch, hf, v);
                for (int u = 0; u < 2; u++) {
                    const __m256i h = _mm256_loadu_si256((const __m256i*)(ch + 256 + 64 * u + 32 * hf));
                    for (int p = 0; p < 4; p++)
                        v[4 * u + p] = _mm256_or_si256(
                            v[4 * u + p], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * p), m3), 4));
                }
                for (int r = 0; r < R; r++) {
                    const int8_t* xq = (const int8_t*)(xa + r * lda) + b * 256 + c * 32;
                    const int32_t* bs = (const int32_t*)(xa + r * lda + k + 4 * (k / 256)) + b * 16 + 2 * c;
                    __m256i ia = _mm256_setzero_si256(), ib = _mm256_setzero_si256();
                    for (int t = 0; t < 4; t++) ia = q2_dot(ia, v[t], q2_bcast(xq + 4 * t));
                    for (int t = 4; t < 8; t++) ib = q2_dot(ib, v[t], q2_bcast(xq + 4 * t));
                    ia = _mm256_sub_epi32(ia, _mm256_set1_epi32(32 * bs[0]));
                    ib = _mm256_sub_epi32(ib, _mm256_set1_epi32(32 * bs[1]));
                    isc[r] = _mm256_add_epi32(isc[r], _mm256_add_epi32(_mm256_mullo_epi32(ia, sca), _mm256_mullo_epi32(ib, scb)));
                }
            }
            for (int r = 0; r < R; r++) {
                const float dx = ((const float*)(xa + r * lda + k))[b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isc[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 o = acc[r];
        if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias + 8 * hf));
        _mm256_storeu_ps(y + r * ldy + 8 * hf, o);
    }
}

#define Q2_TILES(NAME, QT)                                                                                        \
    static void NAME(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k,     \
                     float* y, int64_t ldy, const float* bias, int64_t m) {                                      \
        for (int64_t r = 0; r < m; r += 2) {                                                                      \
            for (int hf = 0; hf < 2; hf++) {                                                                      \
                if (m - r >= 2) q2_tile(wg, QT, b0, b1, xa + r * lda, lda, k, y + r * ldy, ldy, bias, 2, hf);     \
                else q2_tile(wg, QT, b0, b1, xa + r * lda, lda, k, y + r * ldy, ldy, bias, 1, hf);                \
            }                                                                                                     \
        }                                                                                                         \
    }
Q2_TILES(qgroup_avx2_q4_0, QT_Q4_0)
Q2_TILES(qgroup_avx2_q4_1, QT_Q4_1)
Q2_TILES(qgroup_avx2_q8_0, QT_Q8_0)
Q2_TILES(qgroup_avx2_q4_k, QT_Q4_K)
Q2_TILES(qgroup_avx2_q6_k, QT_Q6_K)
#pragma GCC pop_options
#endif

/* The best path this CPU runs. */
static inline int quant_best_impl(void) {
#ifdef PKGD_HAVE_QSIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
        return QIMPL_VNNI512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return QIMPL_AVX2;
#endif
    return QIMPL_SCALAR;
}

/* `impl` where the CPU runs it, else the best path below it. */
static inline int quant_usable_impl(int impl) {
    const int best = quant_best_impl();
    return impl < 0 || impl > best ? best : impl;
}

typedef void (*qgroup_fn)(const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t,
                          const float*, int64_t);

static void qgroup_scalar_q4_0(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k, float* y, int64_t ldy, const float* bias, int64_t m) { qgroup_scalar(wg, QT_Q4_0, b0, b1, xa, lda, k, y, ldy, bias, m); }
static void qgroup_scalar_q4_1(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k, float* y, int64_t ldy, const float* bias, int64_t m) { qgroup_scalar(wg, QT_Q4_1, b0, b1, xa, lda, k, y, ldy, bias, m); }
static void qgroup_scalar_q8_0(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k, float* y, int64_t ldy, const float* bias, int64_t m) { qgroup_scalar(wg, QT_Q8_0, b0, b1, xa, lda, k, y, ldy, bias, m); }
static void qgroup_scalar_q4_k(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k, float* y, int64_t ldy, const float* bias, int64_t m) { qgroup_scalar(wg, QT_Q4_K, b0, b1, xa, lda, k, y, ldy, bias, m); }
static void qgroup_scalar_q6_k(const uint8_t* wg, int64_t b0, int64_t b1, const uint8_t* xa, int64_t lda, int64_t k, float* y, int64_t ldy, const float* bias, int64_t m) { qgroup_scalar(wg, QT_Q6_K, b0, b1, xa, lda, k, y, ldy, bias, m); }

/* The group kernel of type qt on path impl (already made usable), NULL for an unknown type. */
static inline qgroup_fn quant_group_fn(int64_t qt, int impl) {
#ifdef PKGD_HAVE_QSIMD
    if (impl == QIMPL_VNNI512) {
        switch (qt) {
            case QT_Q4_0: return qgroup_vnni_q4_0;
            case QT_Q4_1: return qgroup_vnni_q4_1;
            case QT_Q8_0: return qgroup_vnni_q8_0;
            case QT_Q4_K: return qgroup_vnni_q4_k;
            case QT_Q6_K: return qgroup_vnni_q6_k;
            default: return NULL;
        }
    }
    if (impl == QIMPL_AVX2) {
        switch (qt) {
            case QT_Q4_0: return qgroup_avx2_q4_0;
            case QT_Q4_1: return qgroup_avx2_q4_1;
            case QT_Q8_0: return qgroup_avx2_q8_0;
            case QT_Q4_K: return qgroup_avx2_q4_k;
            case QT_Q6_K: return qgroup_avx2_q6_k;
            default: return NULL;
        }
    }
#else
    (void)impl;
#endif
    switch (qt) {
        case QT_Q4_0: return qgroup_scalar_q4_0;
        case QT_Q4_1: return qgroup_scalar_q4_1;
        case QT_Q8_0: return qgroup_scalar_q8_0;
        case QT_Q4_K: return qgroup_scalar_q4_k;
        case QT_Q6_K: return qgroup_scalar_q6_k;
        default: return NULL;
    }
}

/* Whether w is a weight these kernels read: known types, rows multiples of 16, K a multiple of
 * each type's block, n the sum of the rows. */
static inline int quant_weight_ok(const pkgd_qweight* w) {
    if (w->nseg < 1 || w->nseg > PKGD_QMAX_SEG || w->k <= 0) return 0;
    int64_t n = 0;
    for (int64_t s = 0; s < w->nseg; s++) {
        const pkgd_qsegment* sg = w->seg + s;
        if (!qt_group_block_bytes(sg->qtype) || sg->rows <= 0 || sg->rows % QROWS || w->k % qt_block(sg->qtype) || !sg->data)
            return 0;
        n += sg->rows;
    }
    return n == w->n;
}

/* Which activation families w needs: bit QA32 and/or bit QA256. */
static inline int quant_families(const pkgd_qweight* w) {
    int f = 0;
    for (int64_t s = 0; s < w->nseg; s++) f |= 1 << qt_family(w->seg[s].qtype);
    return f;
}

/* Bytes of activation buffer for m rows of w's families (A32 rows, then A256 rows). */
static inline int64_t quant_act_bytes(int64_t k, int64_t m, int fams) {
    return ((fams & 1) ? m * qa_row_bytes(QA32, k) : 0) + ((fams & 2) ? m * qa_row_bytes(QA256, k) : 0);
}

/* Quantize m rows of x for w into buf (quant_act_bytes); returns the A32 and A256 bases. */
static inline void quant_prepare(uint8_t* buf, const float* x, int64_t ldx, int64_t m, int64_t k, int fams,
                                 const uint8_t** a32, const uint8_t** a256) {
    *a32 = *a256 = NULL;
    if (fams & 1) {
        qa_quantize(buf, x, ldx, m, k, QA32);
        *a32 = buf;
        buf += m * qa_row_bytes(QA32, k);
    }
    if (fams & 2) {
        qa_quantize(buf, x, ldx, m, k, QA256);
        *a256 = buf;
    }
}

/* Global group index g of w -> its segment, the group's data, its block count. */
static inline const pkgd_qsegment* quant_locate(const pkgd_qweight* w, int64_t g, const uint8_t** wg, int64_t* nb) {
    for (int64_t s = 0; s < w->nseg; s++) {
        const pkgd_qsegment* sg = w->seg + s;
        const int64_t groups = sg->rows / QROWS;
        if (g < groups) {
            *nb = w->k / qt_block(sg->qtype);
            *wg = sg->data + g * *nb * qt_group_block_bytes(sg->qtype);
            return sg;
        }
        g -= groups;
    }
    return NULL;
}

/* Inside a parallel region, every thread calling, activations already quantized (a32/a256 as
 * quant_prepare left them): y[m, n] = x W^T (+ bias), with gemv_team's protocol (kernels.h): the
 * (group, block) units are cut into one contiguous range per thread; a group a thread enters
 * mid-way is summed into part[t] (m rows of stride 64; part_blk[t] = the group, else -1), added
 * by fixed_range with block width 16 after the caller's barrier. No barrier inside. */
static inline void qgemv_team(const pkgd_qweight* w, const uint8_t* a32, const uint8_t* a256, int impl,
                              const float* bias, float* y, int64_t m, float* part, int64_t* part_blk) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t k = w->k, l32 = qa_row_bytes(QA32, k), l256 = qa_row_bytes(QA256, k);
    int64_t units = 0;
    for (int64_t s = 0; s < w->nseg; s++) units += w->seg[s].rows / QROWS * (k / qt_block(w->seg[s].qtype));
    const int64_t u1 = units * (t + 1) / nt;
    int64_t u = units * t / nt;
    part_blk[t] = -1;
    int64_t g = 0, ubase = 0; /* group of unit u, first unit of that group */
    const uint8_t* wg;
    int64_t nb;
    const pkgd_qsegment* sg = quant_locate(w, 0, &wg, &nb);
    while (sg && ubase + nb <= u) { /* skip to u's group */
        ubase += nb;
        sg = quant_locate(w, ++g, &wg, &nb);
    }
    while (sg && u < u1) {
        const int64_t k0 = u - ubase, k1 = ubase + nb <= u1 ? nb : u1 - ubase;
        const int fam = qt_family(sg->qtype);
        float* out = k0 == 0 ? y + g * QROWS : part + t * m * 64;
        const int64_t ldo = k0 == 0 ? w->n : 64;
        quant_group_fn(sg->qtype, impl)(wg, k0, k1, fam == QA32 ? a32 : a256, fam == QA32 ? l32 : l256, k, out, ldo,
                                        k0 == 0 && bias ? bias + g * QROWS : NULL, m);
        if (k0 != 0) part_blk[t] = g;
        u = ubase + k1;
        if (k1 == nb) {
            ubase += nb;
            sg = quant_locate(w, ++g, &wg, &nb);
        }
    }
}

/* Layout of the two structs, for pkgd_struct_layout (sizeof, offsetof each field). */
static inline int64_t quant_struct_layout(const char* name, int64_t* out, int64_t cap) {
    int64_t v[8], n = 0;
    if (!strcmp(name, "pkgd_qsegment")) {
        v[n++] = sizeof(pkgd_qsegment);
        v[n++] = offsetof(pkgd_qsegment, qtype);
        v[n++] = offsetof(pkgd_qsegment, rows);
        v[n++] = offsetof(pkgd_qsegment, data);
    } else if (!strcmp(name, "pkgd_qweight")) {
        v[n++] = sizeof(pkgd_qweight);
        v[n++] = offsetof(pkgd_qweight, n);
        v[n++] = offsetof(pkgd_qweight, k);
        v[n++] = offsetof(pkgd_qweight, nseg);
        v[n++] = offsetof(pkgd_qweight, seg);
    } else {
        return -1;
    }
    if (n > cap) return -1;
    memcpy(out, v, sizeof(int64_t) * (size_t)n);
    return n;
}

#endif /* PKGD_QUANT_H */
