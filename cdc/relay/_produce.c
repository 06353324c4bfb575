/* The relay's produce call for an outbox record, in C (cdc.relay.fast_produce).
 *
 * confluent-kafka's Producer.produce() turns each header name into a new UTF-8
 * bytes object, parses its arguments by keyword and builds the header list from
 * Python tuples: 28% of the relay's main thread for 100-event transactions, 15%
 * in the header names alone. This module hands the same record to the same
 * librdkafka producer directly:
 *
 *   - the producer is confluent-kafka's own: its rd_kafka_t is the first field
 *     of the Producer object (confluent_kafka.h, Handle);
 *   - the record's opaque is the per-message state confluent-kafka's delivery
 *     report callback expects ({handle, callback}, Producer.c), so its report is
 *     served exactly as for a record given to Producer.produce(): the callback
 *     is called for a failure (delivery.report.only.error) and its reference
 *     released after the report;
 *   - librdkafka's functions are those of the library confluent-kafka loaded,
 *     found with dlopen(RTLD_NOLOAD) by the caller's path (never a second copy).
 *
 * cdc.relay.fast_produce checks the versions this was verified against and
 * falls back to Producer.produce() for any other; OUTBOX_CDC_PURE_PYTHON=1 does
 * too. Like Producer.produce() it holds the GIL throughout; unlike it, it does
 * not take confluent-kafka's guard against a close() from another thread: call
 * it from the thread that closes the producer (the relay's main thread). A
 * closed producer (its handle NULL) answers _STATE.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* librdkafka's ABI (rdkafka.h; stable since 1.0): only what is called here. */
typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_headers_s rd_kafka_headers_t;
typedef int rd_kafka_resp_err_t;
enum {
    VTYPE_END = 0,
    VTYPE_TOPIC = 1,
    VTYPE_PARTITION = 3,
    VTYPE_VALUE = 4,
    VTYPE_KEY = 5,
    VTYPE_OPAQUE = 6,
    VTYPE_MSGFLAGS = 7,
    VTYPE_TIMESTAMP = 8,
    VTYPE_HEADERS = 10,
};
#define MSG_F_COPY 0x2
#define PARTITION_UA ((int32_t)-1)
#define ERR_INVALID_ARG (-186)
#define ERR_STATE (-172)

static rd_kafka_headers_t *(*headers_new)(size_t);
static rd_kafka_resp_err_t (*header_add)(rd_kafka_headers_t *, const char *, ssize_t,
                                         const void *, ssize_t);
static void (*headers_destroy)(rd_kafka_headers_t *);
static rd_kafka_resp_err_t (*producev)(rd_kafka_t *, ...);
static const char *(*kafka_name)(const rd_kafka_t *);

/* confluent-kafka's Producer object and per-message state. */
typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
} Handle;
typedef struct {
    PyObject *self;
    PyObject *dr_cb;
} MsgState;

static PyObject *producer_type; /* confluent_kafka.Producer */
/* Header names, UTF-8, NUL-terminated: id, type, aggregatetype, traceparent. */
static char *names[4];

static int
take_name(PyObject *name, char **to)
{
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(name, &size);
    if (utf8 == NULL)
        return -1;
    char *copy = PyMem_RawMalloc((size_t)size + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, utf8, (size_t)size + 1);
    PyMem_RawFree(*to);
    *to = copy;
    return 0;
}

