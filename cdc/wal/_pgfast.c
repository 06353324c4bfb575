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

static PyMethodDef methods[] = {
    {"insert_text_values", (PyCFunction)(void (*)(void))insert_text_values, METH_FASTCALL,
     "insert_text_values(data, at=0): the relation OID and values of the text-only pgoutput"
     " Insert at data[at:], or None."},
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
