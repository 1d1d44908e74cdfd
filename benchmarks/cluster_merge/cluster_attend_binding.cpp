// Torch binding of the cluster attention kernel (cluster_attend.cu), built by
// benchmarks/cluster_merge.py.
//
// Python:
//   cluster_attend(q, k, v, loc, k_cache, v_cache, out, cu_q_lens, seq_lens, table,
//                  table_rows, table_start, sinks, qk_scale, softcap_log2, window, rows,
//                  splits, pdl, prologue, release_early) -> bool
//   launch_probe(out, groups, splits, cluster, pdl)   (cluster_attend.h)
//   stamps(n) -> int64 tensor [n]   (built with CLUSTER_ATTEND_STAMPS only)
// Shapes and meaning: the plugin's kernels/store_attend.py (the Triton kernel with the
// same semantics) and cluster_attend.h. loc, table_start and sinks may be None. Returns
// whether the launch used PDL. Nothing here syncs: the call is safe inside CUDA graph
// capture. The script's wrapper checks shapes first (the plugin's check_attention_args);
// the checks here guard the pointers the kernel dereferences.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cluster_attend.h"

namespace {

void check_on(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.device() == device, "attnplug cluster_attend: ", name,
              " must be a CUDA tensor on ", device);
}

void check_index(const at::Tensor& t, const char* name, const at::Device& device, int64_t at_least) {
  check_on(t, name, device);
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "attnplug cluster_attend: ", name, " must be 1-D contiguous");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "attnplug cluster_attend: ", name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.size(0) >= at_least, "attnplug cluster_attend: ", name, " has ", t.size(0), " entries, needs >= ",
              at_least);
}

bool cluster_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& loc,
                    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
                    const at::Tensor& cu_q_lens, const at::Tensor& seq_lens, const at::Tensor& table,
                    const at::Tensor& table_rows, const c10::optional<at::Tensor>& table_start,
                    const c10::optional<at::Tensor>& sinks, double qk_scale, double softcap_log2, int64_t window,
                    int64_t rows, int64_t splits, bool pdl, bool prologue,
                    bool release_early) {
  TORCH_CHECK(q.defined() && q.is_cuda(), "attnplug cluster_attend: q must be a CUDA tensor");
  const at::Device device = q.device();
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"}, {k_cache, "k_cache"},
                                {v_cache, "v_cache"}, {out, "out"}}) {
    check_on(t, name, device);
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == q.scalar_type(), "attnplug cluster_attend: ", name,
                " must be 3-D with q's dtype ", q.scalar_type());
    TORCH_CHECK(t.stride(2) == 1, "attnplug cluster_attend: ", name, " needs a contiguous last dim");
  }
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "attnplug cluster_attend: q must be [T, H, D], last dim contiguous");
  TORCH_CHECK(out.sizes() == q.sizes(), "attnplug cluster_attend: out ", out.sizes(), " != q ", q.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "attnplug cluster_attend: k_cache and v_cache must be contiguous and of one shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && hkv >= 1 && H % hkv == 0, "attnplug cluster_attend: k_cache ", k_cache.sizes(),
              " does not fit q ", q.sizes());
  TORCH_CHECK(k.size(0) == T && k.size(1) == hkv && k.size(2) == D && v.sizes() == k.sizes(),
              "attnplug cluster_attend: k and v must be [", T, ", ", hkv, ", ", D, "]");
  TORCH_CHECK(hkv == 1 || (k.stride(1) == D && v.stride(1) == D), "attnplug cluster_attend: k / v heads must be dense");
  TORCH_CHECK(cu_q_lens.defined() && cu_q_lens.scalar_type() == at::kInt && cu_q_lens.dim() == 1 &&
                  cu_q_lens.is_contiguous() && cu_q_lens.size(0) >= 1,
              "attnplug cluster_attend: cu_q_lens must be [bs + 1] contiguous int32");
  check_on(cu_q_lens, "cu_q_lens", device);
  const int64_t bs = cu_q_lens.size(0) - 1;
  check_index(seq_lens, "seq_lens", device, bs);
  check_index(table_rows, "table_rows", device, bs);
  check_on(table, "table", device);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && (table.size(1) <= 1 || table.stride(1) == 1),
              "attnplug cluster_attend: table must be [R, width] int32 with contiguous rows");
  if (loc.has_value()) check_index(*loc, "loc", device, T);
  if (table_start.has_value()) check_index(*table_start, "table_start", device, bs);
  if (sinks.has_value()) {
    check_on(*sinks, "sinks", device);
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == H,
                "attnplug cluster_attend: sinks must be contiguous float32 [", H, "]");
  }

  AttnplugClusterAttendArgs a = {};
  a.q = q.data_ptr();
  a.k_new = k.data_ptr();
  a.v_new = v.data_ptr();
  a.loc = loc.has_value() ? loc->data_ptr() : nullptr;
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.out = out.data_ptr();
  a.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr();
  a.table = table.data_ptr<int32_t>();
  a.table_rows = table_rows.data_ptr();
  a.table_start = table_start.has_value() ? table_start->data_ptr() : nullptr;
  a.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  a.stride_qt = q.stride(0);
  a.stride_qh = q.stride(1);
  a.stride_knt = k.stride(0);
  a.stride_vnt = v.stride(0);
  a.stride_ot = out.stride(0);
  a.stride_oh = out.stride(1);
  a.stride_table = table.stride(0);
  a.num_slots = k_cache.size(0);
  a.table_width = static_cast<int32_t>(table.size(1));
  a.table_rows_len = static_cast<int32_t>(table.size(0));
  a.num_reqs = static_cast<int32_t>(bs);
  a.num_kv_heads = static_cast<int32_t>(hkv);
  a.group = static_cast<int32_t>(H / hkv);
  a.head_dim = static_cast<int32_t>(D);
  a.rows = static_cast<int32_t>(rows);
  a.window = static_cast<int32_t>(window);
  a.splits = static_cast<int32_t>(splits);
  a.qk_scale = static_cast<float>(qk_scale);
  a.softcap_log2 = static_cast<float>(softcap_log2);
  a.dtype = q.scalar_type() == at::kHalf ? CLUSTER_ATTEND_FLOAT16
                                         : (q.scalar_type() == at::kBFloat16 ? CLUSTER_ATTEND_BFLOAT16 : -1);
  a.loc_is_int64 = loc.has_value() && loc->scalar_type() == at::kLong;
  a.seq_lens_is_int64 = seq_lens.scalar_type() == at::kLong;
  a.table_rows_is_int64 = table_rows.scalar_type() == at::kLong;
  a.table_start_is_int64 = table_start.has_value() && table_start->scalar_type() == at::kLong;
  a.pdl = pdl;
  a.prologue = pdl && prologue;
  a.release_early = pdl && release_early;
  const char* why = attnplug_cluster_attend_unsupported(&a);
  TORCH_CHECK(why == nullptr, "attnplug cluster_attend: ", why == nullptr ? "" : why);
  if (T == 0 || bs == 0) {
    return false;
  }
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  bool pdl_used = false;
  const cudaError_t err = attnplug_cluster_attend_launch(&a, stream, &pdl_used);
  TORCH_CHECK(err == cudaSuccess, "attnplug cluster_attend: CUDA launch failed: ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
  return pdl_used;
}

}  // namespace

