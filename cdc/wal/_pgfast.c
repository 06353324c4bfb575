/*
 * cdc.wal._pgfast: the relay's compiled hot path (optional).
 *
 * insert_text_values(data, at=0) is cdc.wal.pgoutput._insert_text_values_py in
 * C: the relation OID and the values of the pgoutput Insert at data[at:] (to
 * its end) holding only text and NULL values, or None for anything else
 * (another message kind, a binary or unchanged value, a short message,
 * trailing bytes). ``data`` is any buffer: the relay passes the CopyData
 * message psycopg hands over (a memoryview) with the offset of its pgoutput
 * payload, so the payload is never copied; only the values are. Same answers
 * for every input (tests/unit/test_pgoutput.py runs both on the same cases, at
 * offsets, and on random bytes); it only allocates the values and the result.
 *
 * begin_context(data, at=0) is cdc.wal.pgoutput._begin_context_py in C: the
 * pgoutput Begin at data[at:] read in place, with the texts of the
 * transaction's two headers: (final_lsn, commit time in Unix microseconds,
 * b"16/B374D848" as PostgreSQL prints an LSN, b"2026-11-29T10:00:00.123456Z"),
 * or None for anything else (another kind, a wrong length, a commit time
 * outside the years 1000-9999). Python's int formatting of the two was most of
 * a 1-event transaction's cost of its own.
 *
 * Built by setuptools when a C compiler is present (pyproject.toml,
 * ext-modules, optional); without one, or with OUTBOX_CDC_PURE_PYTHON=1, the
 * pure-Python function is used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static uint32_t
read_u32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static PyObject *
insert_text_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at = 0;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "insert_text_values(data, at=0)");
        return NULL;
    }
    if (nargs == 2) {
        at = PyLong_AsSsize_t(args[1]);
        if (at == -1 && PyErr_Occurred())
            return NULL;
        if (at < 0) {
            PyErr_SetString(PyExc_ValueError, "insert_text_values: a negative offset");
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const Py_ssize_t len = view.len;
    const unsigned char *data = (const unsigned char *)view.buf + (at < len ? at : len);
    const Py_ssize_t end = len - (at < len ? at : len); /* the message: data[0:end] */
    PyObject *values = NULL, *result = NULL;

    /* 'I', Int32 relation oid, 'N', Int16 column count */
    if (end < 8 || data[0] != 'I' || data[5] != 'N')
        goto none;
    const uint32_t oid = read_u32(data + 1);
    const unsigned ncols = ((unsigned)data[6] << 8) | (unsigned)data[7];
    values = PyList_New(ncols);
    if (values == NULL)
        goto done;
    Py_ssize_t off = 8;
    for (unsigned i = 0; i < ncols; i++) {
        if (off >= end)
            goto none;
        if (data[off] == 't') { /* text: Int32 size, bytes */
            if (end - off < 5)
                goto none;
            const uint64_t size = read_u32(data + off + 1);
            const Py_ssize_t start = off + 5;
            if (size > (uint64_t)(end - start))
                goto none;
            PyObject *value = PyBytes_FromStringAndSize((const char *)data + start, (Py_ssize_t)size);
            if (value == NULL)
                goto done;
            PyList_SET_ITEM(values, i, value);
            off = start + (Py_ssize_t)size;
        } else if (data[off] == 'n') { /* null */
            PyList_SET_ITEM(values, i, Py_NewRef(Py_None));
            off += 1;
        } else {
            goto none;
        }
    }
    if (off != end)
        goto none;
    PyObject *relation = PyLong_FromUnsignedLong((unsigned long)oid);
    if (relation == NULL)
        goto done;
    result = PyTuple_Pack(2, relation, values);
    Py_DECREF(relation);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(values); /* (a partly filled list: PyList_New's NULL slots are skipped) */
    PyBuffer_Release(&view);
    return result;
}

/* Days since 1970-01-01 -> proleptic Gregorian year, month, day (Howard
 * Hinnant's civil_from_days, exact for every int64 day count used here). */
static void
civil_from_days(int64_t z, int64_t *year, unsigned *month, unsigned *day)
{
    z += 719468;
    const int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    const unsigned doe = (unsigned)(z - era * 146097);
    const unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    const unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    const unsigned mp = (5 * doy + 2) / 153;
    *day = doy - (153 * mp + 2) / 5 + 1;
    *month = mp < 10 ? mp + 3 : mp - 9;
    *year = (int64_t)yoe + era * 400 + (*month <= 2);
}

