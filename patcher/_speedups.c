/*
 * patcher._speedups: compiled hot loops of the CPU codec.
 *
 * Every function here has a NumPy twin in patcher (diff, fingerprint, streams, apply)
 * that defines the result; tests hold the two equal bit for bit. The Python side
 * (patcher/native.py) checks dtypes, shapes and values before calling; this file only
 * trusts nothing about memory: every length is checked against its buffer, so a wrong
 * call raises ValueError instead of reading or writing out of bounds.
 *
 * Buffers come in through the buffer protocol as raw bytes (no NumPy headers needed to
 * build), loads go through memcpy (no alignment assumed), and the GIL is released
 * around every loop so callers can run several at once.
 *
 * Built against the stable ABI of CPython 3.11 (one wheel serves every later version).
 */

#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_FOR_WRITE(p) __builtin_prefetch((p), 1, 0)
#else
#define PREFETCH_FOR_WRITE(p) ((void)(p))
#endif

/* -- fingerprint (docs/FORMAT.md, "Fingerprints"; patcher/fingerprint.py) --------------- */

#define K_INDEX 0x9E3779B97F4A7C15ULL
#define M1 0xBF58476D1CE4E5B9ULL
#define M2 0x94D049BB133111EBULL

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= M1;
    x ^= x >> 27;
    x *= M2;
    x ^= x >> 31;
    return x;
}

static inline uint64_t element_hash(uint64_t index, uint64_t bits) { return mix64((index * K_INDEX) ^ bits); }

/* -- loads and stores of 1, 2, 4 or 8-byte elements, little or big endian alike -------- */

static inline uint64_t load(const unsigned char *p, int width) {
    switch (width) {
        case 1:
            return p[0];
        case 2: {
            uint16_t v;
            memcpy(&v, p, 2);
            return v;
        }
        case 4: {
            uint32_t v;
            memcpy(&v, p, 4);
            return v;
        }
        default: {
            uint64_t v;
            memcpy(&v, p, 8);
            return v;
        }
    }
}

static inline void store(unsigned char *p, int width, uint64_t value) {
    switch (width) {
        case 1:
            p[0] = (unsigned char)value;
            break;
        case 2: {
            uint16_t v = (uint16_t)value;
            memcpy(p, &v, 2);
            break;
        }
        case 4: {
            uint32_t v = (uint32_t)value;
            memcpy(p, &v, 4);
            break;
        }
        default:
            memcpy(p, &value, 8);
    }
}

static inline int64_t load_i64(const unsigned char *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t width_mask(int width) { return width == 8 ? ~0ULL : (1ULL << (8 * width)) - 1; }

/* Hot loops are written once for a `width` argument and inlined into a switch over the
 * four widths, so each copy is compiled for a constant width. */
#if defined(__GNUC__) || defined(__clang__)
#define HOT static inline __attribute__((always_inline))
#else
#define HOT static inline
#endif

/* Run the statement with W the element width as a constant: one compiled copy each. */
#define BY_WIDTH(width, ...)          \
    switch (width) {                  \
        case 1: {                     \
            enum { W = 1 };           \
            __VA_ARGS__;              \
            break;                    \
        }                             \
        case 2: {                     \
            enum { W = 2 };           \
            __VA_ARGS__;              \
            break;                    \
        }                             \
        case 4: {                     \
            enum { W = 4 };           \
            __VA_ARGS__;              \
            break;                    \
        }                             \
        default: {                    \
            enum { W = 8 };           \
            __VA_ARGS__;              \
        }                             \
    }

#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* Element k of a little-endian 64-bit word sits in bits [8 * width * k, ...). */
#define WORD_LANES 1
#endif

/* -- argument helpers ----------------------------------------------------------------- */

static int check_width(int width) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8, got %d", width);
        return -1;
    }
    return 0;
}

/* A buffer of exactly `count` items of `itemsize` bytes, or -1 with ValueError set. */
static int check_len(const Py_buffer *buf, Py_ssize_t count, Py_ssize_t itemsize, const char *what) {
    if (count < 0 || buf->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd items of %zd bytes", what, buf->len, count, itemsize);
        return -1;
    }
    return 0;
}

/* A buffer that holds a whole number of `itemsize`-byte items; returns their count or -1. */
static Py_ssize_t items(const Py_buffer *buf, Py_ssize_t itemsize, const char *what) {
    if (buf->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what, buf->len,
                     itemsize);
        return -1;
    }
    return buf->len / itemsize;
}

static void release(Py_buffer *bufs, int n) {
    for (int i = 0; i < n; i++) {
        if (bufs[i].obj != NULL) PyBuffer_Release(&bufs[i]);
    }
}

/* -- diff ------------------------------------------------------------------------------ */

/* Bytes compared per block: a block with no difference costs eight word XORs. */
#define DIFF_BLOCK 64

/* One change found by the diff: recorded at position `count` of the outputs, its index
 * hashed as `index + first` (the tensor's own index of a block's element 0). */
HOT void record(int width, Py_ssize_t index, uint64_t first, uint64_t was, uint64_t now, Py_ssize_t count,
                unsigned char *idx_out, unsigned char *was_out, unsigned char *delta_out, uint64_t *fp) {
    int64_t i = (int64_t)index;
    memcpy(idx_out + count * 8, &i, 8);
    store(was_out + count * width, width, was);
    store(delta_out + count * width, width, (now - was) & width_mask(width));
    const uint64_t at = (uint64_t)index + first;
    *fp += element_hash(at, now) - element_hash(at, was);
}

typedef struct {
    Py_ssize_t count, next;
    uint64_t fp;
} DiffResult;

/* Elements [pos, n) of a -> c; recorded indices are `base` + the element's own, hashed
 * with `first` added (see record). */
HOT DiffResult diff_scan(int width, const unsigned char *a, const unsigned char *c, Py_ssize_t n, Py_ssize_t pos,
                         Py_ssize_t cap, unsigned char *idx_out, unsigned char *was_out, unsigned char *delta_out,
                         Py_ssize_t base, uint64_t first) {
    const Py_ssize_t per_block = DIFF_BLOCK / width;
    Py_ssize_t count = 0, i = pos;
    uint64_t fp = 0;
    for (; i + per_block <= n; i += per_block) {
        const unsigned char *pa = a + i * width, *pc = c + i * width;
        uint64_t any = 0;
        for (int w = 0; w < DIFF_BLOCK; w += 8) {
            uint64_t x, y;
            memcpy(&x, pa + w, 8);
            memcpy(&y, pc + w, 8);
            any |= x ^ y;
        }
        if (!any) continue;
        if (cap - count < per_block) break;
#ifdef WORD_LANES
        /* Only the changed lanes of the changed words: work in proportion to the changes. */
        for (int w = 0; w < DIFF_BLOCK; w += 8) {
            uint64_t x, y;
            memcpy(&x, pa + w, 8);
            memcpy(&y, pc + w, 8);
            for (uint64_t d = x ^ y; d != 0;) {
                const int shift = (__builtin_ctzll(d) / (8 * width)) * (8 * width);
                const uint64_t mask = width_mask(width);
                d &= ~(mask << shift);
                record(width, base + i + (w + (shift >> 3)) / width, first, (x >> shift) & mask, (y >> shift) & mask,
                       count++, idx_out, was_out, delta_out, &fp);
            }
        }
#else
        for (Py_ssize_t k = 0; k < per_block; k++) {
            uint64_t was = load(pa + k * width, width), now = load(pc + k * width, width);
            if (was != now) record(width, base + i + k, first, was, now, count++, idx_out, was_out, delta_out, &fp);
        }
#endif
    }
    /* The tail, shorter than a block (the outputs hold at least a block). */
    if (i + per_block > n && cap - count >= n - i) {
        for (; i < n; i++) {
            uint64_t was = load(a + i * width, width), now = load(c + i * width, width);
            if (was != now) record(width, base + i, first, was, now, count++, idx_out, was_out, delta_out, &fp);
        }
    }
    DiffResult r = {count, i, fp};
    return r;
}

PyDoc_STRVAR(diff_doc,
             "diff(old, new, width, pos, indices_out, was_out, delta_out, first=0)\n"
             "    -> (count, next_pos, fingerprint_change)\n\n"
             "Scan elements pos.. of two equal-length bit buffers; write each changed element's index\n"
             "(int64), old bits and (new - old) mod 2**bits to the outputs, in order, until the end or\n"
             "until the outputs could not hold another block's changes. Returns how many were written,\n"
             "where the scan stopped (the buffer's length at the end), and the fingerprint change\n"
             "sum(H(first + i, new) - H(first + i, old)) mod 2**64 of the changes written (`first`: a\n"
             "block's place in its tensor). Outputs need room for at least 64 elements.");

static PyObject *py_diff(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}};
    int width;
    Py_ssize_t pos;
    unsigned long long first = 0;
    if (!PyArg_ParseTuple(args, "y*y*inw*w*w*|K", &b[0], &b[1], &width, &pos, &b[2], &b[3], &b[4], &first)) {
        release(b, 5);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], width, "old");
    if (n < 0) goto done;
    if (check_len(&b[1], n, width, "new") < 0) goto done;
    if (pos < 0 || pos > n) {
        PyErr_Format(PyExc_ValueError, "pos %zd outside [0, %zd]", pos, n);
        goto done;
    }
    Py_ssize_t cap = items(&b[2], 8, "indices_out");
    if (cap < 0 || check_len(&b[3], cap, width, "was_out") < 0 || check_len(&b[4], cap, width, "delta_out") < 0)
        goto done;
    if (cap < DIFF_BLOCK / width) {
        PyErr_Format(PyExc_ValueError, "outputs hold %zd elements, at least %d needed", cap, DIFF_BLOCK / width);
        goto done;
    }
    {
        const unsigned char *a = b[0].buf, *c = b[1].buf;
        unsigned char *io = b[2].buf, *wo = b[3].buf, *d = b[4].buf;
        DiffResult r;
        Py_BEGIN_ALLOW_THREADS;
        BY_WIDTH(width, r = diff_scan(W, a, c, n, pos, cap, io, wo, d, 0, first));
        Py_END_ALLOW_THREADS;
        result = Py_BuildValue("nnK", r.count, r.next, (unsigned long long)r.fp);
    }
done:
    release(b, 5);
    return result;
}

/* -- fingerprints ---------------------------------------------------------------------- */

PyDoc_STRVAR(fingerprint_doc,
             "fingerprint(bits, width, first_index, vector=True) -> int\n\n"
             "sum(H(first_index + k, bits[k])) mod 2**64 over the buffer's elements. With AVX-512\n"
             "(F and DQ) eight elements a step; vector=False keeps to the portable loop (tests hold\n"
             "the two equal).");

/* sum H(first + k, bits[k]) over n elements, in four independent sums: the multiplies of
 * neighbouring elements overlap. */
HOT uint64_t fingerprint_scalar(int W, const unsigned char *p, Py_ssize_t n, uint64_t first) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, index = first;
    Py_ssize_t k = 0;
    for (; k + 4 <= n; k += 4, index += 4) {
        s0 += element_hash(index, load(p + k * W, W));
        s1 += element_hash(index + 1, load(p + (k + 1) * W, W));
        s2 += element_hash(index + 2, load(p + (k + 2) * W, W));
        s3 += element_hash(index + 3, load(p + (k + 3) * W, W));
    }
    for (; k < n; k++, index++) s0 += element_hash(index, load(p + k * W, W));
    return s0 + s1 + s2 + s3;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FP_AVX512 1
#define AVX512 __attribute__((target("avx512f,avx512dq")))

AVX512 static inline __m512i mix64_avx512(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 30));
    x = _mm512_mullo_epi64(x, _mm512_set1_epi64((long long)M1));
    x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 27));
    x = _mm512_mullo_epi64(x, _mm512_set1_epi64((long long)M2));
    return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

/* Eight elements at p, widened to 64-bit lanes. */
AVX512 static inline __attribute__((always_inline)) __m512i load8_avx512(const unsigned char *p, int W) {
    switch (W) {
    case 1:
        return _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));
    case 2:
        return _mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)p));
    case 4:
        return _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)p));
    default:
        return _mm512_loadu_si512((const void *)p);
    }
}

/* fingerprint_scalar's sum with 64-bit multiplies eight lanes at a time (the same sum:
 * addition mod 2**64 in any order), two vectors a step. */
AVX512 static inline __attribute__((always_inline)) uint64_t fingerprint_avx512_loop(int W, const unsigned char *p,
                                                                                     Py_ssize_t n, uint64_t first) {
    const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), k = _mm512_set1_epi64((long long)K_INDEX);
    const __m512i step8 = _mm512_set1_epi64((long long)(8 * K_INDEX));
    const __m512i step16 = _mm512_set1_epi64((long long)(16 * K_INDEX));
    __m512i h = _mm512_mullo_epi64(_mm512_add_epi64(_mm512_set1_epi64((long long)first), lanes), k);
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i a = load8_avx512(p + i * W, W), b = load8_avx512(p + (i + 8) * W, W);
        s0 = _mm512_add_epi64(s0, mix64_avx512(_mm512_xor_si512(h, a)));
        s1 = _mm512_add_epi64(s1, mix64_avx512(_mm512_xor_si512(_mm512_add_epi64(h, step8), b)));
        h = _mm512_add_epi64(h, step16);
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1)) +
           fingerprint_scalar(W, p + i * W, n - i, first + (uint64_t)i);
}

AVX512 static uint64_t fingerprint_avx512(int width, const unsigned char *p, Py_ssize_t n, uint64_t first) {
    uint64_t r = 0;
    BY_WIDTH(width, r = fingerprint_avx512_loop(W, p, n, first));
    return r;
}
#endif

static uint64_t fingerprint_any(int width, const unsigned char *p, Py_ssize_t n, uint64_t first, int vector) {
#ifdef FP_AVX512
    if (vector && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"))
        return fingerprint_avx512(width, p, n, first);
#endif
    uint64_t r = 0;
    BY_WIDTH(width, r = fingerprint_scalar(W, p, n, first));
    return r;
}

static PyObject *py_fingerprint(PyObject *self, PyObject *args) {
    Py_buffer b[1] = {{0}};
    int width;
    unsigned long long first;
    int vector = 1;
    if (!PyArg_ParseTuple(args, "y*iK|p", &b[0], &width, &first, &vector)) {
        release(b, 1);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], width, "bits");
    if (n < 0) goto done;
    {
        uint64_t sum;
        Py_BEGIN_ALLOW_THREADS;
        sum = fingerprint_any(width, b[0].buf, n, first, vector);
        Py_END_ALLOW_THREADS;
        result = PyLong_FromUnsignedLongLong(sum);
    }
done:
    release(b, 1);
    return result;
}

PyDoc_STRVAR(fingerprint_change_doc,
             "fingerprint_change(indices, old, new, width) -> int\n\n"
             "sum(H(i, new) - H(i, old)) mod 2**64 over int64 indices and their old and new bits.");

static PyObject *py_fingerprint_change(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};
    int width;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &b[0], &b[1], &b[2], &width)) {
        release(b, 3);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], 8, "indices");
    if (n < 0 || check_len(&b[1], n, width, "old") < 0 || check_len(&b[2], n, width, "new") < 0) goto done;
    {
        const unsigned char *ix = b[0].buf, *po = b[1].buf, *pn = b[2].buf;
        uint64_t fp = 0;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t k = 0; k < n; k++) {
            uint64_t i = (uint64_t)load_i64(ix + 8 * k);
            fp += element_hash(i, load(pn + k * width, width)) - element_hash(i, load(po + k * width, width));
        }
        Py_END_ALLOW_THREADS;
        result = PyLong_FromUnsignedLongLong(fp);
    }
done:
    release(b, 3);
    return result;
}

/* -- apply ----------------------------------------------------------------------------- */

/* Changes looked ahead when prefetching: random reads of a large tensor are bound by
 * memory latency, and several misses in flight hide most of it (measured 2.6x). */
#define PREFETCH_AHEAD 32

typedef struct {
    Py_ssize_t done;
    uint64_t fp;
} ScatterResult;

