/* A whole batch of JPEGs decoded into one uint8 [B, H, W, 3] array, with the GIL released once.

   simplejpeg releases the GIL around libjpeg-turbo for each image but holds it to parse
   arguments, read the header and build the result;
   the loader's reader thread and its other decode threads wait for it two or three times per
   image. Here the GIL is
   held only to collect the batch's buffers; header, size check and decode of every image run
   without it. Same libjpeg-turbo, same settings as simplejpeg's defaults (accurate integer
   IDCT, fancy upsampling), so the pixels are the same (tests/loaders/test_decode.py checks).

   decode_into(images, out, height, width) -> list[int]
     images: a sequence of bytes-like objects (or None)
     out:    a writable C-contiguous buffer of len(images) * height * width * 3 bytes
     returns the indices of the rows it did not decode: None, not decodable to RGB by libjpeg,
     any libjpeg warning (a truncated file, for instance), or not height x width. The caller
     decodes those with its general decoder, which decodes or refuses them exactly as it would
     have (simplejpeg's own conversion for CMYK, Pillow for other formats, a clear error for a
     corrupt or wrongly sized image).

   Loaded by loaders/decode.py when built (pip builds it from pyproject.toml, linking the
   system's libjpeg: libjpeg62-turbo-dev on Debian); without it the loader uses simplejpeg. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

struct error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void on_error(j_common_ptr cinfo) {
    longjmp(((struct error_mgr *)cinfo->err)->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    /* level -1 is a warning (corrupt data): count it, print nothing (the caller re-decodes
       the row with its own decoder, which reports). Trace messages (level >= 0) are ignored. */
    if (level < 0)
        cinfo->err->num_warnings++;
}

/* 0 when the image was decoded into dst (height x width x 3), 1 otherwise. */
static int decode_one(struct jpeg_decompress_struct *cinfo, struct error_mgr *err, const unsigned char *src,
                      size_t len, unsigned char *dst, JDIMENSION height, JDIMENSION width) {
    if (len < 3 || len > ULONG_MAX || src[0] != 0xFF || src[1] != 0xD8 || src[2] != 0xFF)
        return 1;
    if (setjmp(err->jump)) {
        jpeg_abort_decompress(cinfo);
        return 1;
    }
    err->pub.num_warnings = 0;
    jpeg_mem_src(cinfo, src, (unsigned long)len);
    if (jpeg_read_header(cinfo, TRUE) != JPEG_HEADER_OK || cinfo->image_width != width ||
        cinfo->image_height != height ||
        (cinfo->jpeg_color_space != JCS_YCbCr && cinfo->jpeg_color_space != JCS_GRAYSCALE &&
         cinfo->jpeg_color_space != JCS_RGB)) {
        jpeg_abort_decompress(cinfo);
        return 1;
    }
    cinfo->out_color_space = JCS_RGB;
    cinfo->dct_method = JDCT_ISLOW;
    cinfo->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(cinfo);
    if (cinfo->output_width != width || cinfo->output_height != height || cinfo->output_components != 3) {
        jpeg_abort_decompress(cinfo);
        return 1;
    }
    size_t stride = (size_t)width * 3;
    JSAMPROW rows[16];
    while (cinfo->output_scanline < height) {
        JDIMENSION y = cinfo->output_scanline, n = 0;
        while (n < 16 && y + n < height) {
            rows[n] = dst + (size_t)(y + n) * stride;
            n++;
        }
        if (jpeg_read_scanlines(cinfo, rows, n) == 0)
            break; /* the source ran out (a warning was counted) */
    }
    if (cinfo->output_scanline < height || err->pub.num_warnings) {
        jpeg_abort_decompress(cinfo);
        return 1;
    }
    jpeg_finish_decompress(cinfo);
    return err->pub.num_warnings != 0;
}

