// attnplug CUDA plugin: the one extension module holding every C++ kernel's binding.

#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnplug CUDA C++ kernels: the KV store, with PDL";
  attnplug_register_kv_store(m);
}
