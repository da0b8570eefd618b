/* Compiled fast path of `probe`: the common case of headers.read_header + probe.probe_file.
 *
 * Python's per-file cost is well above the open+read+close floor; this does the same work in C
 * for baseline/progressive JPEG and PNG (reading past the first 4 KiB exactly as Python does), with
 * the GIL released so threads scale across cores. Anything else (other formats, errors, warnings,
 * headers that need more reads, names that are not UTF-8) comes back as None and Python's
 * reference parser handles it. The rules below mirror shardkit/core/headers.py and
 * shardkit/packing/probe.py line for line; the tests compare both on every fixture and on fuzzed
 * bytes.
 *
 * Every read is bounds-checked against the bytes actually in hand: the input is untrusted.
 */
#define _GNU_SOURCE /* memrchr, O_PATH */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEAD_BYTES 4096
#define EXIF_READ 65536
#define TAIL_BYTES 32
#define MAX_HEADER_SCAN (16 * 1024 * 1024) /* headers.MAX_HEADER_SCAN */

enum { FMT_JPEG = 1, FMT_PNG = 2 };
enum { MODE_L, MODE_RGB, MODE_CMYK, MODE_1, MODE_I16, MODE_P, MODE_LA, MODE_RGBA, MODE_COUNT };
static const char *MODE_NAMES[MODE_COUNT] = {"L", "RGB", "CMYK", "1", "I;16", "P", "LA", "RGBA"};

typedef struct {
    int ok; /* 0: fall back to Python */
    int format;
    int64_t size;
    uint64_t head_hash; /* headers.head_hash of the first HEAD_BYTES */
    uint64_t identity;  /* headers.file_identity: the file itself, whatever name reached it */
    uint32_t width, height;
    int mode, bits, progressive, orientation;
} Result;

static uint32_t be16(const unsigned char *p) { return ((uint32_t)p[0] << 8) | p[1]; }
static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* headers._exif_orientation: orientation tag of IFD0, or 0 when absent or invalid. */
static int exif_orientation(const unsigned char *t, int64_t len) {
    if (len < 8) return 0;
    int little;
    if (t[0] == 'I' && t[1] == 'I') little = 1;
    else if (t[0] == 'M' && t[1] == 'M') little = 0;
    else return 0;
#define U16(p) (little ? (uint32_t)((p)[0] | ((p)[1] << 8)) : be16(p))
    int64_t ifd = little ? ((int64_t)t[4] | ((int64_t)t[5] << 8) | ((int64_t)t[6] << 16) | ((int64_t)t[7] << 24))
                         : (int64_t)be32(t + 4);
    if (ifd + 2 > len) return 0;
    int64_t count = U16(t + ifd);
    int64_t entry = ifd + 2;
    int64_t end = entry + 12 * count;
    if (end > len - 11) end = len - 11;
    for (; entry < end; entry += 12) {
        if (U16(t + entry) == 0x0112) {
            uint32_t value = U16(t + entry + 8);
            return (value >= 1 && value <= 8) ? (int)value : 0;
        }
    }
#undef U16
    return 0;
}

/* headers.head_hash: a 64-bit hash of the file's first bytes, to find files that may be copies of
 * each other without reading them whole (a match is only a candidate: probe confirms it with a
 * sha256 of both files). Each 8-byte word is mixed on its own, so the loop has no chain of
 * multiplies; numpy computes the same in Python's twin. */
