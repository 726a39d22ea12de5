/*
 * mmgate._native.patchrows: uint8 frames -> Qwen-VL ``pixel_values`` rows in one pass.
 *
 * Stage: preprocess (images and video frames), called by mmgate.models.patch_native.
 * In: C-contiguous uint8 frames [N, H, W, C] (an image is N = 1; a band of an image is
 * its rows of whole merged patches).  Out: rows [rows, C*T*p*p] of transformers 5.24
 * Qwen2VLImageProcessor / Qwen2VLVideoProcessor ``patchify`` order
 *
 *   row    = (g, gh/m, gw/m, m_h, m_w)     g < ceil(N / T): temporal group
 *   column = (C, T, p_h, p_w)
 *   value  = lut[c][frames[min(g*T + t, N - 1), y, x, c]]   (float32), or the byte itself (uint8)
 *
 * where frame min(g*T + t, N - 1) is the reference's time padding with copies of the last
 * frame (so an image, N = 1, is its patch repeated T times).  ``lut`` is the [C, 256]
 * float32 table of the configuration's rescale + normalize (mmgate.models.image_rows.
 * RowNormalizer.lut), so every value is a gather or a byte copy: no float arithmetic, the
 * results are exact whatever the compiler flags.
 *
 * Per row, the [C, p, p] values of one frame are gathered into an aligned scratch (for C = 3
 * in one sequential read of each pixel row, measured 1.3x faster than a pass per channel; the
 * compiler's AVX2 gathers were slower, so there is no SIMD dispatch), then copied with memcpy
 * to each (c, t) column block that uses that frame: ``dst`` may be any byte address (the
 * payload of a serialized request is not float-aligned).  The GIL is released while the rows
 * are written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Limits that keep every index in Py_ssize_t and the per-row scratch small. */
#define PR_MAX_CHANNELS 16
#define PR_MAX_PATCH 64

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    const float *lut;   /* [C, 256] (aligned copy), or NULL: uint8 output */
    Py_ssize_t frames, height, width, channels, patch, merge, temporal;
    Py_ssize_t first_row, num_rows;
} Job;

/* The [ch, p, p] values of one patch of channel-interleaved pixels (ch a constant after inlining). */
static inline void gather_f32(const Job *j, const uint8_t *px, Py_ssize_t ch, float *out) {
    const Py_ssize_t p = j->patch, pp = p * p, stride = j->width * ch;
    if (ch == 3) { /* one sequential read of each pixel row, three plane writes */
        const float *t0 = j->lut, *t1 = j->lut + 256, *t2 = j->lut + 512;
        float *o0 = out, *o1 = out + pp, *o2 = out + 2 * pp;
        for (Py_ssize_t y = 0; y < p; y++, px += stride, o0 += p, o1 += p, o2 += p) {
            for (Py_ssize_t x = 0; x < p; x++) {
                o0[x] = t0[px[3 * x]];
                o1[x] = t1[px[3 * x + 1]];
                o2[x] = t2[px[3 * x + 2]];
            }
        }
        return;
    }
    for (Py_ssize_t y = 0; y < p; y++, px += stride) {
        for (Py_ssize_t c = 0; c < ch; c++) {
            const float *table = j->lut + c * 256;
            const uint8_t *s = px + c;
            float *o = out + c * pp + y * p;
            for (Py_ssize_t x = 0; x < p; x++) o[x] = table[s[x * ch]];
        }
    }
}

