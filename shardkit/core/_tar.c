/* Compiled fast path of reading a WebDataset tar: the common case of tar_headers.tar_members +
 * webdataset._group + the member reads of webdataset._records, one batch of records per call.
 *
 * In Python, walking and reading a record (3 headers parsed, grouped, 2 reads, a tuple per member)
 * runs on the loader's thread with the GIL held, and the decode threads wait for it. This does the
 * same work in C
 * for records whose every member has a plain ustar header (regular file, octal size, an ASCII
 * name with an extension) and whose members' extensions are distinct and include one that is not
 * a small part. Anything else (pax or GNU long names, other member kinds, damage, a missing end
 * marker, a record over the size limit, a short read) stops the walk at the first header of the
 * record it meets it in, and Python's reference walk goes on from there: it reads that record, or
 * raises the error it would have raised, exactly as without this module. The rules below mirror
 * shardkit/formats/tar_headers.py and webdataset.py line for line; tests/test_tar_walk.py compares
 * both on every fixture and on fuzzed tars.
 *
 * Every read is bounds-checked against the bytes actually in hand: the input is untrusted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define BLOCK 512
#define READ_AHEAD 4096 /* tar_headers.READ_AHEAD */
#define MAX_MEMBERS 64  /* members of one record this path takes; more go to Python */
#define NAME_BYTES 256  /* prefix (155) + '/' + name (100) */

enum { MORE = 0, END = 1, PYTHON = 2 };

typedef struct {
    int fd;
    int64_t file_size;
    unsigned char buffer[READ_AHEAD];
    int64_t start;  /* file offset of buffer[0] */
    int64_t length; /* bytes in the buffer */
} Reader;

/* FileBytes.get: n bytes at offset from the read-ahead when it holds them, else by an exact pread
 * (n >= READ_AHEAD) or a new read-ahead at offset. Returns 0 on success with *data pointing at the
 * bytes (or, with out given, copied there); -1 when fewer than n bytes could be read. */
static int refill(Reader *r, int64_t offset) {
    ssize_t got;
    do {
        got = pread(r->fd, r->buffer, READ_AHEAD, offset);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
        r->length = 0;
        return -1;
    }
    r->start = offset, r->length = got;
    return 0;
}

static const unsigned char *held(Reader *r, int64_t offset, int64_t n) {
    if (r->start <= offset && offset + n <= r->start + r->length) return r->buffer + (offset - r->start);
    return NULL;
}

/* The member's payload as a new bytes object, or NULL (no exception set) when it could not be read whole. */
static PyObject *payload(Reader *r, int64_t offset, int64_t n) {
    const unsigned char *in = held(r, offset, n);
    if (in != NULL) return PyBytes_FromStringAndSize((const char *)in, n);
    if (n < READ_AHEAD) {
        if (refill(r, offset) < 0 || (in = held(r, offset, n)) == NULL) return NULL;
        return PyBytes_FromStringAndSize((const char *)in, n);
    }
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, n);
    if (bytes == NULL) {
        PyErr_Clear();
        return NULL;
    }
    char *out = PyBytes_AS_STRING(bytes);
    ssize_t got;
    /* Without the GIL, as os.pread: the loader's decode threads need it between their batches, and
     * reading an image's bytes (a raw record's hundreds of KB) is long enough to hold them up.
     * Nothing else references this new object yet. */
    Py_BEGIN_ALLOW_THREADS
    do {
        got = pread(r->fd, out, (size_t)n, offset); /* one read, as os.pread: a short one is a cut member */
    } while (got < 0 && errno == EINTR);
    Py_END_ALLOW_THREADS
    if (got != n) {
        Py_DECREF(bytes);
        return NULL;
    }
    return bytes;
}

/* tar_headers._octal for a plain field: digits up to the first NUL, spaces stripped, octal only.
 * Returns -1 for anything Python would parse otherwise (base-256) or refuse. */
static int64_t octal(const unsigned char *field, int width) {
    if (field[0] & 0x80) return -1;
    int end = 0;
    while (end < width && field[end] != 0) end++;
    int begin = 0;
    while (begin < end && field[begin] == ' ') begin++;
    while (end > begin && field[end - 1] == ' ') end--;
    int64_t value = 0;
    for (int i = begin; i < end; i++) {
        if (field[i] < '0' || field[i] > '7') return -1;
        value = value * 8 + (field[i] - '0');
    }
    return value;
}