HOT ScatterResult scatter_add_loop(int width, unsigned char *t, Py_ssize_t numel, const unsigned char *ix,
                                   const unsigned char *d, unsigned char *old_out, Py_ssize_t n, int64_t previous) {
    const uint64_t mask = width_mask(width);
    uint64_t fp = 0;
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        if (k + PREFETCH_AHEAD < n) {
            const int64_t ahead = load_i64(ix + 8 * (k + PREFETCH_AHEAD));
            if (ahead >= 0 && ahead < numel) PREFETCH_FOR_WRITE(t + ahead * width);
        }
        const int64_t i = load_i64(ix + 8 * k);
        const uint64_t delta = load(d + k * width, width);
        /* Every invariant of a patch's changes, checked as it is used (the caller undoes
         * the changes before a refusal): in range, increasing, and a real change. */
        if (i <= previous || i >= numel || delta == 0) break;
        previous = i;
        unsigned char *p = t + i * width;
        const uint64_t was = load(p, width), now = (was + delta) & mask;
        store(p, width, now);
        store(old_out + k * width, width, was);
        fp += element_hash((uint64_t)i, now) - element_hash((uint64_t)i, was);
    }
    ScatterResult r = {k, fp};
    return r;
}

PyDoc_STRVAR(scatter_add_doc,
             "scatter_add(target, width, indices, delta, old_out, after) -> (done, fingerprint_change)\n\n"
             "For each k in order: old_out[k] = target[indices[k]]; target[indices[k]] += delta[k]\n"
             "(mod 2**bits). Stops at the first change that is not one (an index out of range or\n"
             "not above the previous one, the first not above `after`, or a zero delta), having\n"
             "applied only those before it; returns how many were applied and their fingerprint\n"
             "change.");

static PyObject *py_scatter_add(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    int width;
    long long after;
    if (!PyArg_ParseTuple(args, "w*iy*y*w*L", &b[0], &width, &b[1], &b[2], &b[3], &after)) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t numel = items(&b[0], width, "target");
    Py_ssize_t n = items(&b[1], 8, "indices");
    if (numel < 0 || n < 0 || check_len(&b[2], n, width, "delta") < 0 || check_len(&b[3], n, width, "old_out") < 0)
        goto done;
    {
        unsigned char *t = b[0].buf, *old_out = b[3].buf;
        const unsigned char *ix = b[1].buf, *d = b[2].buf;
        const int64_t previous = after < -1 ? -1 : (int64_t)after;
        ScatterResult r;
        Py_BEGIN_ALLOW_THREADS;
        BY_WIDTH(width, r = scatter_add_loop(W, t, numel, ix, d, old_out, n, previous));
        Py_END_ALLOW_THREADS;
        result = Py_BuildValue("nK", r.done, (unsigned long long)r.fp);
    }
done:
    release(b, 4);
    return result;
}

PyDoc_STRVAR(scatter_doc,
             "scatter(target, width, indices, values)\n\n"
             "target[indices[k]] = values[k] for every k: puts saved bits back. Indices must be\n"
             "in range (ValueError before any write otherwise).");

static PyObject *py_scatter(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};
    int width;
    if (!PyArg_ParseTuple(args, "w*iy*y*", &b[0], &width, &b[1], &b[2])) {
        release(b, 3);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t numel = items(&b[0], width, "target");
    Py_ssize_t n = items(&b[1], 8, "indices");
    if (numel < 0 || n < 0 || check_len(&b[2], n, width, "values") < 0) goto done;
    {
        unsigned char *t = b[0].buf;
        const unsigned char *ix = b[1].buf, *v = b[2].buf;
        Py_ssize_t bad = -1;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t k = 0; k < n; k++) {
            int64_t i = load_i64(ix + 8 * k);
            if (i < 0 || i >= numel) {
                bad = k;
                break;
            }
        }
        if (bad < 0) {
            for (Py_ssize_t k = 0; k < n; k++) {
                int64_t i = load_i64(ix + 8 * k);
                memcpy(t + i * width, v + k * width, width);
            }
        }
        Py_END_ALLOW_THREADS;
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "index %zd out of range [0, %zd)", bad, numel);
            goto done;
        }
        result = Py_NewRef(Py_None);
    }
done:
    release(b, 3);
    return result;
}

/* -- casts (patcher/cast.py defines them, bit for bit) ------------------------------- */

/* F32 bits to BF16: nearest, ties to even; every NaN to 0xFFFF (cast.BF16_NAN). */
static inline uint16_t cast_f32_bf16(uint32_t x) {
    const uint32_t r = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
    return (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : r);
}

/* F32 bits to F16: nearest, ties to even, subnormals kept, overflow to infinity; a NaN
 * keeps its sign and top ten payload bits and becomes quiet. */
static inline uint16_t cast_f32_f16(uint32_t x) {
    const uint32_t a = x & 0x7FFFFFFFu, e = a >> 23, r = a - 0x38000000u;
    const uint32_t normal = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
    const uint32_t d = 126u - e, shift = d < 14u ? 14u : d > 24u ? 24u : d; /* wraps as NumPy's */
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t sub = (m + (1u << (shift - 1u)) - 1u + ((m >> shift) & 1u)) >> shift;
    uint32_t h = a >= 0x38800000u ? normal : e >= 102u ? sub : 0u;
    h = a >= 0x477FF000u ? 0x7C00u : h;
    h = a > 0x7F800000u ? 0x7E00u | ((a >> 13) & 0x3FFu) : h;
    return (uint16_t)(h | ((x >> 16) & 0x8000u));
}

/* The cast loops: one C loop, compiled for the baseline and again for AVX2 and AVX-512,
 * which the compiler vectorises as wide as each allows (the same bits: the arithmetic is
 * integer). Loads and stores go through memcpy (no alignment assumed). */
#define CAST_LOOP(NAME, FN, TARGET)                                                     \
    TARGET static void NAME(const unsigned char *src, unsigned char *dst, Py_ssize_t n) { \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            uint32_t x;                                                                 \
            memcpy(&x, src + 4 * i, 4);                                                 \
            const uint16_t y = FN(x);                                                   \
            memcpy(dst + 2 * i, &y, 2);                                                 \
        }                                                                               \
    }
#define BASELINE
CAST_LOOP(cast_bf16_base, cast_f32_bf16, BASELINE)
CAST_LOOP(cast_f16_base, cast_f32_f16, BASELINE)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CAST_WIDE 1
CAST_LOOP(cast_bf16_avx2, cast_f32_bf16, __attribute__((target("avx2"))))
CAST_LOOP(cast_f16_avx2, cast_f32_f16, __attribute__((target("avx2"))))
CAST_LOOP(cast_bf16_avx512, cast_f32_bf16, __attribute__((target("avx512f,avx512bw,avx512vl"))))
CAST_LOOP(cast_f16_avx512, cast_f32_f16, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#endif

typedef void (*CastFn)(const unsigned char *, unsigned char *, Py_ssize_t);

/* The widest cast loop this CPU runs (kind 0: F32 -> BF16, 1: F32 -> F16), unless
 * `widest` is 0 (the baseline loop: tests hold every width's bits equal). */
static CastFn cast_fn_at(int kind, int widest) {
#ifdef CAST_WIDE
    if (widest >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return kind == 0 ? cast_bf16_avx512 : cast_f16_avx512;
    if (widest >= 1 && __builtin_cpu_supports("avx2")) return kind == 0 ? cast_bf16_avx2 : cast_f16_avx2;
#endif
    return kind == 0 ? cast_bf16_base : cast_f16_base;
}

PyDoc_STRVAR(cast_doc,
             "cast(src, dst, kind, widest=2)\n\n"
             "patcher.cast's F32 -> BF16 (kind 0) or F32 -> F16 (kind 1) of src's uint32 bits into\n"
             "dst's uint16 (as many elements), on the widest vectors the CPU has up to `widest`\n"
             "(0 the baseline, 1 AVX2, 2 AVX-512); the same bits on each.");

static int check_kind(int kind) {
    if (kind == 0 || kind == 1) return 0;
    PyErr_SetString(PyExc_ValueError, "kind must be 0 (BF16) or 1 (F16)");
    return -1;
}

static PyObject *py_cast(PyObject *self, PyObject *args) {
    Py_buffer b[2] = {{0}};
    int kind, widest = 2;
    if (!PyArg_ParseTuple(args, "y*w*i|i", &b[0], &b[1], &kind, &widest)) {
        release(b, 2);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = items(&b[0], 4, "src");
    if (n < 0 || check_len(&b[1], n, 2, "dst") < 0) goto done;
    if (check_kind(kind) < 0) goto done;
    {
        const unsigned char *src = b[0].buf;
        unsigned char *dst = b[1].buf;
        Py_BEGIN_ALLOW_THREADS;
        cast_fn_at(kind, widest)(src, dst, n);
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
done:
    release(b, 2);
    return result;
}

/* -- the cast and the diff in one pass -------------------------------------------------- */

/* Source elements cast per step: the cast lands in a buffer that stays in the L1 cache
 * until the diff reads it back (a chunk of 1 M elements in Python lived in L2/L3). */
#define CAST_DIFF_STEP 2048

PyDoc_STRVAR(cast_diff_doc,
             "cast_diff(old, src, kind, pos, first, indices_out, was_out, delta_out, widest=2)\n"
             "    -> (count, next_pos, fingerprint_change)\n\n"
             "diff(old, cast(src, kind), 2, pos, ...) without the cast's copy: src's uint32 F32 bits are\n"
             "cast (kind as cast's) a few thousand elements at a time and each step diffed against\n"
             "old's uint16 bits there, recording changes as diff does (indices from 0) until the end\n"
             "or until the outputs could not hold another block's. The fingerprint change hashes\n"
             "each index plus `first` (a block's place in its tensor: a rank's part of the sum).");

static PyObject *py_cast_diff(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}};
    int kind, widest = 2;
    Py_ssize_t pos;
    unsigned long long first;
    if (!PyArg_ParseTuple(args, "y*y*inKw*w*w*|i", &b[0], &b[1], &kind, &pos, &first, &b[2], &b[3], &b[4],
                          &widest)) {
        release(b, 5);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = items(&b[0], 2, "old");
    if (n < 0 || check_len(&b[1], n, 4, "src") < 0) goto done;
    if (check_kind(kind) < 0) goto done;
    if (pos < 0 || pos > n) {
        PyErr_Format(PyExc_ValueError, "pos %zd outside [0, %zd]", pos, n);
        goto done;
    }
    Py_ssize_t cap = items(&b[2], 8, "indices_out");
    if (cap < 0 || check_len(&b[3], cap, 2, "was_out") < 0 || check_len(&b[4], cap, 2, "delta_out") < 0) goto done;
    if (cap < DIFF_BLOCK / 2) {
        PyErr_Format(PyExc_ValueError, "outputs hold %zd elements, at least %d needed", cap, DIFF_BLOCK / 2);
        goto done;
    }
    {
        const unsigned char *a = b[0].buf, *src = b[1].buf;
        unsigned char *io = b[2].buf, *wo = b[3].buf, *d = b[4].buf;
        const CastFn cast = cast_fn_at(kind, widest);
        Py_ssize_t count = 0, i = pos;
        uint64_t fp = 0;
        Py_BEGIN_ALLOW_THREADS;
        unsigned char buffer[2 * CAST_DIFF_STEP];
        while (i < n) {
            const Py_ssize_t m = n - i < CAST_DIFF_STEP ? n - i : CAST_DIFF_STEP;
            cast(src + 4 * i, buffer, m);
            /* The buffer holds elements i..i+m: scanned from its start, recorded from i. */
            DiffResult r = diff_scan(2, a + 2 * i, buffer, m, 0, cap - count, io + 8 * count, wo + 2 * count,
                                     d + 2 * count, i, first);
            count += r.count;
            fp += r.fp;
            if (r.next < m) {
                i += r.next;
                break;
            }
            i += m;
        }
        Py_END_ALLOW_THREADS;
        result = Py_BuildValue("nnK", count, i, (unsigned long long)fp);
    }
done:
    release(b, 5);
    return result;
}

PyDoc_STRVAR(check_changes_doc,
             "check_changes(indices, delta, width, numel) -> int\n\n"
             "0 if the int64 indices are strictly increasing within [0, numel) and no delta is\n"
             "zero; else 1 (the first or last index out of range), 2 (not increasing) or 3 (a\n"
             "zero delta), checked in that order.");

static PyObject *py_check_changes(PyObject *self, PyObject *args) {
    Py_buffer b[2] = {{0}};
    int width;
    Py_ssize_t numel;
    if (!PyArg_ParseTuple(args, "y*y*in", &b[0], &b[1], &width, &numel)) {
        release(b, 2);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], 8, "indices");
    if (n < 0 || check_len(&b[1], n, width, "delta") < 0) goto done;
    {
        const unsigned char *ix = b[0].buf, *d = b[1].buf;
        long code = 0;
        Py_BEGIN_ALLOW_THREADS;
        /* The NumPy checks' order: the ends in range, then strictly increasing, then
         * nonzero deltas. One pass of reductions without early exits. */
        if (n && (load_i64(ix) < 0 || load_i64(ix + 8 * (n - 1)) >= numel)) code = 1;
        if (code == 0) {
            int unordered = 0, zero = n && load(d, width) == 0;
            for (Py_ssize_t k = 1; k < n; k++) {
                unordered |= load_i64(ix + 8 * k) <= load_i64(ix + 8 * (k - 1));
                zero |= load(d + k * width, width) == 0;
            }
            code = unordered ? 2 : zero ? 3 : 0;
        }
        Py_END_ALLOW_THREADS;
        result = PyLong_FromLong(code);
    }
done:
    release(b, 2);
    return result;
}

/* -- streams (docs/FORMAT.md, "Streams"; patcher/streams.py) --------------------------- */

#define ESCAPE 3

/* The code of value k of a packed 2-bit code stream. */
static inline unsigned code_at(const unsigned char *codes, Py_ssize_t k) { return (codes[k >> 2] >> (2 * (k & 3))) & 3; }

/* Whether any of a packed byte's four codes is the escape (both bits set). */
static inline int has_escape(unsigned c) { return (c & (c >> 1) & 0x55) != 0; }

static int padding_ok(const unsigned char *codes, Py_ssize_t count) {
    return count % 4 == 0 || (codes[count >> 2] >> (2 * (count % 4))) == 0;
}

static Py_ssize_t codes_size(Py_ssize_t count) { return (count + 3) / 4; }

/* Zig-zag decoded z = code + 1 for codes 0..2 (-1, +1, -2), as 64-bit patterns; masked to
 * the width when stored. The escape's slot is unused. */
static const uint64_t small_delta[4] = {~0ULL, 1, ~1ULL, 0};

/* Escaped values are stored minus 3 in byte planes: plane j (of `escapes` bytes) holds
 * byte j, little-endian, of every escape of the entry. */
typedef struct {
    const unsigned char *planes;
    int width;
    Py_ssize_t count;
} Escapes;

static inline uint64_t escaped(const Escapes *x, Py_ssize_t e) {
    uint64_t v = 0;
    for (int j = x->width - 1; j >= 0; j--) v = v << 8 | x->planes[j * x->count + e];
    return v;
}

/* The planes' width must be the smallest that holds the values: two encodings of the
 * same values would break canonical encoding. */
static int escapes_canonical(const Escapes *x) {
    if (x->width <= 1) return 1;
    const unsigned char *top = x->planes + (Py_ssize_t)(x->width - 1) * x->count;
    for (Py_ssize_t e = 0; e < x->count; e++) {
        if (top[e]) return 1;
    }
    return 0;
}

/* A resumable reader of one entry's streams: runs of gaps (as indices) and of deltas,
 * each from where the last run of its kind stopped. */
typedef struct {
    const unsigned char *low, *gap_codes, *delta_codes;
    Escapes gap_esc, delta_esc;
    Py_ssize_t count;
    int64_t base; /* start - 1 */
    uint64_t span; /* stop - start */
    Py_ssize_t gk, ge, dk, de; /* next gap, gap escapes used; next delta, delta escapes used */
    uint64_t end; /* last index - base: at most span */
} Entry;

/* The next gap as an index, one at a time; 0 if it is invalid (state then undefined). */
static inline int gap_one(Entry *e, int64_t *out) {
    uint64_t high = code_at(e->gap_codes, e->gk);
    if (high == ESCAPE) {
        /* A high part over span >> 8 would be a gap past the range (or overflow). */
        if (e->ge == e->gap_esc.count || (e->span >> 8) < ESCAPE) return 0;
        const uint64_t stored = escaped(&e->gap_esc, e->ge++);
        if (stored > (e->span >> 8) - ESCAPE) return 0;
        high = stored + ESCAPE;
    }
    const uint64_t gap = high << 8 | e->low[e->gk];
    if (gap == 0 || gap > e->span - e->end) return 0;
    e->end += gap;
    e->gk++;
    *out = e->base + (int64_t)e->end;
    return 1;
}

/* Up to n indices into out; returns how many were valid (n unless one was not). */
static Py_ssize_t gap_run(Entry *e, Py_ssize_t n, int64_t *out) {
    Py_ssize_t j = 0;
    while (j < n) {
        if ((e->gk & 3) == 0 && n - j >= 4) {
            /* Four codes without an escape: four gaps under 768, checked together. */
            const unsigned c = e->gap_codes[e->gk >> 2];
            if (!has_escape(c)) {
                const unsigned char *lo = e->low + e->gk;
                const uint64_t g0 = (uint64_t)(c & 3) << 8 | lo[0], g1 = (uint64_t)(c >> 2 & 3) << 8 | lo[1];
                const uint64_t g2 = (uint64_t)(c >> 4 & 3) << 8 | lo[2], g3 = (uint64_t)(c >> 6) << 8 | lo[3];
                const uint64_t e3 = e->end + g0 + g1 + g2 + g3;
                if (g0 && g1 && g2 && g3 && e3 <= e->span) {
                    out[j] = e->base + (int64_t)(e->end + g0);
                    out[j + 1] = e->base + (int64_t)(e->end + g0 + g1);
                    out[j + 2] = e->base + (int64_t)(e->end + g0 + g1 + g2);
                    out[j + 3] = e->base + (int64_t)e3;
                    e->end = e3;
                    e->gk += 4;
                    j += 4;
                    continue;
                }
            }
        }
        if (!gap_one(e, &out[j])) return j;
        j++;
    }
    return j;
}

/* Up to n deltas into out (as 64-bit patterns, masked to the width); returns how many
 * were valid. */
HOT Py_ssize_t delta_run(int width, Entry *e, Py_ssize_t n, uint64_t *out) {
    const uint64_t mask = width_mask(width);
    Py_ssize_t j = 0;
    while (j < n) {
        if ((e->dk & 3) == 0 && n - j >= 4) {
            const unsigned c = e->delta_codes[e->dk >> 2];
            if (!has_escape(c)) {
                out[j] = small_delta[c & 3] & mask;
                out[j + 1] = small_delta[c >> 2 & 3] & mask;
                out[j + 2] = small_delta[c >> 4 & 3] & mask;
                out[j + 3] = small_delta[c >> 6] & mask;
                e->dk += 4;
                j += 4;
                continue;
            }
        }
        uint64_t v = code_at(e->delta_codes, e->dk);
        if (v == ESCAPE) {
            if (e->de == e->delta_esc.count) return j;
            /* z = v + 1 must fit the width, and not wrap to a zero delta: v <= 2**bits - 2. */
            const uint64_t stored = escaped(&e->delta_esc, e->de++);
            if (stored > mask - 1 - ESCAPE) return j;
            v = stored + ESCAPE;
        }
        const uint64_t z = v + 1;
        out[j++] = ((z >> 1) ^ (0 - (z & 1))) & mask;
        e->dk++;
    }
    return j;
}

/* Changes decoded per step of the decoders and of apply_entry: their indices and deltas
 * (8 KiB) stay in L1. */
#define RUN 512

/* Set up the gap or delta escapes of an entry; -1 with ValueError set if they do not fit. */
static int escapes_init(Escapes *x, const Py_buffer *planes, int width, Py_ssize_t count, const char *what) {
    if (width < 0 || width > 8 || count < 0 || (width == 0) != (count == 0)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd escapes of width %d", what, count, width);
        return -1;
    }
    if (check_len(planes, count * width, 1, what) < 0) return -1;
    x->planes = planes->buf;
    x->width = width;
    x->count = count;
    return 0;
}

/* Parse the common arguments of an entry's streams; -1 with ValueError set if they do not fit. */
static int entry_init(Entry *e, Py_ssize_t count, Py_ssize_t start, Py_ssize_t stop) {
    if (count < 0 || start < 0 || stop < start) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= count and 0 <= start <= stop");
        return -1;
    }
    memset(e, 0, sizeof *e);
    e->count = count;
    e->base = (int64_t)start - 1;
    e->span = (uint64_t)(stop - start);
    return 0;
}

static int gaps_init(Entry *e, const Py_buffer *low, const Py_buffer *codes, const Py_buffer *planes, int width,
                     Py_ssize_t escapes) {
    if (check_len(low, e->count, 1, "low") < 0 || check_len(codes, codes_size(e->count), 1, "gap_codes") < 0 ||
        escapes_init(&e->gap_esc, planes, width, escapes, "gap escapes") < 0)
        return -1;
    e->low = low->buf;
    e->gap_codes = codes->buf;
    return 0;
}

static int deltas_init(Entry *e, const Py_buffer *codes, const Py_buffer *planes, int width, Py_ssize_t escapes) {
    if (check_len(codes, codes_size(e->count), 1, "delta_codes") < 0 ||
        escapes_init(&e->delta_esc, planes, width, escapes, "delta escapes") < 0)
        return -1;
    e->delta_codes = codes->buf;
    return 0;
}

/* The decoders say only whether their input is valid: patcher/streams.py then runs the
 * NumPy decoder on bad input to say what is wrong. */

PyDoc_STRVAR(decode_gaps_doc,
             "decode_gaps(low, codes, planes, plane_width, escapes, count, start, stop, indices_out) -> bool\n\n"
             "An entry's indices from its gap bytes: gap k is (high << 8) | low[k], high the 2-bit\n"
             "code k, or for code 3 the next escape (its plane_width byte planes, concatenated in\n"
             "`planes`, hold high - 3). Writes start - 1 + cumsum(gaps) to indices_out (int64,\n"
             "aligned) and returns True; False if the input is invalid (padding, escape count or\n"
             "width, a zero gap, past stop), with indices_out undefined.");

static PyObject *py_decode_gaps(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    int plane_width;
    Py_ssize_t escapes, count, start, stop;
    if (!PyArg_ParseTuple(args, "y*y*y*innnnw*", &b[0], &b[1], &b[2], &plane_width, &escapes, &count, &start, &stop,
                          &b[3])) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    Entry e;
    if (entry_init(&e, count, start, stop) < 0 || gaps_init(&e, &b[0], &b[1], &b[2], plane_width, escapes) < 0 ||
        check_len(&b[3], count, 8, "indices_out") < 0)
        goto done;
    if ((uintptr_t)b[3].buf % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "indices_out must be 8-byte aligned");
        goto done;
    }
    {
        int ok;
        Py_BEGIN_ALLOW_THREADS;
        ok = padding_ok(e.gap_codes, count) && escapes_canonical(&e.gap_esc) &&
             gap_run(&e, count, (int64_t *)b[3].buf) == count && e.ge == e.gap_esc.count;
        Py_END_ALLOW_THREADS;
        result = PyBool_FromLong(ok);
    }
done:
    release(b, 4);
    return result;
}

