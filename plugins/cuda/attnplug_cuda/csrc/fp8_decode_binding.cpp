// attnplug CUDA plugin: torch binding of the FP8 decode kernel (fp8_decode.cu; fp8_decode.h says
// what it computes).
//
// Python:  fp8_decode(q, k_cache, v_cache, out, table, rows, start, seq_lens, k_scale, v_scale,
//                     sinks, new_k, new_v, loc, window, qk_scale, softcap_log2, pdl,
//                     wait_at_entry) -> bool
//   q, out             [bs, H, 128]   bfloat16 / float16 (one token a request), last dim dense
//   k_cache, v_cache   [S, Hkv, 128]  float8_e4m3fn / float8_e5m2, the same strides, last dim
//                                     dense, rows 16-byte aligned; H = G * Hkv, G in 1, 2, 4, 8
//   table              [R, W] int32, columns dense
//   rows, seq_lens     [>= bs] int32 / int64; start [>= bs] int32 / int64 or None
//   k_scale, v_scale   float32 [Hkv] or [1] (any stride, 0 included)
//   sinks              float32 [H] or None
//   new_k, new_v, loc  [bs, Hkv, 128] q's dtype (heads dense) and [>= bs] int32 / int64, or
//                      all three None: nothing stored
//   window             keys of the last `window` positions; 0: a full layer
//   qk_scale, softcap_log2   kernels/common.py's log2_scales (softcap_log2 0: no soft cap)
//   Returns whether the launch used PDL. Nothing here syncs: safe inside CUDA graph capture.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings.h"
#include "fp8_decode.h"

namespace {

constexpr int64_t kHeadDim = 128;

bool is_index(const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; }

void check_on(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.defined() && t.is_cuda(), "attnplug fp8_decode: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, "attnplug fp8_decode: ", name, " is on ", t.device(), " but q is on ", device,
              "; all tensors must share one device");
}

// a per-request index vector: int32 / int64, 1-D, contiguous, at least bs entries
void check_index(const at::Tensor& t, const char* name, const at::Device& device, int64_t bs) {
  check_on(t, name, device);
  TORCH_CHECK(is_index(t), "attnplug fp8_decode: ", name, " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "attnplug fp8_decode: ", name,
              " must be a contiguous 1-D tensor, got shape ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK(t.size(0) >= bs, "attnplug fp8_decode: ", name, " has ", t.size(0), " entries for ", bs, " requests");
}

void check_scale(const at::Tensor& t, const char* name, const at::Device& device, int64_t num_kv_heads) {
  check_on(t, name, device);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && (t.size(0) == 1 || t.size(0) == num_kv_heads),
              "attnplug fp8_decode: ", name, " must be float32 [", num_kv_heads, "] or [1], got ", t.scalar_type(),
              " ", t.sizes());
}

