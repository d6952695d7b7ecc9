// XLA FFI handler for C = A * B on Hopper.
#pragma once
#include "xla/ffi/api/api.h"

// Operands: a, b (f16 or bf16, rank 2, or rank 3 with a leading batch dimension);
// result: c [(batch,) M, N] of the same type or f32.
// Attributes: transpose_a (A stored [K, M]), transpose_b (B stored [N, K]),
// kernel (0: the seed's V5, 1: persistent clustered), stages.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxHopperGemm);