HOT int deltas_into(int width, Entry *e, unsigned char *out) {
    uint64_t run[RUN];
    for (Py_ssize_t at = 0; at < e->count; at += RUN) {
        const Py_ssize_t n = e->count - at < RUN ? e->count - at : RUN;
        if (delta_run(width, e, n, run) != n) return 0;
        for (Py_ssize_t j = 0; j < n; j++) store(out + (at + j) * width, width, run[j]);
    }
    return e->de == e->delta_esc.count;
}

PyDoc_STRVAR(decode_deltas_doc,
             "decode_deltas(codes, planes, plane_width, escapes, count, width, delta_out) -> bool\n\n"
             "An entry's deltas: value v is the 2-bit code k, or for code 3 the next escape (its\n"
             "byte planes hold v - 3); z = v + 1 is zig-zag decoded to the width. Returns True, or\n"
             "False if the input is invalid (padding, escape count, width or range), with\n"
             "delta_out undefined.");

static PyObject *py_decode_deltas(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};
    int plane_width, width;
    Py_ssize_t escapes, count;
    if (!PyArg_ParseTuple(args, "y*y*inniw*", &b[0], &b[1], &plane_width, &escapes, &count, &width, &b[2])) {
        release(b, 3);
        return NULL;
    }
    PyObject *result = NULL;
    Entry e;
    if (check_width(width) < 0 || entry_init(&e, count, 0, 0) < 0 ||
        deltas_init(&e, &b[0], &b[1], plane_width, escapes) < 0 || check_len(&b[2], count, width, "delta_out") < 0)
        goto done;
    {
        unsigned char *out = b[2].buf;
        int ok = padding_ok(e.delta_codes, count) && escapes_canonical(&e.delta_esc);
        Py_BEGIN_ALLOW_THREADS;
        if (ok) {
            BY_WIDTH(width, ok = deltas_into(W, &e, out));
        }
        Py_END_ALLOW_THREADS;
        result = PyBool_FromLong(ok);
    }
done:
    release(b, 3);
    return result;
}

/* -- decode and apply in one pass ------------------------------------------------------ */

typedef struct {
    Py_ssize_t done;
    uint64_t fp;
    int ok;
} EntryResult;

HOT EntryResult apply_entry_loop(int width, unsigned char *t, Entry *e, int subtract, Py_ssize_t limit) {
    const uint64_t mask = width_mask(width);
    int64_t idx[RUN];
    uint64_t delta[RUN];
    uint64_t fp = 0;
    Py_ssize_t done = 0;
    int bad = !padding_ok(e->gap_codes, e->count) || !padding_ok(e->delta_codes, e->count) ||
              !escapes_canonical(&e->gap_esc) || !escapes_canonical(&e->delta_esc);
    while (!bad && done < limit) {
        const Py_ssize_t want = limit - done < RUN ? limit - done : RUN;
        Py_ssize_t n = gap_run(e, want, idx);
        n = delta_run(width, e, n, delta);
        bad = n < want;
        for (Py_ssize_t j = 0; j < n && j < PREFETCH_AHEAD; j++) PREFETCH_FOR_WRITE(t + idx[j] * width);
        for (Py_ssize_t j = 0; j < n; j++) {
            if (j + PREFETCH_AHEAD < n) PREFETCH_FOR_WRITE(t + idx[j + PREFETCH_AHEAD] * width);
            const int64_t i = idx[j];
            unsigned char *p = t + i * width;
            const uint64_t was = load(p, width);
            const uint64_t now = (subtract ? was - delta[j] : was + delta[j]) & mask;
            store(p, width, now);
            fp += element_hash((uint64_t)i, now) - element_hash((uint64_t)i, was);
        }
        done += n;
    }
    /* Valid through the end: every escape used. */
    int ok = !bad;
    if (ok && limit == e->count) ok = e->ge == e->gap_esc.count && e->de == e->delta_esc.count;
    EntryResult r = {done, fp, ok};
    return r;
}

PyDoc_STRVAR(apply_entry_doc,
             "apply_entry(target, width, low, gap_codes, gap_planes, gap_plane_width, gap_escapes,\n"
             "            delta_codes, delta_planes, delta_plane_width, delta_escapes,\n"
             "            count, start, stop, subtract, limit) -> (done, fingerprint_change, ok)\n\n"
             "Decode the first `limit` changes of one entry from its streams (as decode_gaps and\n"
             "decode_deltas do) and add each delta to target at its index (subtract it instead to\n"
             "undo an earlier call), a few hundred at a time, without materialising the patch.\n"
             "Stops at the first invalid change. Returns how many were applied, their fingerprint\n"
             "change, and whether the streams were valid (through the end when limit == count).");

static PyObject *py_apply_entry(PyObject *self, PyObject *args) {
    Py_buffer b[6] = {{0}};
    int width, gap_plane_width, delta_plane_width, subtract;
    Py_ssize_t gap_escapes, delta_escapes, count, start, stop, limit;
    if (!PyArg_ParseTuple(args, "w*iy*y*y*iny*y*innnnpn", &b[0], &width, &b[1], &b[2], &b[3], &gap_plane_width,
                          &gap_escapes, &b[4], &b[5], &delta_plane_width, &delta_escapes, &count, &start, &stop,
                          &subtract, &limit)) {
        release(b, 6);
        return NULL;
    }
    PyObject *result = NULL;
    Entry e;
    if (check_width(width) < 0 || entry_init(&e, count, start, stop) < 0 ||
        gaps_init(&e, &b[1], &b[2], &b[3], gap_plane_width, gap_escapes) < 0 ||
        deltas_init(&e, &b[4], &b[5], delta_plane_width, delta_escapes) < 0)
        goto done;
    Py_ssize_t numel = items(&b[0], width, "target");
    if (numel < 0) goto done;
    if (stop > numel || limit < 0 || limit > count) {
        PyErr_Format(PyExc_ValueError, "need stop <= %zd (the target's size) and 0 <= limit <= count", numel);
        goto done;
    }
    {
        unsigned char *t = b[0].buf;
        EntryResult r;
        Py_BEGIN_ALLOW_THREADS;
        BY_WIDTH(width, r = apply_entry_loop(W, t, &e, subtract, limit));
        Py_END_ALLOW_THREADS;
        result = Py_BuildValue("nKO", r.done, (unsigned long long)r.fp, r.ok ? Py_True : Py_False);
    }
done:
    release(b, 6);
    return result;
}

/* Writes small values as packed 2-bit codes min(v, 3), and v - 3 of each escape as a
 * uint64; each code byte is stored once, when full (or at the last value). */
typedef struct {
    unsigned char *codes, *esc;
    Py_ssize_t escapes;
    unsigned packed;
} CodeWriter;

static inline void put_small(CodeWriter *w, Py_ssize_t k, Py_ssize_t n, uint64_t v) {
    if (v >= ESCAPE) {
        const uint64_t stored = v - ESCAPE;
        memcpy(w->esc + 8 * w->escapes++, &stored, 8);
        v = ESCAPE;
    }
    w->packed |= (unsigned)v << (2 * (k & 3));
    if ((k & 3) == 3 || k == n - 1) {
        w->codes[k >> 2] = (unsigned char)w->packed;
        w->packed = 0;
    }
}

PyDoc_STRVAR(encode_gaps_doc,
             "encode_gaps(indices, start, low_out, codes_out, escaped_out) -> int\n\n"
             "The gap bytes of sorted unique int64 indices (all >= start): low bytes, packed 2-bit\n"
             "codes of min(high, 3), and high - 3 of each escape into escaped_out (uint64, room for\n"
             "every index). Returns the number of escapes.");

static PyObject *py_encode_gaps(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "y*nw*w*w*", &b[0], &start, &b[1], &b[2], &b[3])) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = items(&b[0], 8, "indices");
    if (n < 0 || check_len(&b[1], n, 1, "low_out") < 0 || check_len(&b[2], codes_size(n), 1, "codes_out") < 0 ||
        check_len(&b[3], n, 8, "escaped_out") < 0)
        goto done;
    {
        const unsigned char *ix = b[0].buf;
        unsigned char *low = b[1].buf;
        CodeWriter w = {b[2].buf, b[3].buf, 0, 0};
        Py_BEGIN_ALLOW_THREADS;
        uint64_t previous = (uint64_t)start - 1;
        for (Py_ssize_t k = 0; k < n; k++) {
            const uint64_t i = (uint64_t)load_i64(ix + 8 * k), gap = i - previous;
            previous = i;
            low[k] = (unsigned char)gap;
            put_small(&w, k, n, gap >> 8);
        }
        Py_END_ALLOW_THREADS;
        result = PyLong_FromSsize_t(w.escapes);
    }
done:
    release(b, 4);
    return result;
}

PyDoc_STRVAR(encode_deltas_doc,
             "encode_deltas(delta, width, codes_out, escaped_out) -> int\n\n"
             "The delta bytes of nonzero deltas: packed 2-bit codes of min(v, 3) for v = zigzag(delta)\n"
             "- 1, and v - 3 of each escape into escaped_out (uint64, room for every delta). Returns\n"
             "the number of escapes.");