static inline void gather_u8(const Job *j, const uint8_t *px, Py_ssize_t ch, uint8_t *out) {
    const Py_ssize_t p = j->patch, pp = p * p, stride = j->width * ch;
    if (ch == 3) { /* one sequential read of each pixel row, three plane writes */
        uint8_t *o0 = out, *o1 = out + pp, *o2 = out + 2 * pp;
        for (Py_ssize_t y = 0; y < p; y++, px += stride, o0 += p, o1 += p, o2 += p) {
            for (Py_ssize_t x = 0; x < p; x++) {
                o0[x] = px[3 * x];
                o1[x] = px[3 * x + 1];
                o2[x] = px[3 * x + 2];
            }
        }
        return;
    }
    for (Py_ssize_t y = 0; y < p; y++, px += stride) {
        for (Py_ssize_t c = 0; c < ch; c++) {
            const uint8_t *s = px + c;
            uint8_t *o = out + c * pp + y * p;
            for (Py_ssize_t x = 0; x < p; x++) o[x] = s[x * ch];
        }
    }
}

/* Writes rows [first_row, first_row + num_rows) with ``ch`` channels (a constant after inlining). */
static inline void run_rows(const Job *j, Py_ssize_t ch, void *scratch) {
    const Py_ssize_t p = j->patch, m = j->merge, T = j->temporal, pp = p * p;
    const Py_ssize_t gh = j->height / p, gw = j->width / p, bw = gw / m;
    const Py_ssize_t per_group = gh * gw, frame_bytes = j->height * j->width * ch;
    const Py_ssize_t item = j->lut ? 4 : 1, block = pp * item; /* bytes of one (c, t) block */
    const Py_ssize_t row_bytes = ch * T * block;
    uint8_t *dst = j->dst;
    for (Py_ssize_t r = j->first_row; r < j->first_row + j->num_rows; r++, dst += row_bytes) {
        Py_ssize_t g = r / per_group, q = r % per_group;
        const Py_ssize_t in_block = q % (m * m), merged = q / (m * m);
        const Py_ssize_t py = (merged / bw) * m + in_block / m, px = (merged % bw) * m + in_block % m;
        const Py_ssize_t offset = (py * p * j->width + px * p) * ch;
        Py_ssize_t prev = -1;
        for (Py_ssize_t t = 0; t < T; t++) {
            Py_ssize_t f = g * T + t;
            if (f > j->frames - 1) f = j->frames - 1;
            if (f != prev) {
                const uint8_t *src = j->src + f * frame_bytes + offset;
                if (j->lut) gather_f32(j, src, ch, (float *)scratch);
                else gather_u8(j, src, ch, (uint8_t *)scratch);
                prev = f;
            }
            for (Py_ssize_t c = 0; c < ch; c++)
                memcpy(dst + (c * T + t) * block, (const uint8_t *)scratch + c * block, (size_t)block);
        }
    }
}

static void run_job(const Job *j, void *scratch) {
    switch (j->channels) { /* constant channel counts let the compiler unroll the gathers */
    case 1: run_rows(j, 1, scratch); break;
    case 3: run_rows(j, 3, scratch); break;
    case 4: run_rows(j, 4, scratch); break;
    default: run_rows(j, j->channels, scratch); break;
    }
}

PyDoc_STRVAR(patch_rows_doc,
"patch_rows(src, dst, lut, frames, height, width, channels, patch, merge, temporal, first_row, num_rows)\n"
"--\n\n"
"Write rows [first_row, first_row + num_rows) of the Qwen-VL patch rows of C-contiguous uint8\n"
"``src`` ([frames, height, width, channels]) into ``dst``, contiguous rows of\n"
"channels*temporal*patch*patch values at any byte address: float32 ``lut[c][byte]`` when\n"
"``lut`` is a [channels, 256] float32 buffer, the bytes themselves when it is None.\n"
"height and width must be multiples of patch*merge.  Releases the GIL.");

static int too_big(Py_ssize_t a, Py_ssize_t b) { return b != 0 && a > PY_SSIZE_T_MAX / b; }

