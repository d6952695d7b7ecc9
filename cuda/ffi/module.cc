// The Python extension: hands the FFI handlers to jax as capsules, and says which kernel
// instances this build compiled.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ffi/gemm_ffi.h"
#include "gemm/gemm.h"

namespace nb = nanobind;

NB_MODULE(_jax_hopper, m) {
  m.doc() = "jax_hopper XLA FFI handlers (Hopper sm_90a GEMM)";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_hopper_gemm"] = nb::capsule(reinterpret_cast<void*>(JaxHopperGemm));
    targets["jax_hopper_gemm_fused"] = nb::capsule(reinterpret_cast<void*>(JaxHopperGemmFused));
    targets["jax_hopper_gemm_fused_grad"] = nb::capsule(reinterpret_cast<void*>(JaxHopperGemmFusedGrad));
    targets["jax_hopper_gemm_fused_derivative"] =
        nb::capsule(reinterpret_cast<void*>(JaxHopperGemmFusedDerivative));
    targets["jax_hopper_ragged_dot"] = nb::capsule(reinterpret_cast<void*>(JaxHopperRaggedDot));
    return targets;
  });
  m.def(
      "workspace_bytes",
      [](int kind, const std::string& dtype, const std::string& major_a, const std::string& major_b, int stages,
         int64_t batch, int64_t m, int64_t n, int64_t k, int sms) {
        jax_hopper::GemmArgs args;
        args.dtype = dtype == "bf16" ? jax_hopper::ElementType::kBF16 : jax_hopper::ElementType::kF16;
        args.major_a = major_a == "K" ? jax_hopper::Major::kK : jax_hopper::Major::kMN;
        args.major_b = major_b == "K" ? jax_hopper::Major::kK : jax_hopper::Major::kMN;
        args.batch = batch, args.m = m, args.n = n, args.k = k;
        const jax_hopper::KernelKindInfo* info = jax_hopper::kernel_kind_info(kind);
        if (info == nullptr) throw nb::value_error(("unknown kernel " + std::to_string(kind)).c_str());
        jax_hopper::KernelChoice choice;
        choice.kind = info->kind;
        choice.stages = stages;
        size_t bytes = 0;
        const jax_hopper::Status st = jax_hopper::workspace_bytes(args, choice, sms, &bytes);
        if (!st.ok()) throw nb::value_error(st.message.c_str());
        return bytes;
      },
      "The workspace bytes of a call of kernel kind `kind` (its id), dtype, majors of A and B "
      "('K' or 'MN'), stages and problem (batch, M, N, K) on a device of `sms` SMs.");
  m.def("ffi_handler_runs", &jax_hopper::ffi_handler_runs,
        "How many times this process ran one of the FFI handlers (a call captured into an XLA command buffer "
        "runs its handler when the graph is recorded, not when it is replayed).");
  m.def(
      "cuda_versions",
      []() {
        int driver = 0;
        if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
        return std::make_tuple(driver, static_cast<int>(CUDART_VERSION));
      },
      "(the CUDA version the installed driver supports, 0 without one; the CUDA runtime version this "
      "build links), each as 1000 major + 10 minor.");
  m.def(
      "compiled_instances",
      []() {
        using Row = std::tuple<std::string, std::string, std::string, std::string, int>;
        const auto major = [](jax_hopper::Major x) { return x == jax_hopper::Major::kK ? "K" : "MN"; };
        std::vector<Row> rows;
        for (const jax_hopper::KernelInstance& i : jax_hopper::compiled_instances())
          rows.emplace_back(jax_hopper::kernel_kind_info(i.kind).name,
                            i.dtype == jax_hopper::ElementType::kF16 ? "f16" : "bf16", major(i.major_a),
                            major(i.major_b), i.stages);
        return rows;
      },
      "The kernel instances this build compiled: (kind name, dtype, major of A, major of B, stages), with the "
      "names and values of jax_hopper/_kernels.py.");
}
