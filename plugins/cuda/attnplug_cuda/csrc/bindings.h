// attnplug CUDA plugin: the torch bindings of the C++ kernels, one register function per
// kernel family, gathered into one extension module by module.cpp.
#pragma once

#include <torch/extension.h>

void attnplug_register_kv_store(pybind11::module_& m);  // kv_store_binding.cpp