#define HASH_STEP 0x9E3779B97F4A7C15ULL
#define HASH_MIX 0xBF58476D1CE4E5B9ULL
#define HASH_FINAL 0x94D049BB133111EBULL
static uint64_t le64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8); /* one load: a loop of byte shifts stays a loop at -O2, several times slower */
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}
static uint64_t hash_word(uint64_t w, int64_t i) {
    w += (uint64_t)i * HASH_STEP;
    w ^= w >> 32;
    return w * HASH_MIX;
}
static uint64_t head_hash(const unsigned char *p, int64_t n) {
    uint64_t sum = (uint64_t)n * HASH_STEP;
    int64_t full = n / 8;
    for (int64_t i = 0; i < full; i++) sum += hash_word(le64(p + 8 * i), i);
    if (n % 8) { /* the last, partial word, zero-padded */
        unsigned char last[8] = {0};
        memcpy(last, p + 8 * full, (size_t)(n % 8));
        sum += hash_word(le64(last), full);
    }
    sum ^= sum >> 29;
    sum *= HASH_FINAL;
    return sum ^ (sum >> 32);
}

static int contains(const unsigned char *hay, int64_t n, const char *needle, int64_t m) {
    for (int64_t i = 0; i + m <= n; i++)
        if (memcmp(hay + i, needle, (size_t)m) == 0) return 1;
    return 0;
}

/* A file being scanned: its first bytes in hand, and the descriptor to read more. */
typedef struct {
    int fd;
    const unsigned char *head;
    int64_t head_len, size;
    int whole; /* the head is the whole file: Python's fetch slices it, never reads */
} Source;

/* headers.read_header's fetch(offset, n): up to n bytes at offset. Points into the head when
 * they are there (or the whole file is), else reads them into `out` (n bytes of room). */
static int64_t fetch(const Source *src, int64_t offset, int64_t n, unsigned char *out, const unsigned char **data) {
    if (src->whole || offset + n <= src->head_len) {
        int64_t start = offset < src->head_len ? offset : src->head_len;
        int64_t end = offset + n < src->head_len ? offset + n : src->head_len;
        *data = src->head + start;
        return end - start;
    }
    ssize_t got = pread(src->fd, out, (size_t)n, (off_t)offset);
    *data = out;
    return got < 0 ? -1 : got;
}

/* headers._ends_with: the end marker within the last 32 bytes. */
static int ends_with(const Source *src, const char *marker, int64_t m) {
    unsigned char tail[TAIL_BYTES];
    const unsigned char *data;
    int64_t got = fetch(src, src->size > TAIL_BYTES ? src->size - TAIL_BYTES : 0, TAIL_BYTES, tail, &data);
    return got > 0 && contains(data, got, marker, m);
}

static int is_sof(int m) { return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC; }

static void parse_jpeg(const Source *src, Result *r, unsigned char *window, unsigned char *segment) {
    const unsigned char *buf = src->head; /* holds file bytes [base, limit) */
    int64_t base = 0, limit = src->head_len, pos = 2;
    int orientation = 0;
    for (;;) {
        if (pos + 4 > limit) {
            if (pos >= MAX_HEADER_SCAN) return;
            int64_t got = fetch(src, pos, HEAD_BYTES, window, &buf);
            base = pos, limit = pos + (got > 0 ? got : 0);
            if (got < 4) return;
        }
        int64_t i = pos - base;
        if (buf[i] != 0xFF) {
            const unsigned char *found = memchr(buf + i, 0xFF, (size_t)(limit - pos));
            pos = found ? base + (int64_t)(found - buf) : limit;
            continue;
        }
        int marker = buf[i + 1];
        if (marker == 0xFF) { pos += 1; continue; }
        if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) { pos += 2; continue; }
        if (marker == 0xDA || marker == 0xD9) return;
        int64_t length = be16(buf + i + 2);
        if (length < 2) return;
        if (is_sof(marker)) {
            if (i + 10 > limit - base) {
                int64_t got = fetch(src, pos, 16, window, &buf);
                if (got < 10) return;
                i = 0;
            }
            int components = buf[i + 9];
            r->bits = buf[i + 4];
            r->height = be16(buf + i + 5);
            r->width = be16(buf + i + 7);
            if (r->width == 0 || r->height == 0) return;
            if (components == 1) r->mode = MODE_L;
            else if (components == 3) r->mode = MODE_RGB;
            else if (components == 4) r->mode = MODE_CMYK;
            else return;
            r->progressive = marker == 0xC2 || marker == 0xC6 || marker == 0xCA || marker == 0xCE;
            r->orientation = orientation ? orientation : 1;
            if (!ends_with(src, "\xff\xd9", 2)) return; /* a warning: Python reports it */
            r->format = FMT_JPEG;
            r->ok = 1;
            return;
        }
        if (marker == 0xE1 && !orientation) {
            /* headers._segment: from the window when it holds the payload, else from the file */
            int64_t n = length - 2 < EXIF_READ ? length - 2 : EXIF_READ;
            const unsigned char *seg = buf + i + 4;
            if (i + 4 + n > limit - base) {
                n = fetch(src, pos + 4, n, segment, &seg);
                if (n < 0) return;
            }
            if (n >= 6 && memcmp(seg, "Exif\0\0", 6) == 0) {
                orientation = exif_orientation(seg + 6, n - 6);
            } else if (n >= 29 && memcmp(seg, "http://ns.adobe.com/xap/1.0/\0", 29) == 0) {
                return; /* XMP orientation: Python's regex handles it */
            }
        }
        pos += 2 + length;
    }
}

