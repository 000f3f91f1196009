// overlapckpt's optional torch extension: the per-tensor passes a snapshot's hooks make.
//
// Why native: at a snapshot's start, inside optimizer.step(), the hooks check that every
// tracked tensor is still the one the layout holds (live_identity.py), check the host
// scalars' addresses before gathering them (host_values.py), and each replay window step
// reads the gradients it logs (gradlog.py). A Mixture-of-Experts rank holds tens of
// thousands of tensors; from Python each pass costs a call per tensor (0.05 to 0.4 us:
// `map(operator.is_)`, `Tensor.data_ptr`, `.grad`), milliseconds per step in all. Here
// each is one loop over the same objects, with no Python object made per tensor.
//
// Every function has a Python twin in overlapckpt/train/copying/tensor_passes.py with the
// same answers, and tests/test_tensor_passes.py holds the two to them. Built ahead by
// `make install` (tensor_passes.build()), never inside a training step; where it is not
// built, the twin runs.
//
// Every entry point holds the GIL (a plain METH_FASTCALL function), and raises TypeError,
// as the twin does, for an argument of the wrong type instead of reading it.

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

bool expect_list(PyObject* obj, const char* what) {
  if (!PyList_Check(obj)) {  // a subclass (TensorRun) keeps its items in the list itself
    PyErr_Format(PyExc_TypeError, "%s must be a list, not %.100s", what, Py_TYPE(obj)->tp_name);
    return false;
  }
  return true;
}

// same_dict_contents(dicts: list[dict], lengths: list[int], values: list) -> bool
// Every dict has its captured length, and their values, chained in order, are the very
// objects of `values` (compared by identity: no __eq__ runs).
PyObject* same_dict_contents(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "same_dict_contents(dicts, lengths, values) takes 3 arguments");
    return nullptr;
  }
  PyObject *dicts = args[0], *lengths = args[1], *values = args[2];
  if (!expect_list(dicts, "dicts") || !expect_list(lengths, "lengths") || !expect_list(values, "values")) {
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(dicts);
  if (PyList_GET_SIZE(lengths) != count) {
    Py_RETURN_FALSE;
  }
  const Py_ssize_t total = PyList_GET_SIZE(values);
  Py_ssize_t at = 0;
  for (Py_ssize_t k = 0; k < count; ++k) {
    PyObject* d = PyList_GET_ITEM(dicts, k);
    if (!PyDict_Check(d)) {
      PyErr_Format(PyExc_TypeError, "dicts[%zd] must be a dict, not %.100s", k, Py_TYPE(d)->tp_name);
      return nullptr;
    }
    const Py_ssize_t expected = PyLong_AsSsize_t(PyList_GET_ITEM(lengths, k));
    if (expected == -1 && PyErr_Occurred()) {
      return nullptr;
    }
    if (PyDict_GET_SIZE(d) != expected || at + expected > total) {
      Py_RETURN_FALSE;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    // PyDict_Next borrows: nothing here runs Python code that could change the dict.
    while (PyDict_Next(d, &pos, &key, &value)) {
      if (value != PyList_GET_ITEM(values, at)) {
        Py_RETURN_FALSE;
      }
      ++at;
    }
  }
  if (at != total) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// same_items(items: list, expected: list) -> bool: as many, and the very objects, in order.
PyObject* same_items(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "same_items(items, expected) takes 2 arguments");
    return nullptr;
  }
  if (!expect_list(args[0], "items") || !expect_list(args[1], "expected")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  if (PyList_GET_SIZE(args[1]) != n) {
    Py_RETURN_FALSE;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (PyList_GET_ITEM(args[0], k) != PyList_GET_ITEM(args[1], k)) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// data_ptrs_equal(tensors: list[Tensor], expected: Tensor[int64]) -> bool
// Each tensor's data pointer (what Tensor.data_ptr() returns) equals expected[k].
PyObject* data_ptrs_equal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "data_ptrs_equal(tensors, expected) takes 2 arguments");
    return nullptr;
  }
  if (!expect_list(args[0], "tensors")) {
    return nullptr;
  }
  if (!THPVariable_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "expected must be an int64 tensor of data pointers");
    return nullptr;
  }
  const at::Tensor& expected = THPVariable_Unpack(args[1]);
  if (expected.scalar_type() != at::kLong || !expected.is_cpu() || !expected.is_contiguous() || expected.dim() != 1) {
    PyErr_SetString(PyExc_TypeError, "expected must be a 1-dim contiguous int64 CPU tensor of data pointers");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  if (expected.numel() != n) {
    Py_RETURN_FALSE;
  }
  const int64_t* pointers = expected.data_ptr<int64_t>();
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* item = PyList_GET_ITEM(args[0], k);
    int64_t address = 0;
    if (THPVariable_CheckExact(item)) {
      // As Tensor.data_ptr() reads it for a Tensor or Parameter: the storage's address plus the offset.
      // A tensor with no storage (sparse) throws, as Tensor.data_ptr() raises: never past this C frame.
      try {
        address = reinterpret_cast<int64_t>(THPVariable_Unpack(item).const_data_ptr());
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
      }
    } else {
      // A subclass may answer data_ptr() through __torch_function__: ask it, as the twin does.
      PyObject* answer = PyObject_CallMethod(item, "data_ptr", nullptr);
      if (answer == nullptr) {
        return nullptr;
      }
      address = PyLong_AsLongLong(answer);
      Py_DECREF(answer);
      if (address == -1 && PyErr_Occurred()) {
        return nullptr;
      }
    }
    if (address != pointers[k]) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// grads_of(params: list[Tensor]) -> list[Tensor | None]: each one's .grad, as Python reads it.
PyObject* grads_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) {
    PyErr_SetString(PyExc_TypeError, "grads_of(params) takes 1 argument");
    return nullptr;
  }
  if (!expect_list(args[0], "params")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* item = PyList_GET_ITEM(args[0], k);
    // A subclass may answer .grad through __torch_function__: only a Tensor or Parameter
    // is read here; any other object is asked, as the twin asks it.
    if (!THPVariable_CheckExact(item)) {
      PyObject* grad = PyObject_GetAttrString(item, "grad");
      if (grad == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      PyList_SET_ITEM(out, k, grad);
      continue;
    }
    PyObject* wrapped = nullptr;
    try {
      // The grad's own Python object where it has one; None when it is undefined.
      wrapped = THPVariable_Wrap(THPVariable_Unpack(item).grad());
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    if (wrapped == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, k, wrapped);
  }
  return out;
}

PyMethodDef methods[] = {
    {"same_dict_contents", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(same_dict_contents)), METH_FASTCALL,
     "Every dict has its length, and their chained values are the very objects of values."},
    {"same_items", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(same_items)), METH_FASTCALL,
     "Two lists hold the very same objects, in order."},
    {"data_ptrs_equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(data_ptrs_equal)), METH_FASTCALL,
     "Each tensor's data pointer equals the int64 tensor's entry."},
    {"grads_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_of)), METH_FASTCALL,
     "Each parameter's .grad (None where it has none)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "overlapckpt_tensor_passes", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_overlapckpt_tensor_passes() { return PyModule_Create(&module_def); }
