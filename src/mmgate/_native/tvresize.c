/*
 * mmgate._native.tvresize: torch's CPU uint8 antialiased resize, the two separable passes.
 *
 * Stage: resize (torchvision image backend), called by mmgate.media.tv_resize, which
 * computes the per-axis int16 weights (a port of ATen HelperInterpBase::
 * _compute_index_ranges_int16_weights) and passes them in.  This file applies them
 * with the integer arithmetic of torch 2.14.1's AVX kernel
 * (aten/src/ATen/native/cpu/UpSampleKernelAVXAntialias.h, ImagingResampleHorizontal /
 * ImagingResampleVertical, themselves after Pillow-SIMD):
 *
 *   out = clamp((2**(p-1) + sum_t in[start + t] * w[t]) >> p, 0, 255)
 *
 * in int32 (the AVX kernel's madd_epi16 / add_epi32, then srai_epi32, packs_epi32,
 * packus_epi16: an arithmetic shift and a clamp to 0..255), horizontal pass first
 * (skipped when the width is unchanged) into a uint8 intermediate, then the vertical
 * pass (skipped when the height is unchanged).  Every sum is an exact integer, so the
 * order of the additions does not matter: the AVX2 kernels below and the portable C
 * kernels give the same bytes.
 *
 * Layout: channels-last uint8 [H, W, C], C-contiguous.  The intermediate rows are
 * produced on demand into a ring of (vertical taps + 4) rows, so it stays in cache.
 * The caller's GIL is released for the whole resize.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define TV_HAVE_AVX2 1
#include <immintrin.h>
#define TV_AVX2 __attribute__((target("avx2")))
#endif

/* Readable bytes the AVX2 horizontal kernel may load past the last byte it uses. */
#define TV_OVERREAD 16
/* Rows the horizontal pass produces per call. */
#define TV_HROWS 4

typedef struct {
    const int32_t *start;   /* [out] first input index of each output */
    const int32_t *size;    /* [out] taps of each output */
    const int16_t *weights; /* [out, ksize] int16 weights, zero past size */
    int ksize;
    int precision;          /* result = (sum + 2**(precision - 1)) >> precision */
} Axis;

static inline int32_t tv_half(int precision) { return precision > 0 ? (int32_t)1 << (precision - 1) : 0; }

