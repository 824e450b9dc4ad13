/* The AVX-512 pieces both of prefixkv's compute extensions use (models/_cpu_ops.c and, through
 * include_dirs, runner/_cpu_attn_tile.h): the target attribute and one exp2 polynomial.
 * Include it after <immintrin.h>, on x86-64 with GCC or Clang only. */
#ifndef PREFIXKV_AVX512_H
#define PREFIXKV_AVX512_H

#define AVX512 __attribute__((target("avx512f,avx512dq,fma")))

/* 2**x for x >= -126 (smaller x clamps there; -inf included): x = n + f, |f| <= 1/2,
 * 2**f by its degree-7 Taylor polynomial (relative error below 1e-8), scaled by 2**n. */
AVX512 static inline __m512 exp2_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733804059840e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
