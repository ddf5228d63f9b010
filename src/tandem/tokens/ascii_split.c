/* The ASCII word-cache encoder's inner loop (ascii_encoder.py), as a CPython extension:
 * split text[start:end] by the ASCII reading of the GPT-2 pre-tokenizer pattern and append
 * each word's ids from the word cache to a list. Python's `re` spends ~140 ns per word on
 * this; here a word costs its string and one dict lookup.
 *
 * The pattern (ascii_encoder.SPLIT_PATTERN), alternatives tried in order at each position,
 * WS = the six ASCII White_Space characters " \t\n\v\f\r":
 *   's 't 're 've 'm 'll 'd | ?[A-Za-z]+ | ?[0-9]+ | ?[^WS A-Za-z0-9]+ |
 *   [WS]+(?![^WS]) | [WS]+
 * The text ends at `end` for the lookahead too (as findall(text, start, end) reads it).
 * tests/unit/tokens/test_ascii_split.py checks `split` against the regex on random text.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { WS = 1, ALPHA = 2, DIGIT = 3, OTHER = 4 };
static unsigned char kind[128];

static void init_kinds(void) {
    for (int c = 0; c < 128; c++) {
        if (c == ' ' || (c >= '\t' && c <= '\r'))
            kind[c] = WS;
        else if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'))
            kind[c] = ALPHA;
        else if (c >= '0' && c <= '9')
            kind[c] = DIGIT;
        else
            kind[c] = OTHER;
    }
}

/* length of the word that starts at s[i], i < n */
static Py_ssize_t word_len(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    unsigned char c = s[i];
    if (c == '\'' && i + 1 < n) {
        unsigned char d = s[i + 1];
        if (d == 's' || d == 't' || d == 'm' || d == 'd')
            return 2;
        if (i + 2 < n) {
            unsigned char e = s[i + 2];
            if ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l'))
                return 3;
        }
    }
    Py_ssize_t j = (c == ' ' && i + 1 < n && kind[s[i + 1]] != WS) ? i + 1 : i;
    unsigned char k = kind[s[j]];
    if (k != WS) { /* a run of one class, after an optional space */
        Py_ssize_t e = j + 1;
        while (e < n && kind[s[e]] == k)
            e++;
        return e - i;
    }
    Py_ssize_t e = i + 1; /* whitespace: all of it at the end, else all but its last */
    while (e < n && kind[s[e]] == WS)
        e++;
    if (e == n || e - i == 1)
        return e - i;
    return e - i - 1;
}

static int ascii_span(PyObject *text, Py_ssize_t start, Py_ssize_t end,
                      const unsigned char **s) {
    if (!PyUnicode_Check(text) || !PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "ascii_split takes ASCII text only");
        return -1;
    }
    if (start < 0 || end > PyUnicode_GET_LENGTH(text) || start > end) {
        PyErr_SetString(PyExc_ValueError, "ascii_split: start/end outside the text");
        return -1;
    }
    *s = (const unsigned char *)PyUnicode_1BYTE_DATA(text);
    return 0;
}

static PyObject *word_at(const unsigned char *s, Py_ssize_t i, Py_ssize_t len) {
    PyObject *w = PyUnicode_New(len, 127);
    if (w != NULL)
        memcpy(PyUnicode_1BYTE_DATA(w), s + i, (size_t)len);
    return w;
}

/* split(text, start, end) -> list of words (what SPLIT_PATTERN.findall gives) */
static PyObject *split(PyObject *self, PyObject *args) {
    PyObject *text;
    Py_ssize_t start, end;
    const unsigned char *s;
    if (!PyArg_ParseTuple(args, "Unn", &text, &start, &end) || ascii_span(text, start, end, &s))
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = start; out != NULL && i < end;) {
        Py_ssize_t len = word_len(s, i, end);
        PyObject *w = word_at(s, i, len);
        if (w == NULL || PyList_Append(out, w) < 0)
            Py_CLEAR(out);
        Py_XDECREF(w);
        i += len;
    }
    return out;
}

/* encode(text, start, end, cache, out): out += cache[word] for each word; the cache is the
 * encoder's word -> ids tuple dict (a miss calls its __missing__: the model's BPE) */
static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *text, *cache, *out;
    Py_ssize_t start, end;
    const unsigned char *s;
    if (!PyArg_ParseTuple(args, "UnnO!O!", &text, &start, &end, &PyDict_Type, &cache,
                          &PyList_Type, &out) ||
        ascii_span(text, start, end, &s))
        return NULL;
    for (Py_ssize_t i = start; i < end;) {
        Py_ssize_t len = word_len(s, i, end);
        PyObject *w = word_at(s, i, len);
        if (w == NULL)
            return NULL;
        PyObject *ids = PyDict_GetItemWithError(cache, w); /* borrowed */
        if (ids != NULL) {
            Py_INCREF(ids);
        } else if (!PyErr_Occurred()) {
            ids = PyObject_GetItem(cache, w); /* the miss: __missing__ */
        }
        Py_DECREF(w);
        if (ids == NULL)
            return NULL;
        if (!PyTuple_Check(ids)) {
            Py_DECREF(ids);
            PyErr_SetString(PyExc_TypeError, "the word cache holds tuples of ids");
            return NULL;
        }
        for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(ids); t++) {
            if (PyList_Append(out, PyTuple_GET_ITEM(ids, t)) < 0) {
                Py_DECREF(ids);
                return NULL;
            }
        }
        Py_DECREF(ids);
        i += len;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(text, start, end) -> the words of text[start:end]"},
    {"encode", encode, METH_VARARGS,
     "encode(text, start, end, cache, out): out += cache[w] for each word w of text[start:end]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tandem_ascii_split", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit_tandem_ascii_split(void) {
    init_kinds();
    return PyModule_Create(&module);
}