static inline uint8_t tv_clamp(int32_t acc, int precision) {
    int32_t v = acc >> precision; /* arithmetic shift, as srai_epi32 */
    return (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

/* ------------------------------------------------------------------ portable C kernels */

/* One row: out[x, c] for x < out_w from in[start[x] .. start[x] + size[x], c]. */
static void h_row_c(const uint8_t *in, uint8_t *out, int out_w, int C, const Axis *ax) {
    const int32_t half = tv_half(ax->precision);
    for (int x = 0; x < out_w; x++) {
        const uint8_t *p = in + (Py_ssize_t)ax->start[x] * C;
        const int16_t *k = ax->weights + (Py_ssize_t)x * ax->ksize;
        const int n = ax->size[x];
        for (int c = 0; c < C; c++) {
            int32_t acc = half;
            for (int t = 0; t < n; t++) acc += (int32_t)p[t * C + c] * k[t];
            out[(Py_ssize_t)x * C + c] = tv_clamp(acc, ax->precision);
        }
    }
}

/* h_row_c for 3 or 4 channels: four int32 lanes per pixel (a fixed-size body); with C = 3 the
 * fourth lane reads the next pixel's first byte and is dropped, so a row needs one readable byte
 * past its end (as the AVX2 kernel, see h_rows).  (GCC vector extensions were slower here on
 * SSE2, which has no 32-bit lane multiply.) */
static void h_row_c4(const uint8_t *in, uint8_t *out, int out_w, int C, const Axis *ax) {
    const int32_t half = tv_half(ax->precision);
    const Py_ssize_t row_bytes = (Py_ssize_t)out_w * C;
    for (int x = 0; x < out_w; x++) {
        const uint8_t *p = in + (Py_ssize_t)ax->start[x] * C;
        const int16_t *k = ax->weights + (Py_ssize_t)x * ax->ksize;
        const int n = ax->size[x];
        int32_t acc[4] = {half, half, half, half};
        for (int t = 0; t < n; t++, p += C) {
            const int32_t w = k[t];
            for (int c = 0; c < 4; c++) acc[c] += (int32_t)p[c] * w;
        }
        uint8_t px[4];
        for (int c = 0; c < 4; c++) px[c] = tv_clamp(acc[c], ax->precision);
        const Py_ssize_t dst = (Py_ssize_t)x * C;
        memcpy(out + dst, px, dst + 4 <= row_bytes ? 4 : (size_t)C);
    }
}

/* One output row of the vertical pass: out[i] from rows[t][i], t < n, i < len. */
static void v_row_c(const uint8_t *const *rows, int n, const int16_t *k, int precision, uint8_t *out,
                    Py_ssize_t from, Py_ssize_t len) {
    enum { BLOCK = 256 };
    int32_t acc[BLOCK];
    const int32_t half = tv_half(precision);
    for (Py_ssize_t i0 = from; i0 < len; i0 += BLOCK) {
        const int m = (int)(len - i0 < BLOCK ? len - i0 : BLOCK);
        for (int j = 0; j < m; j++) acc[j] = half;
        for (int t = 0; t < n; t++) {
            const uint8_t *r = rows[t] + i0;
            const int32_t w = k[t];
            for (int j = 0; j < m; j++) acc[j] += (int32_t)r[j] * w;
        }
        for (int j = 0; j < m; j++) out[i0 + j] = tv_clamp(acc[j], precision);
    }
}

/* ------------------------------------------------------------------ AVX2 kernels */

#ifdef TV_HAVE_AVX2

static inline int32_t tv_pair(const int16_t *k) { /* (k[0], k[1]) as one int32: madd_epi16 operand */
    int32_t v;
    memcpy(&v, k, 4);
    return v;
}

static inline int32_t tv_load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Shuffle mask: int16 lanes (tap a, tap b) per channel c < 4 from 4*C-byte pixels at byte 0;
 * b < 0: a single tap (its partner lane is zero). */
TV_AVX2 static __m256i h_mask(int C, int a, int b) {
    int8_t m[16];
    for (int c = 0; c < 4; c++) {
        m[4 * c + 0] = (int8_t)(c < C ? a * C + c : -1);
        m[4 * c + 1] = -1;
        m[4 * c + 2] = (int8_t)(c < C && b >= 0 ? b * C + c : -1);
        m[4 * c + 3] = -1;
    }
    __m128i lane = _mm_loadu_si128((const __m128i *)m);
    return _mm256_broadcastsi128_si256(lane);
}

static inline void tv_store_pixel(uint8_t *dst, uint32_t v, int C, int fits4) {
    if (fits4)
        memcpy(dst, &v, 4); /* the bytes past C are rewritten by the next pixel */
    else
        memcpy(dst, &v, (size_t)C);
}

/* TV_HROWS rows (1 <= C <= 4): two rows per 256-bit register, pairs of taps per madd_epi16.
 * Loads may read up to TV_OVERREAD bytes past the last pixel of a row. */
TV_AVX2 static void h_rows_avx2(const uint8_t *const *in, uint8_t *const *out, int out_w, int C,
                                const Axis *ax) {
    const __m256i m01 = h_mask(C, 0, 1), m23 = h_mask(C, 2, 3), m0 = h_mask(C, 0, -1);
    const __m256i init = _mm256_set1_epi32(tv_half(ax->precision));
    const __m128i shift = _mm_cvtsi32_si128(ax->precision);
    const __m256i zero = _mm256_setzero_si256();
    const Py_ssize_t row_bytes = (Py_ssize_t)out_w * C;
    for (int x = 0; x < out_w; x++) {
        const Py_ssize_t off = (Py_ssize_t)ax->start[x] * C;
        const uint8_t *p0 = in[0] + off, *p1 = in[1] + off, *p2 = in[2] + off, *p3 = in[3] + off;
        const int16_t *k = ax->weights + (Py_ssize_t)x * ax->ksize;
        const int n = ax->size[x];
        __m256i s01 = init, s23 = init;
        int t = 0;
        for (; t + 4 <= n; t += 4) {
            const Py_ssize_t o = (Py_ssize_t)t * C;
            const __m256i w01 = _mm256_set1_epi32(tv_pair(k + t)), w23 = _mm256_set1_epi32(tv_pair(k + t + 2));
            __m256i src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + o))),
                                                  _mm_loadu_si128((const __m128i *)(p1 + o)), 1);
            s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m01), w01));
            s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m23), w23));
            src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p2 + o))),
                                          _mm_loadu_si128((const __m128i *)(p3 + o)), 1);
            s23 = _mm256_add_epi32(s23, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m01), w01));
            s23 = _mm256_add_epi32(s23, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m23), w23));
        }
        for (; t + 2 <= n; t += 2) {
            const Py_ssize_t o = (Py_ssize_t)t * C;
            const __m256i w01 = _mm256_set1_epi32(tv_pair(k + t));
            __m256i src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(p0 + o))),
                                                  _mm_loadl_epi64((const __m128i *)(p1 + o)), 1);
            s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m01), w01));
            src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(p2 + o))),
                                          _mm_loadl_epi64((const __m128i *)(p3 + o)), 1);
            s23 = _mm256_add_epi32(s23, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m01), w01));
        }
        for (; t < n; t++) {
            const Py_ssize_t o = (Py_ssize_t)t * C;
            const __m256i w0 = _mm256_set1_epi32((int32_t)(uint16_t)k[t]);
            __m256i src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128(tv_load32(p0 + o))),
                                                  _mm_cvtsi32_si128(tv_load32(p1 + o)), 1);
            s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m0), w0));
            src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128(tv_load32(p2 + o))),
                                          _mm_cvtsi32_si128(tv_load32(p3 + o)), 1);
            s23 = _mm256_add_epi32(s23, _mm256_madd_epi16(_mm256_shuffle_epi8(src, m0), w0));
        }
        s01 = _mm256_packus_epi16(_mm256_packs_epi32(_mm256_sra_epi32(s01, shift), zero), zero);
        s23 = _mm256_packus_epi16(_mm256_packs_epi32(_mm256_sra_epi32(s23, shift), zero), zero);
        const Py_ssize_t dst = (Py_ssize_t)x * C;
        const int fits4 = dst + 4 <= row_bytes;
        tv_store_pixel(out[0] + dst, (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(s01)), C, fits4);
        tv_store_pixel(out[1] + dst, (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(s01, 1)), C, fits4);
        tv_store_pixel(out[2] + dst, (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(s23)), C, fits4);
        tv_store_pixel(out[3] + dst, (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(s23, 1)), C, fits4);
    }
}

