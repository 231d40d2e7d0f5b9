// PyInit__native: makes the library an importable extension module (so `import
// purlin_sglang._native` and the editable-install finder locate it). All real entry points are
// the extern "C" functions of purlin/native.h, reached through ctypes; this file holds no logic.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "purlin/native.h"

static PyObject* abi_version(PyObject*, PyObject*) { return PyLong_FromLong(purlin_native_abi_version()); }

static PyObject* build_info(PyObject*, PyObject*) { return PyUnicode_FromString(purlin_native_build_info()); }

static PyMethodDef kMethods[] = {
    {"abi_version", abi_version, METH_NOARGS, "The native ABI version (int)."},
    {"build_info", build_info, METH_NOARGS, "The build info as a JSON string."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_native",
    "purlin_sglang native library; use purlin_sglang.native, not this module.", -1, kMethods,
};

PyMODINIT_FUNC PyInit__native(void) {
  return PyModule_Create(&kModule);
}
