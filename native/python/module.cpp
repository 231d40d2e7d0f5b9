// PyInit__native: makes the library an importable extension module (so `import
// purlin_sglang._native` and the editable-install finder locate it). The entry points are the
// extern "C" functions of purlin/native.h, reached through ctypes, plus ONE function called from
// Python directly: snac_launch, the steady state of an eager collective call (below).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "purlin/native.h"

#if PURLIN_WITH_CUDA
// snac_launch(params, input, output, seq, stream) -> int: one call of a prepared launch
// (engines/cuda.py _Launch). `params` is the address of that call shape's own PurlinSnacParams
// (table, dtype and call description already filled in by the engine); this writes the call's
// input and output pointers and its call number (desc_seq) into it and runs purlin_snac_execute
// on `stream` (a cudaStream_t as an int). Returns that cudaError_t code (0: launched).
//
// Why not ctypes: a ctypes call converts each argument through its argtypes and costs about as much
// as the rest of the launch's Python; this is a vectorcall with five ints. The GIL is released
// around the launch as ctypes does: a launch can block while the stream's queue is full, and in
// loopback the kernels in that queue wait for peer ranks whose threads need the GIL to launch.
static PyObject* snac_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "snac_launch takes 5 arguments (params, input, output, seq, stream), got %zd",
                 nargs);
    return nullptr;
  }
  void* params = PyLong_AsVoidPtr(args[0]);
  void* input = PyLong_AsVoidPtr(args[1]);
  void* output = PyLong_AsVoidPtr(args[2]);
  const long long seq = PyLong_AsLongLong(args[3]);
  void* stream = PyLong_AsVoidPtr(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (params == nullptr) {
    PyErr_SetString(PyExc_ValueError, "snac_launch: params is a null pointer");
    return nullptr;
  }
  auto* p = static_cast<PurlinSnacParams*>(params);
  p->input = input;
  p->output = output;
  p->desc_seq = seq;
  int code = 0;
  Py_BEGIN_ALLOW_THREADS
  code = purlin_snac_execute(p, stream);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(code);
}
#endif

static PyObject* abi_version(PyObject*, PyObject*) { return PyLong_FromLong(purlin_native_abi_version()); }

static PyObject* build_info(PyObject*, PyObject*) { return PyUnicode_FromString(purlin_native_build_info()); }

static PyMethodDef kMethods[] = {
    {"abi_version", abi_version, METH_NOARGS, "The native ABI version (int)."},
    {"build_info", build_info, METH_NOARGS, "The build info as a JSON string."},
#if PURLIN_WITH_CUDA
    {"snac_launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(snac_launch)), METH_FASTCALL,
     "snac_launch(params, input, output, seq, stream) -> cudaError_t: one launch of a prepared SnacParams."},
#endif
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_native",
    "purlin_sglang native library; use purlin_sglang.native, not this module.", -1, kMethods,
};

PyMODINIT_FUNC PyInit__native(void) {
  return PyModule_Create(&kModule);
}