/* One output row of the vertical pass, 32 bytes per step: pairs of input rows interleaved into
 * int16 (a, b) lanes for madd_epi16; the in-lane packs undo the in-lane unpacks.  Returns the
 * number of bytes done (a multiple of 32); the caller finishes the tail. */
TV_AVX2 static Py_ssize_t v_row_avx2(const uint8_t *const *rows, int n, const int16_t *k, int precision,
                                     uint8_t *out, Py_ssize_t len) {
    const __m256i init = _mm256_set1_epi32(tv_half(precision));
    const __m128i shift = _mm_cvtsi32_si128(precision);
    const __m256i zero = _mm256_setzero_si256();
    Py_ssize_t i = 0;
    for (; i + 32 <= len; i += 32) {
        __m256i s0 = init, s1 = init, s2 = init, s3 = init;
        for (int t = 0; t < n; t += 2) {
            const int pair = t + 1 < n;
            const __m256i w = _mm256_set1_epi32(pair ? tv_pair(k + t) : (int32_t)(uint16_t)k[t]);
            const __m256i a = _mm256_loadu_si256((const __m256i *)(rows[t] + i));
            const __m256i b = pair ? _mm256_loadu_si256((const __m256i *)(rows[t + 1] + i)) : zero;
            const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), w));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), w));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), w));
            s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), w));
        }
        const __m256i p01 = _mm256_packs_epi32(_mm256_sra_epi32(s0, shift), _mm256_sra_epi32(s1, shift));
        const __m256i p23 = _mm256_packs_epi32(_mm256_sra_epi32(s2, shift), _mm256_sra_epi32(s3, shift));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_packus_epi16(p01, p23));
    }
    return i;
}