bool fp8_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
                const at::Tensor& table, const at::Tensor& rows, const c10::optional<at::Tensor>& start,
                const at::Tensor& seq_lens, const at::Tensor& k_scale, const at::Tensor& v_scale,
                const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& new_k,
                const c10::optional<at::Tensor>& new_v, const c10::optional<at::Tensor>& loc, int64_t window,
                double qk_scale, double softcap_log2, bool pdl, bool wait_at_entry) {
  TORCH_CHECK(q.defined() && q.is_cuda(), "attnplug fp8_decode: q must be a CUDA tensor");
  const at::Device device = q.device();
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "attnplug fp8_decode: q must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kHeadDim && q.stride(2) == 1, "attnplug fp8_decode: q must be [bs, H, ",
              kHeadDim, "] with a dense last dim, got shape ", q.sizes(), " strides ", q.strides());
  check_on(out, "out", device);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1,
              "attnplug fp8_decode: out must be q's shape ", q.sizes(), " and dtype ", q.scalar_type(),
              " with a dense last dim, got ", out.sizes(), " ", out.scalar_type());
  const int64_t bs = q.size(0), num_heads = q.size(1);

  check_on(k_cache, "k_cache", device);
  check_on(v_cache, "v_cache", device);
  const bool e5m2 = k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(e5m2 || k_cache.scalar_type() == at::kFloat8_e4m3fn,
              "attnplug fp8_decode: k_cache must be float8_e4m3fn or float8_e5m2, got ", k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "attnplug fp8_decode: v_cache has dtype ",
              v_cache.scalar_type(), " but k_cache has ", k_cache.scalar_type());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(2) == kHeadDim && k_cache.stride(2) == 1,
              "attnplug fp8_decode: k_cache must be [S, Hkv, ", kHeadDim, "] with a dense last dim, got shape ",
              k_cache.sizes(), " strides ", k_cache.strides());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "attnplug fp8_decode: v_cache must have k_cache's shape and strides, got ", v_cache.sizes(), " ",
              v_cache.strides(), " and ", k_cache.sizes(), " ", k_cache.strides());
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "attnplug fp8_decode: q's ", num_heads,
              " heads are not a multiple of the cache's ", num_kv_heads, " kv heads");

  check_on(table, "table", device);
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && (table.size(1) <= 1 || table.stride(1) == 1),
              "attnplug fp8_decode: table must be int32 [R, W] with dense columns, got ", table.scalar_type(), " ",
              table.sizes(), " strides ", table.strides());
  check_index(rows, "rows", device, bs);
  check_index(seq_lens, "seq_lens", device, bs);
  if (start.has_value()) check_index(*start, "start", device, bs);
  check_scale(k_scale, "k_scale", device, num_kv_heads);
  check_scale(v_scale, "v_scale", device, num_kv_heads);
  if (sinks.has_value()) {
    check_on(*sinks, "sinks", device);
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == num_heads &&
                    sinks->is_contiguous(),
                "attnplug fp8_decode: sinks must be contiguous float32 [", num_heads, "], got ", sinks->scalar_type(),
                " ", sinks->sizes());
  }
  const bool store = new_k.has_value() || new_v.has_value() || loc.has_value();
  if (store) {
    TORCH_CHECK(new_k.has_value() && new_v.has_value() && loc.has_value(),
                "attnplug fp8_decode: new_k, new_v and loc come together (all three or none)");
    for (const auto* pair : {&*new_k, &*new_v}) {
      const char* name = pair == &*new_k ? "new_k" : "new_v";
      check_on(*pair, name, device);
      TORCH_CHECK(pair->scalar_type() == q.scalar_type() && pair->dim() == 3 && pair->size(0) == bs &&
                      pair->size(1) == num_kv_heads && pair->size(2) == kHeadDim && pair->stride(2) == 1 &&
                      (num_kv_heads == 1 || pair->stride(1) == kHeadDim),
                  "attnplug fp8_decode: ", name, " must be ", q.scalar_type(), " [", bs, ", ", num_kv_heads, ", ",
                  kHeadDim, "] with dense heads, got ", pair->scalar_type(), " ", pair->sizes(), " strides ",
                  pair->strides());
    }
    check_index(*loc, "loc", device, bs);
  }
  TORCH_CHECK(window >= 0 && window <= 0x7fffffff, "attnplug fp8_decode: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(qk_scale > 0.0 && softcap_log2 >= 0.0, "attnplug fp8_decode: qk_scale must be > 0 and softcap_log2 >= 0");
  TORCH_CHECK(k_cache.size(0) <= 0x7fffffff && table.size(0) <= 0x7fffffff && table.size(1) <= 0x7fffffff &&
                  bs <= 0x7fffffff,
              "attnplug fp8_decode: the cache, the table and the batch must each hold fewer than 2^31 entries");

  AttnplugFp8DecodeParams p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.k_cache = static_cast<uint8_t*>(k_cache.data_ptr());
  p.v_cache = static_cast<uint8_t*>(v_cache.data_ptr());
  p.table = table.data_ptr<int32_t>();
  p.rows = rows.data_ptr();
  p.start = start.has_value() ? start->data_ptr() : nullptr;
  p.seq_lens = seq_lens.data_ptr();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.new_k = store ? new_k->data_ptr() : nullptr;
  p.new_v = store ? new_v->data_ptr() : nullptr;
  p.loc = store ? loc->data_ptr() : nullptr;
  p.k_scale_stride = k_scale.size(0) == 1 ? 0 : k_scale.stride(0);
  p.v_scale_stride = v_scale.size(0) == 1 ? 0 : v_scale.stride(0);
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.out_stride_t = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.new_k_stride_t = store ? new_k->stride(0) : 0;
  p.new_v_stride_t = store ? new_v->stride(0) : 0;
  p.kv_stride = k_cache.stride(0);
  p.kv_head_stride = num_kv_heads == 1 ? kHeadDim : k_cache.stride(1);
  p.table_stride = table.stride(0);
  p.table_width = static_cast<int32_t>(table.size(1));
  p.num_table_rows = static_cast<int32_t>(table.size(0));
  p.num_slots = static_cast<int32_t>(k_cache.size(0));
  p.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  p.num_reqs = static_cast<int32_t>(bs);
  p.group = static_cast<int32_t>(num_heads / num_kv_heads);
  p.window = static_cast<int32_t>(window);
  p.rows_int64 = rows.scalar_type() == at::kLong;
  p.start_int64 = start.has_value() && start->scalar_type() == at::kLong;
  p.seq_lens_int64 = seq_lens.scalar_type() == at::kLong;
  p.loc_int64 = store && loc->scalar_type() == at::kLong;
  p.e5m2 = e5m2;
  p.q_fp16 = q.scalar_type() == at::kHalf;
  p.qk_scale = static_cast<float>(qk_scale);
  p.softcap_log2 = static_cast<float>(softcap_log2);
  const char* problem = attnplug_fp8_decode_problem(&p);
  TORCH_CHECK(problem == nullptr, "attnplug fp8_decode: ", problem ? problem : "", " (k_cache shape ",
              k_cache.sizes(), " strides ", k_cache.strides(), ", q heads ", num_heads, ")");
  if (bs == 0) return false;

  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  bool pdl_used = false;
  const cudaError_t err = attnplug_fp8_decode_launch(&p, pdl, wait_at_entry, stream, &pdl_used);
  TORCH_CHECK(err == cudaSuccess, "attnplug fp8_decode: CUDA launch failed: ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
  return pdl_used;
}

}  // namespace

void attnplug_register_fp8_decode(pybind11::module_& m) {
  m.def("fp8_decode", &fp8_decode,
        "Decode attention over an FP8 paged KV cache (one token a request, head dim 128), storing the step's "
        "rows first when new_k / new_v / loc are given; on the current CUDA stream. Returns whether PDL was used.",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("table"), py::arg("rows"),
        py::arg("start"), py::arg("seq_lens"), py::arg("k_scale"), py::arg("v_scale"), py::arg("sinks"),
        py::arg("new_k"), py::arg("new_v"), py::arg("loc"), py::arg("window"), py::arg("qk_scale"),
        py::arg("softcap_log2"), py::arg("pdl") = false, py::arg("wait_at_entry") = true);
}