static PyObject *py_encode_deltas(PyObject *self, PyObject *args) {
    Py_buffer b[3] = {{0}};
    int width;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &b[0], &width, &b[1], &b[2])) {
        release(b, 3);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], width, "delta");
    if (n < 0 || check_len(&b[1], codes_size(n), 1, "codes_out") < 0 || check_len(&b[2], n, 8, "escaped_out") < 0)
        goto done;
    {
        const unsigned char *d = b[0].buf;
        const uint64_t mask = width_mask(width);
        const int top = 8 * width - 1;
        CodeWriter w = {b[1].buf, b[2].buf, 0, 0};
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t k = 0; k < n; k++) {
            const uint64_t delta = load(d + k * width, width);
            const uint64_t z = ((delta << 1) ^ (0 - (delta >> top))) & mask;
            put_small(&w, k, n, (z - 1) & mask);
        }
        Py_END_ALLOW_THREADS;
        result = PyLong_FromSsize_t(w.escapes);
    }
done:
    release(b, 3);
    return result;
}

/* -- context codec (docs/FORMAT.md 3.15; patcher/rangecoder.py, context_model.py, context.py) --
 *
 * The range coder, the model of an entry's changes and the two scans over the base
 * (ranks of the changed elements for the encoder; rank -> index, fused with the scatter
 * of an apply, for the decoder). The Python modules named above define every result;
 * these are their compiled twins, held to the same bytes by tests. */

/* The flat table of contexts (patcher/context_model.py). */
#define CTX_MORE 0
#define CTX_GAP_LONGER 32
#define CTX_GAP_UP 132
#define CTX_GAP_DOWN 164
#define CTX_GAP_BITS 1064
#define CTX_DELTA 1316
#define CTX_DELTA_SLOTS 24
#define CTX_DTYPES 15
#define CTX_COUNT (CTX_DELTA + CTX_DTYPES * 256 * CTX_DELTA_SLOTS)
#define CTX_MAX_CLASSES 16
/* Windows whose bits are this close to the least (relative, and absolute in bits) tie:
 * the lowest wins, so float rounding never decides between equivalent windows. */
#define WINDOW_TIE 1e-9
#define MAX_GAP_BITS 63
#define GAP_SUM_CAP (1ULL << 32)
#define GAP_WINDOW 64
#define RC_TOP (1U << 24)
/* Fields of an entry's row in the meta array (int64). */
#define META_FIELDS 7
enum { M_COUNT, M_LO, M_CLASSES, M_DTYPE, M_WIDTH, M_EBITS, M_EXTRA };

typedef struct {
    uint16_t p;
    uint8_t n;
} Ctx;

static uint8_t ctx_shift[256];

static void ctx_init_shifts(void) {
    for (int n = 0; n < 256; n++) {
        int b = 0;
        for (unsigned v = (unsigned)n + 2; v; v >>= 1) b++;
        ctx_shift[n] = (uint8_t)(b - 1 < 7 ? b - 1 : 7);
    }
}

static Ctx *ctx_table(void) {
    ctx_init_shifts();
    Ctx *t = malloc(sizeof(Ctx) * CTX_COUNT);
    if (t == NULL) return NULL;
    for (int i = 0; i < CTX_COUNT; i++) {
        t[i].p = 32768;
        t[i].n = 0;
    }
    return t;
}

/* Branch-free: the bits coded are often unpredictable, a mispredicted branch costs more
 * than computing both ways. */
static inline void ctx_adapt(Ctx *c, int bit) {
    const int s = ctx_shift[c->n];
    const uint32_t p = c->p, mask = 0U - (uint32_t)bit;
    c->p = (uint16_t)(p - ((p >> s) & mask) + (((65536U - p) >> s) & ~mask));
    c->n = (uint8_t)(c->n + (c->n < 255));
}

static inline int bit_length(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

/* -- range encoder -- */

typedef struct {
    uint64_t low, cache_size;
    uint32_t range;
    uint8_t cache;
    unsigned char *out;
    size_t len, cap;
    int oom;
} RcEnc;

static void rc_put(RcEnc *e, unsigned char byte) {
    if (e->len == e->cap) {
        size_t cap = e->cap ? 2 * e->cap : 1 << 16;
        unsigned char *out = realloc(e->out, cap);
        if (out == NULL) {
            e->oom = 1;
            return;
        }
        e->out = out;
        e->cap = cap;
    }
    e->out[e->len++] = byte;
}

static void rc_shift_low(RcEnc *e) {
    if ((uint32_t)e->low < 0xFF000000U || (e->low >> 32) != 0) {
        const unsigned char carry = (unsigned char)(e->low >> 32);
        unsigned char temp = e->cache;
        do {
            rc_put(e, (unsigned char)(temp + carry));
            temp = 0xFF;
        } while (--e->cache_size != 0);
        e->cache = (uint8_t)(e->low >> 24);
    }
    e->cache_size++;
    e->low = (e->low & 0x00FFFFFFU) << 8;
}

static inline void rc_bit(RcEnc *e, Ctx *c, int bit) {
    const uint32_t bound = (e->range >> 16) * c->p, mask = 0U - (uint32_t)bit;
    e->low += bound & mask;
    e->range = (bound & ~mask) | ((e->range - bound) & mask);
    ctx_adapt(c, bit);
    while (e->range < RC_TOP) {
        e->range <<= 8;
        rc_shift_low(e);
    }
}

static inline void rc_direct(RcEnc *e, uint64_t value, int count) {
    while (count > 0) {
        /* The bits before the range next needs normalising, at once: each halves the
         * range and adds it to low for a 1, with no test in between (the same sums). */
        const int room = 32 - __builtin_clz(e->range) - 25;
        if (room > 0) {
            const int stop = count > room ? count - room : 0;
            uint32_t r = e->range;
            uint64_t add = 0;
            for (int k = count - 1; k >= stop; k--) {
                r >>= 1;
                add += r & (0U - (uint32_t)((value >> k) & 1));
            }
            e->low += add;
            e->range = r;
            count = stop;
            continue;
        }
        count--;
        e->range >>= 1;
        if ((value >> count) & 1) e->low += e->range;
        while (e->range < RC_TOP) {
            e->range <<= 8;
            rc_shift_low(e);
        }
    }
}

static inline size_t rc_bound(const RcEnc *e) { return e->len + (size_t)e->cache_size + 5; }

/* -- range decoder: `bad` set on any read past the end or a code outside the range -- */

typedef struct {
    uint32_t code, range;
    const unsigned char *in;
    size_t pos, len;
    int bad;
} RcDec;

static int rc_dec_init(RcDec *d, const unsigned char *in, size_t len) {
    d->in = in;
    d->len = len;
    d->range = 0xFFFFFFFFU;
    d->bad = 0;
    if (len < 5 || in[0] != 0) return -1;
    d->code = ((uint32_t)in[1] << 24) | ((uint32_t)in[2] << 16) | ((uint32_t)in[3] << 8) | in[4];
    d->pos = 5;
    return d->code == 0xFFFFFFFFU ? -1 : 0;
}

static inline void rc_dec_norm(RcDec *d) {
    while (d->range < RC_TOP) {
        d->range <<= 8;
        if (d->pos < d->len) {
            d->code = (d->code << 8) | d->in[d->pos++];
        } else {
            d->bad = 1;
            d->code <<= 8;
        }
    }
}

static inline int rc_dec_bit(RcDec *d, Ctx *c) {
    const uint32_t bound = (d->range >> 16) * c->p;
    const int bit = d->code >= bound;
    const uint32_t mask = 0U - (uint32_t)bit;
    d->code -= bound & mask;
    d->range = (bound & ~mask) | ((d->range - bound) & mask);
    ctx_adapt(c, bit);
    rc_dec_norm(d);
    return bit;
}

static inline uint64_t rc_dec_direct(RcDec *d, int count) {
    uint64_t value = 0;
    for (int k = 0; k < count; k++) {
        d->range >>= 1;
        int bit = d->code >= d->range;
        if (bit) {
            d->code -= d->range;
            if (d->code >= d->range) d->bad = 1;
        }
        value = (value << 1) | (uint64_t)bit;
        rc_dec_norm(d);
    }
    return value;
}

/* -- the model of an entry (context_model.py) -- */

static inline void gap_rate(uint64_t s, uint64_t n, int *k, int *fr) {
    const uint64_t q = (s << 8) / n;
    const int b = bit_length(q);
    *k = b - 8;
    *fr = (int)((q >> (b - 3)) & 3);
}

static inline void gap_next(uint64_t *s, uint64_t *n, uint64_t g) {
    *s += g < GAP_SUM_CAP ? g : GAP_SUM_CAP;
    if (++*n == GAP_WINDOW) {
        *s = (*s + 1) >> 1;
        *n >>= 1;
    }
}

static inline void class_start_state(uint64_t *s, uint64_t *n) {
    const uint64_t m = (2 * *s) / *n;
    *s = m > 2 ? m : 2;
    *n = 1;
}

static inline int mantissa_ctx(int b, int k, int fr, int node) {
    int rel = b - k;
    rel = (rel < -3 ? -3 : rel > 3 ? 3 : rel) + 3;
    return CTX_GAP_BITS + ((rel * 4 + fr) * 3 + node) * 3 + (b < 4 ? b : 4) - 2;
}

static void enc_gap(RcEnc *e, Ctx *t, uint64_t g, int k, int fr) {
    const int b = bit_length(g), kb = k < 24 ? k : 24;
    Ctx *longer = &t[CTX_GAP_LONGER + fr * 25 + kb];
    if (b > k) {
        rc_bit(e, longer, 1);
        for (int j = k + 1; j < MAX_GAP_BITS; j++) {
            const int stop = b == j;
            rc_bit(e, &t[CTX_GAP_UP + fr * 8 + (j - k < 8 ? j - k : 8) - 1], !stop);
            if (stop) break;
        }
    } else {
        rc_bit(e, longer, 0);
        for (int j = k; j > 1; j--) {
            const int stop = b == j;
            rc_bit(e, &t[CTX_GAP_DOWN + (fr * 9 + (k - j < 8 ? k - j : 8)) * 25 + kb], !stop);
            if (stop) break;
        }
    }
    const int below = b - 1;
    if (below >= 1) {
        const int top = (int)((g >> (below - 1)) & 1);
        rc_bit(e, &t[mantissa_ctx(b, k, fr, 0)], top);
        if (below >= 2) {
            rc_bit(e, &t[mantissa_ctx(b, k, fr, 1 + top)], (int)((g >> (below - 2)) & 1));
            if (below > 2) rc_direct(e, g, below - 2);
        }
    }
}

static uint64_t dec_gap(RcDec *d, Ctx *t, int k, int fr) {
    const int kb = k < 24 ? k : 24;
    int b;
    if (rc_dec_bit(d, &t[CTX_GAP_LONGER + fr * 25 + kb])) {
        b = k + 1;
        while (b < MAX_GAP_BITS && rc_dec_bit(d, &t[CTX_GAP_UP + fr * 8 + (b - k < 8 ? b - k : 8) - 1])) b++;
    } else {
        b = k;
        while (b > 1 && rc_dec_bit(d, &t[CTX_GAP_DOWN + (fr * 9 + (k - b < 8 ? k - b : 8)) * 25 + kb])) b--;
    }
    uint64_t g = 1;
    const int below = b - 1;
    if (below >= 1) {
        const int top = rc_dec_bit(d, &t[mantissa_ctx(b, k, fr, 0)]);
        g = (g << 1) | (uint64_t)top;
        if (below >= 2) {
            g = (g << 1) | (uint64_t)rc_dec_bit(d, &t[mantissa_ctx(b, k, fr, 1 + top)]);
            if (below > 2) g = (g << (below - 2)) | rc_dec_direct(d, below - 2);
        }
    }
    return g;
}

static inline int delta_row(const int64_t *m, int c) {
    const int row = m[M_EBITS] ? (int)((m[M_LO] + c) & 255) : 0;
    return CTX_DELTA + ((int)m[M_DTYPE] * 256 + row) * CTX_DELTA_SLOTS;
}

/* Signed value of a `width`-byte two's-complement delta. */
static inline int64_t sign_extend(uint64_t v, int width) {
    if (width == 8) return (int64_t)v;
    const int bits = 8 * width;
    return (int64_t)(v << (64 - bits)) >> (64 - bits);
}

static void enc_delta(RcEnc *e, Ctx *row, int64_t s, int width) {
    const int negative = s < 0;
    rc_bit(e, &row[0], negative);
    const uint64_t m = negative ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    for (uint64_t t = 1; t <= 3; t++) {
        rc_bit(e, &row[t], m != t);
        if (m == t) return;
    }
    const uint64_t v = m - 3;
    const int b = bit_length(v), most = 8 * width - 1;
    for (int j = 1; j < most; j++) {
        const int stop = b == j;
        rc_bit(e, &row[3 + (j < 20 ? j : 20)], !stop);
        if (stop) break;
    }
    rc_direct(e, v, b - 1);
}

/* The delta's bits, or 0 (never a delta) for one that cannot fit the width. */
static uint64_t dec_delta(RcDec *d, Ctx *row, int width) {
    const int negative = rc_dec_bit(d, &row[0]);
    uint64_t m = 1;
    while (m <= 3 && rc_dec_bit(d, &row[m])) m++;
    if (m == 4) {
        const int most = 8 * width - 1;
        int b = 1;
        while (b < most && rc_dec_bit(d, &row[3 + (b < 20 ? b : 20)])) b++;
        m = ((1ULL << (b - 1)) | rc_dec_direct(d, b - 1)) + 3;
    }
    const uint64_t half = 1ULL << (8 * width - 1);
    if (m > (negative ? half : half - 1)) return 0;
    return (negative ? (uint64_t)0 - m : m) & width_mask(width);
}

/* -- ctx_encode / ctx_decode -- */

typedef struct {
    const int64_t *meta;
    Py_ssize_t entries;
    const unsigned char *classes, *ranks, *deltas;
    int64_t budget;
} EncJob;

/* Each entry's changes gathered class-major (a stable counting sort of its classes), so
 * that the coder reads them in order: ranks[k] and deltas[k] (sign-extended) of the k-th
 * change coded; counts[c] changes of class c. */
static void class_major(const unsigned char *classes, const unsigned char *ranks, const unsigned char *deltas,
                        int width, Py_ssize_t count, int64_t *out_ranks, int64_t *out_deltas,
                        Py_ssize_t counts[CTX_MAX_CLASSES]) {
    Py_ssize_t first[CTX_MAX_CLASSES] = {0};
    for (int c = 0; c < CTX_MAX_CLASSES; c++) counts[c] = 0;
    for (Py_ssize_t k = 0; k < count; k++) counts[classes[k]]++;
    for (int c = 1; c < CTX_MAX_CLASSES; c++) first[c] = first[c - 1] + counts[c - 1];
    for (Py_ssize_t k = 0; k < count; k++) {
        const Py_ssize_t at = first[classes[k]]++;
        out_ranks[at] = load_i64(ranks + 8 * k);
        out_deltas[at] = sign_extend(load(deltas + k * width, width), width);
    }
}

/* Codes entries while they fit; returns how many did (all, or where it stopped).
 * `ranks` and `deltas` hold room for the largest entry's changes. */
static Py_ssize_t ctx_encode_run(const EncJob *job, Ctx *t, RcEnc *e, int64_t *ranks, int64_t *deltas) {
    Py_ssize_t at = 0, dat = 0;
    int64_t spent = 0;
    for (Py_ssize_t i = 0; i < job->entries; i++) {
        const int64_t *m = job->meta + i * META_FIELDS;
        const Py_ssize_t count = (Py_ssize_t)m[M_COUNT];
        const int classes = (int)m[M_CLASSES], width = (int)m[M_WIDTH], last = classes - 1;
        Py_ssize_t counts[CTX_MAX_CLASSES];
        class_major(job->classes + at, job->ranks + 8 * at, job->deltas + dat, width, count, ranks, deltas, counts);
        uint64_t s = 2, n = 1;
        Py_ssize_t pos = 0;
        for (int c = 0; c < classes && pos < count; c++) {
            Ctx *row = &t[delta_row(m, c)];
            int64_t prev = -1;
            int first = 1;
            /* A "more in this class" bit before each change and, unless the entry is done,
             * a last one that says the class ended (the last class needs none). */
            for (const Py_ssize_t stop = pos + counts[c]; pos < stop; pos++) {
                if (c < last) rc_bit(e, &t[CTX_MORE + 2 * c + first], 1);
                const uint64_t g = (uint64_t)(ranks[pos] - prev);
                int kk, fr;
                gap_rate(s, n, &kk, &fr);
                enc_gap(e, t, g, kk, fr);
                gap_next(&s, &n, g);
                enc_delta(e, row, deltas[pos], width);
                prev = ranks[pos];
                first = 0;
            }
            if (pos < count) rc_bit(e, &t[CTX_MORE + 2 * c + first], 0);
            class_start_state(&s, &n);
        }
        at += count;
        dat += count * width;
        spent += m[M_EXTRA];
        if ((int64_t)rc_bound(e) + spent > job->budget || e->oom) return i;
    }
    return job->entries;
}

PyDoc_STRVAR(ctx_encode_doc,
             "ctx_encode(meta, classes, ranks, deltas, budget) -> (fit, bytes or None)\n\n"
             "Range-code entries as patcher.context_encode.code_entries does: meta holds 7 int64 per\n"
             "entry (count, lo, classes, dtype table, width, exponent bits, header cost); classes\n"
             "(uint8, each below its entry's), ranks (int64) and deltas (each entry's width) are\n"
             "every entry's changes in index order, one entry after the other (coded class-major,\n"
             "as a stable sort by class orders them). Stops after the first entry whose stream bound plus\n"
             "the running cost exceeds budget, returning how many entries fit and None.");

static int check_meta(const Py_buffer *meta, Py_ssize_t *entries, Py_ssize_t *changes, Py_ssize_t *delta_bytes) {
    Py_ssize_t n = items(meta, 8 * META_FIELDS, "meta");
    if (n < 0) return -1;
    Py_ssize_t total = 0, bytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *m = (const int64_t *)meta->buf + i * META_FIELDS;
        if (m[M_COUNT] < 0 || m[M_CLASSES] < 1 || m[M_CLASSES] > CTX_MAX_CLASSES || m[M_DTYPE] < 0 ||
            m[M_DTYPE] >= CTX_DTYPES || check_width((int)m[M_WIDTH]) < 0 || m[M_LO] < 0 || m[M_EBITS] < 0 ||
            m[M_EBITS] > 11 || m[M_COUNT] > PY_SSIZE_T_MAX / 16 - total) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "meta: an entry's fields are out of range");
            return -1;
        }
        total += (Py_ssize_t)m[M_COUNT];
        bytes += (Py_ssize_t)m[M_COUNT] * m[M_WIDTH];
    }
    *entries = n;
    *changes = total;
    *delta_bytes = bytes;
    return 0;
}