static int tv_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

#else
static int tv_cpu_has_avx2(void) { return 0; }
#endif

static int tv_avx2 = 0; /* set at import */

/* ------------------------------------------------------------------ the resize */

typedef struct {
    const uint8_t *src;      /* [H, W, C] */
    Py_ssize_t src_len;      /* bytes readable at src */
    int height, width, channels, out_h, out_w;
    const Axis *hax;         /* NULL: width unchanged */
    const Axis *vax;         /* NULL: height unchanged */
    uint8_t *dst;            /* [out_h, out_w, C] */
    int simd;
} Job;

/* Horizontal pass of input rows [r0, r0 + count) (count <= TV_HROWS) into out[0..count). */
static void h_rows(const Job *job, int r0, int count, uint8_t *const *out, uint8_t *pad_in, uint8_t *spare) {
    const Py_ssize_t in_bytes = (Py_ssize_t)job->width * job->channels;
    const int C = job->channels;
    if (C > 4) {
        for (int j = 0; j < count; j++)
            h_row_c(job->src + (Py_ssize_t)(r0 + j) * in_bytes, out[j], job->out_w, C, job->hax);
        return;
    }
    const uint8_t *in[TV_HROWS];
    uint8_t *dst[TV_HROWS];
    for (int j = 0; j < TV_HROWS; j++) {
        const int r = j < count ? r0 + j : r0; /* missing rows: recompute row r0 into a spare row */
        const uint8_t *row = job->src + (Py_ssize_t)r * in_bytes;
        if ((Py_ssize_t)(r + 1) * in_bytes + TV_OVERREAD > job->src_len) {
            uint8_t *copy = pad_in + (Py_ssize_t)j * (in_bytes + TV_OVERREAD);
            memcpy(copy, row, (size_t)in_bytes); /* the padding after it is zeroed once */
            row = copy;
        }
        in[j] = row;
        dst[j] = j < count ? out[j] : spare;
    }
#ifdef TV_HAVE_AVX2
    if (job->simd) {
        h_rows_avx2(in, dst, job->out_w, C, job->hax);
        return;
    }
#endif
    for (int j = 0; j < count; j++) h_row_c4(in[j], dst[j], job->out_w, C, job->hax);
}

static void v_row(const Job *job, const uint8_t *const *rows, int y, uint8_t *out, Py_ssize_t len) {
    const Axis *ax = job->vax;
    const int16_t *k = ax->weights + (Py_ssize_t)y * ax->ksize;
    const int n = ax->size[y];
    Py_ssize_t done = 0;
#ifdef TV_HAVE_AVX2
    if (job->simd) done = v_row_avx2(rows, n, k, ax->precision, out, len);
#endif
    v_row_c(rows, n, k, ax->precision, out, done, len);
}

