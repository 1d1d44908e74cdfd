// attnplug CUDA plugin: torch binding of the KV store kernel (kv_store.cu).
//
// Python:  kv_store(k, v, k_cache, v_cache, loc, pdl=False) -> bool
//   k, v               [T, Hkv, D]   fp16 / bf16 / fp32, one CUDA device
//   k_cache, v_cache   [S, Hkv, D]   same dtype; written in place
//   loc                [T]           int32 or int64 cache slots
//   For each t: k_cache[loc[t]] = k[t]; v_cache[loc[t]] = v[t]. Slots outside
//   [1, S) are skipped: 0 (the padding sink), -1 (no slot) and garbage.
//   Returns whether the launch used PDL (pdl requested and the kernel image on
//   this device is sm_90+).
// Each [Hkv, D] row must be dense; the row (token / slot) stride is free, so a
// slice of a larger buffer works without a copy. Nothing here syncs, so the
// call is safe inside CUDA graph capture.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings.h"
#include "kv_store.h"

namespace {

int dtype_code_of(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return ATTNPLUG_DTYPE_FLOAT32;
    case at::kHalf:
      return ATTNPLUG_DTYPE_FLOAT16;
    case at::kBFloat16:
      return ATTNPLUG_DTYPE_BFLOAT16;
    default:
      return -1;
  }
}

// The Hkv*D elements of each row are contiguous (size-1 dims may have any stride).
bool row_is_dense(const at::Tensor& t) {
  const int64_t h = t.size(1);
  const int64_t d = t.size(2);
  const bool d_ok = d <= 1 || t.stride(2) == 1;
  const bool h_ok = h <= 1 || t.stride(1) == d;
  return d_ok && h_ok;
}

void check_kv_tensor(const at::Tensor& t, const char* name, const at::Device& device,
                     bool is_cache) {
  TORCH_CHECK(t.defined(), "attnplug kv_store: ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), "attnplug kv_store: ", name, " must be a CUDA tensor, got device ",
              t.device());
  TORCH_CHECK(t.device() == device, "attnplug kv_store: ", name, " is on ", t.device(),
              " but k is on ", device, "; all tensors must share one device");
  TORCH_CHECK(t.dim() == 3, "attnplug kv_store: ", name, " must be 3-D [",
              is_cache ? "num_slots" : "num_tokens", ", num_kv_heads, head_dim], got shape ",
              t.sizes());
  TORCH_CHECK(dtype_code_of(t.scalar_type()) >= 0, "attnplug kv_store: ", name,
              " has dtype ", t.scalar_type(), "; expected float16, bfloat16 or float32");
  TORCH_CHECK(row_is_dense(t), "attnplug kv_store: the [num_kv_heads, head_dim] rows of ", name,
              " must be contiguous, got strides ", t.strides(), " for shape ", t.sizes());
  TORCH_CHECK(t.stride(0) >= 0, "attnplug kv_store: ", name, " has a negative row stride ",
              t.stride(0));
  if (is_cache) {
    TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2),
                "attnplug kv_store: the rows of ", name, " overlap (row stride ", t.stride(0),
                " < num_kv_heads * head_dim = ", t.size(1) * t.size(2), ")");
  }
}

bool kv_store(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache,
              const at::Tensor& loc, bool pdl) {
  TORCH_CHECK(k.defined() && k.is_cuda(), "attnplug kv_store: k must be a CUDA tensor, got ",
              k.defined() ? c10::str(k.device()) : std::string("an undefined tensor"));
  const at::Device device = k.device();
  check_kv_tensor(k, "k", device, /*is_cache=*/false);
  check_kv_tensor(v, "v", device, /*is_cache=*/false);
  check_kv_tensor(k_cache, "k_cache", device, /*is_cache=*/true);
  check_kv_tensor(v_cache, "v_cache", device, /*is_cache=*/true);

  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "attnplug kv_store: v has dtype ",
              v.scalar_type(), " but k has ", k.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type(), "attnplug kv_store: k_cache has dtype ",
              k_cache.scalar_type(), " but k has ", k.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k.scalar_type(), "attnplug kv_store: v_cache has dtype ",
              v_cache.scalar_type(), " but k has ", k.scalar_type());

  const int64_t num_tokens = k.size(0);
  const int64_t num_heads = k.size(1);
  const int64_t head_dim = k.size(2);
  TORCH_CHECK(v.sizes() == k.sizes(), "attnplug kv_store: v has shape ", v.sizes(),
              " but k has ", k.sizes());
  TORCH_CHECK(k_cache.size(1) == num_heads && k_cache.size(2) == head_dim,
              "attnplug kv_store: k_cache rows are [", k_cache.size(1), ", ", k_cache.size(2),
              "] but k rows are [", num_heads, ", ", head_dim, "]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "attnplug kv_store: v_cache has shape ",
              v_cache.sizes(), " but k_cache has ", k_cache.sizes());

  TORCH_CHECK(loc.defined(), "attnplug kv_store: loc is undefined");
  TORCH_CHECK(loc.is_cuda() && loc.device() == device,
              "attnplug kv_store: loc must be on k's device ", device, ", got ", loc.device());
  TORCH_CHECK(loc.scalar_type() == at::kInt || loc.scalar_type() == at::kLong,
              "attnplug kv_store: loc must be int32 or int64, got ", loc.scalar_type());
  TORCH_CHECK(loc.dim() == 1, "attnplug kv_store: loc must be 1-D [num_tokens], got shape ",
              loc.sizes());
  TORCH_CHECK(loc.size(0) == num_tokens, "attnplug kv_store: loc has ", loc.size(0),
              " entries but k has ", num_tokens, " tokens");
  TORCH_CHECK(loc.is_contiguous(), "attnplug kv_store: loc must be contiguous, got stride ",
              loc.strides());

  if (num_tokens == 0 || num_heads * head_dim == 0) {
    return false;
  }

  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  bool pdl_used = false;
  const cudaError_t err = attnplug_kv_store_launch(
      k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), loc.data_ptr(),
      loc.scalar_type() == at::kLong, dtype_code_of(k.scalar_type()), num_tokens,
      k_cache.size(0), num_heads * head_dim, k.stride(0), v.stride(0), k_cache.stride(0),
      v_cache.stride(0), pdl, stream, &pdl_used);
  TORCH_CHECK(err == cudaSuccess, "attnplug kv_store: CUDA launch failed: ",
              cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  return pdl_used;
}

// Width in bytes of the loads/stores kv_store would use for these tensors
// (16 = vectorised fast path). For tests and diagnostics.
int64_t vec_bytes(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "attnplug vec_bytes: k, v, k_cache and v_cache must be 3-D");
  const int code = dtype_code_of(k.scalar_type());
  TORCH_CHECK(code >= 0, "attnplug vec_bytes: unsupported dtype ", k.scalar_type());
  return attnplug_kv_store_vec_bytes(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
                                     v_cache.data_ptr(), code, k.size(1) * k.size(2),
                                     k.stride(0), v.stride(0), k_cache.stride(0),
                                     v_cache.stride(0));
}

}  // namespace

void attnplug_register_kv_store(pybind11::module_& m) {
  m.def("kv_store", &kv_store,
        "k_cache[loc[t]] = k[t]; v_cache[loc[t]] = v[t] for every token t, in place, on the "
        "current CUDA stream. Slots outside [1, num_slots) are skipped. Returns whether PDL "
        "was used.",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("loc"),
        py::arg("pdl") = false);
  m.def("vec_bytes", &vec_bytes,
        "Width in bytes of the kernel's loads/stores for these tensors (16 = fast path).",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"));
}
