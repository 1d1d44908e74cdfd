// attnplug CUDA plugin: torch binding of the staged small-step attention (staged_attend.cu).
//
// Python:
//   staged_attend(q, k, v, loc, k_cache, v_cache, out, workspace, tickets, cu_q_lens,
//                 seq_lens, table, table_rows, table_start, sinks, qk_scale, softcap_log2,
//                 window, max_q_len, splits, capacity, pdl, prologue, release_early,
//                 resident=False, trace=None) -> bool
// Shapes and meaning: staged_attend.h and the Python wrapper (attnplug_cuda/staged_attend.py),
// which checks shapes first with the plugin's check_attention_args; the checks here guard
// every pointer the kernel dereferences. loc, table_start and sinks may be None; window 0:
// no window. Returns whether the launch used PDL. Nothing here syncs: the call is safe
// inside CUDA graph capture.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <utility>

#include "bindings.h"
#include "staged_attend.h"

namespace {

void check_on(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.device() == device, "attnplug staged_attend: ", name,
              " must be a CUDA tensor on ", device);
}

void check_index(const at::Tensor& t, const char* name, const at::Device& device, int64_t at_least) {
  check_on(t, name, device);
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "attnplug staged_attend: ", name, " must be 1-D contiguous");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "attnplug staged_attend: ", name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.size(0) >= at_least, "attnplug staged_attend: ", name, " has ", t.size(0), " entries, needs >= ",
              at_least);
}