/* Returns 0, or -1 when out of memory. */
static int run_job(const Job *job) {
    const int C = job->channels;
    const Py_ssize_t in_bytes = (Py_ssize_t)job->width * C;
    const Py_ssize_t mid_bytes = (Py_ssize_t)job->out_w * C; /* a row after the horizontal pass */
    const Py_ssize_t slot = mid_bytes + TV_OVERREAD;
    uint8_t *pad_in = NULL, *spare = NULL, *ring = NULL;
    const uint8_t **rows = NULL;
    int status = -1;

    if (job->hax) {
        pad_in = calloc((size_t)TV_HROWS, (size_t)(in_bytes + TV_OVERREAD));
        spare = malloc((size_t)slot);
        if (!pad_in || !spare) goto done;
    }
    if (job->hax && !job->vax) { /* horizontal only: straight into the output */
        for (int r = 0; r < job->height; r += TV_HROWS) {
            const int count = job->height - r < TV_HROWS ? job->height - r : TV_HROWS;
            uint8_t *out[TV_HROWS];
            for (int j = 0; j < count; j++) out[j] = job->dst + (Py_ssize_t)(r + j) * mid_bytes;
            h_rows(job, r, count, out, pad_in, spare);
        }
        status = 0;
        goto done;
    }
    const Axis *v = job->vax;
    rows = malloc(sizeof(*rows) * (size_t)(v->ksize > 0 ? v->ksize : 1));
    if (!rows) goto done;
    if (!job->hax) { /* vertical only: read the input rows in place */
        for (int y = 0; y < job->out_h; y++) {
            for (int t = 0; t < v->size[y]; t++) rows[t] = job->src + (Py_ssize_t)(v->start[y] + t) * in_bytes;
            v_row(job, rows, y, job->dst + (Py_ssize_t)y * mid_bytes, mid_bytes);
        }
        status = 0;
        goto done;
    }
    /* both passes: intermediate row r lives in ring slot r % depth while rows >= start[y] are needed
     * (start[y] and start[y] + size[y] never decrease; a batch computes at most TV_HROWS - 1 rows ahead) */
    const int depth = v->ksize + TV_HROWS;
    ring = malloc((size_t)depth * (size_t)slot);
    if (!ring) goto done;
    int next = 0; /* first intermediate row not computed yet */
    for (int y = 0; y < job->out_h; y++) {
        const int end = v->start[y] + v->size[y];
        while (next < end) {
            const int count = job->height - next < TV_HROWS ? job->height - next : TV_HROWS;
            uint8_t *out[TV_HROWS];
            for (int j = 0; j < count; j++) out[j] = ring + (Py_ssize_t)((next + j) % depth) * slot;
            h_rows(job, next, count, out, pad_in, spare);
            next += count;
        }
        for (int t = 0; t < v->size[y]; t++) rows[t] = ring + (Py_ssize_t)((v->start[y] + t) % depth) * slot;
        v_row(job, rows, y, job->dst + (Py_ssize_t)y * mid_bytes, mid_bytes);
    }
    status = 0;
done:
    free(pad_in);
    free(spare);
    free(ring);
    free((void *)rows);
    return status;
}

/* ------------------------------------------------------------------ Python binding */

typedef struct {
    Py_buffer start, size, weights;
    Axis axis;
    int held;
} AxisArg;

static void axis_release(AxisArg *a) {
    if (a->held) {
        PyBuffer_Release(&a->start);
        PyBuffer_Release(&a->size);
        PyBuffer_Release(&a->weights);
        a->held = 0;
    }
}

/* obj: None, or (start int32[out], size int32[out], weights int16[out, ksize], ksize, precision).
 * Returns 1 with an axis, 0 for None, -1 with an exception set. */