/* init(library_path, Producer, (id, type, aggregatetype, traceparent) names) */
static PyObject *
init(PyObject *module, PyObject *args)
{
    const char *path;
    PyObject *type, *header_names;
    if (!PyArg_ParseTuple(args, "sOO!", &path, &type, &PyTuple_Type, &header_names))
        return NULL;
    if (!PyType_Check(type) || PyTuple_GET_SIZE(header_names) != 4) {
        PyErr_SetString(PyExc_TypeError, "init(path, Producer type, 4 header names)");
        return NULL;
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "librdkafka is not loaded from %s", path);
        return NULL;
    }
    headers_new = (rd_kafka_headers_t * (*)(size_t)) dlsym(lib, "rd_kafka_headers_new");
    header_add = (rd_kafka_resp_err_t(*)(rd_kafka_headers_t *, const char *, ssize_t,
                                         const void *, ssize_t))dlsym(lib, "rd_kafka_header_add");
    headers_destroy = (void (*)(rd_kafka_headers_t *))dlsym(lib, "rd_kafka_headers_destroy");
    producev = (rd_kafka_resp_err_t(*)(rd_kafka_t *, ...))dlsym(lib, "rd_kafka_producev");
    kafka_name = (const char *(*)(const rd_kafka_t *))dlsym(lib, "rd_kafka_name");
    dlclose(lib); /* (a reference RTLD_NOLOAD took: confluent-kafka keeps it loaded) */
    if (!headers_new || !header_add || !headers_destroy || !producev || !kafka_name) {
        producev = NULL;
        PyErr_SetString(PyExc_ImportError, "librdkafka lacks rd_kafka_producev or headers");
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        PyObject *name = PyTuple_GET_ITEM(header_names, i);
        if (!PyUnicode_Check(name) || take_name(name, &names[i]) < 0) {
            producev = NULL;
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "header names are str");
            return NULL;
        }
    }
    Py_INCREF(type);
    Py_XSETREF(producer_type, type);
    Py_RETURN_NONE;
}

/* name(producer) -> rd_kafka_name() of its handle ("<client.id>#producer-<n>"): the
   caller checks it, so a Producer laid out otherwise is found before any record. */