static PyObject *py_ctx_encode(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    long long budget;
    if (!PyArg_ParseTuple(args, "y*y*y*y*L", &b[0], &b[1], &b[2], &b[3], &budget)) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t entries, changes, delta_bytes;
    if (check_meta(&b[0], &entries, &changes, &delta_bytes) < 0 || check_len(&b[1], changes, 1, "classes") < 0 ||
        check_len(&b[2], changes, 8, "ranks") < 0 || check_len(&b[3], delta_bytes, 1, "deltas") < 0)
        goto done;
    {
        EncJob job = {b[0].buf, entries, b[1].buf, b[2].buf, b[3].buf, budget};
        RcEnc e = {0, 1, 0xFFFFFFFFU, 0, NULL, 0, 0, 0};
        Py_ssize_t most = 1;
        const unsigned char *cls = b[1].buf;
        for (Py_ssize_t i = 0, at = 0; i < entries; i++) {
            const int64_t *m = (const int64_t *)b[0].buf + i * META_FIELDS;
            for (Py_ssize_t k = at; k < at + (Py_ssize_t)m[M_COUNT]; k++) {
                if (cls[k] >= m[M_CLASSES]) {
                    PyErr_SetString(PyExc_ValueError, "classes: a change's class is not below its entry's");
                    goto done;
                }
            }
            at += (Py_ssize_t)m[M_COUNT];
            if (m[M_COUNT] > most) most = (Py_ssize_t)m[M_COUNT];
        }
        Ctx *t = ctx_table();
        int64_t *ranks = malloc(sizeof(int64_t) * (size_t)most), *deltas = malloc(sizeof(int64_t) * (size_t)most);
        if (t == NULL || ranks == NULL || deltas == NULL) {
            free(t);
            free(ranks);
            free(deltas);
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t fit;
        Py_BEGIN_ALLOW_THREADS;
        fit = ctx_encode_run(&job, t, &e, ranks, deltas);
        if (fit == entries)
            for (int i = 0; i < 5; i++) rc_shift_low(&e);
        Py_END_ALLOW_THREADS;
        free(ranks);
        free(deltas);
        free(t);
        if (e.oom) {
            PyErr_NoMemory();
        } else if (fit < entries) {
            result = Py_BuildValue("nO", fit, Py_None);
        } else {
            PyObject *bytes = PyBytes_FromStringAndSize((const char *)e.out, (Py_ssize_t)e.len);
            if (bytes != NULL) result = Py_BuildValue("nN", fit, bytes);
        }
        free(e.out);
    }
done:
    release(b, 4);
    return result;
}

/* Decodes every entry; 0 when the stream is invalid (the NumPy decoder says why). */
static int ctx_decode_run(const int64_t *meta, Py_ssize_t entries, RcDec *d, Ctx *t, unsigned char *classes,
                          unsigned char *ranks, unsigned char *deltas) {
    Py_ssize_t at = 0, dat = 0;
    for (Py_ssize_t i = 0; i < entries; i++) {
        const int64_t *m = meta + i * META_FIELDS;
        const Py_ssize_t count = (Py_ssize_t)m[M_COUNT];
        const int nclasses = (int)m[M_CLASSES], width = (int)m[M_WIDTH], last = nclasses - 1;
        const uint64_t span = (uint64_t)m[M_EXTRA];
        uint64_t s = 2, n = 1;
        Py_ssize_t pos = 0;
        for (int c = 0; c < nclasses && pos < count; c++) {
            Ctx *row = &t[delta_row(m, c)];
            uint64_t prev = (uint64_t)-1;
            int first = 1;
            while (pos < count) {
                if (c < last && !rc_dec_bit(d, &t[CTX_MORE + 2 * c + first])) break;
                int k, fr;
                gap_rate(s, n, &k, &fr);
                const uint64_t g = dec_gap(d, t, k, fr);
                const uint64_t rank = prev + g;
                if (rank >= span || d->bad) return 0;
                gap_next(&s, &n, g);
                const uint64_t delta = dec_delta(d, row, width);
                if (delta == 0 || d->bad) return 0;
                classes[at + pos] = (unsigned char)c;
                const int64_t r = (int64_t)rank;
                memcpy(ranks + 8 * (at + pos), &r, 8);
                store(deltas + dat + pos * width, width, delta);
                prev = rank;
                first = 0;
                pos++;
            }
            class_start_state(&s, &n);
        }
        at += count;
        dat += count * width;
    }
    return !d->bad && d->pos == d->len;
}

PyDoc_STRVAR(ctx_decode_doc,
             "ctx_decode(stream, meta, classes_out, ranks_out, deltas_out) -> bool\n\n"
             "The entropy stage of a context-coded shard (patcher.context_decode): every entry's\n"
             "changes, class-major, into the outputs (as ctx_encode takes them). meta's 7th field\n"
             "is the entry's element count (ranks must stay below it). False for an invalid stream.");

static PyObject *py_ctx_decode(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}};
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*", &b[0], &b[1], &b[2], &b[3], &b[4])) {
        release(b, 5);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t entries, changes, delta_bytes;
    if (check_meta(&b[1], &entries, &changes, &delta_bytes) < 0 || check_len(&b[2], changes, 1, "classes_out") < 0 ||
        check_len(&b[3], changes, 8, "ranks_out") < 0 || check_len(&b[4], delta_bytes, 1, "deltas_out") < 0)
        goto done;
    {
        RcDec d;
        if (rc_dec_init(&d, b[0].buf, (size_t)b[0].len) < 0) {
            result = Py_NewRef(Py_False);
            goto done;
        }
        Ctx *t = ctx_table();
        if (t == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        int ok;
        Py_BEGIN_ALLOW_THREADS;
        ok = ctx_decode_run(b[1].buf, entries, &d, t, b[2].buf, b[3].buf, b[4].buf);
        Py_END_ALLOW_THREADS;
        free(t);
        result = Py_NewRef(ok ? Py_True : Py_False);
    }
done:
    release(b, 5);
    return result;
}

/* -- scans of the base (context.py) --
 *
 * A class's lane is one byte of two 64-bit words (16 lanes): per element, its exponent
 * indexes a table of one-hot words, which the scans add (ranks) or subtract (select). */

#define LANE_HIGH 0x8080808080808080ULL

typedef struct {
    int shift, width, ebits;
    uint64_t emask;
    uint8_t cls[2048];
    uint64_t oh[2][2048];
} Classes;

static int classes_init(Classes *k, int width, int shift, int ebits, int64_t lo, int nclasses) {
    if (ebits < 1 || ebits > 11 || shift < 0 || shift + ebits > 8 * width || nclasses < 1 ||
        nclasses > CTX_MAX_CLASSES || lo < 0 || lo + nclasses > (1 << ebits)) {
        PyErr_SetString(PyExc_ValueError, "class window or exponent field out of range");
        return -1;
    }
    k->shift = shift;
    k->width = width;
    k->ebits = ebits;
    k->emask = (1ULL << ebits) - 1;
    for (int e = 0; e < (1 << ebits); e++) {
        int64_t c = e - lo;
        c = c < 0 ? 0 : c > nclasses - 1 ? nclasses - 1 : c;
        k->cls[e] = (uint8_t)c;
        k->oh[0][e] = c < 8 ? 1ULL << (8 * c) : 0;
        k->oh[1][e] = c >= 8 ? 1ULL << (8 * (c - 8)) : 0;
    }
    return 0;
}

static inline unsigned lane_get(const uint64_t *w, int c) { return (unsigned)(w[c >> 3] >> (8 * (c & 7))) & 0xFF; }

static inline void lane_set(uint64_t *w, int c, unsigned v) {
    const int sh = 8 * (c & 7);
    w[c >> 3] = (w[c >> 3] & ~(0xFFULL << sh)) | ((uint64_t)v << sh);
}

HOT void ranks_loop(int W, const Classes *k, const unsigned char *base, int64_t start, const int64_t *idx,
                    Py_ssize_t n, unsigned char *cls_out, int64_t *rank_out) {
    uint64_t counts[CTX_MAX_CLASSES] = {0};
    uint64_t acc[2] = {0, 0};
    int pending = 0;
    int64_t i = start;
    for (Py_ssize_t j = 0; j < n; j++) {
        const int64_t target = idx[j];
        for (; i < target; i++) {
            const uint64_t e = (load(base + i * W, W) >> k->shift) & k->emask;
            acc[0] += k->oh[0][e];
            acc[1] += k->oh[1][e];
            if (++pending == 255) {
                for (int c = 0; c < CTX_MAX_CLASSES; c++) counts[c] += lane_get(acc, c);
                acc[0] = acc[1] = 0;
                pending = 0;
            }
        }
        const uint64_t e = (load(base + i * W, W) >> k->shift) & k->emask;
        const int c = k->cls[e];
        cls_out[j] = (unsigned char)c;
        rank_out[j] = (int64_t)(counts[c] + lane_get(acc, c));
        counts[c]++;
        i++;
    }
}

/* ctx_diff element by element (any width): diff_scan's changes, each with its class and
 * rank (the members of its class in [0, index), `totals` holding those in [0, pos) and
 * coming out as those in [0, where it stopped)), the exponents of their old bits counted
 * in `changed`. Stops at the change the outputs cannot hold. */
HOT DiffResult ctx_diff_loop(int W, const Classes *k, const unsigned char *a, const unsigned char *c, Py_ssize_t n,
                             Py_ssize_t pos, Py_ssize_t cap, uint64_t *totals, int64_t *changed, unsigned char *idx_out,
                             unsigned char *was_out, unsigned char *delta_out, unsigned char *cls_out,
                             int64_t *rank_out) {
    Py_ssize_t count = 0, i = pos;
    uint64_t fp = 0;
    for (; i < n; i++) {
        const uint64_t was = load(a + i * W, W), now = load(c + i * W, W), e = (was >> k->shift) & k->emask;
        const int cl = k->cls[e];
        if (was != now) {
            if (count == cap) break;
            cls_out[count] = (unsigned char)cl;
            rank_out[count] = (int64_t)totals[cl];
            changed[e]++;
            record(W, i, 0, was, now, count++, idx_out, was_out, delta_out, &fp);
        }
        totals[cl]++;
    }
    DiffResult r = {count, i, fp};
    return r;
}

/* -- block scans (x86-64, 2-byte elements) --
 *
 * The same results as the scans above, 64 elements at a time: SSE2 computes the
 * block's 64 class bytes and their four bit planes, which give each class a 64-bit mask
 * of its members; POPCNT counts them. A block whose masks hold no target of any class
 * is skipped as a whole. Chosen at run time (the CPU must have POPCNT); each element's
 * class still comes from its own bits only. */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CTX_BLOCKS 1
#define BLOCK_TARGET __attribute__((target("popcnt")))

static int blocks_usable(const Classes *k) {
    return k->width == 2 && k->ebits <= 8 && __builtin_cpu_supports("popcnt");
}

typedef struct {
    uint64_t m[CTX_MAX_CLASSES];
} Masks;

/* Each class's member mask from the four bit planes of 64 clipped class ids. */
static inline void planes_to_masks(const uint64_t plane[4], uint64_t valid, int top, Masks *out) {
    const uint64_t low[4] = {~plane[0] & ~plane[1], plane[0] & ~plane[1], ~plane[0] & plane[1], plane[0] & plane[1]};
    const uint64_t high[4] = {~plane[2] & ~plane[3] & valid, plane[2] & ~plane[3] & valid,
                              ~plane[2] & plane[3] & valid, plane[2] & plane[3] & valid};
    for (int c = 0; c <= top; c++) out->m[c] = low[c & 3] & high[c >> 2];
}

/* The members of each class among 64 2-byte elements at p (`valid` of them count). */
BLOCK_TARGET static inline void block_masks(const Classes *k, int lo, int top, const unsigned char *p,
                                            uint64_t valid, Masks *out) {
    const __m128i count = _mm_cvtsi32_si128(k->shift);
    const __m128i emask = _mm_set1_epi16((short)k->emask);
    const __m128i vlo = _mm_set1_epi8((char)lo), vtop = _mm_set1_epi8((char)top);
    uint64_t plane[4] = {0, 0, 0, 0};
    for (int q = 0; q < 4; q++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(p + 32 * q));
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 32 * q + 16));
        a = _mm_and_si128(_mm_srl_epi16(a, count), emask);
        b = _mm_and_si128(_mm_srl_epi16(b, count), emask);
        const __m128i c = _mm_min_epu8(_mm_subs_epu8(_mm_packus_epi16(a, b), vlo), vtop);
        plane[0] |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_slli_epi16(c, 7)) << (16 * q);
        plane[1] |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_slli_epi16(c, 6)) << (16 * q);
        plane[2] |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_slli_epi16(c, 5)) << (16 * q);
        plane[3] |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_slli_epi16(c, 4)) << (16 * q);
    }
    planes_to_masks(plane, valid, top, out);
}

/* block_masks with AVX2: half the instructions (32 elements a vector). */
__attribute__((target("avx2,popcnt"))) static void block_masks_avx2(const Classes *k, int lo, int top,
                                                                     const unsigned char *p, uint64_t valid,
                                                                     Masks *out) {
    const __m128i count = _mm_cvtsi32_si128(k->shift);
    const __m256i emask = _mm256_set1_epi16((short)k->emask);
    const __m256i vlo = _mm256_set1_epi8((char)lo), vtop = _mm256_set1_epi8((char)top);
    uint64_t plane[4] = {0, 0, 0, 0};
    for (int q = 0; q < 2; q++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(p + 64 * q));
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + 64 * q + 32));
        a = _mm256_and_si256(_mm256_srl_epi16(a, count), emask);
        b = _mm256_and_si256(_mm256_srl_epi16(b, count), emask);
        /* packus works within 128-bit lanes: put the 64-bit quarters back in element order. */
        const __m256i e = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
        const __m256i c = _mm256_min_epu8(_mm256_subs_epu8(e, vlo), vtop);
        plane[0] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(c, 7)) << (32 * q);
        plane[1] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(c, 6)) << (32 * q);
        plane[2] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(c, 5)) << (32 * q);
        plane[3] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(c, 4)) << (32 * q);
    }
    planes_to_masks(plane, valid, top, out);
}