static int axis_parse(PyObject *obj, int in_size, int out_size, AxisArg *a, const char *name) {
    a->held = 0;
    if (obj == Py_None) return 0;
    int ksize, precision;
    if (!PyArg_ParseTuple(obj, "y*y*y*ii", &a->start, &a->size, &a->weights, &ksize, &precision)) return -1;
    a->held = 1;
    if (ksize < 1 || precision < 0 || precision > 30 || a->start.len < (Py_ssize_t)out_size * 4 ||
        a->size.len < (Py_ssize_t)out_size * 4 || a->weights.len < (Py_ssize_t)out_size * ksize * 2) {
        PyErr_Format(PyExc_ValueError, "%s axis: buffers too small or bad ksize / precision", name);
        return -1;
    }
    const int32_t *start = a->start.buf, *size = a->size.buf;
    int32_t prev_start = 0, prev_end = 0;
    for (int i = 0; i < out_size; i++) {
        const int32_t s = start[i], e = start[i] + size[i];
        if (s < 0 || size[i] < 0 || size[i] > ksize || e > in_size || s < prev_start || e < prev_end) {
            PyErr_Format(PyExc_ValueError, "%s axis: bad tap range at output %d", name, i);
            return -1;
        }
        prev_start = s;
        prev_end = e;
    }
    a->axis.start = start;
    a->axis.size = size;
    a->axis.weights = a->weights.buf;
    a->axis.ksize = ksize;
    a->axis.precision = precision;
    return 1;
}

PyDoc_STRVAR(resize_doc,
"resize(src, dst, height, width, channels, out_h, out_w, h_axis, v_axis, simd=True)\n"
"--\n\n"
"Resize C-contiguous uint8 [height, width, channels] bytes ``src`` into ``dst``\n"
"([out_h, out_w, channels]) with torch's uint8 antialiased arithmetic.  An axis is None\n"
"(that side unchanged) or (start int32[out], size int32[out], weights int16[out, ksize],\n"
"ksize, precision).  ``simd`` False: the portable C kernels even where AVX2 runs.\n"
"Releases the GIL.");

static PyObject *tv_resize(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"src", "dst", "height", "width", "channels", "out_h", "out_w",
                             "h_axis", "v_axis", "simd", NULL};
    Py_buffer src, dst;
    int height, width, channels, out_h, out_w, simd = 1;
    PyObject *h_obj, *v_obj;
    AxisArg ha = {0}, va = {0};
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*iiiiiOO|p", kwlist, &src, &dst, &height, &width, &channels,
                                     &out_h, &out_w, &h_obj, &v_obj, &simd))
        return NULL;
    if (height < 1 || width < 1 || channels < 1 || out_h < 1 || out_w < 1 ||
        src.len < (Py_ssize_t)height * width * channels || dst.len < (Py_ssize_t)out_h * out_w * channels) {
        PyErr_SetString(PyExc_ValueError, "bad sizes or buffers too small");
        goto done;
    }
    int hk = axis_parse(h_obj, width, out_w, &ha, "horizontal");
    if (hk < 0) goto done;
    int vk = axis_parse(v_obj, height, out_h, &va, "vertical");
    if (vk < 0) goto done;
    if ((hk == 0 && out_w != width) || (vk == 0 && out_h != height) || (hk == 0 && vk == 0)) {
        PyErr_SetString(PyExc_ValueError, "an axis whose size changes needs weights (and one must change)");
        goto done;
    }
    Job job = {src.buf, src.len, height, width, channels, out_h, out_w,
               hk ? &ha.axis : NULL, vk ? &va.axis : NULL, dst.buf, simd && tv_avx2};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run_job(&job);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    axis_release(&ha);
    axis_release(&va);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef tv_methods[] = {
    {"resize", (PyCFunction)(void (*)(void))tv_resize, METH_VARARGS | METH_KEYWORDS, resize_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef tv_module = {
    PyModuleDef_HEAD_INIT, "mmgate._native.tvresize",
    "torch's CPU uint8 antialiased resize passes (see mmgate.media.tv_resize).", -1, tv_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_tvresize(void) {
    PyObject *m = PyModule_Create(&tv_module);
    if (!m) return NULL;
    tv_avx2 = tv_cpu_has_avx2();
    if (PyModule_AddStringConstant(m, "KERNEL", tv_avx2 ? "avx2" : "c") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