static PyObject *
name(PyObject *module, PyObject *producer)
{
    if (kafka_name == NULL || producer_type == NULL ||
        Py_TYPE(producer) != (PyTypeObject *)producer_type) {
        PyErr_SetString(PyExc_TypeError, "name(producer) after init()");
        return NULL;
    }
    rd_kafka_t *rk = ((Handle *)producer)->rk;
    if (rk == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(kafka_name(rk));
}

static int
add(rd_kafka_headers_t *headers, const char *name, PyObject *value)
{
    return header_add(headers, name, -1, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
}

/* produce(producer, topic, value, key, timestamp_ms, event_id, event_type,
 *         aggregatetype, tx_headers, traceparent, reports) -> int
 *
 * The record's headers are id, type, aggregatetype, then tx_headers (a tuple
 * of (str, bytes) pairs), then traceparent when it is not None or empty: the
 * order of the relay's Python path. On success (0) it appends
 * (hash((key, value)), event_id) to reports (a list subclass) and the record
 * holds a reference on reports until its delivery report is served. Otherwise
 * it returns librdkafka's error code, the record was not produced and reports
 * is as it was. */
static PyObject *
produce(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "produce takes 11 arguments");
        return NULL;
    }
    PyObject *producer = args[0], *topic = args[1], *value = args[2], *key = args[3];
    PyObject *event_id = args[5], *event_type = args[6], *aggtype = args[7];
    PyObject *tx_headers = args[8], *trace = args[9], *reports = args[10];
    if (producev == NULL || producer_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cdc.relay._produce.init() was not called");
        return NULL;
    }
    if (Py_TYPE(producer) != (PyTypeObject *)producer_type || !PyUnicode_Check(topic) ||
        !PyBytes_Check(value) || !PyBytes_Check(key) || !PyBytes_Check(event_id) ||
        !PyBytes_Check(event_type) || !PyBytes_Check(aggtype) || !PyTuple_Check(tx_headers) ||
        !(trace == Py_None || PyBytes_Check(trace)) || !PyList_Check(reports)) {
        PyErr_SetString(PyExc_TypeError, "produce: unexpected argument types");
        return NULL;
    }
    long long timestamp_ms = PyLong_AsLongLong(args[4]);
    if (timestamp_ms == -1 && PyErr_Occurred())
        return NULL;
    const char *topic_utf8 = PyUnicode_AsUTF8(topic);
    if (topic_utf8 == NULL)
        return NULL;
    rd_kafka_t *rk = ((Handle *)producer)->rk;
    if (rk == NULL) /* closed */
        return PyLong_FromLong(ERR_STATE);

    /* The entry for reports first: nothing can fail after the record is produced. */
    PyObject *pair = PyTuple_Pack(2, key, value);
    if (pair == NULL)
        return NULL;
    Py_hash_t hash = PyObject_Hash(pair);
    Py_DECREF(pair);
    if (hash == -1)
        return NULL;
    PyObject *hash_obj = PyLong_FromSsize_t(hash);
    if (hash_obj == NULL)
        return NULL;
    PyObject *entry = PyTuple_Pack(2, hash_obj, event_id);
    Py_DECREF(hash_obj);
    if (entry == NULL)
        return NULL;

    Py_ssize_t n_tx = PyTuple_GET_SIZE(tx_headers);
    int traced = trace != Py_None && PyBytes_GET_SIZE(trace) > 0;
    rd_kafka_resp_err_t err = 0;
    rd_kafka_headers_t *headers = headers_new((size_t)(3 + n_tx + traced));
    err = add(headers, names[0], event_id);
    if (!err)
        err = add(headers, names[1], event_type);
    if (!err)
        err = add(headers, names[2], aggtype);
    for (Py_ssize_t i = 0; !err && i < n_tx; i++) {
        PyObject *header = PyTuple_GET_ITEM(tx_headers, i);
        PyObject *name, *hvalue;
        const char *name_utf8;
        if (!PyTuple_Check(header) || PyTuple_GET_SIZE(header) != 2 ||
            !PyUnicode_Check(name = PyTuple_GET_ITEM(header, 0)) ||
            !PyBytes_Check(hvalue = PyTuple_GET_ITEM(header, 1)) ||
            (name_utf8 = PyUnicode_AsUTF8(name)) == NULL) {
            headers_destroy(headers);
            Py_DECREF(entry);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "tx headers are (str, bytes) pairs");
            return NULL;
        }
        err = add(headers, name_utf8, hvalue);
    }
    if (!err && traced)
        err = add(headers, names[3], trace);
    if (err) {
        headers_destroy(headers);
        Py_DECREF(entry);
        return PyLong_FromLong(err);
    }

    /* reports' entry before the record: nothing may fail once it is produced */
    int appended = PyList_Append(reports, entry);
    Py_DECREF(entry);
    if (appended < 0) {
        headers_destroy(headers);
        return NULL;
    }
    /* (zeroed room for two more pointers: fields a confluent-kafka we did not read
       might add read as NULL; it frees the state with free()) */
    MsgState *state = calloc(1, sizeof(*state) + 2 * sizeof(void *));
    if (state == NULL) {
        headers_destroy(headers);
        PyList_SetSlice(reports, PyList_GET_SIZE(reports) - 1, PyList_GET_SIZE(reports), NULL);
        return PyErr_NoMemory();
    }
    state->self = producer;
    state->dr_cb = reports;
    Py_INCREF(reports);

    err = producev(rk, VTYPE_MSGFLAGS, (int)MSG_F_COPY, VTYPE_TOPIC, topic_utf8,
                   VTYPE_PARTITION, PARTITION_UA, VTYPE_KEY, (void *)PyBytes_AS_STRING(key),
                   (size_t)PyBytes_GET_SIZE(key), VTYPE_VALUE, (void *)PyBytes_AS_STRING(value),
                   (size_t)PyBytes_GET_SIZE(value), VTYPE_TIMESTAMP, (int64_t)timestamp_ms,
                   VTYPE_HEADERS, headers, VTYPE_OPAQUE, (void *)state, VTYPE_END);
    if (err) { /* not produced: the headers and the state are still ours */
        headers_destroy(headers);
        free(state);
        PyList_SetSlice(reports, PyList_GET_SIZE(reports) - 1, PyList_GET_SIZE(reports), NULL);
        Py_DECREF(reports);
        return PyLong_FromLong(err);
    }
    return PyLong_FromLong(0); /* its report is served by a later poll, never before */
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, "init(library_path, Producer, header_names): bind librdkafka."},
    {"name", name, METH_O, "name(producer) -> the name librdkafka gave its handle."},
    {"produce", (PyCFunction)(void (*)(void))produce, METH_FASTCALL,
     "produce(producer, topic, value, key, timestamp_ms, event_id, event_type, aggregatetype,"
     " tx_headers, traceparent, reports) -> 0 or librdkafka's error code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_produce", "The relay's produce call, in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__produce(void)
{
    return PyModule_Create(&module);
}