/* A NUL-ended field's length, or -1 when it holds a byte that is not ASCII (Python decodes UTF-8). */
static int ascii_length(const unsigned char *field, int width) {
    int n = 0;
    while (n < width && field[n] != 0) {
        if (field[n] >= 0x80) return -1;
        n++;
    }
    return n;
}

typedef struct {
    char name[NAME_BYTES + 1];
    int key_length; /* split_name's key: the name up to the first '.' of its last component */
    const char *ext;
    int ext_length;
    int64_t offset, size;
} Member;

/* A plain regular member's header at pos, or 0 when Python must read it (-1: end-of-archive marker). */
static int plain_member(Reader *r, int64_t pos, Member *m, int64_t *next) {
    if (pos + BLOCK > r->file_size) return 0; /* no end marker: Python says so */
    const unsigned char *h = held(r, pos, BLOCK);
    if (h == NULL) {
        if (refill(r, pos) < 0 || (h = held(r, pos, BLOCK)) == NULL) return 0;
    }
    int zero = 1;
    for (int i = 0; i < BLOCK; i++)
        if (h[i] != 0) {
            zero = 0;
            break;
        }
    if (zero) return -1;
    if (memcmp(h + 257, "ustar", 5) != 0) return 0;
    if (h[156] != '0' && h[156] != 0 && h[156] != '7') return 0; /* pax, GNU long names, links, folders */
    int64_t size = octal(h + 124, 12);
    if (size < 0) return 0;
    int name_length = ascii_length(h, 100);
    int prefix_length = ascii_length(h + 345, 155);
    if (name_length < 0 || prefix_length < 0) return 0;
    int length = 0;
    if (prefix_length > 0 && memcmp(h + 257, "ustar\0", 6) == 0) {
        memcpy(m->name, h + 345, prefix_length);
        m->name[prefix_length] = '/';
        length = prefix_length + 1;
    }
    memcpy(m->name + length, h, name_length);
    length += name_length;
    m->name[length] = 0;
    int64_t start = pos + BLOCK;
    if (start + size > r->file_size) return 0; /* runs past the end: Python says so */
    /* split_name: the last component's stem and extension; none (or a hidden file): Python skips it */
    const char *base = memchr(m->name, '/', length) ? strrchr(m->name, '/') + 1 : m->name;
    const char *dot = memchr(base, '.', length - (base - m->name));
    if (dot == NULL || dot == base) return 0;
    if (base == m->name + 1) return 0; /* "/a.jpg": split_name's key is "a", without the slash */
    m->key_length = (int)(dot - m->name);
    m->ext = dot + 1;
    m->ext_length = (int)(length - (dot + 1 - m->name));
    m->offset = start, m->size = size;
    *next = start + (size + BLOCK - 1) / BLOCK * BLOCK;
    return 1;
}

static int is_small_part(const Member *m) { /* webdataset.OTHER_PARTS */
    static const char *parts[] = {"cls", "json", "txt", "captions.json", "columns.json"};
    for (int i = 0; i < 5; i++)
        if ((int)strlen(parts[i]) == m->ext_length && memcmp(parts[i], m->ext, m->ext_length) == 0) return 1;
    return 0;
}

/* The record made of members[0:count]: (key, members, next) as webdataset's Entry, with a fourth
 * item {ext: bytes} of `payloads` (the members' bytes in member order) when given; NULL with an
 * exception set. Each extension's str is made once, for both dicts. */