typedef void (*MasksFn)(const Classes *, int, int, const unsigned char *, uint64_t, Masks *);

BLOCK_TARGET static void block_masks_sse2(const Classes *k, int lo, int top, const unsigned char *p, uint64_t valid,
                                          Masks *out) {
    block_masks(k, lo, top, p, valid, out);
}

/* The fastest block_masks this CPU runs. */
static MasksFn masks_fn(void) { return __builtin_cpu_supports("avx2") ? block_masks_avx2 : block_masks_sse2; }

/* 64 elements from `base` at i (fewer at the end of the range), as the overlay makes
 * them: a pointer to them, straight into the base when nothing needs copying. */
static inline const unsigned char *block_at(const unsigned char *base, int64_t i, int64_t stop, const int64_t *ov_idx,
                                            const unsigned char *ov_val, Py_ssize_t ov_n, Py_ssize_t *o,
                                            unsigned char *tmp, uint64_t *valid) {
    const int64_t n = stop - i < 64 ? stop - i : 64;
    *valid = n == 64 ? ~0ULL : (1ULL << n) - 1;
    const int overlaid = *o < ov_n && ov_idx[*o] < i + n;
    if (n == 64 && !overlaid) return base + 2 * i;
    memset(tmp, 0, 128);
    memcpy(tmp, base + 2 * i, (size_t)(2 * n));
    for (; *o < ov_n && ov_idx[*o] < i + n; (*o)++) memcpy(tmp + 2 * (ov_idx[*o] - i), ov_val + 2 * *o, 2);
    return tmp;
}

BLOCK_TARGET static void ranks_blocks(const Classes *k, int lo, int nclasses, const unsigned char *base, int64_t start,
                                      const int64_t *idx, Py_ssize_t n, unsigned char *cls_out, int64_t *rank_out) {
    uint64_t counts[CTX_MAX_CLASSES] = {0};
    const int top = nclasses - 1;
    const int64_t end = n ? idx[n - 1] + 1 : start;
    unsigned char tmp[128];
    Py_ssize_t j = 0, o = 0;
    Masks m;
    const MasksFn masks = masks_fn();
    for (int64_t i = start; i < end; i += 64) {
        uint64_t valid;
        const unsigned char *p = block_at(base, i, end, NULL, NULL, 0, &o, tmp, &valid);
        masks(k, lo, top, p, valid, &m);
        for (; j < n && idx[j] < i + 64; j++) {
            const int off = (int)(idx[j] - i);
            int c = 0;
            while (!((m.m[c] >> off) & 1)) c++;
            cls_out[j] = (unsigned char)c;
            rank_out[j] = (int64_t)(counts[c] + (uint64_t)__builtin_popcountll(m.m[c] & ((1ULL << off) - 1)));
        }
        for (int c = 0; c <= top; c++) counts[c] += (uint64_t)__builtin_popcountll(m.m[c]);
    }
}

/* The encoder's rank pass with AVX2 (ranks_blocks' results, without its 16 masks and
 * popcounts a block): each element's class byte looks up a one-hot nibble (vpshufb), two
 * classes a byte lane, summed vertically; every 7 blocks (before a nibble can overflow)
 * the nibbles go into 64-bit sums (vpsadbw), and a class's lanes are summed only where a
 * change asks for its rank. Full blocks only: the last, partial one is counted element
 * by element. The same counter serves the rank pass at given indices and the diff that
 * ranks its changes as it finds them (ctx_diff). */
#define AVX2 __attribute__((target("avx2,popcnt")))

AVX2 static inline __m256i class_bytes_avx2(const unsigned char *p, __m128i count, __m256i emask, __m256i vlo,
                                            __m256i vtop) {
    __m256i a = _mm256_loadu_si256((const __m256i *)p);
    __m256i b = _mm256_loadu_si256((const __m256i *)(p + 32));
    a = _mm256_and_si256(_mm256_srl_epi16(a, count), emask);
    b = _mm256_and_si256(_mm256_srl_epi16(b, count), emask);
    const __m256i e = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
    return _mm256_min_epu8(_mm256_subs_epu8(e, vlo), vtop);
}

AVX2 static inline uint64_t lanes_sum_avx2(__m256i v) {
    const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (uint64_t)_mm_cvtsi128_si64(_mm_add_epi64(t, _mm_unpackhi_epi64(t, t)));
}

AVX2 static inline uint64_t wide_sum_avx2(__m256i v) {
    const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(_mm_add_epi64(t, _mm_unpackhi_epi64(t, t)));
}

/* Members of each class counted a block at a time. Classes 2g and 2g + 1 share a byte
 * lane of nib[g], as its two nibbles: table[g] maps a class to 1, 16 or 0 (vpshufb). A
 * lane gains at most 2 a block, so the nibbles go into wide (four 64-bit sums a class)
 * every 7 blocks. */
typedef struct {
    __m128i count;
    __m256i emask, vlo, vtop, low4;
    __m256i table[CTX_MAX_CLASSES / 2], nib[CTX_MAX_CLASSES / 2], wide[CTX_MAX_CLASSES];
    int since;
} Counter;

AVX2 static void counter_init(Counter *s, const Classes *k, int lo, int nclasses, const uint64_t *before) {
    s->count = _mm_cvtsi32_si128(k->shift);
    s->emask = _mm256_set1_epi16((short)k->emask);
    s->vlo = _mm256_set1_epi8((char)lo);
    s->vtop = _mm256_set1_epi8((char)(nclasses - 1));
    s->low4 = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < CTX_MAX_CLASSES / 2; g++) {
        unsigned char t[16] = {0};
        t[2 * g] = 1;
        t[2 * g + 1] = 16;
        s->table[g] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
        s->nib[g] = _mm256_setzero_si256();
    }
    for (int c = 0; c < CTX_MAX_CLASSES; c++) s->wide[c] = _mm256_set_epi64x(0, 0, 0, (long long)before[c]);
    s->since = 0;
}

/* The class of element `off` of the block whose class bytes are c0, c1 (stored in cb),
 * and its rank: the members of its class counted so far plus those before it in the
 * block. Call before counter_add of the block. */
AVX2 static inline uint64_t counter_rank(const Counter *s, __m256i c0, __m256i c1, const unsigned char *cb, int off,
                                         int *cls) {
    const int c = cb[off];
    const __m256i want = _mm256_set1_epi8((char)c);
    const uint64_t m = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c0, want)) |
                       (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c1, want)) << 32;
    const __m256i part = _mm256_and_si256(_mm256_srl_epi16(s->nib[c >> 1], _mm_cvtsi32_si128(4 * (c & 1))), s->low4);
    *cls = c;
    return wide_sum_avx2(_mm256_add_epi64(_mm256_sad_epu8(part, _mm256_setzero_si256()), s->wide[c])) +
           (uint64_t)__builtin_popcountll(m & ((1ULL << off) - 1));
}

AVX2 static inline void counter_add(Counter *s, __m256i c0, __m256i c1) {
    for (int g = 0; g < CTX_MAX_CLASSES / 2; g++)
        s->nib[g] = _mm256_add_epi8(
            s->nib[g], _mm256_add_epi8(_mm256_shuffle_epi8(s->table[g], c0), _mm256_shuffle_epi8(s->table[g], c1)));
    if (++s->since == 7) {
        for (int g = 0; g < CTX_MAX_CLASSES / 2; g++) {
            const __m256i lo_n = _mm256_and_si256(s->nib[g], s->low4);
            const __m256i hi_n = _mm256_and_si256(_mm256_srli_epi16(s->nib[g], 4), s->low4);
            s->wide[2 * g] = _mm256_add_epi64(s->wide[2 * g], _mm256_sad_epu8(lo_n, _mm256_setzero_si256()));
            s->wide[2 * g + 1] = _mm256_add_epi64(s->wide[2 * g + 1], _mm256_sad_epu8(hi_n, _mm256_setzero_si256()));
            s->nib[g] = _mm256_setzero_si256();
        }
        s->since = 0;
    }
}

/* Every class's count so far. */
AVX2 static void counter_totals(const Counter *s, uint64_t *totals) {
    for (int g = 0; g < CTX_MAX_CLASSES / 2; g++) {
        totals[2 * g] = lanes_sum_avx2(_mm256_and_si256(s->nib[g], s->low4)) + wide_sum_avx2(s->wide[2 * g]);
        totals[2 * g + 1] = lanes_sum_avx2(_mm256_and_si256(_mm256_srli_epi16(s->nib[g], 4), s->low4)) +
                            wide_sum_avx2(s->wide[2 * g + 1]);
    }
}

AVX2 static void ranks_avx2(const Classes *k, int lo, int nclasses, const unsigned char *base, int64_t start,
                            const int64_t *idx, Py_ssize_t n, unsigned char *cls_out, int64_t *rank_out) {
    if (n == 0) return;
    static const uint64_t zero[CTX_MAX_CLASSES] = {0};
    const int64_t end = idx[n - 1] + 1;
    Counter s;
    counter_init(&s, k, lo, nclasses, zero);
    Py_ssize_t j = 0;
    int64_t i = start;
    for (; i + 64 <= end; i += 64) {
        const unsigned char *p = base + 2 * i;
        const __m256i c0 = class_bytes_avx2(p, s.count, s.emask, s.vlo, s.vtop);
        const __m256i c1 = class_bytes_avx2(p + 64, s.count, s.emask, s.vlo, s.vtop);
        if (idx[j] < i + 64) {
            unsigned char cb[64];
            _mm256_storeu_si256((__m256i *)cb, c0);
            _mm256_storeu_si256((__m256i *)(cb + 32), c1);
            do {
                int c;
                rank_out[j] = (int64_t)counter_rank(&s, c0, c1, cb, (int)(idx[j] - i), &c);
                cls_out[j] = (unsigned char)c;
            } while (++j < n && idx[j] < i + 64);
        }
        counter_add(&s, c0, c1);
    }
    if (j == n) return;
    uint64_t totals[CTX_MAX_CLASSES];
    counter_totals(&s, totals);
    for (; i < end; i++) {
        const int c = k->cls[(load(base + 2 * i, 2) >> k->shift) & k->emask];
        if (i == idx[j]) {
            cls_out[j] = (unsigned char)c;
            rank_out[j++] = (int64_t)totals[c];
        }
        totals[c]++;
    }
}

/* ctx_diff on 2-byte elements: diff_scan's results, each change also ranked. Stops
 * before a block with a change when fewer than 64 outputs are left. */
AVX2 static DiffResult ctx_diff_avx2(const Classes *k, int lo, int nclasses, const unsigned char *a,
                                     const unsigned char *b, Py_ssize_t n, Py_ssize_t pos, Py_ssize_t cap,
                                     uint64_t *totals, int64_t *changed_out, unsigned char *idx_out, unsigned char *was_out,
                                     unsigned char *delta_out, unsigned char *cls_out, int64_t *rank_out) {
    Counter s;
    counter_init(&s, k, lo, nclasses, totals);
    Py_ssize_t count = 0;
    uint64_t fp = 0;
    int64_t i = pos;
    for (; i + 64 <= n; i += 64) {
        const unsigned char *p = a + 2 * i, *q = b + 2 * i;
        __m256i same[4];
        for (int v = 0; v < 4; v++)
            same[v] = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * v)),
                                         _mm256_loadu_si256((const __m256i *)(q + 32 * v)));
        const __m256i c0 = class_bytes_avx2(p, s.count, s.emask, s.vlo, s.vtop);
        const __m256i c1 = class_bytes_avx2(p + 64, s.count, s.emask, s.vlo, s.vtop);
        const __m256i all = _mm256_and_si256(_mm256_and_si256(same[0], same[1]), _mm256_and_si256(same[2], same[3]));
        if (!_mm256_testc_si256(all, _mm256_set1_epi8(-1))) {
            if (cap - count < 64) break;
            /* One bit an element, as class_bytes orders them. */
            const __m256i s01 = _mm256_permute4x64_epi64(_mm256_packs_epi16(same[0], same[1]), 0xD8);
            const __m256i s23 = _mm256_permute4x64_epi64(_mm256_packs_epi16(same[2], same[3]), 0xD8);
            uint64_t changed = ~((uint64_t)(uint32_t)_mm256_movemask_epi8(s01) |
                                 (uint64_t)(uint32_t)_mm256_movemask_epi8(s23) << 32);
            unsigned char cb[64];
            _mm256_storeu_si256((__m256i *)cb, c0);
            _mm256_storeu_si256((__m256i *)(cb + 32), c1);
            for (; changed; changed &= changed - 1) {
                const int off = __builtin_ctzll(changed);
                int c;
                const uint64_t was = load(p + 2 * off, 2);
                rank_out[count] = (int64_t)counter_rank(&s, c0, c1, cb, off, &c);
                cls_out[count] = (unsigned char)c;
                changed_out[(was >> k->shift) & k->emask]++;
                record(2, i + off, 0, was, load(q + 2 * off, 2), count++, idx_out, was_out, delta_out, &fp);
            }
        }
        counter_add(&s, c0, c1);
    }
    counter_totals(&s, totals);
    DiffResult r = {count, i, fp};
    if (i + 64 > n) {
        r = ctx_diff_loop(2, k, a, b, n, i, cap - count, totals, changed_out, idx_out + 8 * count, was_out + 2 * count,
                          delta_out + 2 * count, cls_out + count, rank_out + count);
        r.count += count;
        r.fp += fp;
    }
    return r;
}

/* The decoder's block scan: rem[c] is how many members of class c to pass before its
 * next target (UINT64_MAX once it has none). `found(i, p)` gets each change. */
typedef struct {
    const unsigned char *cls;
    const int64_t *ranks;
    Py_ssize_t next[CTX_MAX_CLASSES], end[CTX_MAX_CLASSES];
    uint64_t rem[CTX_MAX_CLASSES];
    Py_ssize_t left;
} Targets;

static int targets_init(Targets *t, const unsigned char *cls, const int64_t *ranks, Py_ssize_t n, int nclasses) {
    t->cls = cls;
    t->ranks = ranks;
    t->left = n;
    Py_ssize_t j = 0;
    for (int c = 0; c < CTX_MAX_CLASSES; c++) {
        t->next[c] = j;
        int64_t prev = -1;
        while (j < n && cls[j] == c) {
            if (ranks[j] <= prev) return -1;
            prev = ranks[j++];
        }
        t->end[c] = j;
        t->rem[c] = c < nclasses && t->next[c] < t->end[c] ? (uint64_t)ranks[t->next[c]] : UINT64_MAX;
    }
    return j == n ? 0 : -1;
}

/* Within one block's mask of class c: every target the block holds, in order. */
#define TARGETS_IN_BLOCK(t, c, mask, i, ...)                                                  \
    do {                                                                                      \
        uint64_t mm_ = (mask);                                                                \
        uint64_t pc_ = (uint64_t)__builtin_popcountll(mm_);                                   \
        while ((t)->rem[c] < pc_) {                                                           \
            for (uint64_t k_ = (t)->rem[c]; k_; k_--) mm_ &= mm_ - 1;                         \
            const int64_t at_ = (i) + __builtin_ctzll(mm_);                                   \
            const Py_ssize_t p_ = (t)->next[c]++;                                             \
            (t)->left--;                                                                      \
            (t)->rem[c] = (t)->next[c] < (t)->end[c]                                          \
                              ? (uint64_t)((t)->ranks[(t)->next[c]] - (t)->ranks[p_] - 1)     \
                              : UINT64_MAX;                                                   \
            mm_ &= mm_ - 1;                                                                   \
            pc_ = (uint64_t)__builtin_popcountll(mm_);                                        \
            __VA_ARGS__;                                                                      \
        }                                                                                     \
        if ((t)->rem[c] != UINT64_MAX) (t)->rem[c] -= pc_;                                    \
    } while (0)

