/*
 * cdc.wal._pgfast: the relay's compiled hot path (optional).
 *
 * insert_text_values(data) is cdc.wal.pgoutput._insert_text_values_py in C:
 * the relation OID and the values of a pgoutput Insert holding only text and
 * NULL values, or None for anything else (another message kind, a binary or
 * unchanged value, a short message, trailing bytes). Same answers for every
 * input (tests/unit/test_pgoutput.py runs both on the same cases and on
 * random bytes); it only allocates the values and the result.
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
insert_text_values(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = (const unsigned char *)view.buf;
    const Py_ssize_t len = view.len;
    PyObject *values = NULL, *result = NULL;

    /* 'I', Int32 relation oid, 'N', Int16 column count */
    if (len < 8 || data[0] != 'I' || data[5] != 'N')
        goto none;
    const uint32_t oid = read_u32(data + 1);
    const unsigned ncols = ((unsigned)data[6] << 8) | (unsigned)data[7];
    values = PyList_New(ncols);
    if (values == NULL)
        goto done;
    Py_ssize_t off = 8;
    for (unsigned i = 0; i < ncols; i++) {
        if (off >= len)
            goto none;
        if (data[off] == 't') { /* text: Int32 size, bytes */
            if (len - off < 5)
                goto none;
            const uint64_t size = read_u32(data + off + 1);
            const Py_ssize_t start = off + 5;
            if (size > (uint64_t)(len - start))
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
    if (off != len)
        goto none;
    result = Py_BuildValue("(kO)", (unsigned long)oid, values);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(values); /* (a partly filled list: PyList_New's NULL slots are skipped) */
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"insert_text_values", insert_text_values, METH_O,
     "The relation OID and values of a text-only pgoutput Insert, or None."},
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
