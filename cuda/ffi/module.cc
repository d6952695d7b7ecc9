// The Python extension: hands the FFI handlers to jax as capsules, and says which kernel
// instances this build compiled.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

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
    return targets;
  });
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
