// Host-side entry point of the GEMM library: plain C++, no device code, so the FFI
// handler (compiled by the host compiler) depends only on this header.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

// KernelKind, Activation and the JAX_HOPPER_KERNEL_KINDS table, generated at configure
// time from jax_hopper/_kernels.py (the one list of kinds, activations and instances).
#include "gemm/kernel_kinds.h"

namespace jax_hopper {

enum class ElementType { kF16, kBF16 };

// Which dimension of a stored operand is contiguous. A is M x K and B is K x N
// logically; jnp.dot's A [M, K] is K-major, its B [K, N] is MN-major.
enum class Major { kK, kMN };

// TMA needs 16-byte global strides: stored rows of 16-bit elements hold a multiple of
// this many (the Python side pads shorter rows: _primitive.TMA_ROW_MULTIPLE).
constexpr int64_t kTmaRowMultiple = 8;

struct GemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;  // row-major M x N, row length ldc, of type c_dtype
  int64_t batch = 1;  // independent products, each operand's matrices batch_stride_* apart
  int64_t m = 0, n = 0, k = 0;
  // K rows actually stored in an operand whose K is its outer (strided) dimension, when
  // fewer than k; 0 means k. Such an operand needs no K padding for TMA: the other,
  // K-major operand's rows are zero-padded to k, and TMA's out-of-bounds fill reads
  // zeros past this one's extent, so the sum is the same. Saves copying a large
  // weight [K, N] whose K is odd.
  int64_t k_stored_a = 0, k_stored_b = 0;
  int64_t k_of_a() const { return k_stored_a > 0 ? k_stored_a : k; }
  int64_t k_of_b() const { return k_stored_b > 0 ? k_stored_b : k; }
  // Stored row lengths in elements: A is [M][lda] when K-major, [K][lda] when M-major;
  // B is [N][ldb] when K-major, [K][ldb] when N-major. TMA needs them to be multiples
  // of 8 (16 bytes); the logical extent may be smaller (padded M/N columns are never
  // read; padded K columns of a K-major operand are, and must hold zeros).
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch_stride_a = 0, batch_stride_b = 0, batch_stride_c = 0;  // in elements
  ElementType dtype = ElementType::kF16;  // of A and B
  bool c_f32 = false;                     // C in f32 (straight from the accumulator), else in dtype
  Major major_a = Major::kK;
  Major major_b = Major::kMN;
  // Fused epilogue (KernelKind::kPersistentFused only): C = act(A*B + bias) + residual,
  // computed on the f32 accumulator, rounded once. bias is [N], residual [M][ld_residual],
  // both of the operands' type; either may be null.
  // With activation_grad (KernelKind::kPersistentFusedGrad only), the backward form
  // instead: C = (A*B) * act'(residual), the residual holding a forward layer's
  // pre-activation z and A*B the cotangent of act(z) (a backward pass's dh = dy W2^T
  // times gelu'(z1): cuBLASLt's DGELU epilogue). With Activation::kNone the residual
  // holds act'(z) itself (saved by the forward pass): C = (A*B) * residual. Needs a
  // residual, no bias, and C and residual that TMA can address (16-byte aligned, row
  // lengths a multiple of 8).
  // With derivative (KernelKind::kPersistentFusedDerivative only): C = act(A*B + bias)
  // and D = act'(A*B + bias), D in C's shape and layout, for a backward pass to multiply
  // by instead of recomputing act' from the pre-activation. Needs an activation, no
  // residual, and C and D that TMA can store (16-byte aligned, ldc a multiple of 8).
  const void* bias = nullptr;
  const void* residual = nullptr;
  int64_t ld_residual = 0;
  Activation activation = Activation::kNone;
  bool activation_grad = false;
  // With activation_grad, optionally: C's column sums (a bias gradient), computed in f32
  // before C is rounded, per 64-row block: f32 [ceil(M / kColumnSumRows)][N], to be
  // summed over its rows by the caller; 8-byte aligned.
  float* column_sums = nullptr;
  void* derivative = nullptr;
  bool fused() const {
    return bias != nullptr || residual != nullptr || activation != Activation::kNone || activation_grad ||
           derivative != nullptr;
  }
  // The call's workspace, a buffer that lives until the kernel has run (a result of
  // the custom call that XLA plans and nobody reads), 16-byte aligned, of at least
  // workspace_bytes() for the device it was planned for: the dynamic order's ticket
  // counter and the split kinds' partial sums. Nothing is allocated at run time.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Grouped kinds (ragged_dot; launch.cuh: launch_grouped): int32 [groups] group sizes
  // on the device, splitting A's rows (kGrouped: B has `groups` entries, C is [m, n])
  // or the contraction's k rows (kGroupedK: C has `groups` entries [m, n]).
  const void* group_sizes = nullptr;
  int64_t groups = 0;
  // kGrouped, batched: every group_period groups are one batch entry whose last group
  // is a gap (zeros); group g multiplies B's entry g % group_period (B has
  // group_period - 1 entries). 0: group g multiplies entry g.
  int64_t group_period = 0;
};