static PyObject *entry(Member *members, int count, int64_t next, PyObject *payloads) {
    PyObject *key = PyUnicode_DecodeASCII(members[0].name, members[0].key_length, NULL);
    PyObject *table = PyDict_New();
    PyObject *read = payloads == NULL ? NULL : PyDict_New();
    PyObject *found = NULL;
    if (key == NULL || table == NULL || (payloads != NULL && read == NULL)) goto done;
    for (int i = 0; i < count; i++) {
        PyObject *ext = PyUnicode_DecodeASCII(members[i].ext, members[i].ext_length, NULL);
        PyObject *where = Py_BuildValue("(LL)", (long long)members[i].offset, (long long)members[i].size);
        int failed = ext == NULL || where == NULL || PyDict_SetItem(table, ext, where) < 0 ||
                     (read != NULL && PyDict_SetItem(read, ext, PyList_GET_ITEM(payloads, i)) < 0);
        Py_XDECREF(ext), Py_XDECREF(where);
        if (failed) goto done;
    }
    found = read == NULL ? Py_BuildValue("(OOL)", key, table, (long long)next)
                         : Py_BuildValue("(OOLO)", key, table, (long long)next, read);
done:
    Py_XDECREF(key), Py_XDECREF(table), Py_XDECREF(read);
    return found;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    int fd, read;
    long long pos, file_size, max_records, max_bytes, max_record_bytes;
    if (!PyArg_ParseTuple(args, "iLLLLLp", &fd, &pos, &file_size, &max_records, &max_bytes, &max_record_bytes, &read))
        return NULL;
    Reader *r = PyMem_Malloc(sizeof(Reader));
    Member *members = PyMem_Malloc(sizeof(Member) * MAX_MEMBERS);
    PyObject *entries = PyList_New(0);
    PyObject *payloads = read ? PyList_New(0) : NULL; /* the open record's, in member order */
    if (r == NULL || members == NULL || entries == NULL || (read && payloads == NULL)) {
        PyMem_Free(r), PyMem_Free(members), Py_XDECREF(entries), Py_XDECREF(payloads);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    r->fd = fd, r->file_size = file_size, r->start = 0, r->length = 0;
    if (pos < 0 || file_size < 0 || pos > file_size || file_size > INT64_MAX / 2) {
        /* no offset sums can wrap below this (the reader passes offsets within the file): Python */
        PyMem_Free(r), PyMem_Free(members), Py_XDECREF(payloads);
        return Py_BuildValue("(NLi)", entries, pos, PYTHON);
    }
    int state = PYTHON, count = 0; /* count: members of the open record */
    int64_t record_start = pos, record_bytes = 0, batch_bytes = 0, end = pos;
    long long records = 0;
    Member m;
    for (;;) {
        int64_t next = 0;
        int kind = plain_member(r, pos, &m, &next);
        if (kind == 0) break; /* Python reads on from record_start */
        int same = kind == 1 && count > 0 && m.key_length == members[0].key_length &&
                   memcmp(m.name, members[0].name, m.key_length) == 0;
        if (count > 0 && !same) { /* the open record is whole: it ends where this header begins, or at end */
            int images = 0;
            for (int i = 0; i < count; i++) images += !is_small_part(&members[i]);
            if (images == 0) break; /* a sample without an image: Python leaves it out */
            PyObject *made = entry(members, count, kind == 1 ? pos : end, read ? payloads : NULL);
            if (made == NULL || PyList_Append(entries, made) < 0) {
                Py_XDECREF(made);
                goto failed;
            }
            Py_DECREF(made);
            if (read && PyList_SetSlice(payloads, 0, PyList_GET_SIZE(payloads), NULL) < 0) goto failed;
            records++, batch_bytes += record_bytes;
            count = 0, record_start = pos, record_bytes = 0;
            if (kind == 1 && (records >= max_records || batch_bytes >= max_bytes)) {
                state = MORE;
                break;
            }
        }
        if (kind == -1) { /* the end-of-archive marker */
            state = count == 0 ? END : PYTHON; /* (count is 0 here: a record open at the end was closed above) */
            break;
        }
        if (count >= MAX_MEMBERS) break;
        int repeated = 0;
        for (int i = 0; i < count; i++)
            if (members[i].ext_length == m.ext_length && memcmp(members[i].ext, m.ext, m.ext_length) == 0) repeated = 1;
        if (repeated) break; /* a member twice in a record: Python names the damage */
        record_bytes += m.size;
        if (read) {
            if (record_bytes > max_record_bytes) break; /* Python refuses the record */
            PyObject *bytes = payload(r, m.offset, m.size);
            if (bytes == NULL) {
                if (PyErr_Occurred()) goto failed;
                break; /* a short read: Python says what is cut */
            }
            int appended = PyList_Append(payloads, bytes);
            Py_DECREF(bytes);
            if (appended < 0) goto failed;
        }
        members[count] = m;
        members[count].ext = members[count].name + (m.ext - m.name); /* (into its own copy of the name) */
        count++;
        end = next;
        pos = next;
    }
    Py_XDECREF(payloads);
    PyMem_Free(r), PyMem_Free(members);
    return Py_BuildValue("(NLi)", entries, (long long)(state == PYTHON ? record_start : pos), state);
failed:
    Py_XDECREF(payloads);
    PyMem_Free(r), PyMem_Free(members);
    Py_DECREF(entries);
    return NULL;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS,
     "walk(fd, pos, file_size, max_records, max_bytes, max_record_bytes, read) -> (entries, stop, state): "
     "the records from the header at pos as webdataset Entries (key, members, next), with a dict of "
     "each member's bytes when read, until max_records or max_bytes (state 0), the end marker "
     "(state 1) or a record Python must read (state 2); stop is where the next walk begins."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tar", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tar(void) { return PyModule_Create(&module); }