bool staged_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& loc,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
                   const at::Tensor& workspace, const at::Tensor& tickets, const at::Tensor& cu_q_lens,
                   const at::Tensor& seq_lens, const at::Tensor& table, const at::Tensor& table_rows,
                   const c10::optional<at::Tensor>& table_start, const c10::optional<at::Tensor>& sinks,
                   double qk_scale, double softcap_log2, int64_t window, int64_t max_q_len, int64_t splits,
                   int64_t capacity, bool pdl, bool prologue, bool release_early, bool resident,
                   const c10::optional<at::Tensor>& trace) {
  TORCH_CHECK(q.defined() && q.is_cuda(), "attnplug staged_attend: q must be a CUDA tensor");
  const at::Device device = q.device();
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"}, {k_cache, "k_cache"},
                                {v_cache, "v_cache"}, {out, "out"}}) {
    check_on(t, name, device);
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == q.scalar_type(), "attnplug staged_attend: ", name,
                " must be 3-D with q's dtype ", q.scalar_type());
    TORCH_CHECK(t.stride(2) == 1, "attnplug staged_attend: ", name, " needs a contiguous last dim");
  }
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "attnplug staged_attend: q must be [T, H, D], last dim contiguous");
  TORCH_CHECK(out.sizes() == q.sizes(), "attnplug staged_attend: out ", out.sizes(), " != q ", q.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "attnplug staged_attend: k_cache and v_cache must be contiguous and of one shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && hkv >= 1 && H % hkv == 0, "attnplug staged_attend: k_cache ", k_cache.sizes(),
              " does not fit q ", q.sizes());
  TORCH_CHECK(k.size(0) == T && k.size(1) == hkv && k.size(2) == D && v.sizes() == k.sizes(),
              "attnplug staged_attend: k and v must be [", T, ", ", hkv, ", ", D, "]");
  TORCH_CHECK(hkv == 1 || (k.stride(1) == D && v.stride(1) == D), "attnplug staged_attend: k / v heads must be dense");
  check_on(cu_q_lens, "cu_q_lens", device);
  TORCH_CHECK(cu_q_lens.scalar_type() == at::kInt && cu_q_lens.dim() == 1 && cu_q_lens.is_contiguous() &&
                  cu_q_lens.size(0) >= 1,
              "attnplug staged_attend: cu_q_lens must be [bs + 1] contiguous int32");
  const int64_t bs = cu_q_lens.size(0) - 1;
  check_index(seq_lens, "seq_lens", device, bs);
  check_index(table_rows, "table_rows", device, bs);
  check_on(table, "table", device);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && (table.size(1) <= 1 || table.stride(1) == 1),
              "attnplug staged_attend: table must be [R, width] int32 with contiguous rows");
  if (loc.has_value()) check_index(*loc, "loc", device, T);
  if (table_start.has_value()) check_index(*table_start, "table_start", device, bs);
  if (sinks.has_value()) {
    check_on(*sinks, "sinks", device);
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == H,
                "attnplug staged_attend: sinks must be contiguous float32 [", H, "]");
  }
  const int64_t groups = bs * hkv;
  if (trace.has_value()) {
    check_on(*trace, "trace", device);
    TORCH_CHECK(trace->scalar_type() == at::kLong && trace->is_contiguous() && trace->numel() >= groups * splits * 8,
                "attnplug staged_attend: trace must be contiguous int64 with >= ", groups * splits * 8, " entries");
  }
  if (splits > 1) {
    check_on(workspace, "workspace", device);
    check_on(tickets, "tickets", device);
    TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous(),
                "attnplug staged_attend: workspace must be contiguous float32");
    TORCH_CHECK(tickets.scalar_type() == at::kInt && tickets.is_contiguous() && tickets.numel() >= groups,
                "attnplug staged_attend: tickets must be contiguous int32 with >= ", groups, " entries");
    const size_t need = attnplug_staged_attend_workspace_bytes(static_cast<int>(groups * splits), static_cast<int>(D));
    TORCH_CHECK(static_cast<size_t>(workspace.numel()) * sizeof(float) >= need, "attnplug staged_attend: workspace has ",
                workspace.numel(), " float32 elements, needs ", (need + 3) / 4);
  }
  TORCH_CHECK(groups <= 65535, "attnplug staged_attend: ", groups, " (request, kv head) groups exceed the grid limit 65535");

  AttnplugStagedAttendArgs a = {};
  a.q = q.data_ptr();
  a.k_new = k.data_ptr();
  a.v_new = v.data_ptr();
  a.loc = loc.has_value() ? loc->data_ptr() : nullptr;
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.out = out.data_ptr();
  a.workspace = splits > 1 ? workspace.data_ptr<float>() : nullptr;
  a.tickets = splits > 1 ? tickets.data_ptr<int32_t>() : nullptr;
  a.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr();
  a.table = table.data_ptr<int32_t>();
  a.table_rows = table_rows.data_ptr();
  a.table_start = table_start.has_value() ? table_start->data_ptr() : nullptr;
  a.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  a.trace = trace.has_value() ? trace->data_ptr<int64_t>() : nullptr;
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
  a.window = static_cast<int32_t>(window);
  a.splits = static_cast<int32_t>(splits);
  a.capacity = static_cast<int32_t>(capacity);
  a.qk_scale = static_cast<float>(qk_scale);
  a.softcap_log2 = static_cast<float>(softcap_log2);
  a.dtype = q.scalar_type() == at::kHalf ? STAGED_ATTEND_FLOAT16
                                         : (q.scalar_type() == at::kBFloat16 ? STAGED_ATTEND_BFLOAT16 : -1);
  a.loc_is_int64 = loc.has_value() && loc->scalar_type() == at::kLong;
  a.seq_lens_is_int64 = seq_lens.scalar_type() == at::kLong;
  a.table_rows_is_int64 = table_rows.scalar_type() == at::kLong;
  a.table_start_is_int64 = table_start.has_value() && table_start->scalar_type() == at::kLong;
  a.pdl = pdl;
  a.prologue = pdl && prologue;
  a.release_early = pdl && release_early;
  a.resident = resident;
  const char* why = attnplug_staged_attend_unsupported(&a, static_cast<int>(max_q_len));
  TORCH_CHECK(why == nullptr, "attnplug staged_attend: ", why == nullptr ? "" : why);
  if (T == 0 || bs == 0) {
    return false;
  }
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  bool pdl_used = false;
  const cudaError_t err = attnplug_staged_attend_launch(&a, static_cast<int>(max_q_len), stream, &pdl_used);
  TORCH_CHECK(err == cudaSuccess, "attnplug staged_attend: CUDA launch failed: ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
  return pdl_used;
}

}  // namespace

void attnplug_register_staged_attend(pybind11::module_& m) {
  m.def("staged_attend", &staged_attend,
        "Store the step's K/V at loc, attend q over the paged cache into out, each CTA's keys staged in "
        "shared memory before the PDL wait; KV splits merged by the last CTA of each group (resident: "
        "one CTA a group holding its cached keys in registers). Returns whether PDL was used.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("loc"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("out"), py::arg("workspace"), py::arg("tickets"), py::arg("cu_q_lens"), py::arg("seq_lens"),
        py::arg("table"), py::arg("table_rows"), py::arg("table_start"), py::arg("sinks"), py::arg("qk_scale"),
        py::arg("softcap_log2"), py::arg("window"), py::arg("max_q_len"), py::arg("splits"), py::arg("capacity"),
        py::arg("pdl"), py::arg("prologue"), py::arg("release_early"), py::arg("resident") = false, py::arg("trace") = py::none());
}