// The kernel kinds (KernelKind, generated; jax_hopper/_kernels.py says what each is for).
// kV5 is the seed (one tile per CTA, producer warp, epilogue stored from registers). The
// persistent kinds run one CTA per SM looping over tiles in 2-CTA clusters along M that
// share B through TMA multicast; the ablations differ by one technique each
// (config.cuh derives the details):
//  kPersistentBasic  register->global epilogue, one producer warp (288 threads)
//  kPersistentTma    + epilogue staged in shared memory and written by TMA stores
//                      that overlap the next tile's mainloop
//  kPersistentImmediate + a producer warpgroup handing registers to the consumers
//                      (setmaxnreg, 384 threads)
//  kPersistentStatic + the deferred store: a tile's output is staged and stored
//                      during the next tile's first K tiles, under its MMAs, in the
//                      registers setmaxnreg gave; tiles in a static grid stride
//  kPersistent       + the dynamic tile order: tiles handed out by a global ticket
//                      counter in the order clusters finish (cuBLASLt's order;
//                      scheduler/tile_tickets.cuh): the default
//  kPersistentWait0  kPersistentStatic with wait_group(0) instead of one wgmma group in flight
//  kPersistentFused  kPersistent with the fused epilogue (bias, activation, residual)
//  kPersistentFusedGrad kPersistent with the fused epilogue's backward form, C times
//                      act'(z) (GemmArgs::activation_grad)
//  kPersistentFusedDerivative kPersistent with the fused epilogue's forward form that also
//                      writes act'(z) (GemmArgs::derivative)
//  kPersistentStreamK kPersistent whose last, partial wave of tiles is split along K
//                      over all clusters (stream-K for the tail; experimental)
//  kPersistentF16Acc  opt-in, f16 only: the tutorial's final version -- 256x256 tiles,
//                      four consumer warpgroups, accumulation in f16 (faster, less
//                      accurate: README "f16 accumulation")
//  kSmallM            decode-sized M: 64x128 tiles (one consumer warpgroup), every
//                      tile's K range split into pieces, one CTA each (two per SM,
//                      one wave), summed in piece order (deterministic): in a cluster
//                      of the tile's pieces through distributed shared memory, or
//                      (more than 8 pieces, or short pieces a cluster would cut
//                      fewer) by the last piece through global memory
//  kPersistentPingpong experimental: 128x128 tiles, each consumer warpgroup owns whole
//                      tiles (the CTA's even and odd ones), so one warpgroup's epilogue
//                      runs under the other's MMAs; slower than kPersistent

// What the table says of one kind.
struct KernelKindInfo {
  KernelKind kind;
  const char* name;    // the name Python uses
  int stages;          // the default ring depth
  const char* target;  // the FFI target that launches it
};
// The kind whose KernelKind value is `id` (the FFI's `kernel` attribute), or null.
const KernelKindInfo* kernel_kind_info(int32_t id);
inline const KernelKindInfo& kernel_kind_info(KernelKind kind) { return *kernel_kind_info(static_cast<int32_t>(kind)); }

// One compiled kernel instance.
struct KernelInstance {
  KernelKind kind;
  ElementType dtype;
  Major major_a, major_b;
  int stages;
};
// What this build compiled (CMake option JAX_HOPPER_EXPERIMENTAL_KERNELS adds the
// ablation and experimental instances to the default ones).
std::vector<KernelInstance> compiled_instances();

// Compile-time kernel parameters that are selectable at run time (each choice is an
// instance listed in jax_hopper/_kernels.py).
struct KernelChoice {
  KernelKind kind = KernelKind::kPersistent;
  int stages = 4;
};
// Rows of C summed into one row of GemmArgs::column_sums (one consumer warpgroup's).
constexpr int64_t kColumnSumRows = 64;

struct Status {
  enum Code { kOk, kInvalidArgument, kInternal } code = kOk;
  std::string message;
  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {kInvalidArgument, std::move(m)}; }
  static Status Internal(std::string m) { return {kInternal, std::move(m)}; }
  bool ok() const { return code == kOk; }
};

// The FFI's `kernel` attribute (a KernelKind value) as the kind that `target` launches;
// unknown values and kinds of another target are refused.
Status kernel_kind_for_target(int32_t id, const std::string& target, KernelKind* kind);
// The FFI's `activation` attribute (an Activation value).
Status activation_of(int32_t id, Activation* activation);

// The bytes of GemmArgs::workspace a call of this kind and shape needs on a device of
// `sms` SMs (the shape's fields of `args` only). On another device the launch fits its
// split into what it is given: a split K cuts fewer pieces; stream-K's tail (an
// experimental kind) is an error if it does not fit.
Status workspace_bytes(const GemmArgs& args, const KernelChoice& choice, int sms, size_t* bytes);

// Enqueues C = A * B on `stream`. Validates the arguments, handles empty problems
// (K == 0 writes zeros) and reports any CUDA error; never synchronises.
Status gemm(const GemmArgs& args, const KernelChoice& choice, cudaStream_t stream);

}  // namespace jax_hopper