static int png_mode(int color_type, int bits) {
    switch (color_type) {
    case 0:
        return bits == 1 ? MODE_1 : (bits == 2 || bits == 4 || bits == 8) ? MODE_L : bits == 16 ? MODE_I16 : -1;
    case 2: return (bits == 8 || bits == 16) ? MODE_RGB : -1;
    case 3: return (bits == 1 || bits == 2 || bits == 4 || bits == 8) ? MODE_P : -1;
    case 4: return (bits == 8 || bits == 16) ? MODE_LA : -1;
    case 6: return (bits == 8 || bits == 16) ? MODE_RGBA : -1;
    default: return -1;
    }
}

static void parse_png(const Source *src, Result *r, unsigned char *segment) {
    const unsigned char *buf = src->head;
    if (src->head_len < 33 || memcmp(buf + 12, "IHDR", 4) != 0) return;
    r->width = be32(buf + 16);
    r->height = be32(buf + 20);
    r->bits = buf[24];
    if (r->width == 0 || r->height == 0) return;
    r->mode = png_mode(buf[25], buf[24]);
    if (r->mode < 0) return;
    r->progressive = buf[28] == 1;
    /* headers._png_chunks: tRNS and eXIf before the image data */
    int64_t pos = 33, bound = src->size < MAX_HEADER_SCAN ? src->size : MAX_HEADER_SCAN;
    int orientation = 1, transparent = 0;
    while (pos + 8 <= bound) {
        unsigned char header_room[8];
        const unsigned char *header;
        if (fetch(src, pos, 8, header_room, &header) < 8) break;
        int64_t length = be32(header);
        const unsigned char *kind = header + 4;
        if (memcmp(kind, "IDAT", 4) == 0 || memcmp(kind, "IEND", 4) == 0) break;
        if (memcmp(kind, "tRNS", 4) == 0) {
            transparent = 1;
        } else if (memcmp(kind, "eXIf", 4) == 0) {
            const unsigned char *payload;
            int64_t n = fetch(src, pos + 8, length < EXIF_READ ? length : EXIF_READ, segment, &payload);
            if (n < 0) return;
            if (n >= 6 && memcmp(payload, "Exif\0\0", 6) == 0) { payload += 6; n -= 6; }
            orientation = exif_orientation(payload, n);
            if (orientation == 0) orientation = 1;
        }
        pos += 12 + length;
    }
    if (transparent && r->mode == MODE_L) r->mode = MODE_LA;
    if (transparent && r->mode == MODE_RGB) r->mode = MODE_RGBA;
    r->orientation = orientation;
    if (!ends_with(src, "IEND", 4)) return;
    r->format = FMT_PNG;
    r->ok = 1;
}