void launch_probe(const at::Tensor& out, int64_t groups, int64_t splits, bool cluster, bool pdl) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.numel() >= groups,
              "attnplug cluster launch probe: out must be a float32 CUDA tensor of >= groups elements");
  const c10::cuda::CUDAGuard device_guard(out.device());
  const cudaError_t err =
      attnplug_cluster_launch_probe(out.data_ptr<float>(), static_cast<int>(groups), static_cast<int>(splits), cluster,
                                    pdl, c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "attnplug cluster launch probe: ", cudaGetErrorString(err));
}

#ifdef CLUSTER_ATTEND_STAMPS
at::Tensor stamps(int64_t n) {
  at::Tensor t = at::zeros({n}, at::kLong);
  const cudaError_t err = attnplug_cluster_attend_read_stamps(reinterpret_cast<long long*>(t.data_ptr<int64_t>()),
                                                              static_cast<int>(n));
  TORCH_CHECK(err == cudaSuccess, "attnplug cluster_attend stamps: ", cudaGetErrorString(err));
  return t;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "One-launch small-step attention, KV splits merged in a thread-block cluster (benchmark kernel)";
  m.def("launch_probe", &launch_probe, "groups x splits CTAs doing almost nothing (cluster_attend.h)",
        py::arg("out"), py::arg("groups"), py::arg("splits"), py::arg("cluster"), py::arg("pdl"));
#ifdef CLUSTER_ATTEND_STAMPS
  m.def("stamps", &stamps, "The first n clock64 stamps (9 per CTA)", py::arg("n"));
#endif
  m.def("cluster_attend", &cluster_attend,
        "Store the step's K/V at loc, attend q over the paged cache into out, the KV splits of each "
        "(request, kv head) group merged inside one thread-block cluster; one launch, no workspace. "
        "Returns whether PDL was used.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("loc"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("out"), py::arg("cu_q_lens"), py::arg("seq_lens"), py::arg("table"), py::arg("table_rows"),
        py::arg("table_start"), py::arg("sinks"), py::arg("qk_scale"), py::arg("softcap_log2"), py::arg("window"),
        py::arg("rows"), py::arg("splits"), py::arg("pdl"), py::arg("prologue"),
        py::arg("release_early"));
}