BLOCK_TARGET static void select_blocks(const Classes *k, int lo, int nclasses, Targets *t, const unsigned char *base,
                                       int64_t start, int64_t stop, const int64_t *ov_idx, const unsigned char *ov_val,
                                       Py_ssize_t ov_n, int64_t *idx_out) {
    const int top = nclasses - 1;
    unsigned char tmp[128];
    Py_ssize_t o = 0;
    while (o < ov_n && ov_idx[o] < start) o++;
    Masks m;
    const MasksFn masks = masks_fn();
    for (int64_t i = start; i < stop && t->left > 0; i += 64) {
        uint64_t valid;
        const unsigned char *p = block_at(base, i, stop, ov_idx, ov_val, ov_n, &o, tmp, &valid);
        masks(k, lo, top, p, valid, &m);
        for (int c = 0; c <= top; c++) TARGETS_IN_BLOCK(t, c, m.m[c], i, idx_out[p_] = at_);
    }
}

BLOCK_TARGET static EntryResult apply_blocks(const Classes *k, int lo, int nclasses, Targets *t, unsigned char *target,
                                             int64_t start, int64_t stop, const unsigned char *delta, int64_t *idx_out,
                                             int64_t *pos_out) {
    const int top = nclasses - 1;
    unsigned char tmp[128];
    Py_ssize_t o = 0, done = 0;
    uint64_t fp = 0;
    Masks m;
    const MasksFn masks = masks_fn();
    for (int64_t i = start; i < stop && t->left > 0; i += 64) {
        uint64_t valid;
        const unsigned char *p = block_at(target, i, stop, NULL, NULL, 0, &o, tmp, &valid);
        masks(k, lo, top, p, valid, &m); /* every class from the bits before any change */
        for (int c = 0; c <= top; c++) {
            TARGETS_IN_BLOCK(t, c, m.m[c], i, {
                unsigned char *q = target + 2 * at_;
                const uint64_t was = load(q, 2), now = (was + load(delta + 2 * p_, 2)) & 0xFFFF;
                store(q, 2, now);
                fp += element_hash((uint64_t)at_, now) - element_hash((uint64_t)at_, was);
                idx_out[done] = at_;
                pos_out[done] = p_;
                done++;
            });
        }
    }
    EntryResult r = {done, fp, t->left == 0};
    return r;
}
#endif

PyDoc_STRVAR(ctx_ranks_doc,
             "ctx_ranks(base, width, shift, ebits, lo, classes, start, indices, classes_out, ranks_out)\n\n"
             "patcher.context.class_ranks: for sorted indices (int64, >= start, < the base's length),\n"
             "each one's class and its rank among the elements of its class in [start, index).");

static PyObject *py_ctx_ranks(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    int width, shift, ebits, nclasses;
    long long lo, start;
    if (!PyArg_ParseTuple(args, "y*iiiLiLy*w*w*", &b[0], &width, &shift, &ebits, &lo, &nclasses, &start, &b[1],
                          &b[2], &b[3])) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    Classes *k = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t numel = items(&b[0], width, "base"), n = items(&b[1], 8, "indices");
    if (numel < 0 || n < 0 || check_len(&b[2], n, 1, "classes_out") < 0 || check_len(&b[3], n, 8, "ranks_out") < 0)
        goto done;
    {
        const int64_t *idx = b[1].buf;
        int64_t prev = start - 1;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (idx[j] <= prev || idx[j] >= numel) {
                PyErr_SetString(PyExc_ValueError, "indices must be increasing, >= start and < the base's length");
                goto done;
            }
            prev = idx[j];
        }
        k = malloc(sizeof(Classes));
        if (k == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (classes_init(k, width, shift, ebits, lo, nclasses) < 0) goto done;
        Py_BEGIN_ALLOW_THREADS;
#ifdef CTX_BLOCKS
        if (blocks_usable(k) && __builtin_cpu_supports("avx2"))
            ranks_avx2(k, (int)lo, nclasses, b[0].buf, start, idx, n, b[2].buf, b[3].buf);
        else if (blocks_usable(k))
            ranks_blocks(k, (int)lo, nclasses, b[0].buf, start, idx, n, b[2].buf, b[3].buf);
        else
#endif
            BY_WIDTH(width, ranks_loop(W, k, b[0].buf, start, idx, n, b[2].buf, b[3].buf));
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
done:
    free(k);
    release(b, 4);
    return result;
}

PyDoc_STRVAR(ctx_diff_doc,
             "ctx_diff(old, new, width, shift, ebits, lo, classes, pos, totals, changed, indices_out,\n"
             "         was_out, delta_out, classes_out, ranks_out) -> (count, next_pos, fingerprint_change)\n\n"
             "diff() that also gives each change its class (of its old bits) and rank among the\n"
             "elements of its class before it (patcher.context_diff). totals (uint64, 16) holds\n"
             "each class's elements in [0, pos) and is updated to [0, next_pos); changed (int64,\n"
             "2**ebits) gains the exponent of each change's old bits.");

static PyObject *py_ctx_diff(PyObject *self, PyObject *args) {
    Py_buffer b[9] = {{0}};
    int width, shift, ebits, nclasses;
    long long lo;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*y*iiiLinw*w*w*w*w*w*w*", &b[0], &b[1], &width, &shift, &ebits, &lo, &nclasses,
                          &pos, &b[2], &b[8], &b[3], &b[4], &b[5], &b[6], &b[7])) {
        release(b, 9);
        return NULL;
    }
    PyObject *result = NULL;
    Classes *k = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], width, "old");
    if (n < 0 || check_len(&b[1], n, width, "new") < 0 || check_len(&b[2], CTX_MAX_CLASSES, 8, "totals") < 0)
        goto done;
    if (pos < 0 || pos > n) {
        PyErr_Format(PyExc_ValueError, "pos %zd outside [0, %zd]", pos, n);
        goto done;
    }
    Py_ssize_t cap = items(&b[3], 8, "indices_out");
    if (cap < 0 || check_len(&b[4], cap, width, "was_out") < 0 || check_len(&b[5], cap, width, "delta_out") < 0 ||
        check_len(&b[6], cap, 1, "classes_out") < 0 || check_len(&b[7], cap, 8, "ranks_out") < 0)
        goto done;
    if (cap < 64) {
        PyErr_Format(PyExc_ValueError, "outputs hold %zd elements, at least 64 needed", cap);
        goto done;
    }
    k = malloc(sizeof(Classes));
    if (k == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (classes_init(k, width, shift, ebits, lo, nclasses) < 0 ||
        check_len(&b[8], (Py_ssize_t)1 << ebits, 8, "changed") < 0)
        goto done;
    {
        uint64_t totals[CTX_MAX_CLASSES];
        int64_t *changed = b[8].buf;
        memcpy(totals, b[2].buf, sizeof(totals));
        const unsigned char *a = b[0].buf, *c = b[1].buf;
        DiffResult r;
        Py_BEGIN_ALLOW_THREADS;
#ifdef CTX_BLOCKS
        if (blocks_usable(k) && __builtin_cpu_supports("avx2"))
            r = ctx_diff_avx2(k, (int)lo, nclasses, a, c, n, pos, cap, totals, changed, b[3].buf, b[4].buf, b[5].buf,
                              b[6].buf, b[7].buf);
        else
#endif
            BY_WIDTH(width, r = ctx_diff_loop(W, k, a, c, n, pos, cap, totals, changed, b[3].buf, b[4].buf, b[5].buf,
                                              b[6].buf, b[7].buf));
        Py_END_ALLOW_THREADS;
        memcpy(b[2].buf, totals, sizeof(totals));
        result = Py_BuildValue("nnK", r.count, r.next, (unsigned long long)r.fp);
    }
done:
    free(k);
    release(b, 9);
    return result;
}

/* The decoder's scan: every element of [start, stop) in turn; each target (class c's
 * next rank) found calls `found`. Lanes hold 0x80 + the members of their class still to
 * skip (at most 127; the rest in `excess`); a lane whose high bit clears has reached its
 * mark. Classes without targets left are removed from the one-hot tables. */
typedef struct {
    Classes k;
    const unsigned char *cls;
    const int64_t *ranks;
    Py_ssize_t next[CTX_MAX_CLASSES + 1], end[CTX_MAX_CLASSES + 1];
    uint64_t excess[CTX_MAX_CLASSES];
    uint64_t lanes[2];
    Py_ssize_t left;
    int bad;
} Select;

static void select_arm(Select *s, int c, uint64_t skip) {
    const uint64_t now = skip < 127 ? skip : 127;
    lane_set(s->lanes, c, (unsigned)(0x80 + now));
    s->excess[c] = skip - now;
}

static void select_drop(Select *s, int c) {
    for (int e = 0; e < (1 << s->k.ebits); e++) {
        if (s->k.cls[e] == c) {
            s->k.oh[0][e] = 0;
            s->k.oh[1][e] = 0;
        }
    }
    lane_set(s->lanes, c, 0xFF);
}

static int select_init(Select *s, const unsigned char *cls, const int64_t *ranks, Py_ssize_t n, int nclasses) {
    s->cls = cls;
    s->ranks = ranks;
    s->left = n;
    s->bad = 0;
    s->lanes[0] = s->lanes[1] = ~0ULL;
    Py_ssize_t j = 0;
    for (int c = 0; c < CTX_MAX_CLASSES; c++) {
        s->next[c] = j;
        int64_t prev = -1;
        while (j < n && cls[j] == c) {
            if (ranks[j] <= prev) return -1;
            prev = ranks[j++];
        }
        s->end[c] = j;
    }
    if (j != n) return -1; /* classes not non-decreasing, or one past the window */
    for (int c = 0; c < CTX_MAX_CLASSES; c++) {
        if (c >= nclasses || s->next[c] == s->end[c])
            select_drop(s, c);
        else
            select_arm(s, c, (uint64_t)ranks[s->next[c]]);
    }
    return 0;
}

/* An element whose lane reached its mark; returns the class-major position of the
 * change it is, or -1 when it only used up skips. The lanes are the caller's locals
 * (so that they stay in registers on the hot path), passed in and out here. */
static Py_ssize_t select_hit(Select *s, int c, uint64_t *lanes) {
    s->lanes[0] = lanes[0];
    s->lanes[1] = lanes[1];
    Py_ssize_t p = -1;
    if (s->excess[c]) {
        select_arm(s, c, s->excess[c] - 1);
    } else {
        p = s->next[c]++;
        s->left--;
        if (s->next[c] < s->end[c])
            select_arm(s, c, (uint64_t)(s->ranks[s->next[c]] - s->ranks[p] - 1));
        else
            select_drop(s, c);
    }
    lanes[0] = s->lanes[0];
    lanes[1] = s->lanes[1];
    return p;
}

/* One element of a scan, its bits `x`; the statement after runs for a change (at p_). */
#define SELECT_STEP(x, ...)                                           \
    do {                                                              \
        const uint64_t e_ = ((x) >> shift) & emask;                   \
        l0 -= oh0[e_];                                                \
        l1 -= oh1[e_];                                                \
        if ((l0 & l1 & LANE_HIGH) != LANE_HIGH) {                     \
            uint64_t lanes_[2] = {l0, l1};                            \
            const Py_ssize_t p_ = select_hit(s, s->k.cls[e_], lanes_); \
            l0 = lanes_[0];                                           \
            l1 = lanes_[1];                                           \
            if (p_ >= 0) {                                            \
                __VA_ARGS__;                                          \
            }                                                         \
        }                                                             \
    } while (0)

/* The scan's state in locals: the compiler cannot keep what a pointer reaches in
 * registers across the stores of the loop. */
#define SELECT_LOCALS                                \
    const int shift = s->k.shift;                    \
    const uint64_t emask = s->k.emask;               \
    const uint64_t *oh0 = s->k.oh[0], *oh1 = s->k.oh[1]; \
    uint64_t l0 = s->lanes[0], l1 = s->lanes[1]

HOT void select_loop(int W, Select *s, const unsigned char *base, int64_t start, int64_t stop, const int64_t *ov_idx,
                     const unsigned char *ov_val, Py_ssize_t ov_n, int64_t *idx_out) {
    SELECT_LOCALS;
    Py_ssize_t o = 0;
    int64_t i = start;
    while (o < ov_n && ov_idx[o] < start) o++;
    while (i < stop && s->left > 0) {
        const int64_t run_end = o < ov_n && ov_idx[o] < stop ? ov_idx[o] : stop;
        for (; i < run_end; i++) {
            SELECT_STEP(load(base + i * W, W), idx_out[p_] = i; if (s->left == 0) return);
        }
        if (i == run_end && run_end < stop) {
            SELECT_STEP(load(ov_val + o * W, W), idx_out[p_] = i; if (s->left == 0) return);
            i++;
            o++;
        }
    }
}

HOT EntryResult select_apply_loop(int W, Select *s, unsigned char *t, int64_t start, int64_t stop,
                                  const unsigned char *delta, int64_t *idx_out, int64_t *pos_out) {
    SELECT_LOCALS;
    const uint64_t mask = width_mask(W);
    uint64_t fp = 0;
    Py_ssize_t done = 0;
    if (s->left > 0) {
        for (int64_t i = start; i < stop; i++) {
            unsigned char *p = t + i * W;
            const uint64_t was = load(p, W);
            SELECT_STEP(was, const uint64_t now = (was + load(delta + p_ * W, W)) & mask; store(p, W, now);
                        fp += element_hash((uint64_t)i, now) - element_hash((uint64_t)i, was); idx_out[done] = i;
                        pos_out[done] = p_; done++; if (s->left == 0) goto finished);
        }
    }
finished:;
    EntryResult r = {done, fp, s->left == 0};
    return r;
}

static Select *select_new(int width, int shift, int ebits, long long lo, int nclasses, const Py_buffer *cls,
                          const Py_buffer *ranks, Py_ssize_t *n) {
    *n = items(ranks, 8, "ranks");
    if (*n < 0 || check_len(cls, *n, 1, "classes") < 0) return NULL;
    Select *s = malloc(sizeof(Select));
    if (s == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (classes_init(&s->k, width, shift, ebits, lo, nclasses) < 0) {
        free(s);
        return NULL;
    }
    if (select_init(s, cls->buf, ranks->buf, *n, nclasses) < 0) {
        PyErr_SetString(PyExc_ValueError, "classes must be non-decreasing and in the window, ranks increasing in each");
        free(s);
        return NULL;
    }
    return s;
}

PyDoc_STRVAR(ctx_select_doc,
             "ctx_select(base, width, shift, ebits, lo, classes, start, stop, cls, ranks, overlay_idx,\n"
             "           overlay_val, idx_out) -> bool\n\n"
             "patcher.context.select_ranks: the index of each (class, rank) pair (class-major) into\n"
             "idx_out, reading the base through the overlay (sorted int64 indices and their bits).\n"
             "False if a rank is not below its class's count in [start, stop).");

static PyObject *py_ctx_select(PyObject *self, PyObject *args) {
    Py_buffer b[6] = {{0}};
    int width, shift, ebits, nclasses;
    long long lo, start, stop;
    if (!PyArg_ParseTuple(args, "y*iiiLiLLy*y*y*y*w*", &b[0], &width, &shift, &ebits, &lo, &nclasses, &start, &stop,
                          &b[1], &b[2], &b[3], &b[4], &b[5])) {
        release(b, 6);
        return NULL;
    }
    PyObject *result = NULL;
    Select *s = NULL;
    Py_ssize_t n, numel, ov_n;
    if (check_width(width) < 0 || (numel = items(&b[0], width, "base")) < 0) goto done;
    if (start < 0 || stop < start || stop > numel) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= start <= stop <= the base's length");
        goto done;
    }
    if ((ov_n = items(&b[3], 8, "overlay_idx")) < 0 || check_len(&b[4], ov_n, width, "overlay_val") < 0) goto done;
    for (Py_ssize_t o = 1; o < ov_n; o++) {
        if (((const int64_t *)b[3].buf)[o] <= ((const int64_t *)b[3].buf)[o - 1]) {
            PyErr_SetString(PyExc_ValueError, "overlay indices must be increasing");
            goto done;
        }
    }
    if ((s = select_new(width, shift, ebits, lo, nclasses, &b[1], &b[2], &n)) == NULL) goto done;
    if (check_len(&b[5], n, 8, "idx_out") < 0) goto done;
    {
        Py_ssize_t left;
#ifdef CTX_BLOCKS
        Targets t;
        if (blocks_usable(&s->k) && targets_init(&t, b[1].buf, b[2].buf, n, nclasses) == 0) {
            Py_BEGIN_ALLOW_THREADS;
            select_blocks(&s->k, (int)lo, nclasses, &t, b[0].buf, start, stop, b[3].buf, b[4].buf, ov_n, b[5].buf);
            Py_END_ALLOW_THREADS;
            left = t.left;
        } else
#endif
        {
            Py_BEGIN_ALLOW_THREADS;
            BY_WIDTH(width, select_loop(W, s, b[0].buf, start, stop, b[3].buf, b[4].buf, ov_n, b[5].buf));
            Py_END_ALLOW_THREADS;
            left = s->left;
        }
        result = Py_NewRef(left == 0 ? Py_True : Py_False);
    }
done:
    free(s);
    release(b, 6);
    return result;
}

