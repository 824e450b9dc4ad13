/* prefixkv.runner._cpu_attn, part 1: the vector arithmetic on one tile of 64 keys (AVX-512),
 * knowing nothing of sequences or tasks (those are _cpu_attn.c's, which includes this file
 * once, inside its HAVE_KERNEL section).
 *
 * A tile's keys are transposed to kt [dim][KT] (transpose16); scores_softmax computes the
 * scores of MR query rows against it in 4 x 4 vector accumulators and updates each row's
 * online softmax (base 2); accumulate_pv adds P x V into the rows' outputs. load1 / store1 /
 * load16 read and write float32 or bfloat16 (widened on load, rounded to nearest even). exp2_ps
 * and the AVX512 attribute come from models/_avx512.h.
 */

static const float zero_row[MAX_DIM] __attribute__((aligned(64)));

typedef struct {
    float *qs, *os, *m, *l, *lsum, *p; /* l: 16 partial sums a row; lsum: their totals */
    float *kt_own, *v_own; /* a task's own K tile (and bf16 V rows) when not shared */
    const float *kt;
    const float *vrow[KT];
} scratch_t;

/* Scores of MR rows (qrow[r], D floats each, pre-scaled) against the tile kt [D][KT]; then the
 * online-softmax update of m / l / o for each row with ``valid[r]`` leading keys (0..KT); a
 * row's l is 16 partial sums (lr[r], 64-byte aligned), added up once after its last tile. */
AVX512 static void scores_softmax(long dim, scratch_t *S, float *const qrow[MR],
                                  float *const orow[MR], float *mr[MR], float *lr[MR],
                                  const int valid[MR])
{
    __m512 acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (long d = 0; d < dim; d++) {
        const float *kd = S->kt + d * KT;
        __m512 k0 = _mm512_load_ps(kd), k1 = _mm512_load_ps(kd + 16);
        __m512 k2 = _mm512_load_ps(kd + 32), k3 = _mm512_load_ps(kd + 48);
        for (int r = 0; r < MR; r++) {
            __m512 b = _mm512_set1_ps(qrow[r][d]);
            acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
        }
    }
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < MR; r++) {
        __mmask16 keep[4];
        __m512 mx = ninf;
        for (int c = 0; c < 4; c++) {
            int n = valid[r] - 16 * c;
            keep[c] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
            acc[r][c] = _mm512_mask_mov_ps(ninf, keep[c], acc[r][c]);
            mx = _mm512_max_ps(mx, acc[r][c]);
        }
        float m_old = *mr[r], m_tile = _mm512_reduce_max_ps(mx);
        float m_new = m_tile > m_old ? m_tile : m_old;
        __m512 mv = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
        float *pr = S->p + r * KT;
        for (int c = 0; c < 4; c++) {
            __m512 e = _mm512_maskz_mov_ps(keep[c], exp2_ps(_mm512_sub_ps(acc[r][c], mv)));
            sum = _mm512_add_ps(sum, e);
            _mm512_store_ps(pr + 16 * c, e);
        }
        if (m_new > m_old) { /* rescale what was summed under the old maximum */
            float alpha = exp2f(m_old - m_new);
            __m512 av = _mm512_set1_ps(alpha);
            _mm512_store_ps(lr[r], _mm512_mul_ps(av, _mm512_load_ps(lr[r])));
            for (long d = 0; d < dim; d += 16)
                _mm512_store_ps(orow[r] + d, _mm512_mul_ps(av, _mm512_load_ps(orow[r] + d)));
            *mr[r] = m_new;
        }
        _mm512_store_ps(lr[r], _mm512_add_ps(_mm512_load_ps(lr[r]), sum)); /* 16 partial sums */
    }
}

/* o[r] += p[r] x V for the tile's ``nk`` keys, 64 columns at a time. */
AVX512 static void accumulate_pv(long dim, scratch_t *S, float *const orow[MR], long nk)
{
    for (long d0 = 0; d0 < dim; d0 += 64) {
        int nv = (int)((dim - d0) / 16 < 4 ? (dim - d0) / 16 : 4);
        __m512 acc[MR][4];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < 4; c++)
                acc[r][c] = c < nv ? _mm512_load_ps(orow[r] + d0 + 16 * c) : _mm512_setzero_ps();
        if (nv == 4) {
            for (long j = 0; j < nk; j++) {
                const float *vj = S->vrow[j] + d0;
                __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
                __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
                for (int r = 0; r < MR; r++) {
                    __m512 b = _mm512_set1_ps(S->p[r * KT + j]);
                    acc[r][0] = _mm512_fmadd_ps(b, v0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(b, v1, acc[r][1]);
                    acc[r][2] = _mm512_fmadd_ps(b, v2, acc[r][2]);
                    acc[r][3] = _mm512_fmadd_ps(b, v3, acc[r][3]);
                }
            }
        } else {
            for (long j = 0; j < nk; j++) {
                const float *vj = S->vrow[j] + d0;
                for (int r = 0; r < MR; r++) {
                    __m512 b = _mm512_set1_ps(S->p[r * KT + j]);
                    for (int c = 0; c < nv; c++)
                        acc[r][c] = _mm512_fmadd_ps(b, _mm512_loadu_ps(vj + 16 * c), acc[r][c]);
                }
            }
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < nv; c++)
                _mm512_store_ps(orow[r] + d0 + 16 * c, acc[r][c]);
    }
}

static inline float load1(const void *p, long i, int bf16)
{
    if (!bf16)
        return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to the nearest bfloat16, ties to even (NaN stays NaN), as torch does. */
static inline void store1(void *p, long i, float f, int bf16)
{
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        bits |= 0x00400000u;
    else
        bits += 0x7fffu + ((bits >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

AVX512 static inline __m512 load16(const void *p, long i, int bf16)
{
    if (!bf16)
        return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 keys (rows[j], 16 floats from column d0 each) into kt[(d0 + d) * KT + j]: a 16 x 16
 * transpose in registers (unpack ps, unpack pd, two rounds of 128-bit lane shuffles). */
AVX512 static void transpose16(const void *const rows[16], long d0, float *kt, int bf16)
{
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = load16(rows[i], d0, bf16);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], lane L: rows 4i..4i+3 at column 4L + c */
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        __m512d c = _mm512_castps_pd(t[4 * i + 1]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c] */
        __m512 v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        __m512 v2 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        __m512 v4 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
        _mm512_store_ps(kt + (d0 + c) * KT, _mm512_shuffle_f32x4(v1, v3, 0x88));
        _mm512_store_ps(kt + (d0 + 4 + c) * KT, _mm512_shuffle_f32x4(v2, v4, 0x88));
        _mm512_store_ps(kt + (d0 + 8 + c) * KT, _mm512_shuffle_f32x4(v1, v3, 0xdd));
        _mm512_store_ps(kt + (d0 + 12 + c) * KT, _mm512_shuffle_f32x4(v2, v4, 0xdd));
    }
}

