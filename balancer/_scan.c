/* The frame scanner's fast loop in C (balancer/frames.py, FrameScanner.feed).
 *
 * skip_frames(data, pos, mbit, hlen, limit) -> (pos, count)
 *
 * From ``pos`` (a frame boundary between messages), walks whole frames that can only move the
 * scanner's counters: FIN with a text or binary opcode and RSV bits clear (first byte 0x81 or
 * 0x82), the mask bit the direction requires (``mbit`` 0x80 or 0), a 7- or 16-bit payload length
 * of at most ``limit``, the frame whole in ``data`` (``hlen``: 6 with a mask key, 2 without).
 * Returns where the walk stopped (the first frame that is anything else, or the end) and how
 * many frames it passed. It is the same walk as the Python loop in ``feed``, which stays as the
 * fallback where this module is not built; tests/test_frames.py runs both against the general
 * scanner. Payloads are never read, only headers: a pure function of the bytes, no state. Every
 * sum is of a position inside ``data``, ``hlen`` (2 or 6) and a length of at most 16 bits: none
 * can wrap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
skip_frames(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "skip_frames(data, pos, mbit, hlen, limit)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    long mbit = PyLong_AsLong(args[2]);
    Py_ssize_t hlen = PyLong_AsSsize_t(args[3]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    /* hlen is 2 or 6: anything else is a caller's bug, and a large one would wrap the sums. */
    if (pos < 0 || (mbit != 0 && mbit != 0x80) || (hlen != 2 && hlen != 6)) {
        PyErr_SetString(PyExc_ValueError, "skip_frames: bad pos, mbit or hlen");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    const Py_ssize_t n = view.len;
    Py_ssize_t count = 0;
    while (pos + 1 < n) {
        const unsigned char b0 = p[pos];
        if (b0 != 0x81 && b0 != 0x82) {
            break;
        }
        Py_ssize_t length = (Py_ssize_t)(p[pos + 1] ^ (unsigned char)mbit);
        Py_ssize_t end;
        if (length < 126) {
            end = pos + hlen + length;
        }
        else if (length == 126) {
            if (pos + 3 >= n) {
                break; /* the extended length is cut short */
            }
            length = ((Py_ssize_t)p[pos + 2] << 8) | p[pos + 3];
            if (length > limit) {
                break;
            }
            end = pos + hlen + 2 + length;
        }
        else {
            break; /* a 64-bit length, or the wrong mask bit (128 and more) */
        }
        if (end > n) {
            break;
        }
        count++;
        pos = end;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nn)", pos, count);
}

static PyMethodDef scan_methods[] = {
    {"skip_frames", (PyCFunction)(void (*)(void))skip_frames, METH_FASTCALL,
     "skip_frames(data, pos, mbit, hlen, limit) -> (pos, count): the fast loop of "
     "FrameScanner.feed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT, "balancer._scan", "The frame scanner's fast loop in C.", 0,
    scan_methods,
};

PyMODINIT_FUNC
PyInit__scan(void)
{
    return PyModuleDef_Init(&scan_module);
}