PyDoc_STRVAR(ctx_apply_doc,
             "ctx_apply(target, width, shift, ebits, lo, classes, start, stop, cls, ranks, delta, idx_out,\n"
             "          pos_out) -> (done, fingerprint_change, ok)\n\n"
             "One pass over target[start:stop]: resolve each (class, rank) pair as ctx_select does,\n"
             "reading each element's class before it changes, and add the pair's delta there. The\n"
             "changes applied go to idx_out / pos_out (index, class-major position) in index order,\n"
             "so a caller can undo them; ok is False if some rank was never reached.");

static PyObject *py_ctx_apply(PyObject *self, PyObject *args) {
    Py_buffer b[6] = {{0}};
    int width, shift, ebits, nclasses;
    long long lo, start, stop;
    if (!PyArg_ParseTuple(args, "w*iiiLiLLy*y*y*w*w*", &b[0], &width, &shift, &ebits, &lo, &nclasses, &start,
                          &stop, &b[1], &b[2], &b[3], &b[4], &b[5])) {
        release(b, 6);
        return NULL;
    }
    PyObject *result = NULL;
    Select *s = NULL;
    Py_ssize_t n, numel;
    if (check_width(width) < 0 || (numel = items(&b[0], width, "target")) < 0) goto done;
    if (start < 0 || stop < start || stop > numel) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= start <= stop <= the target's length");
        goto done;
    }
    if ((s = select_new(width, shift, ebits, lo, nclasses, &b[1], &b[2], &n)) == NULL) goto done;
    if (check_len(&b[3], n, width, "delta") < 0 || check_len(&b[4], n, 8, "idx_out") < 0 ||
        check_len(&b[5], n, 8, "pos_out") < 0)
        goto done;
    {
        EntryResult r;
#ifdef CTX_BLOCKS
        Targets t;
        if (blocks_usable(&s->k) && targets_init(&t, b[1].buf, b[2].buf, n, nclasses) == 0) {
            Py_BEGIN_ALLOW_THREADS;
            r = apply_blocks(&s->k, (int)lo, nclasses, &t, b[0].buf, start, stop, b[3].buf, b[4].buf, b[5].buf);
            Py_END_ALLOW_THREADS;
        } else
#endif
        {
            Py_BEGIN_ALLOW_THREADS;
            BY_WIDTH(width, r = select_apply_loop(W, s, b[0].buf, start, stop, b[3].buf, b[4].buf, b[5].buf));
            Py_END_ALLOW_THREADS;
        }
        result = Py_BuildValue("nKO", r.done, (unsigned long long)r.fp, r.ok ? Py_True : Py_False);
    }
done:
    free(s);
    release(b, 6);
    return result;
}

/* The sample of base[start:stop] that choose_window reads: the first `run` elements of
 * every `stride`. Adds each one's exponent to counts, and where `now` is given, that of
 * each one whose bits differ in `now` to changed. The runs are `stride` apart, which no
 * hardware prefetcher follows: the reads are asked for well ahead, so they overlap
 * instead of each waiting on memory. Elements go to four histograms in turn (`sub`,
 * 4 x 2**ebits zeroed counts), so that runs of equal exponents, the common case, do not
 * each wait on the previous increment; they are summed at the end. One copy per width. */
HOT void sample_counts(int W, const unsigned char *base, const unsigned char *now, int shift, uint64_t emask,
                       int64_t start, int64_t stop, int64_t step, int64_t run, int64_t *counts, int64_t *changed,
                       int64_t *sub) {
    const int64_t ahead = 16 * step, size = (int64_t)emask + 1;
    int64_t *const l0 = sub, *const l1 = sub + size, *const l2 = sub + 2 * size, *const l3 = sub + 3 * size;
    for (int64_t i = start; i < stop; i += step) {
        if (i + ahead < stop) {
            for (int64_t off = 0; off < run * W; off += 64) {
                __builtin_prefetch(base + (i + ahead) * W + off);
                if (now != NULL) __builtin_prefetch(now + (i + ahead) * W + off);
            }
        }
        const int64_t end = stop - i < run ? stop : i + run;
        int64_t j = i;
        for (; j + 4 <= end; j += 4) {
            const unsigned char *p = base + j * W;
            const uint64_t w0 = load(p, W), w1 = load(p + W, W), w2 = load(p + 2 * W, W), w3 = load(p + 3 * W, W);
            l0[(w0 >> shift) & emask]++;
            l1[(w1 >> shift) & emask]++;
            l2[(w2 >> shift) & emask]++;
            l3[(w3 >> shift) & emask]++;
            if (now != NULL) {
                /* A branch, not adds of 0 or 1: changes are rare, and each add would wait on
                 * the last one to the same count. */
                const unsigned char *q = now + j * W;
                if (w0 != load(q, W)) changed[(w0 >> shift) & emask]++;
                if (w1 != load(q + W, W)) changed[(w1 >> shift) & emask]++;
                if (w2 != load(q + 2 * W, W)) changed[(w2 >> shift) & emask]++;
                if (w3 != load(q + 3 * W, W)) changed[(w3 >> shift) & emask]++;
            }
        }
        for (; j < end; j++) {
            const uint64_t was = load(base + j * W, W);
            l0[(was >> shift) & emask]++;
            if (now != NULL && was != load(now + j * W, W)) changed[(was >> shift) & emask]++;
        }
    }
    for (int64_t e = 0; e < size; e++) counts[e] += l0[e] + l1[e] + l2[e] + l3[e];
}

/* sample_counts with its scratch, the GIL released while it runs: -1 (MemoryError set)
 * when the scratch cannot be had. */
static int sample(const unsigned char *base, const unsigned char *now, int width, int shift, int ebits, int64_t start,
                  int64_t stop, int64_t step, int64_t run, int64_t *counts, int64_t *changed) {
    int64_t *sub = calloc(4 * ((size_t)1 << ebits), sizeof(int64_t));
    if (sub == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const uint64_t emask = (1ULL << ebits) - 1;
    Py_BEGIN_ALLOW_THREADS;
    BY_WIDTH(width, sample_counts(W, base, now, shift, emask, start, stop, step, run, counts, changed, sub));
    Py_END_ALLOW_THREADS;
    free(sub);
    return 0;
}

/* The arguments both histograms check: a sample of [start, stop) and 2**ebits counts. */
static int sample_args_ok(Py_ssize_t numel, int width, int shift, int ebits, long long start, long long stop,
                          long long step, long long run, const Py_buffer *counts, const Py_buffer *changed) {
    if (ebits < 1 || ebits > 11 || shift < 0 || shift + ebits > 8 * width || start < 0 || stop < start ||
        stop > numel || step < 1 || run < 1 || run > step || check_len(counts, 1 << ebits, 8, "counts_out") < 0 ||
        check_len(changed, 1 << ebits, 8, "changed_out") < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "histogram arguments out of range");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(ctx_histogram_doc,
             "ctx_histogram(base, width, shift, ebits, start, stop, stride, run, counts_out, indices,\n"
             "              changed_out)\n\n"
             "patcher.context.choose_window's histograms: add to counts_out (int64, 2**ebits) the\n"
             "exponent of the first `run` elements of every `stride` of base[start:stop] (its sample),\n"
             "and to changed_out (the same) that of base[i] for every i of indices (int64, in range).");

static PyObject *py_ctx_histogram(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    int width, shift, ebits;
    long long start, stop, step, run;
    if (!PyArg_ParseTuple(args, "y*iiiLLLLw*y*w*", &b[0], &width, &shift, &ebits, &start, &stop, &step, &run, &b[1],
                          &b[2], &b[3])) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t numel, n;
    if (check_width(width) < 0 || (numel = items(&b[0], width, "base")) < 0 || (n = items(&b[2], 8, "indices")) < 0)
        goto done;
    if (!sample_args_ok(numel, width, shift, ebits, start, stop, step, run, &b[1], &b[3])) goto done;
    {
        const unsigned char *base = b[0].buf;
        const int64_t *idx = b[2].buf;
        int64_t *counts = b[1].buf, *changed = b[3].buf;
        const uint64_t emask = (1ULL << ebits) - 1;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (idx[j] < 0 || idx[j] >= numel) {
                PyErr_SetString(PyExc_ValueError, "indices must be within the base");
                goto done;
            }
        }
        if (sample(base, NULL, width, shift, ebits, start, stop, step, run, counts, NULL) < 0) goto done;
        Py_BEGIN_ALLOW_THREADS;
        /* Changes are hundreds of elements apart: ask for their reads ahead. */
        enum { AHEAD = 32 };
        for (Py_ssize_t j = 0; j < n; j++) {
            if (j + AHEAD < n) __builtin_prefetch(base + idx[j + AHEAD] * width);
            changed[(load(base + idx[j] * width, width) >> shift) & emask]++;
        }
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
done:
    release(b, 4);
    return result;
}

/* -- ctx_window: choose_window's pick from two exponent histograms (patcher.context.window_of) -- */

/* n * h(k / n) in bits; 0 where no element, or none or every one, changed. */
static double bernoulli_bits(double n, double k) {
    if (!(k > 0.0) || !(k < n)) return 0.0;
    const double p = k / n;
    return -(k * log2(p) + (n - k) * log2(1.0 - p));
}

PyDoc_STRVAR(ctx_window_doc, "ctx_window(sampled, changed, scale) -> (lo, classes)\n\n"
                             "window_of on int64 histograms of one length (<= 2048), in the same\n"
                             "operations and order; the changes' histogram is not all zeros.");

static PyObject *py_ctx_window(PyObject *self, PyObject *args) {
    Py_buffer b[2] = {{0}};
    long long scale;
    if (!PyArg_ParseTuple(args, "y*y*L", &b[0], &b[1], &scale)) {
        release(b, 2);
        return NULL;
    }
    PyObject *result = NULL;
    enum { MOST = 2048 }; /* 2**11: the widest exponent (F64) */
    double nk[2][MOST + 1], each[MOST + 1];
    Py_ssize_t len = items(&b[0], 8, "sampled");
    if (len < 0 || check_len(&b[1], len, 8, "changed") < 0) goto done;
    if (len > MOST || scale < 1) {
        PyErr_SetString(PyExc_ValueError, "histograms of at most 2048 counts, and a scale >= 1");
        goto done;
    }
    {
        const int64_t *sampled = b[0].buf, *changed = b[1].buf;
        Py_ssize_t e_min = -1, e_max = -1;
        for (Py_ssize_t e = 0; e < len; e++) {
            if (sampled[e] < 0 || changed[e] < 0 || sampled[e] > INT64_MAX / scale) {
                PyErr_SetString(PyExc_ValueError, "counts must be >= 0 and small enough to scale");
                goto done;
            }
            if (sampled[e] * scale > 0 || changed[e] > 0) {
                if (e_min < 0) e_min = e;
                e_max = e;
            }
        }
        if (e_min < 0) {
            PyErr_SetString(PyExc_ValueError, "the histograms are empty");
            goto done;
        }
        if (e_max - e_min < CTX_MAX_CLASSES) {
            result = Py_BuildValue("(nn)", e_min, e_max - e_min + 1);
            goto done;
        }
        const Py_ssize_t span = e_max - e_min + 1, rows = span - CTX_MAX_CLASSES + 1;
        nk[0][0] = nk[1][0] = each[0] = 0.0;
        for (Py_ssize_t j = 0; j < span; j++) {  /* running sums, in numpy.cumsum's order */
            const int64_t m = sampled[e_min + j] * scale, c = changed[e_min + j];
            const double n = (double)(m > c ? m : c), k = (double)c;
            nk[0][j + 1] = nk[0][j] + n;
            nk[1][j + 1] = nk[1][j] + k;
            each[j + 1] = each[j] + bernoulli_bits(n, k);
        }
        double best = 0.0;
        double bits[MOST];
        for (Py_ssize_t r = 0; r < rows; r++) {
            const Py_ssize_t top = r + CTX_MAX_CLASSES - 1;
            bits[r] = bernoulli_bits(nk[0][r + 1], nk[1][r + 1]) + (each[top] - each[r + 1]) +
                      bernoulli_bits(nk[0][span] - nk[0][top], nk[1][span] - nk[1][top]);
            if (r == 0 || bits[r] < best) best = bits[r];
        }
        const double limit = best + best * WINDOW_TIE + WINDOW_TIE;
        Py_ssize_t r = 0;
        while (bits[r] > limit) r++;
        result = Py_BuildValue("(nn)", e_min + r, (Py_ssize_t)CTX_MAX_CLASSES);
    }
done:
    release(b, 2);
    return result;
}

PyDoc_STRVAR(ctx_sample_doc,
             "ctx_sample(base, new, width, shift, ebits, start, stop, stride, run, counts_out, changed_out)\n\n"
             "ctx_histogram's sample of base[start:stop] into counts_out, and the exponents of the\n"
             "sampled elements whose bits differ in new (same length) into changed_out.");

static PyObject *py_ctx_sample(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}};
    int width, shift, ebits;
    long long start, stop, step, run;
    if (!PyArg_ParseTuple(args, "y*y*iiiLLLLw*w*", &b[0], &b[1], &width, &shift, &ebits, &start, &stop, &step, &run,
                          &b[2], &b[3])) {
        release(b, 4);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t numel;
    if (check_width(width) < 0 || (numel = items(&b[0], width, "base")) < 0 || check_len(&b[1], numel, width, "new") < 0)
        goto done;
    if (!sample_args_ok(numel, width, shift, ebits, start, stop, step, run, &b[2], &b[3]) ||
        sample(b[0].buf, b[1].buf, width, shift, ebits, start, stop, step, run, b[2].buf, b[3].buf) < 0)
        goto done;
    result = Py_NewRef(Py_None);
done:
    release(b, 4);
    return result;
}

/* -- module ---------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"diff", py_diff, METH_VARARGS, diff_doc},
    {"fingerprint", py_fingerprint, METH_VARARGS, fingerprint_doc},
    {"fingerprint_change", py_fingerprint_change, METH_VARARGS, fingerprint_change_doc},
    {"scatter_add", py_scatter_add, METH_VARARGS, scatter_add_doc},
    {"scatter", py_scatter, METH_VARARGS, scatter_doc},
    {"check_changes", py_check_changes, METH_VARARGS, check_changes_doc},
    {"cast", py_cast, METH_VARARGS, cast_doc},
    {"cast_diff", py_cast_diff, METH_VARARGS, cast_diff_doc},
    {"decode_gaps", py_decode_gaps, METH_VARARGS, decode_gaps_doc},
    {"decode_deltas", py_decode_deltas, METH_VARARGS, decode_deltas_doc},
    {"apply_entry", py_apply_entry, METH_VARARGS, apply_entry_doc},
    {"encode_gaps", py_encode_gaps, METH_VARARGS, encode_gaps_doc},
    {"encode_deltas", py_encode_deltas, METH_VARARGS, encode_deltas_doc},
    {"ctx_encode", py_ctx_encode, METH_VARARGS, ctx_encode_doc},
    {"ctx_decode", py_ctx_decode, METH_VARARGS, ctx_decode_doc},
    {"ctx_ranks", py_ctx_ranks, METH_VARARGS, ctx_ranks_doc},
    {"ctx_select", py_ctx_select, METH_VARARGS, ctx_select_doc},
    {"ctx_apply", py_ctx_apply, METH_VARARGS, ctx_apply_doc},
    {"ctx_histogram", py_ctx_histogram, METH_VARARGS, ctx_histogram_doc},
    {"ctx_diff", py_ctx_diff, METH_VARARGS, ctx_diff_doc},
    {"ctx_sample", py_ctx_sample, METH_VARARGS, ctx_sample_doc},
    {"ctx_window", py_ctx_window, METH_VARARGS, ctx_window_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "patcher._speedups", "Compiled hot loops of the CPU codec (patcher/native.py).", 0, methods,
    slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModuleDef_Init(&module); }
