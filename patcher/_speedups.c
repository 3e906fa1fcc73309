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

#include <stdint.h>
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

/* One change found by the diff: recorded at position `count` of the outputs. */
HOT void record(int width, Py_ssize_t index, uint64_t was, uint64_t now, Py_ssize_t count, unsigned char *idx_out,
                unsigned char *was_out, unsigned char *delta_out, uint64_t *fp) {
    int64_t i = (int64_t)index;
    memcpy(idx_out + count * 8, &i, 8);
    store(was_out + count * width, width, was);
    store(delta_out + count * width, width, (now - was) & width_mask(width));
    *fp += element_hash((uint64_t)index, now) - element_hash((uint64_t)index, was);
}

typedef struct {
    Py_ssize_t count, next;
    uint64_t fp;
} DiffResult;

HOT DiffResult diff_scan(int width, const unsigned char *a, const unsigned char *c, Py_ssize_t n, Py_ssize_t pos,
                         Py_ssize_t cap, unsigned char *idx_out, unsigned char *was_out, unsigned char *delta_out) {
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
                record(width, i + (w + (shift >> 3)) / width, (x >> shift) & mask, (y >> shift) & mask, count++, idx_out,
                       was_out, delta_out, &fp);
            }
        }
#else
        for (Py_ssize_t k = 0; k < per_block; k++) {
            uint64_t was = load(pa + k * width, width), now = load(pc + k * width, width);
            if (was != now) record(width, i + k, was, now, count++, idx_out, was_out, delta_out, &fp);
        }
#endif
    }
    /* The tail, shorter than a block (the outputs hold at least a block). */
    if (i + per_block > n && cap - count >= n - i) {
        for (; i < n; i++) {
            uint64_t was = load(a + i * width, width), now = load(c + i * width, width);
            if (was != now) record(width, i, was, now, count++, idx_out, was_out, delta_out, &fp);
        }
    }
    DiffResult r = {count, i, fp};
    return r;
}

PyDoc_STRVAR(diff_doc,
             "diff(old, new, width, pos, indices_out, was_out, delta_out) -> (count, next_pos, fingerprint_change)\n\n"
             "Scan elements pos.. of two equal-length bit buffers; write each changed element's index\n"
             "(int64), old bits and (new - old) mod 2**bits to the outputs, in order, until the end or\n"
             "until the outputs could not hold another block's changes. Returns how many were written,\n"
             "where the scan stopped (the buffer's length at the end), and the fingerprint change\n"
             "sum(H(i, new) - H(i, old)) mod 2**64 of the changes written. Outputs need room for at\n"
             "least 64 elements.");

static PyObject *py_diff(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}};
    int width;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*y*inw*w*w*", &b[0], &b[1], &width, &pos, &b[2], &b[3], &b[4])) {
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
        BY_WIDTH(width, r = diff_scan(W, a, c, n, pos, cap, io, wo, d));
        Py_END_ALLOW_THREADS;
        result = Py_BuildValue("nnK", r.count, r.next, (unsigned long long)r.fp);
    }
done:
    release(b, 5);
    return result;
}

/* -- fingerprints ---------------------------------------------------------------------- */

PyDoc_STRVAR(fingerprint_doc,
             "fingerprint(bits, width, first_index) -> int\n\n"
             "sum(H(first_index + k, bits[k])) mod 2**64 over the buffer's elements.");

static PyObject *py_fingerprint(PyObject *self, PyObject *args) {
    Py_buffer b[1] = {{0}};
    int width;
    unsigned long long first;
    if (!PyArg_ParseTuple(args, "y*iK", &b[0], &width, &first)) {
        release(b, 1);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    Py_ssize_t n = items(&b[0], width, "bits");
    if (n < 0) goto done;
    {
        const unsigned char *p = b[0].buf;
        /* Four independent sums: the multiplies of neighbouring elements overlap. */
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, index = first;
        Py_ssize_t k = 0;
        Py_BEGIN_ALLOW_THREADS;
        for (; k + 4 <= n; k += 4, index += 4) {
            s0 += element_hash(index, load(p + k * width, width));
            s1 += element_hash(index + 1, load(p + (k + 1) * width, width));
            s2 += element_hash(index + 2, load(p + (k + 2) * width, width));
            s3 += element_hash(index + 3, load(p + (k + 3) * width, width));
        }
        for (; k < n; k++, index++) s0 += element_hash(index, load(p + k * width, width));
        Py_END_ALLOW_THREADS;
        result = PyLong_FromUnsignedLongLong(s0 + s1 + s2 + s3);
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

/* -- module ---------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"diff", py_diff, METH_VARARGS, diff_doc},
    {"fingerprint", py_fingerprint, METH_VARARGS, fingerprint_doc},
    {"fingerprint_change", py_fingerprint_change, METH_VARARGS, fingerprint_change_doc},
    {"scatter_add", py_scatter_add, METH_VARARGS, scatter_add_doc},
    {"scatter", py_scatter, METH_VARARGS, scatter_doc},
    {"check_changes", py_check_changes, METH_VARARGS, check_changes_doc},
    {"decode_gaps", py_decode_gaps, METH_VARARGS, decode_gaps_doc},
    {"decode_deltas", py_decode_deltas, METH_VARARGS, decode_deltas_doc},
    {"apply_entry", py_apply_entry, METH_VARARGS, apply_entry_doc},
    {"encode_gaps", py_encode_gaps, METH_VARARGS, encode_gaps_doc},
    {"encode_deltas", py_encode_deltas, METH_VARARGS, encode_deltas_doc},
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