/* Decodes every held buffer of bufs[0..n) into its slot of dst; bad[i] = 1 for a row left.
   Runs without the GIL. 0 (and libjpeg's message in message) when libjpeg could not even create
   a decompressor (out of memory, or a libjpeg other than the one whose headers we were built
   with); 1 otherwise.

   NOTE [ libjpeg errors ]: libjpeg reports an error by calling error_exit, which must not return.
   Ours longjmps to the latest setjmp on err.jump, so a setjmp is armed before every libjpeg
   call that can fail: here around jpeg_create_decompress, in decode_one around each image (its
   jump buffer is stale once decode_one returns; only jpeg_destroy_decompress, which cannot
   fail, runs after the last one). */
static int decode_all(const Py_buffer *bufs, Py_ssize_t n, unsigned char *dst, size_t image_bytes,
                      JDIMENSION height, JDIMENSION width, char *bad, char *message) {
    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
    memset(&cinfo, 0, sizeof cinfo); /* cinfo.mem == NULL: jpeg_destroy_decompress frees nothing */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        err.pub.format_message((j_common_ptr)&cinfo, message);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    jpeg_create_decompress(&cinfo);
    for (Py_ssize_t i = 0; i < n; i++)
        bad[i] = !bufs[i].obj || decode_one(&cinfo, &err, bufs[i].buf, (size_t)bufs[i].len, dst + (size_t)i * image_bytes,
                                            height, width);
    jpeg_destroy_decompress(&cinfo);
    return 1;
}

static PyObject *decode_into(PyObject *self, PyObject *args) {
    PyObject *images, *out_obj, *seq = NULL, *failed = NULL;
    Py_ssize_t height, width;
    Py_buffer out = {0};
    Py_buffer *bufs = NULL;
    char *bad = NULL;
    char message[JMSG_LENGTH_MAX] = "";
    int started;
    if (!PyArg_ParseTuple(args, "OOnn", &images, &out_obj, &height, &width))
        return NULL;
    if (height <= 0 || width <= 0 || height > JPEG_MAX_DIMENSION || width > JPEG_MAX_DIMENSION) {
        PyErr_Format(PyExc_ValueError, "image size %zdx%zd is out of range", width, height);
        return NULL;
    }
    /* A tuple of our own: the items stay referenced even if the caller's list changes. */
    if (!(seq = PySequence_Tuple(images)))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    size_t image_bytes = (size_t)height * (size_t)width * 3;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if ((n && image_bytes > SIZE_MAX / (size_t)n) || (size_t)out.len != (size_t)n * image_bytes) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, %zd images of %zdx%zdx3 need %zu", out.len, n, width,
                     height, (size_t)n * image_bytes);
        goto done;
    }
    bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    bad = PyMem_Calloc(n ? n : 1, 1);
    if (!bufs || !bad) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (item == Py_None)
            continue;
        if (PyObject_GetBuffer(item, &bufs[i], PyBUF_SIMPLE) < 0) /* sets bufs[i].obj on success */
            goto done;
    }

    Py_BEGIN_ALLOW_THREADS
    started = decode_all(bufs, n, out.buf, image_bytes, (JDIMENSION)height, (JDIMENSION)width, bad, message);
    Py_END_ALLOW_THREADS
    if (!started) {
        PyErr_Format(PyExc_RuntimeError, "libjpeg could not start a decompressor: %s", message);
        goto done;
    }

    if (!(failed = PyList_New(0)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!bad[i])
            continue;
        PyObject *index = PyLong_FromSsize_t(i);
        if (!index || PyList_Append(failed, index) < 0) {
            Py_XDECREF(index);
            Py_CLEAR(failed);
            goto done;
        }
        Py_DECREF(index);
    }

done:
    if (bufs)
        for (Py_ssize_t i = 0; i < n; i++)
            if (bufs[i].obj)
                PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(bad);
    if (out.obj)
        PyBuffer_Release(&out);
    Py_DECREF(seq);
    return failed;
}

static PyMethodDef methods[] = {
    {"decode_into", decode_into, METH_VARARGS,
     "decode_into(images, out, height, width) -> indices of the rows not decoded"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