/* probe.probe_file's check: the extension names the format found, or Python reports a mismatch. */
static int extension_matches(const char *path, Py_ssize_t len, int format) {
    const char *dot = NULL;
    for (Py_ssize_t i = len - 1; i >= 0; i--)
        if (path[i] == '.') { dot = path + i + 1; break; }
    if (dot == NULL) return 0;
    size_t n = (size_t)(path + len - dot);
    char ext[6] = {0};
    if (n == 0 || n > 4) return 0;
    for (size_t i = 0; i < n; i++) ext[i] = (char)(dot[i] >= 'A' && dot[i] <= 'Z' ? dot[i] + 32 : dot[i]);
    if (format == FMT_JPEG)
        return !strcmp(ext, "jpg") || !strcmp(ext, "jpeg") || !strcmp(ext, "jpe") || !strcmp(ext, "jfif");
    return !strcmp(ext, "png") || !strcmp(ext, "apng");
}

/* Files of a chunk mostly share a folder: opening each by name relative to the folder's descriptor
 * spares the kernel the walk down every component of the full path. O_NONBLOCK: a
 * FIFO named in a list file must not block the scan (it reads as empty, and Python then names it). */
typedef struct {
    int fd;
    char path[1024];
    size_t len;
} FolderCache;

static int open_in_folder(FolderCache *folder, const char *path, size_t path_len) {
    const char *slash = memrchr(path, '/', path_len);
    size_t len = slash ? (size_t)(slash - path) : 0;
    if (slash == NULL || len == 0 || len >= sizeof folder->path) return open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (folder->fd < 0 || len != folder->len || memcmp(folder->path, path, len) != 0) {
        if (folder->fd >= 0) close(folder->fd);
        memcpy(folder->path, path, len);
        folder->path[len] = '\0';
        folder->len = len;
        folder->fd = open(folder->path, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (folder->fd < 0) return open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    }
    return openat(folder->fd, slash + 1, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
}

/* `window` (HEAD_BYTES) and `segment` (EXIF_READ) are scratch room for reads past the head:
 * allocated once per batch, not per file. */
static void scan_one(const char *path, Py_ssize_t path_len, uint64_t max_pixels, Result *r, FolderCache *folder,
                     unsigned char *window, unsigned char *segment) {
    unsigned char head[HEAD_BYTES];
    memset(r, 0, sizeof *r);
    if (path == NULL) return;
    int fd = open_in_folder(folder, path, (size_t)path_len);
    if (fd < 0) return;
    ssize_t got = read(fd, head, HEAD_BYTES);
    if (got > 0) {
        Source src = {fd, head, got, got, got < HEAD_BYTES};
        /* one fstat gives both the size (for a file longer than its head) and which file this is,
         * so that links to one file are one file among copies */
        struct stat info;
        if (fstat(fd, &info) != 0) {
            src.size = 0; /* Python looks at it */
        } else {
            if (!src.whole) src.size = (int64_t)info.st_size;
            r->identity = (uint64_t)info.st_ino ^ ((uint64_t)info.st_dev * HASH_STEP);
        }
        if (src.size > 0) {
            r->size = src.size;
            r->head_hash = head_hash(head, got);
            if (got >= 3 && head[0] == 0xFF && head[1] == 0xD8 && head[2] == 0xFF)
                parse_jpeg(&src, r, window, segment);
            else if (got >= 8 && memcmp(head, "\x89PNG\r\n\x1a\n", 8) == 0)
                parse_png(&src, r, segment);
        }
    }
    close(fd);
    if (r->ok && (!extension_matches(path, path_len, r->format) || (uint64_t)r->width * r->height > max_pixels))
        r->ok = 0;
}

static PyObject *FORMAT_JPEG, *FORMAT_PNG, *MODES[MODE_COUNT], *NO_WARNINGS;

static PyObject *scan_batch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *paths_arg;
    long long max_pixels; /* signed: "K" would wrap -1 to 2**64-1 without a word */
    if (!PyArg_ParseTuple(args, "OL:scan_batch", &paths_arg, &max_pixels)) return NULL;
    PyObject *paths = PySequence_Tuple(paths_arg); /* holds the strings while the GIL is released */
    if (paths == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(paths);
    const char **names = PyMem_Calloc((size_t)n + 1, sizeof *names);
    Py_ssize_t *lengths = PyMem_Calloc((size_t)n + 1, sizeof *lengths);
    Result *results = PyMem_Calloc((size_t)n + 1, sizeof *results);
    if (names == NULL || lengths == NULL || results == NULL) {
        PyMem_Free(names), PyMem_Free(lengths), PyMem_Free(results), Py_DECREF(paths);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(paths, i);
        names[i] = PyUnicode_Check(item) ? PyUnicode_AsUTF8AndSize(item, &lengths[i]) : NULL;
        /* surrogate-escaped (non-UTF-8) names and embedded NULs: Python's path handling decides */
        if (names[i] == NULL) PyErr_Clear();
        else if ((Py_ssize_t)strlen(names[i]) != lengths[i]) names[i] = NULL;
    }
    unsigned char *window = PyMem_RawMalloc(HEAD_BYTES), *segment = PyMem_RawMalloc(EXIF_READ);
    if (window == NULL || segment == NULL) {
        PyMem_RawFree(window), PyMem_RawFree(segment);
        PyMem_Free(names), PyMem_Free(lengths), PyMem_Free(results), Py_DECREF(paths);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    FolderCache folder = {-1, {0}, 0};
    /* a limit below 1 flags every image: Python's job (results stay zeroed: None) */
    for (Py_ssize_t i = 0; max_pixels > 0 && i < n; i++)
        scan_one(names[i], lengths[i], (uint64_t)max_pixels, &results[i], &folder, window, segment);
    if (folder.fd >= 0) close(folder.fd);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(window), PyMem_RawFree(segment);
    PyObject *rows = PyList_New(n);
    for (Py_ssize_t i = 0; rows != NULL && i < n; i++) {
        Result *r = &results[i];
        PyObject *row;
        if (!r->ok) {
            row = Py_NewRef(Py_None);
        } else {
            PyObject *header = Py_BuildValue("(OkkOiOiO)", r->format == FMT_JPEG ? FORMAT_JPEG : FORMAT_PNG,
                                             (unsigned long)r->width, (unsigned long)r->height, MODES[r->mode],
                                             r->bits, r->progressive ? Py_True : Py_False, r->orientation, Py_True);
            row = header == NULL ? NULL
                                : Py_BuildValue("(LNOOKK)", (long long)r->size, header, Py_None, NO_WARNINGS,
                                                (unsigned long long)r->head_hash, (unsigned long long)r->identity);
        }
        if (row == NULL) Py_CLEAR(rows);
        else PyList_SET_ITEM(rows, i, row);
    }
    PyMem_Free(names), PyMem_Free(lengths), PyMem_Free(results);
    Py_DECREF(paths);
    return rows;
}

static PyMethodDef methods[] = {
    {"scan_batch", scan_batch, METH_VARARGS,
     "scan_batch(paths, max_pixels) -> list: per path, probe._probe_chunk's row (size, header, None, (), head_hash, identity) "
     "for a clean JPEG/PNG, or None where Python must look."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__scan(void) {
    FORMAT_JPEG = PyUnicode_InternFromString("jpeg");
    FORMAT_PNG = PyUnicode_InternFromString("png");
    NO_WARNINGS = PyTuple_New(0);
    if (FORMAT_JPEG == NULL || FORMAT_PNG == NULL || NO_WARNINGS == NULL) return NULL;
    for (int i = 0; i < MODE_COUNT; i++)
        if ((MODES[i] = PyUnicode_InternFromString(MODE_NAMES[i])) == NULL) return NULL;
    return PyModule_Create(&module);
}
