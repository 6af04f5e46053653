/* Rows of an Arrow binary array as Python bytes, copied with the GIL released.

   Arrow's to_pylist() holds the GIL for the whole copy of a window's images (~27 MB for 2,000
   224px JPEGs): the loader's decode threads, which come back from libjpeg-turbo after every
   image, wait for it. Here only the allocation of the bytes objects needs the GIL; the copy
   runs without it. Safe because no other thread can reach the new objects before we return
   them, and the source buffers are held (Py_buffer) until then.

   rows(offsets, values, offset, length, validity) -> list[bytes | None]
     offsets:  the array's int32 offsets buffer (binary, not large_binary)
     values:   its data buffer
     offset:   the array's offset (into offsets and validity), length: its length
     validity: its validity bitmap, or None when it has no nulls

   Loaded by loaders/shard_loader.py when built; without it the loader uses to_pylist(). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *rows(PyObject *self, PyObject *args) {
    Py_buffer offsets_buf, values_buf, validity_buf = {0};
    Py_ssize_t offset, length;
    PyObject *validity, *list = NULL;
    char **dst = NULL;
    if (!PyArg_ParseTuple(args, "y*y*nnO", &offsets_buf, &values_buf, &offset, &length, &validity))
        return NULL;
    int has_validity = validity != Py_None;
    if (has_validity && PyObject_GetBuffer(validity, &validity_buf, PyBUF_SIMPLE) < 0)
        goto done;
    /* In size_t: offset + length + 7 cannot overflow for two non-negative Py_ssize_t. */
    if (offset < 0 || length < 0 ||
        (size_t)offsets_buf.len / sizeof(int32_t) < (size_t)offset + (size_t)length + 1 ||
        (has_validity && (size_t)validity_buf.len < ((size_t)offset + (size_t)length + 7) / 8)) {
        PyErr_Format(PyExc_ValueError, "buffers too short for %zd rows at offset %zd", length, offset);
        goto done;
    }
    const int32_t *offs = (const int32_t *)offsets_buf.buf;
    const char *values = (const char *)values_buf.buf;
    const uint8_t *bits = has_validity ? (const uint8_t *)validity_buf.buf : NULL;
    if (length > 0 && (offs[offset] < 0 || offs[offset + length] > values_buf.len)) {
        PyErr_Format(PyExc_ValueError, "offsets point outside the %zd-byte values buffer", values_buf.len);
        goto done;
    }
    list = PyList_New(length);
    dst = PyMem_Malloc(sizeof(char *) * (length ? length : 1));
    if (list == NULL || dst == NULL) {
        if (dst == NULL) PyErr_NoMemory();
        Py_CLEAR(list);
        goto done;
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_ssize_t j = offset + i;
        dst[i] = NULL;
        if (bits != NULL && !((bits[j >> 3] >> (j & 7)) & 1)) {
            PyList_SET_ITEM(list, i, Py_NewRef(Py_None));
            continue;
        }
        Py_ssize_t size = (Py_ssize_t)offs[j + 1] - offs[j];
        /* Each row on its own: a null row between two may hide offsets that leave the buffer. */
        if (size < 0 || offs[j] < 0 || offs[j + 1] > values_buf.len) {
            if (size < 0)
                PyErr_Format(PyExc_ValueError, "row %zd has a negative length", i);
            else
                PyErr_Format(PyExc_ValueError, "row %zd points outside the %zd-byte values buffer", i, values_buf.len);
            Py_CLEAR(list);  /* the items set so far go with it; the rest are NULL */
            goto done;
        }
        PyObject *item = PyBytes_FromStringAndSize(NULL, size);
        if (item == NULL) {
            Py_CLEAR(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, item);
        dst[i] = PyBytes_AS_STRING(item);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < length; i++) {
        if (dst[i] != NULL) {
            Py_ssize_t j = offset + i;
            memcpy(dst[i], values + offs[j], (size_t)(offs[j + 1] - offs[j]));
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyMem_Free(dst);
    PyBuffer_Release(&offsets_buf);
    PyBuffer_Release(&values_buf);
    if (has_validity && validity_buf.obj != NULL) PyBuffer_Release(&validity_buf);
    return list;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS, "rows(offsets, values, offset, length, validity) -> list[bytes | None]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