static PyObject *pr_patch_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"src", "dst", "lut", "frames", "height", "width", "channels", "patch",
                             "merge", "temporal", "first_row", "num_rows", NULL};
    Py_buffer src = {0}, dst = {0}, lut = {0};
    int have_lut = 0;
    PyObject *lut_obj, *result = NULL;
    Py_ssize_t frames, height, width, channels, patch, merge, temporal, first_row, num_rows;
    float *table = NULL;
    void *scratch = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*Onnnnnnnnn", kwlist, &src, &dst, &lut_obj, &frames,
                                     &height, &width, &channels, &patch, &merge, &temporal, &first_row,
                                     &num_rows))
        return NULL;
    if (frames < 1 || height < 1 || width < 1 || channels < 1 || channels > PR_MAX_CHANNELS || patch < 1 ||
        patch > PR_MAX_PATCH || merge < 1 || temporal < 1 || temporal > 1024 || first_row < 0 || num_rows < 0) {
        PyErr_SetString(PyExc_ValueError, "patch_rows: sizes out of range");
        goto done;
    }
    if (height % (patch * merge) || width % (patch * merge)) {
        PyErr_SetString(PyExc_ValueError, "patch_rows: height and width must be multiples of patch * merge");
        goto done;
    }
    if (too_big(frames, height) || too_big(frames * height, width) || too_big(frames * height * width, channels)) {
        PyErr_SetString(PyExc_ValueError, "patch_rows: frames too large");
        goto done;
    }
    const Py_ssize_t groups = (frames + temporal - 1) / temporal;
    const Py_ssize_t rows = groups * (height / patch) * (width / patch);
    const Py_ssize_t item = lut_obj == Py_None ? 1 : 4;
    const Py_ssize_t row_bytes = channels * temporal * patch * patch * item;
    if (src.len < frames * height * width * channels) {
        PyErr_Format(PyExc_ValueError, "patch_rows: src holds %zd bytes, %zd needed", src.len,
                     frames * height * width * channels);
        goto done;
    }
    if (first_row > rows || num_rows > rows - first_row) {
        PyErr_Format(PyExc_ValueError, "patch_rows: rows [%zd, %zd) outside the %zd rows of the frames",
                     first_row, first_row + num_rows, rows);
        goto done;
    }
    if (too_big(num_rows, row_bytes) || dst.len < num_rows * row_bytes) {
        PyErr_Format(PyExc_ValueError, "patch_rows: dst holds %zd bytes, %zd rows of %zd bytes needed", dst.len,
                     num_rows, row_bytes);
        goto done;
    }
    {
        const uint8_t *s0 = src.buf, *d0 = dst.buf;
        if (num_rows > 0 && s0 < d0 + num_rows * row_bytes && d0 < s0 + frames * height * width * channels) {
            PyErr_SetString(PyExc_ValueError, "patch_rows: dst overlaps src");
            goto done;
        }
    }
    if (lut_obj != Py_None) {
        if (PyObject_GetBuffer(lut_obj, &lut, PyBUF_C_CONTIGUOUS) < 0) goto done;
        have_lut = 1;
        if (lut.len != channels * 256 * 4) {
            PyErr_Format(PyExc_ValueError, "patch_rows: lut holds %zd bytes, [%zd, 256] float32 needed", lut.len,
                         channels);
            goto done;
        }
        table = PyMem_Malloc((size_t)(channels * 256) * sizeof(float));
        if (!table) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(table, lut.buf, (size_t)lut.len); /* aligned, and safe against the caller's buffer moving */
    }
    scratch = PyMem_Malloc((size_t)(channels * patch * patch) * sizeof(float));
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    Job job = {src.buf, dst.buf, table, frames, height, width, channels, patch, merge, temporal,
               first_row, num_rows};
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, scratch);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(scratch);
    PyMem_Free(table);
    if (have_lut) PyBuffer_Release(&lut);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef pr_methods[] = {
    {"patch_rows", (PyCFunction)(void (*)(void))pr_patch_rows, METH_VARARGS | METH_KEYWORDS, patch_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pr_module = {
    PyModuleDef_HEAD_INIT, "mmgate._native.patchrows",
    "uint8 frames -> Qwen-VL pixel_values rows in one pass (see mmgate.models.patch_native).", -1, pr_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_patchrows(void) { return PyModule_Create(&pr_module); }