static char *
put_digits(char *out, uint64_t value, int width)
{
    for (int i = width - 1; i >= 0; i--) {
        out[i] = (char)('0' + value % 10);
        value /= 10;
    }
    return out + width;
}

static char *
put_hex(char *out, uint32_t value) /* upper case, no padding, as %X */
{
    static const char digits[] = "0123456789ABCDEF";
    char tmp[8];
    int n = 0;
    do {
        tmp[n++] = digits[value & 0xF];
        value >>= 4;
    } while (value);
    while (n)
        *out++ = tmp[--n];
    return out;
}

/* PostgreSQL's epoch (2000-01-01) in Unix microseconds. */
#define PG_EPOCH_OFFSET_US INT64_C(946684800000000)
#define US_PER_S INT64_C(1000000)

static PyObject *
begin_context(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at = 0;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "begin_context(data, at=0)");
        return NULL;
    }
    if (nargs == 2) {
        at = PyLong_AsSsize_t(args[1]);
        if (at == -1 && PyErr_Occurred())
            return NULL;
        if (at < 0) {
            PyErr_SetString(PyExc_ValueError, "begin_context: a negative offset");
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    /* 'B', Int64 final_lsn, Int64 commit time (PostgreSQL epoch, us), Int32 xid */
    if (at > view.len || view.len - at != 21)
        goto none;
    const unsigned char *data = (const unsigned char *)view.buf + at;
    if (data[0] != 'B')
        goto none;
    const uint64_t final_lsn = ((uint64_t)read_u32(data + 1) << 32) | read_u32(data + 5);
    const int64_t pg_ts = (int64_t)(((uint64_t)read_u32(data + 9) << 32) | read_u32(data + 13));
    if (pg_ts > INT64_MAX - PG_EPOCH_OFFSET_US)
        goto none;
    const int64_t ts_us = pg_ts + PG_EPOCH_OFFSET_US;
    int64_t secs = ts_us / US_PER_S, micros = ts_us % US_PER_S;
    if (micros < 0) { /* floor, as Python's divmod */
        micros += US_PER_S;
        secs -= 1;
    }
    int64_t days = secs / 86400, sod = secs % 86400;
    if (sod < 0) {
        sod += 86400;
        days -= 1;
    }
    int64_t year;
    unsigned month, day;
    civil_from_days(days, &year, &month, &day);
    if (year < 1000 || year > 9999)
        goto none;

    char lsn[17], *p = lsn; /* "%X/%X" */
    p = put_hex(p, (uint32_t)(final_lsn >> 32));
    *p++ = '/';
    p = put_hex(p, (uint32_t)final_lsn);
    char iso[27], *q = iso; /* YYYY-MM-DDTHH:MM:SS.ffffffZ */
    q = put_digits(q, (uint64_t)year, 4);
    *q++ = '-';
    q = put_digits(q, month, 2);
    *q++ = '-';
    q = put_digits(q, day, 2);
    *q++ = 'T';
    q = put_digits(q, (uint64_t)(sod / 3600), 2);
    *q++ = ':';
    q = put_digits(q, (uint64_t)(sod / 60 % 60), 2);
    *q++ = ':';
    q = put_digits(q, (uint64_t)(sod % 60), 2);
    *q++ = '.';
    q = put_digits(q, (uint64_t)micros, 6);
    *q++ = 'Z';

    PyObject *items[4] = {
        PyLong_FromUnsignedLongLong(final_lsn),
        PyLong_FromLongLong(ts_us),
        PyBytes_FromStringAndSize(lsn, p - lsn),
        PyBytes_FromStringAndSize(iso, q - iso),
    };
    if (items[0] && items[1] && items[2] && items[3])
        result = PyTuple_Pack(4, items[0], items[1], items[2], items[3]);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(items[i]);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"insert_text_values", (PyCFunction)(void (*)(void))insert_text_values, METH_FASTCALL,
     "insert_text_values(data, at=0): the relation OID and values of the text-only pgoutput"
     " Insert at data[at:], or None."},
    {"begin_context", (PyCFunction)(void (*)(void))begin_context, METH_FASTCALL,
     "begin_context(data, at=0): the pgoutput Begin at data[at:] with its header texts:"
     " (final_lsn, commit time in Unix us, LSN text, ISO commit time), or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cdc.wal._pgfast", "The relay's compiled hot path (optional).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__pgfast(void)
{
    return PyModule_Create(&module);
}
