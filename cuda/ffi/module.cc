// The Python extension: hands the FFI handlers to jax as capsules.
#include <nanobind/nanobind.h>

#include "ffi/gemm_ffi.h"

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
}
